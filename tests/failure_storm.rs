//! Failure storms below HTTP (issue 22, item 2): a gateway that resets
//! every connection, one whose port is closed, and one that never answers
//! until the attempt times out. Each is a sign the pool cannot take work,
//! like a 429, so it must hold every queue on the gateway with the same
//! growing backoff and single probe: the attempts the gateway sees stay at
//! a few per backoff period whatever the backlog. Before the fix these
//! failures got only per-request backoff, and with a backlog the attempt
//! rate grew with it (issue 22: 228 attempts/s mean, 1 090/s peak with
//! 2 000 queued).
//!
//! Attempts are counted at the scripted server (a real loopback socket)
//! where there is one; the closed port has no server, so there the
//! application's own `sluicegate_requests_sent_total` is sampled. Limits
//! are the issue's targets (mean ≤ 2 attempts/s, peak ≤ one window per
//! second) with no wall-clock speed thresholds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluicegate::config::Config;
use support::failing::{FailingGateway, Failure, per_second};

/// The window: `max_sys` of the one queue, through the blind `constant`
/// gate (always a fresh reading, so only the hold keeps the gateway quiet).
const WINDOW: usize = 32;

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .try_into()
        .unwrap()
}

fn config(gateway: &str) -> Config {
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{gateway}"
attempt_timeout = "1s"
connect_timeout = "1s"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
congestion_max_backoff = "8s"
shutdown_grace = "2s"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "storm"
max_sys = {WINDOW}
gate_type = "constant"
"#
    );
    Config::from_toml_str(&toml, &Default::default()).unwrap()
}

/// `sluicegate_requests_sent_total` of the queue.
fn sent(app: &support::App) -> usize {
    let text = app.running.metrics.encode();
    let prefix = "sluicegate_requests_sent_total{queue=\"storm\"} ";
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as usize)
}

/// Runs `queued` messages against `url` for `span`; returns the attempts
/// per second, read from `server` when there is one, else from the app's
/// sent counter sampled every 100 ms.
async fn storm(
    url: &str,
    server: Option<&FailingGateway>,
    queued: usize,
    span: Duration,
) -> Vec<usize> {
    let app = support::start_app(&config(url)).await;
    let queue = app.running.transports().memory()[0].clone();
    let deadline = unix_now() + 3600;
    let start = Instant::now();
    for i in 0..queued {
        queue.push_message(
            serde_json::json!({"id": format!("m{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string(),
        );
    }
    let mut samples = vec![(start, 0usize)];
    while start.elapsed() < span {
        tokio::time::sleep(Duration::from_millis(100)).await;
        samples.push((Instant::now(), sent(&app)));
    }
    let per_second = match server {
        Some(server) => per_second(&server.attempts(), start, span),
        None => {
            // Rebuild one instant per attempt from the sampled counter.
            let mut at = Vec::new();
            for pair in samples.windows(2) {
                at.extend(std::iter::repeat_n(
                    pair[1].0,
                    pair[1].1.saturating_sub(pair[0].1),
                ));
            }
            per_second(&at, start, span)
        }
    };
    app.stop().await;
    // Nothing answered, nothing lost: every message is still waiting.
    assert_eq!(queue.result_count(), 0, "{:?}", queue.results());
    assert!(queue.dead_letters().is_empty());
    assert_eq!(queue.unsettled().len(), queued);
    per_second
}

fn check(what: &str, per_second: &[usize]) {
    let total: usize = per_second.iter().sum();
    let mean = total as f64 / per_second.len() as f64;
    let peak = per_second.iter().copied().max().unwrap_or(0);
    println!(
        "{what}: {total} attempts in {} s, mean {mean:.2}/s, peak {peak}/s; per second {per_second:?}",
        per_second.len()
    );
    assert!(total > 0, "{what}: the gateway saw no attempt at all");
    assert!(mean <= 2.0, "{what}: mean {mean:.2} attempts/s");
    // The first wave is the window released before the first failure
    // came back; the first probe follows a hold of at least 1 s (half of
    // the default `congestion_backoff`, 2 s), in a later second.
    assert!(peak <= WINDOW, "{what}: peak {peak} attempts/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_with_2000_queued_sees_a_few_attempts_per_backoff() {
    let server = FailingGateway::start(Failure::Reset).await;
    let counts = storm(&server.url, Some(&server), 2000, Duration::from_secs(60)).await;
    check("reset, 2000 queued, 60 s", &counts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_a_congestion_signal() {
    // A port nothing listens on: every connect is refused at once.
    let url = format!("http://127.0.0.1:{}", support::free_port());
    let counts = storm(&url, None, 500, Duration::from_secs(30)).await;
    check("connect refused, 500 queued, 30 s", &counts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_hangs_past_the_attempt_timeout_is_a_congestion_signal() {
    let server = FailingGateway::start(Failure::Hang).await;
    // The first wave alone is 32 attempts: over 30 s it leaves room for
    // the probes within the mean of 2/s.
    let counts = storm(&server.url, Some(&server), 500, Duration::from_secs(30)).await;
    check("hang past attempt_timeout 1s, 500 queued, 30 s", &counts);
}

/// A reset is a failed attempt: it is counted in the result's `attempts`
/// (and toward `max_attempts`), and the message is tried again once the
/// hold has passed, from the same message, not a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_hit_a_reset_is_counted() {
    let server = FailingGateway::start(Failure::ResetThenOk(2)).await;
    let app = support::start_app(&config(&server.url)).await;
    let queue = app.running.transports().memory()[0].clone();
    queue.push_message(
        serde_json::json!({"id": "once", "deadline": unix_now() + 600,
            "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
        .to_string(),
    );
    // Two holds of 1–2 s and 2–4 s, then the answer.
    support::wait_until(Duration::from_secs(30), "the message answered", || {
        queue.result_count() == 1
    })
    .await;
    app.stop().await;
    let result = &queue.results()[0];
    assert_eq!(result.status_code, Some(200), "{result:?}");
    assert_eq!(result.attempts, 3, "{result:?}");
    assert_eq!(server.count(), 3);
}
