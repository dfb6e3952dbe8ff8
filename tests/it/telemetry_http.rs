//! The running application serves `/metrics`, `/healthz` and `/readyz`,
//! and `/metrics` carries every documented metric.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluicegate::config::Config;
use sluicegate::telemetry::METRIC_NAMES;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::test]
async fn metrics_health_and_readiness_are_served() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_string("{}"))
        .mount(&server)
        .await;
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{}"
[telemetry]
listen = "127.0.0.1:0"
[dispatch]
poll_interval = "50ms"
receive_wait = "50ms"
[[queue]]
queue_name = "q"
gate_type = "constant"
"#,
        server.uri()
    );
    let config = Config::from_toml_str(&toml, &BTreeMap::new()).expect("valid config");
    let app = support::start_app(&config).await;
    let queue = app.running.transports().memory()[0].clone();
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 600;
    queue.push_message(format!(
        r#"{{"id":"a","deadline":{deadline},"payload":{{}}}}"#
    ));
    let base = format!("http://{}", app.running.telemetry_addr);
    let client = reqwest::Client::new();
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    while queue.results().is_empty() && tokio::time::Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(queue.results().len(), 1);

    let health = client
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    let ready = client
        .get(format!("{base}/readyz"))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), 200);
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body");
    // The Pub/Sub transport's own metrics exist only for Pub/Sub queues;
    // tests/it/pubsub_transport.rs checks the full list on one. The Batch
    // API's per-tenant holdings have a series only once a tenant with a
    // `serve.tenant_limits` limit has a batch; tests/it/batch_api.rs reads
    // them (`batches_over_a_tenant_limit_get_429_at_creation_...`).
    // Flex and background metrics exist only in `sluicegate serve`;
    // tests/it/flex.rs reads them. The earliest waiting deadline has a
    // series only while work waits (the test below reads it).
    for name in METRIC_NAMES.iter().filter(|n| {
        !n.starts_with("sluicegate_pubsub_")
            && !n.starts_with("sluicegate_batch_enqueued_")
            && !n.starts_with("sluicegate_flex_")
            && !n.starts_with("sluicegate_background_")
            && **n != "sluicegate_queue_earliest_deadline_timestamp_seconds"
    }) {
        assert!(text.contains(name), "{name} missing");
    }
    assert!(
        text.contains(r#"sluicegate_outcomes_total{queue="q",outcome="success"} 1"#),
        "{text}"
    );

    // Every metric is documented.
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md"))
        .expect("docs/metrics.md");
    for name in METRIC_NAMES {
        assert!(
            docs.contains(&format!("`{name}`")),
            "{name} not in docs/metrics.md"
        );
    }

    let health = app.running.health.clone();
    app.stop().await;
    assert!(!health.is_ready(), "not ready once draining");
}

/// Deadline proximity for autoscalers: with the gate shut (a page reading
/// saturation 1), the waiting messages' deadlines show as counts within
/// each horizon and the earliest deadline, at the backlog's cadence; on
/// the in-memory queue and on Redis (its sorted set's scores).
#[tokio::test(flavor = "multi_thread")]
async fn waiting_work_shows_by_time_to_deadline_in_memory_and_on_redis() {
    due_metrics_follow_waiting_deadlines(false).await;
    due_metrics_follow_waiting_deadlines(true).await;
}

async fn due_metrics_follow_waiting_deadlines(on_redis: bool) {
    let page = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(200).set_body_string("pool_saturation 1\n"))
        .mount(&page)
        .await;
    let redis = on_redis.then(crate::support::redis::RedisServer::start);
    let transport = if on_redis { "redis" } else { "memory" };
    let mut toml = format!(
        r#"
transport = "{transport}"
[gateway]
url = "http://127.0.0.1:9"
[telemetry]
listen = "127.0.0.1:0"
[dispatch]
poll_interval = "50ms"
receive_wait = "50ms"
[[queue]]
queue_name = "due"
gate_type = "endpoint-scrape"
gate_params = {{ url = "{}/metrics", metric = "pool_saturation" }}
"#,
        page.uri()
    );
    if let Some(r) = &redis {
        toml.push_str(&format!("[redis]\nurl = \"{}\"\n", r.url()));
    }
    let now = i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
    )
    .expect("seconds");
    let deadlines = due_deadlines(now);
    let lines: Vec<String> = deadlines
        .iter()
        .enumerate()
        .map(|(i, d)| format!(r#"{{"id":"m{i}","deadline":{d},"payload":{{}}}}"#))
        .collect();
    let config = Config::from_toml_str(&toml, &BTreeMap::new()).expect("valid config");
    if let Some(r) = &redis {
        crate::support::redis::submit(r, "due", &lines).await;
    }
    let app = support::start_app(&config).await;
    if !on_redis {
        let queue = app.running.transports().memory()[0].clone();
        for line in &lines {
            queue.push_message(line.clone());
        }
    }
    let base = format!("http://{}/metrics", app.running.telemetry_addr);
    assert_due_profile(&base, "due", now, transport).await;
    app.stop().await;
}

/// Deadlines due in 30 s, 200 s, 5 000 s (past the hour) and 100 000 s
/// (past the day) from `now`: what [`assert_due_profile`] expects.
pub(crate) fn due_deadlines(now: i64) -> [i64; 4] {
    [now + 30, now + 200, now + 5_000, now + 100_000]
}

/// Waits (bounded) until the dispatcher at `metrics_url` reports the
/// [`due_deadlines`] of `queue` waiting, then checks every horizon and
/// the earliest deadline.
pub(crate) async fn assert_due_profile(metrics_url: &str, queue: &str, now: i64, transport: &str) {
    let client = reqwest::Client::new();
    let want = [
        ("60", 1),
        ("300", 2),
        ("900", 2),
        ("3600", 2),
        ("14400", 3),
        ("86400", 3),
    ];
    let series = |text: &str, within: &str| {
        let prefix = format!(
            r#"sluicegate_queue_due_messages{{queue="{queue}",within_seconds="{within}"}} "#
        );
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_owned))
    };
    let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = client
            .get(metrics_url)
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("body");
        if series(&text, "86400").as_deref() == Some("3") {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{transport}: the due counts never appeared:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for (within, n) in want {
        assert_eq!(
            series(&text, within).as_deref(),
            Some(n.to_string().as_str()),
            "{transport}: within {within} s\n{text}"
        );
    }
    let earliest = format!(
        "sluicegate_queue_earliest_deadline_timestamp_seconds{{queue=\"{queue}\"}} {}",
        now + 30
    );
    assert!(text.contains(&earliest), "{transport}: {earliest}\n{text}");
}
