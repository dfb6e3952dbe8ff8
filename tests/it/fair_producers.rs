//! Fair whoever produced the message (issue 36, part 1): tenant `big` has
//! 2 000 messages at the head of the queue and tenant `small` 50 behind
//! them; a dispatcher with the default fairness settings (attribute
//! `userid`, lookahead 64) and a window of 8 sends to the simulator.
//! `small`'s last result must be among the first 120 results (about 100
//! when the 50 interleave 1 : 1 with `big`; results complete within a
//! window of dispatch order), however the messages were written:
//!
//! - Redis, by `sluicegate submit` without flags (it files lanes by the
//!   dispatcher's default attribute);
//! - Redis, by a plain `ZADD` of upstream's format (the dispatcher's
//!   claims file them into lanes themselves);
//! - PostgreSQL (`sql`), by our client as upstream's producer writes rows
//!   (the claims file them), and by `sluicegate submit` without flags (it
//!   files each row's lane at insert);
//! - the embedded store (its claims always filed them; kept here so every
//!   producer path is measured the same way);
//! - the Batch API (`serve` files each line in its tenant's lane), on its
//!   embedded store and on Redis.
//!
//! Before issue 36 the first two and the `sql` one ended at about result
//! 2 050 of 2 050. Only the first results are waited for: the dispatcher
//! stops once `small` is answered.

use crate::support;

use std::time::Duration;

use crate::support::postgres::Postgres;
use crate::support::redis::{RedisServer, fast_app_toml, redis_config};
use bytes::Bytes;
use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, EndpointUrl};
use sluicegate::sim::{SimConfig, SimHandle, spawn_http};

const BIG: usize = 2000;
const SMALL: usize = 50;
/// The last `small` result must be at or before this position.
const WITHIN: usize = 120;

/// One request of `tenant` (metadata `userid`) for the simulator's model.
fn line(id: &str, tenant: &str, deadline: i64) -> String {
    serde_json::json!({
        "id": id,
        "deadline": deadline,
        "metadata": {"userid": tenant},
        "payload": {"model": "sim-model", "prompt": "p", "max_tokens": 1}
    })
    .to_string()
}

/// `big-<i>` with deadlines from `base`, then `small-<i>` 10 000 s later:
/// (deadline, line) in queue order.
fn backlog(base: i64) -> Vec<(i64, String)> {
    let big = (0..BIG).map(|i| {
        (
            base + i as i64,
            line(&format!("big-{i}"), "big", base + i as i64),
        )
    });
    let small = (0..SMALL).map(|i| {
        let d = base + 10_000 + i as i64;
        (d, line(&format!("small-{i}"), "small", d))
    });
    big.chain(small).collect()
}

/// A fast simulated pool (many replicas, time sped up), so 120 answers
/// take well under a second of the test's time.
async fn pool() -> SimHandle {
    let cfg = SimConfig {
        pool_name: "fair".into(),
        time_scale: 50.0,
        ..SimConfig::default()
    };
    spawn_http(cfg).await.expect("simulator starts")
}

/// The queue's `[[queue]]` lines: window 8, nothing else but defaults.
fn queue_toml(queue: &str) -> String {
    format!(
        r#"queue_name = "{queue}"
max_sys = 8
gate_type = "constant""#
    )
}

/// The 1-based position of the last `small-` id in `ids` (completion
/// order); panics unless every `small` is there.
fn last_small(ids: &[String]) -> usize {
    let small = ids.iter().filter(|id| id.starts_with("small-")).count();
    assert_eq!(small, SMALL, "every small result");
    ids.iter()
        .rposition(|id| id.starts_with("small-"))
        .map_or(0, |i| i + 1)
}

fn check(what: &str, ids: &[String]) {
    let position = last_small(ids);
    eprintln!(
        "{what}: last `small` result is number {position} ({} results read)",
        ids.len()
    );
    assert!(
        position <= WITHIN,
        "{what}: `small`'s last result was number {position}"
    );
}

/// Result ids of the Redis result list in completion order, once every
/// `small` is answered (bounded wait).
async fn redis_results(server: &RedisServer) -> Vec<String> {
    let read = || -> Vec<String> {
        let mut ids: Vec<String> = server
            .cli(&["LRANGE", "result-list", "0", "-1"])
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|r| r["id"].as_str().map(str::to_owned))
            .collect();
        // LPUSH: newest first.
        ids.reverse();
        ids
    };
    support::wait_until(Duration::from_secs(120), "every small result", || {
        read().iter().filter(|id| id.starts_with("small-")).count() == SMALL
    })
    .await;
    read()
}

async fn redis_dispatcher(server: &RedisServer, sim: &SimHandle, queue: &str) -> support::App {
    let toml = fast_app_toml(&sim.base_url(), "", &queue_toml(queue));
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis_config(server));
    support::start_app(&config).await
}

/// `sluicegate submit --queue Q FILE`, no other flag: lanes are filed by
/// the dispatcher's default attribute, and `small` goes out from the start.
#[tokio::test(flavor = "multi_thread")]
async fn submit_without_flags_is_fair_on_redis() {
    let server = RedisServer::start();
    let tmp = support::TempDir::new("fair-submit");
    let file = tmp.0.join("backlog.jsonl");
    let lines: Vec<String> = backlog(unix_secs() + 3600)
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("write the backlog");
    let out = support::cli::output(
        support::cli::sluicegate(&["submit", "--redis-url", &server.url(), "--queue", "fairsub"])
            .env_remove("SLUICEGATE_FAIRNESS_ATTRIBUTE")
            .arg(&file),
    );
    assert!(out.status.success(), "{}", support::cli::text(&out.stderr));
    let sim = pool().await;
    let app = redis_dispatcher(&server, &sim, "fairsub").await;
    let ids = redis_results(&server).await;
    app.stop().await;
    check("redis, submit without flags", &ids);
}

/// Upstream's format written by a plain `ZADD` (bare requests scored by
/// deadline, no lane, as another producer writes them): the dispatcher's
/// claims file them into lanes, and `small` goes out from the start.
#[tokio::test(flavor = "multi_thread")]
async fn a_plain_zadd_is_fair_on_redis() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connects");
    let mut zadd = redis::cmd("ZADD");
    zadd.arg("fairzadd");
    for (deadline, member) in backlog(unix_secs() + 3600) {
        zadd.arg(deadline).arg(member);
    }
    let added: usize = zadd.query_async(&mut conn).await.expect("ZADD");
    assert_eq!(added, BIG + SMALL);
    assert_eq!(
        server.int(&["EXISTS", "fairzadd:tenant-lanes"]),
        0,
        "no lanes yet"
    );
    let sim = pool().await;
    let app = redis_dispatcher(&server, &sim, "fairzadd").await;
    let ids = redis_results(&server).await;
    app.stop().await;
    check("redis, plain ZADD", &ids);
}

/// Rows written by our `sql` client without an attribute, as upstream's
/// producer writes them (no lane): the dispatcher's claims file them.
#[tokio::test(flavor = "multi_thread")]
async fn rows_of_any_producer_are_fair_on_sql() {
    use sluicegate::queue::sql::SqlClient;
    let pg = Postgres::start();
    let url = EndpointUrl::new(url::Url::parse(&pg.url()).expect("url"));
    let client = SqlClient::open(&url, Duration::from_secs(5))
        .await
        .expect("client opens");
    let items: Vec<(Bytes, i64)> = backlog(unix_secs() + 3600)
        .into_iter()
        .map(|(d, l)| (Bytes::from(l), d))
        .collect();
    let n = client.enqueue("fairsql", &items).await.expect("enqueued");
    assert_eq!(n as usize, BIG + SMALL);
    assert_eq!(
        pg.psql("SELECT count(*) FROM async_requests WHERE queue = 'fairsql' AND tenant IS NULL"),
        (BIG + SMALL).to_string(),
        "no row filed before the dispatcher"
    );
    let ids = sql_results_of_a_dispatcher(&pg, &client, "fairsql").await;
    check("sql, rows of any producer", &ids);
}

/// `sluicegate submit --sql-url URL --queue Q FILE`, no other flag: each
/// row is filed in its tenant's lane as it is inserted (the dispatcher's
/// default attribute), so the claims file nothing, and `small` goes out
/// from the start.
#[tokio::test(flavor = "multi_thread")]
async fn submit_without_flags_is_fair_on_sql() {
    use sluicegate::queue::sql::SqlClient;
    let pg = Postgres::start();
    let tmp = support::TempDir::new("fair-submit-sql");
    let file = tmp.0.join("backlog.jsonl");
    let lines: Vec<String> = backlog(unix_secs() + 3600)
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("write the backlog");
    let out = support::cli::output(
        support::cli::sluicegate(&["submit", "--sql-url", &pg.url(), "--queue", "fairsqlsub"])
            .env_remove("SLUICEGATE_FAIRNESS_ATTRIBUTE")
            .arg(&file),
    );
    assert!(out.status.success(), "{}", support::cli::text(&out.stderr));
    assert_eq!(
        pg.psql(
            "SELECT tenant || ':' || count(*) FROM async_requests WHERE queue = 'fairsqlsub' GROUP BY tenant ORDER BY tenant"
        )
        .lines()
        .collect::<Vec<_>>(),
        vec![format!("big:{BIG}"), format!("small:{SMALL}")],
        "every row filed in its lane at insert"
    );
    let url = EndpointUrl::new(url::Url::parse(&pg.url()).expect("url"));
    let client = SqlClient::open(&url, Duration::from_secs(5))
        .await
        .expect("client opens");
    let ids = sql_results_of_a_dispatcher(&pg, &client, "fairsqlsub").await;
    check("sql, submit without flags", &ids);
}

/// A queue of one tenant is claimed by the plain claim (its lanes' heads
/// are the queue's head); a second tenant's rows arriving later, unfiled,
/// switch the claims back to the lanes at once: `small` goes out within
/// the dispatcher's lookahead (64 claimed before it came), the window (8)
/// and the 1 : 1 interleave of its 50 (100) after its arrival, not behind
/// `big`'s whole backlog.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_arriving_behind_a_one_tenant_queue_is_fair_on_sql() {
    use sluicegate::queue::sql::SqlClient;
    let pg = Postgres::start();
    let url = EndpointUrl::new(url::Url::parse(&pg.url()).expect("url"));
    let client = SqlClient::open(&url, Duration::from_secs(5))
        .await
        .expect("client opens");
    let (big, small): (Vec<_>, Vec<_>) = backlog(unix_secs() + 3600)
        .into_iter()
        .map(|(d, l)| (Bytes::from(l), d))
        .partition(|(l, _)| !String::from_utf8_lossy(l).contains("small-"));
    let n = (client
        .enqueue_in_lanes("fairlate", &big, Some("userid"))
        .await)
        .expect("enqueued");
    assert_eq!(n as usize, BIG);
    let queue = "fairlate".to_owned();
    let late = async {
        // Once the dispatcher is well into `big`, `small` arrives unfiled.
        let give_up = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let done = (client.results_after("result-sql", 0, BIG + SMALL).await).expect("results");
            if done.len() >= 50 {
                break;
            }
            assert!(
                std::time::Instant::now() < give_up,
                "big not under way within 120 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let before = (client.results_after("result-sql", 0, BIG + SMALL).await)
            .expect("results")
            .len();
        (client.enqueue(&queue, &small).await).expect("small enqueued");
        before
    };
    let (ids, before) = tokio::join!(sql_results_of_a_dispatcher(&pg, &client, "fairlate"), late);
    let position = last_small(&ids);
    eprintln!(
        "sql, a tenant arriving late: small enqueued after result {before}, its last is number {position}"
    );
    assert!(
        position <= before + 64 + 8 + 2 * SMALL + 20,
        "small's last result was number {position}, small came after result {before}"
    );
}

/// Starts a dispatcher with the default fairness settings on `sql` queue
/// `queue`, and returns result ids in write order once every `small` is
/// answered (bounded wait).
async fn sql_results_of_a_dispatcher(
    pg: &Postgres,
    client: &sluicegate::queue::sql::SqlClient,
    queue: &str,
) -> Vec<String> {
    let sim = pool().await;
    let toml = format!(
        r#"
transport = "sql"
[sql]
url = "{url}"
poll_interval = "50ms"
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
{queue}
"#,
        url = pg.url(),
        gateway = sim.base_url(),
        queue = queue_toml(queue),
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    let read = || async {
        let results = client
            .results_after("result-sql", 0, BIG + SMALL)
            .await
            .expect("results");
        // `seq` is the write order.
        results.into_iter().map(|r| r.id).collect::<Vec<String>>()
    };
    let give_up = std::time::Instant::now() + Duration::from_secs(120);
    let ids = loop {
        let ids = read().await;
        if ids.iter().filter(|id| id.starts_with("small-")).count() == SMALL {
            break ids;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "small not answered within 120 s ({} results)",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    app.stop().await;
    ids
}

/// The Batch API (`serve`, dispatcher in process, window 8, default
/// fairness settings), on its embedded store and on Redis: tenant `big`'s
/// batch of 2 000 lines, then `small`'s of 50, both queued whole while
/// the gate is shut. `serve` writes each line's tenant into its metadata
/// and files its lane, so once the gate opens `small` is dispatched among
/// the first 120, as for the other producers. Measured at the gateway.
#[tokio::test(flavor = "multi_thread")]
async fn batches_of_the_batch_api_are_fair() {
    use crate::support::gate::Gate;
    use crate::support::serve::{Api, ServeSpec, completion_lines};
    use crate::support::tenants::{recording_gateway, seen};
    for redis in [None, Some(RedisServer::start())] {
        let what = if redis.is_some() { "redis" } else { "embedded" };
        let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
        let gate = Gate::closed().await;
        let mut spec = ServeSpec::new(&gateway.uri());
        spec.keys = Some("big:key-big,small:key-small".into());
        spec.redis_port = redis.as_ref().map(|r| r.port);
        spec.gate_url = Some(gate.url.clone());
        let served = support::serve::start(&spec, None).await;
        let big = Api::new(&served.base, Some("key-big"));
        let small = Api::new(&served.base, Some("key-small"));
        for (api, n) in [(&big, BIG), (&small, SMALL)] {
            let (status, body) = api.try_batch(&completion_lines(n, 1)).await;
            assert_eq!(status, 200, "{what}: {body}");
        }
        let queued = || match &redis {
            Some(r) => usize::try_from(r.int(&["ZCARD", "batch-api"])).unwrap_or(0),
            None => {
                let db =
                    rusqlite::Connection::open(served.dir.0.join("queue.db")).expect("queue file");
                db.query_row("SELECT count(*) FROM messages", [], |r| r.get::<_, i64>(0))
                    .map_or(0, |n| usize::try_from(n).unwrap_or(0))
            }
        };
        support::wait_until(Duration::from_secs(60), "both batches queued", || {
            queued() == BIG + SMALL
        })
        .await;
        assert!(
            seen(&arrivals).is_empty(),
            "{what}: sent through a shut gate"
        );
        gate.set_open(true);
        support::wait_until(Duration::from_secs(120), "every small dispatch", || {
            seen(&arrivals)
                .iter()
                .filter(|a| a.tenant == "small")
                .count()
                == SMALL
        })
        .await;
        let all = seen(&arrivals);
        let position = all
            .iter()
            .rposition(|a| a.tenant == "small")
            .map_or(0, |i| i + 1);
        served.stop().await;
        eprintln!("batch api, {what}: small's last dispatch is number {position}");
        assert!(
            position <= WITHIN,
            "{what}: small's last dispatch was number {position}"
        );
    }
}

/// The embedded store: its claims file every message (no producer flag).
#[tokio::test(flavor = "multi_thread")]
async fn the_embedded_store_is_fair() {
    use sluicegate::queue::embedded::EmbeddedQueue;
    let tmp = support::TempDir::new("fair-embedded");
    let db = tmp.0.join("store.db");
    let bodies: Vec<Bytes> = backlog(unix_secs() + 3600)
        .into_iter()
        .map(|(_, l)| Bytes::from(l))
        .collect();
    let store = EmbeddedQueue::open(&db, "fairemb").expect("store");
    store.enqueue(&bodies, &[]).expect("enqueued");
    let sim = pool().await;
    let toml = format!(
        r#"
transport = "embedded"
[embedded]
path = "{}"
[gateway]
url = "{}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
{}
"#,
        db.display(),
        sim.base_url(),
        queue_toml("fairemb"),
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    let read = || -> Vec<String> {
        // Write order.
        (store.results().expect("results").into_iter())
            .map(|r| r.id)
            .collect()
    };
    support::wait_until(Duration::from_secs(120), "every small result", || {
        read().iter().filter(|id| id.starts_with("small-")).count() == SMALL
    })
    .await;
    let ids = read();
    app.stop().await;
    check("embedded store", &ids);
}

/// Two replicas claim a plain-`ZADD` queue while their filers and claims
/// file it into lanes at the same time: every member is claimed exactly
/// once, and the lanes end empty (filing only adds index entries; the
/// claims check pending for each).
#[tokio::test(flavor = "multi_thread")]
async fn replicas_filing_and_claiming_together_lose_and_duplicate_nothing() {
    use sluicegate::queue::Queue;
    use sluicegate::queue::redis::{RedisQueue, RedisQueueSettings};
    use sluicegate::redis::{RedisConnection, client, manager};
    use sluicegate::tasks::Tasks;
    use std::collections::HashSet;
    const N: usize = 3000;
    let server = RedisServer::start();
    let base = unix_secs() + 3600;
    let mut zadd = redis::cmd("ZADD");
    zadd.arg("fairrep");
    for i in 0..N {
        let tenant = ["a", "b", "c"][i % 3];
        zadd.arg(base + i as i64)
            .arg(line(&format!("m-{i}"), tenant, base + i as i64));
    }
    let c = redis::Client::open(server.url()).expect("client");
    let mut conn = c
        .get_multiplexed_async_connection()
        .await
        .expect("connects");
    let _: usize = zadd.query_async(&mut conn).await.expect("ZADD");
    let tasks = Tasks::new();
    let replica = || {
        let c = client(&redis_config(&server)).expect("client");
        let mut settings = RedisQueueSettings::new("fairrep");
        settings.fairness_attribute = Some("userid".into());
        std::sync::Arc::new(RedisQueue::start(
            RedisConnection::Single(manager(&c).expect("manager")),
            settings,
            &tasks,
        ))
    };
    let drain = |queue: std::sync::Arc<RedisQueue>| {
        tokio::spawn(async move {
            let mut ids = Vec::new();
            // Bounded: 3 000 members in claims of at most 37.
            for _ in 0..10_000 {
                let got = queue
                    .receive(37, Duration::from_secs(60), Duration::ZERO)
                    .await
                    .expect("receive");
                if got.is_empty() && queue.backlog().await.expect("backlog") == Some(0) {
                    break;
                }
                for d in got {
                    let v: serde_json::Value = serde_json::from_slice(&d.body).expect("json");
                    ids.push(v["id"].as_str().expect("id").to_owned());
                }
            }
            ids
        })
    };
    let (one, two) = (drain(replica()), drain(replica()));
    let (one, two) = (one.await.expect("replica 1"), two.await.expect("replica 2"));
    eprintln!("replicas: {} and {} claims", one.len(), two.len());
    let all: Vec<String> = one.into_iter().chain(two).collect();
    let distinct: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), N, "every member claimed once");
    assert_eq!(distinct.len(), N, "no member claimed twice");
    assert_eq!(server.int(&["ZCARD", "fairrep"]), 0);
    for t in ["a", "b", "c"] {
        assert_eq!(
            server.int(&["ZCARD", &format!("fairrep:tenant-lane:{t}")]),
            0,
            "lane {t} empty"
        );
    }
    tasks.root_token().cancel();
}

/// A dispatcher without a fairness attribute deletes the lanes `submit`
/// filed by default: its claims never take members out of them.
#[tokio::test(flavor = "multi_thread")]
async fn a_dispatcher_without_an_attribute_drops_the_lanes() {
    use sluicegate::queue::redis::{RedisQueue, RedisQueueSettings};
    use sluicegate::redis::{RedisConnection, client, manager};
    use sluicegate::tasks::Tasks;
    let server = RedisServer::start();
    let lines: Vec<String> = (0..5)
        .map(|i| line(&format!("x-{i}"), "t", unix_secs() + 3600 + i))
        .collect();
    crate::support::redis::submit_in_lanes(&server, "nolanes", &lines).await;
    assert_eq!(server.int(&["ZCARD", "nolanes:tenant-lane:t"]), 5);
    let tasks = Tasks::new();
    let c = client(&redis_config(&server)).expect("client");
    let _queue = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        RedisQueueSettings::new("nolanes"),
        &tasks,
    );
    support::wait_until(Duration::from_secs(10), "lanes dropped", || {
        server.int(&["EXISTS", "nolanes:tenant-lanes", "nolanes:tenant-lane:t"]) == 0
    })
    .await;
    assert_eq!(
        server.int(&["ZCARD", "nolanes"]),
        5,
        "the queue itself is kept"
    );
    tasks.root_token().cancel();
}
