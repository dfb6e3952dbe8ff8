//! A local-linear-trend Kalman filter that forecasts the interactive load
//! (`slo-headroom`).

/// Noise of the [`LocalLinearTrend`] filter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KalmanConfig {
    /// Process noise of the level, per second (requests²/s).
    pub q_level: f64,
    /// Process noise of the slope, per second ((requests/s)²/s).
    pub q_slope: f64,
    /// Observation noise (requests²).
    pub r: f64,
    /// Readings before the filter's forecast is used; until then the
    /// forecast is the last value (the constant predictor).
    pub warmup: u32,
}

/// A local-linear-trend Kalman filter: state `(level, slope)`, with
/// `level' = level + slope·dt` between readings `dt` seconds apart.
#[derive(Debug, Clone)]
pub struct LocalLinearTrend {
    cfg: KalmanConfig,
    /// `(level, slope)`.
    x: [f64; 2],
    /// State covariance.
    p: [[f64; 2]; 2],
    seen: u32,
    last: f64,
}

/// Prior variance of the slope: diffuse, so the first readings set it.
const SLOPE_PRIOR: f64 = 1e6;

impl LocalLinearTrend {
    /// A filter that has seen nothing.
    pub const fn new(cfg: KalmanConfig) -> Self {
        Self {
            cfg,
            x: [0.0, 0.0],
            p: [[0.0, 0.0], [0.0, 0.0]],
            seen: 0,
            last: 0.0,
        }
    }

    /// Folds in observation `z`, `dt` seconds after the previous one.
    pub fn update(&mut self, z: f64, dt: f64) {
        self.last = z;
        if self.seen == 0 {
            self.x = [z, 0.0];
            self.p = [[self.cfg.r, 0.0], [0.0, SLOPE_PRIOR]];
            self.seen = 1;
            return;
        }
        self.seen = self.seen.saturating_add(1);
        let dt = dt.max(0.0);
        let [[p00, p01], [p10, p11]] = self.p;
        // Predict: x = F x, P = F P Fᵀ + Q with F = [[1, dt], [0, 1]].
        let level = self.x[0] + dt * self.x[1];
        let slope = self.x[1];
        let a00 = p00 + dt * (p10 + p01) + dt * dt * p11 + self.cfg.q_level * dt;
        let a01 = p01 + dt * p11;
        let a10 = p10 + dt * p11;
        let a11 = p11 + self.cfg.q_slope * dt;
        // Update with H = [1, 0].
        let s = a00 + self.cfg.r;
        if s <= 0.0 || !s.is_finite() {
            self.x = [z, slope];
            return;
        }
        let (k0, k1) = (a00 / s, a10 / s);
        let innovation = z - level;
        self.x = [level + k0 * innovation, slope + k1 * innovation];
        self.p = [
            [(1.0 - k0) * a00, (1.0 - k0) * a01],
            [a10 - k1 * a00, a11 - k1 * a01],
        ];
    }

    /// The filtered level.
    pub const fn level(&self) -> f64 {
        self.x[0]
    }

    /// The filtered slope (per second).
    pub const fn slope(&self) -> f64 {
        self.x[1]
    }

    /// Whether the filter has seen `warmup` readings.
    pub const fn warm(&self) -> bool {
        self.seen >= self.cfg.warmup
    }

    /// The value expected `horizon` seconds from the last reading: the
    /// trend's extrapolation once warm, the last value before.
    pub fn forecast(&self, horizon: f64) -> f64 {
        if self.warm() {
            self.x[0] + self.x[1] * horizon
        } else {
            self.last
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::gate::control) const KALMAN: KalmanConfig = KalmanConfig {
        q_level: 0.1,
        q_slope: 0.01,
        r: 1.0,
        warmup: 5,
    };

    #[test]
    fn kalman_on_a_constant_series_converges_to_the_level_with_no_slope() {
        let mut k = LocalLinearTrend::new(KALMAN);
        for _ in 0..200 {
            k.update(40.0, 1.0);
        }
        assert!((k.level() - 40.0).abs() < 1e-6, "{}", k.level());
        assert!(k.slope().abs() < 1e-6, "{}", k.slope());
        assert!((k.forecast(10.0) - 40.0).abs() < 1e-4);
    }

    #[test]
    fn kalman_on_a_ramp_learns_the_slope_and_extrapolates() {
        let mut k = LocalLinearTrend::new(KALMAN);
        for t in 0..100 {
            // Readings 1 s apart, the value rising 2 per second.
            k.update(5.0 + 2.0 * f64::from(t), 1.0);
        }
        assert!((k.slope() - 2.0).abs() < 1e-3, "{}", k.slope());
        assert!((k.level() - 203.0).abs() < 1e-2, "{}", k.level());
        assert!(
            (k.forecast(10.0) - 223.0).abs() < 0.05,
            "{}",
            k.forecast(10.0)
        );
    }

    #[test]
    fn kalman_uses_the_constant_predictor_until_warm() {
        let mut k = LocalLinearTrend::new(KALMAN);
        for (t, z) in [10.0, 20.0, 30.0, 40.0].into_iter().enumerate() {
            k.update(z, if t == 0 { 0.0 } else { 1.0 });
            assert!(!k.warm());
            assert_eq!(k.forecast(10.0), z);
        }
        k.update(50.0, 1.0);
        assert!(k.warm());
        assert!(k.forecast(10.0) > 100.0, "{}", k.forecast(10.0));
    }
}
