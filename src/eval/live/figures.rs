//! The live eval's figures, pure: interactive requests as the client timed
//! them in, `ΔV`, `ρ` and harvest against the batch-free baseline out; the
//! spread over repeats and the verdict.

use serde::Serialize;

use crate::eval::Spread;
use crate::eval::score::{self, Slo, ratio};
use crate::sim::runner::quantile;

/// One interactive request as the client saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timing {
    /// Seconds from the run's start to the request being sent.
    pub sent_s: f64,
    /// Seconds to the first streamed token; `None` when none came (an
    /// error, a refusal, a timeout).
    pub ttft_s: Option<f64>,
    /// The request's own p95 gap between streamed tokens, seconds; `None`
    /// with fewer than two tokens.
    pub itl_p95_s: Option<f64>,
    /// The request's mean gap between streamed tokens, seconds; `None`
    /// with fewer than two tokens.
    pub itl_mean_s: Option<f64>,
    /// Seconds from sending to the last streamed token; `None` when none
    /// came.
    pub last_token_s: Option<f64>,
    /// Output tokens received.
    pub output_tokens: u64,
    /// Prompt tokens, as the engine counted them (0 when it did not say).
    pub prompt_tokens: u64,
    /// Whether the request completed with a 2xx and every token.
    pub ok: bool,
}

impl Timing {
    /// Whether the request met the SLO: completed, TTFT and its own p95
    /// inter-token gap within bounds. A failed request is a violation.
    pub fn meets(&self, slo: Slo) -> bool {
        self.ok
            && self.ttft_s.is_some_and(|t| t <= slo.ttft_s)
            && self.itl_p95_s.is_none_or(|i| i <= slo.itl_s)
    }
}

/// p95 of a request's inter-token gaps (`None` under two tokens).
pub fn itl_p95(token_times_s: &[f64]) -> Option<f64> {
    let mut gaps: Vec<f64> = token_times_s.windows(2).map(|w| w[1] - w[0]).collect();
    quantile(&mut gaps, 0.95)
}

/// The interactive figures of one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RunFigures {
    /// Requests timed.
    pub requests: usize,
    /// TTFT p50, seconds (failed requests count with their time to failure
    /// as a lower bound; they are violations either way).
    pub ttft_p50_s: f64,
    /// TTFT p99, seconds.
    pub ttft_p99_s: f64,
    /// p99 over requests of their p95 ITL, seconds.
    pub itl_p99_s: f64,
    /// Requests violating the SLO, percent.
    pub violations_pct: f64,
}

impl RunFigures {
    /// Figures of `timings` under `slo`; `give_up_s` is what a request
    /// without a first token counts as its TTFT.
    pub fn of(timings: &[Timing], slo: Slo, give_up_s: f64) -> Self {
        let mut ttfts: Vec<f64> = (timings.iter())
            .map(|t| t.ttft_s.unwrap_or(give_up_s))
            .collect();
        let mut itls: Vec<f64> = timings.iter().filter_map(|t| t.itl_p95_s).collect();
        let violations = timings.iter().filter(|t| !t.meets(slo)).count();
        Self {
            requests: timings.len(),
            ttft_p50_s: quantile(&mut ttfts, 0.50).unwrap_or(0.0),
            ttft_p99_s: quantile(&mut ttfts, 0.99).unwrap_or(0.0),
            itl_p99_s: quantile(&mut itls, 0.99).unwrap_or(0.0),
            violations_pct: if timings.is_empty() {
                0.0
            } else {
                100.0 * violations as f64 / timings.len() as f64
            },
        }
    }
}

/// A contender's run scored against the baseline of the same repeat.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LiveScore {
    /// Batch output tokens per second over the run.
    pub batch_tokens_per_s: f64,
    /// Of the slack: batch tokens/s over (the ungated run's total token
    /// rate − the baseline's interactive token rate); `None` without an
    /// ungated run to measure the engine's capacity.
    pub harvest: Option<f64>,
    /// `ΔV`: violations minus the baseline's, percentage points.
    pub delta_v_pp: f64,
    /// `ρ` of TTFT p99.
    pub rho_ttft: f64,
    /// `ρ` of ITL p99.
    pub rho_itl: f64,
    /// The run's own figures.
    pub interactive: RunFigures,
}

/// `run` against `baseline`; `slack_tokens_per_s` is the engine's token
/// rate left over by the baseline's interactive traffic, when known.
pub fn score(
    baseline: &RunFigures,
    run: &RunFigures,
    batch_tokens_per_s: f64,
    slack_tokens_per_s: Option<f64>,
) -> LiveScore {
    LiveScore {
        batch_tokens_per_s,
        harvest: slack_tokens_per_s
            .filter(|s| *s > 0.0)
            .map(|s| batch_tokens_per_s / s),
        delta_v_pp: run.violations_pct - baseline.violations_pct,
        rho_ttft: ratio(run.ttft_p99_s, baseline.ttft_p99_s),
        rho_itl: ratio(run.itl_p99_s, baseline.itl_p99_s),
        interactive: *run,
    }
}

/// Whether a score keeps the budget the gate-quality tables publish (the
/// simulator's rule, [`score::within_budget`]).
pub fn within_budget(s: &LiveScore, slo: Slo) -> bool {
    score::within_budget(
        s.delta_v_pp,
        s.rho_ttft,
        s.rho_itl,
        s.interactive.itl_p99_s,
        slo,
    )
}

/// A contender over the repeats.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Batch tokens/s.
    pub batch_tokens_per_s: Spread,
    /// Harvest of the slack (repeats that had an ungated run).
    pub harvest: Option<Spread>,
    /// `ΔV`, pp.
    pub delta_v_pp: Spread,
    /// `ρ` TTFT p99.
    pub rho_ttft: Spread,
    /// `ρ` ITL p99.
    pub rho_itl: Spread,
    /// Repeats within the budget, of `runs`.
    pub within: usize,
    /// Repeats.
    pub runs: usize,
}

impl Summary {
    /// Over `scores` (one per repeat).
    pub fn of(scores: &[LiveScore], slo: Slo) -> Self {
        let spread = |f: fn(&LiveScore) -> f64| Spread::of(scores.iter().map(f));
        let harvests: Vec<f64> = scores.iter().filter_map(|s| s.harvest).collect();
        Self {
            batch_tokens_per_s: spread(|s| s.batch_tokens_per_s),
            harvest: (!harvests.is_empty()).then(|| Spread::of(harvests)),
            delta_v_pp: spread(|s| s.delta_v_pp),
            rho_ttft: spread(|s| s.rho_ttft),
            rho_itl: spread(|s| s.rho_itl),
            within: scores.iter().filter(|s| within_budget(s, slo)).count(),
            runs: scores.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(ttft: Option<f64>, itl: Option<f64>, ok: bool) -> Timing {
        Timing {
            sent_s: 0.0,
            ttft_s: ttft,
            itl_p95_s: itl,
            itl_mean_s: itl,
            last_token_s: ttft,
            output_tokens: 32,
            prompt_tokens: 250,
            ok,
        }
    }

    #[test]
    fn a_request_meets_the_slo_only_when_it_completed_in_time() {
        let slo = Slo::default();
        assert!(timing(Some(0.1), Some(0.02), true).meets(slo));
        assert!(
            !timing(Some(0.6), Some(0.02), true).meets(slo),
            "slow first token"
        );
        assert!(
            !timing(Some(0.1), Some(0.06), true).meets(slo),
            "slow tokens"
        );
        assert!(!timing(Some(0.1), Some(0.02), false).meets(slo), "failed");
        assert!(!timing(None, None, false).meets(slo), "no token");
        assert!(
            timing(Some(0.1), None, true).meets(slo),
            "one token: no gap"
        );
    }

    #[test]
    fn itl_p95_is_of_the_gaps() {
        assert_eq!(itl_p95(&[1.0]), None);
        let times: Vec<f64> = (0..21).map(|i| f64::from(i) * 0.01).collect();
        let p95 = itl_p95(&times).expect("20 gaps");
        assert!((p95 - 0.01).abs() < 1e-9, "{p95}");
    }

    #[test]
    fn figures_count_failures_as_violations_and_censored_ttfts() {
        let mut timings = vec![timing(Some(0.1), Some(0.01), true); 98];
        timings.push(timing(None, None, false));
        timings.push(timing(Some(0.7), Some(0.01), true));
        let f = RunFigures::of(&timings, Slo::default(), 30.0);
        assert_eq!(f.requests, 100);
        assert!((f.violations_pct - 2.0).abs() < 1e-9);
        assert!((f.ttft_p99_s - 0.7).abs() < 1e-9, "{f:?}");
        let all = RunFigures::of(&[timing(None, None, false)], Slo::default(), 30.0);
        assert_eq!(all.ttft_p99_s, 30.0);
    }

    #[test]
    fn a_score_is_against_the_baseline_of_its_repeat() {
        let base = RunFigures {
            requests: 500,
            ttft_p50_s: 0.03,
            ttft_p99_s: 0.1,
            itl_p99_s: 0.02,
            violations_pct: 0.2,
        };
        let run = RunFigures {
            ttft_p99_s: 0.11,
            itl_p99_s: 0.03,
            violations_pct: 0.6,
            ..base
        };
        let s = score(&base, &run, 300.0, Some(600.0));
        assert!((s.delta_v_pp - 0.4).abs() < 1e-9);
        assert!((s.rho_ttft - 1.1).abs() < 1e-9);
        assert_eq!(s.harvest, Some(0.5));
        assert!(within_budget(&s, Slo::default()));
        let worse = score(
            &base,
            &RunFigures {
                violations_pct: 0.8,
                ..run
            },
            300.0,
            None,
        );
        assert!(!within_budget(&worse, Slo::default()));
        assert_eq!(worse.harvest, None);
        let summary = Summary::of(&[s, worse], Slo::default());
        assert_eq!((summary.within, summary.runs), (1, 2));
        assert_eq!(summary.harvest.map(|h| h.max), Some(0.5));
    }
}
