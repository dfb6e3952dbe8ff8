//! `sluicegate eval --live URL`: gate quality on a real engine
//! (`src/eval/live/`, docs/real-engine.md).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::eval::Slo;
use crate::eval::live::{
    LiveContender, LiveOptions, LiveReport, LiveShape, evaluate, timeline_csv,
};

/// The live eval's own flags (with `--scenario`, `--gate`, `--csv` and
/// `--json` of `eval`).
#[derive(Debug, Args)]
pub(super) struct LiveArgs {
    /// Run against a real engine at this base URL (its `/v1/completions`),
    /// in real time, instead of the simulator.
    #[arg(long, value_name = "URL")]
    pub(super) live: Option<String>,
    /// The engine's `/metrics` (default `<URL>/metrics`).
    #[arg(long, value_name = "URL", requires = "live")]
    metrics_url: Option<String>,
    /// The model to ask for (default: the first the engine lists).
    #[arg(long, requires = "live")]
    model: Option<String>,
    /// Interactive requests per second (mean).
    #[arg(long, default_value_t = 3.0, requires = "live")]
    rate: f64,
    /// Length of each run (e.g. `180s`, `3m`): at 3 requests/s, 180 s
    /// gives each p99 about 540 requests.
    #[arg(long, default_value = "180s", requires = "live")]
    duration: String,
    /// Unscored interactive traffic before the first run.
    #[arg(long, default_value = "20s", requires = "live")]
    warmup: String,
    /// Repeats of the baseline and every contender.
    #[arg(long, default_value_t = 3, requires = "live")]
    repeats: usize,
    /// The first repeat's seed (repeat k uses seed + k).
    #[arg(long = "live-seed", default_value_t = 1, requires = "live")]
    live_seed: u64,
    /// `max_SYS`: the engine's `--max-num-seqs`.
    #[arg(long, default_value_t = 32, requires = "live")]
    max_sys: u32,
    /// Words per prompt (about a token each).
    #[arg(long, default_value_t = 250, requires = "live")]
    prompt_words: usize,
    /// Output tokens of an interactive request.
    #[arg(long, default_value_t = 32, requires = "live")]
    output_tokens: u32,
    /// Output tokens of a batch request.
    #[arg(long, default_value_t = 64, requires = "live")]
    batch_output_tokens: u32,
    /// The SLO's TTFT bound, seconds (scores, and `feedback`'s and
    /// `slo-headroom`'s `ttft_slo`).
    #[arg(long, default_value_t = 0.5, requires = "live")]
    ttft_slo: f64,
    /// The SLO's bound on a request's p95 gap between tokens, seconds
    /// (scores, and the gates' `itl_slo`).
    #[arg(long, default_value_t = 0.05, requires = "live")]
    itl_slo: f64,
    /// The engine's API server PID (`scripts/vllm.sh serve` prints it):
    /// the CPU time of its process tree is reported per run.
    #[arg(long, requires = "live")]
    engine_pid: Option<u32>,
}

/// Contenders when `--gate` names none.
const DEFAULT_CONTENDERS: &[&str] = &[
    "feedback",
    "slo-headroom",
    "vllm",
    "static-cap-1",
    "static-cap-2",
    "static-cap-4",
    "ungated",
];

/// Runs the live eval.
pub(super) async fn run(
    url: String,
    live: LiveArgs,
    scenarios: &[String],
    gates: &[String],
    gate_specs: &[String],
    csv: Option<PathBuf>,
    json: bool,
) -> ExitCode {
    let options = match options(url, &live, scenarios, gates, gate_specs).await {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sluicegate eval --live: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let progress = |what: &str| eprintln!("eval --live: {what}");
    let report = match evaluate(&options, &progress).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sluicegate eval --live: {e}");
            return ExitCode::FAILURE;
        }
    };
    let _ = std::fs::remove_dir_all(&options.work_dir);
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("sluicegate eval --live: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", table(&report));
    }
    if let Some(path) = csv {
        if let Err(e) = std::fs::write(&path, timeline_csv(&report)) {
            eprintln!("sluicegate eval --live: --csv {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

async fn options(
    url: String,
    live: &LiveArgs,
    scenarios: &[String],
    gates: &[String],
    gate_specs: &[String],
) -> Result<LiveOptions, String> {
    let url = url.trim_end_matches('/').to_owned();
    let shape = match scenarios {
        [] => LiveShape::Steady,
        [one] => LiveShape::parse(one).ok_or_else(|| {
            format!("--scenario: `{one}` does not run live; allowed: steady, waves")
        })?,
        _ => return Err("--scenario: one scenario per live eval (steady or waves)".to_owned()),
    };
    let names: Vec<&str> = if gates.is_empty() && gate_specs.is_empty() {
        DEFAULT_CONTENDERS.to_vec()
    } else {
        gates.iter().map(String::as_str).collect()
    };
    let mut contenders = names
        .iter()
        .map(|n| LiveContender::parse(n).map_err(|e| format!("--gate: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    for spec in gate_specs {
        contenders.push(LiveContender::spec(spec).map_err(|e| format!("--gate-spec: {e}"))?);
    }
    let duration =
        crate::config::parse_duration(&live.duration).map_err(|e| format!("--duration: {e}"))?;
    let warmup =
        crate::config::parse_duration(&live.warmup).map_err(|e| format!("--warmup: {e}"))?;
    if duration < Duration::from_secs(10) {
        return Err("--duration: at least 10s".to_owned());
    }
    if !(live.rate.is_finite() && live.rate > 0.0) {
        return Err(format!("--rate: a number > 0, got {}", live.rate));
    }
    if live.repeats == 0
        || live.max_sys == 0
        || live.output_tokens == 0
        || live.batch_output_tokens == 0
    {
        return Err(
            "--repeats, --max-sys, --output-tokens and --batch-output-tokens must be >= 1"
                .to_owned(),
        );
    }
    let model = match &live.model {
        Some(m) => m.clone(),
        None => first_model(&url).await?,
    };
    Ok(LiveOptions {
        metrics_url: live
            .metrics_url
            .clone()
            .unwrap_or_else(|| format!("{url}/metrics")),
        url,
        model,
        shape,
        rate: live.rate,
        duration,
        warmup,
        repeats: live.repeats,
        seed: live.live_seed,
        contenders,
        max_sys: live.max_sys,
        prompt_words: live.prompt_words,
        output_tokens: live.output_tokens,
        batch_output_tokens: live.batch_output_tokens,
        slo: Slo {
            ttft_s: positive("--ttft-slo", live.ttft_slo)?,
            itl_s: positive("--itl-slo", live.itl_slo)?,
        },
        engine_pid: live.engine_pid,
        work_dir: std::env::temp_dir().join(format!("sluicegate-eval-live-{}", std::process::id())),
    })
}

/// `value` when it is a finite number > 0.
fn positive(flag: &str, value: f64) -> Result<f64, String> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(format!(
            "{flag}: must be a number of seconds > 0, got {value}"
        ))
    }
}

/// The first model `<url>/v1/models` lists.
pub(super) async fn first_model(url: &str) -> Result<String, String> {
    let models: serde_json::Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("{url}/v1/models: {e} (or name one with --model)"))?
        .json()
        .await
        .map_err(|e| format!("{url}/v1/models: {e}"))?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{url}/v1/models lists no model; name one with --model"))
}

/// The report as tables: the baselines' own spread, then each contender
/// (min–max over repeats), then every run with its CPU time.
fn table(report: &LiveReport) -> String {
    let mut out = String::new();
    let shape = report.shape.name();
    let _ = writeln!(
        out,
        "live eval: {shape}, {} interactive requests/s, {} s per run, {} repeats; SLO TTFT <= {} s, p95 ITL <= {} s",
        report.rate,
        report.duration_s,
        report.baselines.len(),
        report.slo.ttft_s,
        report.slo.itl_s
    );
    let _ = writeln!(out, "\nbaseline (no batch), per repeat:");
    for (i, b) in report.baselines.iter().enumerate() {
        let _ = writeln!(
            out,
            "  #{i}: {} requests, TTFT p50 {:.3} s p99 {:.3} s, ITL p99 {:.3} s, violations {:.2} %",
            b.requests, b.ttft_p50_s, b.ttft_p99_s, b.itl_p99_s, b.violations_pct
        );
    }
    let _ = writeln!(
        out,
        "\n{:<14} {:>17} {:>13} {:>15} {:>15} {:>15} {:>7}",
        "contender", "batch tokens/s", "H (slack)", "ΔV pp", "ρ TTFT p99", "ρ ITL p99", "within"
    );
    let range =
        |s: crate::eval::Spread, digits: usize| format!("{:.digits$}–{:.digits$}", s.min, s.max);
    for c in &report.contenders {
        let s = &c.summary;
        let _ = writeln!(
            out,
            "{:<14} {:>17} {:>13} {:>15} {:>15} {:>15} {:>4}/{}",
            c.contender,
            range(s.batch_tokens_per_s, 0),
            s.harvest.map_or_else(|| "–".to_owned(), |h| range(h, 2)),
            range(s.delta_v_pp, 2),
            range(s.rho_ttft, 2),
            range(s.rho_itl, 2),
            s.within,
            s.runs
        );
    }
    let _ = writeln!(
        out,
        "\nruns (client TTFT p99 | the engine's own TTFT p99 bucket | CPU s per process):"
    );
    for r in &report.runs {
        let cpu: Vec<String> = r.cpu_s.iter().map(|(p, s)| format!("{p} {s:.0}")).collect();
        let engine = r
            .engine_ttft_p99_s
            .map_or_else(|| "–".to_owned(), |v| format!("≤{v}"));
        let _ = writeln!(
            out,
            "  #{} {:<14} {:>7.3} s | {:>6} s | violations {:>5.2} % | batch {:>5.0} tokens/s | {}",
            r.repeat,
            r.contender,
            r.interactive.ttft_p99_s,
            engine,
            r.interactive.violations_pct,
            r.batch_tokens_per_s,
            cpu.join(", ")
        );
    }
    out
}
