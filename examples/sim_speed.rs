//! Virtual-time speed of the pool simulator: 4 replicas at a busy load
//! (interactive Poisson with diurnal wave and bursts, plus a batch backlog
//! behind a static cap) for 30 simulated minutes.
//!
//! `cargo run --release --example sim_speed [-- SIM_SECONDS]`
#![allow(clippy::print_stdout)] // a benchmark's job is to print its figures

use std::time::Instant;

use sluicegate::sim::config::LoadMode;
use sluicegate::sim::engine::RequestClass;
use sluicegate::sim::runner::{BatchSpec, NoBatch, Scenario, StaticCap, run};

fn main() -> Result<(), sluicegate::sim::SimError> {
    let duration: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1800.0);
    let mut sc = Scenario::new(4);
    sc.duration_s = duration;
    sc.interactive.mode = LoadMode::Poisson;
    sc.interactive.rate_per_replica = 8.0;
    sc.batch = Some(BatchSpec::default());

    for (label, cap) in [
        ("interactive only", None),
        ("+ batch, static cap 64", Some(64u32)),
    ] {
        let wall = Instant::now();
        let report = match cap {
            None => run(&sc, &mut NoBatch)?,
            Some(cap) => run(&sc, &mut StaticCap { cap })?,
        };
        let secs = wall.elapsed().as_secs_f64();
        let i = RequestClass::Interactive;
        println!("{label}:");
        println!(
            "  {duration:.0} simulated s in {secs:.3} wall s = {:.0} simulated s per wall s",
            duration / secs
        );
        println!(
            "  steps {}  requests {}  preemptions {}  steps/wall s {:.0}",
            report.steps,
            report.records.len(),
            report.preemptions,
            report.steps as f64 / secs
        );
        println!(
            "  interactive TTFT p50 {:.3} s p99 {:.3} s, ITL(mean) p50 {:.4} s; tokens/s interactive {:.0} batch {:.0}",
            report.ttft_quantile(i, 0.5).unwrap_or(f64::NAN),
            report.ttft_quantile(i, 0.99).unwrap_or(f64::NAN),
            report.itl_mean_quantile(i, 0.5).unwrap_or(f64::NAN),
            report.generated_tokens_per_s(i),
            report.generated_tokens_per_s(RequestClass::Batch),
        );
    }
    Ok(())
}
