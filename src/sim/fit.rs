//! The step model fitted to a real engine's closed-loop sweep (pure).
//!
//! A closed loop of `c` clients, each sending a `P`-token prompt for
//! exactly `O` tokens after the previous one finished, keeps about `c`
//! sequences decoding and starts about `c / O` prefills per step. The
//! model's step time `c0 + c1·prefill + c2·seqs + c3·context` then gives,
//! for the two things a client can time:
//!
//! - **TTFT with one client** (nothing else running): one step that
//!   prefills the prompt, plus the HTTP path, which no step constant
//!   models: `TTFT₁(P) = h + c1·P`, with `h` absorbing `c0`. Two prompt
//!   lengths give `c1` as the slope.
//! - **Mean gap between tokens** at concurrency `c`: every step the
//!   request decodes in also decodes the `c − 1` others and, on average,
//!   `(c − 1) / O` of their prefills:
//!   `ITL(c, P) − c1·P·(c − 1)/O = c0 + c2·c + c3·c·(P + O/2)`.
//!   Least squares over the points gives `c0`, `c2`, `c3`; points at two
//!   prompt lengths (and `c > 1`) separate `c2` from `c3`.
//!
//! A constant the data would make negative is held at zero and the rest
//! refitted: a step cannot get cheaper with more work.

use serde::{Deserialize, Serialize};

use super::config::StepModel;

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
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// `c1` needs TTFT at concurrency 1 for two different prompt lengths.
    #[error(
        "the fit needs concurrency 1 at two prompt lengths at least 50 tokens apart (for the prefill cost c1); the sweep has concurrency 1 at {0:?} tokens"
    )]
    NoPrefillSlope(Vec<f64>),
    /// `c0`, `c2`, `c3` need at least three points.
    #[error("the fit needs at least 3 points with a measured inter-token gap, got {0}")]
    TooFewPoints(usize),
}

/// The fitted step constants (jitter is not fitted; the caller's is kept)
/// and how well they explain the gaps they were fitted to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    /// The step model.
    pub step: StepModel,
    /// The HTTP path's share of TTFT at concurrency 1, seconds (`h`).
    pub http_s: f64,
    /// Largest relative error of the modelled mean gap over the points.
    pub worst_itl_error: f64,
}

/// Fits the step model to `points`; `jitter` is carried over.
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
    let (http_s, c1_s) = line(&singles);
    let c1_s = c1_s.max(0.0);

    let usable: Vec<&MeasuredPoint> = points
        .iter()
        .filter(|p| p.requests > 0 && p.itl_mean_s > 0.0 && p.output_tokens > 1)
        .collect();
    if usable.len() < 3 {
        return Err(FitError::TooFewPoints(usable.len()));
    }
    // Rows [1, c, c·(P + O/2)] against the gap less the others' prefills.
    let rows: Vec<([f64; 3], f64)> = usable
        .iter()
        .map(|p| {
            let c = f64::from(p.concurrency);
            let o = f64::from(p.output_tokens);
            let prefill = c1_s * p.prompt_tokens * (c - 1.0) / o;
            (
                [1.0, c, c * (p.prompt_tokens + o / 2.0)],
                p.itl_mean_s - prefill,
            )
        })
        .collect();
    let [c0, c2, c3] = nonnegative_least_squares(&rows);
    let step = StepModel {
        // A step always costs something (the simulator refuses c0 = 0).
        c0_ms: (c0 * 1000.0).max(0.01),
        c1_ms_per_prefill_token: c1_s * 1000.0,
        c2_ms_per_decode_seq: c2 * 1000.0,
        c3_ms_per_context_token: c3 * 1000.0,
        jitter,
    };
    let worst_itl_error = usable
        .iter()
        .map(|p| (modelled_itl_s(&step, p) / p.itl_mean_s - 1.0).abs())
        .fold(0.0, f64::max);
    Ok(Fit {
        step,
        http_s: http_s.max(0.0),
        worst_itl_error,
    })
}

/// The mean gap the model gives at `p`'s concurrency and lengths, seconds.
pub fn modelled_itl_s(step: &StepModel, p: &MeasuredPoint) -> f64 {
    let c = f64::from(p.concurrency);
    let o = f64::from(p.output_tokens);
    (step.c0_ms
        + step.c1_ms_per_prefill_token * p.prompt_tokens * (c - 1.0) / o
        + step.c2_ms_per_decode_seq * c
        + step.c3_ms_per_context_token * c * (p.prompt_tokens + o / 2.0))
        / 1000.0
}

/// Intercept and slope of the least-squares line through `xy`.
fn line(xy: &[(f64, f64)]) -> (f64, f64) {
    let n = xy.len() as f64;
    let mx = xy.iter().map(|(x, _)| x).sum::<f64>() / n;
    let my = xy.iter().map(|(_, y)| y).sum::<f64>() / n;
    let sxx: f64 = xy.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - slope * mx, slope)
}

/// Least squares for three coefficients, none negative: solve with all
/// three; while one comes out negative, hold the most negative at zero and
/// solve for the rest (three unknowns need at most three rounds).
fn nonnegative_least_squares(rows: &[([f64; 3], f64)]) -> [f64; 3] {
    let mut free = [true; 3];
    loop {
        let x = least_squares(rows, free);
        let worst = (0..3)
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
fn least_squares(rows: &[([f64; 3], f64)], free: [bool; 3]) -> [f64; 3] {
    let idx: Vec<usize> = (0..3).filter(|&i| free[i]).collect();
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
        if m[pivot][col].abs() < 1e-18 {
            continue;
        }
        m.swap(col, pivot);
        let lead = m[col][col];
        for v in &mut m[col] {
            *v /= lead;
        }
        for r in 0..k {
            if r != col {
                let f = m[r][col];
                for c in 0..=k {
                    m[r][c] -= f * m[col][c];
                }
            }
        }
    }
    let mut x = [0.0; 3];
    for (r, &i) in idx.iter().enumerate() {
        if m[r][r].abs() > 1e-18 {
            x[i] = m[r][k];
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A point an engine with `step` would give, TTFT with HTTP path `h`.
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
            ttft_p50_s: h + step.c1_ms_per_prefill_token * prompt / 1000.0,
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
        points.push(synthetic(step, 1, 1000.0, 0.02));
        points.push(synthetic(step, 8, 1000.0, 0.02));
        points
    }

    #[test]
    fn recovers_the_constants_that_made_the_points() {
        let truth = StepModel {
            c0_ms: 5.5,
            c1_ms_per_prefill_token: 0.12,
            c2_ms_per_decode_seq: 0.4,
            c3_ms_per_context_token: 0.002,
            jitter: 0.03,
        };
        let f = fit(&sweep(&truth), 0.03).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-3);
        assert!(close(f.step.c0_ms, truth.c0_ms), "{f:?}");
        assert!(close(f.step.c1_ms_per_prefill_token, 0.12), "{f:?}");
        assert!(close(f.step.c2_ms_per_decode_seq, 0.4), "{f:?}");
        assert!(close(f.step.c3_ms_per_context_token, 0.002), "{f:?}");
        assert!((f.http_s - 0.02).abs() < 1e-9, "{f:?}");
        assert!(f.worst_itl_error < 1e-6, "{f:?}");
    }

    #[test]
    fn a_constant_the_data_would_make_negative_is_zero_and_the_rest_refitted() {
        // Gaps that fall with the context length would need c3 < 0.
        let truth = StepModel {
            c0_ms: 6.0,
            c1_ms_per_prefill_token: 0.1,
            c2_ms_per_decode_seq: 0.5,
            c3_ms_per_context_token: 0.0,
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
        assert_eq!(
            fit(&points, 0.0).unwrap_err(),
            FitError::NoPrefillSlope(vec![250.0])
        );
    }
}
