//! The simulator against a published closed-loop concurrency sweep
//! (`sluicegate sim sweep`): one replica, a fixed number of requests always
//! in flight (each finished request is replaced at once), and per
//! concurrency the throughput, mean end-to-end latency and mean KV use,
//! next to the reference figures. Pure: configuration in, figures out.

use serde::Serialize;

use super::config::{EngineConfig, LoadMode};
use super::engine::{Outcome, RequestClass};
use super::error::SimError;
use super::runner::{self, BatchSpec, StaticCap, quantile};

/// One published point of a closed-loop sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Reference {
    /// Requests kept in flight.
    pub concurrency: u32,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Mean end-to-end latency, seconds.
    pub mean_latency_s: f64,
    /// Mean KV-cache use, percent (`None` where the source says "< 1 %").
    pub kv_pct: Option<f64>,
}

/// The llm-d async-processor operations guide's sweep: Llama-3.1-8B on one
/// H100, vLLM `--max-num-seqs 1024`, about 256 output tokens, closed loop
/// through the inference gateway (`docs/simulator.md`, "Calibration: `sluicegate sim sweep`").
pub const LLM_D_H100: [Reference; 7] = [
    Reference {
        concurrency: 8,
        requests_per_s: 4.2,
        mean_latency_s: 1.9,
        kv_pct: None,
    },
    Reference {
        concurrency: 32,
        requests_per_s: 14.7,
        mean_latency_s: 2.2,
        kv_pct: Some(3.0),
    },
    Reference {
        concurrency: 64,
        requests_per_s: 24.1,
        mean_latency_s: 2.6,
        kv_pct: Some(5.0),
    },
    Reference {
        concurrency: 128,
        requests_per_s: 35.8,
        mean_latency_s: 3.6,
        kv_pct: Some(12.0),
    },
    Reference {
        concurrency: 192,
        requests_per_s: 40.4,
        mean_latency_s: 4.7,
        kv_pct: Some(16.0),
    },
    Reference {
        concurrency: 256,
        requests_per_s: 44.3,
        mean_latency_s: 5.8,
        kv_pct: Some(20.0),
    },
    Reference {
        concurrency: 512,
        requests_per_s: 61.4,
        mean_latency_s: 9.7,
        kv_pct: Some(51.0),
    },
];

/// How the sweep runs.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepConfig {
    /// The replica (step constants, KV, `max_num_seqs`).
    pub engine: EngineConfig,
    /// Mean prompt length, tokens (lognormal with `prompt_cv`).
    pub prompt_mean: f64,
    /// Coefficient of variation of the prompt length.
    pub prompt_cv: f64,
    /// Output tokens of every request (`max_tokens`; the model never stops
    /// earlier).
    pub output_tokens: u32,
    /// Simulated seconds per concurrency.
    pub duration_s: f64,
    /// Seconds at the start not measured (the loop filling up).
    pub warmup_s: f64,
    /// Seed.
    pub seed: u64,
}

impl Default for SweepConfig {
    /// The reference's setting: `max_num_seqs` 1024 and an H100-like KV
    /// budget (28 000 blocks of 16 tokens, `docs/simulator.md`), 256
    /// output tokens; the prompt length is not published, 256 is assumed.
    fn default() -> Self {
        Self {
            engine: EngineConfig {
                max_num_seqs: 1024,
                num_gpu_blocks: 28_000,
                ..EngineConfig::default()
            },
            prompt_mean: 256.0,
            prompt_cv: 0.3,
            output_tokens: 256,
            duration_s: 180.0,
            warmup_s: 30.0,
            seed: 1,
        }
    }
}

/// The simulator's figures at one concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Requests kept in flight.
    pub concurrency: u32,
    /// Completed requests per second after the warm-up.
    pub requests_per_s: f64,
    /// Mean end-to-end latency of requests sent after the warm-up, seconds.
    pub mean_latency_s: f64,
    /// Mean KV use after the warm-up, percent.
    pub kv_pct: f64,
    /// Output tokens per second after the warm-up.
    pub output_tokens_per_s: f64,
    /// Median time to first token of requests sent after the warm-up,
    /// seconds (the engine's time: no HTTP path).
    pub ttft_p50_s: f64,
    /// Their 99th percentile TTFT, seconds.
    pub ttft_p99_s: f64,
    /// Their mean gap between tokens, averaged over requests, seconds.
    pub itl_mean_s: f64,
}

/// Runs one closed loop at `concurrency`.
pub fn point(cfg: &SweepConfig, concurrency: u32) -> Result<SweepPoint, SimError> {
    let mut sc = runner::Scenario::new(1);
    sc.pool.engine = cfg.engine.clone();
    sc.interactive.mode = LoadMode::Off;
    sc.batch = Some(BatchSpec {
        prompt_mean: cfg.prompt_mean,
        prompt_cv: cfg.prompt_cv,
        // A true length far beyond max_tokens: every request generates
        // exactly `output_tokens`, as a benchmark with ignore_eos does.
        output_mean: f64::from(cfg.output_tokens) * 100.0,
        output_cv: 0.1,
        max_tokens: cfg.output_tokens,
        ..BatchSpec::default()
    });
    sc.duration_s = cfg.duration_s;
    sc.seed = cfg.seed;
    // The loop refills at every step end at the latest.
    sc.policy_interval_s = 0.005;
    sc.sample_interval_s = 1.0;
    let run = runner::run(&sc, &mut StaticCap { cap: concurrency })?;
    let span = (cfg.duration_s - cfg.warmup_s).max(1e-9);
    let done: Vec<_> = run
        .records
        .iter()
        .filter(|r| r.class == RequestClass::Batch && r.outcome == Outcome::Completed)
        .collect();
    let finished_after = done
        .iter()
        .filter(|r| r.finished_at.is_some_and(|t| t >= cfg.warmup_s))
        .count();
    let measured: Vec<_> = done.iter().filter(|r| r.arrival >= cfg.warmup_s).collect();
    let latencies: Vec<f64> = measured
        .iter()
        .filter_map(|r| r.finished_at.map(|t| t - r.arrival))
        .collect();
    let mut ttfts: Vec<f64> = measured.iter().filter_map(|r| r.ttft()).collect();
    let itls: Vec<f64> = measured.iter().filter_map(|r| r.itl_mean).collect();
    let late: Vec<_> = run.series.iter().filter(|p| p.t >= cfg.warmup_s).collect();
    let kv = late.iter().map(|p| p.kv_usage).sum::<f64>() / late.len().max(1) as f64;
    let tokens = match (late.first(), late.last()) {
        (Some(a), Some(b)) if b.t > a.t => {
            (b.batch_tokens_total - a.batch_tokens_total) as f64 / (b.t - a.t)
        }
        _ => 0.0,
    };
    Ok(SweepPoint {
        concurrency,
        requests_per_s: finished_after as f64 / span,
        mean_latency_s: latencies.iter().sum::<f64>() / latencies.len().max(1) as f64,
        kv_pct: 100.0 * kv,
        output_tokens_per_s: tokens,
        ttft_p50_s: quantile(&mut ttfts, 0.5).unwrap_or(0.0),
        ttft_p99_s: quantile(&mut ttfts, 0.99).unwrap_or(0.0),
        itl_mean_s: itls.iter().sum::<f64>() / itls.len().max(1) as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_loop_obeys_littles_law() {
        // Throughput × latency = requests in flight, within the loop's
        // refill delay and the measurement edges.
        let cfg = SweepConfig {
            duration_s: 60.0,
            warmup_s: 10.0,
            ..SweepConfig::default()
        };
        for c in [8, 64] {
            let p = point(&cfg, c).unwrap();
            let in_flight = p.requests_per_s * p.mean_latency_s;
            assert!(
                (in_flight - f64::from(c)).abs() < 0.1 * f64::from(c),
                "{c}: {p:?}"
            );
            // Every request generates exactly 256 tokens.
            let per_request = p.output_tokens_per_s / p.requests_per_s;
            assert!((per_request - 256.0).abs() < 0.1 * 256.0, "{c}: {p:?}");
        }
    }

    #[test]
    fn an_engine_with_a_short_model_length_runs() {
        // The virtual-time runner once checked the HTTP front's default
        // output cap (2 048) against the engine, refusing the test engine
        // of `scripts/vllm.sh` (`--max-model-len 2048`).
        let mut cfg = SweepConfig {
            duration_s: 20.0,
            warmup_s: 5.0,
            ..SweepConfig::default()
        };
        cfg.engine.max_model_len = 2048;
        cfg.engine.max_num_seqs = 32;
        let p = point(&cfg, 4).unwrap();
        assert!(
            p.requests_per_s > 0.0 && p.ttft_p50_s > 0.0 && p.itl_mean_s > 0.0,
            "{p:?}"
        );
    }

    #[test]
    fn more_concurrency_more_throughput_and_latency() {
        let cfg = SweepConfig {
            duration_s: 40.0,
            warmup_s: 10.0,
            ..SweepConfig::default()
        };
        let a = point(&cfg, 8).unwrap();
        let b = point(&cfg, 128).unwrap();
        assert!(b.requests_per_s > a.requests_per_s, "{a:?} {b:?}");
        assert!(b.mean_latency_s > a.mean_latency_s, "{a:?} {b:?}");
        assert!(b.kv_pct > a.kv_pct, "{a:?} {b:?}");
    }
}
