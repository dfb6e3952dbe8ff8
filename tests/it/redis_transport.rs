//! The Redis transport in process against a real `redis-server`: round trip
//! through the simulator, upstream wire compatibility (messages written
//! with plain `redis-cli`), typed results for expired and cancelled
//! messages, retries into dead letters, and password authentication.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::redis::{RedisOptions, RedisServer, redis_config, submit_as};
use sluicegate::app::Running;
use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, RedisConfig, Secret};
use sluicegate::queue::Queue;
use sluicegate::queue::redis::{RedisQueue, RedisQueueSettings, cancel};
use sluicegate::redis::{RedisConnection, client, connection, manager};
use sluicegate::request::parse_message;
use sluicegate::sim::{SimConfig, spawn_http};
use sluicegate::tasks::Tasks;
use tokio_util::sync::CancellationToken;

struct Dispatcher {
    running: Running,
    shutdown: CancellationToken,
    queue: Arc<RedisQueue>,
}

impl Dispatcher {
    async fn stop(self) {
        self.shutdown.cancel();
        self.running.wait().await.expect("clean drain");
    }
}

async fn start_dispatcher(
    redis: RedisConfig,
    gateway: &str,
    queue: &str,
    extra_dispatch: &str,
) -> Dispatcher {
    start_dispatcher_gated(
        redis,
        gateway,
        queue,
        extra_dispatch,
        r#"gate_type = "constant""#,
    )
    .await
}

async fn start_dispatcher_gated(
    redis: RedisConfig,
    gateway: &str,
    queue: &str,
    extra_dispatch: &str,
    gate: &str,
) -> Dispatcher {
    let toml = support::redis::fast_app_toml(
        gateway,
        extra_dispatch,
        &format!("queue_name = \"{queue}\"\nmax_sys = 32\n{gate}"),
    );
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis);
    let support::App { running, shutdown } = support::start_app(&config).await;
    let queue = running.transports().redis()[0].clone();
    Dispatcher {
        running,
        shutdown,
        queue,
    }
}

fn request_line(id: &str, deadline: i64) -> String {
    serde_json::json!({
        "id": id,
        "deadline": deadline,
        "payload": {"model": "sim-model", "prompt": "Summarise.", "max_tokens": 4}
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn round_trip_through_the_simulator_writes_one_result_per_request() {
    let server = RedisServer::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let redis = redis_config(&server);
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..60)
        .map(|i| request_line(&format!("rt-{i}"), deadline))
        .collect();
    submit_as(&redis, "rt", &lines).await;
    assert_eq!(server.int(&["ZCARD", "rt"]), 60);
    let d = start_dispatcher(redis, &sim.base_url(), "rt", "").await;
    let results = server.wait_for_len("result-list", 60).await;
    let mut ids: Vec<&str> = results
        .iter()
        .map(|r| r["id"].as_str().expect("id"))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 60);
    for r in &results {
        assert_eq!(r["status_code"], 200, "{r}");
        assert!(r["request_token"].as_str().is_some(), "{r}");
    }
    // Claims dropped with their results; producer keys cleaned up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.int(&["ZCARD", "rt"]), 0);
    assert_eq!(server.int(&["HLEN", "rt:claimed"]), 0);
    assert_eq!(server.int(&["ZCARD", "rt:claims-idx"]), 0);
    assert_eq!(server.int(&["EXISTS", "request-active:rt-0"]), 0);
    assert_eq!(d.queue.status().expect("status").claims_held, 0);
    d.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_envelope_written_with_redis_cli_gets_upstream_result_shape() {
    let server = RedisServer::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let deadline = unix_secs() + 600;
    // Exactly what an upstream producer writes: envelope member, score =
    // deadline, active key holding the token.
    let envelope = serde_json::json!({
        "internal": {
            "retry_count": 0,
            "request_token": "0a1b2c3d",
            "request_queue_name": "request-sortedset",
            "result_queue_name": "upstream-results"
        },
        "request_kind": "redis",
        "data": {
            "id": "up-1",
            "created": unix_secs(),
            "deadline": deadline.to_string(),
            "payload": {"model": "sim-model", "prompt": "Hi", "max_tokens": 2},
            "metadata": {"userid": "alice"}
        }
    })
    .to_string();
    server.cli(&[
        "ZADD",
        "request-sortedset",
        &deadline.to_string(),
        &envelope,
    ]);
    server.cli(&["SET", "request-active:up-1", "0a1b2c3d", "EX", "600"]);
    // And a bare request, which upstream producers may also write.
    server.cli(&[
        "ZADD",
        "request-sortedset",
        &deadline.to_string(),
        &request_line("up-2", deadline),
    ]);
    // And garbage, which must still get a result, not vanish.
    server.cli(&["ZADD", "request-sortedset", "1", "not json"]);
    let d = start_dispatcher(
        redis_config(&server),
        &sim.base_url(),
        "request-sortedset",
        "",
    )
    .await;
    let upstream = server.wait_for_len("upstream-results", 1).await;
    let r = &upstream[0];
    assert_eq!(r["id"], "up-1");
    assert_eq!(r["status_code"], 200);
    assert_eq!(r["request_token"], "0a1b2c3d");
    let body: serde_json::Value =
        serde_json::from_str(r["payload"].as_str().expect("payload is a string")).expect("json");
    assert!(body["choices"].is_array(), "{body}");
    let defaults = server.wait_for_len("result-list", 2).await;
    let bare = defaults
        .iter()
        .find(|r| r["id"] == "up-2")
        .expect("bare result");
    assert_eq!(bare["status_code"], 200);
    let invalid = defaults
        .iter()
        .find(|r| r["error_code"] == "INVALID_REQUEST")
        .expect("garbage answered");
    assert!(invalid.get("status_code").is_none());
    assert_eq!(server.int(&["EXISTS", "request-active:up-1"]), 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.int(&["HLEN", "request-sortedset:claimed"]), 0);
    d.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_and_cancelled_messages_get_typed_results() {
    let server = RedisServer::start();
    let sim = spawn_http(SimConfig::default()).await.expect("simulator");
    let redis = redis_config(&server);
    let now = unix_secs();
    submit_as(
        &redis,
        "typed",
        &[
            request_line("expired", now - 10),
            request_line("cancelled", now + 600),
            request_line("fine", now + 600),
        ],
    )
    .await;
    {
        let mut conn = connection(&redis).expect("connection");
        let outcome = cancel(&mut conn, "cancelled").await.expect("cancel");
        assert_eq!(outcome, sluicegate::queue::redis::CancelOutcome::Cancelled);
        let outcome = cancel(&mut conn, "never-submitted").await.expect("cancel");
        assert_eq!(outcome, sluicegate::queue::redis::CancelOutcome::NotActive);
    }
    let d = start_dispatcher(redis, &sim.base_url(), "typed", "").await;
    let results = server.wait_for_len("result-list", 3).await;
    let by_id = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("{id} answered"))
            .clone()
    };
    assert_eq!(by_id("expired")["error_code"], "DEADLINE_EXCEEDED");
    assert_eq!(by_id("cancelled")["error_code"], "CANCELLED");
    assert_eq!(by_id("fine")["status_code"], 200);
    // The cancel marker held this submission's token: cleaned up.
    assert_eq!(server.int(&["EXISTS", "request-cancel:cancelled"]), 0);
    assert_eq!(d.queue.cancelled_total(), 1);
    d.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_attempts_go_through_the_retry_set_into_dead_letters() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let server = RedisServer::start();
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500).set_body_string("boom"))
        .mount(&gateway)
        .await;
    let redis = redis_config(&server);
    submit_as(
        &redis,
        "flaky",
        &[request_line("doomed", unix_secs() + 600)],
    )
    .await;
    let d = start_dispatcher(redis, &gateway.uri(), "flaky", "max_attempts = 3").await;
    let dead = server.wait_for_len("flaky:dead-letters", 1).await;
    assert_eq!(dead[0]["last_error"]["id"], "doomed");
    assert_eq!(dead[0]["last_error"]["status_code"], 500);
    let message =
        parse_message(dead[0]["message"].as_str().expect("message").as_bytes()).expect("envelope");
    // Two failed attempts were counted in the envelope; the third ended it.
    assert_eq!(message.internal.retry_count, 2);
    assert_eq!(
        message.internal.request_queue_name.as_deref(),
        Some("flaky")
    );
    // A dead letter also writes its result (the last answer, flagged as
    // exhausted), so readers waiting for every result are not left waiting.
    let results = server.wait_for_len("result-list", 1).await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["id"], "doomed");
    assert_eq!(results[0]["error_code"], "INFERENCE_ERROR");
    assert_eq!(server.int(&["ZCARD", "retry-sortedset"]), 0);
    assert_eq!(server.int(&["HLEN", "flaky:claimed"]), 0);
    support::wait_until(Duration::from_secs(5), "a dead letter", || {
        d.queue.status().expect("status").dead_letters_total >= 1
    })
    .await;
    // The metric follows the transport's counter.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let text = d.running.metrics.encode();
    assert!(
        text.contains(r#"sluicegate_queue_dead_letters_total{queue="flaky"} 1"#),
        "{text}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn password_protected_redis_needs_and_accepts_credentials() {
    let server = RedisServer::start_with(RedisOptions {
        password: Some("s3cret-pass".into()),
        ..RedisOptions::default()
    });
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    // Without the password: the transport reports errors, never data.
    let wrong = RedisConfig {
        password: Some(Secret::new("wrong")),
        ..redis_config(&server)
    };
    let c = client(&wrong).expect("client");
    let tasks = Tasks::new();
    let queue = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        RedisQueueSettings::new("auth"),
        &tasks,
    );
    assert!(queue.backlog().await.is_err());
    drop(queue);
    // From a password file, as a deployment mounts it.
    let file = std::env::temp_dir().join(format!("sluicegate-redis-pass-{}", std::process::id()));
    std::fs::write(&file, "s3cret-pass\n").expect("password file");
    // Loaded as a deployment's config is: the file is read at load time.
    let loaded = Config::from_toml_str(
        &format!(
            "transport = \"redis\"\n[gateway]\nurl = \"http://127.0.0.1:1\"\n\
             [redis]\nurl = \"{}\"\npassword_file = \"{}\"\n\
             [[queue]]\nqueue_name = \"auth\"\ngate_type = \"constant\"\n",
            server.url(),
            file.display()
        ),
        &Default::default(),
    )
    .expect("config with a password file");
    let redis = loaded.redis.expect("[redis]");
    let deadline = unix_secs() + 600;
    submit_as(
        &redis,
        "auth",
        &[request_line("a-1", deadline), request_line("a-2", deadline)],
    )
    .await;
    let d = start_dispatcher(redis, &sim.base_url(), "auth", "").await;
    let results = server.wait_for_len("result-list", 2).await;
    assert!(results.iter().all(|r| r["status_code"] == 200));
    assert!(d.queue.is_reachable());
    d.stop().await;
    let _ = std::fs::remove_file(file);
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_arriving_while_a_message_waits_for_the_gate_is_honoured_before_send() {
    // Without lookahead, "second" waits unclaimed in Redis.
    cancel_while_waiting("tenant_lookahead = 0", Some(1)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_arriving_while_a_message_waits_in_the_lookahead_is_honoured_before_send() {
    // With the default lookahead "second" is claimed into the fairness
    // buffer; the send path asks the queue again because it waited.
    cancel_while_waiting("", None).await;
}

/// Two messages, one request at a time; "second" is cancelled while it
/// waits behind "first" and must end `CANCELLED` without reaching the
/// gateway. `claimed`: how many claims Redis must show while it waits.
async fn cancel_while_waiting(extra_dispatch: &str, claimed: Option<i64>) {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let server = RedisServer::start();
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_string("{}")
                .set_delay(Duration::from_millis(1500)),
        )
        .mount(&gateway)
        .await;
    let redis = redis_config(&server);
    let deadline = unix_secs() + 600;
    submit_as(
        &redis,
        "waits",
        &[
            request_line("first", deadline),
            request_line("second", deadline + 1),
        ],
    )
    .await;
    // One request at a time; the earlier deadline goes first, so "second"
    // waits behind "first". The local gate's reading counts our own work
    // (window = its limit), so "second" waits unclaimed in Redis rather
    // than claimed at the gate.
    let d = start_dispatcher_gated(
        redis.clone(),
        &gateway.uri(),
        "waits",
        extra_dispatch,
        r#"gate_type = "local-max-concurrency"
gate_params = { limit = 1, gating_mode = "blocking" }"#,
    )
    .await;
    support::wait_until(Duration::from_secs(10), "first never claimed", || {
        server.int(&["HLEN", "waits:claimed"]) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(claimed) = claimed {
        assert_eq!(
            server.int(&["HLEN", "waits:claimed"]),
            claimed,
            "nothing is claimed beyond the gate's limit"
        );
    }
    {
        let mut conn = connection(&redis).expect("connection");
        let outcome = cancel(&mut conn, "second").await.expect("cancel");
        assert_eq!(outcome, sluicegate::queue::redis::CancelOutcome::Cancelled);
    }
    let results = server.wait_for_len("result-list", 2).await;
    let second = results
        .iter()
        .find(|r| r["id"] == "second")
        .expect("second answered");
    assert_eq!(second["error_code"], "CANCELLED", "{second}");
    let first = results
        .iter()
        .find(|r| r["id"] == "first")
        .expect("first answered");
    assert_eq!(first["status_code"], 200);
    let sent = gateway.received_requests().await.expect("recording").len();
    assert_eq!(sent, 1, "the cancelled request must not reach the gateway");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_aborts_requests_in_flight_at_the_engine_and_keeps_an_answer_that_came_first() {
    // Three long generations run at the simulator at once; two are
    // cancelled while they run. Their connections must close (the
    // simulator aborts them and frees their slots), each gets exactly one
    // CANCELLED result, and a cancel after the third's answer changes
    // nothing.
    let server = RedisServer::start();
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        ..SimConfig::default()
    };
    cfg.http.max_output_tokens = 1500;
    let sim = spawn_http(cfg).await.expect("simulator starts");
    let redis = redis_config(&server);
    let deadline = unix_secs() + 600;
    let line = |id: &str, max_tokens: u32| {
        serde_json::json!({
            "id": id,
            "deadline": deadline,
            "payload": {"model": "sim-model", "prompt": "Write on.", "max_tokens": max_tokens}
        })
        .to_string()
    };
    submit_as(
        &redis,
        "inflight",
        &[
            line("long-1", 1500),
            line("long-2", 1500),
            line("short", 64),
        ],
    )
    .await;
    let d = start_dispatcher(
        redis.clone(),
        &sim.base_url(),
        "inflight",
        "cancel_check_interval = \"100ms\"",
    )
    .await;
    let http = reqwest::Client::new();
    let short = server.wait_for_len("result-list", 1).await;
    assert_eq!(short[0]["id"], "short", "{short:?}");
    assert_eq!(short[0]["status_code"], 200);
    assert_eq!(
        support::sim::pool_in_flight(&http, &sim).await,
        2.0,
        "both long generations still run at the engine"
    );
    assert_eq!(support::sim::aborted(&http, &sim).await, 0);
    {
        let mut conn = connection(&redis).expect("connection");
        for id in ["long-1", "long-2", "short"] {
            cancel(&mut conn, id).await.expect("cancel");
        }
    }
    let results = server.wait_for_len("result-list", 3).await;
    for id in ["long-1", "long-2"] {
        let r = results.iter().find(|r| r["id"] == id).expect("answered");
        assert_eq!(r["error_code"], "CANCELLED", "{r}");
    }
    let give_up = Instant::now() + Duration::from_secs(10);
    while support::sim::aborted(&http, &sim).await < 2 {
        assert!(Instant::now() < give_up, "the engine never saw the aborts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(support::sim::aborted(&http, &sim).await, 2);
    assert_eq!(support::sim::pool_in_flight(&http, &sim).await, 0.0);
    // Several check intervals later: still one result per message, the
    // answer that came first kept.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let results = server.wait_for_len("result-list", 3).await;
    assert_eq!(results.len(), 3, "{results:?}");
    let short = results.iter().find(|r| r["id"] == "short").expect("short");
    assert_eq!(short["status_code"], 200);
    assert_eq!(
        server.int(&["HLEN", "inflight:claimed"]),
        0,
        "nothing stays claimed"
    );
    d.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_lease_is_reclaimed_and_the_old_holder_is_fenced_out() {
    use sluicegate::queue::Completion;
    use sluicegate::result::ResultRecord;
    let server = RedisServer::start();
    let redis = redis_config(&server);
    submit_as(&redis, "lease", &[request_line("slow", unix_secs() + 600)]).await;
    let c = client(&redis).expect("client");
    let tasks = Tasks::new();
    let old_holder = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        RedisQueueSettings::new("lease"),
        &tasks,
    );
    let new_holder = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        RedisQueueSettings::new("lease"),
        &tasks,
    );
    let first = old_holder
        .receive(10, Duration::from_secs(1), Duration::ZERO)
        .await
        .expect("receive");
    assert_eq!(first.len(), 1);
    assert_eq!(server.int(&["ZCARD", "lease"]), 0, "claimed, not pending");
    // Nobody renews the lease: a reclaimer returns it at its old score.
    let give_up = Instant::now() + Duration::from_secs(10);
    let second = loop {
        let got = new_holder
            .receive(10, Duration::from_secs(30), Duration::from_millis(100))
            .await
            .expect("receive");
        if !got.is_empty() {
            break got;
        }
        assert!(Instant::now() < give_up, "never redelivered");
    };
    assert_ne!(first[0].tag, second[0].tag);
    assert_eq!(first[0].body, second[0].body);
    let result = |who: &str| ResultRecord::http("slow", None, 200, who.into(), 1);
    let stale = old_holder
        .ack(vec![Completion {
            tag: first[0].tag.clone(),
            result: result("old"),
        }])
        .await
        .expect("ack");
    assert_eq!((stale.acked, stale.lease_lost), (0, 1));
    let fresh = new_holder
        .ack(vec![Completion {
            tag: second[0].tag.clone(),
            result: result("new"),
        }])
        .await
        .expect("ack");
    assert_eq!((fresh.acked, fresh.lease_lost), (1, 0));
    let results = server.cli(&["LRANGE", "result-list", "0", "-1"]);
    assert_eq!(results.lines().count(), 1, "{results}");
    assert!(results.contains(r#""payload":"new""#), "{results}");
    assert_eq!(server.int(&["HLEN", "lease:claimed"]), 0);
    assert!(
        old_holder.status().expect("status").reclaims_total
            + new_holder.status().expect("status").reclaims_total
            >= 1
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn several_queues_per_process_each_with_its_gate_and_result_list() {
    let server = RedisServer::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let redis = redis_config(&server);
    let deadline = unix_secs() + 600;
    let lines = |p: &str| -> Vec<String> {
        (0..10)
            .map(|i| request_line(&format!("{p}-{i}"), deadline))
            .collect()
    };
    submit_as(&redis, "alpha", &lines("a")).await;
    submit_as(&redis, "beta", &lines("b")).await;
    let toml = format!(
        r#"
transport = "redis"
[gateway]
url = "{}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "alpha"
result_queue_name = "alpha-results"
gate_type = "constant"
[[queue]]
queue_name = "beta"
result_queue_name = "beta-results"
gate_type = "local-max-concurrency"
gate_params = {{ limit = 2, gating_mode = "blocking" }}
"#,
        sim.base_url()
    );
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis);
    let support::App { running, shutdown } = support::start_app(&config).await;
    let alpha = server.wait_for_len("alpha-results", 10).await;
    let beta = server.wait_for_len("beta-results", 10).await;
    assert!(
        alpha
            .iter()
            .all(|r| r["id"].as_str().is_some_and(|id| id.starts_with("a-")))
    );
    assert!(
        beta.iter()
            .all(|r| r["id"].as_str().is_some_and(|id| id.starts_with("b-")))
    );
    assert_eq!(server.int(&["LLEN", "result-list"]), 0);
    let text = running.metrics.encode();
    assert!(
        text.contains(r#"sluicegate_queue_claims_held{queue="alpha"}"#),
        "{text}"
    );
    assert!(
        text.contains(r#"sluicegate_queue_claims_held{queue="beta"}"#),
        "{text}"
    );
    shutdown.cancel();
    running.wait().await.expect("clean drain");
    sim.shutdown().await.expect("simulator stops");
}

/// The claim and ack scripts write a batch in a few variadic calls, in
/// chunks of 1 000 arguments (issue 21); a batch of 1 500 crosses a chunk
/// boundary in every call. Each claim is settled once (a tag acked twice
/// in one batch counts as a lost lease the second time), every result
/// reaches the list, no claim state is left, and the producer's keys are
/// dropped only where they still hold the settled submission's token.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_ack_settles_each_claim_once_and_keeps_a_newer_submissions_keys() {
    use sluicegate::queue::Completion;
    use sluicegate::result::ResultRecord;
    const N: usize = 1_500;
    let server = RedisServer::start();
    let redis = redis_config(&server);
    let deadline = unix_secs() + 600;
    let lines: Vec<String> = (0..N)
        .map(|i| request_line(&format!("b{i}"), deadline))
        .collect();
    submit_as(&redis, "batched", &lines).await;
    // A newer submission of b7 took over its active key: settling the old
    // claim must leave it.
    server.cli(&["SET", "request-active:b7", "newer-token"]);
    let c = client(&redis).expect("client");
    let tasks = Tasks::new();
    let queue = RedisQueue::start(
        RedisConnection::Single(manager(&c).expect("manager")),
        RedisQueueSettings::new("batched"),
        &tasks,
    );
    let mut deliveries = Vec::new();
    let give_up = Instant::now() + Duration::from_secs(20);
    while deliveries.len() < N {
        let got = queue
            .receive(
                N - deliveries.len(),
                Duration::from_secs(60),
                Duration::from_millis(100),
            )
            .await
            .expect("receive");
        deliveries.extend(got);
        assert!(
            Instant::now() < give_up,
            "claimed only {}",
            deliveries.len()
        );
    }
    assert_eq!(server.int(&["ZCARD", "batched"]), 0, "every member claimed");
    assert_eq!(server.int(&["HLEN", "batched:claimed"]) as usize, N);
    let mut completions: Vec<Completion> = deliveries
        .iter()
        .map(|d| {
            let message = parse_message(&d.body).expect("our own envelope");
            let id = message.request.id.clone();
            let token = message.token().map(str::to_owned);
            Completion {
                tag: d.tag.clone(),
                result: ResultRecord::http(&id, token.as_deref(), 200, "done".into(), 1),
            }
        })
        .collect();
    completions.push(Completion {
        tag: completions[3].tag.clone(),
        result: completions[3].result.clone(),
    });
    let report = queue.ack(completions).await.expect("ack");
    assert_eq!((report.acked, report.lease_lost), (N, 1));
    assert_eq!(server.int(&["LLEN", "result-list"]) as usize, N);
    for key in [
        "batched:claimed",
        "batched:claim-owners",
        "batched:claim-scores",
    ] {
        assert_eq!(server.int(&["HLEN", key]), 0, "{key} left");
    }
    assert_eq!(
        server.int(&["ZCARD", "batched:claims-idx"]),
        0,
        "lease index left"
    );
    let active = server.cli(&["--scan", "--pattern", "request-active:*"]);
    assert_eq!(
        active.trim(),
        "request-active:b7",
        "only the newer submission's key stays"
    );
    assert_eq!(
        server.cli(&["GET", "request-active:b7"]).trim(),
        "newer-token"
    );
}
