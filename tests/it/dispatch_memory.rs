//! The whole request path against the in-memory queue and a real HTTP
//! server (wiremock scripts the gateway's answers).

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use sluicegate::clock::unix_secs;
use sluicegate::config::{GatingMode, Rounding, Unit};
use sluicegate::dispatch::{DispatchSettings, QueueDispatcher, RetryPolicy};
use sluicegate::gate::{
    Budget, ConstantGate, DispatchEvent, DispatchGate, FailClosed, GateError,
    LocalMaxConcurrencyGate, Observation,
};
use sluicegate::gateway::{GatewayClient, GatewaySettings, Target};
use sluicegate::queue::{
    AckReport, Completion, Delivery, DeliveryTag, MemoryQueue, NackReason, Queue, QueueError,
};
use sluicegate::result::{ErrorCode, ResultRecord};
use sluicegate::tasks::Tasks;
use sluicegate::telemetry::Metrics;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

fn message(id: &str, deadline_in: i64) -> String {
    serde_json::json!({
        "id": id,
        "deadline": unix_secs() + deadline_in,
        "payload": {"model": "m", "prompt": format!("hello {id}"), "max_tokens": 8}
    })
    .to_string()
}

fn fast_settings() -> DispatchSettings {
    DispatchSettings {
        poll_interval: Duration::from_millis(50),
        receive_wait: Duration::from_millis(50),
        congestion_backoff: Duration::from_millis(100),
        wait_requeue_delay: Duration::from_millis(50),
        shutdown_grace: Duration::from_secs(5),
        ..DispatchSettings::default()
    }
}

struct Harness {
    queue: Arc<MemoryQueue>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    tasks: Tasks,
    task: tokio::task::JoinHandle<()>,
}

impl Harness {
    fn start(
        gateway_url: &str,
        gate: Box<dyn DispatchGate>,
        settings: DispatchSettings,
        retry: RetryPolicy,
    ) -> Self {
        Self::start_on(
            Arc::new(MemoryQueue::new("q")),
            gateway_url,
            gate,
            settings,
            retry,
        )
    }

    fn start_on(
        queue: Arc<MemoryQueue>,
        gateway_url: &str,
        gate: Box<dyn DispatchGate>,
        settings: DispatchSettings,
        retry: RetryPolicy,
    ) -> Self {
        Self::start_through(queue.clone(), queue, gateway_url, gate, settings, retry)
    }

    /// Dispatches from `dispatched` (a wrapper of `queue`, say), while
    /// results are read from `queue`.
    fn start_through(
        queue: Arc<MemoryQueue>,
        dispatched: Arc<dyn Queue>,
        gateway_url: &str,
        gate: Box<dyn DispatchGate>,
        settings: DispatchSettings,
        retry: RetryPolicy,
    ) -> Self {
        let metrics = Arc::new(Metrics::new());
        let dispatcher = QueueDispatcher {
            queue: dispatched,
            gate: Arc::new(FailClosed::new(gate, settings.max_staleness)),
            gateway: GatewayClient::new(GatewaySettings {
                attempt_timeout: Duration::from_secs(5),
                ..GatewaySettings::default()
            })
            .expect("client"),
            target: Target::new(gateway_url, "/v1/completions", None).expect("target"),
            retry,
            congestion: Default::default(),
            pool: Default::default(),
            settings,
            metrics: metrics.queue("q"),
            labels: BTreeMap::new(),
            traces: None,
            relay: sluicegate::relay::Relay::default(),
        };
        let shutdown = CancellationToken::new();
        let tasks = Tasks::new();
        let task = tokio::spawn(dispatcher.run(shutdown.clone(), tasks.clone()));
        Self {
            queue,
            metrics,
            shutdown,
            tasks,
            task,
        }
    }

    async fn wait_for_results(&self, n: usize) -> Vec<ResultRecord> {
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            let results = self.queue.results();
            if results.len() >= n || Instant::now() > give_up {
                return results;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(self) -> Arc<MemoryQueue> {
        self.shutdown.cancel();
        self.task.await.expect("dispatcher ends cleanly");
        self.tasks.stop().await;
        assert!(self.tasks.panicked().is_empty(), "no task panicked");
        self.queue
    }
}

/// A gateway answering every POST with `answer`.
async fn gateway(answer: impl Respond + 'static) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(answer)
        .mount(&server)
        .await;
    server
}

fn no_retry_limit() -> RetryPolicy {
    RetryPolicy {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(100),
        max_attempts: None,
        jitter: true,
    }
}

#[tokio::test]
async fn every_message_gets_exactly_one_result() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/completions"))
        .respond_with(ResponseTemplate::new(200).set_body_string(r#"{"choices":[]}"#))
        .mount(&server)
        .await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        no_retry_limit(),
    );
    for i in 0..200 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    let results = h.wait_for_results(200).await;
    assert_eq!(results.len(), 200);
    let ids: std::collections::HashSet<_> = results.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids.len(), 200);
    assert!(
        results
            .iter()
            .all(|r| r.status_code == Some(200) && r.payload == r#"{"choices":[]}"#)
    );
    let q = h.stop().await;
    assert_eq!(q.pending_len() + q.leased_len(), 0);
    assert_eq!(
        server.received_requests().await.expect("recorded").len(),
        200
    );
}

#[tokio::test]
async fn expired_and_invalid_messages_get_typed_results_and_are_never_sent() {
    let server = gateway(ResponseTemplate::new(200)).await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        no_retry_limit(),
    );
    h.queue.push_message(message("expired", -10));
    h.queue.push_message("{not json");
    h.queue
        .push_message(r#"{"id":"bad-deadline","deadline":"tomorrow","payload":{}}"#);
    h.queue.push_message(
        serde_json::json!({"id":"off-host","deadline": unix_secs()+600,"payload":{},"endpoint":"http://evil.example:9/v1/completions"}).to_string(),
    );
    let results = h.wait_for_results(4).await;
    let by_id: BTreeMap<_, _> = results.iter().map(|r| (r.id.clone(), r.clone())).collect();
    assert_eq!(
        by_id["expired"].error_code,
        Some(ErrorCode::DeadlineExceeded)
    );
    assert_eq!(
        by_id["bad-deadline"].error_code,
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(
        by_id["off-host"].error_code,
        Some(ErrorCode::InvalidRequest)
    );
    let unparsable: Vec<_> = results
        .iter()
        .filter(|r| r.id.starts_with("invalid:"))
        .collect();
    assert_eq!(unparsable.len(), 1);
    assert_eq!(unparsable[0].error_code, Some(ErrorCode::InvalidRequest));
    h.stop().await;
    assert!(
        server
            .received_requests()
            .await
            .expect("recorded")
            .is_empty()
    );
}

/// Answers with the scripted statuses in order, then 200.
struct Script {
    statuses: Vec<(u16, Option<&'static str>)>,
    calls: AtomicUsize,
}

impl Respond for Script {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let i = self.calls.fetch_add(1, Ordering::SeqCst);
        match self.statuses.get(i) {
            Some((status, retry_after)) => {
                let t = ResponseTemplate::new(*status).set_body_string(format!("answer {status}"));
                match retry_after {
                    Some(v) => t.insert_header("Retry-After", *v),
                    None => t,
                }
            }
            None => ResponseTemplate::new(200).set_body_string("ok"),
        }
    }
}

#[tokio::test]
async fn congestion_and_server_errors_are_retried_not_failed() {
    let server = gateway(Script {
        statuses: vec![(429, Some("1")), (503, None), (500, None), (502, None)],
        calls: AtomicUsize::new(0),
    })
    .await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        no_retry_limit(),
    );
    h.queue.push_message(message("r", 3600));
    let results = h.wait_for_results(1).await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].status_code, Some(200));
    // Two congestion requeues do not count as failed attempts; two 5xx do.
    assert_eq!(results[0].attempts, 3);
    let text = h.metrics.encode();
    assert!(
        text.contains(r#"sluicegate_congestion_signals_total{queue="q"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"sluicegate_retries_total{queue="q",reason="failed"} 2"#),
        "{text}"
    );
    h.stop().await;
    assert_eq!(server.received_requests().await.expect("recorded").len(), 5);
}

#[tokio::test]
async fn client_errors_are_final_and_attempts_run_out_into_dead_letters() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/completions"))
        .respond_with(ResponseTemplate::new(400).set_body_string("bad model"))
        .mount(&server)
        .await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        no_retry_limit(),
    );
    h.queue.push_message(message("four-hundred", 3600));
    let results = h.wait_for_results(1).await;
    assert_eq!(results[0].status_code, Some(400));
    assert_eq!(results[0].payload, "bad model");
    h.stop().await;

    let failing = gateway(ResponseTemplate::new(500)).await;
    let h = Harness::start(
        &failing.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        RetryPolicy {
            max_attempts: Some(3),
            ..no_retry_limit()
        },
    );
    h.queue.push_message(message("doomed", 3600));
    let give_up = Instant::now() + Duration::from_secs(20);
    while h.queue.dead_letters().is_empty() && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let q = h.stop().await;
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].last_error.status_code, Some(500));
    assert!(q.results().is_empty());
    assert_eq!(
        failing.received_requests().await.expect("recorded").len(),
        3
    );
}

/// A gate whose reading never gets newer, like a cached metric.
#[derive(Debug)]
struct FrozenGate {
    budget: Budget,
    taken_at: Instant,
}

impl DispatchGate for FrozenGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        let o = Observation::open(self.budget, self.taken_at);
        Box::pin(async move { Ok(o) })
    }
    fn kind(&self) -> &'static str {
        "frozen"
    }
}

#[tokio::test]
async fn one_observation_releases_at_most_n() {
    let server = gateway(ResponseTemplate::new(200)).await;
    // max_SYS 10 × D 0.3 = 3 requests for this one, never refreshed reading.
    let settings = DispatchSettings {
        max_sys: 10.0,
        unit: Unit::Requests,
        rounding: Rounding::Floor,
        max_staleness: Duration::from_secs(600),
        ..fast_settings()
    };
    let h = Harness::start(
        &server.uri(),
        Box::new(FrozenGate {
            budget: Budget::saturating(0.3),
            taken_at: Instant::now(),
        }),
        settings,
        no_retry_limit(),
    );
    for i in 0..10 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    h.wait_for_results(3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        h.queue.results().len(),
        3,
        "no more than N from one reading"
    );
    let q = h.stop().await;
    assert_eq!(q.pending_len(), 7, "the rest stays queued");
}

#[tokio::test]
async fn closed_gate_sends_nothing_and_unreadable_gate_is_closed() {
    #[derive(Debug)]
    struct Broken;
    impl DispatchGate for Broken {
        fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
            Box::pin(async { Err(GateError::SourceUnavailable("down".into())) })
        }
        fn kind(&self) -> &'static str {
            "broken"
        }
    }
    let server = gateway(ResponseTemplate::new(200)).await;
    for gate in [
        Box::new(ConstantGate::new(Budget::ZERO)) as Box<dyn DispatchGate>,
        Box::new(Broken),
    ] {
        let h = Harness::start(&server.uri(), gate, fast_settings(), no_retry_limit());
        h.queue.push_message(message("held", 3600));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(h.queue.results().is_empty());
        let text = h.metrics.encode();
        assert!(
            text.contains(r#"sluicegate_gate_open{queue="q"} 0"#),
            "{text}"
        );
        let q = h.stop().await;
        assert_eq!(q.pending_len(), 1, "message stays queued");
    }
    assert!(
        server
            .received_requests()
            .await
            .expect("recorded")
            .is_empty()
    );
}

/// Issue 22: messages whose deadline passes while the window takes
/// nothing (here a closed gate) are answered within 1 s of it, not when
/// the window opens again. Before, they stayed in the queue unseen. The
/// poll interval is the default 1 s, so this is the deadline sweep's doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_passing_while_the_gate_is_closed_are_answered_within_a_second() {
    let server = gateway(ResponseTemplate::new(200)).await;
    let settings = DispatchSettings {
        shutdown_grace: Duration::from_secs(5),
        ..DispatchSettings::default()
    };
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::new(Budget::ZERO)),
        settings,
        no_retry_limit(),
    );
    let deadline = unix_secs() + 2;
    for i in 0..50 {
        h.queue.push_message(
            serde_json::json!({"id": format!("m{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string(),
        );
    }
    let wall = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs_f64()
    };
    while h.queue.result_count() < 50 {
        assert!(
            wall() < deadline as f64 + 10.0,
            "{} of 50 answered 10 s after the deadline",
            h.queue.result_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let late = wall() - deadline as f64;
    assert!(late >= 0.0, "answered {late:.3} s before the deadline");
    assert!(late <= 1.0, "answered {late:.3} s after the deadline");
    let q = h.stop().await;
    assert!(
        q.results()
            .iter()
            .all(|r| r.error_code == Some(ErrorCode::DeadlineExceeded)),
        "{:?}",
        q.results()
    );
    assert!(
        server
            .received_requests()
            .await
            .expect("recorded")
            .is_empty()
    );
}

/// Counts concurrent requests at the gateway.
struct Concurrency {
    now: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

/// Admission by a local concurrency gate under a wide-open budget: the
/// window lets more through than the gate admits, as with a per-tenant
/// quota, so blocking admission must park the rest. (The local gate's own
/// budget sees our load, so alone it keeps the window at its limit and
/// nothing needs to park.)
#[derive(Debug)]
struct AdmissionOnly(Arc<LocalMaxConcurrencyGate>);

impl DispatchGate for AdmissionOnly {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(std::future::ready(Ok(Observation::open(
            Budget::FULL,
            Instant::now(),
        ))))
    }

    fn admit<'a>(
        &'a self,
        request: sluicegate::gate::AdmissionRequest<'a>,
    ) -> BoxFuture<'a, sluicegate::gate::Admission> {
        self.0.admit(request)
    }

    fn kind(&self) -> &'static str {
        "admission-only"
    }
}

#[tokio::test]
async fn local_max_concurrency_caps_in_flight_and_parks_the_rest() {
    let server = gateway(ResponseTemplate::new(200).set_delay(Duration::from_millis(150))).await;
    let gate = Arc::new(LocalMaxConcurrencyGate::new(3, GatingMode::Blocking));
    let probe = gate.clone();
    let h = Harness::start(
        &server.uri(),
        Box::new(AdmissionOnly(gate)),
        fast_settings(),
        no_retry_limit(),
    );
    for i in 0..12 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    let c = Concurrency {
        now: Arc::new(AtomicUsize::new(0)),
        peak: Arc::new(AtomicUsize::new(0)),
    };
    let give_up = Instant::now() + Duration::from_secs(30);
    let mut saw_parked = false;
    while h.queue.results().len() < 12 && Instant::now() < give_up {
        c.now.store(probe.in_flight(), Ordering::SeqCst);
        c.peak.fetch_max(probe.in_flight(), Ordering::SeqCst);
        saw_parked |= !h
            .metrics
            .encode()
            .contains(r#"sluicegate_parked_requests{queue="q"} 0"#);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        h.queue.results().len(),
        12,
        "gate in flight {}, pending {}, leased {}, metrics:\n{}",
        probe.in_flight(),
        h.queue.pending_len(),
        h.queue.leased_len(),
        h.metrics.encode()
    );
    assert!(c.peak.load(Ordering::SeqCst) <= 3);
    assert!(saw_parked, "blocking mode parks messages at the gate");
    h.stop().await;
}

#[tokio::test]
async fn shutdown_finishes_in_flight_within_grace_and_requeues_the_rest() {
    let server = gateway(ResponseTemplate::new(200).set_delay(Duration::from_millis(300))).await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        fast_settings(),
        no_retry_limit(),
    );
    for i in 0..5 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    // Wait until they are in flight, then stop: all five finish.
    let give_up = Instant::now() + Duration::from_secs(10);
    while server.received_requests().await.expect("recorded").len() < 5 && Instant::now() < give_up
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let q = h.stop().await;
    assert_eq!(q.results().len(), 5);
    assert_eq!(q.leased_len(), 0);

    // A gateway slower than the grace period: requests are abandoned and
    // go back to the queue, nothing is lost.
    let slow = gateway(ResponseTemplate::new(200).set_delay(Duration::from_secs(20))).await;
    let h = Harness::start(
        &slow.uri(),
        Box::new(ConstantGate::default()),
        DispatchSettings {
            shutdown_grace: Duration::from_millis(200),
            ..fast_settings()
        },
        no_retry_limit(),
    );
    for i in 0..3 {
        h.queue.push_message(message(&format!("s{i}"), 3600));
    }
    let give_up = Instant::now() + Duration::from_secs(10);
    while slow.received_requests().await.expect("recorded").len() < 3 && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let q = h.stop().await;
    assert!(q.results().is_empty());
    assert_eq!(q.leased_len(), 0);
    assert_eq!(q.pending_len(), 3, "abandoned requests are requeued");
}

#[tokio::test]
async fn earliest_deadline_goes_first() {
    let server = gateway(ResponseTemplate::new(200)).await;
    let queue = Arc::new(MemoryQueue::new("q"));
    queue.push_message(message("late", 7200));
    queue.push_message(message("early", 600));
    queue.push_message(message("middle", 3600));
    let settings = DispatchSettings {
        max_sys: 1.0,
        ..fast_settings()
    };
    let h = Harness::start_on(
        queue,
        &server.uri(),
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    let results = h.wait_for_results(3).await;
    let order: Vec<_> = results.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(order, vec!["early", "middle", "late"]);
    h.stop().await;
}

#[tokio::test]
async fn a_blind_gate_never_has_more_than_max_sys_in_flight() {
    let (url, peak) = support::counting_gateway(Duration::from_millis(50)).await;
    let settings = DispatchSettings {
        max_sys: 4.0,
        ..fast_settings()
    };
    let h = Harness::start(
        &url,
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    for i in 0..40 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    assert_eq!(h.wait_for_results(40).await.len(), 40);
    h.stop().await;
    let peak = peak.load(Ordering::SeqCst);
    assert!(peak <= 4, "peak in flight {peak} exceeds max_sys");
    assert!(
        peak >= 2,
        "the window is used, not serialised (peak {peak})"
    );
}

/// A gate with a live max_SYS (ready endpoints × concurrency: requests).
#[derive(Debug)]
struct LiveCapacityGate;

impl DispatchGate for LiveCapacityGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        let mut o = Observation::open(Budget::FULL, Instant::now());
        o.max_sys = Some(4.0);
        o.sees_own_load = true;
        Box::pin(std::future::ready(Ok(o)))
    }

    fn kind(&self) -> &'static str {
        "live-capacity"
    }
}

#[tokio::test]
async fn a_token_queue_ignores_a_live_capacity_counted_in_requests() {
    // Before: the live max_SYS of 4 (requests) was read as 4 tokens, and
    // requests of more than 4 tokens stalled the queue forever.
    let server = gateway(ResponseTemplate::new(200).set_body_string("{}")).await;
    let h = Harness::start(
        &server.uri(),
        Box::new(LiveCapacityGate),
        DispatchSettings {
            unit: Unit::Tokens,
            max_sys: 10_000.0,
            ..fast_settings()
        },
        no_retry_limit(),
    );
    for i in 0..20 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    let results = h.wait_for_results(20).await;
    assert_eq!(results.len(), 20, "the token queue stalled");
    assert!(results.iter().all(|r| r.status_code == Some(200)));
    h.stop().await;
}

#[tokio::test]
async fn local_max_concurrency_alone_fills_its_limit() {
    // Its budget is read from our own in-flight work, so it sees our load:
    // the window is in-flight + free slots = the limit. (This run, with
    // equal request durations, also reached the limit before the gate was
    // marked as seeing our load; the unit test in local_concurrency.rs is
    // the one that pins that change.)
    let (url, peak) = support::counting_gateway(Duration::from_millis(200)).await;
    let h = Harness::start(
        &url,
        Box::new(LocalMaxConcurrencyGate::new(6, GatingMode::Blocking)),
        DispatchSettings {
            max_sys: 6.0,
            ..fast_settings()
        },
        no_retry_limit(),
    );
    for i in 0..36 {
        h.queue.push_message(message(&format!("m{i}"), 3600));
    }
    assert_eq!(h.wait_for_results(36).await.len(), 36);
    h.stop().await;
    let peak = peak.load(Ordering::SeqCst);
    assert_eq!(peak, 6, "peak in flight {peak}, limit 6");
}

#[tokio::test]
async fn a_message_waiting_for_room_goes_back_to_the_queue_during_a_long_congestion_hold() {
    // A is sent; B (tokens) does not fit beside it and waits for room,
    // claimed. A's answer is 429 with `Retry-After: 3600`. Before, B sat
    // claimed for the whole hour; now it goes back to the queue (no attempt
    // used) with the hold as its delay.
    let server = gateway(
        ResponseTemplate::new(429)
            .insert_header("retry-after", "3600")
            .set_delay(Duration::from_millis(500)),
    )
    .await;
    let h = Harness::start(
        &server.uri(),
        Box::new(ConstantGate::default()),
        DispatchSettings {
            unit: Unit::Tokens,
            max_sys: 1500.0,
            ..fast_settings()
        },
        no_retry_limit(),
    );
    let big = |id: &str| {
        serde_json::json!({"id": id, "deadline": unix_secs() + 7200,
            "payload": {"model": "m", "prompt": "p", "max_tokens": 1000}})
        .to_string()
    };
    h.queue.push_message(big("a"));
    h.queue.push_message(big("b"));
    let give_up = Instant::now() + Duration::from_secs(10);
    let sent = || async { server.received_requests().await.map_or(0, |r| r.len()) };
    while sent().await == 0 && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A's 429 arrives after 500 ms; B must not stay claimed after it.
    while (h.queue.leased_len() > 0 || h.queue.pending_len() < 2) && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        h.queue.leased_len(),
        0,
        "nothing stays claimed through the hold"
    );
    assert_eq!(h.queue.pending_len(), 2);
    assert!(h.queue.results().is_empty());
    assert_eq!(
        server.received_requests().await.map_or(0, |r| r.len()),
        1,
        "only A reached the gateway"
    );
    h.stop().await;
}

/// Open, and records every event the dispatcher reports.
#[derive(Debug, Default)]
struct Recording(std::sync::Mutex<Vec<DispatchEvent>>);

impl DispatchGate for Recording {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(std::future::ready(Ok(Observation::open(
            Budget::FULL,
            Instant::now(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "recording"
    }

    fn on_event(&self, event: DispatchEvent) {
        self.0.lock().expect("lock").push(event);
    }
}

#[tokio::test]
async fn the_gate_hears_each_attempt_sent_and_answered_with_its_status() {
    // The feedback gates learn their own in-flight work and 429/503s from
    // these events: one `Sent` before each attempt, one `Answered` after.
    let server = gateway(Script {
        statuses: vec![(429, Some("0")), (503, None)],
        calls: AtomicUsize::new(0),
    })
    .await;
    let gate = Arc::new(Recording::default());
    let h = Harness::start(
        &server.uri(),
        Box::new(gate.clone()),
        fast_settings(),
        no_retry_limit(),
    );
    h.queue.push_message(message("e", 3600));
    let results = h.wait_for_results(1).await;
    assert_eq!(results[0].status_code, Some(200));
    h.stop().await;
    let events = gate.0.lock().expect("lock").clone();
    let kinds: Vec<String> = events
        .iter()
        .map(|e| match e {
            DispatchEvent::Sent { cost, .. } => format!("sent {cost}"),
            DispatchEvent::Answered { status, cost, .. } => format!("answered {status} {cost}"),
            DispatchEvent::Failed { .. } => "failed".to_owned(),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "sent 1",
            "answered 429 1",
            "sent 1",
            "answered 503 1",
            "sent 1",
            "answered 200 1"
        ],
        "{events:?}"
    );
    assert!(events[1].is_congestion() && events[3].is_congestion());
    assert!(!events[5].is_congestion());
    // Each answer names when its request was sent.
    for pair in events.chunks(2) {
        let (DispatchEvent::Sent { at, .. }, DispatchEvent::Answered { sent_at, .. }) =
            (pair[0], pair[1])
        else {
            panic!("{pair:?}")
        };
        assert_eq!(at, sent_at);
    }
}

/// A constant gate that counts how often it is read.
#[derive(Debug, Default)]
struct CountingConstant(Arc<AtomicUsize>);

impl DispatchGate for CountingConstant {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Box::pin(std::future::ready(Ok(Observation::open(
            Budget::saturating(1.0),
            Instant::now(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "counting-constant"
    }
}

/// Found with `sluicegate bench hold`: with every unit of a constant gate's
/// window in flight, the receiver asked for a reading, the fresh reading
/// woke the receiver, which found no room and asked again, burning a core
/// for as long as the requests were held. Now a full window is read on
/// demand only after its own work moved; otherwise once per poll interval.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_window_is_not_read_again_and_again_while_nothing_moves() {
    const HOLD: Duration = Duration::from_millis(1500);
    let server = gateway(ResponseTemplate::new(200).set_delay(HOLD)).await;
    let reads = Arc::new(AtomicUsize::new(0));
    let settings = DispatchSettings {
        max_sys: 4.0,
        ..fast_settings()
    };
    let h = Harness::start(
        &server.uri(),
        Box::new(CountingConstant(reads.clone())),
        settings,
        no_retry_limit(),
    );
    for i in 0..4 {
        h.queue.push_message(message(&format!("held-{i}"), 3600));
    }
    let give_up = Instant::now() + Duration::from_secs(10);
    while server.received_requests().await.map_or(0, |r| r.len()) < 4 {
        assert!(Instant::now() < give_up, "the window never filled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = reads.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let during = reads.load(Ordering::Relaxed) - before;
    // One reading per 50 ms poll is 20 in that second; the spin made
    // tens of thousands.
    assert!(during <= 40, "{during} readings in 1 s of a full window");
    assert_eq!(h.wait_for_results(4).await.len(), 4);
    h.stop().await;
}

/// Issue 22: twelve 8 MiB messages, a window of 100 and a byte budget of
/// 32 MiB: never more than four bodies held, so never more than four in
/// flight (before the budget all twelve went at once, and ten 8 MiB
/// messages peaked at 360 MB RSS); every one is answered.
#[tokio::test]
async fn large_bodies_stay_within_the_byte_budget() {
    const MIB: usize = 1 << 20;
    let (url, peak) = support::counting_gateway(Duration::from_millis(300)).await;
    let settings = DispatchSettings {
        max_sys: 100.0,
        max_buffered_bytes: 32 * MIB as u64,
        ..fast_settings()
    };
    let h = Harness::start(
        &url,
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    let prompt = "x".repeat(8 * MIB - 200);
    for i in 0..12 {
        h.queue.push_message(
            serde_json::json!({
                "id": format!("big-{i}"),
                "deadline": unix_secs() + 3600,
                "payload": {"model": "m", "prompt": prompt, "max_tokens": 1}
            })
            .to_string(),
        );
    }
    let results = h.wait_for_results(12).await;
    assert_eq!(results.len(), 12);
    assert!(
        results.iter().all(|r| r.status_code == Some(200)),
        "{results:?}"
    );
    h.stop().await;
    let peak = peak.load(Ordering::SeqCst);
    assert!(peak <= 4, "peak in flight {peak}: over the byte budget");
    assert!(peak >= 2, "the budget is used (peak {peak})");
}

/// A gateway answer: 200 with an empty completion, after `delay`.
fn answered_after(delay: Duration) -> ResponseTemplate {
    ResponseTemplate::new(200)
        .set_body_string(r#"{"choices":[]}"#)
        .set_delay(delay)
}

/// A memory queue `q` holding `n` messages due in an hour.
fn queue_of(n: usize) -> Arc<MemoryQueue> {
    let memory = Arc::new(MemoryQueue::new("q"));
    for i in 0..n {
        memory.push_message(message(&format!("m{i}"), 3600));
    }
    memory
}

/// The `Queue` methods a test queue passes to its `inner` memory queue
/// unchanged (each test queue writes only the ones it alters).
macro_rules! pass_through {
    ($($method:ident),+) => { $(pass_through!(@$method);)+ };
    (@name) => {
        fn name(&self) -> &str {
            self.inner.name()
        }
    };
    (@ack) => {
        fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
            self.inner.ack(completions)
        }
    };
    (@nack) => {
        fn nack(
            &self,
            tag: DeliveryTag,
            delay: Duration,
            reason: NackReason,
        ) -> BoxFuture<'_, Result<(), QueueError>> {
            self.inner.nack(tag, delay, reason)
        }
    };
    (@extend_lease) => {
        fn extend_lease(
            &self,
            tags: Vec<DeliveryTag>,
            lease: Duration,
        ) -> BoxFuture<'_, Result<(), QueueError>> {
            self.inner.extend_lease(tags, lease)
        }
    };
    (@dead_letter) => {
        fn dead_letter(
            &self,
            tag: DeliveryTag,
            last_error: ResultRecord,
        ) -> BoxFuture<'_, Result<(), QueueError>> {
            self.inner.dead_letter(tag, last_error)
        }
    };
    (@backlog) => {
        fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
            self.inner.backlog()
        }
    };
}

/// The memory queue behind a pull that takes `delay` (a Redis claim's
/// round trip, drawn out), counting what the dispatcher does meanwhile.
#[derive(Debug)]
struct SlowPull {
    inner: Arc<MemoryQueue>,
    delay: Duration,
    /// Requests the gateway has received so far.
    sent: Arc<AtomicUsize>,
    /// Pulls during whose second half the gateway received a request.
    overlapped: AtomicUsize,
    /// Pulls running now, and the most at once.
    pulls: AtomicUsize,
    most_pulls: AtomicUsize,
    /// Leased and not yet settled, and the most at once.
    leased: AtomicUsize,
    most_leased: AtomicUsize,
}

impl SlowPull {
    fn settled(&self, n: usize) {
        self.leased.fetch_sub(n, Ordering::SeqCst);
    }
}

impl Queue for SlowPull {
    pass_through!(name, extend_lease, backlog);

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(async move {
            let running = self.pulls.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_pulls.fetch_max(running, Ordering::SeqCst);
            tokio::time::sleep(self.delay / 2).await;
            let halfway = self.sent.load(Ordering::SeqCst);
            tokio::time::sleep(self.delay / 2).await;
            if self.sent.load(Ordering::SeqCst) > halfway {
                self.overlapped.fetch_add(1, Ordering::SeqCst);
            }
            let got = self.inner.receive(max, lease, wait).await;
            if let Ok(deliveries) = &got {
                let now =
                    self.leased.fetch_add(deliveries.len(), Ordering::SeqCst) + deliveries.len();
                self.most_leased.fetch_max(now, Ordering::SeqCst);
            }
            self.pulls.fetch_sub(1, Ordering::SeqCst);
            got
        })
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        self.settled(completions.len());
        self.inner.ack(completions)
    }

    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        self.settled(1);
        self.inner.nack(tag, delay, reason)
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        self.settled(1);
        self.inner.dead_letter(tag, last_error)
    }
}

/// Counts the requests it receives and answers each after 20 ms.
struct CountArrivals(Arc<AtomicUsize>);

impl Respond for CountArrivals {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        self.0.fetch_add(1, Ordering::SeqCst);
        ResponseTemplate::new(200)
            .set_body_string(r#"{"choices":[]}"#)
            .set_delay(Duration::from_millis(20))
    }
}

/// Issue 21: a pull from a slow queue runs beside the sends instead of
/// stalling them (the Redis drain's claim script and the sends it feeds
/// had taken turns). The buffer keeps sending while a pull is out, and
/// one pull runs at a time (what it asked for counts as buffered, so the
/// lookahead bound of `pull_size` holds with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_pull_runs_beside_the_sends_one_pull_at_a_time() {
    let sent = Arc::new(AtomicUsize::new(0));
    let server = gateway(CountArrivals(sent.clone())).await;
    let memory = Arc::new(MemoryQueue::new("q"));
    for i in 0..300 {
        memory.push_message(message(&format!("m{i}"), 3600));
    }
    let slow = Arc::new(SlowPull {
        inner: memory.clone(),
        delay: Duration::from_millis(100),
        sent,
        overlapped: AtomicUsize::new(0),
        pulls: AtomicUsize::new(0),
        most_pulls: AtomicUsize::new(0),
        leased: AtomicUsize::new(0),
        most_leased: AtomicUsize::new(0),
    });
    let settings = DispatchSettings {
        max_sys: 8.0,
        tenant_lookahead: 64,
        receive_batch: 64,
        ..fast_settings()
    };
    let h = Harness::start_through(
        memory,
        slow.clone(),
        &server.uri(),
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    let results = h.wait_for_results(300).await;
    h.stop().await;
    let ids: std::collections::HashSet<_> = results.iter().map(|r| r.id.clone()).collect();
    assert_eq!((results.len(), ids.len()), (300, 300), "one result each");
    let overlapped = slow.overlapped.load(Ordering::SeqCst);
    let most_pulls = slow.most_pulls.load(Ordering::SeqCst);
    let most_leased = slow.most_leased.load(Ordering::SeqCst);
    eprintln!(
        "pulls with sends in their second half: {overlapped}; most leased and unacked {most_leased}"
    );
    assert!(
        overlapped >= 2,
        "sends stalled while pulls ran ({overlapped} overlapped)"
    );
    assert_eq!(most_pulls, 1, "one pull at a time");
}

/// A queue behind one connection lock, as the `sql` transport's `Db` is
/// while it reconnects: a pull holds the lock across its round trip, and
/// the deadline sweep needs it too.
#[derive(Debug)]
struct OneConnection {
    inner: Arc<MemoryQueue>,
    connection: tokio::sync::Mutex<()>,
    round_trip: Duration,
}

impl Queue for OneConnection {
    pass_through!(name, ack, nack, extend_lease, dead_letter, backlog);

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(async move {
            let _held = self.connection.lock().await;
            tokio::time::sleep(self.round_trip).await;
            self.inner.receive(max, lease, wait).await
        })
    }

    fn receive_expired(
        &self,
        max: usize,
        lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(async move {
            let _held = self.connection.lock().await;
            self.inner.receive_expired(max, lease, now_unix).await
        })
    }
}

/// Found in CI (`sql_transport::a_postgres_restart_mid_drain_loses_nothing`
/// stalled at 65 of 300 after the restart): a pull running beside the
/// releases was a future only the receiver polled. When the window filled,
/// the receiver ran the deadline sweep, which waited for the connection
/// lock the unpolled pull held (or had been handed), and nothing moved
/// again. The pull must make progress on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_beside_the_sends_never_waits_for_the_receiver_to_poll_it() {
    let server = gateway(answered_after(Duration::from_millis(50))).await;
    let memory = queue_of(60);
    let locked = Arc::new(OneConnection {
        inner: memory.clone(),
        connection: tokio::sync::Mutex::new(()),
        round_trip: Duration::from_millis(100),
    });
    let settings = DispatchSettings {
        max_sys: 4.0,
        tenant_lookahead: 8,
        receive_batch: 8,
        ..fast_settings()
    };
    let h = Harness::start_through(
        memory,
        locked,
        &server.uri(),
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    let results = h.wait_for_results(60).await;
    assert_eq!(
        results.len(),
        60,
        "the receiver stalled behind its own pull"
    );
    h.stop().await;
}

/// A queue whose every pull after the first never answers (a broker that
/// stopped responding mid-run).
#[derive(Debug)]
struct StuckAfterFirstPull {
    inner: Arc<MemoryQueue>,
    pulls: AtomicUsize,
}

impl Queue for StuckAfterFirstPull {
    pass_through!(name, ack, nack, extend_lease, dead_letter, backlog);

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        if self.pulls.fetch_add(1, Ordering::SeqCst) == 0 {
            return self.inner.receive(max, lease, wait);
        }
        Box::pin(std::future::pending())
    }
}

/// Found reading the drain: a pull running beside the releases was waited
/// for at shutdown until the task tree's root token, which the
/// application cancels only after every dispatcher has returned, so a pull
/// that never answered held the shutdown forever. It is now waited for at
/// most the shutdown grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_that_never_answers_does_not_hold_the_shutdown() {
    let server = gateway(answered_after(Duration::from_millis(20))).await;
    let memory = queue_of(40);
    let stuck = Arc::new(StuckAfterFirstPull {
        inner: memory.clone(),
        pulls: AtomicUsize::new(0),
    });
    let settings = DispatchSettings {
        max_sys: 2.0,
        tenant_lookahead: 8,
        receive_batch: 8,
        shutdown_grace: Duration::from_secs(1),
        ..fast_settings()
    };
    let h = Harness::start_through(
        memory,
        stuck.clone(),
        &server.uri(),
        Box::new(ConstantGate::default()),
        settings,
        no_retry_limit(),
    );
    // The first pull's messages are answered while the second pull hangs.
    let first = h.wait_for_results(8).await.len();
    assert!(first >= 8, "the first pull's messages answered ({first})");
    assert!(
        stuck.pulls.load(Ordering::SeqCst) >= 2,
        "a second pull is out"
    );
    let stopped = tokio::time::timeout(Duration::from_secs(60), h.stop()).await;
    assert!(
        stopped.is_ok(),
        "the drain waited for a pull that never answers"
    );
}
