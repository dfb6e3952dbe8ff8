//! The embedded store against the queue contract, including reopening the
//! file (a restart) and two handles on one file (two processes).

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::request::LastAnswer;
use crate::result::ErrorCode;

const LEASE: Duration = Duration::from_secs(30);
const NO_WAIT: Duration = Duration::ZERO;

fn temp_db(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "sluicegate-embedded-{name}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("queue.db")
}

fn push(q: &EmbeddedQueue, body: &'static str, deadline: i64) {
    q.enqueue_with_deadlines(&[(Bytes::from_static(body.as_bytes()), deadline)], &[])
        .expect("enqueue");
}

fn ok(id: &str) -> ResultRecord {
    ResultRecord::http(id, None, 200, "{}".into(), 1)
}

fn done(tag: &DeliveryTag, id: &str) -> Completion {
    Completion {
        tag: tag.clone(),
        result: ok(id),
    }
}

#[tokio::test]
async fn delivers_earliest_deadline_first_then_fifo() {
    let q = EmbeddedQueue::open(temp_db("edf"), "q").expect("open");
    push(&q, "late", 300);
    push(&q, "early-a", 100);
    push(&q, "early-b", 100);
    let got = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
    let bodies: Vec<&[u8]> = got.iter().map(|d| d.body.as_ref()).collect();
    assert_eq!(bodies, vec![&b"early-a"[..], b"early-b", b"late"]);
}

#[tokio::test]
async fn expired_lease_is_redelivered_and_stale_ack_is_refused() {
    let q = EmbeddedQueue::open(temp_db("lease"), "q").expect("open");
    push(&q, "m", 1);
    let short = Duration::from_millis(50);
    let first = q.receive(1, short, NO_WAIT).await.expect("ok");
    assert_eq!(first.len(), 1);
    assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
    tokio::time::sleep(Duration::from_millis(80)).await;
    let second = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(second.len(), 1);
    assert_ne!(first[0].tag, second[0].tag);
    // The first holder may have sent it: the reclaim counts an attempt
    // (issue 22), a hand-back does not.
    assert_eq!((first[0].retry_count, second[0].retry_count), (0, 1));
    let stale = q.ack(vec![done(&first[0].tag, "m")]).await.expect("ok");
    assert_eq!(stale.lease_lost, 1);
    assert_eq!(q.result_count().expect("count"), 0);
    let fresh = q.ack(vec![done(&second[0].tag, "m")]).await.expect("ok");
    assert_eq!(fresh.acked, 1);
    assert_eq!(q.result_count().expect("count"), 1);
    assert_eq!(q.unsettled_count().expect("count"), 0);
}

#[tokio::test]
async fn extended_lease_is_not_redelivered() {
    let q = EmbeddedQueue::open(temp_db("extend"), "q").expect("open");
    push(&q, "m", 1);
    let short = Duration::from_millis(60);
    let d = q.receive(1, short, NO_WAIT).await.expect("ok");
    q.extend_lease(vec![d[0].tag.clone()], LEASE)
        .await
        .expect("ok");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
}

#[tokio::test]
async fn second_result_for_same_submission_is_dropped() {
    let q = EmbeddedQueue::open(temp_db("dup"), "q").expect("open");
    push(&q, "a", 1);
    push(&q, "a-again", 1);
    let got = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
    let report = q
        .ack(vec![done(&got[0].tag, "a"), done(&got[1].tag, "a")])
        .await
        .expect("ok");
    assert_eq!((report.acked, report.duplicates), (1, 1));
    assert_eq!(q.results().expect("results").len(), 1);
    assert_eq!(q.unsettled_count().expect("count"), 0);
}

#[tokio::test]
async fn only_failed_nacks_count_as_attempts_and_order_is_kept() {
    let q = EmbeddedQueue::open(temp_db("nack"), "q").expect("open");
    push(&q, "first", 10);
    push(&q, "second", 20);
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    q.nack(d[0].tag.clone(), Duration::ZERO, NackReason::Congested)
        .await
        .expect("ok");
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(d[0].body.as_ref(), b"first");
    assert_eq!(d[0].retry_count, 0);
    q.nack(d[0].tag.clone(), Duration::ZERO, NackReason::Failed)
        .await
        .expect("ok");
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(d[0].body.as_ref(), b"first");
    assert_eq!(d[0].retry_count, 1);
    q.nack(
        d[0].tag.clone(),
        Duration::from_secs(60),
        NackReason::Failed,
    )
    .await
    .expect("ok");
    let d = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(d.len(), 1, "a delayed message stays invisible");
    assert_eq!(d[0].body.as_ref(), b"second");
}

#[tokio::test]
async fn dead_letter_moves_the_message_out_with_its_error() {
    let q = EmbeddedQueue::open(temp_db("dead"), "q").expect("open");
    push(&q, "m", 1);
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    let last = ResultRecord::error("m", None, ErrorCode::InferenceError, "boom");
    q.dead_letter(d[0].tag.clone(), last).await.expect("ok");
    let dead = q.dead_letters().expect("dead");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].body.as_ref(), b"m");
    assert_eq!(
        dead[0].last_error.error_code,
        Some(ErrorCode::InferenceError)
    );
    assert_eq!(q.unsettled_count().expect("count"), 0);
    assert_eq!(q.backlog().await.expect("ok"), Some(0));
}

#[tokio::test]
async fn messages_and_results_survive_reopening_the_file() {
    let path = temp_db("reopen");
    {
        let q = EmbeddedQueue::open(&path, "q").expect("open");
        push(&q, "a", 1);
        push(&q, "b", 2);
        let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        q.ack(vec![done(&d[0].tag, "a")]).await.expect("ok");
        // "b" is leased when the process "dies".
        let _ = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    }
    let q = EmbeddedQueue::open(&path, "q").expect("reopen");
    assert_eq!(q.results().expect("results")[0].id, "a");
    assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
    assert_eq!(q.release_all_leases().expect("release"), 1);
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(d[0].body.as_ref(), b"b");
}

#[tokio::test]
async fn two_handles_on_one_file_never_hold_the_same_message() {
    let path = temp_db("two");
    let a = EmbeddedQueue::open(&path, "q").expect("open a");
    let b = EmbeddedQueue::open(&path, "q").expect("open b");
    for _ in 0..50 {
        push(&a, "m", 1);
    }
    let (da, db) = tokio::join!(a.receive(30, LEASE, NO_WAIT), b.receive(30, LEASE, NO_WAIT));
    let (da, db) = (da.expect("a"), db.expect("b"));
    assert_eq!(da.len() + db.len(), 50);
    // The tag fences the row, whichever handle presents it; once settled,
    // the same tag is refused.
    let wrong = a.ack(vec![done(&db[0].tag, "x")]).await.expect("ok");
    assert_eq!(
        wrong.acked, 1,
        "a tag is a fence on the row, valid from any handle"
    );
    let stale = b.ack(vec![done(&db[0].tag, "x")]).await.expect("ok");
    assert_eq!(stale.lease_lost, 1);
}

#[tokio::test]
async fn queues_in_one_file_are_separate() {
    let path = temp_db("separate");
    let a = EmbeddedQueue::open(&path, "a").expect("open a");
    let b = EmbeddedQueue::open(&path, "b").expect("open b");
    push(&a, "for-a", 1);
    assert!(b.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
    assert_eq!(a.receive(1, LEASE, NO_WAIT).await.expect("ok").len(), 1);
}

#[test]
fn owner_lock_refuses_a_second_owner_until_released() {
    let path = temp_db("owner");
    let first = OwnerLock::acquire(&path).expect("first owner");
    let second = OwnerLock::acquire(&path);
    assert!(
        matches!(second, Err(EmbeddedError::Locked { .. })),
        "{second:?}"
    );
    drop(first);
    OwnerLock::acquire(&path).expect("free again");
}

#[test]
fn refuses_a_file_of_another_schema_version() {
    let path = temp_db("schema");
    drop(EmbeddedQueue::open(&path, "q").expect("open"));
    let conn = Connection::open(&path).expect("raw");
    conn.execute(
        "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
        [],
    )
    .expect("update");
    drop(conn);
    let err = EmbeddedQueue::open(&path, "q").expect_err("refused");
    assert!(err.to_string().contains("schema version 99"), "{err}");
}

fn tenant_body(id: &str, tenant: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"id":"{id}","deadline":1,"metadata":{{"userid":"{tenant}"}},"payload":{{}}}}"#
    ))
}

fn lanes(weights: &[(&str, u32)]) -> Option<TenantLanes> {
    Some(TenantLanes {
        attribute: "userid".into(),
        weights: weights.iter().map(|(t, w)| ((*t).to_owned(), *w)).collect(),
    })
}

fn tenants_of(got: &[Delivery]) -> Vec<String> {
    got.iter()
        .map(|d| lanes::tenant_of(&d.body, "userid"))
        .collect()
}

#[tokio::test]
async fn with_lanes_a_claim_takes_every_tenants_head_by_weight() {
    let path = temp_db("lanes");
    let plain = EmbeddedQueue::open(&path, "q").expect("open");
    let mut items: Vec<(Bytes, i64)> = (0..200)
        .map(|i| (tenant_body(&format!("big-{i}"), "big"), 100 + i))
        .collect();
    items.extend((0..10).map(|i| (tenant_body(&format!("small-{i}"), "small"), 10_000 + i)));
    plain.enqueue_with_deadlines(&items, &[]).expect("enqueue");
    // Without lanes the head is all `big`.
    let head = plain
        .receive(10, Duration::from_millis(1), NO_WAIT)
        .await
        .expect("ok");
    assert!(tenants_of(&head).iter().all(|t| t == "big"));
    tokio::time::sleep(Duration::from_millis(5)).await;
    let fair = EmbeddedQueue::open_with_lanes(&path, "q", lanes(&[])).expect("open");
    let got = fair.receive(10, LEASE, NO_WAIT).await.expect("ok");
    let small = tenants_of(&got).iter().filter(|t| *t == "small").count();
    assert_eq!((got.len(), small), (10, 5), "{:?}", tenants_of(&got));
    // Within a lane, earliest deadline first.
    let first_small = got
        .iter()
        .find(|d| lanes::tenant_of(&d.body, "userid") == "small")
        .expect("small");
    assert!(
        std::str::from_utf8(&first_small.body)
            .expect("utf-8")
            .contains("small-0")
    );
    // Weights: 3 of `big` per 1 of `small` (5 small left).
    let weighted = EmbeddedQueue::open_with_lanes(&path, "q", lanes(&[("big", 3)])).expect("open");
    let got = weighted.receive(8, LEASE, NO_WAIT).await.expect("ok");
    let small = tenants_of(&got).iter().filter(|t| *t == "small").count();
    assert_eq!((got.len(), small), (8, 2), "{:?}", tenants_of(&got));
}

#[tokio::test]
async fn a_lane_whose_messages_are_all_gone_leaves_and_nothing_is_lost() {
    let q = EmbeddedQueue::open_with_lanes(temp_db("lanes-gone"), "q", lanes(&[])).expect("open");
    q.enqueue_with_deadlines(
        &[(tenant_body("a", "t"), 1), (Bytes::from_static(b"junk"), 2)],
        &[],
    )
    .expect("enqueue");
    let got = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(got.len(), 2, "a body without a tenant is in lane \"\"");
    let report = q
        .ack(
            got.iter()
                .enumerate()
                .map(|(i, d)| done(&d.tag, &format!("r{i}")))
                .collect(),
        )
        .await
        .expect("ack");
    assert_eq!(report.acked, 2);
    assert!(q.receive(10, LEASE, NO_WAIT).await.expect("ok").is_empty());
    let lanes_left: i64 = q
        .inner
        .read(|c, _| c.query_row("SELECT COUNT(*) FROM lanes", [], |r| r.get(0)))
        .expect("count");
    assert_eq!(lanes_left, 0);
}

#[tokio::test]
async fn a_version_1_file_gains_the_tenant_column_and_keeps_its_messages() {
    let path = temp_db("v1");
    {
        let c = rusqlite::Connection::open(&path).expect("sqlite");
        c.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO meta VALUES ('schema_version', '1');
             CREATE TABLE messages (
                 seq INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL,
                 deadline INTEGER NOT NULL, body BLOB NOT NULL,
                 retry_count INTEGER NOT NULL DEFAULT 0, visible_at_ms INTEGER NOT NULL,
                 lease_tag TEXT, lease_expires_ms INTEGER);
             INSERT INTO messages (queue, deadline, body, visible_at_ms)
                 VALUES ('q', 1, CAST('{\"id\":\"old\",\"metadata\":{\"userid\":\"t\"}}' AS BLOB), 0);",
        )
        .expect("a version 1 store");
    }
    let q = EmbeddedQueue::open_with_lanes(&path, "q", lanes(&[])).expect("migrates");
    let got = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(tenants_of(&got), ["t"]);
    let version = q.meta("schema_version").expect("meta");
    assert_eq!(version.as_deref(), Some("2"));
    // Opening it again (another process) is a no-op.
    EmbeddedQueue::open(&path, "q").expect("reopens");
}

#[tokio::test]
async fn expired_receive_takes_only_passed_deadlines_delayed_or_not() {
    let q = EmbeddedQueue::open(temp_db("expired"), "q").expect("open");
    push(&q, "expired-delayed", 100);
    push(&q, "expired-leased", 150);
    push(&q, "expired-visible", 190);
    push(&q, "due-later", 300);
    let first = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
    // Back with a long delay: still due for its deadline answer.
    q.nack(
        first[0].tag.clone(),
        Duration::from_secs(3600),
        NackReason::Congested,
    )
    .await
    .expect("ok");
    let got = q.receive_expired(10, LEASE, 200).await.expect("ok");
    let bodies: Vec<&[u8]> = got.iter().map(|d| d.body.as_ref()).collect();
    assert_eq!(bodies, vec![&b"expired-delayed"[..], b"expired-visible"]);
    assert!(
        q.receive_expired(10, LEASE, 200)
            .await
            .expect("ok")
            .is_empty()
    );
    let rest = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
    let bodies: Vec<&[u8]> = rest.iter().map(|d| d.body.as_ref()).collect();
    assert_eq!(bodies, vec![&b"due-later"[..]], "the unexpired one stays");
}

#[tokio::test]
async fn a_requeue_after_an_attempt_keeps_its_count_and_last_answer() {
    let q = EmbeddedQueue::open(temp_db("record"), "q").expect("open");
    let body = r#"{"id":"a","deadline":100,"payload":{"prompt":"p"}}"#;
    push(&q, body, 100);
    let first = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    let record = AttemptRecord {
        attempts: 2,
        last_answer: Some(LastAnswer {
            status_code: 429,
            body: "busy".into(),
        }),
    };
    q.requeue_after_attempt(
        first[0].tag.clone(),
        Duration::ZERO,
        NackReason::Congested,
        record,
    )
    .await
    .expect("ok");
    let again = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(again[0].retry_count, 0, "congestion is no failure");
    let message = parse_message(&again[0].body).expect("still a message");
    assert_eq!(message.previous_attempts(again[0].retry_count), 2);
    assert_eq!(message.last_answer().map(|a| a.status_code), Some(429));
    assert_eq!(message.request.payload.get(), r#"{"prompt":"p"}"#);
    // A failed attempt counts, and a later record without an answer keeps
    // the earlier one.
    q.requeue_after_attempt(
        again[0].tag.clone(),
        Duration::ZERO,
        NackReason::Failed,
        AttemptRecord {
            attempts: 3,
            last_answer: None,
        },
    )
    .await
    .expect("ok");
    let third = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(third[0].retry_count, 1);
    let message = parse_message(&third[0].body).expect("still a message");
    assert_eq!(message.previous_attempts(third[0].retry_count), 3);
    assert_eq!(message.last_answer().map(|a| a.body.as_str()), Some("busy"));
}

#[tokio::test]
async fn due_counts_the_waiting_messages_by_time_to_deadline_and_not_the_leased() {
    let q = EmbeddedQueue::open(temp_db("due"), "q").expect("open");
    let now = crate::clock::unix_secs();
    assert_eq!(
        q.due().await.expect("ok"),
        Some(crate::queue::due::DueProfile::default()),
        "nothing waits"
    );
    push(&q, "overdue", now - 10);
    push(&q, "soon", now + 200);
    push(&q, "later", now + 5_000);
    push(&q, "tomorrow", now + 100_000);
    let profile = q.due().await.expect("ok").expect("profile");
    assert_eq!(profile.within, [1, 2, 2, 2, 3, 3]);
    assert_eq!(profile.earliest, Some(now - 10));
    // A leased message is not waiting: the earliest goes with it.
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(d[0].body.as_ref(), b"overdue");
    let profile = q.due().await.expect("ok").expect("profile");
    assert_eq!(profile.within, [0, 1, 1, 1, 2, 2]);
    assert_eq!(profile.earliest, Some(now + 200));
    assert_eq!(q.backlog().await.expect("ok"), Some(3));
    // A lapsed lease is waiting again, in the backlog and the profile.
    let d = q
        .receive(1, Duration::from_millis(1500), NO_WAIT)
        .await
        .expect("ok");
    assert_eq!(d[0].body.as_ref(), b"soon");
    assert_eq!(q.backlog().await.expect("ok"), Some(2), "soon is leased");
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert_eq!(q.backlog().await.expect("ok"), Some(3), "its lease lapsed");
    let profile = q.due().await.expect("ok").expect("profile");
    assert_eq!(profile.within, [0, 1, 1, 1, 2, 2]);
    assert_eq!(profile.earliest, Some(now + 200));
    assert_eq!(q.leased_count().expect("ok"), 1, "overdue is still leased");
}

/// Flex requests past `serve.flex_max_wait` are withdrawn only while
/// they wait: one a dispatcher leased is left alone and unmarked (its
/// answer still comes), and `leased_ids` tells the two apart.
#[tokio::test]
async fn withdraw_takes_only_waiting_messages_and_leased_ids_sees_the_taken() {
    let q = EmbeddedQueue::open(temp_db("withdraw"), "q").expect("open");
    let now = crate::clock::unix_secs();
    let body = |id: &str, deadline: i64| {
        Bytes::from(format!(
            r#"{{"id":"{id}","deadline":{deadline},"payload":{{}}}}"#
        ))
    };
    q.enqueue_with_deadlines(
        &[
            (body("taken", now), now),
            (body("waiting", now + 60), now + 60),
        ],
        &[],
    )
    .expect("enqueue");
    let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
    assert_eq!(
        parse_message(&d[0].body).expect("valid").request.id,
        "taken"
    );
    let ids = [
        "taken".to_owned(),
        "waiting".to_owned(),
        "unknown".to_owned(),
    ];
    assert_eq!(q.leased_ids(&ids).expect("ok"), [true, false, false]);
    assert_eq!(q.withdraw_ids(&ids).expect("ok"), [false, true, false]);
    // The withdrawn one is answered CANCELLED once and gone from the queue.
    let results = q.results_after(0, 10).expect("results");
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].1.id, "waiting");
    assert_eq!(results[0].1.error_code, Some(ErrorCode::Cancelled));
    assert_eq!(q.pending_ids().expect("ok"), ["taken".to_owned()]);
    // The taken one carries no cancel mark: it is sent and answered.
    assert!(!q.cancelled(&d[0].tag).await);
    assert_eq!(q.withdraw_ids(&ids).expect("ok"), [false, false, false]);
}
