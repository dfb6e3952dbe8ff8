//! `sluicegate sim sweep`: the simulator's closed-loop concurrency sweep
//! next to a reference: the llm-d H100 figures (`src/sim/sweep.rs`), or a
//! real engine measured now (`--live URL`) or before (`--against FILE`),
//! with the simulator's step model fitted to it (`src/sim/fit.rs`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::eval::live::sweep::{MeasuredSweep, SweepPlan, measure};
use crate::sim::config::{EngineConfig, LoadMode, SimConfig, StepModel};
use crate::sim::fit::{MeasuredPoint, REFINE_DURATION_S, fit, refine, sim_error, simulate};
use crate::sim::sweep::{LLM_D_H100, SweepConfig, SweepPoint, point};

/// Flags of `sluicegate sim sweep`.
#[derive(Debug, Args)]
pub(super) struct SweepArgs {
    /// Mean prompt length, tokens (the reference does not publish it).
    #[arg(long, default_value_t = 256.0)]
    prompt_tokens: f64,
    /// Output tokens of every request (default 256 against the reference,
    /// 64 with `--live`).
    #[arg(long)]
    output_tokens: Option<u32>,
    /// KV capacity in blocks of 16 tokens (28 000 ≈ an 8B model on an
    /// 80 GB H100).
    #[arg(long, default_value_t = 28_000)]
    num_gpu_blocks: u32,
    /// Simulated seconds per concurrency (the first sixth, at most 30 s,
    /// is not measured).
    #[arg(long, default_value_t = 180.0)]
    duration: f64,
    /// Measure a real engine at this base URL instead (its
    /// `/v1/completions`, streamed), fit the step model to it, and run the
    /// simulator at the same points.
    #[arg(long, value_name = "URL", conflicts_with = "against")]
    live: Option<String>,
    /// Fit and compare against a sweep saved with `--save` instead of
    /// measuring.
    #[arg(long, value_name = "FILE")]
    against: Option<PathBuf>,
    /// Write the measured sweep as JSON (with `--live`).
    #[arg(long, value_name = "FILE", requires = "live")]
    save: Option<PathBuf>,
    /// Write the fitted engine as a simulator configuration
    /// (`sluicegate sim serve --config FILE`): one replica.
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// The engine's `/metrics` (default `<URL>/metrics`).
    #[arg(long, value_name = "URL", requires = "live")]
    metrics_url: Option<String>,
    /// The model to ask for (default: the first the engine lists).
    #[arg(long, requires = "live")]
    model: Option<String>,
    /// Concurrencies measured with `--prompt-words` prompts.
    #[arg(
        long,
        default_value = "1,2,4,8,16,32",
        value_name = "LIST",
        requires = "live"
    )]
    concurrency: String,
    /// Words per prompt (about a token each on the test model).
    #[arg(long, default_value_t = 250, requires = "live")]
    prompt_words: usize,
    /// A longer prompt length, measured at concurrency 1 and 8, and the
    /// length halfway at concurrency 1: the fit needs three lengths for
    /// the prefill's linear and quadratic costs.
    #[arg(long, default_value_t = 1000, requires = "live")]
    long_prompt_words: usize,
    /// Measured time per point on the engine (e.g. `40s`).
    #[arg(long, default_value = "40s", requires = "live")]
    point_duration: String,
    /// Unmeasured time at the start of each point on the engine.
    #[arg(long, default_value = "10s", requires = "live")]
    point_warmup: String,
    /// The engine's `--max-num-seqs`, for the fitted engine.
    #[arg(long, default_value_t = 32)]
    max_num_seqs: u32,
    /// The engine's `--max-model-len`, for the fitted engine.
    #[arg(long, default_value_t = 2048)]
    max_model_len: u32,
    /// The engine's `--max-num-batched-tokens`, for the fitted engine.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: u32,
}

/// Runs the sweep and prints the side-by-side table.
pub(super) async fn run(args: SweepArgs) -> ExitCode {
    if args.live.is_none() && args.against.is_none() {
        return tokio::task::spawn_blocking(move || against_reference(&args))
            .await
            .unwrap_or(ExitCode::FAILURE);
    }
    let measured = match measured(&args).await {
        Ok(m) => m,
        Err(e) => {
            eprintln!("sluicegate sim sweep: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    tokio::task::spawn_blocking(move || against_engine(&args, &measured))
        .await
        .unwrap_or(ExitCode::FAILURE)
}

fn against_reference(args: &SweepArgs) -> ExitCode {
    let mut cfg = SweepConfig {
        prompt_mean: args.prompt_tokens,
        output_tokens: args.output_tokens.unwrap_or(256),
        duration_s: args.duration,
        ..SweepConfig::default()
    };
    cfg.engine.num_gpu_blocks = args.num_gpu_blocks;
    cfg.warmup_s = (cfg.duration_s / 6.0).min(30.0);
    let mut points = Vec::new();
    for r in LLM_D_H100 {
        match point(&cfg, r.concurrency) {
            Ok(p) => points.push(p),
            Err(e) => {
                eprintln!("sluicegate sim sweep: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    print!("{}", reference_table(&cfg, &points));
    ExitCode::SUCCESS
}

/// The engine's sweep: read from `--against`, or measured on `--live`
/// (and saved with `--save`).
async fn measured(args: &SweepArgs) -> Result<MeasuredSweep, String> {
    if let Some(path) = &args.against {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--against {}: {e}", path.display()))?;
        return serde_json::from_str(&text)
            .map_err(|e| format!("--against {}: {e}", path.display()));
    }
    let url = args
        .live
        .clone()
        .unwrap_or_default()
        .trim_end_matches('/')
        .to_owned();
    let duration = crate::config::parse_duration(&args.point_duration)
        .map_err(|e| format!("--point-duration: {e}"))?;
    let warmup = crate::config::parse_duration(&args.point_warmup)
        .map_err(|e| format!("--point-warmup: {e}"))?;
    let mut points = Vec::new();
    for c in args.concurrency.split(',') {
        let concurrency = c
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|c| *c >= 1)
            .ok_or_else(|| format!("--concurrency: {c:?} is not a whole number >= 1"))?;
        points.push(crate::eval::live::sweep::SweepPoint {
            concurrency,
            prompt_words: args.prompt_words,
        });
    }
    // Three lengths at concurrency 1 give the prefill's linear and
    // quadratic costs; concurrency 8 at the long one separates the
    // per-sequence cost from the per-context-token one.
    let middle = (args.prompt_words + args.long_prompt_words) / 2;
    for (concurrency, prompt_words) in [
        (1, middle),
        (1, args.long_prompt_words),
        (8, args.long_prompt_words),
    ] {
        points.push(crate::eval::live::sweep::SweepPoint {
            concurrency,
            prompt_words,
        });
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => super::eval_live::first_model(&url).await?,
    };
    let plan = SweepPlan {
        metrics_url: args
            .metrics_url
            .clone()
            .unwrap_or_else(|| format!("{url}/metrics")),
        url,
        model,
        points,
        output_tokens: args.output_tokens.unwrap_or(64),
        duration,
        warmup,
        seed: 1,
    };
    let sweep = measure(&plan, &|what| eprintln!("sluicegate sim sweep: {what}")).await?;
    if let Some(path) = &args.save {
        let json = serde_json::to_string_pretty(&sweep).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("--save {}: {e}", path.display()))?;
    }
    Ok(sweep)
}

/// Fits the step model to the engine's sweep (closed form, then refined
/// by simulation), runs the simulator at the same points, prints both,
/// and writes `--profile`.
fn against_engine(args: &SweepArgs, measured: &MeasuredSweep) -> ExitCode {
    match fit_and_compare(args, measured) {
        Ok(table) => {
            print!("{table}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluicegate sim sweep: {e}");
            ExitCode::FAILURE
        }
    }
}

fn fit_and_compare(args: &SweepArgs, measured: &MeasuredSweep) -> Result<String, String> {
    let closed = fit(&measured.points, 0.03).map_err(|e| e.to_string())?;
    let mut engine = EngineConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        step: closed.step.clone(),
        ..EngineConfig::default()
    };
    if let Some(kv) = measured.kv {
        engine.block_size = kv.block_size;
        engine.num_gpu_blocks = kv.num_gpu_blocks;
    }
    let closed_error = sim_error(&engine, &measured.points, closed.http_s, args.duration)
        .map_err(|e| e.to_string())?;
    let (step, _) = refine(&engine, &measured.points, closed.http_s, REFINE_DURATION_S)
        .map_err(|e| e.to_string())?;
    engine.step = step;
    let refined_error = sim_error(&engine, &measured.points, closed.http_s, args.duration)
        .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for m in &measured.points {
        rows.push((
            m,
            simulate(&engine, m, args.duration).map_err(|e| e.to_string())?,
        ));
    }
    let mut out = String::new();
    let _ = writeln!(out, "engine: {}", measured.url);
    let _ = writeln!(
        out,
        "closed-form fit: {}; HTTP path {:.1} ms; simulator error {:.4} (mean squared log ratio)",
        constants(&closed.step),
        closed.http_s * 1000.0,
        closed_error
    );
    let _ = writeln!(
        out,
        "refined by simulation: {}; simulator error {:.4}",
        constants(&engine.step),
        refined_error
    );
    out.push_str(&engine_table(closed.http_s, &rows));
    if let Some(path) = &args.profile {
        let text = toml::to_string(&profile(engine, measured)).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("--profile {}: {e}", path.display()))?;
    }
    Ok(out)
}

fn constants(s: &StepModel) -> String {
    format!(
        "c0 {:.3} ms, c1 {:.5} ms/prefill token, c2 {:.4} ms/seq, c3 {:.6} ms/context token, c4 {:.3e} ms/prefill token/context token",
        s.c0_ms,
        s.c1_ms_per_prefill_token,
        s.c2_ms_per_decode_seq,
        s.c3_ms_per_context_token,
        s.c4_ms_per_prefill_context
    )
}

/// The fitted engine as a one-replica simulator with no load of its own,
/// its prompts counted in tokens as the engine counted them.
fn profile(engine: EngineConfig, measured: &MeasuredSweep) -> SimConfig {
    let (chars, tokens) = measured.points.iter().fold((0.0, 0.0), |(c, t), p| {
        (c + p.prompt_chars, t + p.prompt_tokens)
    });
    let mut cfg = SimConfig {
        replicas: 1,
        ..SimConfig::default()
    };
    cfg.http.max_output_tokens = engine.max_model_len.saturating_sub(1).max(1);
    cfg.engine = engine;
    cfg.interactive.mode = LoadMode::Off;
    if tokens > 0.0 {
        cfg.http.chars_per_token = (chars / tokens).max(1.0);
    }
    cfg
}

/// Within the ±15 % the simulator is held to.
fn mark(ratio: f64) -> &'static str {
    if (0.85..=1.15).contains(&ratio) {
        " "
    } else {
        "*"
    }
}

fn engine_table(http_s: f64, rows: &[(&MeasuredPoint, SweepPoint)]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "each cell: engine / simulator / ratio; * outside ±15 %; the simulator's TTFT includes the HTTP path"
    );
    let _ = writeln!(
        out,
        "{:>4} {:>6} | {:>22} | {:>24} | {:>24} | {:>22}",
        "conc", "prompt", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL mean ms"
    );
    let cell = |a: f64, b: f64, digits: usize| {
        let r = if a > 0.0 { b / a } else { f64::NAN };
        format!("{a:>7.digits$} {b:>7.digits$} {r:>5.2}{}", mark(r))
    };
    for (m, p) in rows {
        let _ = writeln!(
            out,
            "{:>4} {:>6.0} | {} | {} | {} | {}",
            m.concurrency,
            m.prompt_tokens,
            cell(m.requests_per_s, p.requests_per_s, 2),
            cell(m.ttft_p50_s * 1e3, (p.ttft_p50_s + http_s) * 1e3, 1),
            cell(m.ttft_p99_s * 1e3, (p.ttft_p99_s + http_s) * 1e3, 1),
            cell(m.itl_mean_s * 1e3, p.itl_mean_s * 1e3, 1),
        );
    }
    out
}

fn reference_table(cfg: &SweepConfig, points: &[SweepPoint]) -> String {
    let s = &cfg.engine.step;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "closed loop, 1 replica: max_num_seqs {}, {} KV blocks, prompt {:.0} (cv {}), output {}; step c0 {} ms, c1 {} ms/prefill token, c2 {} ms/seq, c3 {} ms/context token, jitter {}",
        cfg.engine.max_num_seqs,
        cfg.engine.num_gpu_blocks,
        cfg.prompt_mean,
        cfg.prompt_cv,
        cfg.output_tokens,
        s.c0_ms,
        s.c1_ms_per_prefill_token,
        s.c2_ms_per_decode_seq,
        s.c3_ms_per_context_token,
        s.jitter
    );
    let _ = writeln!(
        out,
        "reference: llm-d async-processor guide, Llama-3.1-8B on one H100, vLLM --max-num-seqs 1024, ~256 output tokens"
    );
    let _ = writeln!(
        out,
        "{:>5} | {:>7} {:>7} {:>6} | {:>7} {:>7} {:>6} | {:>6} {:>6} | {:>8}",
        "conc", "req/s", "ref", "ratio", "lat s", "ref", "ratio", "KV %", "ref", "tok/s"
    );
    for (p, r) in points.iter().zip(LLM_D_H100) {
        let _ = writeln!(
            out,
            "{:>5} | {:>7.1} {:>7.1} {:>6.2} | {:>7.2} {:>7.1} {:>6.2} | {:>6.1} {:>6} | {:>8.0}",
            p.concurrency,
            p.requests_per_s,
            r.requests_per_s,
            p.requests_per_s / r.requests_per_s,
            p.mean_latency_s,
            r.mean_latency_s,
            p.mean_latency_s / r.mean_latency_s,
            p.kv_pct,
            r.kv_pct
                .map_or_else(|| "<1".to_owned(), |k| format!("{k:.0}")),
            p.output_tokens_per_s
        );
    }
    out
}
