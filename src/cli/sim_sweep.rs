//! `sluicegate sim sweep`: the simulator's closed-loop concurrency sweep
//! next to the llm-d H100 figures (`src/sim/sweep.rs`).

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;

use crate::sim::sweep::{LLM_D_H100, SweepConfig, SweepPoint, point};

/// Flags of `sluicegate sim sweep`.
#[derive(Debug, Args)]
pub(super) struct SweepArgs {
    /// Mean prompt length, tokens (the reference does not publish it).
    #[arg(long, default_value_t = 256.0)]
    prompt_tokens: f64,
    /// Output tokens of every request.
    #[arg(long, default_value_t = 256)]
    output_tokens: u32,
    /// KV capacity in blocks of 16 tokens (28 000 ≈ an 8B model on an
    /// 80 GB H100).
    #[arg(long, default_value_t = 28_000)]
    num_gpu_blocks: u32,
    /// Simulated seconds per concurrency (the first 30 s are not measured).
    #[arg(long, default_value_t = 180.0)]
    duration: f64,
}

/// Runs the sweep and prints the side-by-side table.
pub(super) fn run(args: &SweepArgs) -> ExitCode {
    let mut cfg = SweepConfig {
        prompt_mean: args.prompt_tokens,
        output_tokens: args.output_tokens,
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
    print!("{}", table(&cfg, &points));
    ExitCode::SUCCESS
}

fn table(cfg: &SweepConfig, points: &[SweepPoint]) -> String {
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
