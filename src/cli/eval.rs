//! `sluicegate eval`: gate quality in virtual time (`src/eval/`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::dispatch::DispatchSettings;
use crate::dispatch::pace::{Pace, PaceUnit};
use crate::eval::{
    Contender, NamedSpec, Options, PoolSize, Report, Scenario, ScenarioReport, Shape, Slo, Spread,
    TEST_SEEDS, TRAIN_SEEDS, contender,
};
use crate::sim::config::SchedPolicy;

/// Flags of `sluicegate eval`.
#[derive(Debug, Args)]
pub(super) struct EvalArgs {
    /// Scenarios to run (repeatable): steady, diurnal, waves, step,
    /// blackout, long-context. Default: all, or none with `--trace`.
    #[arg(long = "scenario", value_name = "NAME")]
    scenarios: Vec<String>,
    /// Pool sizes: small (4 replicas), large (16) or all.
    #[arg(long, default_value = "all", value_name = "SIZE")]
    pool: String,
    /// Contenders to run (repeatable): ungated, static-cap-oracle,
    /// static-cap-N (a fixed cap of N), upstream-per-poll, or a gate
    /// (prometheus-budget, prometheus-saturation, vllm, feedback,
    /// slo-headroom, ...). Default: every built-in one.
    #[arg(long = "gate", value_name = "NAME")]
    gates: Vec<String>,
    /// Also evaluate a gate of your own (repeatable):
    /// `NAME={"gate_type": "...", "gate_params": {...}}`, with the
    /// simulated pool's metrics at `http://pool.sim.invalid/metrics` and
    /// Prometheus pool name `pool`; with `--live`, a gate that reads the
    /// engine's page gets it as `urls`, and the eval's SLO as `ttft_slo` and
    /// `itl_slo`, unless it names its own.
    #[arg(long = "gate-spec", value_name = "NAME=JSON")]
    gate_specs: Vec<String>,
    /// Replay a CSV trace (timestamp, input tokens, output tokens) as a
    /// scenario on each pool size; alone it runs only the trace (add
    /// `--scenario` for built-in ones too).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Scales every scenario's duration (1.0 = full; at least 30 s).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Seeds each scenario runs on: `test` (the 5 test seeds of the
    /// published tables), `train` (the 10 tuning seeds), `test:N` /
    /// `train:N` (the first N of a set), or a number N (the first N test
    /// seeds).
    #[arg(long, default_value = "test", value_name = "SET")]
    seeds: String,
    /// Run these seed numbers instead of `--seeds` (repeatable; seed number
    /// K runs every scenario with its fixed seed + K).
    #[arg(long = "seed", value_name = "K", conflicts_with = "seeds")]
    seed_numbers: Vec<u64>,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Draw each scenario's run over time as an SVG (with several
    /// scenarios, `FILE` gets a `-<scenario>` suffix per scenario).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Write each scenario's runs second by second as CSV: the first
    /// seed's run of every contender and the baseline (batch and
    /// interactive in flight, releases, interactive SLO violations by
    /// arrival, the gate's budget and window). With several scenarios,
    /// `FILE` gets a `-<scenario>` suffix per scenario, as `--svg`.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// The contender the SVG draws (default: the gate with the most batch
    /// tokens within the SLO budget).
    #[arg(long, value_name = "NAME")]
    svg_gate: Option<String>,
    /// The engines' scheduling policy: `fcfs` (default) or `priority`
    /// (vLLM's `--scheduling-policy priority`; batch requests carry
    /// priority 1, interactive 0, so batch yields inside the engine).
    #[arg(long, default_value = "fcfs", value_name = "POLICY")]
    engine_policy: String,
    /// How often every gate is read, in seconds (the dispatcher's
    /// `dispatch.poll_interval`, also the sources' cache TTL; default 1):
    /// e.g. 15 makes every source as slow as a 15 s Prometheus scrape.
    #[arg(long, value_name = "SECONDS")]
    poll_interval: Option<f64>,
    /// Paced release for every gate (`dispatch.pace`): off, requests or
    /// tokens (prompt tokens; at most one request per 50 ms tick).
    #[arg(long, default_value = "off", value_name = "UNIT")]
    pace: String,
    /// `dispatch.pace_rate`: units per second.
    #[arg(long, default_value_t = 10.0, value_name = "RATE")]
    pace_rate: f64,
    /// `dispatch.pace_burst`: most units that start at once.
    #[arg(long, default_value_t = 1.0, value_name = "UNITS")]
    pace_burst: f64,
    /// Keep the window of readings that count our requests shut until the
    /// next fresh reading, as before refill on own finishes (to measure
    /// what the refill buys; `run` always refills).
    #[arg(long)]
    no_refill: bool,
    /// Worker threads (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    /// `--live URL` and its flags: the same evaluation on a real engine.
    #[command(flatten)]
    live: super::eval_live::LiveArgs,
}

impl EvalArgs {
    /// Whether this is a live eval (`--live URL`).
    pub(super) fn is_live(&self) -> bool {
        self.live.live.is_some()
    }
}

/// Runs `sluicegate eval --live URL`; the simulator's own flags are
/// refused rather than silently ignored.
pub(super) async fn run_live(args: EvalArgs) -> ExitCode {
    let simulator_only = [
        ("--pool", args.pool != "all"),
        ("--trace", args.trace.is_some()),
        ("--scale", args.scale != 1.0),
        ("--svg", args.svg.is_some()),
        ("--svg-gate", args.svg_gate.is_some()),
        ("--engine-policy", args.engine_policy != "fcfs"),
        ("--poll-interval", args.poll_interval.is_some()),
        ("--pace", args.pace != "off"),
        ("--no-refill", args.no_refill),
        ("--seed", !args.seed_numbers.is_empty()),
        ("--seeds", args.seeds != "test"),
    ];
    if let Some((flag, _)) = simulator_only.iter().find(|(_, set)| *set) {
        eprintln!(
            "sluicegate eval --live: {flag} is a simulator flag; a live eval takes --repeats and --live-seed"
        );
        return ExitCode::from(super::EXIT_CONFIG);
    }
    let Some(url) = args.live.live.clone() else {
        return ExitCode::from(super::EXIT_CONFIG);
    };
    super::eval_live::run(
        url,
        args.live,
        &args.scenarios,
        &args.gates,
        &args.gate_specs,
        args.csv,
        args.json,
    )
    .await
}

/// Runs `sluicegate eval`.
pub(super) fn run(args: EvalArgs) -> ExitCode {
    let options = match options(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sluicegate eval: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let total = progress_total(&options);
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {elapsed} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = |what: &str| {
        // The oracle's search decides its runs as it goes: the total is an
        // estimate that grows if the search needs more.
        if bar.position() + 1 >= bar.length().unwrap_or(0) {
            bar.inc_length(1);
        }
        bar.inc(1);
        bar.set_message(what.to_owned());
    };
    let report = crate::eval::evaluate(&options, &progress);
    bar.finish_and_clear();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sluicegate eval: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("sluicegate eval: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", table(&report));
    }
    if let Some(path) = &args.svg
        && let Err(e) = write_svgs(&report, path, args.svg_gate.as_deref())
    {
        eprintln!("sluicegate eval: --svg: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.csv
        && let Err(e) = write_csvs(&report, path)
    {
        eprintln!("sluicegate eval: --csv: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// One CSV per scenario, named as [`write_svgs`] names its files.
fn write_csvs(report: &Report, path: &std::path::Path) -> Result<(), String> {
    let many = report.scenarios.len() > 1;
    for sc in &report.scenarios {
        let file = per_scenario(path, &sc.scenario.name, many, "csv");
        let csv = crate::eval::series::timeline_csv(sc);
        std::fs::write(&file, csv).map_err(|e| format!("{}: {e}", file.display()))?;
        eprintln!("wrote {} ({})", file.display(), sc.scenario.name);
    }
    Ok(())
}

/// `path` itself for one scenario, else `<stem>-<scenario>.<ext>` beside
/// it (`/` in the scenario's name becomes `-`).
fn per_scenario(path: &std::path::Path, scenario: &str, many: bool, ext: &str) -> PathBuf {
    if !many {
        return path.to_path_buf();
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("eval");
    let name = scenario.replace('/', "-");
    path.with_file_name(format!("{stem}-{name}.{ext}"))
}

/// One SVG per scenario: `path` itself for one scenario, else
/// `<stem>-<scenario>.svg` beside it.
fn write_svgs(report: &Report, path: &std::path::Path, gate: Option<&str>) -> Result<(), String> {
    let many = report.scenarios.len() > 1;
    for sc in &report.scenarios {
        let row = match gate {
            Some(name) => sc.rows.iter().find(|r| r.contender == name),
            None => sc.best_gate(),
        };
        let Some(row) = row else {
            return Err(format!("no contender to draw in {}", sc.scenario.name));
        };
        let file = per_scenario(path, &sc.scenario.name, many, "svg");
        let svg = crate::eval::timeline_svg(sc, row).map_err(|e| e.to_string())?;
        std::fs::write(&file, svg).map_err(|e| format!("{}: {e}", file.display()))?;
        eprintln!(
            "wrote {} ({} in {})",
            file.display(),
            row.contender,
            sc.scenario.name
        );
    }
    Ok(())
}

fn options(args: &EvalArgs) -> Result<Options, String> {
    if !(args.scale.is_finite() && args.scale > 0.0) {
        return Err(format!("--scale must be a number > 0, got {}", args.scale));
    }
    let pools: Vec<PoolSize> = match args.pool.as_str() {
        "all" => PoolSize::ALL.to_vec(),
        "small" => vec![PoolSize::Small],
        "large" => vec![PoolSize::Large],
        other => {
            return Err(format!(
                "--pool: unknown size `{other}`; allowed: small, large, all"
            ));
        }
    };
    let shapes: Vec<Shape> = if args.scenarios.is_empty() && args.trace.is_some() {
        Vec::new()
    } else if args.scenarios.is_empty() {
        Shape::BUILT_IN.to_vec()
    } else {
        args.scenarios
            .iter()
            .map(|name| {
                Shape::parse(name).ok_or_else(|| {
                    let allowed: Vec<&str> = Shape::BUILT_IN.iter().map(|s| s.name()).collect();
                    format!(
                        "--scenario: unknown `{name}`; allowed: {}",
                        allowed.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?
    };
    let engine_policy = match args.engine_policy.as_str() {
        "fcfs" => SchedPolicy::Fcfs,
        "priority" => SchedPolicy::Priority,
        other => {
            return Err(format!(
                "--engine-policy: unknown `{other}`; allowed: fcfs, priority"
            ));
        }
    };
    let mut scenarios = Vec::new();
    for &pool in &pools {
        for &shape in &shapes {
            scenarios.push(Scenario::built_in(shape, pool, args.scale));
        }
        if let Some(path) = &args.trace {
            scenarios.push(Scenario::trace(path, pool).map_err(|e| format!("--trace: {e}"))?);
        }
    }
    for scenario in &mut scenarios {
        scenario.engine_policy = engine_policy;
    }
    let seeds = if args.seed_numbers.is_empty() {
        seed_set(&args.seeds)?
    } else {
        args.seed_numbers.clone()
    };
    let all = contender::built_in()?;
    let contenders: Vec<Contender> = if args.gates.is_empty() && !args.gate_specs.is_empty() {
        Vec::new()
    } else if args.gates.is_empty() {
        all
    } else {
        let names: Vec<String> = all.iter().map(|c| c.name.clone()).collect();
        args.gates
            .iter()
            .map(|g| {
                contender::find(&all, g).ok_or_else(|| {
                    format!(
                        "--gate: unknown `{g}`; allowed: {}, static-cap-N",
                        names.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?
    };
    let mut contenders = contenders;
    for spec in &args.gate_specs {
        contenders.push(custom_gate(spec)?);
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let mut settings = DispatchSettings::default();
    if let Some(secs) = args.poll_interval {
        settings.poll_interval = Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| !d.is_zero() && *d < settings.max_staleness)
            .ok_or_else(|| {
                format!(
                    "--poll-interval must be a number of seconds > 0 and below max_staleness ({} s), got {secs}",
                    settings.max_staleness.as_secs_f64()
                )
            })?;
    }
    settings.refill_own_finishes = !args.no_refill;
    settings.pace = match args.pace.as_str() {
        "off" => None,
        unit => {
            let unit = match unit {
                "requests" => PaceUnit::Requests,
                "tokens" => PaceUnit::Tokens,
                other => {
                    return Err(format!(
                        "--pace: unknown `{other}`; allowed: off, requests, tokens"
                    ));
                }
            };
            Some(
                Pace::new(unit, args.pace_rate, args.pace_burst)
                    .map_err(|e| format!("--pace: {e}"))?,
            )
        }
    };
    Ok(Options {
        scenarios,
        seeds,
        contenders,
        settings,
        pool_max_sys: true,
        slo: Slo::default(),
        threads,
    })
}

/// The seed numbers `--seeds SET` names.
fn seed_set(set: &str) -> Result<Vec<u64>, String> {
    let bad =
        || format!("--seeds: expected test, train, test:N, train:N or a number N, got `{set}`");
    let (name, n) = match set.split_once(':') {
        Some((name, n)) => (name, Some(n.parse::<usize>().map_err(|_| bad())?)),
        None => match set.parse::<usize>() {
            Ok(n) => ("test", Some(n)),
            Err(_) => (set, None),
        },
    };
    let all: &[u64] = match name {
        "test" => &TEST_SEEDS,
        "train" => &TRAIN_SEEDS,
        _ => return Err(bad()),
    };
    let n = n.unwrap_or(all.len());
    if n == 0 || n > all.len() {
        return Err(format!(
            "--seeds: the {name} set has {} seeds; asked for {n}",
            all.len()
        ));
    }
    Ok(all[..n].to_vec())
}

/// A `--gate-spec NAME=JSON` contender.
fn custom_gate(arg: &str) -> Result<Contender, String> {
    let spec = NamedSpec::parse(arg).map_err(|e| format!("--gate-spec: {e}"))?;
    Contender::gate(&spec.name, &spec.gate_type, &spec.params)
}

/// Runs the evaluation will make, for the progress bar.
fn progress_total(o: &Options) -> u64 {
    let mut sizes: Vec<usize> = o.scenarios.iter().map(|s| s.pool.replicas()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // The oracle's search takes about a dozen caps.
    let per_scenario: usize = o
        .contenders
        .iter()
        .map(|c| match c.kind {
            crate::eval::Kind::StaticOracle => 12,
            _ => 1,
        })
        .sum::<usize>()
        + 1;
    (sizes.len() + o.scenarios.len() * o.seeds.len().max(1) * per_scenario) as u64
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

/// The report as one table per scenario.
pub(super) fn table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "SLO: TTFT <= {} s and p95 ITL <= {} s; within budget: dV <= 0.5 pp, rho(TTFT p99) <= 1.2 and (rho(ITL p99) <= 1.2 or ITL p99 <= {} s), on the mean over seeds",
        report.slo.ttft_s, report.slo.itl_s, report.slo.itl_s
    );
    let seeds: Vec<String> = report.seeds.iter().map(u64::to_string).collect();
    let _ = writeln!(
        out,
        "seeds: {} (figures: mean, and (min..max) over the seeds)",
        seeds.join(", ")
    );
    for sc in &report.scenarios {
        scenario_table(&mut out, sc, report.max_staleness_s);
    }
    out
}

/// `mean` alone for one seed, else `mean (min..max)`.
fn cell(s: Spread, many: bool, f: fn(f64) -> String) -> String {
    if many {
        format!("{} ({}..{})", f(s.mean), f(s.min), f(s.max))
    } else {
        f(s.mean)
    }
}

fn scenario_table(out: &mut String, sc: &ScenarioReport, max_staleness_s: f64) {
    let n = sc.baselines.len().max(1) as f64;
    let mean =
        |f: fn(&crate::eval::SeedBaseline) -> f64| sc.baselines.iter().map(f).sum::<f64>() / n;
    let _ = writeln!(
        out,
        "\n{} ({:.0} s, seed {:#x} + seed number): capacity {:.0} tok/s (max_sys {:.0}), physical bound {:.0} tok/s, slack {:.0} tok; baseline TTFT p99 {:.3} s, ITL p99 {:.3} s, SLO violations {:.2} %",
        sc.scenario.name,
        sc.scenario.duration_s,
        sc.scenario.seed,
        sc.capacity_tokens_per_s,
        sc.max_sys,
        mean(|b| b.bound_tokens) / sc.scenario.duration_s,
        mean(|b| b.slack_tokens),
        mean(|b| b.interactive.ttft_p99_s),
        mean(|b| b.interactive.itl_p99_s),
        mean(|b| b.interactive.violations_pct),
    );
    let many = sc.baselines.len() > 1;
    let w = if many { 20 } else { 6 };
    let _ = writeln!(
        out,
        "{:<30} {:>3} {:>w$} {:>6} {:>w$} {:>w$} {:>w$} {:>9} {:>5} {:>7} {:>7} {:>5} {:>8} {:>8} {:>5}",
        "contender",
        "ok",
        "H",
        "H*",
        "dV pp",
        "rhoTTFT",
        "rhoITL",
        "batch t/s",
        "idle",
        "react s",
        "recov s",
        "osc",
        "429/503",
        "preempt",
        "dark"
    );
    for row in &sc.rows {
        let s = &row.summary;
        let name = match &row.detail {
            Some(d) => format!("{} ({d})", row.contender),
            None => row.contender.clone(),
        };
        let mark = if s.within_budget { "" } else { " *" };
        let _ = writeln!(
            out,
            "{:<30} {:>3} {:>w$} {:>6.3} {:>w$} {:>w$} {:>w$} {:>9.0} {:>5.2} {:>7} {:>7} {:>5} {:>8.0} {:>8.0} {:>5}{mark}",
            name,
            format!("{}/{}", s.seeds_within_budget, row.runs.len()),
            cell(s.harvest, many, |v| format!("{v:.3}")),
            s.harvest_bound.mean,
            cell(s.delta_v_pp, many, |v| format!("{v:+.2}")),
            cell(s.rho_ttft, many, |v| format!("{v:.2}")),
            cell(s.rho_itl, many, |v| format!("{v:.2}")),
            s.batch_tokens_per_s.mean,
            s.batch_idle_fraction,
            opt(s.reaction_s),
            opt(s.recovery_s),
            s.oscillation_cv
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
            s.rejections,
            s.preemptions,
            s.dark_dispatches,
        );
    }
    let _ = writeln!(
        out,
        "(* outside the SLO budget on the means; ok = seeds within it on their own; dark = dispatches with metrics dark > {max_staleness_s:.0} s)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: EvalArgs,
    }

    fn parse(argv: &[&str]) -> Result<Options, String> {
        use clap::Parser as _;
        let cli = Cli::try_parse_from(std::iter::once("eval").chain(argv.iter().copied()))
            .map_err(|e| e.to_string())?;
        options(&cli.args)
    }

    #[test]
    fn a_fixed_static_cap_is_a_contender_of_its_own() {
        let o = parse(&["--gate", "static-cap-12", "--scenario", "steady"]).unwrap();
        assert_eq!(o.contenders.len(), 1);
        assert_eq!(o.contenders[0].name, "static-cap-12");
        assert!(matches!(o.contenders[0].kind, crate::eval::Kind::Cap(12)));
        let err = parse(&["--gate", "static-cap-x"]).unwrap_err();
        assert!(err.contains("static-cap-N"), "{err}");
    }

    #[test]
    fn engine_policy_applies_to_every_scenario_and_rejects_unknown_names() {
        let fcfs = parse(&["--scenario", "steady", "--pool", "all"]).unwrap();
        assert!(
            fcfs.scenarios
                .iter()
                .all(|s| s.engine_policy == SchedPolicy::Fcfs)
        );
        let prio = parse(&["--scenario", "steady", "--engine-policy", "priority"]).unwrap();
        assert_eq!(prio.scenarios.len(), 2);
        assert!(
            prio.scenarios
                .iter()
                .all(|s| s.engine_policy == SchedPolicy::Priority)
        );
        let err = parse(&["--engine-policy", "lifo"]).unwrap_err();
        assert!(
            err.contains("--engine-policy") && err.contains("fcfs, priority"),
            "{err}"
        );
    }

    #[test]
    fn a_trace_alone_runs_only_the_trace() {
        let dir = std::env::temp_dir().join(format!("sluicegate-cli-eval-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        std::fs::write(&path, "0,100,10\n40,100,10\n").unwrap();
        let trace = path.to_str().unwrap();
        let o = parse(&["--trace", trace, "--pool", "small"]).unwrap();
        let names: Vec<&str> = o.scenarios.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["trace/small"]);
        let o = parse(&["--trace", trace, "--pool", "small", "--scenario", "waves"]).unwrap();
        let names: Vec<&str> = o.scenarios.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["waves/small", "trace/small"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn poll_interval_sets_the_dispatch_poll_and_rejects_nonsense() {
        let default = parse(&[]).unwrap().settings.poll_interval;
        assert_eq!(default, DispatchSettings::default().poll_interval);
        let slow = parse(&["--poll-interval", "15"]).unwrap();
        assert_eq!(slow.settings.poll_interval, Duration::from_secs(15));
        for bad in ["0", "-1", "NaN", "3600"] {
            assert!(parse(&["--poll-interval", bad]).is_err(), "{bad}");
        }
        assert!(parse(&[]).unwrap().settings.refill_own_finishes);
        assert_eq!(parse(&[]).unwrap().settings.pace, None);
        let paced = parse(&[
            "--pace",
            "tokens",
            "--pace-rate",
            "4000",
            "--pace-burst",
            "200",
        ])
        .unwrap();
        assert_eq!(
            paced.settings.pace,
            Some(Pace::new(PaceUnit::Tokens, 4000.0, 200.0).unwrap())
        );
        assert!(parse(&["--pace", "bytes"]).is_err());
        assert!(parse(&["--pace", "requests", "--pace-rate", "0"]).is_err());
        assert!(
            !parse(&["--no-refill"])
                .unwrap()
                .settings
                .refill_own_finishes
        );
    }

    #[test]
    fn seeds_default_to_the_test_set_and_explicit_ones_win() {
        assert_eq!(parse(&[]).unwrap().seeds, TEST_SEEDS.to_vec());
        assert_eq!(
            parse(&["--seed", "7", "--seed", "3"]).unwrap().seeds,
            vec![7, 3]
        );
        assert!(parse(&["--seed", "7", "--seeds", "train"]).is_err());
    }

    #[test]
    fn seed_sets_are_named_or_counted() {
        assert_eq!(seed_set("test").unwrap(), TEST_SEEDS.to_vec());
        assert_eq!(seed_set("train").unwrap(), TRAIN_SEEDS.to_vec());
        assert_eq!(seed_set("2").unwrap(), TEST_SEEDS[..2].to_vec());
        assert_eq!(seed_set("train:3").unwrap(), vec![0, 1, 2]);
        assert!(seed_set("test:6").is_err());
        assert!(seed_set("0").is_err());
        assert!(seed_set("dev").is_err());
    }

    #[test]
    fn the_test_and_train_seeds_never_meet() {
        // Scenario seeds are base + k with bases 0..=6 apart: disjoint sets
        // need every test k more than 6 from every train k.
        for t in TEST_SEEDS {
            for r in TRAIN_SEEDS {
                assert!(t.abs_diff(r) > 6, "{t} {r}");
            }
        }
    }
}
