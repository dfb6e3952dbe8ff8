//! Gate-quality figures of one run against its batch-free twin: harvest
//! `H`, excess SLO violations `ΔV`, tail inflation `ρ`, and the dynamics
//! (reaction, recovery, oscillation). Pure: reports in, numbers out.

use serde::Serialize;

use super::scenario::Scenario;
use crate::sim::engine::RequestClass;
use crate::sim::runner::{RunReport, SeriesPoint, quantile};

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

/// What one contender did in one scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Score {
    /// `H`: batch tokens generated / slack tokens.
    pub harvest: f64,
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
fn ratio(with: f64, without: f64) -> f64 {
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

/// Scores `run` against the batch-free `baseline` of the same scenario.
pub fn score(
    scenario: &Scenario,
    baseline: &RunReport,
    run: &RunReport,
    slack: f64,
    slo: Slo,
    dark_dispatches: u64,
) -> Score {
    let base = Interactive::of(baseline, slo);
    let with = Interactive::of(run, slo);
    let batch_tokens = run.tokens_generated.1 as f64;
    Score {
        harvest: if slack > 0.0 {
            batch_tokens / slack
        } else {
            0.0
        },
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
    fn ratio_handles_zero_baselines() {
        assert_eq!(ratio(0.0, 0.0), 1.0);
        assert_eq!(ratio(2.0, 1.0), 2.0);
        assert!(ratio(1.0, 0.0).is_infinite());
    }
}
