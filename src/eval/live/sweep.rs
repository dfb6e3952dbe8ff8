//! A real engine's closed-loop concurrency sweep (`sluicegate sim sweep
//! --live URL`): at each point `c` clients each send one streamed
//! completion after another (`ignore_eos`, so every request generates
//! exactly its `max_tokens`) for a fixed time. What the engine serves is
//! what the simulator's step model is fitted to ([`crate::sim::fit`]) and
//! then compared against at the same points.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::engine;
use super::figures::Timing;
use super::traffic;
use crate::sim::fit::MeasuredPoint;
use crate::sim::runner::quantile;

/// One point of the sweep: clients and prompt length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepPoint {
    /// Clients, each with one request at a time.
    pub concurrency: u32,
    /// Words per prompt.
    pub prompt_words: usize,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct SweepPlan {
    /// The engine's base URL (`<url>/v1/completions`).
    pub url: String,
    /// The engine's `/metrics`.
    pub metrics_url: String,
    /// The model to ask for.
    pub model: String,
    /// The points, in order.
    pub points: Vec<SweepPoint>,
    /// Output tokens of every request.
    pub output_tokens: u32,
    /// Measured time per point.
    pub duration: Duration,
    /// Unmeasured time at the start of each point (the loop filling up).
    pub warmup: Duration,
    /// Seed of the prompts.
    pub seed: u64,
}

/// The engine's KV shape, from `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvShape {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks.
    pub num_gpu_blocks: u32,
}

/// A measured sweep, as `--save` writes it and `--against` reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredSweep {
    /// The engine measured.
    pub url: String,
    /// Its KV shape, when its page says.
    pub kv: Option<KvShape>,
    /// Per point.
    pub points: Vec<MeasuredPoint>,
}

/// Runs the sweep; `progress` hears each point start.
pub async fn measure(
    plan: &SweepPlan,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<MeasuredSweep, String> {
    let client = engine::client()?;
    let kv = kv_shape(&client, &plan.metrics_url).await?;
    let mut points = Vec::new();
    for (i, point) in plan.points.iter().enumerate() {
        engine::wait_idle(&client, &plan.metrics_url, Duration::from_secs(120)).await?;
        progress(&format!(
            "concurrency {} with {}-word prompts",
            point.concurrency, point.prompt_words
        ));
        let seed = plan.seed.wrapping_add((i as u64) << 32);
        points.push(closed_loop(&client, plan, *point, seed).await?);
    }
    Ok(MeasuredSweep {
        url: plan.url.clone(),
        kv,
        points,
    })
}

/// One point: `c` clients until the warm-up and the measured time are over;
/// each finishes the request it has in flight.
async fn closed_loop(
    client: &reqwest::Client,
    plan: &SweepPlan,
    point: SweepPoint,
    seed: u64,
) -> Result<MeasuredPoint, String> {
    let start = Instant::now();
    let end = start + plan.warmup + plan.duration;
    let timings = Arc::new(Mutex::new(Vec::<(Timing, usize)>::new()));
    let mut clients = Vec::new();
    for k in 0..point.concurrency {
        let (client, timings, plan) = (client.clone(), timings.clone(), plan.clone());
        clients.push(tokio::spawn(async move {
            let mut n: u64 = 0;
            while Instant::now() < end {
                let text = traffic::prompt(seed ^ (u64::from(k) << 20) ^ n, point.prompt_words);
                n += 1;
                let t = traffic::interactive_request(
                    &client,
                    &plan.url,
                    &plan.model,
                    &text,
                    plan.output_tokens,
                    start,
                    GIVE_UP,
                )
                .await;
                let failed = !t.ok;
                timings.lock().await.push((t, text.len()));
                if failed {
                    // An engine that refuses would be hammered otherwise.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }));
    }
    for c in clients {
        c.await.map_err(|e| e.to_string())?;
    }
    let timings = std::mem::take(&mut *timings.lock().await);
    let failed = timings.iter().filter(|(t, _)| !t.ok).count();
    if failed * 10 > timings.len() {
        let silent = timings.iter().filter(|(t, _)| t.ttft_s.is_none()).count();
        return Err(format!(
            "concurrency {}: {failed} of {} requests failed ({silent} without a first token, the rest short of {} tokens or without [DONE]); is {} a vLLM serving {}?",
            point.concurrency,
            timings.len(),
            plan.output_tokens,
            plan.url,
            plan.model
        ));
    }
    Ok(figures(point, plan, &timings))
}

/// How long one request may take before it counts as failed.
const GIVE_UP: Duration = Duration::from_secs(120);

/// The point's figures from its requests' timings (with each prompt's
/// length in characters).
fn figures(point: SweepPoint, plan: &SweepPlan, timings: &[(Timing, usize)]) -> MeasuredPoint {
    let warmup = plan.warmup.as_secs_f64();
    let end = warmup + plan.duration.as_secs_f64();
    let done = |t: &Timing| t.last_token_s.map(|l| t.sent_s + l);
    let ok: Vec<&(Timing, usize)> = timings.iter().filter(|(t, _)| t.ok).collect();
    let finished_in = ok
        .iter()
        .filter(|(t, _)| done(t).is_some_and(|d| (warmup..end).contains(&d)))
        .count();
    // Requests sent after the warm-up: their latencies.
    let measured: Vec<&(Timing, usize)> = ok
        .iter()
        .copied()
        .filter(|(t, _)| t.sent_s >= warmup && t.sent_s < end)
        .collect();
    let n = measured.len().max(1) as f64;
    let mean =
        |f: &dyn Fn(&Timing, usize) -> f64| measured.iter().map(|(t, c)| f(t, *c)).sum::<f64>() / n;
    let mut ttfts: Vec<f64> = measured.iter().filter_map(|(t, _)| t.ttft_s).collect();
    let rate = finished_in as f64 / plan.duration.as_secs_f64();
    MeasuredPoint {
        concurrency: point.concurrency,
        prompt_words: point.prompt_words,
        prompt_tokens: mean(&|t, _| t.prompt_tokens as f64),
        prompt_chars: mean(&|_, chars| chars as f64),
        output_tokens: plan.output_tokens,
        requests: measured.len(),
        requests_per_s: rate,
        output_tokens_per_s: rate * f64::from(plan.output_tokens),
        ttft_p50_s: quantile(&mut ttfts, 0.5).unwrap_or(0.0),
        ttft_p99_s: quantile(&mut ttfts, 0.99).unwrap_or(0.0),
        itl_mean_s: mean(&|t, _| t.itl_mean_s.unwrap_or(0.0)),
        latency_mean_s: mean(&|t, _| t.last_token_s.unwrap_or(0.0)),
    }
}

/// The KV shape on the engine's page (`vllm:cache_config_info`'s labels);
/// `None` when the page has no such series.
async fn kv_shape(client: &reqwest::Client, metrics_url: &str) -> Result<Option<KvShape>, String> {
    let page = engine::page(client, metrics_url).await?;
    Ok(page.named("vllm:cache_config_info").find_map(|s| {
        let label = |k: &str| s.labels.get(k)?.parse::<u32>().ok();
        Some(KvShape {
            block_size: label("block_size")?,
            num_gpu_blocks: label("num_gpu_blocks")?,
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(sent_s: f64, ttft: f64, last: f64, ok: bool) -> (Timing, usize) {
        let t = Timing {
            sent_s,
            ttft_s: Some(ttft),
            itl_p95_s: Some(0.02),
            itl_mean_s: Some((last - ttft) / 63.0),
            last_token_s: Some(last),
            output_tokens: 64,
            prompt_tokens: 250,
            ok,
        };
        (t, 1500)
    }

    #[test]
    fn figures_count_what_finished_in_the_measured_time_and_time_what_was_sent_in_it() {
        let plan = SweepPlan {
            url: "http://e".into(),
            metrics_url: "http://e/metrics".into(),
            model: "m".into(),
            points: Vec::new(),
            output_tokens: 64,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(2),
            seed: 1,
        };
        let point = SweepPoint {
            concurrency: 2,
            prompt_words: 250,
        };
        let timings = vec![
            // Sent in the warm-up, finished in the measured time: counted
            // for throughput, not timed.
            timing(0.5, 0.1, 2.0, true),
            // Two measured requests.
            timing(3.0, 0.1, 1.36, true),
            timing(4.0, 0.3, 1.56, true),
            // Sent in time but finished after the end: timed, not counted.
            timing(11.5, 0.1, 1.0, true),
            // A failure is neither.
            timing(5.0, 0.1, 1.0, false),
        ];
        let p = figures(point, &plan, &timings);
        assert_eq!(p.requests, 3);
        assert!((p.requests_per_s - 0.3).abs() < 1e-9, "{p:?}");
        assert!((p.output_tokens_per_s - 19.2).abs() < 1e-9, "{p:?}");
        assert_eq!(p.ttft_p50_s, 0.1);
        assert_eq!(p.ttft_p99_s, 0.3);
        assert!((p.latency_mean_s - (1.36 + 1.56 + 1.0) / 3.0).abs() < 1e-9);
        assert!((p.prompt_tokens - 250.0).abs() < 1e-9);
        assert!((p.prompt_chars - 1500.0).abs() < 1e-9);
    }
}
