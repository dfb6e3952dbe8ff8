//! The step model fitted to a real engine's closed-loop sweep (pure).
//!
//! Two stages. **First, closed form.** A closed loop of `c` clients, each
//! sending a `P`-token prompt for exactly `O` tokens after the previous one
//! finished, keeps about `c` sequences decoding and starts about `c / O`
//! prefills per step. The step time `c0 + c1·prefill + c2·seqs +
//! c3·context + c4·prefill·context` then gives, for what a client can time:
//!
//! - **TTFT with one client** (nothing else running): one step that
//!   prefills the prompt, plus the HTTP path, which no step constant
//!   models: `TTFT₁(P) = h + c1·P + c4·P²/2`, with `h` absorbing `c0`.
//!   Three prompt lengths give `c1` and `c4`; two give `c1` alone.
//! - **Mean gap between tokens** at concurrency `c`: every step the
//!   request decodes in also decodes the `c − 1` others and, on average,
//!   `(c − 1) / O` of their prefills:
//!   `ITL(c, P) − (c1·P + c4·P²/2)·(c − 1)/O = c0 + c2·c + c3·c·(P + O/2)`.
//!   Least squares on relative error over the points gives `c0`, `c2`,
//!   `c3`; points at two prompt lengths (and `c > 1`) separate `c2` from
//!   `c3`.
//!
//! A constant the data would make negative is held at zero and the rest
//! refitted: a step cannot get cheaper with more work.
//!
//! **Then, by simulation** ([`refine`]): the closed form ignores how the
//! scheduler batches prefills and queues requests, so the constants are
//! searched (coordinate descent in log space) to minimise the simulator's
//! own error against the engine, point by point: throughput, TTFT p50
//! (plus `h`) and mean ITL.

use serde::{Deserialize, Serialize};

use super::config::{EngineConfig, StepModel};
use super::error::SimError;
use super::sweep::{SweepConfig, SweepPoint, point};

/// What the engine served at one concurrency and prompt length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredPoint {
    /// Clients kept sending, each one request at a time.
    pub concurrency: u32,
    /// Words in each prompt (what the client sent).
    pub prompt_words: usize,
    /// Mean prompt length as the engine counted it, tokens.
    pub prompt_tokens: f64,
    /// Mean prompt length in characters (for the simulator's
    /// `http.chars_per_token`).
    pub prompt_chars: f64,
    /// Output tokens of every request (`ignore_eos`).
    pub output_tokens: u32,
    /// Completed requests measured (sent after the warm-up).
    pub requests: usize,
    /// Requests completed per second after the warm-up.
    pub requests_per_s: f64,
    /// Output tokens per second after the warm-up.
    pub output_tokens_per_s: f64,
    /// Time to first token, median, seconds.
    pub ttft_p50_s: f64,
    /// Time to first token, 99th percentile, seconds.
    pub ttft_p99_s: f64,
    /// Mean gap between a request's tokens, averaged over requests, seconds.
    pub itl_mean_s: f64,
    /// Mean time from sending to the last token, seconds.
    pub latency_mean_s: f64,
}

/// Why no step model could be fitted.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// `c1` needs TTFT at concurrency 1 for two different prompt lengths.
    #[error(
        "the fit needs concurrency 1 at two prompt lengths at least 50 tokens apart (for the prefill cost c1); the sweep has concurrency 1 at {0:?} tokens"
    )]
    NoPrefillSlope(Vec<f64>),
    /// `c0`, `c2`, `c3` need at least three points.
    #[error("the fit needs at least 3 points with a measured inter-token gap, got {0}")]
    TooFewPoints(usize),
    /// The simulator refused the engine.
    #[error(transparent)]
    Sim(#[from] SimError),
}

/// The fitted step constants (jitter is not fitted; the caller's is kept)
/// and how well they explain the points.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    /// The step model.
    pub step: StepModel,
    /// The HTTP path's share of TTFT at concurrency 1, seconds (`h`).
    pub http_s: f64,
    /// Largest relative error of the closed form's mean gap over the points.
    pub worst_itl_error: f64,
}

/// Fits the step model to `points` in closed form; `jitter` is carried over.
pub fn fit(points: &[MeasuredPoint], jitter: f64) -> Result<Fit, FitError> {
    let singles: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.concurrency == 1 && p.requests > 0)
        .map(|p| (p.prompt_tokens, p.ttft_p50_s))
        .collect();
    let (lo, hi) = singles
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), (p, _)| {
            (lo.min(*p), hi.max(*p))
        });
    if singles.len() < 2 || hi - lo < 50.0 {
        return Err(FitError::NoPrefillSlope(
            singles.iter().map(|(p, _)| *p).collect(),
        ));
    }
    // TTFT₁ = h + c1·P (+ c4·P²/2 with three lengths or more), relative.
    let quadratic = distinct(singles.iter().map(|(p, _)| *p)) >= 3;
    let rows: Vec<(Vec<f64>, f64)> = singles
        .iter()
        .map(|&(p, t)| {
            let a = if quadratic {
                vec![1.0, p, p * p / 2.0]
            } else {
                vec![1.0, p]
            };
            (a, t)
        })
        .collect();
    let x = nonnegative_least_squares(&relative(&rows));
    let (http_s, c1_s, c4_s) = (x[0], x[1], x.get(2).copied().unwrap_or(0.0));

    let usable: Vec<&MeasuredPoint> = points
        .iter()
        .filter(|p| p.requests > 0 && p.itl_mean_s > 0.0 && p.output_tokens > 1)
        .collect();
    if usable.len() < 3 {
        return Err(FitError::TooFewPoints(usable.len()));
    }
    // Rows [1, c, c·(P + O/2)] against the gap less the others' prefills.
    let rows: Vec<(Vec<f64>, f64)> = usable
        .iter()
        .map(|p| {
            let c = f64::from(p.concurrency);
            let o = f64::from(p.output_tokens);
            let prompt = p.prompt_tokens;
            let prefill = (c1_s * prompt + c4_s * prompt * prompt / 2.0) * (c - 1.0) / o;
            (vec![1.0, c, c * (prompt + o / 2.0)], p.itl_mean_s - prefill)
        })
        .collect();
    // Relative to the measured gap, not to what is left of it.
    let weighted: Vec<(Vec<f64>, f64)> = rows
        .iter()
        .zip(&usable)
        .map(|((a, y), p)| {
            let w = 1.0 / p.itl_mean_s;
            (a.iter().map(|v| v * w).collect(), y * w)
        })
        .collect();
    let x = nonnegative_least_squares(&weighted);
    let step = StepModel {
        // A step always costs something (the simulator refuses c0 = 0).
        c0_ms: (x[0] * 1000.0).max(0.01),
        c1_ms_per_prefill_token: c1_s * 1000.0,
        c2_ms_per_decode_seq: x[1] * 1000.0,
        c3_ms_per_context_token: x[2] * 1000.0,
        c4_ms_per_prefill_context: c4_s * 1000.0,
        jitter,
    };
    let worst_itl_error = usable
        .iter()
        .map(|p| (modelled_itl_s(&step, p) / p.itl_mean_s - 1.0).abs())
        .fold(0.0, f64::max);
    Ok(Fit {
        step,
        http_s,
        worst_itl_error,
    })
}

/// The mean gap the closed form gives at `p`'s concurrency and lengths,
/// seconds.
pub fn modelled_itl_s(step: &StepModel, p: &MeasuredPoint) -> f64 {
    let c = f64::from(p.concurrency);
    let o = f64::from(p.output_tokens);
    let prompt = p.prompt_tokens;
    (step.c0_ms
        + (step.c1_ms_per_prefill_token * prompt
            + step.c4_ms_per_prefill_context * prompt * prompt / 2.0)
            * (c - 1.0)
            / o
        + step.c2_ms_per_decode_seq * c
        + step.c3_ms_per_context_token * c * (prompt + o / 2.0))
        / 1000.0
}

/// The simulator's closed loop at `m`'s concurrency and lengths on
/// `engine`, for `duration_s` simulated seconds (the first sixth, at most
/// 30 s, unmeasured).
pub fn simulate(
    engine: &EngineConfig,
    m: &MeasuredPoint,
    duration_s: f64,
) -> Result<SweepPoint, SimError> {
    let cfg = SweepConfig {
        engine: engine.clone(),
        prompt_mean: m.prompt_tokens,
        // Prompts of a fixed number of words vary a little in tokens.
        prompt_cv: 0.05,
        output_tokens: m.output_tokens,
        duration_s,
        warmup_s: (duration_s / 6.0).min(30.0),
        seed: 1,
    };
    point(&cfg, m.concurrency)
}

/// The simulator's error against the engine: the mean over points of the
/// squared log ratios of throughput, TTFT p50 (plus the HTTP path
/// `http_s`) and mean ITL.
pub fn sim_error(
    engine: &EngineConfig,
    points: &[MeasuredPoint],
    http_s: f64,
    duration_s: f64,
) -> Result<f64, SimError> {
    let mut sum = 0.0;
    let mut n = 0usize;
    for m in points.iter().filter(|m| m.requests > 0) {
        let s = simulate(engine, m, duration_s)?;
        for (sim, real) in [
            (s.requests_per_s, m.requests_per_s),
            (s.ttft_p50_s + http_s, m.ttft_p50_s),
            (s.itl_mean_s, m.itl_mean_s),
        ] {
            if sim > 0.0 && real > 0.0 {
                sum += (sim / real).ln().powi(2);
                n += 1;
            }
        }
    }
    Ok(if n == 0 {
        f64::INFINITY
    } else {
        sum / n as f64
    })
}

/// Simulated seconds per point while refining (the table runs longer).
pub const REFINE_DURATION_S: f64 = 120.0;

/// At most this many simulated sweeps while refining.
const REFINE_BUDGET: usize = 600;

/// Searches the step constants from `engine.step` for the smallest
/// [`sim_error`]: each constant in turn is scaled up or down by a factor
/// while that helps; the factor shrinks (2 → √2 → …) when nothing does,
/// down to 1 %. A zero constant is tried at a small seed value. Returns
/// the step model and its error.
pub fn refine(
    engine: &EngineConfig,
    points: &[MeasuredPoint],
    http_s: f64,
    duration_s: f64,
) -> Result<(StepModel, f64), FitError> {
    // Small but visible starting values for constants fitted at zero.
    const SEEDS: [f64; 5] = [0.5, 0.01, 0.005, 1e-4, 1e-5];
    let mut engine = engine.clone();
    let get = |s: &StepModel| {
        [
            s.c0_ms,
            s.c1_ms_per_prefill_token,
            s.c2_ms_per_decode_seq,
            s.c3_ms_per_context_token,
            s.c4_ms_per_prefill_context,
        ]
    };
    let set = |s: &mut StepModel, x: [f64; 5]| {
        s.c0_ms = x[0];
        s.c1_ms_per_prefill_token = x[1];
        s.c2_ms_per_decode_seq = x[2];
        s.c3_ms_per_context_token = x[3];
        s.c4_ms_per_prefill_context = x[4];
    };
    let mut x = get(&engine.step);
    let mut best = sim_error(&engine, points, http_s, duration_s)?;
    let mut factor: f64 = 2.0;
    let mut runs = 1;
    while factor > 1.01 && runs < REFINE_BUDGET {
        let mut improved = false;
        for i in 0..x.len() {
            for up in [true, false] {
                let mut y = x;
                y[i] = match (x[i] == 0.0, up) {
                    (true, true) => SEEDS[i],
                    (true, false) => continue,
                    (false, true) => x[i] * factor,
                    (false, false) => x[i] / factor,
                };
                set(&mut engine.step, y);
                let e = sim_error(&engine, points, http_s, duration_s)?;
                runs += 1;
                if e < best {
                    (best, x, improved) = (e, y, true);
                    break;
                }
            }
        }
        if !improved {
            factor = factor.sqrt();
        }
    }
    set(&mut engine.step, x);
    Ok((engine.step, best))
}

/// How many different values (at least 1 apart) `values` holds.
fn distinct(values: impl Iterator<Item = f64>) -> usize {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.dedup_by(|a, b| (*a - *b).abs() < 1.0);
    v.len()
}

/// Each row divided by its target: least squares on relative error.
fn relative(rows: &[(Vec<f64>, f64)]) -> Vec<(Vec<f64>, f64)> {
    rows.iter()
        .filter(|(_, y)| *y > 0.0)
        .map(|(a, y)| (a.iter().map(|v| v / y).collect(), 1.0))
        .collect()
}

/// Least squares with no coefficient negative: solve with all; while one
/// comes out negative, hold the most negative at zero and solve for the
/// rest (at most one round per coefficient).
fn nonnegative_least_squares(rows: &[(Vec<f64>, f64)]) -> Vec<f64> {
    let k = rows.first().map_or(0, |(a, _)| a.len());
    let mut free = vec![true; k];
    loop {
        let x = least_squares(rows, &free);
        let worst = (0..k)
            .filter(|&i| free[i] && x[i] < 0.0)
            .min_by(|&a, &b| x[a].total_cmp(&x[b]));
        match worst {
            Some(i) => free[i] = false,
            None => return x,
        }
    }
}

/// Least squares over the `free` coefficients (the others are zero), by
/// the normal equations; a singular system leaves its coefficients zero.
fn least_squares(rows: &[(Vec<f64>, f64)], free: &[bool]) -> Vec<f64> {
    let idx: Vec<usize> = (0..free.len()).filter(|&i| free[i]).collect();
    let k = idx.len();
    // Augmented normal equations [AᵀA | Aᵀy], k × (k + 1).
    let mut m = vec![vec![0.0; k + 1]; k];
    for (a, y) in rows {
        for (r, &i) in idx.iter().enumerate() {
            for (c, &j) in idx.iter().enumerate() {
                m[r][c] += a[i] * a[j];
            }
            m[r][k] += a[i] * y;
        }
    }
    // Gauss–Jordan with partial pivoting.
    for col in 0..k {
        let Some(pivot) = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
        else {
            break;
        };
        if m[pivot][col].abs() < 1e-300 {
            continue;
        }
        m.swap(col, pivot);
        let lead = m[col][col];
        for v in &mut m[col] {
            *v /= lead;
        }
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col];
                for (v, p) in row.iter_mut().zip(&pivot_row) {
                    *v -= f * p;
                }
            }
        }
    }
    let mut x = vec![0.0; free.len()];
    for (r, &i) in idx.iter().enumerate() {
        if m[r][r].abs() > 1e-300 {
            x[i] = m[r][k];
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A point the closed form of `step` gives, TTFT with HTTP path `h`.
    fn synthetic(step: &StepModel, c: u32, prompt: f64, h: f64) -> MeasuredPoint {
        let mut p = MeasuredPoint {
            concurrency: c,
            prompt_words: prompt as usize,
            prompt_tokens: prompt,
            prompt_chars: prompt * 5.0,
            output_tokens: 64,
            requests: 100,
            requests_per_s: 1.0,
            output_tokens_per_s: 64.0,
            ttft_p50_s: h
                + (step.c1_ms_per_prefill_token * prompt
                    + step.c4_ms_per_prefill_context * prompt * prompt / 2.0)
                    / 1000.0,
            ttft_p99_s: 0.0,
            itl_mean_s: 0.0,
            latency_mean_s: 0.0,
        };
        p.itl_mean_s = modelled_itl_s(step, &p);
        p
    }

    fn sweep(step: &StepModel) -> Vec<MeasuredPoint> {
        let mut points: Vec<_> = [1, 2, 4, 8, 16, 32]
            .into_iter()
            .map(|c| synthetic(step, c, 250.0, 0.02))
            .collect();
        points.push(synthetic(step, 1, 500.0, 0.02));
        points.push(synthetic(step, 1, 1000.0, 0.02));
        points.push(synthetic(step, 8, 1000.0, 0.02));
        points
    }

    #[test]
    fn the_closed_form_recovers_the_constants_that_made_the_points() {
        let truth = StepModel {
            c0_ms: 5.5,
            c1_ms_per_prefill_token: 0.12,
            c2_ms_per_decode_seq: 0.4,
            c3_ms_per_context_token: 0.002,
            c4_ms_per_prefill_context: 8e-5,
            jitter: 0.03,
        };
        let f = fit(&sweep(&truth), 0.03).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-3);
        assert!(close(f.step.c0_ms, truth.c0_ms), "{f:?}");
        assert!(close(f.step.c1_ms_per_prefill_token, 0.12), "{f:?}");
        assert!(close(f.step.c2_ms_per_decode_seq, 0.4), "{f:?}");
        assert!(close(f.step.c3_ms_per_context_token, 0.002), "{f:?}");
        assert!(close(f.step.c4_ms_per_prefill_context, 8e-5), "{f:?}");
        assert!((f.http_s - 0.02).abs() < 1e-9, "{f:?}");
        assert!(f.worst_itl_error < 1e-6, "{f:?}");
    }

    #[test]
    fn two_prompt_lengths_fit_a_linear_prefill() {
        let truth = StepModel {
            c4_ms_per_prefill_context: 0.0,
            ..StepModel::default()
        };
        let points: Vec<_> = sweep(&truth)
            .into_iter()
            .filter(|p| p.prompt_tokens != 500.0)
            .collect();
        let f = fit(&points, 0.03).unwrap();
        assert_eq!(f.step.c4_ms_per_prefill_context, 0.0);
        assert!(
            (f.step.c1_ms_per_prefill_token / 0.0345 - 1.0).abs() < 1e-6,
            "{f:?}"
        );
    }

    #[test]
    fn a_constant_the_data_would_make_negative_is_zero_and_the_rest_refitted() {
        // Gaps that fall with the context length would need c3 < 0.
        let truth = StepModel {
            c0_ms: 6.0,
            c1_ms_per_prefill_token: 0.1,
            c2_ms_per_decode_seq: 0.5,
            c3_ms_per_context_token: 0.0,
            c4_ms_per_prefill_context: 0.0,
            jitter: 0.0,
        };
        let mut points = sweep(&truth);
        for p in points.iter_mut().filter(|p| p.prompt_tokens > 500.0) {
            p.itl_mean_s *= 0.8;
        }
        let f = fit(&points, 0.0).unwrap();
        assert_eq!(f.step.c3_ms_per_context_token, 0.0, "{f:?}");
        assert!(
            f.step.c0_ms > 0.0 && f.step.c2_ms_per_decode_seq > 0.0,
            "{f:?}"
        );
    }

    #[test]
    fn one_prompt_length_cannot_give_the_prefill_cost() {
        let step = StepModel::default();
        let points: Vec<_> = [1, 4, 16]
            .into_iter()
            .map(|c| synthetic(&step, c, 250.0, 0.02))
            .collect();
        let err = fit(&points, 0.0).unwrap_err();
        assert!(
            matches!(&err, FitError::NoPrefillSlope(p) if p == &[250.0]),
            "{err:?}"
        );
    }

    #[test]
    fn refining_against_the_simulators_own_sweep_lowers_its_error() {
        // Points the simulator itself gives with known constants; the
        // search starts from constants 1.6× off and must get closer.
        let engine = EngineConfig {
            max_num_seqs: 32,
            max_model_len: 2048,
            step: StepModel {
                c0_ms: 5.0,
                c1_ms_per_prefill_token: 0.2,
                c2_ms_per_decode_seq: 0.05,
                c3_ms_per_context_token: 5e-4,
                c4_ms_per_prefill_context: 8e-5,
                jitter: 0.03,
            },
            ..EngineConfig::default()
        };
        let template = synthetic(&engine.step, 1, 250.0, 0.0);
        // Short runs keep the test fast (a debug build simulates slowly).
        let duration_s = 40.0;
        let points: Vec<MeasuredPoint> = [(1, 250.0), (16, 250.0), (1, 1000.0)]
            .into_iter()
            .map(|(c, prompt)| {
                let m = MeasuredPoint {
                    concurrency: c,
                    prompt_tokens: prompt,
                    ..template.clone()
                };
                let s = simulate(&engine, &m, duration_s).unwrap();
                MeasuredPoint {
                    requests_per_s: s.requests_per_s,
                    ttft_p50_s: s.ttft_p50_s,
                    itl_mean_s: s.itl_mean_s,
                    ..m
                }
            })
            .collect();
        let mut start = engine.clone();
        start.step.c0_ms *= 1.6;
        start.step.c1_ms_per_prefill_token /= 1.6;
        start.step.c3_ms_per_context_token = 0.0;
        let before = sim_error(&start, &points, 0.0, duration_s).unwrap();
        let (step, after) = refine(&start, &points, 0.0, duration_s).unwrap();
        assert!(after < before / 10.0, "{before} -> {after}: {step:?}");
        assert!((step.c0_ms / 5.0 - 1.0).abs() < 0.25, "{step:?}");
        assert!(
            (step.c1_ms_per_prefill_token / 0.2 - 1.0).abs() < 0.25,
            "{step:?}"
        );
    }
}
