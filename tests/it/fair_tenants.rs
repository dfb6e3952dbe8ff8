//! Fair tenants on one Redis queue (real `redis-server`, a recording
//! gateway; the deep backlog, plain and weighted, also on the embedded
//! store, and plain on the in-memory queue): a tenant over quota at the head of the queue does not delay
//! another tenant's messages (measured at the gateway), under a window of
//! one request the tenants share it by their weights, and with tenant
//! lanes a small tenant behind a deep backlog is served from the start, by
//! weight.

use crate::support;

use std::time::{Duration, Instant};

use crate::support::redis::RedisServer;
use crate::support::redis::{redis_config, submit, submit_in_lanes};
use crate::support::tenants::{Arrival, recording_gateway, seen, tenant_line};
use sluicegate::clock::unix_secs;
use sluicegate::config::Config;

async fn start(server: &RedisServer, gateway: &str, dispatch: &str, queue: &str) -> support::App {
    let toml = support::redis::fast_app_toml(gateway, dispatch, queue);
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis_config(server));
    support::start_app(&config).await
}

/// `head.2` lines of tenant `head.1` (ids `head.0-<i>`, deadlines from
/// `base`), then `behind.2` of tenant `behind.1` with later deadlines.
fn backlog(head: (&str, &str, usize), behind: (&str, &str, usize), base: i64) -> Vec<String> {
    let mut lines = Vec::with_capacity(head.2 + behind.2);
    for ((prefix, tenant, n), from) in [(head, base), (behind, base + 10_000)] {
        lines
            .extend((0..n).map(|i| tenant_line(&format!("{prefix}-{i}"), tenant, from + i as i64)));
    }
    lines
}

fn count(arrivals: &[Arrival], tenant: &str) -> usize {
    arrivals.iter().filter(|a| a.tenant == tenant).count()
}

/// Tenant `hog` has 300 messages at the head of the queue (earlier
/// deadlines) and a quota of 20 per minute; tenant `small` has 20 behind
/// them. Every refused `hog` message waits out the requeue delay (5 s);
/// `small`'s messages must not wait for `hog`: the last of them reaches
/// the gateway well within one requeue delay of the start.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_over_quota_at_the_head_does_not_delay_the_others() {
    const HOG: usize = 300;
    const SMALL: usize = 20;
    const QUOTA: usize = 20;
    let requeue = Duration::from_secs(5);
    let server = RedisServer::start();
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines = backlog(("hog", "hog", HOG), ("small", "small", SMALL), base);
    submit(&server, "fairq", &lines).await;
    let started = Instant::now();
    let app = start(
        &server,
        &gateway.uri(),
        &format!("wait_requeue_delay = \"{}s\"", requeue.as_secs()),
        &format!(
            r#"queue_name = "fairq"
max_sys = 8
gate_type = "redis-quota"
gate_params = {{ address = "127.0.0.1:{}", limit = {QUOTA}, window = "1m" }}"#,
            server.port
        ),
    )
    .await;
    support::wait_until(Duration::from_secs(60), "every small message sent", || {
        count(&seen(&arrivals), "small") == SMALL
    })
    .await;
    let all = seen(&arrivals);
    let last_small = all
        .iter()
        .filter(|a| a.tenant == "small")
        .map(|a| a.at.duration_since(started))
        .max()
        .expect("small arrived");
    let first_small = all
        .iter()
        .filter(|a| a.tenant == "small")
        .map(|a| a.at.duration_since(started))
        .min()
        .expect("small arrived");
    eprintln!(
        "fair tenants: {SMALL} messages of `small` behind {HOG} of `hog` (over quota, requeue delay {:?}): first at {:.3} s, last at {:.3} s after start; hog sent {}",
        requeue,
        first_small.as_secs_f64(),
        last_small.as_secs_f64(),
        count(&all, "hog")
    );
    // The quota held for hog, and small did not wait for hog's refusals.
    // (Hog may not have used its whole quota yet when small's last one
    // goes: with every lane filed from the start, small can finish first,
    // 19 of 20 in a full run.)
    let hog = count(&all, "hog");
    assert!(hog <= QUOTA, "hog sent {hog}, over its quota of {QUOTA}");
    assert!(
        last_small < requeue / 2,
        "small waited {last_small:?}, hog's requeue delay is {requeue:?}"
    );
    app.stop().await;
}

/// Two backlogged tenants with interleaved deadlines and weights 3 : 1,
/// one request in flight at a time: the first 60 dispatches split about
/// 45 : 15 (DRR serves 3 of `gold` per 1 of `bronze` while both have
/// messages in the lookahead).
#[tokio::test(flavor = "multi_thread")]
async fn the_window_is_shared_by_weight() {
    const EACH: usize = 100;
    const FIRST: usize = 60;
    let server = RedisServer::start();
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let mut lines = Vec::new();
    for i in 0..EACH {
        lines.push(tenant_line(&format!("g-{i}"), "gold", base + 2 * i as i64));
        lines.push(tenant_line(
            &format!("b-{i}"),
            "bronze",
            base + 2 * i as i64 + 1,
        ));
    }
    submit(&server, "shareq", &lines).await;
    let app = start(
        &server,
        &gateway.uri(),
        "tenant_weights = { gold = 3 }\ntenant_lookahead = 64",
        r#"queue_name = "shareq"
max_sys = 1
gate_type = "constant""#,
    )
    .await;
    support::wait_until(Duration::from_secs(60), "first dispatches", || {
        seen(&arrivals).len() >= FIRST
    })
    .await;
    let first: Vec<Arrival> = seen(&arrivals).into_iter().take(FIRST).collect();
    let gold = count(&first, "gold");
    let bronze = count(&first, "bronze");
    eprintln!(
        "weighted shares: first {FIRST} dispatches gold {gold}, bronze {bronze} (weights 3 : 1)"
    );
    assert_eq!(gold + bronze, FIRST);
    // 45 : 15 exactly when the first pull holds both tenants; one pull
    // landing differently moves it by a few.
    assert!((40..=50).contains(&gold), "gold {gold}, bronze {bronze}");
    support::wait_until(Duration::from_secs(60), "everything sent", || {
        seen(&arrivals).len() >= 2 * EACH
    })
    .await;
    let all = seen(&arrivals);
    assert_eq!(count(&all, "gold"), EACH);
    assert_eq!(count(&all, "bronze"), EACH);
    app.stop().await;
}

/// Position (1-based, in gateway arrival order) of `tenant`'s last request.
fn last_position(arrivals: &[Arrival], tenant: &str) -> usize {
    arrivals
        .iter()
        .rposition(|a| a.tenant == tenant)
        .map_or(0, |i| i + 1)
}

/// What the recording gateway saw, in order.
type Arrivals = std::sync::Arc<std::sync::Mutex<Vec<Arrival>>>;

/// Waits until all `small` of tenant `small` were sent, then checks that
/// the last went out within the first 120 dispatches (about 100 if the 50
/// interleave 1 : 1 with the backlog through a window of 8); returns the
/// arrivals and that dispatch's position.
async fn small_served_early(
    arrivals: &Arrivals,
    small: usize,
    what: &str,
) -> (Vec<Arrival>, usize) {
    support::wait_until(Duration::from_secs(60), "every small message sent", || {
        count(&seen(arrivals), "small") == small
    })
    .await;
    let all = seen(arrivals);
    let position = last_position(&all, "small");
    eprintln!("{what}: last `small` request is dispatch {position}");
    assert!(
        position <= 120,
        "`small`'s last request was dispatch {position}"
    );
    (all, position)
}

/// Waits for the first `first` dispatches and checks that tenant `gold`
/// (weight 3 against 1) has 3 / 4 of them within 10 %.
async fn weighted_first_shares(arrivals: &Arrivals, first: usize, what: &str) {
    support::wait_until(Duration::from_secs(60), "first dispatches", || {
        seen(arrivals).len() >= first
    })
    .await;
    let head: Vec<Arrival> = seen(arrivals).into_iter().take(first).collect();
    let gold = count(&head, "gold");
    eprintln!(
        "{what}: first {first} dispatches gold {gold}, bronze {} (weights 3 : 1)",
        first - gold
    );
    let (low, high) = (first * 27 / 40, first * 33 / 40);
    assert!((low..=high).contains(&gold), "gold {gold} of {first}");
}

/// Issue 22: tenant `big` has 2 000 messages at the head of the queue and
/// tenant `small` 50 behind them, a window of 8. Filed in tenant lanes (our
/// producer), `small`'s 50 are interleaved with `big`'s from the start:
/// its last request reaches the gateway within the first 120 dispatches
/// (1.2 × the 100 of a 1 : 1 interleave). Without lanes (as an upstream
/// producer writes) the default lookahead of 64 sees only the head, and
/// `small`'s last request is dispatch 2 050 of 2 050.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_tenant_behind_a_deep_backlog_is_served_from_the_start() {
    const BIG: usize = 2000;
    const SMALL: usize = 50;
    let server = RedisServer::start();
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines = backlog(("big", "big", BIG), ("small", "small", SMALL), base);
    submit_in_lanes(&server, "deepq", &lines).await;
    let started = Instant::now();
    let app = start(
        &server,
        &gateway.uri(),
        "",
        r#"queue_name = "deepq"
max_sys = 8
gate_type = "constant""#,
    )
    .await;
    let what = format!("deep backlog: {SMALL} of `small` behind {BIG} of `big`, window 8");
    let (all, position) = small_served_early(&arrivals, SMALL, &what).await;
    let last_at = all[position - 1].at.duration_since(started);
    let hundredth_at = all[99.min(all.len() - 1)].at.duration_since(started);
    eprintln!(
        "deep backlog: last `small` request at {:.3} s; dispatch 100 at {:.3} s",
        last_at.as_secs_f64(),
        hundredth_at.as_secs_f64()
    );
    app.stop().await;
}

/// Enqueues `lines` into the embedded store at `db` (queue `queue`) and
/// starts a dispatcher on it, window 8, with `dispatch` added to
/// `[dispatch]`. The store is filed into lanes by its own claims (no
/// producer flag).
async fn start_embedded(
    db: &std::path::Path,
    queue: &str,
    lines: Vec<String>,
    gateway: &str,
    dispatch: &str,
) -> support::App {
    use bytes::Bytes;
    use sluicegate::queue::embedded::EmbeddedQueue;
    let bodies: Vec<Bytes> = lines.into_iter().map(Bytes::from).collect();
    EmbeddedQueue::open(db, queue)
        .expect("store")
        .enqueue(&bodies, &[])
        .expect("enqueued");
    let toml = format!(
        r#"
transport = "embedded"
[embedded]
path = "{}"
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
{dispatch}
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "{queue}"
max_sys = 8
gate_type = "constant"
"#,
        db.display(),
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    support::start_app(&config).await
}

/// The deep backlog of the test above on the embedded store: its claims
/// file every message into its tenant's lane themselves (no producer
/// flag), and `small`'s 50 go out within the first 120 dispatches.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_tenant_behind_a_deep_backlog_on_the_embedded_store_is_served_from_the_start() {
    const BIG: usize = 2000;
    const SMALL: usize = 50;
    let tmp = support::TempDir::new("deep-embedded");
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines = backlog(("big", "big", BIG), ("small", "small", SMALL), base);
    let app = start_embedded(&tmp.0.join("store.db"), "deepe", lines, &gateway.uri(), "").await;
    let what =
        format!("deep backlog, embedded: {SMALL} of `small` behind {BIG} of `big`, window 8");
    small_served_early(&arrivals, SMALL, &what).await;
    app.stop().await;
}

/// The deep backlog on the in-memory transport, loaded as `run --input`
/// loads a file (before the dispatcher starts): the queue files each
/// message into its tenant's lane itself, and `small`'s 50 go out within
/// the first 120 dispatches (without lanes: dispatch 2 049 of 2 050).
#[tokio::test(flavor = "multi_thread")]
async fn a_small_tenant_behind_a_deep_backlog_in_memory_is_served_from_the_start() {
    const BIG: usize = 2000;
    const SMALL: usize = 50;
    let tmp = support::TempDir::new("deep-memory");
    let input = tmp.0.join("backlog.jsonl");
    let base = unix_secs() + 3600;
    let lines = backlog(("big", "big", BIG), ("small", "small", SMALL), base);
    std::fs::write(&input, lines.join("\n")).expect("write the backlog");
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "deepm"
max_sys = 8
gate_type = "constant"
"#,
        gateway.uri()
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = sluicegate::app::start(
        &config,
        sluicegate::app::RunOptions {
            input: Some(input),
            ..Default::default()
        },
        shutdown.clone().cancelled_owned(),
    )
    .await
    .expect("the application starts");
    let app = support::App { running, shutdown };
    let queue = app.running.transports().memory()[0].clone();
    let what = format!("deep backlog, memory: {SMALL} of `small` behind {BIG} of `big`, window 8");
    small_served_early(&arrivals, SMALL, &what).await;
    support::wait_until(Duration::from_secs(60), "every message answered", || {
        queue.result_count() == BIG + SMALL
    })
    .await;
    app.stop().await;
}

/// Issue 22: `gold` (weight 3) has 1 000 messages at the head, `bronze`
/// (weight 1) 1 000 behind them, a window of 8, tenant lanes: the first
/// 400 dispatches split 3 : 1 within 10 % (gold 270–330). Without lanes
/// all 400 are gold.
#[tokio::test(flavor = "multi_thread")]
async fn weights_hold_behind_a_deep_backlog() {
    const EACH: usize = 1000;
    const FIRST: usize = 400;
    let server = RedisServer::start();
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines = backlog(("g", "gold", EACH), ("b", "bronze", EACH), base);
    submit_in_lanes(&server, "deepw", &lines).await;
    let app = start(
        &server,
        &gateway.uri(),
        "tenant_weights = { gold = 3 }",
        r#"queue_name = "deepw"
max_sys = 8
gate_type = "constant""#,
    )
    .await;
    weighted_first_shares(&arrivals, FIRST, "deep weighted shares").await;
    app.stop().await;
}

/// The weighted deep backlog of the test above on the embedded store:
/// `gold` (weight 3) 1 000 at the head, `bronze` (weight 1) 1 000 behind,
/// window 8; the first 400 dispatches split 3 : 1 within 10 %.
#[tokio::test(flavor = "multi_thread")]
async fn weights_hold_behind_a_deep_backlog_on_the_embedded_store() {
    const EACH: usize = 1000;
    const FIRST: usize = 400;
    let tmp = support::TempDir::new("deep-weights-embedded");
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines = backlog(("g", "gold", EACH), ("b", "bronze", EACH), base);
    let app = start_embedded(
        &tmp.0.join("store.db"),
        "deepwe",
        lines,
        &gateway.uri(),
        "tenant_weights = { gold = 3 }",
    )
    .await;
    weighted_first_shares(&arrivals, FIRST, "deep weighted shares, embedded").await;
    app.stop().await;
}

/// A message that goes back to pending (handed back, its lease expired,
/// or a retry whose delay ended) goes back into its tenant's lane, so a
/// retry is not buried behind another tenant's backlog; a claimed one
/// leaves it.
#[tokio::test(flavor = "multi_thread")]
async fn messages_back_in_pending_are_back_in_their_lane() {
    use sluicegate::queue::redis::{RedisQueue, RedisQueueSettings};
    use sluicegate::queue::{NackReason, Queue};
    use sluicegate::redis::{RedisConnection, client, manager};
    use sluicegate::tasks::Tasks;
    let server = RedisServer::start();
    let base = unix_secs() + 3600;
    let lines: Vec<String> = (0..3)
        .map(|i| tenant_line(&format!("t-{i}"), "t1", base + i))
        .collect();
    submit_in_lanes(&server, "laneq", &lines).await;
    let lane = || server.int(&["ZCARD", "laneq:tenant-lane:t1"]);
    assert_eq!(lane(), 3);
    let c = client(&redis_config(&server)).expect("client");
    let tasks = Tasks::new();
    let mut settings = RedisQueueSettings::new("laneq");
    settings.fairness_attribute = Some("userid".into());
    let queue = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        settings,
        &tasks,
    );
    let got = queue
        .receive(3, Duration::from_secs(1), Duration::ZERO)
        .await
        .expect("receive");
    assert_eq!(got.len(), 3);
    assert_eq!((lane(), server.int(&["ZCARD", "laneq"])), (0, 0), "claimed");
    queue
        .nack(got[0].tag.clone(), Duration::ZERO, NackReason::NotAdmitted)
        .await
        .expect("hand back");
    assert_eq!(lane(), 1, "handed back into its lane");
    queue
        .nack(
            got[1].tag.clone(),
            Duration::from_millis(200),
            NackReason::Failed,
        )
        .await
        .expect("retry later");
    // The retry mover and the reclaimer (got[2]'s lease of 1 s) run every
    // 250 ms.
    support::wait_until(
        Duration::from_secs(10),
        "retry and reclaim back in the lane",
        || lane() == 3,
    )
    .await;
    assert_eq!(server.int(&["ZCARD", "laneq"]), 3);
    assert_eq!(server.int(&["SISMEMBER", "laneq:tenant-lanes", "t1"]), 1);
}

/// `submit --fairness-attribute` files every line into its tenant's lane
/// (lines without the attribute into the lane `""`); without the flag it
/// files by the dispatcher's default attribute (`userid`, issue 36); with
/// an empty one, nothing is filed.
#[test]
fn submit_files_lines_into_tenant_lanes() {
    let server = RedisServer::start();
    let tmp = support::TempDir::new("submit-lanes");
    let file = tmp.0.join("batch.jsonl");
    let base = unix_secs() + 3600;
    let mut lines: Vec<String> = (0..3)
        .map(|i| tenant_line(&format!("a-{i}"), "alice", base + i))
        .collect();
    lines.push(tenant_line("b-0", "bob", base));
    lines.push(
        serde_json::json!({"id": "anon", "deadline": base, "payload": {"model": "m"}}).to_string(),
    );
    std::fs::write(&file, lines.join("\n")).expect("write batch");
    let submit = |queue: &str, flag: &[&str]| {
        let out = support::cli::output(
            support::cli::sluicegate(&["submit", "--redis-url", &server.url(), "--queue", queue])
                .env_remove("SLUICEGATE_FAIRNESS_ATTRIBUTE")
                .args(flag)
                .arg(&file),
        );
        assert!(out.status.success(), "{}", support::cli::text(&out.stderr));
    };
    submit("laned", &["--fairness-attribute", "userid"]);
    assert_eq!(server.int(&["ZCARD", "laned:tenant-lane:alice"]), 3);
    assert_eq!(server.int(&["ZCARD", "laned:tenant-lane:bob"]), 1);
    assert_eq!(server.int(&["ZCARD", "laned:tenant-lane:"]), 1);
    assert_eq!(server.int(&["SCARD", "laned:tenant-lanes"]), 3);
    submit("default", &[]);
    assert_eq!(server.int(&["ZCARD", "default:tenant-lane:alice"]), 3);
    assert_eq!(server.int(&["SCARD", "default:tenant-lanes"]), 3);
    submit("plain", &["--fairness-attribute", ""]);
    assert_eq!(server.int(&["ZCARD", "plain"]), 5);
    assert_eq!(server.int(&["EXISTS", "plain:tenant-lanes"]), 0);
}
