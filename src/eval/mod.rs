//! `sluicegate eval`: gate quality in virtual time. Each scenario runs on
//! each seed once without batch work (the baseline, shared by every
//! contender) and once per contender; each run is scored against the
//! baseline of its seed (harvest `H` against `Θ` and `H*` against the
//! physical bound, excess SLO violations `ΔV`, tail inflation `ρ`,
//! reaction, recovery, oscillation), and the seeds are summarised as mean
//! and min–max. Every random stream is paired between a baseline and its
//! runs (common random numbers, `crate::sim::runner::run`), so a
//! difference is the contender's alone.
//!
//! # Layout
//! - [`scenario`]: the scenarios (load shapes, pool sizes, fixed seeds).
//! - [`contender`]: the baselines and gates compared.
//! - [`harness`]: the production gate, window and congestion hold driving
//!   the simulated batch on a paused clock.
//! - `endpoint.rs` / `promql.rs`: the pool's `/metrics` page and a
//!   Prometheus view of it, served in-process to the gates' own sources.
//! - [`score`]: the figures, pure.
//! - `chart.rs`: the run over time as an SVG.

mod chart;
pub mod contender;
mod endpoint;
pub mod harness;
pub mod live;
mod promql;
pub mod scenario;
pub mod score;
pub mod series;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;

pub use chart::timeline_svg;
pub use contender::{Contender, Kind, NamedSpec};
pub use endpoint::{PAGE_URL, SimMetrics};
pub use harness::{GatePolicy, GateSample, HarnessError, Release};
pub use scenario::{PoolSize, Scenario, Shape, TEST_SEEDS, TRAIN_SEEDS};
pub use score::{Interactive, PhysicalBound, Score, Slo};

use crate::dispatch::DispatchSettings;
use crate::sim::engine::RequestClass;
use crate::sim::error::SimError;
use crate::sim::metrics::{ExpositionLabels, ViewConfig};
use crate::sim::runner::{
    self, BatchPolicy, BatchSpec, NoBatch, RunReport, SeriesPoint, StaticCap,
};

/// Why an evaluation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The simulator refused a scenario.
    #[error("scenario {scenario}: {source}")]
    Sim {
        /// Scenario name.
        scenario: String,
        /// Why.
        #[source]
        source: SimError,
    },
    /// A contender could not be set up.
    #[error(transparent)]
    Harness(#[from] HarnessError),
}

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct Options {
    /// The scenarios (their seed is seed number 0's).
    pub scenarios: Vec<Scenario>,
    /// Seed numbers every scenario runs on ([`TEST_SEEDS`], [`TRAIN_SEEDS`]).
    pub seeds: Vec<u64>,
    /// The contenders.
    pub contenders: Vec<Contender>,
    /// The dispatcher settings of every gate (the configuration's
    /// defaults unless a caller changes them).
    pub settings: DispatchSettings,
    /// Whether each pool's `max_sys` is its SLO-feasible batch concurrency
    /// (the cap `Θ` is measured at), so no gate's window is capped by a
    /// default; otherwise `settings.max_sys`.
    pub pool_max_sys: bool,
    /// The interactive SLO.
    pub slo: Slo,
    /// Worker threads (runs are independent).
    pub threads: usize,
}

/// Mean and range over seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// Of `values` (zeros when there are none).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return Self {
                mean: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// A contender's figures over the seeds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// `H`.
    pub harvest: Spread,
    /// `H*`.
    pub harvest_bound: Spread,
    /// `ΔV`, percentage points.
    pub delta_v_pp: Spread,
    /// `ρ(TTFT p99)`.
    pub rho_ttft: Spread,
    /// `ρ(ITL p99)`.
    pub rho_itl: Spread,
    /// Interactive ITL p99 with the contender, seconds.
    pub itl_p99_s: Spread,
    /// Batch tokens per second.
    pub batch_tokens_per_s: Spread,
    /// Mean reaction time over the seeds where it is defined.
    pub reaction_s: Option<f64>,
    /// Mean recovery time over the seeds where it is defined.
    pub recovery_s: Option<f64>,
    /// Mean oscillation over the seeds where it is defined.
    pub oscillation_cv: Option<f64>,
    /// Mean share of 1 s samples without batch in the pool.
    pub batch_idle_fraction: f64,
    /// Mean 429/503 answers per run.
    pub rejections: f64,
    /// Mean preemptions per run.
    pub preemptions: f64,
    /// Dark dispatches over every seed (must be 0).
    pub dark_dispatches: u64,
    /// Whether the means keep the SLO budget ([`score::within_budget`]).
    pub within_budget: bool,
    /// Seeds whose run keeps the SLO budget on its own.
    pub seeds_within_budget: usize,
}

fn mean_of(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = values.flatten().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

impl Summary {
    /// Of one contender's runs, one per seed.
    pub fn of(runs: &[Score], slo: Slo) -> Self {
        let spread = |f: fn(&Score) -> f64| Spread::of(runs.iter().map(f));
        let n = runs.len().max(1) as f64;
        let (dv, rt, ri, itl) = (
            spread(|s| s.delta_v_pp),
            spread(|s| s.rho_ttft),
            spread(|s| s.rho_itl),
            spread(|s| s.interactive.itl_p99_s),
        );
        Self {
            harvest: spread(|s| s.harvest),
            harvest_bound: spread(|s| s.harvest_bound),
            delta_v_pp: dv,
            rho_ttft: rt,
            rho_itl: ri,
            itl_p99_s: itl,
            batch_tokens_per_s: spread(|s| s.batch_tokens_per_s),
            reaction_s: mean_of(runs.iter().map(|s| s.reaction_s)),
            recovery_s: mean_of(runs.iter().map(|s| s.recovery_s)),
            oscillation_cv: mean_of(runs.iter().map(|s| s.oscillation_cv)),
            batch_idle_fraction: runs.iter().map(|s| s.batch_idle_fraction).sum::<f64>() / n,
            rejections: runs.iter().map(|s| s.rejections as f64).sum::<f64>() / n,
            preemptions: runs.iter().map(|s| s.preemptions as f64).sum::<f64>() / n,
            dark_dispatches: runs.iter().map(|s| s.dark_dispatches).sum(),
            within_budget: score::within_budget(dv.mean, rt.mean, ri.mean, itl.mean, slo),
            seeds_within_budget: runs.iter().filter(|s| within_slo_budget(s, slo)).count(),
        }
    }
}

/// One contender in one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Contender name.
    pub contender: String,
    /// What the figures are of, when not obvious (the oracle's cap).
    pub detail: Option<String>,
    /// Whether this is a sluicegate gate through the window (not a
    /// baseline).
    pub gate: bool,
    /// The figures over the seeds.
    pub summary: Summary,
    /// The figures of each seed, in the report's seed order.
    pub runs: Vec<Score>,
    /// The first seed's run over time, for charts.
    #[serde(skip)]
    pub timeline: Timeline,
}

impl Row {
    /// The first seed's figures (the run the timeline shows).
    pub fn first(&self) -> Option<&Score> {
        self.runs.first()
    }
}

/// A scenario's batch-free baseline on one seed.
#[derive(Debug, Clone, Serialize)]
pub struct SeedBaseline {
    /// Seed number ([`TEST_SEEDS`]).
    pub seed_number: u64,
    /// The seed the runs used.
    pub seed: u64,
    /// Slack tokens over the run (against `Θ`).
    pub slack_tokens: f64,
    /// The physical bound's batch tokens over the run.
    pub bound_tokens: f64,
    /// The interactive figures without batch.
    pub interactive: Interactive,
}

/// A scenario's results.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// The scenario (seed number 0's seed).
    pub scenario: Scenario,
    /// `Θ`: the pool's SLO-feasible token throughput, tokens/s.
    pub capacity_tokens_per_s: f64,
    /// `max_sys` the gates ran with.
    pub max_sys: f64,
    /// The physical bound's model ([`PhysicalBound`]).
    pub bound: PhysicalBound,
    /// One baseline per seed, shared by every contender.
    pub baselines: Vec<SeedBaseline>,
    /// One row per contender.
    pub rows: Vec<Row>,
    /// The first seed's baseline over time.
    #[serde(skip)]
    pub baseline_timeline: Timeline,
}

impl ScenarioReport {
    /// The gate with the most batch tokens (mean over seeds) within the SLO
    /// budget, else the gate with the smallest mean `ΔV`.
    pub fn best_gate(&self) -> Option<&Row> {
        let gates = || self.rows.iter().filter(|r| r.gate);
        gates()
            .filter(|r| r.summary.within_budget)
            .max_by(|a, b| {
                a.summary
                    .batch_tokens_per_s
                    .mean
                    .total_cmp(&b.summary.batch_tokens_per_s.mean)
            })
            .or_else(|| {
                gates().min_by(|a, b| {
                    a.summary
                        .delta_v_pp
                        .mean
                        .total_cmp(&b.summary.delta_v_pp.mean)
                })
            })
    }
}

/// Everything `eval` measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The SLO the figures are against.
    pub slo: Slo,
    /// The dispatcher settings the gates ran with.
    pub max_staleness_s: f64,
    /// Seed numbers every scenario ran on.
    pub seeds: Vec<u64>,
    /// One entry per scenario.
    pub scenarios: Vec<ScenarioReport>,
}

/// A run over time, kept for charts (records are dropped after scoring).
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// The simulator's samples (1 s).
    pub series: Vec<SeriesPoint>,
    /// Interactive TTFT p99 per 10 s of arrivals.
    pub ttft_p99: Vec<(f64, f64)>,
    /// Interactive arrivals per second, per 10 s.
    pub interactive_rate: Vec<(f64, f64)>,
    /// Interactive requests judged and violating the SLO, by arrival per
    /// 1 s: `(second's end, judged, violated)`.
    pub violations: Vec<(f64, u32, u32)>,
    /// The gate's readings (gates only).
    pub readings: Vec<GateSample>,
}

impl Timeline {
    fn of(run: &RunReport, slo: Slo, readings: Vec<GateSample>) -> Self {
        Self {
            series: run.series.clone(),
            ttft_p99: score::ttft_p99_over_time(run, 10.0),
            interactive_rate: score::interactive_rate_over_time(run, 10.0),
            violations: score::violations_over_time(run, slo, 1.0),
            readings,
        }
    }
}

/// Seconds between the harness' release decisions: finer than any gate's
/// poll, so the window is refilled as soon as a request finishes, as the
/// dispatcher's receiver does.
const TICK_S: f64 = 0.05;

/// The simulator's scenario for `sc`.
fn sim_scenario(sc: &Scenario, batch: bool) -> runner::Scenario {
    let mut s = runner::Scenario::new(sc.pool.replicas());
    s.pool = sc.pool.pool();
    s.pool.engine.policy = sc.engine_policy;
    s.interactive = sc.load.clone();
    s.batch = batch.then(BatchSpec::default);
    s.duration_s = sc.duration_s;
    s.seed = sc.seed;
    s.policy_interval_s = TICK_S;
    s.sample_interval_s = 1.0;
    s
}

/// The metrics a gate sees in `sc`: the page (direct scrape) and a
/// Prometheus view (15 s scrape, 5 s query cache), dark in the blackouts.
fn metrics(sc: &Scenario) -> Arc<SimMetrics> {
    let engine = sc.pool.pool().engine;
    let labels = ExpositionLabels {
        pool: contender::POOL.to_owned(),
        model: "sim-model".to_owned(),
        block_size: engine.block_size,
        num_gpu_blocks: engine.num_gpu_blocks,
        legacy_vllm_names: false,
    };
    Arc::new(SimMetrics::new(
        labels,
        ViewConfig {
            blackouts: sc.blackouts.clone(),
            ..ViewConfig::direct()
        },
        ViewConfig {
            blackouts: sc.blackouts.clone(),
            ..ViewConfig::prometheus()
        },
    ))
}

fn run_policy(
    sc: &Scenario,
    batch: bool,
    policy: &mut dyn BatchPolicy,
) -> Result<RunReport, EvalError> {
    runner::run(&sim_scenario(sc, batch), policy).map_err(|source| EvalError::Sim {
        scenario: sc.name.clone(),
        source,
    })
}

/// A pool's capacity: `Θ` and the batch concurrency it is measured at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolCapacity {
    /// `Θ`, batch-only tokens per second at `concurrency`.
    pub tokens_per_s: f64,
    /// The largest static batch cap whose requests' p95 ITL still meets the
    /// SLO at the 95th percentile over requests.
    pub concurrency: u32,
}

/// `Θ` of a pool: the batch-only token throughput at the largest static
/// cap whose p95 inter-token latency still meets the SLO (a doubling ramp,
/// then bisection), measured once per pool size and SLO in a process
/// (the runs are deterministic).
pub fn capacity(pool: PoolSize, slo: Slo) -> Result<PoolCapacity, EvalError> {
    type Key = (PoolSize, u64, u64);
    static MEASURED: Mutex<Vec<(Key, PoolCapacity)>> = Mutex::new(Vec::new());
    let key = (pool, slo.ttft_s.to_bits(), slo.itl_s.to_bits());
    let known = |m: &Mutex<Vec<(Key, PoolCapacity)>>| {
        m.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    };
    if let Some(theta) = known(&MEASURED) {
        return Ok(theta);
    }
    let theta = measure_capacity(pool, slo)?;
    MEASURED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((key, theta));
    Ok(theta)
}

fn measure_capacity(pool: PoolSize, slo: Slo) -> Result<PoolCapacity, EvalError> {
    let mut sc = Scenario::built_in(Shape::Steady, pool, 1.0);
    sc.name = format!("capacity/{}", pool.name());
    sc.load.mode = crate::sim::config::LoadMode::Off;
    sc.duration_s = 120.0;
    let probe = |cap: u32| -> Result<(bool, f64), EvalError> {
        let run = run_policy(&sc, true, &mut StaticCap { cap })?;
        let itl = run
            .itl_p95_quantile(RequestClass::Batch, 0.95)
            .unwrap_or(f64::INFINITY);
        Ok((
            itl <= slo.itl_s,
            run.generated_tokens_per_s(RequestClass::Batch),
        ))
    };
    let per_replica_max = sc.pool.pool().engine.max_num_seqs;
    let top = per_replica_max * pool.replicas() as u32;
    let (mut good, mut best) = (0u32, 0.0f64);
    let mut bad = None;
    let mut cap = pool.replicas() as u32;
    while cap <= top {
        let (ok, tps) = probe(cap)?;
        if !ok {
            bad = Some(cap);
            break;
        }
        (good, best) = (cap, tps);
        cap *= 2;
    }
    if let Some(mut bad) = bad {
        while bad - good > 1 && (bad - good) * 16 > good {
            let mid = good + (bad - good) / 2;
            let (ok, tps) = probe(mid)?;
            if ok {
                (good, best) = (mid, tps);
            } else {
                bad = mid;
            }
        }
    }
    Ok(PoolCapacity {
        tokens_per_s: best,
        concurrency: good,
    })
}

/// One unit of work for [`parallel`].
type Job<'a, T> = Box<dyn FnOnce() -> T + Send + 'a>;

/// Runs jobs on `threads` workers, results in job order.
fn parallel<T: Send>(threads: usize, jobs: Vec<Job<'_, T>>) -> Vec<T> {
    let n = jobs.len();
    let queue: Mutex<Vec<Option<Job<'_, T>>>> = Mutex::new(jobs.into_iter().map(Some).collect());
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let job = queue
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)[i]
                        .take();
                    if let Some(job) = job {
                        let out = job();
                        results
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)[i] = Some(out);
                    }
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .flatten()
        .collect()
}

/// The static-cap oracle's search for one scenario, pure: a doubling ramp
/// (0, 1, 2, 4, …) until two caps in a row break the SLO budget or every
/// slot of the pool is tried, then refinement between the largest cap
/// within the budget and the next cap tried above it, until they are
/// within 10 % of each other. If being within the budget is monotone in
/// the cap (more batch, more violations), the cap it reports is within
/// 10 % of the best cap.
#[derive(Debug, Clone)]
pub struct CapSearch {
    top: u32,
    /// Caps tried: whether the mean over seeds kept the budget, and its
    /// mean batch tokens per second.
    tried: std::collections::BTreeMap<u32, (bool, f64)>,
}

impl CapSearch {
    /// A search over caps `0..=top`.
    pub fn new(top: u32) -> Self {
        Self {
            top,
            tried: std::collections::BTreeMap::new(),
        }
    }

    /// The largest cap tried within the budget (0 before any).
    fn good(&self) -> u32 {
        self.tried
            .iter()
            .filter(|(_, (ok, _))| *ok)
            .map(|(c, _)| *c)
            .max()
            .unwrap_or(0)
    }

    /// The caps to run next (every seed); empty when the search is over.
    pub fn next(&self) -> Vec<u32> {
        let good = self.good();
        let fails_above: Vec<u32> = self
            .tried
            .iter()
            .filter(|(c, (ok, _))| **c > good && !ok)
            .map(|(c, _)| *c)
            .collect();
        let untried = |caps: Vec<u32>| -> Vec<u32> {
            let mut caps: Vec<u32> = caps
                .into_iter()
                .filter(|c| *c <= self.top && !self.tried.contains_key(c))
                .collect();
            caps.sort_unstable();
            caps.dedup();
            caps
        };
        if self.tried.is_empty() {
            return untried(vec![0, 1, 2, 4, 8, 16]);
        }
        let largest = self.tried.keys().next_back().copied().unwrap_or(0);
        // Ramp: two more doublings while fewer than two caps above the
        // best broke the budget.
        if fails_above.len() < 2 && largest < self.top {
            let a = (largest.max(1) * 2).min(self.top);
            return untried(vec![a, (a * 2).min(self.top)]);
        }
        // Refine between the best and the smallest failure above it.
        let Some(&bad) = fails_above.first() else {
            return Vec::new();
        };
        let gap = bad - good;
        if gap <= (good / 10).max(1) {
            return Vec::new();
        }
        untried(vec![good + gap / 4, good + gap / 2, good + 3 * gap / 4])
    }

    /// Records cap `cap`: whether it kept the budget and its batch tokens/s.
    pub fn record(&mut self, cap: u32, within_budget: bool, tokens_per_s: f64) {
        self.tried.insert(cap, (within_budget, tokens_per_s));
    }

    /// The cap with the most batch tokens within the budget.
    pub fn best(&self) -> Option<u32> {
        self.tried
            .iter()
            .filter(|(_, (ok, _))| *ok)
            .max_by(|a, b| a.1.1.total_cmp(&b.1.1).then(a.0.cmp(b.0)))
            .map(|(c, _)| *c)
    }
}

/// Whether one run keeps the headline budget ([`score::within_budget`]).
pub fn within_slo_budget(s: &Score, slo: Slo) -> bool {
    score::within_budget(
        s.delta_v_pp,
        s.rho_ttft,
        s.rho_itl,
        s.interactive.itl_p99_s,
        slo,
    )
}

/// One scenario on one seed, ready to score runs against.
struct Base {
    /// The scenario with this seed.
    scenario: Scenario,
    run: RunReport,
    slack: f64,
    bound: f64,
    settings: DispatchSettings,
}

/// One contender's run on one seed.
struct Scored {
    score: Score,
    timeline: Option<Timeline>,
}

/// Runs the evaluation; `progress` is called after each run with what ran.
pub fn evaluate(options: &Options, progress: &(dyn Fn(&str) + Sync)) -> Result<Report, EvalError> {
    let Options {
        scenarios,
        seeds,
        contenders,
        settings,
        pool_max_sys,
        slo,
        threads,
    } = options;
    let seeds: Vec<u64> = if seeds.is_empty() {
        vec![0]
    } else {
        seeds.clone()
    };
    // Θ per pool size in use.
    let mut sizes: Vec<PoolSize> = scenarios.iter().map(|s| s.pool).collect();
    sizes.sort_by_key(|s| s.replicas());
    sizes.dedup();
    let jobs: Vec<Job<'_, Result<(PoolSize, PoolCapacity), EvalError>>> = sizes
        .iter()
        .map(|&size| {
            Box::new(move || {
                let theta = capacity(size, *slo)?;
                progress(&format!("capacity {}", size.name()));
                Ok((size, theta))
            }) as Job<'_, _>
        })
        .collect();
    let capacities = parallel(*threads, jobs)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let theta = |size: PoolSize| {
        capacities.iter().find(|(s, _)| *s == size).map_or(
            PoolCapacity {
                tokens_per_s: 0.0,
                concurrency: 0,
            },
            |(_, t)| *t,
        )
    };
    let settings_of = |sc: &Scenario| {
        let mut s = settings.clone();
        if *pool_max_sys {
            s.max_sys = f64::from(theta(sc.pool).concurrency.max(1));
        }
        s
    };
    let bound_of =
        |sc: &Scenario| PhysicalBound::new(&sc.pool.pool().engine, &BatchSpec::default(), *slo);

    // One baseline per scenario and seed, shared by every contender.
    let mut jobs: Vec<Job<'_, Result<Base, EvalError>>> = Vec::new();
    for sc in scenarios {
        for &k in &seeds {
            let (settings_of, bound_of, theta) = (&settings_of, &bound_of, &theta);
            jobs.push(Box::new(move || {
                let scenario = sc.with_seed(k);
                let run = run_policy(&scenario, false, &mut NoBatch)?;
                progress(&format!("{} seed {k} baseline", sc.name));
                let slack = score::slack_tokens(&run, theta(sc.pool).tokens_per_s);
                let bound = score::bound_tokens(&run, &bound_of(sc), sc.pool.replicas());
                Ok(Base {
                    settings: settings_of(sc),
                    scenario,
                    run,
                    slack,
                    bound,
                })
            }));
        }
    }
    let bases = parallel(*threads, jobs)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let nseeds = seeds.len();
    let base = |si: usize, ki: usize| &bases[si * nseeds + ki];

    // One run of a plan on one scenario and seed.
    let run_one = |si: usize, ki: usize, name: &str, plan: Plan<'_>, keep: bool| {
        let b = base(si, ki);
        let sc = &b.scenario;
        let (run, readings, dark) = match plan {
            Plan::Cap(cap) => (run_policy(sc, true, &mut StaticCap { cap })?, Vec::new(), 0),
            Plan::Gate(spec, release) => {
                let mut policy = GatePolicy::new(
                    name.to_owned(),
                    spec,
                    b.settings.clone(),
                    release,
                    metrics(sc),
                    sc.seed,
                    sc.blackouts.clone(),
                )?;
                let run = run_policy(sc, true, &mut policy)?;
                (
                    run,
                    std::mem::take(&mut policy.readings),
                    policy.dark_dispatches,
                )
            }
        };
        let against = score::Against {
            scenario: sc,
            baseline: &b.run,
            slack: b.slack,
            bound: b.bound,
            slo: *slo,
        };
        let score = score::score(&against, &run, dark);
        progress(&format!("{} seed {} {name}", scenarios[si].name, seeds[ki]));
        Ok::<_, EvalError>(Scored {
            score,
            timeline: keep.then(|| Timeline::of(&run, *slo, readings)),
        })
    };

    // Every contender but the oracle: one run per scenario and seed.
    // (scenario, contender, seed index, run).
    type Done = (usize, usize, usize, Scored);
    let mut jobs: Vec<Job<'_, Result<Done, EvalError>>> = Vec::new();
    for si in 0..scenarios.len() {
        for (ci, c) in contenders.iter().enumerate() {
            let plan = match &c.kind {
                Kind::Ungated => Plan::Cap(u32::MAX),
                Kind::Cap(cap) => Plan::Cap(*cap),
                Kind::StaticOracle => continue,
                Kind::Gate { spec, release } => Plan::Gate(spec, *release),
            };
            for ki in 0..nseeds {
                let run_one = &run_one;
                jobs.push(Box::new(move || {
                    Ok((si, ci, ki, run_one(si, ki, &c.name, plan, ki == 0)?))
                }));
            }
        }
    }
    let mut scored: Vec<Done> = parallel(*threads, jobs)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;

    // The oracle: rounds of caps per scenario, every seed of a cap at once.
    let oracle = contenders
        .iter()
        .position(|c| matches!(c.kind, Kind::StaticOracle));
    let mut searches: Vec<CapSearch> = scenarios
        .iter()
        .map(|sc| CapSearch::new(oracle_top(sc.pool)))
        .collect();
    let mut cap_runs: Vec<std::collections::BTreeMap<u32, Vec<Scored>>> =
        (0..scenarios.len()).map(|_| Default::default()).collect();
    while oracle.is_some() {
        // (scenario, cap, seed index, run).
        type CapDone = (usize, u32, usize, Scored);
        let mut jobs: Vec<Job<'_, Result<CapDone, EvalError>>> = Vec::new();
        for (si, search) in searches.iter().enumerate() {
            for cap in search.next() {
                for ki in 0..nseeds {
                    let run_one = &run_one;
                    jobs.push(Box::new(move || {
                        let name = format!("static-cap-{cap}");
                        Ok((
                            si,
                            cap,
                            ki,
                            run_one(si, ki, &name, Plan::Cap(cap), ki == 0)?,
                        ))
                    }));
                }
            }
        }
        if jobs.is_empty() {
            break;
        }
        let mut done = parallel(*threads, jobs)
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        done.sort_by_key(|(si, cap, ki, _)| (*si, *cap, *ki));
        for (si, cap, _, s) in done {
            cap_runs[si].entry(cap).or_default().push(s);
        }
        for (si, search) in searches.iter_mut().enumerate() {
            for (cap, runs) in &cap_runs[si] {
                let scores: Vec<Score> = runs.iter().map(|r| r.score.clone()).collect();
                let summary = Summary::of(&scores, *slo);
                search.record(*cap, summary.within_budget, summary.batch_tokens_per_s.mean);
            }
        }
    }

    scored.sort_by_key(|(si, ci, ki, _)| (*si, *ci, *ki));
    let mut reports = Vec::new();
    for (si, sc) in scenarios.iter().enumerate() {
        let mut rows = Vec::new();
        for (ci, c) in contenders.iter().enumerate() {
            let (runs, detail): (Vec<&Scored>, Option<String>) = match c.kind {
                Kind::StaticOracle => {
                    let Some(cap) = searches[si].best() else {
                        continue;
                    };
                    let runs = cap_runs[si]
                        .get(&cap)
                        .map(|v| v.iter().collect())
                        .unwrap_or_default();
                    (runs, Some(format!("cap {cap}")))
                }
                _ => (
                    scored
                        .iter()
                        .filter(|(s, k, _, _)| *s == si && *k == ci)
                        .map(|(_, _, _, r)| r)
                        .collect(),
                    None,
                ),
            };
            if runs.is_empty() {
                continue;
            }
            let scores: Vec<Score> = runs.iter().map(|r| r.score.clone()).collect();
            rows.push(Row {
                contender: c.name.clone(),
                detail,
                gate: c.is_gate(),
                summary: Summary::of(&scores, *slo),
                runs: scores,
                timeline: runs
                    .first()
                    .and_then(|r| r.timeline.clone())
                    .unwrap_or_default(),
            });
        }
        let baselines = (0..nseeds)
            .map(|ki| {
                let b = base(si, ki);
                SeedBaseline {
                    seed_number: seeds[ki],
                    seed: b.scenario.seed,
                    slack_tokens: b.slack,
                    bound_tokens: b.bound,
                    interactive: Interactive::of(&b.run, *slo),
                }
            })
            .collect();
        reports.push(ScenarioReport {
            scenario: sc.clone(),
            capacity_tokens_per_s: theta(sc.pool).tokens_per_s,
            max_sys: base(si, 0).settings.max_sys,
            bound: bound_of(sc),
            baselines,
            rows,
            baseline_timeline: Timeline::of(&base(si, 0).run, *slo, Vec::new()),
        });
    }
    Ok(Report {
        slo: *slo,
        max_staleness_s: settings.max_staleness.as_secs_f64(),
        seeds,
        scenarios: reports,
    })
}

/// How one run releases batch work.
#[derive(Clone, Copy)]
enum Plan<'a> {
    /// A static concurrency cap (`u32::MAX`: ungated).
    Cap(u32),
    /// A gate through the harness.
    Gate(&'a crate::config::GateSpec, Release),
}

/// The largest cap the oracle tries: every slot of the pool.
fn oracle_top(pool: PoolSize) -> u32 {
    pool.pool().engine.max_num_seqs * pool.replicas() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a search against a budget that holds up to `limit` and tokens
    /// that grow with the cap.
    fn search(limit: u32, top: u32) -> (u32, usize) {
        let mut s = CapSearch::new(top);
        let mut runs = 0;
        loop {
            let caps = s.next();
            if caps.is_empty() {
                break;
            }
            for c in caps {
                runs += 1;
                s.record(c, c <= limit, f64::from(c));
            }
        }
        (s.best().expect("cap 0 keeps the budget"), runs)
    }

    #[test]
    fn the_oracle_finds_a_cap_within_ten_percent_of_the_best() {
        for limit in [0, 1, 3, 7, 13, 37, 100, 129, 500, 1023, 1024, 4000] {
            let (cap, runs) = search(limit, 1024);
            let best = limit.min(1024);
            assert!(cap <= best, "limit {limit}: cap {cap}");
            assert!(
                f64::from(best - cap) <= 0.1 * f64::from(best),
                "limit {limit}: cap {cap} is more than 10 % below {best}"
            );
            assert!(runs <= 24, "limit {limit}: {runs} runs");
        }
    }

    #[test]
    fn the_oracle_reports_the_most_tokens_not_the_largest_cap() {
        let mut s = CapSearch::new(64);
        s.record(0, true, 0.0);
        s.record(8, true, 900.0);
        s.record(16, true, 800.0);
        s.record(32, false, 2000.0);
        assert_eq!(s.best(), Some(8));
    }

    #[test]
    fn spread_is_mean_min_and_max() {
        let s = Spread::of([1.0, 4.0, 2.5]);
        assert_eq!((s.mean, s.min, s.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of([]).mean, 0.0);
    }
}
