//! `sluicegate demo`: the simulator in-process with interactive waves, a
//! generated batch file run through a metric-driven gate with live
//! progress, then a report and an SVG chart. No network, no services.
//!
//! The interactive cost is measured against a twin: a second simulated
//! pool with the same seed and the same waves but no batch. Both get the
//! same probe requests at the same moments, so "TTFT p99 vs baseline" is
//! the same traffic with and without sluicegate's batch.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::batch::chart::{Series, render};
use crate::batch::{BatchOptions, GateWatch, run_batch};
use crate::queue::embedded::EmbeddedQueue;
use crate::sim::config::LoadMode;
use crate::sim::{SimConfig, spawn_http};

/// Flags of `sluicegate demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// A short run (~15 s) with a smaller batch, for tests.
    #[arg(long)]
    short: bool,
    /// Where the batch file, results, state and chart go (recreated).
    #[arg(long, default_value = "sluicegate-demo")]
    dir: PathBuf,
}

/// One chart sample: (seconds, batch done %, the pool gate's budget `D`
/// while it is the tighter gate).
type Sample = (f64, f64, Option<f64>);

/// Sizes of one demo run.
struct Plan {
    lines: usize,
    probe_every: Duration,
}

/// Probe TTFTs (ms) of the gated pool and its batch-free twin, by time.
#[derive(Default)]
struct Probes {
    pool: Vec<(f64, f64)>,
    twin: Vec<(f64, f64)>,
}

fn p99(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64) * 0.99).ceil() as usize;
    v.get(rank.saturating_sub(1).min(v.len() - 1)).copied()
}

fn sim_config(seed: u64) -> SimConfig {
    let mut cfg = SimConfig {
        replicas: 2,
        seed,
        time_scale: 1.0,
        ..SimConfig::default()
    };
    cfg.interactive.mode = LoadMode::Waves;
    cfg.interactive.waves_high_rate_per_replica = 14.0;
    cfg.interactive.waves_low_rate_per_replica = 2.0;
    cfg.interactive.waves_high_s = 8.0;
    cfg.interactive.waves_low_s = 8.0;
    cfg.interactive.max_tokens = 256;
    cfg
}

fn write_batch_file(path: &Path, lines: usize) -> std::io::Result<()> {
    let filler = "Summarise the quarterly report and list the three biggest risks. ".repeat(12);
    let mut out = String::new();
    for i in 0..lines {
        let line = serde_json::json!({
            "custom_id": format!("demo-{i}"),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim-model",
                "messages": [{"role": "user", "content": format!("Document {i}. {filler}")}],
                "max_tokens": 128
            }
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    std::fs::write(path, out)
}

/// Sends one tiny interactive request; its latency is the TTFT (one
/// output token).
async fn probe(client: &reqwest::Client, base: &str) -> Option<f64> {
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1
    });
    let start = Instant::now();
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .ok()?;
    let ok = r.status().is_success();
    let _ = r.bytes().await;
    ok.then(|| start.elapsed().as_secs_f64() * 1000.0)
}

/// Runs the demo.
pub(crate) async fn run(args: DemoArgs) -> ExitCode {
    crate::telemetry::logging::init(crate::config::LogFormat::Text, "warn");
    match demo(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("demo: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn demo(args: DemoArgs) -> Result<ExitCode, String> {
    let plan = if args.short {
        Plan {
            lines: 120,
            probe_every: Duration::from_millis(100),
        }
    } else {
        Plan {
            lines: 2400,
            probe_every: Duration::from_millis(100),
        }
    };
    let dir = args.dir;
    let state = dir.join("state");
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_batch_file(&input, plan.lines).map_err(|e| format!("{}: {e}", input.display()))?;

    let pool = spawn_http(sim_config(7)).await.map_err(|e| e.to_string())?;
    let twin = spawn_http(sim_config(7)).await.map_err(|e| e.to_string())?;
    let pool_url = pool.base_url();
    let twin_url = twin.base_url();
    eprintln!(
        "simulated pool (2 vLLM replicas, interactive waves) on {pool_url}; batch-free twin on {twin_url}"
    );
    eprintln!(
        "batch: {} chat completions in {}; gate: composite of vllm (on {pool_url}/metrics) and local-max-concurrency 16",
        plan.lines,
        input.display()
    );

    let started = Instant::now();
    let probes = Arc::new(Mutex::new(Probes::default()));
    let stop = CancellationToken::new();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| e.to_string())?;
    // The demo's helpers run on a task tree too, so a panic is named.
    let tasks = crate::app::Tasks::new();
    let prober = {
        let (probes, stop, client) = (probes.clone(), stop.clone(), client.clone());
        let (pool_url, twin_url) = (pool_url.clone(), twin_url.clone());
        let probe_tasks = tasks.clone();
        tasks.spawn("demo prober", async move {
            let mut tick = tokio::time::interval(plan.probe_every);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let (probes, client) = (probes.clone(), client.clone());
                let (pool_url, twin_url) = (pool_url.clone(), twin_url.clone());
                probe_tasks.spawn("demo probe", async move {
                    let t = started.elapsed().as_secs_f64();
                    let (a, b) = tokio::join!(probe(&client, &pool_url), probe(&client, &twin_url));
                    let mut p = probes.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(a) = a {
                        p.pool.push((t, a));
                    }
                    if let Some(b) = b {
                        p.twin.push((t, b));
                    }
                });
            }
        })
    };

    // A catalogue gate, built as `run` builds any queue's gate: the `vllm`
    // roofline over the pool's own /metrics (baseline 0.3 kept for the
    // interactive waves), capped by `local-max-concurrency` so the batch
    // never holds more than 16 requests at once (two replicas × 8).
    let gate = super::batch::gate_from_flags(
        "composite",
        &serde_json::json!({"gates": [
            {"gate_type": "vllm", "gate_params": {
                "urls": [format!("{pool_url}/metrics")],
                "baseline": 0.3,
            }},
            {"gate_type": "local-max-concurrency", "gate_params": {
                "limit": 16,
                "gating_mode": "blocking",
            }},
        ]})
        .to_string(),
    )?;
    let (watched, gate_stats) = GateWatch::new(gate);

    // Samples for the chart: (t, batch done %, budget D). D is charted
    // only while the pool gate (`vllm`) is the tighter one: when the local
    // limit binds, the composite's D is only its free share of 16 slots.
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let sampler = {
        let (samples, stop, stats) = (samples.clone(), stop.clone(), gate_stats.clone());
        let db = state.join("queue.db");
        let lines = plan.lines as f64;
        tasks.spawn("demo sampler", async move {
            let mut store: Option<EmbeddedQueue> = None;
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                if store.is_none() && db.exists() {
                    store = EmbeddedQueue::open(&db, "batch").ok();
                }
                let done = store
                    .as_ref()
                    .and_then(|s| s.result_count().ok())
                    .unwrap_or(0) as f64;
                let gate = stats.snapshot();
                samples.lock().unwrap_or_else(|e| e.into_inner()).push((
                    started.elapsed().as_secs_f64(),
                    100.0 * done / lines,
                    (!gate.local_limit).then_some(gate.budget),
                ));
            }
        })
    };

    let status = {
        let probes = probes.clone();
        Arc::new(move || {
            let p = probes.lock().unwrap_or_else(|e| e.into_inner());
            let now = started.elapsed().as_secs_f64();
            let recent =
                |v: &[(f64, f64)]| p99(v.iter().filter(|(t, _)| now - t < 10.0).map(|(_, x)| *x));
            match (recent(&p.pool), recent(&p.twin)) {
                (Some(a), Some(b)) => {
                    format!("interactive TTFT p99 (10 s) {a:.0} ms vs {b:.0} ms baseline")
                }
                _ => "interactive TTFT: measuring".to_owned(),
            }
        }) as crate::batch::StatusHook
    };

    let mut options = BatchOptions::new(input.clone(), output.clone(), pool_url.clone());
    options.state = Some(state.clone());
    options.max_in_flight = 48.0;
    options.poll_interval = Duration::from_millis(200);
    let shutdown = CancellationToken::new();
    super::spawn_signal_handler(shutdown.clone());
    let result = run_batch(&options, Box::new(watched), Some(status), shutdown).await;
    stop.cancel();
    let _ = prober.await;
    let _ = sampler.await;
    tasks.stop().await;
    let (summary, _) = result.map_err(|e| e.to_string())?;
    let elapsed = started.elapsed().as_secs_f64();
    let _ = pool.shutdown().await;
    let _ = twin.shutdown().await;

    let probes = probes.lock().unwrap_or_else(|e| e.into_inner());
    let with_batch = p99(probes.pool.iter().map(|(_, x)| *x));
    let baseline = p99(probes.twin.iter().map(|(_, x)| *x));
    let samples = samples.lock().unwrap_or_else(|e| e.into_inner());
    // Rolling p99 over the last 3 s at each sample: raw probes are noise.
    let rolling = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        samples
            .iter()
            .filter_map(|(t, _, _)| {
                p99(v
                    .iter()
                    .filter(|(at, _)| at <= t && t - at < 3.0)
                    .map(|(_, x)| *x))
                .map(|x| (*t, x))
            })
            .collect()
    };
    let (pool_ttft, twin_ttft) = (rolling(&probes.pool), rolling(&probes.twin));
    let ttft_top = pool_ttft
        .iter()
        .chain(twin_ttft.iter())
        .map(|(_, x)| *x)
        .fold(10.0_f64, f64::max)
        .ceil();
    let chart = render(
        "sluicegate demo: batch through a metric-driven gate beside interactive waves",
        "seconds",
        elapsed,
        &[
            Series {
                label: "batch done, %".into(),
                color: "#1f77b4".into(),
                points: samples.iter().map(|(t, d, _)| (*t, *d)).collect(),
                y_max: 100.0,
                dashed: false,
            },
            Series {
                label: "gate budget D".into(),
                color: "#2ca02c".into(),
                points: samples
                    .iter()
                    .filter_map(|(t, _, b)| b.map(|b| (*t, b)))
                    .collect(),
                y_max: 1.0,
                dashed: false,
            },
            Series {
                label: "interactive TTFT p99 (3 s), ms, with batch".into(),
                color: "#d62728".into(),
                points: pool_ttft,
                y_max: ttft_top,
                dashed: false,
            },
            Series {
                label: "same, twin pool without batch (baseline)".into(),
                color: "#7f7f7f".into(),
                points: twin_ttft,
                y_max: ttft_top,
                dashed: true,
            },
        ],
    );
    let svg = dir.join("demo.svg");
    std::fs::write(&svg, chart).map_err(|e| format!("{}: {e}", svg.display()))?;

    eprintln!("{summary}");
    println!("demo report");
    // "Held back" is the pool gate, its source or a congestion hold; a
    // full window (16 in flight) is the batch running at its limit.
    println!(
        "  batch: {}/{} lines completed in {:.1} s; held back by the gate {:.1} s, window full (16 in flight) {:.1} s",
        summary.completed,
        summary.lines,
        summary.elapsed.as_secs_f64(),
        summary.states.held_back().as_secs_f64(),
        summary.states.window_full.as_secs_f64()
    );
    match (with_batch, baseline) {
        (Some(a), Some(b)) => println!(
            "  interactive TTFT p99: {a:.0} ms with the batch vs {b:.0} ms baseline (same waves, no batch); {} probes each",
            probes.pool.len().min(probes.twin.len())
        ),
        _ => println!("  interactive TTFT: no probe answered"),
    }
    println!("  results: {}", output.display());
    println!("  chart:   {}", svg.display());
    Ok(if summary.interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}
