//! `sluicegate demo`: the simulator in-process with interactive waves, a
//! generated batch file run through the `feedback` gate (the best gate in
//! `sluicegate eval`'s table, `docs/gate-quality.md`) with live progress,
//! then a report and an SVG chart. No network, no services.
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

use crate::batch::{BatchOptions, GateWatch, run_batch};
use crate::chart::{Line, LineStyle, Panel, render_svg};
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

/// The feedback window's growth per clean reading (requests).
const DEMO_INCREASE: f64 = 3.0;

/// The batch queue's `max_sys`: the most batch requests the gate may
/// ever allow in flight (its window is a fraction of it).
const MAX_IN_FLIGHT: f64 = 48.0;

/// Over how long the interactive arrival rate is averaged on the chart:
/// a quarter of a wave phase, so the waves stay square but Poisson noise
/// is smoothed.
const RATE_SPAN_S: f64 = 2.0;

/// One chart sample, taken every 250 ms.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the demo started.
    t: f64,
    /// Interactive requests the simulated pool's load generator has
    /// submitted so far (the waves; probes and batch not counted).
    arrivals: u64,
    /// Batch requests in flight (sent, not answered).
    in_flight: u64,
    /// The gate's budget `D` (for `feedback`, its window as a fraction of
    /// `MAX_IN_FLIGHT`) and baseline `B` (`None` when its source did not
    /// answer).
    budget: Option<(f64, f64)>,
}

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

/// The chart's panels: interactive load, its TTFT with the batch and
/// without (the twin), batch in flight, and the gate's `D` and `B`.
fn demo_panels(
    samples: &[Sample],
    pool_ttft: Vec<(f64, f64)>,
    twin_ttft: Vec<(f64, f64)>,
) -> Vec<Panel> {
    // Arrival rate over the last RATE_SPAN_S at each sample (from the
    // first sample at least that old).
    let rate: Vec<(f64, f64)> = samples
        .iter()
        .filter_map(|s| {
            let from = samples.iter().rev().find(|o| s.t - o.t >= RATE_SPAN_S)?;
            let n = s.arrivals.saturating_sub(from.arrivals) as f64;
            Some((s.t, n / (s.t - from.t)))
        })
        .collect();
    let grey = LineStyle::dashed().with_color(90, 90, 90);
    let budget = |pick: fn((f64, f64)) -> f64| -> Vec<(f64, f64)> {
        samples
            .iter()
            .filter_map(|s| s.budget.map(|b| (s.t, pick(b))))
            .collect()
    };
    let t_end = samples.last().map_or(0.0, |s| s.t);
    vec![
        Panel {
            title: "interactive load on the pool (waves)".into(),
            y_label: "arrivals / s".into(),
            lines: vec![Line::new(
                format!("interactive arrivals ({RATE_SPAN_S:.0} s average)"),
                rate,
                LineStyle::solid(),
            )],
            y_range: None,
        },
        Panel {
            title: "interactive TTFT p99 (rolling 3 s)".into(),
            y_label: "ms".into(),
            lines: vec![
                Line::new(
                    "with batch",
                    pool_ttft,
                    LineStyle::solid().with_color(214, 39, 40),
                ),
                Line::new("twin pool without batch (baseline)", twin_ttft, grey),
            ],
            y_range: None,
        },
        Panel {
            title: "batch requests in flight".into(),
            y_label: "requests".into(),
            lines: vec![
                Line::new(
                    "in flight",
                    samples.iter().map(|s| (s.t, s.in_flight as f64)).collect(),
                    LineStyle::solid(),
                ),
                Line::new(
                    "gate window",
                    budget(|(d, b)| (d - b).max(0.0) * MAX_IN_FLIGHT),
                    grey,
                ),
                Line::new(
                    format!("max_sys ({MAX_IN_FLIGHT:.0})"),
                    vec![(0.0, MAX_IN_FLIGHT), (t_end, MAX_IN_FLIGHT)],
                    LineStyle::dashed().with_color(180, 180, 180),
                ),
            ],
            y_range: None,
        },
        Panel {
            title: "gate (feedback): budget D = window / max_sys, baseline B".into(),
            y_label: "fraction of max_sys".into(),
            lines: vec![
                Line::new(
                    "budget D",
                    budget(|(d, _)| d),
                    LineStyle::solid().with_color(44, 160, 44),
                ),
                Line::new("baseline B", budget(|(_, b)| b), grey),
            ],
            y_range: Some((0.0, 1.0)),
        },
    ]
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
            lines: 60,
            probe_every: Duration::from_millis(100),
        }
    } else {
        Plan {
            lines: 300,
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

    // A catalogue gate, built as `run` builds any queue's gate:
    // `feedback` on the pool's own /metrics grows its batch window while
    // the interactive SLO has margin and nothing waits, and cuts it when
    // a wave arrives. Defaults except the growth step: the demo's waves
    // last 8 s, not minutes, so the window must climb faster to use them.
    let params = serde_json::json!({
        "urls": [format!("{pool_url}/metrics")],
        "increase": DEMO_INCREASE,
    })
    .to_string();
    let gate = super::batch::gate_from_flags("feedback", &params, MAX_IN_FLIGHT)?;
    // The parameters the gate really runs with, from a twin built the same
    // way (explaining reads the pool, which would move the real gate's
    // history).
    let notes = super::batch::gate_from_flags("feedback", &params, MAX_IN_FLIGHT)?
        .explain()
        .await
        .notes;
    eprintln!(
        "batch: {} chat completions in {}; gate: feedback {params}, max_sys {MAX_IN_FLIGHT:.0}{}{}",
        plan.lines,
        input.display(),
        if notes.is_empty() { "" } else { "; " },
        notes.join("; ")
    );
    let (watched, gate_stats) = GateWatch::new(gate);

    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let pool = Arc::new(pool);
    let sampler = {
        let (samples, stop, stats) = (samples.clone(), stop.clone(), gate_stats.clone());
        let pool = pool.clone();
        tasks.spawn("demo sampler", async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                let gate = stats.snapshot();
                let sample = Sample {
                    t: started.elapsed().as_secs_f64(),
                    arrivals: pool.interactive_arrivals(),
                    in_flight: gate.in_flight,
                    budget: gate
                        .source_available
                        .then_some((gate.budget, gate.baseline)),
                };
                samples
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sample);
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
    options.max_in_flight = MAX_IN_FLIGHT;
    options.poll_interval = Duration::from_millis(200);
    let shutdown = CancellationToken::new();
    super::spawn_signal_handler(shutdown.clone());
    let result = run_batch(&options, Box::new(watched), Some(status), shutdown).await;
    stop.cancel();
    let _ = prober.await;
    let _ = sampler.await;
    tasks.stop().await;
    let (summary, _) = result.map_err(|e| e.to_string())?;
    // The sampler has ended, so this is the last handle on the pool.
    if let Ok(pool) = Arc::try_unwrap(pool) {
        let _ = pool.shutdown().await;
    }
    let _ = twin.shutdown().await;

    let probes = probes.lock().unwrap_or_else(|e| e.into_inner());
    let with_batch = p99(probes.pool.iter().map(|(_, x)| *x));
    let baseline = p99(probes.twin.iter().map(|(_, x)| *x));
    let samples = samples.lock().unwrap_or_else(|e| e.into_inner());
    // Rolling p99 over the last 3 s at each sample: raw probes are noise.
    let rolling = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        samples
            .iter()
            .filter_map(|s| {
                p99(v
                    .iter()
                    .filter(|(at, _)| *at <= s.t && s.t - at < 3.0)
                    .map(|(_, x)| *x))
                .map(|x| (s.t, x))
            })
            .collect()
    };
    let chart = render_svg(
        "sluicegate demo: batch through the feedback gate beside interactive waves",
        "seconds since start",
        &demo_panels(&samples, rolling(&probes.pool), rolling(&probes.twin)),
    )
    .map_err(|e| format!("chart: {e}"))?;
    let svg = dir.join("demo.svg");
    std::fs::write(&svg, chart).map_err(|e| format!("{}: {e}", svg.display()))?;

    eprintln!("{summary}");
    println!("demo report");
    // "Held back" is the gate, its source or a congestion hold; a full
    // window is the batch running at what the gate allows.
    let elapsed = summary.elapsed.as_secs_f64();
    println!(
        "  batch harvest: {}/{} lines completed in {elapsed:.1} s ({:.1} requests/s beside the interactive waves); held back by the gate {:.1} s, window full {:.1} s",
        summary.completed,
        summary.lines,
        summary.completed as f64 / elapsed.max(1e-9),
        summary.states.held_back().as_secs_f64(),
        summary.states.window_full.as_secs_f64()
    );
    match (with_batch, baseline) {
        (Some(a), Some(b)) => println!(
            "  interactive TTFT p99: {a:.0} ms with the batch vs {b:.0} ms on the batch-free twin (rho {:.2}; same waves); {} probes each",
            a / b.max(1e-9),
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
