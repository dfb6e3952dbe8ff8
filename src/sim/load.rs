//! Seeded arrival processes: Poisson with a compressed diurnal wave and
//! bursts, "waves", and CSV trace replay; lognormal request lengths.

use std::collections::VecDeque;
use std::path::Path;

use rand::RngExt;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, LogNormal};

use super::config::{LoadConfig, LoadMode};
use super::error::SimError;
use super::time::SimTime;

/// One generated request (class and id are the caller's business).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Arrival time at the gateway.
    pub at: SimTime,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// True output length, tokens.
    pub output_tokens: u32,
    /// Client `max_tokens`.
    pub max_tokens: u32,
    /// vLLM priority.
    pub priority: i32,
}

/// One row of a CSV trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRow {
    /// Seconds (any origin; replay starts at the first row).
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
}

/// Parses `timestamp,input_tokens,output_tokens` lines; a non-numeric first
/// line is a header; blank lines and `#` comments are skipped.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRow>, SimError> {
    let mut rows: Vec<TraceRow> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let err = |message: String| SimError::TraceParse {
            line: n + 1,
            message,
        };
        if rows.is_empty() && n == 0 && fields.first().is_some_and(|f| f.parse::<f64>().is_err()) {
            continue; // header
        }
        if fields.len() != 3 {
            return Err(err(format!("expected 3 fields, found {}", fields.len())));
        }
        let timestamp: f64 = fields[0]
            .parse()
            .map_err(|_| err(format!("timestamp {:?} is not a number", fields[0])))?;
        if !timestamp.is_finite() {
            return Err(err("timestamp must be finite".into()));
        }
        let tok = |i: usize, what: &str| -> Result<u32, SimError> {
            fields[i].parse::<u32>().map_err(|_| {
                err(format!(
                    "{what} {:?} is not a non-negative integer",
                    fields[i]
                ))
            })
        };
        let row = TraceRow {
            timestamp,
            input_tokens: tok(1, "input_tokens")?,
            output_tokens: tok(2, "output_tokens")?,
        };
        if let Some(prev) = rows.last()
            && row.timestamp < prev.timestamp
        {
            return Err(err("timestamps must not decrease".into()));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Reads and parses a trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRow>, SimError> {
    let text = std::fs::read_to_string(path).map_err(|source| SimError::TraceRead {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(&text)
}

/// Lognormal prompt and output lengths, kept within the model length.
#[derive(Debug, Clone)]
pub struct LengthModel {
    prompt: LogNormal<f64>,
    output: LogNormal<f64>,
    max_tokens: u32,
    max_model_len: u32,
}

impl LengthModel {
    /// From means and coefficients of variation.
    pub fn new(
        prompt_mean: f64,
        prompt_cv: f64,
        output_mean: f64,
        output_cv: f64,
        max_tokens: u32,
        max_model_len: u32,
    ) -> Result<Self, SimError> {
        let ln = |key: &str, m: f64, cv: f64| {
            LogNormal::from_mean_cv(m, cv).map_err(|source| SimError::Distribution {
                key: key.to_owned(),
                source,
            })
        };
        Ok(Self {
            prompt: ln("prompt_mean", prompt_mean, prompt_cv)?,
            output: ln("output_mean", output_mean, output_cv)?,
            max_tokens: max_tokens.max(1),
            max_model_len: max_model_len.max(2),
        })
    }

    /// From a load section.
    pub fn from_load(cfg: &LoadConfig, max_model_len: u32) -> Result<Self, SimError> {
        Self::new(
            cfg.prompt_mean,
            cfg.prompt_cv,
            cfg.output_mean,
            cfg.output_cv,
            cfg.max_tokens,
            max_model_len,
        )
    }

    /// `(prompt, true output, max_tokens)`, with `prompt + max_tokens <= max_model_len`.
    pub fn draw(&self, rng: &mut Xoshiro256PlusPlus) -> (u32, u32, u32) {
        let p = self.prompt.sample(rng).round();
        let o = self.output.sample(rng).round();
        self.fit(p, o, self.max_tokens)
    }

    /// Clamps lengths into the model window.
    pub fn fit(&self, prompt: f64, output: f64, max_tokens: u32) -> (u32, u32, u32) {
        // Prompts may use at most three quarters of the window so that some
        // output always fits.
        let p_cap = (self.max_model_len - 1)
            .min(self.max_model_len * 3 / 4)
            .max(1);
        let prompt = (prompt.max(1.0) as u32).min(p_cap);
        let max_tokens = max_tokens.clamp(1, self.max_model_len - prompt);
        let output = (output.max(1.0) as u32).min(max_tokens);
        (prompt, output, max_tokens)
    }
}

#[derive(Debug, Clone)]
enum Process {
    Off,
    Poisson {
        base: f64,
        amp: f64,
        period: f64,
        burst_gap: f64,
        burst_len: [f64; 2],
        burst_factor: [f64; 2],
        /// Bursts generated so far that may still matter: (start, end, factor).
        bursts: VecDeque<(f64, f64, f64)>,
        next_burst: f64,
    },
    Waves {
        high: f64,
        low: f64,
        high_s: f64,
        low_s: f64,
    },
    Trace {
        rows: Vec<TraceRow>,
        next: usize,
        speed: f64,
    },
}

/// A deterministic stream of arrivals in time order.
#[derive(Debug, Clone)]
pub struct LoadGenerator {
    process: Process,
    lengths: LengthModel,
    rng: Xoshiro256PlusPlus,
    t: SimTime,
    priority: i32,
    /// `(at, factor)`: rates are multiplied by `factor` from `at` on.
    rate_step: Option<(SimTime, f64)>,
    /// `([start, end], factor)`: prompts are longer inside the window.
    long_prompts: Option<([SimTime; 2], f64)>,
}

impl LoadGenerator {
    /// Builds the generator a load section describes (reads the trace file).
    pub fn new(
        cfg: &LoadConfig,
        replicas: usize,
        max_model_len: u32,
        seed: u64,
    ) -> Result<Self, SimError> {
        let rows = match (&cfg.mode, &cfg.trace_file) {
            (LoadMode::Trace, Some(path)) => read_trace(path)?,
            _ => Vec::new(),
        };
        Self::with_trace(cfg, replicas, max_model_len, seed, rows)
    }

    /// Like [`LoadGenerator::new`] with trace rows supplied directly.
    pub fn with_trace(
        cfg: &LoadConfig,
        replicas: usize,
        max_model_len: u32,
        seed: u64,
        rows: Vec<TraceRow>,
    ) -> Result<Self, SimError> {
        cfg.validate_ranges("load")?;
        let n = replicas.max(1) as f64;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let process = match cfg.mode {
            LoadMode::Off => Process::Off,
            LoadMode::Poisson => {
                let next_burst = if cfg.burst_mean_gap_s > 0.0 {
                    exp_sample(&mut rng, 1.0 / cfg.burst_mean_gap_s)
                } else {
                    f64::INFINITY
                };
                Process::Poisson {
                    base: cfg.rate_per_replica * n,
                    amp: cfg.diurnal_amplitude,
                    period: cfg.diurnal_period_s,
                    burst_gap: cfg.burst_mean_gap_s,
                    burst_len: cfg.burst_duration_s,
                    burst_factor: cfg.burst_factor,
                    bursts: VecDeque::new(),
                    next_burst,
                }
            }
            LoadMode::Waves => Process::Waves {
                high: cfg.waves_high_rate_per_replica * n,
                low: cfg.waves_low_rate_per_replica * n,
                high_s: cfg.waves_high_s,
                low_s: cfg.waves_low_s,
            },
            LoadMode::Trace => Process::Trace {
                rows,
                next: 0,
                speed: cfg.trace_speed,
            },
        };
        Ok(Self {
            process,
            lengths: LengthModel::from_load(cfg, max_model_len)?,
            rng,
            t: 0.0,
            priority: cfg.priority,
            rate_step: cfg.rate_step_at_s.map(|at| (at, cfg.rate_step_factor)),
            long_prompts: cfg
                .long_prompt_window_s
                .map(|w| (w, cfg.long_prompt_factor)),
        })
    }

    /// The arrival rate (requests per second) the process targets at `t`,
    /// for the bursts generated so far.
    pub fn rate_at(&self, t: SimTime) -> f64 {
        self.base_rate_at(t) * self.step_factor(t)
    }

    /// The rate multiplier of the configured step at `t`.
    fn step_factor(&self, t: SimTime) -> f64 {
        match self.rate_step {
            Some((at, factor)) if t >= at => factor,
            _ => 1.0,
        }
    }

    /// The prompt multiplier at `t`.
    fn prompt_factor(&self, t: SimTime) -> f64 {
        match self.long_prompts {
            Some(([start, end], factor)) if (start..end).contains(&t) => factor,
            _ => 1.0,
        }
    }

    /// The process's own rate at `t`, before the step.
    fn base_rate_at(&self, t: SimTime) -> f64 {
        match &self.process {
            Process::Off | Process::Trace { .. } => 0.0,
            Process::Poisson {
                base,
                amp,
                period,
                bursts,
                ..
            } => {
                let diurnal = 1.0 + amp * (2.0 * std::f64::consts::PI * t / period).sin();
                let burst = bursts
                    .iter()
                    .filter(|(s, e, _)| (*s..*e).contains(&t))
                    .map(|b| b.2)
                    .fold(1.0, f64::max);
                base * diurnal * burst
            }
            Process::Waves {
                high,
                low,
                high_s,
                low_s,
            } => {
                if t.rem_euclid(high_s + low_s) < *high_s {
                    *high
                } else {
                    *low
                }
            }
        }
    }

    /// Generates bursts up to `t` and forgets the ones that ended.
    fn extend_bursts(&mut self, t: SimTime) {
        if let Process::Poisson {
            burst_gap,
            burst_len,
            burst_factor,
            bursts,
            next_burst,
            ..
        } = &mut self.process
        {
            while *next_burst <= t {
                let start = *next_burst;
                let len = self.rng.random_range(burst_len[0]..=burst_len[1]);
                let f = self.rng.random_range(burst_factor[0]..=burst_factor[1]);
                bursts.push_back((start, start + len, f));
                *next_burst = start + exp_sample(&mut self.rng, 1.0 / *burst_gap);
            }
            while bursts.front().is_some_and(|b| b.1 < t) {
                bursts.pop_front();
            }
        }
    }

    fn rate_bound(&self) -> f64 {
        let step = self.rate_step.map_or(1.0, |(_, f)| f.max(1.0));
        step * match &self.process {
            Process::Off | Process::Trace { .. } => 0.0,
            Process::Poisson {
                base,
                amp,
                burst_factor,
                ..
            } => base * (1.0 + amp) * burst_factor[1].max(1.0),
            Process::Waves { high, low, .. } => high.max(*low),
        }
    }

    /// The next arrival, or `None` when the process is exhausted (off, or
    /// the trace ended).
    pub fn next_arrival(&mut self) -> Option<Arrival> {
        if let Process::Trace { rows, next, speed } = &mut self.process {
            let row = *rows.get(*next)?;
            let t0 = rows.first().map_or(0.0, |r| r.timestamp);
            *next += 1;
            let at = (row.timestamp - t0) / *speed;
            let max_tokens = self.lengths.max_tokens.max(row.output_tokens);
            let prompt_factor = self.prompt_factor(at);
            let (p, o, m) = self.lengths.fit(
                f64::from(row.input_tokens) * prompt_factor,
                f64::from(row.output_tokens),
                max_tokens,
            );
            return Some(Arrival {
                at,
                prompt_tokens: p,
                output_tokens: o,
                max_tokens: m,
                priority: self.priority,
            });
        }
        let bound = self.rate_bound();
        if bound <= 0.0 {
            return None;
        }
        // Thinning (Lewis–Shedler): candidates at the bound rate, accepted
        // with probability rate(t) / bound.
        loop {
            self.t += exp_sample(&mut self.rng, bound);
            self.extend_bursts(self.t);
            let accept = self.rate_at(self.t) / bound;
            if self.rng.random::<f64>() < accept {
                break;
            }
        }
        let (mut p, mut o, mut m) = self.lengths.draw(&mut self.rng);
        let prompt_factor = self.prompt_factor(self.t);
        if prompt_factor != 1.0 {
            (p, o, m) = self
                .lengths
                .fit(f64::from(p) * prompt_factor, f64::from(o), m);
        }
        Some(Arrival {
            at: self.t,
            prompt_tokens: p,
            output_tokens: o,
            max_tokens: m,
            priority: self.priority,
        })
    }
}

impl Iterator for LoadGenerator {
    type Item = Arrival;

    fn next(&mut self) -> Option<Arrival> {
        self.next_arrival()
    }
}

/// Exponential sample with the given rate (per second).
/// An exponential draw of `rate` (a Poisson process's next gap).
pub(crate) fn exp_sample(rng: &mut Xoshiro256PlusPlus, rate: f64) -> f64 {
    // 1 - U is in (0, 1], so the log is finite.
    -(1.0 - rng.random::<f64>()).ln() / rate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mode: LoadMode) -> LoadConfig {
        LoadConfig {
            mode,
            ..LoadConfig::default()
        }
    }

    #[test]
    fn poisson_mean_rate_and_lengths_match_config() {
        let mut c = cfg(LoadMode::Poisson);
        c.burst_mean_gap_s = 0.0;
        c.diurnal_amplitude = 0.0;
        c.rate_per_replica = 10.0;
        let g = LoadGenerator::new(&c, 2, 8192, 3).unwrap();
        let v: Vec<Arrival> = g.take_while(|a| a.at < 500.0).collect();
        let rate = v.len() as f64 / 500.0;
        assert!((rate - 20.0).abs() < 1.0, "rate {rate}");
        let mean_p = v.iter().map(|a| f64::from(a.prompt_tokens)).sum::<f64>() / v.len() as f64;
        let mean_o = v.iter().map(|a| f64::from(a.output_tokens)).sum::<f64>() / v.len() as f64;
        assert!((mean_p - 512.0).abs() < 25.0, "prompt mean {mean_p}");
        assert!((mean_o - 128.0).abs() < 8.0, "output mean {mean_o}");
        assert!(v.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn diurnal_wave_and_bursts_modulate_the_rate() {
        let mut c = cfg(LoadMode::Poisson);
        c.burst_mean_gap_s = 300.0;
        let mut g = LoadGenerator::new(&c, 1, 8192, 5).unwrap();
        let mut peak = 0.0f64;
        while let Some(a) = g.next_arrival() {
            if a.at > 3600.0 {
                break;
            }
            peak = peak.max(g.rate_at(a.at));
        }
        // base 8 × diurnal up to 1.4 × bursts of 2–3×.
        assert!(peak > 8.0 * 1.4 * 1.9, "peak {peak}");
    }

    #[test]
    fn waves_alternate_between_high_and_low() {
        let c = cfg(LoadMode::Waves);
        let g = LoadGenerator::new(&c, 1, 8192, 9).unwrap();
        let v: Vec<Arrival> = g.take_while(|a| a.at < 150.0).collect();
        let high = v.iter().filter(|a| a.at < 60.0).count() as f64 / 60.0;
        let low = v.iter().filter(|a| a.at >= 60.0).count() as f64 / 90.0;
        assert!(high > 25.0 && low < 2.0, "high {high} low {low}");
    }

    #[test]
    fn a_rate_step_multiplies_the_rate_and_long_prompts_stay_in_their_window() {
        let mut c = cfg(LoadMode::Poisson);
        c.diurnal_amplitude = 0.0;
        c.burst_mean_gap_s = 0.0;
        c.rate_step_at_s = Some(500.0);
        c.rate_step_factor = 3.0;
        c.long_prompt_window_s = Some([200.0, 300.0]);
        c.long_prompt_factor = 8.0;
        let g = LoadGenerator::new(&c, 1, 32_768, 5).unwrap();
        let arrivals: Vec<Arrival> = g.take_while(|a| a.at < 1000.0).collect();
        let before = arrivals.iter().filter(|a| a.at < 500.0).count() as f64;
        let after = arrivals.iter().filter(|a| a.at >= 500.0).count() as f64;
        let ratio = after / before;
        assert!((2.6..3.4).contains(&ratio), "rate ratio {ratio}");
        let mean_prompt = |lo: f64, hi: f64| {
            let v: Vec<f64> = arrivals
                .iter()
                .filter(|a| (lo..hi).contains(&a.at))
                .map(|a| f64::from(a.prompt_tokens))
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        let long = mean_prompt(200.0, 300.0);
        let normal = mean_prompt(0.0, 200.0);
        assert!(long / normal > 5.0, "{long} vs {normal}");
        assert!(mean_prompt(300.0, 500.0) / normal < 1.5);
    }

    #[test]
    fn same_seed_same_stream() {
        let c = cfg(LoadMode::Poisson);
        let a: Vec<Arrival> = LoadGenerator::new(&c, 2, 8192, 11)
            .unwrap()
            .take(200)
            .collect();
        let b: Vec<Arrival> = LoadGenerator::new(&c, 2, 8192, 11)
            .unwrap()
            .take(200)
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn trace_replays_relative_to_first_row() {
        let rows = parse_trace("timestamp,input_tokens,output_tokens\n100.5,10,20\n101.5,30,40\n")
            .unwrap();
        let mut c = cfg(LoadMode::Trace);
        c.trace_speed = 2.0;
        let g = LoadGenerator::with_trace(&c, 1, 8192, 1, rows).unwrap();
        let v: Vec<Arrival> = g.collect();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].at, 0.0);
        assert_eq!(v[1].at, 0.5);
        assert_eq!((v[1].prompt_tokens, v[1].output_tokens), (30, 40));
    }

    #[test]
    fn trace_errors_name_the_line() {
        let err = parse_trace("0,1,2\n1,x,2\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        assert!(parse_trace("5,1,2\n4,1,2\n").is_err());
    }
}
