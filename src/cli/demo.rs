//! `sluicegate demo`: the simulator in-process with interactive waves, a
//! generated batch file run through the `feedback` gate (the best gate in
//! `sluicegate eval`'s table, `docs/gate-quality.md`) with live progress,
//! then a report and an SVG chart. No network, no services.
//!
//! The interactive cost is measured against a twin: a second simulated
//! pool with the same seed and the same waves but no batch. Both pools
//! record the waves' own interactive requests (the load generator's, the
//! traffic the batch could hurt); the same seed draws the same requests at
//! the same moments, so pairing them by arrival makes "TTFT p99 vs the
//! twin" (`ρ`) the same traffic with and without sluicegate's batch.

mod ttft;

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
use crate::sim::{SimConfig, SimHandle, spawn_http};
use ttft::{PairedTtft, rolling_p99};

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
    /// submitted so far (the waves; batch not counted).
    arrivals: u64,
    /// Batch requests in flight (sent, not answered).
    in_flight: u64,
    /// The gate's budget `D` (for `feedback`, its window as a fraction of
    /// `MAX_IN_FLIGHT`) and baseline `B` (`None` when its source did not
    /// answer).
    budget: Option<(f64, f64)>,
}

/// Over how long the live status and the chart take TTFT p99 (seconds of
/// arrivals).
const STATUS_SPAN_S: f64 = 10.0;
const CHART_SPAN_S: f64 = 3.0;

/// How long the report waits after the batch for the last requests of
/// the window to get their first token (else they count with their wait).
const SETTLE: Duration = Duration::from_secs(10);

/// The waves' requests of both pools, paired over arrivals in `[from, to]`
/// (simulated seconds).
fn paired(pool: &SimHandle, twin: &SimHandle, from: f64, to: f64) -> PairedTtft {
    let (pool_now, pool_t) = pool.interactive_timings();
    let (twin_now, twin_t) = twin.interactive_timings();
    PairedTtft::of((pool_now, &pool_t), (twin_now, &twin_t), from, to)
}

fn sim_config(seed: u64) -> SimConfig {
    let mut cfg = SimConfig {
        replicas: 2,
        seed,
        time_scale: 1.0,
        ..SimConfig::default()
    };
    cfg.interactive.mode = LoadMode::Waves;
    // The engine was calibrated 1/0.69 times faster (docs/simulator.md);
    // the waves were 14 and 2 requests/s on the first constants, so they
    // scale with it to still fill the pool at their crest.
    cfg.interactive.waves_high_rate_per_replica = 20.0;
    cfg.interactive.waves_low_rate_per_replica = 3.0;
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
            title: format!(
                "interactive TTFT p99 of the waves' requests (arrivals over the last {CHART_SPAN_S:.0} s)"
            ),
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

/// Runs the demo.
pub(crate) async fn run(args: DemoArgs) -> ExitCode {
    crate::telemetry::logging::init(crate::telemetry::LogFormat::Text, "warn");
    match demo(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("demo: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn demo(args: DemoArgs) -> Result<ExitCode, String> {
    let lines = if args.short { 60 } else { 300 };
    let dir = args.dir;
    let state = dir.join("state");
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_batch_file(&input, lines).map_err(|e| format!("{}: {e}", input.display()))?;

    let pool = Arc::new(spawn_http(sim_config(7)).await.map_err(|e| e.to_string())?);
    let twin = Arc::new(spawn_http(sim_config(7)).await.map_err(|e| e.to_string())?);
    // Recording starts a moment apart; pairing by arrival index keeps
    // only requests both pools saw.
    pool.record_interactive();
    twin.record_interactive();
    let pool_url = pool.base_url();
    eprintln!(
        "simulated pool (2 vLLM replicas, interactive waves) on {pool_url}; batch-free twin (same seed and waves) on {}",
        twin.base_url()
    );

    let started = Instant::now();
    // The pool's simulated time at `started`: the chart's time zero.
    let sim_zero = pool.sim_time();
    let stop = CancellationToken::new();
    // The demo's helpers run on a task tree too, so a panic is named.
    let tasks = crate::tasks::Tasks::new();

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
        "batch: {lines} chat completions in {}; gate: feedback {params}, max_sys {MAX_IN_FLIGHT:.0}{}{}",
        input.display(),
        if notes.is_empty() { "" } else { "; " },
        notes.join("; ")
    );
    let (watched, gate_stats) = GateWatch::new(gate);

    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
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
        let (pool, twin) = (pool.clone(), twin.clone());
        Arc::new(move || {
            let now = pool.sim_time();
            match paired(&pool, &twin, now - STATUS_SPAN_S, now).p99() {
                Some((a, b)) => format!(
                    "interactive TTFT p99 ({STATUS_SPAN_S:.0} s) {:.0} ms vs {:.0} ms on the twin",
                    a * 1000.0,
                    b * 1000.0
                ),
                None => "interactive TTFT: measuring".to_owned(),
            }
        }) as crate::batch::StatusHook
    };

    let mut options = BatchOptions::new(input.clone(), output.clone(), pool_url.clone());
    options.state = Some(state.clone());
    options.max_in_flight = MAX_IN_FLIGHT;
    options.poll_interval = Duration::from_millis(200);
    let shutdown = CancellationToken::new();
    super::spawn_signal_handler(shutdown.clone());
    let batch_from = pool.sim_time();
    let result = run_batch(&options, Box::new(watched), Some(status), shutdown).await;
    let batch_to = pool.sim_time();
    stop.cancel();
    let _ = sampler.await;
    tasks.stop().await;
    let (summary, _) = result.map_err(|e| e.to_string())?;

    // The interactive requests that arrived while the batch ran: wait
    // (bounded) for the last of them to get a first token on both pools.
    let settle_until = Instant::now() + SETTLE;
    let mut cost = paired(&pool, &twin, batch_from, batch_to);
    while !cost.settled() && Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cost = paired(&pool, &twin, batch_from, batch_to);
    }
    // The sampler and the status hook have ended, so these are the last
    // handles on the pools.
    for sim in [pool, twin] {
        if let Ok(sim) = Arc::try_unwrap(sim) {
            let _ = sim.shutdown().await;
        }
    }

    let samples = samples.lock().unwrap_or_else(|e| e.into_inner());
    let elapsed = summary.elapsed.as_secs_f64().max(1e-9);
    let harvest = Harvest {
        tokens_per_s: summary.completion_tokens as f64 / elapsed,
        requests_per_s: summary.completed as f64 / elapsed,
    };
    let rho = cost.rho();
    // Chart times are seconds since `started`; TTFTs in ms.
    let on_chart = |v: &[(f64, f64)]| -> Vec<(f64, f64)> {
        v.iter()
            .map(|(arrival, ttft)| (arrival - sim_zero, ttft * 1000.0))
            .collect()
    };
    let at: Vec<f64> = samples.iter().map(|s| s.t).collect();
    // Short enough for the chart's 1000 px width at its title size.
    let title = format!(
        "sluicegate demo (feedback): {}; {}",
        harvest.label(),
        rho.map_or_else(
            || "rho n/a".to_owned(),
            |r| format!("rho {r:.2} (TTFT p99 / twin)")
        )
    );
    let chart = render_svg(
        &title,
        "seconds since start",
        &demo_panels(
            &samples,
            rolling_p99(&on_chart(&cost.pool), &at, CHART_SPAN_S),
            rolling_p99(&on_chart(&cost.twin), &at, CHART_SPAN_S),
        ),
    )
    .map_err(|e| format!("chart: {e}"))?;
    let svg = dir.join("demo.svg");
    std::fs::write(&svg, chart).map_err(|e| format!("{}: {e}", svg.display()))?;

    eprintln!("{summary}");
    println!("demo report");
    // "Held back" is the gate (including an open gate whose window allows
    // no request), its source or a congestion hold; a full window is the
    // batch running at what the gate allows.
    println!(
        "  batch harvest: {}/{} lines completed in {elapsed:.1} s beside the interactive waves; H = {:.0} batch output tokens/s ({:.1} requests/s); held back by the gate {:.1} s, window full {:.1} s",
        summary.completed,
        summary.lines,
        harvest.tokens_per_s,
        harvest.requests_per_s,
        summary.states.held_back().as_secs_f64(),
        summary.states.window_full.as_secs_f64()
    );
    match (cost.p99(), rho) {
        (Some((a, b)), Some(r)) => println!(
            "  interactive TTFT p99: {:.0} ms with the batch vs {:.0} ms on the batch-free twin (rho {r:.2}); the waves' own {} requests that arrived while the batch ran, paired by arrival{}",
            a * 1000.0,
            b * 1000.0,
            cost.requests,
            cost.caveats()
        ),
        _ => println!("  interactive TTFT: no wave request arrived while the batch ran"),
    }
    println!("  results: {}", output.display());
    println!("  chart:   {}", svg.display());
    Ok(if summary.interrupted {
        ExitCode::from(130)
    } else {
        ExitCode::SUCCESS
    })
}

/// `H` as the demo defines it: the batch's completion (output) tokens and
/// completed requests per second of the run.
struct Harvest {
    tokens_per_s: f64,
    requests_per_s: f64,
}

impl Harvest {
    fn label(&self) -> String {
        format!(
            "H {:.0} batch tokens/s, {:.1} req/s",
            self.tokens_per_s, self.requests_per_s
        )
    }
}
