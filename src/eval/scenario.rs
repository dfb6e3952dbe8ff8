//! The scenarios `sluicegate eval` runs: fixed seeds, two pool sizes, and
//! interactive load shapes that stress a gate in different ways.

use std::path::Path;

use serde::Serialize;

use crate::sim::config::{EngineConfig, GatewayConfig, LoadConfig, LoadMode, SchedPolicy};
use crate::sim::error::SimError;
use crate::sim::load::read_trace;
use crate::sim::pool::PoolConfig;

/// A pool size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolSize {
    /// 4 replicas of an 8B-like engine.
    Small,
    /// 16 replicas of the same engine.
    Large,
}

impl PoolSize {
    /// Every size.
    pub const ALL: [PoolSize; 2] = [PoolSize::Small, PoolSize::Large];

    /// Replicas in the pool.
    pub fn replicas(self) -> usize {
        match self {
            PoolSize::Small => 4,
            PoolSize::Large => 16,
        }
    }

    /// Its name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PoolSize::Small => "small",
            PoolSize::Large => "large",
        }
    }

    /// The pool: vLLM-like engines (the simulator's 8B-on-H100 defaults)
    /// behind an endpoint picker with flow control, as llm-d deploys it, so
    /// the picker's queue and saturation metrics mean what they mean there.
    pub fn pool(self) -> PoolConfig {
        PoolConfig {
            replicas: self.replicas(),
            engine: EngineConfig::default(),
            gateway: GatewayConfig {
                flow_control: true,
                ..GatewayConfig::default()
            },
        }
    }
}

/// The named load shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Shape {
    /// Constant-rate Poisson load.
    Steady,
    /// A compressed day: a sine over the run with random 2–3× bursts.
    Diurnal,
    /// Saturating bursts alternating with near-idle periods.
    Waves,
    /// Steady load that triples halfway.
    Step,
    /// Steady load with the metrics dark for 60 s.
    Blackout,
    /// Steady load whose prompts are 8× longer for a minute.
    LongContext,
    /// A CSV trace (`--trace FILE`).
    Trace,
}

impl Shape {
    /// The built-in shapes, in report order.
    pub const BUILT_IN: [Shape; 6] = [
        Shape::Steady,
        Shape::Diurnal,
        Shape::Waves,
        Shape::Step,
        Shape::Blackout,
        Shape::LongContext,
    ];

    /// Its name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Steady => "steady",
            Shape::Diurnal => "diurnal",
            Shape::Waves => "waves",
            Shape::Step => "step",
            Shape::Blackout => "blackout",
            Shape::LongContext => "long-context",
            Shape::Trace => "trace",
        }
    }

    /// The shape called `name`.
    pub fn parse(name: &str) -> Option<Shape> {
        Self::BUILT_IN.into_iter().find(|s| s.name() == name)
    }
}

/// Seed numbers for tuning: sweeps of gate parameters run on these (and
/// the shipped defaults were chosen on seed 0, the only seed before seed
/// sets existed). A scenario run on seed number `k` has seed
/// `base + k` (`base` is `0x5100_0000` plus the shape's index), so these
/// give seeds `base + 0 … base + 9`.
pub const TRAIN_SEEDS: [u64; 10] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9];

/// Seed numbers of the published tables: no default was tuned on them.
/// Far from the train seeds, so that no shape's test seed equals another
/// shape's train seed (`base + k` overlaps only within 6 of `k`).
pub const TEST_SEEDS: [u64; 5] = [100, 101, 102, 103, 104];

/// Interactive requests per second per replica in steady state: about
/// 40 % of a replica's SLO-feasible token throughput (`Θ` / replicas, 2 718
/// tokens/s on the calibrated engine, 128 output tokens a request), so
/// there is slack to harvest, the baseline meets its SLO and 3× the rate
/// (`waves`, `step`) saturates the pool. It was 4.0 on the first step
/// constants, whose `Θ` was 1 270 tokens/s per replica.
const STEADY_RATE: f64 = 8.5;

/// One scenario: a pool, an interactive load and what disturbs it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scenario {
    /// `<shape>` or `<shape>/<pool>`.
    pub name: String,
    /// The load shape.
    pub shape: Shape,
    /// The pool size.
    pub pool: PoolSize,
    /// Simulated seconds.
    pub duration_s: f64,
    /// Seed of load, lengths and jitter for seed number 0; seed number
    /// `k` runs with `seed + k` ([`Scenario::with_seed`]).
    pub seed: u64,
    /// Interactive load.
    #[serde(skip)]
    pub load: LoadConfig,
    /// Metrics dark in these `[start, end]` windows (seconds).
    pub blackouts: Vec<[f64; 2]>,
    /// The disturbance window, for recovery time: `[start, end]`.
    pub disturbance: Option<[f64; 2]>,
    /// When the interactive rate steps up, for reaction time.
    pub step_at: Option<f64>,
    /// The engines' scheduling policy (fcfs unless `--engine-policy`);
    /// under `priority` batch (priority 1) yields to interactive (0).
    pub engine_policy: SchedPolicy,
}

impl Scenario {
    /// The built-in `shape` on `pool`; `scale` stretches the duration
    /// (1.0 = the full run, smaller for quick runs).
    pub fn built_in(shape: Shape, pool: PoolSize, scale: f64) -> Scenario {
        let d = |s: f64| (s * scale).max(30.0);
        let mut load = LoadConfig {
            mode: LoadMode::Poisson,
            rate_per_replica: STEADY_RATE,
            diurnal_amplitude: 0.0,
            burst_mean_gap_s: 0.0,
            ..LoadConfig::default()
        };
        let mut sc = Scenario {
            name: format!("{}/{}", shape.name(), pool.name()),
            shape,
            pool,
            duration_s: d(600.0),
            seed: 0x5100_0000 + shape as u64,
            load: load.clone(),
            blackouts: Vec::new(),
            disturbance: None,
            step_at: None,
            engine_policy: SchedPolicy::Fcfs,
        };
        match shape {
            Shape::Steady | Shape::Trace => {}
            Shape::Diurnal => {
                // Peaks at 1.5× the steady rate, with an occasional 2×
                // burst on top: busy, but within what the pool serves.
                sc.duration_s = d(1200.0);
                load.diurnal_amplitude = 0.5;
                load.diurnal_period_s = sc.duration_s;
                load.burst_mean_gap_s = sc.duration_s / 3.0;
                load.burst_duration_s = [30.0, 60.0];
                load.burst_factor = [1.5, 2.0];
            }
            Shape::Waves => {
                sc.duration_s = d(900.0);
                load.mode = LoadMode::Waves;
                load.waves_high_rate_per_replica = STEADY_RATE * 3.0;
                load.waves_low_rate_per_replica = 0.3;
                load.waves_high_s = 60.0;
                load.waves_low_s = 90.0;
            }
            Shape::Step => {
                let at = sc.duration_s / 2.0;
                load.rate_step_at_s = Some(at);
                load.rate_step_factor = 3.0;
                sc.step_at = Some(at);
            }
            Shape::Blackout => {
                let start = (sc.duration_s / 2.0).floor();
                let window = [start, start + 60.0];
                sc.blackouts = vec![window];
                sc.disturbance = Some(window);
            }
            Shape::LongContext => {
                // A minute: 5.5× prompts at the steady rate nearly
                // saturate prefill even without batch work (8.5 × 2 816
                // tokens × 0.0345 ms ≈ 0.83 s of prefill a second, as 8×
                // at 4/s was on the first step constants).
                let start = (sc.duration_s / 2.0).floor();
                let window = [start, start + 60.0];
                load.long_prompt_window_s = Some(window);
                load.long_prompt_factor = 5.5;
                sc.disturbance = Some(window);
            }
        }
        sc.load = load;
        sc
    }

    /// This scenario on seed number `k` (see [`TRAIN_SEEDS`]).
    pub fn with_seed(&self, k: u64) -> Scenario {
        Scenario {
            seed: self.seed.wrapping_add(k),
            ..self.clone()
        }
    }

    /// A trace replay on `pool`: the run lasts as long as the trace.
    pub fn trace(path: &Path, pool: PoolSize) -> Result<Scenario, SimError> {
        let rows = read_trace(path)?;
        let first = rows.first().map_or(0.0, |r| r.timestamp);
        let last = rows.last().map_or(0.0, |r| r.timestamp);
        let mut sc = Scenario::built_in(Shape::Trace, pool, 1.0);
        sc.duration_s = (last - first).max(30.0);
        sc.name = format!("trace/{}", pool.name());
        sc.load.mode = LoadMode::Trace;
        sc.load.trace_file = Some(path.to_path_buf());
        Ok(sc)
    }
}
