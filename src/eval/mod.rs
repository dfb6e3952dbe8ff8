//! `sluicegate eval`: gate quality in virtual time. Each scenario runs once
//! without batch work (the baseline) and once per contender with the same
//! seed; each run is scored against the baseline (harvest `H`, excess SLO
//! violations `ΔV`, tail inflation `ρ`, reaction, recovery, oscillation).
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
mod promql;
pub mod scenario;
pub mod score;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;

pub use chart::timeline_svg;
pub use contender::{Contender, Kind};
pub use endpoint::{PAGE_URL, SimMetrics};
pub use harness::{GatePolicy, GateSample, HarnessError, Release};
pub use scenario::{PoolSize, Scenario, Shape};
pub use score::{Interactive, Score, Slo};

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
    /// The scenarios.
    pub scenarios: Vec<Scenario>,
    /// The contenders.
    pub contenders: Vec<Contender>,
    /// The dispatcher settings of every gate (the configuration's
    /// defaults unless a caller changes them).
    pub settings: DispatchSettings,
    /// The interactive SLO.
    pub slo: Slo,
    /// Worker threads (runs are independent).
    pub threads: usize,
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
    /// The figures.
    pub score: Score,
    /// The run over time, for charts.
    #[serde(skip)]
    pub timeline: Timeline,
}

/// A scenario's results.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: Scenario,
    /// `Θ`: the pool's SLO-feasible token throughput, tokens/s.
    pub capacity_tokens_per_s: f64,
    /// Slack tokens over the run.
    pub slack_tokens: f64,
    /// The batch-free baseline's interactive figures.
    pub baseline: Interactive,
    /// One row per contender.
    pub rows: Vec<Row>,
    /// The baseline over time.
    #[serde(skip)]
    pub baseline_timeline: Timeline,
}

impl ScenarioReport {
    /// The gate with the most batch tokens within the SLO budget, else the
    /// gate with the smallest `ΔV`.
    pub fn best_gate(&self) -> Option<&Row> {
        let gates = || self.rows.iter().filter(|r| r.gate);
        gates()
            .filter(|r| within_slo_budget(&r.score))
            .max_by(|a, b| {
                a.score
                    .batch_tokens_per_s
                    .total_cmp(&b.score.batch_tokens_per_s)
            })
            .or_else(|| gates().min_by(|a, b| a.score.delta_v_pp.total_cmp(&b.score.delta_v_pp)))
    }
}

/// Everything `eval` measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The SLO the figures are against.
    pub slo: Slo,
    /// The dispatcher settings the gates ran with.
    pub max_staleness_s: f64,
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
    /// The gate's readings (gates only).
    pub readings: Vec<GateSample>,
}

impl Timeline {
    fn of(run: &RunReport, readings: Vec<GateSample>) -> Self {
        Self {
            series: run.series.clone(),
            ttft_p99: score::ttft_p99_over_time(run, 10.0),
            interactive_rate: score::interactive_rate_over_time(run, 10.0),
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

/// `Θ` of a pool: the batch-only token throughput at the largest static
/// cap whose p95 inter-token latency still meets the SLO (a doubling ramp,
/// then bisection), measured once per pool size and SLO in a process
/// (the runs are deterministic).
pub fn capacity(pool: PoolSize, slo: Slo) -> Result<f64, EvalError> {
    type Key = (PoolSize, u64, u64);
    static MEASURED: Mutex<Vec<(Key, f64)>> = Mutex::new(Vec::new());
    let key = (pool, slo.ttft_s.to_bits(), slo.itl_s.to_bits());
    let known = |m: &Mutex<Vec<(Key, f64)>>| {
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

fn measure_capacity(pool: PoolSize, slo: Slo) -> Result<f64, EvalError> {
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
    Ok(best)
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

/// Static caps the oracle tries in a pool: 0 (no batch), then powers of
/// two and the midpoints between them up to every replica full.
fn oracle_caps(pool: PoolSize) -> Vec<u32> {
    let top = pool.pool().engine.max_num_seqs * pool.replicas() as u32;
    let mut caps = vec![0];
    let mut cap = 1u32;
    while cap <= top {
        caps.push(cap);
        if cap >= 4 && cap + cap / 2 <= top {
            caps.push(cap + cap / 2);
        }
        cap *= 2;
    }
    caps
}

/// Whether a score keeps the headline constraints (`ΔV ≤ 0.5` pp and
/// `ρ(TTFT p99) ≤ 1.2`).
pub fn within_slo_budget(s: &Score) -> bool {
    s.delta_v_pp <= 0.5 && s.rho_ttft <= 1.2
}

/// One scored run.
struct Scored {
    scenario: usize,
    contender: usize,
    cap: Option<u32>,
    row: Row,
}

/// Runs the evaluation; `progress` is called after each run with what ran.
pub fn evaluate(options: &Options, progress: &(dyn Fn(&str) + Sync)) -> Result<Report, EvalError> {
    let Options {
        scenarios,
        contenders,
        settings,
        slo,
        threads,
    } = options;
    // Θ per pool size in use.
    let mut sizes: Vec<PoolSize> = scenarios.iter().map(|s| s.pool).collect();
    sizes.dedup();
    sizes.sort_by_key(|s| s.replicas());
    sizes.dedup();
    let jobs: Vec<Job<'_, Result<(PoolSize, f64), EvalError>>> = sizes
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
        capacities
            .iter()
            .find(|(s, _)| *s == size)
            .map_or(0.0, |(_, t)| *t)
    };

    // Baselines.
    let jobs: Vec<Job<'_, Result<RunReport, EvalError>>> = scenarios
        .iter()
        .map(|sc| {
            Box::new(move || {
                let run = run_policy(sc, false, &mut NoBatch)?;
                progress(&format!("{} baseline", sc.name));
                Ok(run)
            }) as Job<'_, _>
        })
        .collect();
    let baselines = parallel(*threads, jobs)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let slack: Vec<f64> = scenarios
        .iter()
        .zip(&baselines)
        .map(|(sc, b)| score::slack_tokens(b, theta(sc.pool)))
        .collect();

    // Every contender run (the oracle: one per cap).
    let mut jobs: Vec<Job<'_, Result<Scored, EvalError>>> = Vec::new();
    for (si, sc) in scenarios.iter().enumerate() {
        for (ci, c) in contenders.iter().enumerate() {
            let plans: Vec<Plan<'_>> = match &c.kind {
                Kind::Ungated => vec![Plan::Cap(u32::MAX)],
                Kind::Cap(cap) => vec![Plan::Cap(*cap)],
                Kind::StaticOracle => oracle_caps(sc.pool).into_iter().map(Plan::Cap).collect(),
                Kind::Gate { spec, release } => vec![Plan::Gate(spec, *release)],
            };
            for plan in plans {
                let (baseline, slack) = (&baselines[si], slack[si]);
                let cap = match (&c.kind, &plan) {
                    (Kind::StaticOracle, Plan::Cap(cap)) => Some(*cap),
                    _ => None,
                };
                jobs.push(Box::new(move || {
                    let (run, readings, dark) = match plan {
                        Plan::Cap(cap) => {
                            (run_policy(sc, true, &mut StaticCap { cap })?, Vec::new(), 0)
                        }
                        Plan::Gate(spec, release) => {
                            let mut policy = GatePolicy::new(
                                c.name.clone(),
                                spec,
                                settings.clone(),
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
                    let score = score::score(sc, baseline, &run, slack, *slo, dark);
                    progress(&format!("{} {}", sc.name, c.name));
                    Ok(Scored {
                        scenario: si,
                        contender: ci,
                        cap,
                        row: Row {
                            contender: c.name.clone(),
                            detail: cap.map(|c| format!("cap {c}")),
                            gate: c.is_gate(),
                            score,
                            timeline: Timeline::of(&run, readings),
                        },
                    })
                }));
            }
        }
    }
    let scored = parallel(*threads, jobs)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;

    let mut reports = Vec::new();
    for (si, sc) in scenarios.iter().enumerate() {
        let mut rows = Vec::new();
        for (ci, c) in contenders.iter().enumerate() {
            let mut mine = scored
                .iter()
                .filter(|s| s.scenario == si && s.contender == ci);
            let row = match c.kind {
                Kind::StaticOracle => best_cap(mine.filter(|s| s.cap.is_some())),
                _ => mine.next().map(|s| s.row.clone()),
            };
            rows.extend(row);
        }
        reports.push(ScenarioReport {
            scenario: sc.clone(),
            capacity_tokens_per_s: theta(sc.pool),
            slack_tokens: slack[si],
            baseline: Interactive::of(&baselines[si], *slo),
            rows,
            baseline_timeline: Timeline::of(&baselines[si], Vec::new()),
        });
    }
    Ok(Report {
        slo: *slo,
        max_staleness_s: settings.max_staleness.as_secs_f64(),
        scenarios: reports,
    })
}

/// How one run releases batch work.
enum Plan<'a> {
    /// A static concurrency cap (`u32::MAX`: ungated).
    Cap(u32),
    /// A gate through the harness.
    Gate(&'a crate::config::GateSpec, Release),
}

/// The cap with the most batch tokens among those within the SLO budget
/// (cap 0, no batch at all, always is).
fn best_cap<'a>(runs: impl Iterator<Item = &'a Scored>) -> Option<Row> {
    let runs: Vec<&Scored> = runs.collect();
    runs.iter()
        .filter(|s| within_slo_budget(&s.row.score))
        .max_by(|a, b| {
            a.row
                .score
                .batch_tokens_per_s
                .total_cmp(&b.row.score.batch_tokens_per_s)
        })
        .map(|s| s.row.clone())
}
