//! `sluicegate eval`: gate quality in virtual time (`src/eval/`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::dispatch::DispatchSettings;
use crate::eval::{
    Contender, Options, PoolSize, Report, Scenario, ScenarioReport, Shape, Slo, contender,
};

/// Flags of `sluicegate eval`.
#[derive(Debug, Args)]
pub(super) struct EvalArgs {
    /// Scenarios to run (repeatable): steady, diurnal, waves, step,
    /// blackout, long-context. Default: all.
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
    /// Prometheus pool name `pool`.
    #[arg(long = "gate-spec", value_name = "NAME=JSON")]
    gate_specs: Vec<String>,
    /// Also replay a CSV trace (timestamp, input tokens, output tokens) as
    /// a scenario on each pool size.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Scales every scenario's duration (1.0 = full; at least 30 s).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Added to every scenario's fixed seed (0 = the published figures).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Draw each scenario's run over time as an SVG (with several
    /// scenarios, `FILE` gets a `-<scenario>` suffix per scenario).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// The contender the SVG draws (default: the gate with the most batch
    /// tokens within the SLO budget).
    #[arg(long, value_name = "NAME")]
    svg_gate: Option<String>,
    /// Worker threads (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
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
    ExitCode::SUCCESS
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
        let file = if many {
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("eval");
            let name = sc.scenario.name.replace('/', "-");
            path.with_file_name(format!("{stem}-{name}.svg"))
        } else {
            path.to_path_buf()
        };
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
    let shapes: Vec<Shape> = if args.scenarios.is_empty() {
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
    let mut scenarios = Vec::new();
    for &pool in &pools {
        for &shape in &shapes {
            scenarios.push(Scenario::built_in(shape, pool, args.scale));
        }
        if let Some(path) = &args.trace {
            scenarios.push(Scenario::trace(path, pool).map_err(|e| format!("--trace: {e}"))?);
        }
    }
    for sc in &mut scenarios {
        sc.seed = sc.seed.wrapping_add(args.seed);
    }
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
                all.iter()
                    .find(|c| &c.name == g)
                    .cloned()
                    .ok_or_else(|| format!("--gate: unknown `{g}`; allowed: {}", names.join(", ")))
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
    Ok(Options {
        scenarios,
        contenders,
        settings: DispatchSettings::default(),
        slo: Slo::default(),
        threads,
    })
}

/// A `--gate-spec NAME=JSON` contender.
fn custom_gate(arg: &str) -> Result<Contender, String> {
    let (name, json) = arg
        .split_once('=')
        .ok_or_else(|| format!("--gate-spec: expected NAME=JSON, got `{arg}`"))?;
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("--gate-spec {name}: {e}"))?;
    let gate_type = value
        .get("gate_type")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("--gate-spec {name}: `gate_type` (a string) is required"))?;
    let params = value
        .get("gate_params")
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    Contender::gate(name, gate_type, &params)
}

/// Runs the evaluation will make, for the progress bar.
fn progress_total(o: &Options) -> u64 {
    let mut sizes: Vec<usize> = o.scenarios.iter().map(|s| s.pool.replicas()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let per_scenario: usize = o
        .contenders
        .iter()
        .map(|c| match c.kind {
            crate::eval::Kind::StaticOracle => 0,
            _ => 1,
        })
        .sum::<usize>()
        + 1;
    (sizes.len() + o.scenarios.len() * per_scenario) as u64
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

/// The report as one table per scenario.
pub(super) fn table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "SLO: TTFT <= {} s and p95 ITL <= {} s; headline: H at dV <= 0.5 pp and rho(TTFT p99) <= 1.2",
        report.slo.ttft_s, report.slo.itl_s
    );
    for sc in &report.scenarios {
        scenario_table(&mut out, sc, report.max_staleness_s);
    }
    out
}

fn scenario_table(out: &mut String, sc: &ScenarioReport, max_staleness_s: f64) {
    let b = &sc.baseline;
    let _ = writeln!(
        out,
        "\n{} ({:.0} s, seed {:#x}): capacity {:.0} tok/s, slack {:.0} tok; baseline TTFT p99 {:.3} s, ITL p99 {:.3} s, SLO violations {:.2} %",
        sc.scenario.name,
        sc.scenario.duration_s,
        sc.scenario.seed,
        sc.capacity_tokens_per_s,
        sc.slack_tokens,
        b.ttft_p99_s,
        b.itl_p99_s,
        b.violations_pct
    );
    let _ = writeln!(
        out,
        "{:<30} {:>6} {:>8} {:>7} {:>6} {:>9} {:>7} {:>7} {:>5} {:>8} {:>8} {:>5}",
        "contender",
        "H",
        "dV pp",
        "rhoTTFT",
        "rhoITL",
        "batch t/s",
        "react s",
        "recov s",
        "osc",
        "429/503",
        "preempt",
        "dark"
    );
    for row in &sc.rows {
        let s = &row.score;
        let name = match &row.detail {
            Some(d) => format!("{} ({d})", row.contender),
            None => row.contender.clone(),
        };
        let mark = if crate::eval::within_slo_budget(s) {
            ""
        } else {
            " *"
        };
        let _ = writeln!(
            out,
            "{:<30} {:>6.3} {:>+8.2} {:>7.2} {:>6.2} {:>9.0} {:>7} {:>7} {:>5} {:>8} {:>8} {:>5}{mark}",
            name,
            s.harvest,
            s.delta_v_pp,
            s.rho_ttft,
            s.rho_itl,
            s.batch_tokens_per_s,
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
        "(* outside the SLO budget; dark = dispatches with metrics dark > {max_staleness_s:.0} s)"
    );
}
