//! The `slo-headroom` controller: forecast load, step-time line and its
//! correction, and the most own work that keeps predicted ITL within its
//! limit.

use super::kalman::{KalmanConfig, LocalLinearTrend};
use super::nnls::{Line, NnlsLine};

/// The largest own in-flight `M >= 0` with `correction·(a + b·(load + M))
/// <= limit`, capped at `max`: all of `max` when the step time does not
/// depend on the batch and already meets the limit, none when it does not.
pub fn admissible(line: Line, correction: f64, load: f64, limit: f64, max: f64) -> f64 {
    let target = limit / correction;
    if line.b <= 0.0 {
        return if line.a <= target { max } else { 0.0 };
    }
    ((target - line.a) / line.b - load).clamp(0.0, max)
}

/// Clamp of the actual/expected correction: beyond these the model, not
/// the engine, is wrong, and one odd interval must not swing admission.
const CORRECTION_RANGE: (f64, f64) = (0.5, 3.0);

/// Limits of the [`HeadroomModel`], in requests and seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadroomConfig {
    /// Corrected predicted ITL must stay at or below this
    /// (`itl_slo × (1 − margin)`).
    pub itl_limit: f64,
    /// Observed TTFT quantile above this admits nothing
    /// (`ttft_slo × (1 − margin)`).
    pub ttft_limit: f64,
    /// Waiting requests above this admit nothing.
    pub waiting_threshold: f64,
    /// Seconds a request admitted now keeps running.
    pub horizon: f64,
    /// The regression is trusted once its running counts span this much.
    pub min_spread: f64,
    /// ... and it holds at least this many points.
    pub min_points: usize,
    /// EWMA weight of the newest actual/expected ratio, in (0, 1].
    pub correction_alpha: f64,
    /// Admitted before the regression is trusted.
    pub initial: f64,
    /// Ceiling of the admitted amount.
    pub max: f64,
    /// The admitted amount exceeds own in-flight by at most this much
    /// (requests per reading): the model's headroom is reached in steps,
    /// because a burst of batch prefills hurts interactive TTFT before
    /// any reading can show it.
    pub max_increase: f64,
}

/// What one interval shows, for the [`HeadroomModel`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadroomInputs {
    /// Seconds since the previous reading.
    pub dt: f64,
    /// Requests running in the pool (ours included).
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// Engines in the pool (waiting is judged per engine).
    pub engines: f64,
    /// Our own requests in flight.
    pub own: f64,
    /// The interval's ITL statistic the SLO is held to (`slo-headroom`'s
    /// `itl_quantile` of the token gaps, interpolated), when any token was
    /// produced.
    pub itl: Option<f64>,
    /// Observed TTFT quantile over the interval, when any request started.
    pub ttft_quantile: Option<f64>,
}

/// Why the model admitted what it did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admitted {
    /// Nothing: TTFT over its limit.
    TtftOver,
    /// Nothing: requests wait.
    Waiting,
    /// `initial`: the regression is not trusted yet.
    Initial,
    /// Solved from the model.
    Model {
        /// Interactive load now.
        load: f64,
        /// The load forecast over the horizon.
        forecast: f64,
        /// The step-time line.
        line: Line,
        /// The actual/expected correction.
        correction: f64,
    },
}

/// The `slo-headroom` controller: forecasts interactive load with a
/// [`LocalLinearTrend`], maps load to step time with an [`NnlsLine`]
/// corrected by how far reality sits from it, and admits the most own work
/// that keeps the predicted ITL within its limit.
#[derive(Debug, Clone)]
pub struct HeadroomModel {
    cfg: HeadroomConfig,
    trend: LocalLinearTrend,
    line: NnlsLine,
    correction: f64,
}

impl HeadroomModel {
    /// A model that has seen nothing; `window` points of regression.
    pub fn new(cfg: HeadroomConfig, kalman: KalmanConfig, window: usize) -> Self {
        Self {
            cfg,
            trend: LocalLinearTrend::new(kalman),
            line: NnlsLine::new(window),
            correction: 1.0,
        }
    }

    fn trusted_line(&self) -> Option<Line> {
        let enough =
            self.line.len() >= self.cfg.min_points && self.line.spread() >= self.cfg.min_spread;
        enough.then(|| self.line.fit()).flatten()
    }

    /// Folds in one interval and returns the admitted own in-flight `M`
    /// (requests) and why.
    pub fn on_interval(&mut self, i: &HeadroomInputs) -> (f64, Admitted) {
        let c = self.cfg;
        let load = (i.running + i.waiting - i.own).max(0.0);
        self.trend.update(load, i.dt);
        if let Some(itl) = i.itl.filter(|v| v.is_finite() && *v >= 0.0) {
            // Judge the model before it learns this point, so the ratio
            // measures prediction error, not fit residue.
            if let Some(line) = self.trusted_line() {
                let expected = line.at(i.running);
                if expected > 0.0 {
                    let ratio = (itl / expected).clamp(CORRECTION_RANGE.0, CORRECTION_RANGE.1);
                    self.correction += c.correction_alpha * (ratio - self.correction);
                }
            }
            self.line.push(i.running, itl);
        }
        if i.ttft_quantile.is_some_and(|t| t > c.ttft_limit) {
            return (0.0, Admitted::TtftOver);
        }
        if i.waiting / i.engines.max(1.0) > c.waiting_threshold {
            return (0.0, Admitted::Waiting);
        }
        let Some(line) = self.trusted_line() else {
            return (c.initial.min(c.max), Admitted::Initial);
        };
        // The load a request admitted now meets over its run: the larger
        // of now and the horizon's end (the trend is linear).
        let forecast = self
            .trend
            .forecast(0.0)
            .max(self.trend.forecast(c.horizon))
            .max(0.0);
        let m = admissible(line, self.correction, forecast, c.itl_limit, c.max)
            .min(i.own.max(0.0) + c.max_increase);
        (
            m,
            Admitted::Model {
                load,
                forecast,
                line,
                correction: self.correction,
            },
        )
    }

    /// The actual/expected correction factor now.
    pub const fn correction(&self) -> f64 {
        self.correction
    }
}

#[cfg(test)]
mod tests {
    use super::super::kalman::tests::KALMAN;
    use super::*;

    #[test]
    fn admissible_load_solves_the_line_for_the_limit() {
        let l = Line { a: 0.01, b: 0.001 };
        // 0.01 + 0.001·(20 + M) <= 0.04 → M = 10.
        assert!((admissible(l, 1.0, 20.0, 0.04, 100.0) - 10.0).abs() < 1e-9);
        // A correction of 2 halves the limit: 0.02 → M = 0 (clamped).
        assert_eq!(admissible(l, 2.0, 20.0, 0.04, 100.0), 0.0);
        assert_eq!(admissible(l, 1.0, 0.0, 1.0, 50.0), 50.0);
        let flat = Line { a: 0.01, b: 0.0 };
        assert_eq!(admissible(flat, 1.0, 30.0, 0.04, 50.0), 50.0);
        assert_eq!(admissible(flat, 1.0, 30.0, 0.005, 50.0), 0.0);
    }

    const HEADROOM: HeadroomConfig = HeadroomConfig {
        itl_limit: 0.045,
        ttft_limit: 0.45,
        waiting_threshold: 0.0,
        horizon: 10.0,
        min_spread: 4.0,
        min_points: 3,
        correction_alpha: 0.5,
        initial: 2.0,
        max: 100.0,
        max_increase: 1000.0,
    };

    fn inputs(running: f64, itl: f64) -> HeadroomInputs {
        HeadroomInputs {
            dt: 1.0,
            running,
            waiting: 0.0,
            engines: 1.0,
            own: 0.0,
            itl: Some(itl),
            ttft_quantile: Some(0.1),
        }
    }

    #[test]
    fn headroom_admits_initial_until_the_regression_has_spread() {
        let mut h = HeadroomModel::new(HEADROOM, KALMAN, 20);
        for _ in 0..5 {
            assert_eq!(h.on_interval(&inputs(10.0, 0.02)), (2.0, Admitted::Initial));
        }
    }

    #[test]
    fn headroom_solves_the_line_at_the_forecast_load() {
        let mut h = HeadroomModel::new(HEADROOM, KALMAN, 60);
        // ITL = 0.01 + 0.001·running exactly; load steady at 20 at the end.
        let ramp = [0.0, 10.0, 20.0, 30.0];
        for r in ramp.into_iter().chain([20.0; 40]) {
            h.on_interval(&inputs(r, 0.01 + 0.001 * r));
        }
        let (m, why) = h.on_interval(&inputs(20.0, 0.03));
        assert!((h.correction() - 1.0).abs() < 1e-9, "{}", h.correction());
        // 0.01 + 0.001·(forecast + M) <= 0.045 with forecast ≈ 20 → M ≈ 15.
        let Admitted::Model { forecast, .. } = why else {
            panic!("{why:?}")
        };
        assert!((forecast - 20.0).abs() < 1.0, "{forecast}");
        assert!((m - (35.0 - forecast)).abs() < 1e-6, "{m}");
        // Reality twice as slow as the model: the correction rises and
        // admission falls.
        for _ in 0..10 {
            h.on_interval(&inputs(20.0, 0.06));
        }
        let (slower, _) = h.on_interval(&inputs(20.0, 0.06));
        assert!(h.correction() > 1.5, "{}", h.correction());
        assert!(slower < m, "{slower} vs {m}");
    }

    #[test]
    fn headroom_climbs_to_the_model_in_steps_above_own_work() {
        let mut h = HeadroomModel::new(
            HeadroomConfig {
                max_increase: 3.0,
                ..HEADROOM
            },
            KALMAN,
            60,
        );
        // The same exact line as above: the model alone admits about 15.
        for r in [0.0, 10.0, 20.0, 30.0].into_iter().chain([20.0; 40]) {
            h.on_interval(&inputs(r, 0.01 + 0.001 * r));
        }
        let (idle, _) = h.on_interval(&inputs(20.0, 0.03));
        assert!((idle - 3.0).abs() < 1e-9, "{idle}");
        let busy = HeadroomInputs {
            own: 10.0,
            ..inputs(30.0, 0.04)
        };
        let (m, _) = h.on_interval(&busy);
        assert!(m <= 13.0 + 1e-9 && m > 3.0, "{m}");
    }

    #[test]
    fn headroom_admits_nothing_over_ttft_or_while_requests_wait() {
        let mut h = HeadroomModel::new(HEADROOM, KALMAN, 20);
        let slow = HeadroomInputs {
            ttft_quantile: Some(0.5),
            ..inputs(5.0, 0.02)
        };
        assert_eq!(h.on_interval(&slow), (0.0, Admitted::TtftOver));
        let waiting = HeadroomInputs {
            waiting: 2.0,
            ..inputs(5.0, 0.02)
        };
        assert_eq!(h.on_interval(&waiting), (0.0, Admitted::Waiting));
        // Waiting is judged per engine: 2 waiting is 2 per engine on one
        // engine, 0.25 per engine over eight.
        let mut h = HeadroomModel::new(
            HeadroomConfig {
                waiting_threshold: 0.5,
                ..HEADROOM
            },
            KALMAN,
            20,
        );
        assert_eq!(h.on_interval(&waiting), (0.0, Admitted::Waiting));
        let spread = HeadroomInputs {
            engines: 8.0,
            ..waiting
        };
        assert_ne!(h.on_interval(&spread).1, Admitted::Waiting);
    }
}
