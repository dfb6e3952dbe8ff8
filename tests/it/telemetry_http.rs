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
    // tests/it/flex.rs reads them.
    for name in METRIC_NAMES.iter().filter(|n| {
        !n.starts_with("sluicegate_pubsub_")
            && !n.starts_with("sluicegate_batch_enqueued_")
            && !n.starts_with("sluicegate_flex_")
            && !n.starts_with("sluicegate_background_")
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
