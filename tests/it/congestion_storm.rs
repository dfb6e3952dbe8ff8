//! A gateway that answers 429 or 503 to everything for 20 s, as an
//! overloaded endpoint picker or vLLM's admission limit does. Two queues
//! send to it through the blind `constant` gate (whose readings are always
//! "fresh", so only the congestion hold keeps the gateway quiet). Counted at
//! the gateway: after the first wave of rejections, attempts stay at one
//! probe per hold across both queues; nothing is lost; dispatch resumes
//! within one hold of the gateway's recovery.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sluicegate::clock::unix_secs;
use sluicegate::config::Config;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

/// How long the gateway refuses everything.
const STORM: Duration = Duration::from_secs(20);
/// The first wave (everything the window released before the first answer)
/// is allowed this long to come back.
const FIRST_WAVE: Duration = Duration::from_secs(2);
/// `dispatch.congestion_max_backoff` in these tests.
const MAX_HOLD: Duration = Duration::from_secs(8);
const PER_QUEUE: usize = 60;

#[derive(Clone, Copy, Debug)]
enum Refusal {
    TooMany,
    TooManyRetryAfter(u32),
    Unavailable,
}

/// Refuses until `storm_ends`, then answers 200; counts what it saw.
struct Gateway {
    started: Instant,
    refusal: Refusal,
    first_wave: AtomicUsize,
    during_storm: AtomicUsize,
    first_success_after: std::sync::Mutex<Option<Duration>>,
}

/// Mounted as a responder through a shared handle, so the test reads the
/// counts afterwards.
struct Shared(Arc<Gateway>);

impl Respond for Shared {
    fn respond(&self, _request: &Request) -> ResponseTemplate {
        let gateway = &self.0;
        let elapsed = gateway.started.elapsed();
        if elapsed < STORM {
            if elapsed < FIRST_WAVE {
                gateway.first_wave.fetch_add(1, Ordering::SeqCst);
            } else {
                gateway.during_storm.fetch_add(1, Ordering::SeqCst);
            }
            return match gateway.refusal {
                Refusal::TooMany => ResponseTemplate::new(429),
                Refusal::TooManyRetryAfter(s) => {
                    ResponseTemplate::new(429).insert_header("retry-after", s.to_string().as_str())
                }
                Refusal::Unavailable => ResponseTemplate::new(503),
            };
        }
        let mut first = gateway.first_success_after.lock().unwrap();
        if first.is_none() {
            *first = Some(elapsed - STORM);
        }
        ResponseTemplate::new(200).set_body_json(serde_json::json!({
            "id": "cmpl", "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]
        }))
    }
}

async fn storm(refusal: Refusal) {
    let server = MockServer::start().await;
    let gateway = Arc::new(Gateway {
        started: Instant::now(),
        refusal,
        first_wave: AtomicUsize::new(0),
        during_storm: AtomicUsize::new(0),
        first_success_after: std::sync::Mutex::new(None),
    });
    Mock::given(method("POST"))
        .respond_with(Shared(gateway.clone()))
        .mount(&server)
        .await;
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
congestion_backoff = "1s"
congestion_max_backoff = "{}s"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "alpha"
max_sys = 32
gate_type = "constant"
[[queue]]
queue_name = "beta"
max_sys = 32
gate_type = "constant"
"#,
        server.uri(),
        MAX_HOLD.as_secs()
    );
    let config = Config::from_toml_str(&toml, &Default::default()).unwrap();
    let app = support::start_app(&config).await;
    let deadline = unix_secs() + 3600;
    for (q, queue) in app.running.transports().memory().iter().enumerate() {
        for i in 0..PER_QUEUE {
            queue.push_message(
                serde_json::json!({"id": format!("q{q}-{i}"), "deadline": deadline,
                    "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
                .to_string(),
            );
        }
    }
    let queues = app.running.transports().memory().to_vec();
    support::wait_until(
        STORM + Duration::from_secs(30),
        "every message answered",
        || queues.iter().map(|q| q.result_count()).sum::<usize>() == 2 * PER_QUEUE,
    )
    .await;
    let first_wave = gateway.first_wave.load(Ordering::SeqCst);
    let during = gateway.during_storm.load(Ordering::SeqCst);
    let resumed = gateway.first_success_after.lock().unwrap().unwrap();
    println!(
        "{refusal:?}: first wave {first_wave}, attempts in the remaining {:?} of the storm {during}, \
         first success {resumed:?} after recovery",
        STORM - FIRST_WAVE
    );
    // The blind gate released its whole window (2 × 32) before the first
    // answer; within the same 2 s at most a probe or two follow.
    assert!(first_wave <= 64 + 2, "first wave {first_wave}");
    // Then one probe per hold across both queues: holds of at least 0.5 s
    // doubling to 4–8 s (or Retry-After) leave room for a handful in 18 s.
    assert!(
        during <= 12,
        "{during} attempts during the storm after the first wave"
    );
    // Dispatch resumes within one hold of the recovery.
    assert!(
        resumed <= MAX_HOLD + Duration::from_secs(1),
        "resumed after {resumed:?}"
    );
    // Nothing lost: every message has exactly one 200 result.
    for queue in &queues {
        let results = queue.results();
        assert_eq!(results.len(), PER_QUEUE);
        assert!(
            results.iter().all(|r| r.status_code == Some(200)),
            "{results:?}"
        );
        assert!(queue.dead_letters().is_empty());
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_without_retry_after_gets_one_probe_per_backoff() {
    storm(Refusal::TooMany).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_with_retry_after_gets_one_probe_per_retry_after() {
    storm(Refusal::TooManyRetryAfter(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_with_retry_after_zero_still_backs_off() {
    storm(Refusal::TooManyRetryAfter(0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_storm_gets_one_probe_per_backoff() {
    storm(Refusal::Unavailable).await;
}
