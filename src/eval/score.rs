//! Gate-quality figures of one run against its batch-free twin: harvest
//! `H`, excess SLO violations `ΔV`, tail inflation `ρ`, and the dynamics
//! (reaction, recovery, oscillation). Pure: reports in, numbers out.

use serde::Serialize;

use super::scenario::Scenario;
use crate::sim::config::EngineConfig;
use crate::sim::engine::RequestClass;
use crate::sim::runner::{BatchSpec, RunReport, SeriesPoint, quantile};

/// The interactive SLO: a request meets it when its TTFT and its own p95
/// inter-token latency are within these bounds (vLLM bucket edges).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    /// TTFT bound, seconds.
    pub ttft_s: f64,
    /// Bound on a request's p95 ITL, seconds.
    pub itl_s: f64,
}

impl Default for Slo {
    fn default() -> Self {
        Self {
            ttft_s: 0.5,
            itl_s: 0.05,
        }
    }
}

/// Interactive figures of one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Interactive {
    /// TTFT p99, seconds.
    pub ttft_p99_s: f64,
    /// p99 over requests of their p95 ITL, seconds.
    pub itl_p99_s: f64,
    /// Requests violating the SLO (refusals included), percent.
    pub violations_pct: f64,
}

impl Interactive {
    /// The interactive figures of `run` under `slo`.
    pub fn of(run: &RunReport, slo: Slo) -> Self {
        Self {
            ttft_p99_s: run
                .ttft_quantile(RequestClass::Interactive, 0.99)
                .unwrap_or(0.0),
            itl_p99_s: run
                .itl_p95_quantile(RequestClass::Interactive, 0.99)
                .unwrap_or(0.0),
            violations_pct: 100.0
                * run.slo_violation_rate(RequestClass::Interactive, slo.ttft_s, slo.itl_s),
        }
    }
}

/// What one contender did in one scenario on one seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Score {
    /// `H`: batch tokens generated / slack tokens.
    pub harvest: f64,
    /// `H*`: batch tokens generated / the physical bound's tokens
    /// ([`PhysicalBound`]).
    pub harvest_bound: f64,
    /// `ΔV`: interactive SLO violations minus the baseline's, percentage points.
    pub delta_v_pp: f64,
    /// `ρ` of interactive TTFT p99.
    pub rho_ttft: f64,
    /// `ρ` of interactive ITL p99.
    pub rho_itl: f64,
    /// Batch output tokens generated per simulated second.
    pub batch_tokens_per_s: f64,
    /// Seconds from the 3× step until batch in-flight halved (step scenario).
    pub reaction_s: Option<f64>,
    /// Seconds from the end of the disturbance until batch throughput is
    /// back to 90 % of what it was before (blackout, long-context).
    pub recovery_s: Option<f64>,
    /// Coefficient of variation of batch in-flight under constant load
    /// (steady scenario, after a minute of warm-up).
    pub oscillation_cv: Option<f64>,
    /// Share of the run's 1 s samples with no batch request in the pool
    /// (the backlog never runs out, so this is time the dispatcher left
    /// the pool without batch work).
    pub batch_idle_fraction: f64,
    /// 429 and 503 answers, batch and interactive.
    pub rejections: u64,
    /// Preemptions over the pool.
    pub preemptions: u64,
    /// Batch requests released while metrics had been dark for longer than
    /// `max_staleness` (must be 0).
    pub dark_dispatches: u64,
    /// The run's interactive figures.
    pub interactive: Interactive,
}

/// Ratio of two tail figures; 1 when both are zero.
pub(crate) fn ratio(with: f64, without: f64) -> f64 {
    if without > 0.0 {
        with / without
    } else if with > 0.0 {
        f64::INFINITY
    } else {
        1.0
    }
}

/// Slack tokens: `∫ max(0, Θ − θ_int(t)) dt` over the baseline's samples,
/// with `θ_int` the interactive token rate served without batch.
pub fn slack_tokens(baseline: &RunReport, capacity_tokens_per_s: f64) -> f64 {
    baseline
        .series
        .windows(2)
        .map(|w| {
            let dt = w[1].t - w[0].t;
            let rate = (w[1].interactive_tokens_total - w[0].interactive_tokens_total) as f64 / dt;
            (capacity_tokens_per_s - rate).max(0.0) * dt
        })
        .sum()
}

/// An upper bound on the batch output tokens a pool can add to an
/// interactive load, from the engine's step model
/// (`d = c0 + c1·P + c2·N_dec + c3·Σctx`), for a batch of the given mean
/// lengths, assuming:
///
/// - while a replica serves interactive requests, every step lasts at most
///   the ITL SLO `τ` (each interactive request then meets its ITL bound);
///   the fewest steps are steps of exactly `τ`, each paying `c0` once, and
///   the interactive requests' own work (prefill, decode, context, as in
///   the batch-free baseline) comes first;
/// - the rest of the step time carries batch work at its mean cost per
///   output token `k` (its prompt's prefill, its decodes and their context,
///   spread evenly over steps: a perfectly paced dispatcher);
/// - while a replica has no interactive work (the baseline's idle time),
///   steps are free: `n / (c0 + n·k)` tokens per second with `n` as many
///   batch sequences as fit (`max_num_seqs`, KV for their prompts, the
///   step token budget);
/// - the pool is one resource (routing could move work between replicas),
///   and interactive requests are present only as long as in the baseline
///   (under the bound they would stay longer, leaving less free time: so
///   this only raises the bound).
///
/// Preemption, chunking limits and scheduling order are ignored, which also
/// only raises the bound. No dispatcher meets the SLO step by step above
/// it; the per-request p95 SLO allows a request 5 % of slow gaps, so a
/// gate can exceed it by a few percent at most.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhysicalBound {
    /// Model time one batch output token costs on average, seconds.
    pub cost_per_token_s: f64,
    /// Batch tokens per second of a replica without interactive work.
    pub free_tokens_per_s: f64,
    /// Fixed cost of a step, seconds.
    pub step_overhead_s: f64,
    /// Longest step while interactive requests run (the ITL SLO), seconds.
    pub step_limit_s: f64,
}

impl PhysicalBound {
    /// The bound for `batch` on `engine` replicas under `slo`.
    pub fn new(engine: &EngineConfig, batch: &BatchSpec, slo: Slo) -> Self {
        let m = &engine.step;
        let (p, o) = (batch.prompt_mean, batch.output_mean.max(1.0));
        // A request of prompt p and output o: one prefill of p tokens (its
        // last step samples the first token), then o − 1 decodes whose
        // contexts are p + 1 … p + o − 1. Means over the lognormal output
        // length: E[o²] = ō²(1 + cv²).
        let o2 = o * o * (1.0 + batch.output_cv * batch.output_cv);
        let per_request_ms = m.c1_ms_per_prefill_token * p
            + m.c4_ms_per_prefill_context * p * p * (1.0 + batch.prompt_cv * batch.prompt_cv) / 2.0
            + m.c2_ms_per_decode_seq * (o - 1.0)
            + m.c3_ms_per_context_token * ((o - 1.0) * p + (o2 - o) / 2.0);
        let k = per_request_ms / o / 1000.0;
        let c0 = m.c0_ms / 1000.0;
        // As many batch sequences as fit a free replica: KV for their
        // prompts alone (the smallest footprint) and the step budget with
        // each decode's share of prefill (p / o tokens per output token).
        let kv_tokens = f64::from(engine.block_size) * f64::from(engine.num_gpu_blocks);
        let n = f64::from(engine.max_num_seqs)
            .min((kv_tokens / p.max(1.0)).floor())
            .min(f64::from(engine.max_num_batched_tokens) / (1.0 + p / o))
            .max(1.0);
        Self {
            cost_per_token_s: k,
            free_tokens_per_s: n / (c0 + n * k),
            step_overhead_s: c0,
            step_limit_s: slo.itl_s,
        }
    }

    /// Batch tokens that fit in `replica_s` replica-seconds of which
    /// `busy_s` carried interactive requests whose own work took `work_s`
    /// (model time without `c0`).
    pub fn tokens(&self, replica_s: f64, busy_s: f64, work_s: f64) -> f64 {
        let busy = busy_s.clamp(0.0, replica_s);
        let steps_overhead = busy * self.step_overhead_s / self.step_limit_s;
        let constrained = ((busy - steps_overhead - work_s) / self.cost_per_token_s)
            .clamp(0.0, busy * self.free_tokens_per_s);
        constrained + (replica_s - busy) * self.free_tokens_per_s
    }
}

/// The physical bound's batch tokens over the batch-free `baseline` of a
/// pool of `replicas`, sample interval by sample interval.
pub fn bound_tokens(baseline: &RunReport, bound: &PhysicalBound, replicas: usize) -> f64 {
    baseline
        .series
        .windows(2)
        .map(|w| {
            let dt = w[1].t - w[0].t;
            bound.tokens(
                dt * replicas as f64,
                w[1].interactive_busy_s_total - w[0].interactive_busy_s_total,
                w[1].interactive_work_s_total - w[0].interactive_work_s_total,
            )
        })
        .sum()
}

/// What one run is scored against: its scenario, the batch-free baseline
/// of the same seed, and that baseline's slack and bound.
#[derive(Debug, Clone, Copy)]
pub struct Against<'a> {
    /// The scenario.
    pub scenario: &'a Scenario,
    /// The batch-free run of the same scenario and seed.
    pub baseline: &'a RunReport,
    /// Slack tokens of that baseline ([`slack_tokens`]).
    pub slack: f64,
    /// The physical bound's tokens ([`bound_tokens`]).
    pub bound: f64,
    /// The SLO.
    pub slo: Slo,
}

/// Whether a run keeps the headline budget: `ΔV ≤ 0.5` pp,
/// `ρ(TTFT p99) ≤ 1.2`, and `ρ(ITL p99) ≤ 1.2` unless interactive ITL p99
/// is within the SLO anyway (a ratio over a tiny baseline tail says
/// nothing then).
pub fn within_budget(
    delta_v_pp: f64,
    rho_ttft: f64,
    rho_itl: f64,
    itl_p99_s: f64,
    slo: Slo,
) -> bool {
    delta_v_pp <= 0.5 && rho_ttft <= 1.2 && (rho_itl <= 1.2 || itl_p99_s <= slo.itl_s)
}

/// Scores `run` against the batch-free baseline of the same scenario and seed.
pub fn score(against: &Against<'_>, run: &RunReport, dark_dispatches: u64) -> Score {
    let Against {
        scenario,
        baseline,
        slack,
        bound,
        slo,
    } = *against;
    let base = Interactive::of(baseline, slo);
    let with = Interactive::of(run, slo);
    let batch_tokens = run.tokens_generated.1 as f64;
    let per = |total: f64| {
        if total > 0.0 {
            batch_tokens / total
        } else {
            0.0
        }
    };
    Score {
        harvest: per(slack),
        harvest_bound: per(bound),
        delta_v_pp: with.violations_pct - base.violations_pct,
        rho_ttft: ratio(with.ttft_p99_s, base.ttft_p99_s),
        rho_itl: ratio(with.itl_p99_s, base.itl_p99_s),
        batch_tokens_per_s: batch_tokens / run.duration_s,
        reaction_s: scenario.step_at.and_then(|at| reaction(&run.series, at)),
        recovery_s: scenario
            .disturbance
            .and_then(|window| recovery(&run.series, window)),
        oscillation_cv: (scenario.shape == super::scenario::Shape::Steady)
            .then(|| oscillation(&run.series, 60.0))
            .flatten(),
        batch_idle_fraction: batch_idle_fraction(&run.series),
        rejections: (run.rejected(RequestClass::Interactive) + run.rejected(RequestClass::Batch))
            as u64,
        preemptions: run.preemptions,
        dark_dispatches,
        interactive: with,
    }
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Share of `series`' samples with no batch request in the pool (0 for
/// an empty series).
pub fn batch_idle_fraction(series: &[SeriesPoint]) -> f64 {
    if series.is_empty() {
        return 0.0;
    }
    let idle = series.iter().filter(|p| p.batch_in_flight == 0).count();
    idle as f64 / series.len() as f64
}

/// Seconds from `at` until batch in-flight is at most half its mean over
/// the minute before; `None` with (almost) nothing in flight before, or if
/// it never halves.
pub fn reaction(series: &[SeriesPoint], at: f64) -> Option<f64> {
    let before = mean(
        series
            .iter()
            .filter(|p| p.t >= at - 60.0 && p.t < at)
            .map(|p| f64::from(p.batch_in_flight)),
    )?;
    if before < 2.0 {
        return None;
    }
    series
        .iter()
        .find(|p| p.t >= at && f64::from(p.batch_in_flight) <= before / 2.0)
        .map(|p| p.t - at)
}

/// Batch tokens per second between two samples.
fn batch_rate(a: &SeriesPoint, b: &SeriesPoint) -> f64 {
    (b.batch_tokens_total - a.batch_tokens_total) as f64 / (b.t - a.t).max(1e-9)
}

/// Seconds from the end of `window` until the batch token rate over the
/// last 10 s is back to 90 % of its mean over the minute before the window.
pub fn recovery(series: &[SeriesPoint], [start, end]: [f64; 2]) -> Option<f64> {
    let first = series.iter().position(|p| p.t >= start - 60.0)?;
    let last = series.iter().position(|p| p.t >= start)?;
    if last <= first {
        return None;
    }
    let before = batch_rate(&series[first], &series[last]);
    if before <= 0.0 {
        return None;
    }
    let from = series.iter().position(|p| p.t >= end)?;
    (from..series.len()).find_map(|i| {
        let back = series[..=i]
            .iter()
            .rposition(|p| p.t <= series[i].t - 10.0)?;
        (batch_rate(&series[back], &series[i]) >= 0.9 * before).then(|| series[i].t - end)
    })
}

/// Coefficient of variation of batch in-flight after `warmup` seconds.
pub fn oscillation(series: &[SeriesPoint], warmup: f64) -> Option<f64> {
    let v: Vec<f64> = series
        .iter()
        .filter(|p| p.t >= warmup)
        .map(|p| f64::from(p.batch_in_flight))
        .collect();
    let m = mean(v.iter().copied())?;
    if m <= 0.0 {
        return None;
    }
    let var = mean(v.iter().map(|x| (x - m).powi(2)))?;
    Some(var.sqrt() / m)
}

/// TTFT p99 of interactive requests arriving in consecutive `bucket_s`
/// windows: `(window end, p99)`, for charts.
pub fn ttft_p99_over_time(run: &RunReport, bucket_s: f64) -> Vec<(f64, f64)> {
    let mut buckets: Vec<Vec<f64>> = vec![Vec::new(); (run.duration_s / bucket_s).ceil() as usize];
    for r in run
        .records
        .iter()
        .filter(|r| r.class == RequestClass::Interactive)
    {
        let Some(ttft) = r.ttft() else { continue };
        let i = ((r.arrival / bucket_s) as usize).min(buckets.len().saturating_sub(1));
        if let Some(b) = buckets.get_mut(i) {
            b.push(ttft);
        }
    }
    buckets
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut b)| quantile(&mut b, 0.99).map(|q| ((i + 1) as f64 * bucket_s, q)))
        .collect()
}

/// Interactive requests judged and those violating `slo`, by arrival in
/// consecutive `bucket_s` windows: `(window end, judged, violated)`.
pub fn violations_over_time(run: &RunReport, slo: Slo, bucket_s: f64) -> Vec<(f64, u32, u32)> {
    let n = (run.duration_s / bucket_s).ceil() as usize;
    let mut counts = vec![(0u32, 0u32); n];
    for r in run
        .records
        .iter()
        .filter(|r| r.class == RequestClass::Interactive)
    {
        let Some(violated) = run.slo_verdict(r, slo.ttft_s, slo.itl_s) else {
            continue;
        };
        let i = ((r.arrival / bucket_s) as usize).min(n.saturating_sub(1));
        if let Some((judged, bad)) = counts.get_mut(i) {
            *judged += 1;
            *bad += u32::from(violated);
        }
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, (judged, bad))| ((i + 1) as f64 * bucket_s, judged, bad))
        .collect()
}

/// Interactive arrivals per second in consecutive `bucket_s` windows.
pub fn interactive_rate_over_time(run: &RunReport, bucket_s: f64) -> Vec<(f64, f64)> {
    let n = (run.duration_s / bucket_s).ceil() as usize;
    let mut counts = vec![0usize; n];
    for r in run
        .records
        .iter()
        .filter(|r| r.class == RequestClass::Interactive)
    {
        let i = ((r.arrival / bucket_s) as usize).min(n.saturating_sub(1));
        if let Some(c) = counts.get_mut(i) {
            *c += 1;
        }
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(i, c)| ((i + 1) as f64 * bucket_s, c as f64 / bucket_s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t: f64, in_flight: u32, tokens: u64) -> SeriesPoint {
        SeriesPoint {
            t,
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            saturation: 0.0,
            flow_control_queue: 0,
            interactive_in_flight: 0,
            batch_in_flight: in_flight,
            batch_released_total: 0,
            interactive_tokens_total: 0,
            batch_tokens_total: tokens,
            preemptions_total: 0,
            interactive_work_s_total: 0.0,
            interactive_busy_s_total: 0.0,
            observation_age: None,
        }
    }

    #[test]
    fn reaction_is_the_time_until_in_flight_halves() {
        let series: Vec<SeriesPoint> = (0..200)
            .map(|t| {
                let t = f64::from(t);
                let inflight = if t < 100.0 {
                    40
                } else if t < 103.0 {
                    30
                } else {
                    10
                };
                point(t, inflight, 0)
            })
            .collect();
        assert_eq!(reaction(&series, 100.0), Some(3.0));
        let flat: Vec<SeriesPoint> = (0..200).map(|t| point(f64::from(t), 0, 0)).collect();
        assert_eq!(reaction(&flat, 100.0), None);
    }

    #[test]
    fn recovery_waits_for_ninety_percent_of_the_rate_before() {
        // 100 tokens/s, nothing during [100, 160), then 100 tokens/s again.
        let mut total = 0;
        let series: Vec<SeriesPoint> = (0..300)
            .map(|t| {
                let t = f64::from(t);
                if !(100.0..160.0).contains(&t) {
                    total += 100;
                }
                point(t, 0, total)
            })
            .collect();
        // The 10 s window first holds 90 % of the old rate 8 s after the end
        // (8 s of full rate, 1 s of the gap, sampled once a second).
        let r = recovery(&series, [100.0, 160.0]).unwrap();
        assert!((8.0..=11.0).contains(&r), "{r}");
    }

    #[test]
    fn oscillation_of_a_constant_is_zero() {
        let series: Vec<SeriesPoint> = (0..200).map(|t| point(f64::from(t), 7, 0)).collect();
        assert_eq!(oscillation(&series, 60.0), Some(0.0));
    }

    #[test]
    fn idle_fraction_counts_samples_without_batch_in_flight() {
        let series: Vec<SeriesPoint> = (0..10)
            .map(|t| point(f64::from(t), if t % 4 == 0 { 0 } else { 3 }, 0))
            .collect();
        // Samples 0, 4 and 8 are idle.
        assert!((batch_idle_fraction(&series) - 0.3).abs() < 1e-12);
        assert_eq!(batch_idle_fraction(&[]), 0.0);
    }

    #[test]
    fn physical_bound_of_a_hand_computed_case() {
        // c0 10 ms, 0.1 ms per prefill token, 0.1 ms per decode, no context
        // cost; batch of exactly 10 prompt and 10 output tokens; τ = 50 ms.
        let mut engine = EngineConfig::default();
        engine.step.c0_ms = 10.0;
        engine.step.c1_ms_per_prefill_token = 0.1;
        engine.step.c2_ms_per_decode_seq = 0.1;
        engine.step.c3_ms_per_context_token = 0.0;
        let batch = BatchSpec {
            prompt_mean: 10.0,
            prompt_cv: 0.0,
            output_mean: 10.0,
            output_cv: 0.0,
            ..BatchSpec::default()
        };
        let b = PhysicalBound::new(&engine, &batch, Slo::default());
        // Per request: 10 prefill tokens (1 ms) + 9 decodes (0.9 ms) for
        // 10 output tokens: 0.19 ms per token.
        assert!((b.cost_per_token_s - 0.000_19).abs() < 1e-12);
        // Free replica: n = min(256 seqs, 131072 / 10 KV, 2048 / 2) = 256;
        // 256 / (10 ms + 256 × 0.19 ms) = 256 / 58.64 ms.
        assert!((b.free_tokens_per_s - 256.0 / 0.058_64).abs() < 1e-6);
        // One second busy with interactive work of 200 ms: 20 steps of
        // 50 ms pay 200 ms of c0, leaving 600 ms for batch at 0.19 ms each.
        let busy = b.tokens(1.0, 1.0, 0.2);
        assert!((busy - 0.6 / 0.000_19).abs() < 1e-6, "{busy}");
        // A second replica idle for that second adds a free second.
        let two = b.tokens(2.0, 1.0, 0.2);
        assert!((two - (0.6 / 0.000_19 + 256.0 / 0.058_64)).abs() < 1e-6);
        // Interactive work beyond what the steps can hold: no batch at all.
        assert_eq!(b.tokens(1.0, 1.0, 0.9), 0.0);
    }

    #[test]
    fn budget_needs_itl_within_ratio_or_slo() {
        let slo = Slo::default();
        assert!(within_budget(0.5, 1.2, 1.2, 0.09, slo));
        assert!(!within_budget(0.51, 1.0, 1.0, 0.01, slo));
        assert!(!within_budget(0.0, 1.21, 1.0, 0.01, slo));
        // ITL tail inflated but still under the SLO: within.
        assert!(within_budget(0.0, 1.0, 1.5, 0.049, slo));
        assert!(!within_budget(0.0, 1.0, 1.5, 0.051, slo));
    }

    #[test]
    fn ratio_handles_zero_baselines() {
        assert_eq!(ratio(0.0, 0.0), 1.0);
        assert_eq!(ratio(2.0, 1.0), 2.0);
        assert!(ratio(1.0, 0.0).is_infinite());
    }
}
