//! Pure controllers of the feedback gates (`feedback`, `slo-headroom`): no
//! clock, no I/O, instants and readings passed in, so every rule can be
//! tested on exact sequences.
//!
//! - [`Histogram`]: a cumulative histogram summed over selected series, its
//!   delta between two readings, the fraction at or below a threshold, a
//!   quantile and the mean over the interval.
//! - [`attainment`]: interactive SLO attainment from the TTFT and ITL
//!   fractions.
//! - [`Aimd`]: the additive-increase / multiplicative-decrease window.
//! - [`LocalLinearTrend`]: a Kalman filter (level + slope) that forecasts
//!   the interactive load.
//! - [`NnlsLine`]: a sliding-window least-squares line `y ≈ a + b·x` with
//!   `a, b ≥ 0`.
//! - [`SplitMix64`]: the seeded jitter source.

use std::collections::VecDeque;

use crate::source::text::HistogramSeries;

/// A small seeded generator (SplitMix64) for jitter: deterministic for a
/// seed, so runs repeat exactly, and different per replica (each has its
/// own seed), so replicas do not move in step. Not for anything secret.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in [-1, 1].
    pub fn symmetric(&mut self) -> f64 {
        // 53 random bits give every representable step of [0, 1).
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        2.0 * unit - 1.0
    }
}

/// A cumulative histogram (vLLM's counters since engine start), summed over
/// the selected series: `(upper bound, cumulative count)` sorted by bound,
/// the total count and the sum of observations.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    /// `(le, cumulative count)`, sorted by `le`.
    pub buckets: Vec<(f64, f64)>,
    /// Number of observations.
    pub count: f64,
    /// Sum of the observed values.
    pub sum: f64,
}

impl Histogram {
    /// The sum of `series` whose labels include every `(name, value)` of
    /// `labels`; `None` when no series matches. Series of different engines
    /// share vLLM's bucket edges; an edge only some series have is summed
    /// over those that have it (never happens with one vLLM version).
    pub fn select(
        series: &[HistogramSeries],
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Option<Self> {
        let mut out = Self::default();
        let mut any = false;
        for s in series {
            let selected = labels
                .iter()
                .all(|(k, v)| s.labels.get(k).is_some_and(|have| have == v));
            if !selected {
                continue;
            }
            any = true;
            for &(le, c) in &s.buckets {
                match out.buckets.iter_mut().find(|(e, _)| *e == le) {
                    Some((_, total)) => *total += c,
                    None => out.buckets.push((le, c)),
                }
            }
            // Without `_count`, the +Inf bucket is the count.
            let count = s.count.or_else(|| {
                s.buckets
                    .last()
                    .filter(|(le, _)| le.is_infinite())
                    .map(|b| b.1)
            });
            out.count += count.unwrap_or(0.0);
            out.sum += s.sum.unwrap_or(0.0);
        }
        out.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        any.then_some(out)
    }

    /// What was observed between `earlier` and `self`. `None` when a
    /// counter went down or the bucket edges changed (an engine restarted
    /// or a series disappeared): that interval says nothing.
    pub fn since(&self, earlier: &Self) -> Option<Self> {
        let count = self.count - earlier.count;
        let sum = self.sum - earlier.sum;
        if self.buckets.len() != earlier.buckets.len() || count < 0.0 || !count.is_finite() {
            return None;
        }
        let mut buckets = Vec::with_capacity(self.buckets.len());
        for (&(le, now), &(le0, then)) in self.buckets.iter().zip(&earlier.buckets) {
            let d = now - then;
            if le != le0 || d < 0.0 || !d.is_finite() {
                return None;
            }
            buckets.push((le, d));
        }
        Some(Self {
            buckets,
            count,
            sum,
        })
    }

    /// The fraction of observations at or below `threshold`, read at the
    /// largest bucket edge `<= threshold` (so a threshold between edges is
    /// read conservatively). `None` without observations.
    pub fn fraction_within(&self, threshold: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let within = self
            .buckets
            .iter()
            .take_while(|(le, _)| *le <= threshold)
            .last()
            .map_or(0.0, |b| b.1);
        Some((within / self.count).clamp(0.0, 1.0))
    }

    /// The `p`-quantile, read as the upper edge of the bucket where it
    /// falls (an over-estimate, never an under-estimate); `+Inf` when it
    /// falls in the last bucket. `None` without observations.
    pub fn quantile(&self, p: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = p * self.count;
        Some(
            self.buckets
                .iter()
                .find(|(_, c)| *c >= rank)
                .map_or(f64::INFINITY, |b| b.0),
        )
    }

    /// The `p`-quantile interpolated linearly inside its bucket, as
    /// Prometheus' `histogram_quantile` does (a continuous value a
    /// regression can fit, where the bucket edge jumps); the upper edge of
    /// the last finite bucket when it falls in `+Inf`. `None` without
    /// observations.
    pub fn quantile_interpolated(&self, p: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = p.clamp(0.0, 1.0) * self.count;
        let (mut lower_edge, mut lower_count) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return Some(lower_edge);
                }
                let inside = cumulative - lower_count;
                let share = if inside > 0.0 {
                    (rank - lower_count) / inside
                } else {
                    1.0
                };
                return Some(lower_edge + (le - lower_edge) * share);
            }
            (lower_edge, lower_count) = (le, cumulative);
        }
        Some(lower_edge)
    }

    /// The mean observation (`sum / count`). `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }
}

/// Interactive SLO attainment from the fraction of requests whose TTFT met
/// its SLO and the fraction of inter-token gaps that met theirs. vLLM's
/// histograms are separate (and ITL counts token gaps, not requests), so
/// the joint per-request fraction is not observable; this takes its
/// lower bound `max(0, ttft + itl − 1)` (Fréchet), so a gate can only
/// under-estimate attainment. A side without observations counts as met.
pub fn attainment(ttft_fraction: Option<f64>, itl_fraction: Option<f64>) -> Option<f64> {
    match (ttft_fraction, itl_fraction) {
        (None, None) => None,
        (t, i) => Some((t.unwrap_or(1.0) + i.unwrap_or(1.0) - 1.0).max(0.0)),
    }
}

/// Limits and steps of the [`Aimd`] window, in the queue's unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdConfig {
    /// Window at start.
    pub initial: f64,
    /// Floor of the window (may be 0).
    pub min: f64,
    /// Ceiling of the window (the queue's `max_sys`).
    pub max: f64,
    /// Additive growth step per reading, before jitter.
    pub increase: f64,
    /// Multiplicative cut factor in (0, 1).
    pub decrease: f64,
    /// Relative jitter of the growth step in [0, 1) (0.2 = ±20 %).
    pub jitter: f64,
    /// Attainment below this cuts.
    pub target: f64,
    /// Growth needs attainment of at least `target + margin`.
    pub margin: f64,
    /// Waiting requests per engine above this count as waiting.
    pub waiting_threshold: f64,
    /// Waiting over this many consecutive readings cuts.
    pub waiting_persist: u32,
    /// Growth needs own in-flight of at least this fraction of the window.
    pub use_fraction: f64,
    /// Cut by how far a reading misses (see [`Aimd::cut_factor`]) instead
    /// of by `decrease` on any miss.
    pub graded: bool,
}

/// What one reading tells the window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Signals {
    /// Attainment over the interval (`None`: no interactive requests
    /// finished, which neither cuts nor blocks growth).
    pub attainment: Option<f64>,
    /// Requests waiting per engine.
    pub waiting: f64,
    /// Preemptions since the previous reading.
    pub new_preemptions: f64,
    /// Our own work in flight, in the queue's unit.
    pub own_in_flight: f64,
}

/// Why the window was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A 429 or 503 answer.
    Congestion,
    /// The engines preempted requests since the last reading.
    Preemption,
    /// Attainment fell below the target.
    Attainment,
    /// Requests waited over `waiting_persist` readings.
    Waiting,
}

impl Cause {
    /// Bounded label for logs and explanations.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Congestion => "congestion",
            Self::Preemption => "preemption",
            Self::Attainment => "attainment below target",
            Self::Waiting => "persistent waiting",
        }
    }
}

/// Why the window did not grow on a reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// A 429/503 arrived since the last reading.
    Congested,
    /// Attainment is below `target + margin`.
    NoMargin,
    /// Requests are waiting (not yet long enough to cut).
    Waiting,
    /// Own in-flight is below `use_fraction` of the window.
    Unused,
    /// Already at the ceiling.
    AtMax,
    /// A cut cause, but the window was already cut in this interval.
    AlreadyCut(Cause),
}

/// What a reading did to the window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// Grew by this much (after jitter and clamping).
    Grew(f64),
    /// Cut multiplicatively.
    Cut(Cause),
    /// Unchanged.
    Held(Hold),
}

/// The AIMD window: grows additively only while the pool shows margin and
/// the window is used, cuts multiplicatively on any sign of congestion, at
/// most once per reading interval (so one burst of 429s, or a burst and the
/// preemptions it caused, is one cut).
#[derive(Debug, Clone)]
pub struct Aimd {
    cfg: AimdConfig,
    window: f64,
    /// Consecutive readings with requests waiting.
    waiting_streak: u32,
    /// A 429/503 arrived since the last reading.
    congested: bool,
    /// The window was cut since the last reading.
    cut_this_interval: bool,
    /// The previous reading cut the window (a second miss in a row is no
    /// noise: it cuts the full `decrease` even when graded).
    missed_last_reading: bool,
    rng: SplitMix64,
}

impl Aimd {
    /// A window at `cfg.initial` (clamped), jitter seeded with `seed`.
    pub fn new(cfg: AimdConfig, seed: u64) -> Self {
        Self {
            window: cfg.initial.clamp(cfg.min, cfg.max.max(cfg.min)),
            cfg,
            waiting_streak: 0,
            congested: false,
            cut_this_interval: false,
            missed_last_reading: false,
            rng: SplitMix64::new(seed),
        }
    }

    /// The window `W`.
    pub const fn window(&self) -> f64 {
        self.window
    }

    /// The limits in use.
    pub const fn config(&self) -> &AimdConfig {
        &self.cfg
    }

    /// Lowers the ceiling to `cap` (the setpoint) for now; never below the
    /// floor.
    pub fn cap(&mut self, cap: f64) {
        self.window = self.window.min(cap.max(self.cfg.min));
    }

    fn cut(&mut self, factor: f64) {
        self.window = (self.window * factor).max(self.cfg.min);
        self.cut_this_interval = true;
    }

    /// The factor a reading's cut multiplies the window by. Congestion and
    /// preemption are the pool refusing work: always the full `decrease`.
    /// Without `graded`, so is every other cause. With it, a miss cuts in
    /// proportion to its size: attainment by its shortfall measured in the
    /// SLO's own allowance (`1 − target`), waiting by its excess over the
    /// threshold measured in the threshold; a miss of one allowance or
    /// more, or a second miss in a row, cuts the full `decrease`. Why: on
    /// steady load most misses are one noisy interval just past the line,
    /// and halving the window for each keeps it swinging between half and
    /// full. Off by default (`feedback`'s `graded_cut`): on the train seeds
    /// it harvested 5–15 % more on steady load but cut too little in a
    /// wave's first readings and broke the SLO budget there
    /// (`docs/gate-quality.md`, "Calibrated engine").
    pub fn cut_factor(&self, cause: Cause, s: &Signals) -> f64 {
        let c = &self.cfg;
        let severity = match cause {
            _ if !c.graded || self.missed_last_reading => 1.0,
            Cause::Congestion | Cause::Preemption => 1.0,
            Cause::Attainment => s
                .attainment
                .map_or(1.0, |a| (c.target - a) / (1.0 - c.target).max(1e-6)),
            Cause::Waiting => (s.waiting - c.waiting_threshold) / c.waiting_threshold.max(1e-6),
        };
        1.0 - (1.0 - c.decrease) * severity.clamp(0.0, 1.0)
    }

    /// A 429/503 answer: cuts at once unless the window was already cut in
    /// this reading interval. Returns whether it cut.
    pub fn on_congestion(&mut self) -> bool {
        self.congested = true;
        if self.cut_this_interval {
            return false;
        }
        self.cut(self.cfg.decrease);
        true
    }

    /// Applies one new reading (call once per fresh reading, never for a
    /// re-read of the same data) and starts the next interval.
    pub fn on_reading(&mut self, s: &Signals) -> Step {
        let c = self.cfg;
        let waiting = s.waiting > c.waiting_threshold;
        self.waiting_streak = if waiting { self.waiting_streak + 1 } else { 0 };
        let failed = s.attainment.is_some_and(|a| a < c.target);
        let cause = if s.new_preemptions > 0.0 {
            Some(Cause::Preemption)
        } else if failed {
            Some(Cause::Attainment)
        } else if self.waiting_streak >= c.waiting_persist {
            Some(Cause::Waiting)
        } else {
            None
        };
        let step = match cause {
            Some(cause) if self.cut_this_interval => Step::Held(Hold::AlreadyCut(cause)),
            Some(cause) => {
                self.cut(self.cut_factor(cause, s));
                if cause == Cause::Waiting {
                    // The next waiting cut needs another persistent stretch.
                    self.waiting_streak = 0;
                }
                Step::Cut(cause)
            }
            None => self.grow(s),
        };
        self.missed_last_reading = cause.is_some();
        self.congested = false;
        self.cut_this_interval = false;
        step
    }

    fn grow(&mut self, s: &Signals) -> Step {
        let c = self.cfg;
        let margin = s.attainment.is_none_or(|a| a >= c.target + c.margin);
        // A window smaller than two steps may not fit one request, so it
        // cannot show use; growth off the floor would otherwise never start.
        let used =
            s.own_in_flight >= c.use_fraction * self.window || self.window < 2.0 * c.increase;
        let hold = if self.congested {
            Some(Hold::Congested)
        } else if !margin {
            Some(Hold::NoMargin)
        } else if s.waiting > c.waiting_threshold {
            Some(Hold::Waiting)
        } else if !used {
            Some(Hold::Unused)
        } else if self.window >= c.max {
            Some(Hold::AtMax)
        } else {
            None
        };
        if let Some(h) = hold {
            return Step::Held(h);
        }
        let step = c.increase * (1.0 + c.jitter * self.rng.symmetric());
        let before = self.window;
        self.window = (self.window + step.max(0.0)).min(c.max);
        Step::Grew(self.window - before)
    }
}

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

/// A line `y ≈ a + b·x` fitted by least squares over the last `capacity`
/// points, with `a, b ≥ 0`: a step time cannot fall as the batch grows,
/// nor be negative at an empty batch, so a fit that says so (noise,
/// co-moving load) is refitted with that coefficient at 0.
#[derive(Debug, Clone)]
pub struct NnlsLine {
    points: VecDeque<(f64, f64)>,
    capacity: usize,
}

/// A fitted line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// Intercept, `>= 0`.
    pub a: f64,
    /// Slope, `>= 0`.
    pub b: f64,
}

impl Line {
    /// `a + b·x`.
    pub fn at(&self, x: f64) -> f64 {
        self.a + self.b * x
    }
}

impl NnlsLine {
    /// An empty window of `capacity` points (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            points: VecDeque::with_capacity(capacity.max(2)),
            capacity: capacity.max(2),
        }
    }

    /// Adds a point, dropping the oldest when full. Non-finite points are
    /// ignored.
    pub fn push(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        if self.points.len() == self.capacity {
            self.points.pop_front();
        }
        self.points.push_back((x, y));
    }

    /// Number of points held.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether it holds no points.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// `max(x) − min(x)` over the window (0 when empty).
    pub fn spread(&self) -> f64 {
        let (lo, hi) = self
            .points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.0), hi.max(p.0))
            });
        if hi >= lo { hi - lo } else { 0.0 }
    }

    /// The non-negative least-squares line, `None` when empty. Exact for
    /// two coefficients: the unconstrained fit when both are `>= 0`, else
    /// the better of the intercept-only and slope-only fits (each clamped at
    /// 0), which is where the constrained optimum lies.
    pub fn fit(&self) -> Option<Line> {
        let n = self.points.len() as f64;
        if n == 0.0 {
            return None;
        }
        let (sx, sy, sxx, sxy) = self
            .points
            .iter()
            .fold((0.0, 0.0, 0.0, 0.0), |(sx, sy, sxx, sxy), &(x, y)| {
                (sx + x, sy + y, sxx + x * x, sxy + x * y)
            });
        let det = n * sxx - sx * sx;
        if det > 1e-12 * n * sxx.max(1.0) {
            let b = (n * sxy - sx * sy) / det;
            let a = (sy - b * sx) / n;
            if a >= 0.0 && b >= 0.0 {
                return Some(Line { a, b });
            }
        }
        let sse = |l: Line| -> f64 {
            self.points
                .iter()
                .map(|&(x, y)| (y - l.at(x)).powi(2))
                .sum()
        };
        let intercept_only = Line {
            a: (sy / n).max(0.0),
            b: 0.0,
        };
        let slope_only = Line {
            a: 0.0,
            b: if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 },
        };
        Some(if sse(slope_only) < sse(intercept_only) {
            slope_only
        } else {
            intercept_only
        })
    }
}

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
    use super::*;
    use std::collections::BTreeMap;

    const CFG: AimdConfig = AimdConfig {
        initial: 10.0,
        min: 0.0,
        max: 100.0,
        increase: 1.0,
        decrease: 0.5,
        jitter: 0.2,
        target: 0.99,
        margin: 0.005,
        waiting_threshold: 0.0,
        waiting_persist: 3,
        use_fraction: 0.5,
        graded: false,
    };

    fn calm(own: f64) -> Signals {
        Signals {
            attainment: Some(1.0),
            waiting: 0.0,
            new_preemptions: 0.0,
            own_in_flight: own,
        }
    }

    #[test]
    fn window_grows_additively_only_with_margin_and_use() {
        let mut w = Aimd::new(CFG, 7);
        let Step::Grew(by) = w.on_reading(&calm(8.0)) else {
            panic!("should grow")
        };
        assert!((0.8..=1.2).contains(&by), "{by}");
        let before = w.window();
        // Attainment met but without margin.
        let s = Signals {
            attainment: Some(0.992),
            ..calm(8.0)
        };
        assert_eq!(w.on_reading(&s), Step::Held(Hold::NoMargin));
        // Window not used: 2 in flight of ~11.
        assert_eq!(w.on_reading(&calm(2.0)), Step::Held(Hold::Unused));
        // Something waits, not yet persistently.
        let s = Signals {
            waiting: 1.0,
            ..calm(8.0)
        };
        assert_eq!(w.on_reading(&s), Step::Held(Hold::Waiting));
        assert_eq!(w.window(), before);
    }

    #[test]
    fn window_cuts_multiplicatively_on_each_cause() {
        let preempt = Signals {
            new_preemptions: 2.0,
            ..calm(8.0)
        };
        let failed = Signals {
            attainment: Some(0.9),
            ..calm(8.0)
        };
        for (s, cause) in [(preempt, Cause::Preemption), (failed, Cause::Attainment)] {
            let mut w = Aimd::new(CFG, 1);
            assert_eq!(w.on_reading(&s), Step::Cut(cause));
            assert_eq!(w.window(), 5.0);
        }
        let mut w = Aimd::new(CFG, 1);
        let waiting = Signals {
            waiting: 3.0,
            ..calm(8.0)
        };
        assert_eq!(w.on_reading(&waiting), Step::Held(Hold::Waiting));
        assert_eq!(w.on_reading(&waiting), Step::Held(Hold::Waiting));
        assert_eq!(w.on_reading(&waiting), Step::Cut(Cause::Waiting));
        assert_eq!(w.window(), 5.0);
        // The streak starts over after a waiting cut.
        assert_eq!(w.on_reading(&waiting), Step::Held(Hold::Waiting));
        let mut w = Aimd::new(CFG, 1);
        assert!(w.on_congestion());
        assert_eq!(w.window(), 5.0);
    }

    #[test]
    fn graded_cuts_follow_the_size_of_the_miss_and_a_second_miss_cuts_fully() {
        let graded = AimdConfig {
            graded: true,
            waiting_threshold: 1.0,
            waiting_persist: 1,
            ..CFG
        };
        // target 0.99: the allowance is 0.01; a miss of a fifth of it cuts
        // a fifth of the way to `decrease` (0.5): ×0.9.
        let mut w = Aimd::new(graded, 1);
        let miss = Signals {
            attainment: Some(0.988),
            ..calm(10.0)
        };
        assert_eq!(w.on_reading(&miss), Step::Cut(Cause::Attainment));
        assert!((w.window() - 9.0).abs() < 1e-9, "{}", w.window());
        // The next reading misses again: no noise, the full cut.
        assert_eq!(w.on_reading(&miss), Step::Cut(Cause::Attainment));
        assert!((w.window() - 4.5).abs() < 1e-9, "{}", w.window());
        // Waiting 1.5 per engine over a threshold of 1: half an allowance.
        let mut w = Aimd::new(graded, 1);
        let waiting = Signals {
            waiting: 1.5,
            ..calm(10.0)
        };
        assert_eq!(w.on_reading(&waiting), Step::Cut(Cause::Waiting));
        assert!((w.window() - 7.5).abs() < 1e-9, "{}", w.window());
        // A miss of a whole allowance or more, 429/503 and preemption cut
        // the full `decrease` on the first reading.
        let mut w = Aimd::new(graded, 1);
        w.on_reading(&Signals {
            attainment: Some(0.95),
            ..calm(10.0)
        });
        assert!((w.window() - 5.0).abs() < 1e-9);
        let mut w = Aimd::new(graded, 1);
        w.on_reading(&Signals {
            new_preemptions: 1.0,
            ..calm(10.0)
        });
        assert!((w.window() - 5.0).abs() < 1e-9);
        let mut w = Aimd::new(graded, 1);
        assert!(w.on_congestion());
        assert!((w.window() - 5.0).abs() < 1e-9);
        // Not graded: any miss cuts the full `decrease`.
        let mut w = Aimd::new(CFG, 1);
        w.on_reading(&miss);
        assert!((w.window() - 5.0).abs() < 1e-9);
    }

    #[test]
    fn one_burst_of_429s_is_one_cut_per_interval() {
        let mut w = Aimd::new(CFG, 1);
        let cuts = (0..30).filter(|_| w.on_congestion()).count();
        assert_eq!(cuts, 1);
        assert_eq!(w.window(), 5.0);
        // The reading closing that interval neither grows nor cuts again.
        let preempt = Signals {
            new_preemptions: 1.0,
            ..calm(5.0)
        };
        assert_eq!(
            w.on_reading(&preempt),
            Step::Held(Hold::AlreadyCut(Cause::Preemption))
        );
        // The next interval may cut again, and its reading does not grow.
        assert!(w.on_congestion());
        assert_eq!(w.window(), 2.5);
        assert_eq!(w.on_reading(&calm(5.0)), Step::Held(Hold::Congested));
    }

    #[test]
    fn window_stays_within_floor_and_ceiling() {
        let mut w = Aimd::new(AimdConfig { min: 2.0, ..CFG }, 3);
        for _ in 0..20 {
            w.on_congestion();
            w.on_reading(&calm(0.0));
        }
        assert_eq!(w.window(), 2.0);
        let mut w = Aimd::new(CFG, 3);
        for _ in 0..500 {
            let own = w.window();
            w.on_reading(&calm(own));
        }
        assert_eq!(w.window(), 100.0);
        assert_eq!(w.on_reading(&calm(100.0)), Step::Held(Hold::AtMax));
    }

    #[test]
    fn a_window_too_small_to_use_may_still_grow() {
        let mut w = Aimd::new(
            AimdConfig {
                initial: 0.0,
                ..CFG
            },
            3,
        );
        assert!(matches!(w.on_reading(&calm(0.0)), Step::Grew(_)));
    }

    #[test]
    fn jitter_is_deterministic_for_a_seed_and_differs_between_seeds() {
        let run = |seed| {
            let mut w = Aimd::new(CFG, seed);
            (0..20)
                .map(|_| {
                    let own = w.window();
                    w.on_reading(&calm(own));
                    w.window()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        let mut rng = SplitMix64::new(9);
        assert!(
            (0..1000)
                .map(|_| rng.symmetric())
                .all(|u| (-1.0..=1.0).contains(&u))
        );
    }

    fn series(labels: &[(&str, &str)], buckets: &[(f64, f64)], sum: f64) -> HistogramSeries {
        HistogramSeries {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            buckets: buckets.to_vec(),
            sum: Some(sum),
            count: buckets.last().map(|b| b.1),
        }
    }

    #[test]
    fn histogram_delta_reads_the_interval_at_the_edge_below_the_threshold() {
        let inf = f64::INFINITY;
        let before = [
            series(
                &[("model_name", "chat")],
                &[(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (inf, 20.0)],
                4.0,
            ),
            series(
                &[("model_name", "batch")],
                &[(0.1, 0.0), (0.5, 0.0), (1.0, 50.0), (inf, 50.0)],
                40.0,
            ),
        ];
        let after = [
            series(
                &[("model_name", "chat")],
                &[(0.1, 50.0), (0.5, 118.0), (1.0, 119.0), (inf, 120.0)],
                24.0,
            ),
            series(
                &[("model_name", "batch")],
                &[(0.1, 0.0), (0.5, 0.0), (1.0, 90.0), (inf, 90.0)],
                80.0,
            ),
        ];
        let chat: BTreeMap<String, String> = [("model_name".to_owned(), "chat".to_owned())].into();
        let d = Histogram::select(&after, &chat)
            .unwrap()
            .since(&Histogram::select(&before, &chat).unwrap())
            .unwrap();
        assert_eq!(d.count, 100.0);
        assert_eq!(d.fraction_within(0.5), Some(0.98));
        // 0.7 lies between edges: read at 0.5.
        assert_eq!(d.fraction_within(0.7), Some(0.98));
        assert_eq!(d.fraction_within(0.05), Some(0.0));
        assert_eq!(d.quantile(0.5), Some(0.5));
        assert_eq!(d.quantile(0.99), Some(1.0));
        assert_eq!(d.quantile(1.0), Some(inf));
        assert_eq!(d.mean(), Some(0.2));
        // Without a filter the batch series dilutes the interactive one.
        let all = BTreeMap::new();
        let d = Histogram::select(&after, &all)
            .unwrap()
            .since(&Histogram::select(&before, &all).unwrap())
            .unwrap();
        assert_eq!(d.count, 140.0);
        assert!((d.fraction_within(0.5).unwrap() - 98.0 / 140.0).abs() < 1e-12);
        // A restart (counters down) gives no interval; no match gives none.
        assert!(
            Histogram::select(&before, &chat)
                .unwrap()
                .since(&Histogram::select(&after, &chat).unwrap())
                .is_none()
        );
        let other: BTreeMap<String, String> = [("model_name".to_owned(), "x".to_owned())].into();
        assert!(Histogram::select(&after, &other).is_none());
        assert_eq!(Histogram::default().fraction_within(1.0), None);
    }

    #[test]
    fn attainment_is_the_lower_bound_of_the_joint_fraction() {
        assert_eq!(attainment(None, None), None);
        assert_eq!(attainment(Some(0.99), None), Some(0.99));
        assert!((attainment(Some(0.995), Some(0.99)).unwrap() - 0.985).abs() < 1e-12);
        assert_eq!(attainment(Some(0.3), Some(0.2)), Some(0.0));
    }

    const KALMAN: KalmanConfig = KalmanConfig {
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
    fn interpolated_quantiles_fall_inside_their_bucket() {
        let inf = f64::INFINITY;
        let h = Histogram::select(
            &[series(
                &[],
                &[(0.025, 50.0), (0.05, 90.0), (0.075, 100.0), (inf, 100.0)],
                3.0,
            )],
            &BTreeMap::new(),
        )
        .unwrap();
        // Rank 70 is half-way through the (0.025, 0.05] bucket (50 → 90).
        let q = h.quantile_interpolated(0.7).unwrap();
        assert!((q - 0.0375).abs() < 1e-12, "{q}");
        // The bucket-edge reading over-estimates; interpolation does not.
        assert_eq!(h.quantile(0.7), Some(0.05));
        assert!((h.quantile_interpolated(0.25).unwrap() - 0.0125).abs() < 1e-12);
        assert_eq!(h.quantile_interpolated(1.0), Some(0.075));
        let empty = Histogram::select(&[series(&[], &[(inf, 0.0)], 0.0)], &BTreeMap::new());
        assert!(empty.is_none_or(|h| h.quantile_interpolated(0.5).is_none()));
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

    #[test]
    fn regression_recovers_exact_coefficients() {
        let mut r = NnlsLine::new(10);
        for x in 0..10 {
            let x = f64::from(x) * 4.0;
            r.push(x, 0.01 + 0.0005 * x);
        }
        let l = r.fit().unwrap();
        assert!(
            (l.a - 0.01).abs() < 1e-12 && (l.b - 0.0005).abs() < 1e-12,
            "{l:?}"
        );
        assert_eq!(r.spread(), 36.0);
    }

    #[test]
    fn regression_refuses_negative_coefficients() {
        // A true negative slope: the best non-negative line is flat.
        let mut r = NnlsLine::new(10);
        for x in 0..10 {
            let x = f64::from(x);
            r.push(x, 1.0 - 0.05 * x);
        }
        let l = r.fit().unwrap();
        assert_eq!(l.b, 0.0);
        assert!((l.a - 0.775).abs() < 1e-12, "{l:?}");
        // A true negative intercept: refitted through the origin.
        let mut r = NnlsLine::new(10);
        for x in 1..=10 {
            let x = f64::from(x);
            r.push(x, -1.0 + x);
        }
        let l = r.fit().unwrap();
        assert_eq!(l.a, 0.0);
        assert!(l.b > 0.0);
    }

    #[test]
    fn regression_window_slides() {
        let mut r = NnlsLine::new(3);
        for x in 0..3 {
            r.push(f64::from(x), 100.0);
        }
        for x in 10..13 {
            let x = f64::from(x);
            r.push(x, 2.0 * x);
        }
        assert_eq!(r.len(), 3);
        let l = r.fit().unwrap();
        assert!(l.a.abs() < 1e-9 && (l.b - 2.0).abs() < 1e-9, "{l:?}");
    }

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
