//! Self-checks of the pool simulator (docs/simulator.md): the properties a
//! real vLLM pool shows, asserted on virtual-time runs with fixed seeds.
//! Figures are printed (`cargo test --test sim_selfcheck -- --nocapture`)
//! and quoted in docs/simulator.md.
#![allow(clippy::print_stdout, clippy::unwrap_used)] // tests print their figures

use sluicegate::sim::config::LoadMode;
use sluicegate::sim::engine::RequestClass::{Batch, Interactive};
use sluicegate::sim::runner::{BatchSpec, NoBatch, RunReport, Scenario, StaticCap, run};

/// A batch-only run of one replica at a fixed concurrency.
fn closed_loop(cap: u32, batch: BatchSpec, blocks: Option<u32>, duration_s: f64) -> RunReport {
    let mut sc = Scenario::new(1);
    sc.duration_s = duration_s;
    sc.batch = Some(batch);
    if let Some(b) = blocks {
        sc.pool.engine.num_gpu_blocks = b;
    }
    run(&sc, &mut StaticCap { cap }).unwrap()
}

#[test]
fn throughput_saturates_at_a_knee_and_itl_grows_with_batch() {
    let caps = [1u32, 2, 4, 8, 16, 32, 64, 128, 256];
    let mut thr = Vec::new();
    let mut itl = Vec::new();
    println!("cap  tokens/s  ITL p50 (s)  TTFT p50 (s)");
    for cap in caps {
        let r = closed_loop(cap, BatchSpec::default(), None, 60.0);
        let t = r.generated_tokens_per_s(Batch);
        let i = r.itl_mean_quantile(Batch, 0.5).unwrap();
        println!(
            "{cap:>4} {t:>9.0} {i:>12.4} {:>12.3}",
            r.ttft_quantile(Batch, 0.5).unwrap()
        );
        thr.push(t);
        itl.push(i);
    }
    // Below the knee, doubling concurrency nearly doubles throughput...
    assert!(thr[1] / thr[0] > 1.8, "{thr:?}");
    assert!(thr[3] / thr[2] > 1.6, "{thr:?}");
    // ...above it, it barely moves.
    assert!(thr[8] / thr[7] < 1.1, "{thr:?}");
    assert!(thr[8] > 5.0 * thr[0], "{thr:?}");
    // ITL grows with the batch.
    assert!(itl[6] > 1.5 * itl[0], "{itl:?}");
    assert!(itl.windows(2).all(|w| w[1] >= w[0] * 0.97), "{itl:?}");
}

#[test]
fn itl_grows_with_context() {
    let spec = |prompt: f64| BatchSpec {
        prompt_mean: prompt,
        prompt_cv: 0.0,
        output_mean: 1000.0,
        output_cv: 0.0,
        ..BatchSpec::default()
    };
    let short = closed_loop(64, spec(64.0), Some(32768), 60.0);
    let long = closed_loop(64, spec(4000.0), Some(32768), 60.0);
    let (s, l) = (
        short.itl_mean_quantile(Batch, 0.5).unwrap(),
        long.itl_mean_quantile(Batch, 0.5).unwrap(),
    );
    println!("ITL p50 at batch 64: prompt 64 -> {s:.4} s, prompt 4000 -> {l:.4} s");
    assert!(l > 1.5 * s, "short {s} long {l}");
    assert_eq!(long.preemptions, 0, "context effect, not KV pressure");
}

fn interactive(replicas: usize, rate_per_replica: f64, duration_s: f64) -> Scenario {
    let mut sc = Scenario::new(replicas);
    sc.duration_s = duration_s;
    sc.interactive.mode = LoadMode::Poisson;
    sc.interactive.rate_per_replica = rate_per_replica;
    sc.interactive.diurnal_amplitude = 0.0;
    sc.interactive.burst_mean_gap_s = 0.0;
    sc
}

#[test]
fn ttft_explodes_once_waiting_persists() {
    println!("rate/s  TTFT p50  TTFT p99  waiting@25%  waiting@end");
    let mut p99 = Vec::new();
    // 1.45× the rates of the first step constants (10, 25, 40), which
    // ran every step 1.45× slower: the same loads relative to the engine.
    for rate in [14.5, 36.0, 58.0] {
        let r = run(&interactive(1, rate, 120.0), &mut NoBatch).unwrap();
        let q = r.series.len() / 4;
        let (w1, w2) = (r.series[q].waiting, r.series.last().unwrap().waiting);
        let (a, b) = (
            r.ttft_quantile(Interactive, 0.5).unwrap(),
            r.ttft_quantile(Interactive, 0.99).unwrap(),
        );
        println!("{rate:>6} {a:>9.3} {b:>9.3} {w1:>12} {w2:>12}");
        p99.push((b, w1, w2));
    }
    assert!(p99[0].0 < 0.5, "light load keeps TTFT low: {p99:?}");
    // Overload: the waiting queue grows without bound and TTFT with it.
    let (b, w1, w2) = p99[2];
    assert!(w2 > 2 * w1.max(10), "waiting persists and grows: {p99:?}");
    assert!(b > 20.0 * p99[0].0 && b > 10.0, "TTFT explodes: {p99:?}");
}

#[test]
fn preemptions_appear_when_kv_runs_out() {
    let spec = BatchSpec {
        prompt_mean: 512.0,
        output_mean: 512.0,
        ..BatchSpec::default()
    };
    let ample = closed_loop(64, spec.clone(), None, 60.0);
    let tight = closed_loop(64, spec, Some(1024), 60.0);
    let kv_max = tight.series.iter().map(|p| p.kv_usage).fold(0.0, f64::max);
    println!(
        "preemptions: 8192 blocks -> {}, 1024 blocks -> {} (peak KV {kv_max:.2}); tokens/s {:.0} vs {:.0}",
        ample.preemptions,
        tight.preemptions,
        ample.generated_tokens_per_s(Batch),
        tight.generated_tokens_per_s(Batch)
    );
    assert_eq!(ample.preemptions, 0);
    assert!(tight.preemptions > 10);
    assert!(kv_max > 0.9);
    assert!(tight.records.iter().any(|r| r.preemptions > 0));
}

/// Interactive load at about a third of capacity on 2 replicas, plus a batch backlog.
fn shared_pool() -> Scenario {
    let mut sc = interactive(2, 8.0, 300.0);
    sc.batch = Some(BatchSpec {
        backlog: 20_000,
        ..BatchSpec::default()
    });
    sc
}

#[test]
fn ungated_backlog_inflates_ttft_p99_and_small_cap_does_not() {
    let sc = shared_pool();
    let base = run(&sc, &mut NoBatch).unwrap();
    let ungated = run(&sc, &mut StaticCap::ungated()).unwrap();
    let capped = run(&sc, &mut StaticCap { cap: 4 }).unwrap();
    let p99 = |r: &RunReport| r.ttft_quantile(Interactive, 0.99).unwrap();
    let (b, u, c) = (p99(&base), p99(&ungated), p99(&capped));
    println!(
        "interactive TTFT p99: baseline {b:.3} s, ungated {u:.3} s ({:.0}x), static cap 4 {c:.3} s ({:.2}x)",
        u / b,
        c / b
    );
    println!(
        "batch tokens/s: ungated {:.0}, static cap 4 {:.0}; SLO violations (0.5 s / 0.05 s): baseline {:.4}, ungated {:.4}, cap 4 {:.4}",
        ungated.generated_tokens_per_s(Batch),
        capped.generated_tokens_per_s(Batch),
        base.slo_violation_rate(Interactive, 0.5, 0.05),
        ungated.slo_violation_rate(Interactive, 0.5, 0.05),
        capped.slo_violation_rate(Interactive, 0.5, 0.05),
    );
    assert!(
        u > 10.0 * b,
        "ungated inflates p99 more than 10x: {b} -> {u}"
    );
    assert!(
        c < 1.5 * b,
        "a small static cap stays near baseline: {b} -> {c}"
    );
    assert!(
        capped.generated_tokens_per_s(Batch) > 100.0,
        "and still harvests batch work"
    );
}
