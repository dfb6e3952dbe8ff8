//! The dispatcher's observer, window and congestion hold together, on
//! tokio's paused clock: time moves only when the test says so, so the
//! window's refills and the 429 hold are checked to the millisecond, with
//! no sleeps and no flakiness.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::congestion::{CongestionHold, CongestionPolicy};
use super::observe::observe_loop;
use super::pace::{Pace, PaceUnit};
use super::state::{SendKind, Shared};
use super::{DispatchSettings, QueueDispatcher, RetryPolicy};
use crate::gate::{Budget, DispatchGate, FailClosed, GateError, Observation};
use crate::gateway::{GatewayClient, GatewaySettings, Target};
use crate::queue::MemoryQueue;
use crate::telemetry::Metrics;

const POLL: Duration = Duration::from_millis(100);

/// A gate whose reading the test sets: headroom and the instant the data
/// describes (re-reading the same data keeps the same instant).
#[derive(Debug)]
struct Scripted(Arc<Mutex<Observation>>);

impl DispatchGate for Scripted {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        let o = self
            .0
            .lock()
            .map(|o| o.clone())
            .map_err(|_| GateError::SourceUnavailable("poisoned".into()));
        Box::pin(std::future::ready(o))
    }

    fn kind(&self) -> &'static str {
        "scripted"
    }
}

fn reading(d: f64, taken_at: Instant) -> Observation {
    let mut o = Observation::open(Budget::saturating(d), taken_at);
    o.sees_own_load = true;
    o
}

fn shared(gate: Arc<Mutex<Observation>>) -> Arc<Shared> {
    shared_with(gate, None)
}

fn shared_with(gate: Arc<Mutex<Observation>>, pace: Option<Pace>) -> Arc<Shared> {
    shared_on(Arc::new(MemoryQueue::new("q")), gate, pace)
}

fn shared_on(
    queue: Arc<MemoryQueue>,
    gate: Arc<Mutex<Observation>>,
    pace: Option<Pace>,
) -> Arc<Shared> {
    let settings = DispatchSettings {
        max_sys: 10.0,
        poll_interval: POLL,
        max_staleness: Duration::from_secs(60),
        pace,
        ..DispatchSettings::default()
    };
    let config = QueueDispatcher {
        queue,
        gate: Arc::new(FailClosed::new(
            Box::new(Scripted(gate)),
            settings.max_staleness,
        )),
        gateway: GatewayClient::new(GatewaySettings::default()).expect("client"),
        target: Target::new("http://127.0.0.1:9", "/v1/completions", None).expect("target"),
        retry: RetryPolicy::default(),
        congestion: Arc::new(CongestionHold::new(CongestionPolicy {
            initial_backoff: Duration::from_secs(2),
            max_backoff: Duration::from_secs(60),
        })),
        pool: Default::default(),
        settings,
        metrics: Metrics::new().queue("q"),
        labels: BTreeMap::new(),
        traces: None,
        relay: crate::relay::Relay::default(),
    };
    Arc::new(Shared::new(config))
}

/// Lets the observer run one poll (and whatever it wakes).
async fn poll() {
    tokio::time::advance(POLL).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

fn send(shared: &Shared, units: u64) -> Option<SendKind> {
    let mut window = shared.window();
    let mut last = None;
    for _ in 0..units {
        last = shared.record_send(&mut window, Instant::now(), 1, 1);
        last?;
    }
    last
}

#[tokio::test(start_paused = true)]
async fn the_window_refills_on_a_fresh_reading_only() {
    let data = Arc::new(Mutex::new(reading(0.5, Instant::now())));
    let shared = shared(data.clone());
    let stop = CancellationToken::new();
    let observer = tokio::spawn(observe_loop(shared.clone(), stop.clone()));
    poll().await;
    // N = 10 × 0.5 = 5.
    assert_eq!(shared.room(Instant::now()), 5);
    assert_eq!(send(&shared, 5), Some(SendKind::Normal));
    assert_eq!(shared.room(Instant::now()), 0);
    // The same data read again, poll after poll, releases nothing.
    for _ in 0..5 {
        poll().await;
        assert_eq!(shared.room(Instant::now()), 0);
    }
    // Newer data that still counts our 5 in flight: window = 5 + N.
    *data.lock().expect("lock") = reading(0.3, Instant::now());
    poll().await;
    assert_eq!(shared.room(Instant::now()), 3);
    stop.cancel();
    observer.await.expect("observer ends");
}

#[tokio::test(start_paused = true)]
async fn finished_requests_of_a_reading_that_counts_them_are_refilled_before_the_next() {
    // A slow source: its data stays the same, poll after poll.
    let mut counting = reading(0.5, Instant::now());
    counting.counts_own_requests = true;
    counting.max_sys = Some(10.0);
    let data = Arc::new(Mutex::new(counting));
    let shared = shared(data.clone());
    let stop = CancellationToken::new();
    let observer = tokio::spawn(observe_loop(shared.clone(), stop.clone()));
    poll().await;
    assert_eq!(send(&shared, 5), Some(SendKind::Normal));
    assert_eq!(shared.room(Instant::now()), 0);
    poll().await;
    shared.window().finished(Instant::now(), 2);
    // No new data, but two of ours sent after it have finished.
    assert_eq!(shared.room(Instant::now()), 2);
    assert_eq!(send(&shared, 2), Some(SendKind::Normal));
    assert_eq!(shared.room(Instant::now()), 0);
    assert_eq!(
        shared.window().in_flight(),
        5,
        "never above the reading's 5"
    );
    stop.cancel();
    observer.await.expect("observer ends");
}

#[tokio::test(start_paused = true)]
async fn a_paced_window_releases_one_request_per_pace_interval() {
    let data = Arc::new(Mutex::new(reading(0.5, Instant::now())));
    let pace = Pace::new(PaceUnit::Requests, 20.0, 1.0).expect("valid");
    let shared = shared_with(data.clone(), Some(pace));
    let stop = CancellationToken::new();
    let observer = tokio::spawn(observe_loop(shared.clone(), stop.clone()));
    poll().await;
    // N = 5, but one request at a time, one per 50 ms.
    assert_eq!(shared.room(Instant::now()), 1);
    assert_eq!(send(&shared, 1), Some(SendKind::Normal));
    assert_eq!(shared.room(Instant::now()), 0);
    assert_eq!(send(&shared, 1), None, "the pace holds the second");
    let now = Instant::now();
    let wake = shared.next_look(now);
    assert!(
        wake > now && wake <= now + Duration::from_millis(50),
        "the receiver wakes for the pace, not the poll"
    );
    tokio::time::advance(Duration::from_millis(50)).await;
    assert_eq!(shared.room(Instant::now()), 1);
    let mut sent = 1;
    for _ in 0..20 {
        if send(&shared, 1).is_some() {
            sent += 1;
        }
        tokio::time::advance(Duration::from_millis(50)).await;
    }
    assert_eq!(sent, 5, "the window still bounds the total");
    stop.cancel();
    observer.await.expect("observer ends");
}

#[tokio::test(start_paused = true)]
async fn a_429_holds_the_window_shut_until_the_hold_ends_then_one_probe() {
    let data = Arc::new(Mutex::new(reading(1.0, Instant::now())));
    let shared = shared(data.clone());
    let stop = CancellationToken::new();
    let observer = tokio::spawn(observe_loop(shared.clone(), stop.clone()));
    poll().await;
    assert_eq!(send(&shared, 1), Some(SendKind::Normal));
    let sent_at = Instant::now();
    // The gateway answers 429 with `Retry-After: 0`.
    let hold = {
        let mut window = shared.window();
        window.finished(Instant::now(), 1);
        window.congested(Instant::now());
        shared
            .config
            .congestion
            .lock()
            .signal(Instant::now(), sent_at, Some(Duration::ZERO), 0.0)
    };
    assert_eq!(
        hold,
        Duration::from_secs(1),
        "half of the 2 s step, no jitter"
    );
    // Fresh readings every poll (a blind gate's are always fresh) do not
    // reopen it during the hold.
    for _ in 0..9 {
        *data.lock().expect("lock") = reading(1.0, Instant::now());
        poll().await;
        assert_eq!(shared.room(Instant::now()), 0);
    }
    *data.lock().expect("lock") = reading(1.0, Instant::now());
    poll().await;
    // The hold is over: one probe, not a window.
    assert_eq!(shared.room(Instant::now()), 1);
    assert_eq!(send(&shared, 1), Some(SendKind::Probe));
    assert_eq!(shared.room(Instant::now()), 0);
    assert_eq!(send(&shared, 1), None, "a second probe waits for the first");
    // The probe's answer clears the congestion: the window is back.
    shared.config.congestion.lock().answered(Instant::now());
    assert_eq!(shared.room(Instant::now()), 9);
    stop.cancel();
    observer.await.expect("observer ends");
}

/// Issue 36: a request released under the shared window's lease, whose
/// process paused (or waited on the queue) past the lease before it went
/// out, was sent on units another replica may hold by then. It is not sent
/// now: its room goes back and it waits for a lease again.
#[tokio::test(start_paused = true)]
async fn a_request_whose_lease_lapsed_after_its_release_is_not_sent() {
    use super::receive::{Release, check, release};
    use super::send::send_and_settle;
    let queue = Arc::new(MemoryQueue::new("q"));
    let data = Arc::new(Mutex::new(reading(1.0, Instant::now())));
    let shared = shared_on(queue.clone(), data, None);
    let stop = CancellationToken::new();
    let observer = tokio::spawn(observe_loop(shared.clone(), stop.clone()));
    poll().await;
    // The keeper's sync granted 3 units, usable for 1.8 s (a 2 s lease).
    let lapses = Instant::now() + Duration::from_millis(1800);
    shared.config.pool.window().set_cap(3, lapses);
    let deadline = crate::clock::unix_secs() + 3600;
    queue.push_message(format!(
        r#"{{"id":"a","deadline":{deadline},"payload":{{"model":"m","prompt":"p"}}}}"#
    ));
    let delivery = shared
        .queue()
        .receive(1, Duration::from_secs(60), Duration::ZERO)
        .await
        .expect("receive")
        .pop()
        .expect("a delivery");
    let (results, mut settled) = tokio::sync::mpsc::channel(4);
    let ready = check(&shared, delivery, &results).await.expect("valid");
    let shutdown = CancellationToken::new();
    let Release::Go(ticket, kind) = release(&shared, &ready, &shutdown).await else {
        panic!("released under the lease");
    };
    assert_eq!(shared.window().in_flight(), 1);
    // The process pauses past the lease before the request goes out.
    tokio::time::advance(Duration::from_secs(3)).await;
    let worker = tokio::spawn(send_and_settle(
        shared.clone(),
        ready,
        ticket,
        kind,
        shutdown.clone(),
        CancellationToken::new(),
        results,
    ));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(shared.metrics().sent.get(), 0, "sent on a lapsed lease");
    assert_eq!(shared.window().in_flight(), 0, "its room went back");
    // It waits for room under a new lease; at shutdown it goes back to the
    // queue unsent.
    shutdown.cancel();
    worker.await.expect("worker ends");
    assert_eq!(shared.metrics().sent.get(), 0);
    assert!(settled.try_recv().is_err(), "no result: it was not sent");
    assert_eq!(queue.pending_len(), 1, "back in the queue");
    stop.cancel();
    observer.await.expect("observer ends");
}

#[test]
fn a_timed_out_last_attempt_is_marked_in_the_result() {
    use crate::gateway::AttemptFailure;
    let deadline = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3600;
    let body = format!(r#"{{"id":"a","deadline":{deadline},"payload":{{}}}}"#);
    let message = crate::request::parse_message(body.as_bytes()).expect("valid");
    let timed_out = super::send::failure_result(&message, &AttemptFailure::Timeout, 3);
    assert!(timed_out.timed_out);
    assert_eq!(timed_out.attempts, 3);
    let reset = super::send::failure_result(&message, &AttemptFailure::Reset("rst".into()), 1);
    assert!(!reset.timed_out);
}
