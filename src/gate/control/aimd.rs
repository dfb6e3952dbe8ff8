//! The additive-increase / multiplicative-decrease window of `feedback`.

use super::jitter::SplitMix64;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
