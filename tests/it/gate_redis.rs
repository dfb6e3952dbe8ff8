//! The `redis` gate against a real `redis-server` on a free loopback port.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::support::redis::RedisServer;
use serde_json::json;
use sluicegate::clock::unix_secs_f64;
use sluicegate::config::GateSpec;
use sluicegate::gate::{FailClosed, GateContext, build_gate};

const STALENESS: Duration = Duration::from_secs(2);

/// A reading after the cache had time to refresh (it serves the previous
/// reading while a refresh runs).
async fn fresh(g: &FailClosed) -> sluicegate::gate::Observation {
    // Past the TTL, so the next call starts a refresh.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = g.observe().await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    g.observe().await
}

fn gate(params: serde_json::Value) -> FailClosed {
    let spec = GateSpec::parse("redis", &params, "test").unwrap();
    let ctx = GateContext::new(None, None, Duration::from_millis(50), STALENESS);
    FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_gate_reads_the_budget_key_and_fails_closed_otherwise() {
    let redis = RedisServer::start();
    let address = format!("127.0.0.1:{}", redis.port);
    let g = gate(json!({"address": address}));

    // Missing key: closed (upstream opens).
    let o = g.observe().await;
    assert_eq!(o.budget.get(), 0.0);
    assert!(!o.source_available, "{o:?}");

    redis.cli(&["SET", "dispatch-gate-budget", "0.4"]);
    let o = fresh(&g).await;
    assert!(
        o.source_available && (o.budget.get() - 0.4).abs() < 1e-12,
        "{o:?}"
    );
    // A bare number has no date and says nothing about our own load.
    assert!(!o.sees_own_load);

    for bad in ["abc", "1.5", "-0.1", "NaN"] {
        redis.cli(&["SET", "dispatch-gate-budget", bad]);
        let o = fresh(&g).await;
        assert_eq!(o.budget.get(), 0.0, "{bad}: {o:?}");
        assert!(!o.source_available, "{bad}");
    }

    // A custom key and the explicit opt-in to upstream's open-on-missing.
    let open = gate(json!({"address": format!("redis://{address}/0"), "budget_key": "other", "missing": "open"}))
        .observe()
        .await;
    assert_eq!(open.budget.get(), 1.0);
    assert!(!open.source_available);

    redis.cli(&["SET", "dispatch-gate-budget", "0.7"]);
    assert!(fresh(&g).await.is_open());
    drop(redis);
    let start = std::time::Instant::now();
    loop {
        let o = g.observe().await;
        if !o.source_available {
            assert_eq!(o.budget.get(), 0.0);
            break;
        }
        assert!(
            start.elapsed() < STALENESS + Duration::from_secs(3),
            "still open: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decision_records_are_dated_acknowledged_and_go_stale() {
    let redis = RedisServer::start();
    let address = format!("127.0.0.1:{}", redis.port);
    let spec = GateSpec::parse("redis", &json!({"address": address}), "test").unwrap();
    let ctx = GateContext::new(None, None, Duration::from_millis(50), STALENESS);
    let replica = ctx.replica.clone();
    let g = FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS);

    let record = json!({"budget": 0.6, "timestamp": unix_secs_f64(), "decision_id": "d-1",
        "sees_own_load": true});
    redis.cli(&["SET", "dispatch-gate-budget", &record.to_string()]);
    let o = fresh(&g).await;
    assert!(o.source_available, "{o:?}");
    assert!((o.budget.get() - 0.6).abs() < 1e-12, "{o:?}");
    assert!(o.sees_own_load);
    // The controller can tell the decision took effect here.
    assert_eq!(
        redis
            .cli(&["HGET", "dispatch-gate-budget:applied", &replica])
            .trim()
            .to_owned(),
        "d-1"
    );

    // A controller that died leaves its last record behind: once its data
    // is older than max_staleness the gate closes instead of trusting it.
    let old = json!({"budget": 0.9, "timestamp": unix_secs_f64() - 10.0, "decision_id": "d-2"});
    redis.cli(&["SET", "dispatch-gate-budget", &old.to_string()]);
    let o = fresh(&g).await;
    assert_eq!(o.budget.get(), 0.0, "{o:?}");
    assert!(!o.source_available);
    // ... and is not acknowledged as applied.
    assert_eq!(
        redis
            .cli(&["HGET", "dispatch-gate-budget:applied", &replica])
            .trim()
            .to_owned(),
        "d-1"
    );

    // A record without a timestamp is refused, never guessed.
    redis.cli(&["SET", "dispatch-gate-budget", r#"{"budget": 0.5}"#]);
    let o = fresh(&g).await;
    assert_eq!(o.budget.get(), 0.0, "{o:?}");
}
