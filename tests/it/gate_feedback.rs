//! The feedback gates (`feedback`, `slo-headroom`) against the live
//! simulator's `/metrics`: they act once per fresh reading, learn from
//! dispatch events, and fail closed when the pages go away.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::support::sim::{flood, small_pool};
use serde_json::{Value, json};
use sluicegate::config::GateSpec;
use sluicegate::gate::{DispatchEvent, FailClosed, GateContext, Observation, build_gate};
use tokio::time::Instant;

const STALENESS: Duration = Duration::from_millis(800);

fn gate(kind: &str, params: Value) -> FailClosed {
    let spec = GateSpec::parse(kind, &params, "test").unwrap();
    let ctx = GateContext::new(None, None, Duration::from_millis(100), STALENESS);
    FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS)
}

/// The first observation dated after `after` (a fresh scrape).
async fn next_reading(gate: &FailClosed, after: Instant) -> Observation {
    let start = std::time::Instant::now();
    loop {
        let o = gate.observe().await;
        if o.taken_at > after || start.elapsed() > Duration::from_secs(5) {
            assert!(o.source_available, "{}", o.reason);
            return o;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

async fn until(gate: &FailClosed, pred: impl Fn(&Observation) -> bool) -> Observation {
    let start = std::time::Instant::now();
    loop {
        let o = gate.observe().await;
        if pred(&o) || start.elapsed() > Duration::from_secs(10) {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_window_grows_with_use_cuts_once_per_burst_and_fails_closed() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let gate = gate(
        "feedback",
        json!({"urls": [url], "jitter": 0, "increase": 1}),
    );
    // max_sys 100 requests: initial window 5, step 1 (pinned: the test is
    // about the rules, not the default step).
    let first = gate.observe().await;
    assert!(first.source_available, "{}", first.reason);
    assert!(close(first.budget.get(), 0.05), "{first:?}");
    assert!(!first.sees_own_load);
    // A re-read of the same scrape changes nothing; an unused window does
    // not grow on the next fresh reading.
    let again = gate.observe().await;
    if again.taken_at == first.taken_at {
        assert_eq!(again.budget, first.budget);
    }
    let o = next_reading(&gate, first.taken_at).await;
    assert!(close(o.budget.get(), 0.05), "{}", o.reason);
    assert!(o.reason.contains("Unused"), "{}", o.reason);
    // Five of ours in flight use the window: it grows by one step.
    let now = Instant::now();
    for _ in 0..5 {
        gate.on_event(DispatchEvent::Sent { at: now, cost: 1 });
    }
    let o = next_reading(&gate, o.taken_at).await;
    assert!(close(o.budget.get(), 0.06), "{}", o.reason);
    // A burst of 30 rejections is one cut: 6 × 0.5.
    for _ in 0..30 {
        gate.on_event(DispatchEvent::Answered {
            at: now,
            sent_at: now,
            status: 429,
            cost: 1,
        });
    }
    let o = next_reading(&gate, o.taken_at).await;
    assert!(close(o.budget.get(), 0.03), "{}", o.reason);
    assert!(o.reason.contains("Congested"), "{}", o.reason);
    // Pages gone: closed and unavailable once the data is stale.
    sim.shutdown().await.unwrap();
    let closed = until(&gate, |o| !o.source_available).await;
    assert!(!closed.source_available, "{closed:?}");
    assert_eq!(closed.budget.get(), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_headroom_admits_initial_when_idle_and_nothing_while_requests_wait() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let gate = gate("slo-headroom", json!({"urls": [url]}));
    let first = gate.observe().await;
    assert!(first.source_available, "{}", first.reason);
    // One request of 100 before the regression is trusted.
    assert!(close(first.budget.get(), 0.01), "{}", first.reason);
    assert!(!first.sees_own_load);
    let _load = flood(&sim, 20, 400).await;
    let o = until(&gate, |o| o.budget.get() == 0.0).await;
    assert_eq!(o.budget.get(), 0.0, "{}", o.reason);
    assert!(o.source_available);
    assert!(o.reason.contains("waiting"), "{}", o.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_gates_compose_and_composite_forwards_events() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let gate = gate(
        "composite",
        json!({"gates": [
            {"gate_type": "feedback", "gate_params": {"urls": [url.clone()], "jitter": 0, "initial_window": 40}},
            {"gate_type": "slo-headroom", "gate_params": {"urls": [url], "initial": 30}}
        ]}),
    );
    let first = gate.observe().await;
    assert!(first.source_available, "{}", first.reason);
    // The tighter of 40 and 30.
    assert!(close(first.budget.get(), 0.30), "{}", first.reason);
    let now = Instant::now();
    for _ in 0..3 {
        gate.on_event(DispatchEvent::Answered {
            at: now,
            sent_at: now,
            status: 503,
            cost: 1,
        });
    }
    // The feedback window was cut to 20 through the composite. The cut
    // shows at the feedback gate's next fresh reading; the two inner
    // gates scrape on their own caches, so a fresher slo-headroom reading
    // can come first: wait for the composite to show it.
    let o = until(&gate, |o| {
        o.taken_at > first.taken_at && close(o.budget.get(), 0.20)
    })
    .await;
    assert!(close(o.budget.get(), 0.20), "{}", o.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_starts_only_at_lulls_of_the_foreign_load() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    // A lull is the lowest load seen: zero, after the idle readings. At
    // most 2 start per lull: the window (5) is not reached from nothing.
    // (Waiting never cuts here: the window stays 5 while the flood waits.)
    let gate = gate(
        "feedback",
        json!({"urls": [url], "jitter": 0, "lull_quantile": 0.0, "lull_readings": 1000, "lull_burst": 2,
               "waiting_threshold": 1000}),
    );
    let idle = gate.observe().await;
    assert!(close(idle.budget.get(), 0.02), "{}", idle.reason);
    assert!(idle.reason.contains("lull: foreign"), "{}", idle.reason);
    // Foreign requests running: no new start (the window itself is kept).
    let _load = flood(&sim, 20, 1500).await;
    let busy = until(&gate, |o| o.budget.get() == 0.0).await;
    assert_eq!(busy.budget.get(), 0.0, "{}", busy.reason);
    assert!(busy.source_available);
    assert!(busy.reason.contains("W = 5.000"), "{}", busy.reason);
    assert!(busy.reason.contains("no start: foreign"), "{}", busy.reason);
    // The same requests counted as ours are no foreign load: a lull again,
    // and 20 of ours + 2 exceed the window, which caps it (the window grows
    // now that it is used, so the budget is W's, whatever W is by then).
    let now = Instant::now();
    for _ in 0..20 {
        gate.on_event(DispatchEvent::Sent { at: now, cost: 1 });
    }
    let ours = until(&gate, |o| o.budget.get() > 0.0).await;
    assert!(
        ours.reason
            .contains("lull: foreign requests per engine 0.00"),
        "{}",
        ours.reason
    );
    let w: f64 = ours.reason["W = ".len()..]
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .expect("the reason starts with the window");
    assert!(
        w >= 5.0 && close(ours.budget.get(), w / 100.0),
        "{}",
        ours.reason
    );
}
