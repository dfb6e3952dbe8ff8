//! Pools: queues that send to the same inference pool share one window,
//! sampled at the gateway. The application runs in process, as `run` does,
//! with two memory queues.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluicegate::config::Config;

/// A gateway that holds each request for `delay` and records the most
/// requests it held at once.
async fn counting_gateway(delay: Duration) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    use axum::routing::post;
    let now = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let total = Arc::new(AtomicUsize::new(0));
    let (n, p, t) = (now.clone(), peak.clone(), total.clone());
    let app = axum::Router::new().route(
        "/v1/completions",
        post(move || {
            let (n, p, t) = (n.clone(), p.clone(), t.clone());
            async move {
                let current = n.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(current, Ordering::SeqCst);
                t.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                n.fetch_sub(1, Ordering::SeqCst);
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), peak, total)
}

fn message(id: &str) -> String {
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    serde_json::json!({"id": id, "deadline": deadline, "payload": {"model": "m", "prompt": "p"}})
        .to_string()
}

/// Two memory queues with the given `[[queue]]` bodies, fast timings.
fn two_queues(gateway: &str, a: &str, b: &str) -> Config {
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "50ms"
receive_wait = "50ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "a"
{a}
[[queue]]
queue_name = "b"
{b}
"#
    );
    Config::from_toml_str(&toml, &BTreeMap::new()).expect("valid config")
}

/// Pushes `n` messages into each queue, waits for every result, stops.
async fn drain_both(config: &Config, n: usize) {
    let app = support::start_app(config).await;
    let queues = app.running.transports().memory().to_vec();
    assert_eq!(queues.len(), 2);
    for (q, name) in queues.iter().zip(["a", "b"]) {
        for i in 0..n {
            q.push_message(message(&format!("{name}-{i}")));
        }
    }
    let qs = queues.clone();
    support::wait_until(
        Duration::from_secs(60),
        "every message answered",
        move || qs.iter().all(|q| q.results().len() == n),
    )
    .await;
    for q in &queues {
        assert!(q.results().iter().all(|r| r.status_code == Some(200)));
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_queues_on_one_pool_never_exceed_one_window_together() {
    // Both queues read a constant gate with max_sys 4: one window of 4 for
    // the pool. Before pools, each queue opened its own and the gateway
    // held 8.
    let (url, peak, total) = counting_gateway(Duration::from_millis(100)).await;
    let gate = "gate_type = \"constant\"\nmax_sys = 4";
    drain_both(&two_queues(&url, gate, gate), 40).await;
    let peak = peak.load(Ordering::SeqCst);
    assert_eq!(total.load(Ordering::SeqCst), 80);
    assert!(
        peak <= 4,
        "peak in flight {peak} over the pool's window of 4"
    );
    assert!(peak >= 3, "the window is used (peak {peak})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_naming_the_same_pool_share_it_across_gateway_urls() {
    // Two URLs of one gateway (127.0.0.1 and localhost) are two pools by
    // default; `pool` names them one.
    let (url, peak, _) = counting_gateway(Duration::from_millis(100)).await;
    let other = url.replace("127.0.0.1", "localhost");
    let a = format!(
        "igw_base_url = \"{other}\"\npool = \"shared\"\ngate_type = \"constant\"\nmax_sys = 3"
    );
    let b = "pool = \"shared\"\ngate_type = \"constant\"\nmax_sys = 3";
    drain_both(&two_queues(&url, &a, b), 30).await;
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= 3,
        "peak in flight {peak} over the pool's window of 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_max_concurrency_caps_the_pool_not_each_queue() {
    let (url, peak, _) = counting_gateway(Duration::from_millis(100)).await;
    let gate = "gate_type = \"local-max-concurrency\"\ngate_params = { limit = 5 }\nmax_sys = 5";
    drain_both(&two_queues(&url, gate, gate), 30).await;
    let peak = peak.load(Ordering::SeqCst);
    assert!(peak <= 5, "peak in flight {peak} over the limit of 5");
    assert!(peak >= 4, "the limit is used (peak {peak})");
}

#[test]
fn pools_default_to_the_gateway_url_and_can_be_named() {
    let config = two_queues(
        "http://user:secret@gw.example:8080/base/",
        "gate_type = \"constant\"",
        "gate_type = \"constant\"\npool = \"p1\"",
    );
    assert_eq!(
        sluicegate::app::pool_name(&config.queues[0]),
        "http://gw.example:8080/base"
    );
    assert_eq!(sluicegate::app::pool_name(&config.queues[1]), "p1");
    let bad = r#"
transport = "memory"
[gateway]
url = "http://gw"
[[queue]]
gate_type = "constant"
pool = "a{b}"
"#;
    let error = Config::from_toml_str(bad, &BTreeMap::new()).unwrap_err();
    assert!(error.to_string().contains("queue[0].pool"), "{error}");
}
