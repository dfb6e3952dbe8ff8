//! What one gate decision and one window check cost on the dispatch path
//! (issue 11, item 8). Figures and the command are in
//! `docs/benchmarks.md`, "Gate cost".
//!
//! - `observe/vllm_warm_cache`: a catalogue `vllm` gate behind
//!   `FailClosed`, reading the real simulator's `/metrics` over loopback,
//!   with a cache TTL and staleness limit of an hour: after one warming
//!   read every iteration is a cache hit, so this is the decision itself
//!   (cache lookup, the parsed reading, budget arithmetic, wrappers), not a
//!   scrape.
//! - `observe/constant`: the `constant` gate behind the same wrapper, as a
//!   floor. (`prometheus-budget` needs a Prometheus server and is left out.)
//! - `window/*`: the per-dispatch window bookkeeping with a live grant:
//!   the bare `Window`, and the same through a pool's lane behind its
//!   mutex (`Pool::window`), as the dispatcher does it.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::json;
use sluicegate::config::{GateSpec, Rounding, Unit};
use sluicegate::dispatch::Pool;
use sluicegate::dispatch::window::{Window, headroom_units};
use sluicegate::gate::{Budget, Capacity, FailClosed, GateContext, Observation, build_gate};
use sluicegate::sim::{SimConfig, spawn_http};
use tokio::time::Instant;

/// Long enough that no iteration of a run re-reads the source or finds
/// the reading stale.
const HOUR: Duration = Duration::from_secs(3600);

/// A catalogue gate of `kind` behind `FailClosed`, as `run` builds it.
fn gate(kind: &str, params: &serde_json::Value) -> FailClosed {
    let spec = GateSpec::parse(kind, params, "bench").expect("gate spec");
    let ctx = GateContext::new(None, None, HOUR, HOUR);
    FailClosed::new(build_gate(&spec, &ctx).expect("gate builds"), HOUR)
}

fn observe(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    // The simulator's front is served by the same runtime, as in the demo.
    let sim = rt
        .block_on(spawn_http(SimConfig::default()))
        .expect("simulator");
    let vllm = gate(
        "vllm",
        &json!({"urls": [format!("{}/metrics", sim.base_url())], "baseline": 0.1}),
    );
    let warm = rt.block_on(vllm.observe());
    assert!(
        warm.source_available,
        "the warming read reached the simulator: {}",
        warm.reason
    );
    let constant = gate("constant", &json!({}));

    let mut group = c.benchmark_group("observe");
    group.bench_function("vllm_warm_cache", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(vllm.observe().await) });
    });
    group.bench_function("constant", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(constant.observe().await) });
    });
    group.finish();
    drop(sim);
}

fn window(c: &mut Criterion) {
    let mut group = c.benchmark_group("window");
    // A grant large enough that no run exhausts it, so every check takes
    // the "allowed" path as a dispatcher with steady budget does; the
    // clock is read per dispatch, as the dispatcher does.
    let start = Instant::now();
    let mut w = Window::new(start, HOUR);
    w.observe(start, u64::MAX / 4, false, true);
    group.bench_function("allows_sent_finished", |b| {
        b.iter(|| {
            let now = Instant::now();
            let ok = w.allows(now, black_box(1));
            w.sent(now, 1);
            w.finished(now, 1);
            black_box(ok)
        });
    });
    assert!(w.allows(Instant::now(), 1), "the grant stayed live");
    // The same through a pool of one lane: lock, check, record, unlock.
    let pool = Pool::new("bench");
    let lane = {
        let mut window = pool.window();
        let lane = window.add_lane(start, HOUR);
        let capacity = Capacity {
            max_sys: 1e15,
            unit: Unit::Requests,
        };
        let full = Observation::open(Budget::new(1.0).expect("budget"), start);
        window.apply(lane, &full, capacity, Rounding::Floor);
        lane
    };
    group.bench_function("pool_lane_allows_sent_finished", |b| {
        b.iter(|| {
            let now = Instant::now();
            let mut window = pool.window();
            let ok = window.allows(lane, now, black_box(1));
            window.sent(now, 1);
            window.finished(now, 1);
            black_box(ok)
        });
    });
    assert!(
        pool.window().allows(lane, Instant::now(), 1),
        "the pool's grant stayed live"
    );
    group.bench_function("headroom_units", |b| {
        b.iter(|| {
            headroom_units(
                black_box(2.0 * 256.0),
                black_box(0.7 - 0.1),
                black_box(Rounding::Floor),
            )
        });
    });
    group.finish();
}

criterion_group!(benches, observe, window);
criterion_main!(benches);
