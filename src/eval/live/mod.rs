//! `sluicegate eval --live URL`: gate quality on a real engine, in real
//! time. Each repeat first runs the interactive traffic alone (the
//! baseline), then once per contender with the batch sent through the
//! production batch runner ([`crate::batch::run_batch`]) and the
//! contender's gate, with the same seeded arrivals; every run is scored
//! against the baseline of its repeat as `eval` scores (`ΔV`, `ρ`, harvest).
//!
//! Controls for a shared machine (docs/real-engine.md): a warm-up before
//! the first run; the engine idle before each run; the batch imported and
//! started before the interactive traffic; the CPU time of the engine's
//! processes and of this one reported per run, so a starved API server
//! shows.
//!
//! # Layout
//! - [`traffic`]: arrivals, prompts, the batch file, one timed request.
//! - [`figures`]: the scoring, pure.
//! - [`engine`]: the engine's page and the processes' CPU time.

pub mod engine;
pub mod figures;
pub mod sweep;
pub mod traffic;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::figures::{LiveScore, RunFigures, Summary, Timing};
pub use self::traffic::LiveShape;
use crate::batch::{BatchOptions, build_gate_for_batch, run_batch};
use crate::eval::{NamedSpec, Slo};
use crate::gate::control::Histogram;

/// A contender of the live eval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum LiveContender {
    /// The batch with nothing but `max_sys` in its way.
    Ungated,
    /// A fixed number of batch requests in flight.
    StaticCap(u32),
    /// A gate reading the engine's page, with its default parameters.
    Gate(String),
    /// A gate with parameters of its own (`--gate-spec NAME=JSON`); for the
    /// gates that read the engine's page, `urls`, `ttft_slo` and `itl_slo`
    /// default to that page and the eval's SLO where the gate takes them.
    Spec {
        /// Its name in reports.
        name: String,
        /// The gate type.
        gate_type: String,
        /// Its parameters as given.
        params: serde_json::Value,
    },
}

/// Gates that read an engine's own page and need nothing else.
const PAGE_GATES: &[&str] = &["feedback", "slo-headroom", "vllm"];

/// Gates that hold an interactive SLO (`ttft_slo`, `itl_slo`).
const SLO_GATES: &[&str] = &["feedback", "slo-headroom"];

impl LiveContender {
    /// By name: `ungated`, `static-cap-N`, or a gate that reads the
    /// engine's page (`feedback`, `slo-headroom`, `vllm`).
    pub fn parse(name: &str) -> Result<Self, String> {
        if name == "ungated" {
            return Ok(Self::Ungated);
        }
        if let Some(n) = name.strip_prefix("static-cap-") {
            return match n.parse::<u32>() {
                Ok(n) if n > 0 => Ok(Self::StaticCap(n)),
                _ => Err(format!("{name}: a static cap is static-cap-N with N >= 1")),
            };
        }
        if PAGE_GATES.contains(&name) {
            return Ok(Self::Gate(name.to_owned()));
        }
        Err(format!(
            "unknown live contender {name:?}; allowed: ungated, static-cap-N, {}",
            PAGE_GATES.join(", ")
        ))
    }

    /// From `NAME={"gate_type": "...", "gate_params": {...}}`.
    pub fn spec(arg: &str) -> Result<Self, String> {
        let NamedSpec {
            name,
            gate_type,
            params,
        } = NamedSpec::parse(arg)?;
        Ok(Self::Spec {
            name,
            gate_type,
            params,
        })
    }

    /// Its name in reports.
    pub fn name(&self) -> String {
        match self {
            Self::Ungated => "ungated".to_owned(),
            Self::StaticCap(n) => format!("static-cap-{n}"),
            Self::Gate(g) => g.clone(),
            Self::Spec { name, .. } => name.clone(),
        }
    }

    /// The batch runner's gate type, parameters and `max_SYS`: a static cap
    /// of N is the constant gate with a window of N; the gates that hold an
    /// SLO hold the eval's.
    fn batch_gate(
        &self,
        metrics_url: &str,
        max_sys: u32,
        slo: Slo,
    ) -> (String, serde_json::Value, u32) {
        match self {
            Self::Ungated => ("constant".into(), json!({}), max_sys),
            Self::StaticCap(n) => ("constant".into(), json!({}), *n),
            Self::Gate(g) if g == "vllm" => (
                g.clone(),
                json!({"urls": [metrics_url], "max_num_seqs": max_sys}),
                max_sys,
            ),
            Self::Gate(g) => (
                g.clone(),
                json!({"urls": [metrics_url], "ttft_slo": slo.ttft_s, "itl_slo": slo.itl_s}),
                max_sys,
            ),
            Self::Spec {
                gate_type, params, ..
            } => {
                let mut params = params.clone();
                if let Some(map) = params.as_object_mut() {
                    if PAGE_GATES.contains(&gate_type.as_str()) {
                        map.entry("urls").or_insert_with(|| json!([metrics_url]));
                    }
                    if SLO_GATES.contains(&gate_type.as_str()) {
                        map.entry("ttft_slo").or_insert_with(|| json!(slo.ttft_s));
                        map.entry("itl_slo").or_insert_with(|| json!(slo.itl_s));
                    }
                }
                (gate_type.clone(), params, max_sys)
            }
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LiveOptions {
    /// The engine's (or gateway's) base URL: interactive and batch requests
    /// go to `<url>/v1/completions`.
    pub url: String,
    /// The engine's `/metrics`.
    pub metrics_url: String,
    /// The model to ask for.
    pub model: String,
    /// The interactive load's shape.
    pub shape: LiveShape,
    /// Interactive requests per second (mean).
    pub rate: f64,
    /// Length of each scored run.
    pub duration: Duration,
    /// Unscored interactive traffic before the first run.
    pub warmup: Duration,
    /// Repeats (each with its own seed: `seed + repeat`).
    pub repeats: usize,
    /// The first repeat's seed.
    pub seed: u64,
    /// The contenders (the baseline runs anyway).
    pub contenders: Vec<LiveContender>,
    /// `max_SYS` of the gates: the engine's `--max-num-seqs`.
    pub max_sys: u32,
    /// Words per prompt (about one token each).
    pub prompt_words: usize,
    /// Output tokens of an interactive request.
    pub output_tokens: u32,
    /// Output tokens of a batch request.
    pub batch_output_tokens: u32,
    /// The interactive SLO.
    pub slo: Slo,
    /// The engine's API server process, whose tree's CPU time is reported.
    pub engine_pid: Option<u32>,
    /// Scratch space for the batch runs' state.
    pub work_dir: PathBuf,
}

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct LiveRun {
    /// Repeat number (0-based).
    pub repeat: usize,
    /// `baseline` or the contender's name.
    pub contender: String,
    /// Seconds from the first arrival to the last answer.
    pub elapsed_s: f64,
    /// The client's figures.
    pub interactive: RunFigures,
    /// The engine's own TTFT histogram over the run: p50 and p99 as bucket
    /// edges.
    pub engine_ttft_p50_s: Option<f64>,
    /// See `engine_ttft_p50_s`.
    pub engine_ttft_p99_s: Option<f64>,
    /// Interactive output tokens per second.
    pub interactive_tokens_per_s: f64,
    /// Batch output tokens per second (the engine's generated tokens less
    /// the interactive ones).
    pub batch_tokens_per_s: f64,
    /// CPU seconds per process over the run (`name[pid]`), this one first.
    pub cpu_s: Vec<(String, f64)>,
    /// Second by second: interactive sent, interactive violations by send
    /// second, engine running, engine waiting, tokens generated.
    pub timeline: Vec<TimelineRow>,
}

/// One second of a run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TimelineRow {
    /// Second of the run.
    pub second: u32,
    /// Interactive requests sent in it.
    pub sent: u32,
    /// Of those, SLO violations.
    pub violations: u32,
    /// The engine's running requests at its end.
    pub running: f64,
    /// The engine's waiting requests at its end.
    pub waiting: f64,
    /// Tokens the engine generated in it.
    pub tokens: f64,
}

/// A contender's results.
#[derive(Debug, Clone, Serialize)]
pub struct LiveContenderReport {
    /// Its name.
    pub contender: String,
    /// One score per repeat.
    pub scores: Vec<LiveScore>,
    /// Over the repeats.
    pub summary: Summary,
}

/// The whole evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct LiveReport {
    /// The shape run.
    pub shape: LiveShape,
    /// Interactive requests per second.
    pub rate: f64,
    /// Seconds per run.
    pub duration_s: f64,
    /// The SLO every run is scored against.
    pub slo: Slo,
    /// The baselines' figures, one per repeat (their own spread is the
    /// noise every ratio sits in).
    pub baselines: Vec<RunFigures>,
    /// Per contender.
    pub contenders: Vec<LiveContenderReport>,
    /// Every run, in order.
    pub runs: Vec<LiveRun>,
}

/// Runs the live evaluation; `progress` hears what starts.
pub async fn evaluate(
    options: &LiveOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<LiveReport, String> {
    let client = engine::client()?;
    engine::read(&client, &options.metrics_url).await?;
    if !options.warmup.is_zero() {
        progress("warm-up");
        let arrivals = traffic::arrivals(
            LiveShape::Steady,
            options.rate,
            options.warmup.as_secs_f64(),
            !options.seed,
        );
        interactive(&client, options, &arrivals, u64::MAX).await;
    }
    let mut runs = Vec::new();
    for repeat in 0..options.repeats {
        let seed = options.seed + repeat as u64;
        let arrivals = traffic::arrivals(
            options.shape,
            options.rate,
            options.duration.as_secs_f64(),
            seed,
        );
        progress(&format!(
            "repeat {} baseline ({} requests)",
            repeat + 1,
            arrivals.len()
        ));
        runs.push(one_run(&client, options, repeat, None, &arrivals, seed).await?);
        for contender in &options.contenders {
            progress(&format!("repeat {} {}", repeat + 1, contender.name()));
            runs.push(one_run(&client, options, repeat, Some(contender), &arrivals, seed).await?);
        }
    }
    Ok(report(options, runs))
}

/// Scores the runs against the baseline of their repeat.
fn report(options: &LiveOptions, runs: Vec<LiveRun>) -> LiveReport {
    let of = |repeat: usize, name: &str| {
        runs.iter()
            .find(|r| r.repeat == repeat && r.contender == name)
    };
    let baselines: Vec<RunFigures> = (0..options.repeats)
        .filter_map(|r| of(r, "baseline").map(|b| b.interactive))
        .collect();
    let contenders = (options.contenders.iter())
        .map(|c| {
            let name = c.name();
            let scores: Vec<LiveScore> = (0..options.repeats)
                .filter_map(|r| {
                    let base = of(r, "baseline")?;
                    let run = of(r, &name)?;
                    // The slack: what the engine served ungated in this
                    // repeat, less the interactive rate it serves alone.
                    let slack = of(r, "ungated").map(|u| {
                        u.batch_tokens_per_s + u.interactive_tokens_per_s
                            - base.interactive_tokens_per_s
                    });
                    Some(figures::score(
                        &base.interactive,
                        &run.interactive,
                        run.batch_tokens_per_s,
                        slack,
                    ))
                })
                .collect();
            let summary = Summary::of(&scores, options.slo);
            LiveContenderReport {
                contender: name,
                scores,
                summary,
            }
        })
        .collect();
    LiveReport {
        shape: options.shape,
        rate: options.rate,
        duration_s: options.duration.as_secs_f64(),
        slo: options.slo,
        baselines,
        contenders,
        runs,
    }
}

/// How long an interactive request may take before it counts as failed.
const GIVE_UP: Duration = Duration::from_secs(60);

/// One run: the batch (if any) started first, then the interactive
/// arrivals, then the batch stopped and the engine left idle.
async fn one_run(
    client: &reqwest::Client,
    options: &LiveOptions,
    repeat: usize,
    contender: Option<&LiveContender>,
    arrivals: &[f64],
    seed: u64,
) -> Result<LiveRun, String> {
    engine::wait_idle(client, &options.metrics_url, Duration::from_secs(120)).await?;
    let name = contender.map_or_else(|| "baseline".to_owned(), LiveContender::name);
    let stop = CancellationToken::new();
    let batch = match contender {
        Some(c) => Some(start_batch(client, options, c, repeat, seed, stop.clone()).await?),
        None => None,
    };
    let pids = processes(options.engine_pid);
    let cpu_before: Vec<Option<f64>> = pids.iter().map(|p| engine::cpu_seconds(*p)).collect();
    let before = engine::read(client, &options.metrics_url).await?;
    let start = Instant::now();
    let sampler = tokio::spawn(sample(
        client.clone(),
        options.metrics_url.clone(),
        start,
        stop.clone(),
    ));
    let timings = interactive(client, options, arrivals, seed).await;
    let elapsed_s = start.elapsed().as_secs_f64();
    let after = engine::read(client, &options.metrics_url).await?;
    stop.cancel();
    let samples = sampler.await.unwrap_or_default();
    if let Some((task, dir)) = batch {
        let _ = tokio::time::timeout(Duration::from_secs(120), task).await;
        let _ = std::fs::remove_dir_all(dir);
    }
    let cpu_s = (pids.iter().zip(&cpu_before))
        .filter_map(|(pid, was)| {
            let used = engine::cpu_seconds(*pid)? - (*was)?;
            Some((format!("{}[{pid}]", engine::process_name(*pid)), used))
        })
        .collect();
    let interactive_tokens: u64 = timings.iter().map(|t| t.output_tokens).sum();
    let generated = after.generation_tokens - before.generation_tokens;
    // The engine's own TTFT histogram over the run, read as the gates read
    // it (`None` if the engine restarted meanwhile).
    let all = std::collections::BTreeMap::new();
    let ttft = Histogram::select(&after.ttft, &all)
        .zip(Histogram::select(&before.ttft, &all))
        .and_then(|(after, before)| after.since(&before));
    Ok(LiveRun {
        repeat,
        contender: name,
        elapsed_s,
        interactive: RunFigures::of(&timings, options.slo, GIVE_UP.as_secs_f64()),
        engine_ttft_p50_s: ttft.as_ref().and_then(|h| h.quantile(0.50)),
        engine_ttft_p99_s: ttft.as_ref().and_then(|h| h.quantile(0.99)),
        interactive_tokens_per_s: interactive_tokens as f64 / elapsed_s,
        batch_tokens_per_s: (generated - interactive_tokens as f64).max(0.0) / elapsed_s,
        cpu_s,
        timeline: timeline(&timings, &samples, options.slo),
    })
}

/// This process first, then the engine's process tree.
fn processes(engine_pid: Option<u32>) -> Vec<u32> {
    let mut pids = vec![std::process::id()];
    pids.extend(engine_pid.map(engine::process_tree).unwrap_or_default());
    pids
}

/// Starts the batch runner on a fresh file of enough lines that it never
/// runs dry, and returns once it has requests at the engine (or, for a gate
/// that stays shut, after 10 s).
async fn start_batch(
    client: &reqwest::Client,
    options: &LiveOptions,
    contender: &LiveContender,
    repeat: usize,
    seed: u64,
    stop: CancellationToken,
) -> Result<(tokio::task::JoinHandle<()>, PathBuf), String> {
    let dir = options
        .work_dir
        .join(format!("r{repeat}-{}", contender.name()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (gate_type, params, max_sys) =
        contender.batch_gate(&options.metrics_url, options.max_sys, options.slo);
    let gate = build_gate_for_batch(&gate_type, &params, f64::from(max_sys))?;
    // One request per slot per second of the run, twice over: more than the
    // engine can finish (a 64-token request takes over a second at 32 in
    // flight). The same file for every contender, a static cap included:
    // the batch runner's work grows with its backlog, and it shares a core
    // with the engine's API server.
    let lines = 2 * options.max_sys as usize * options.duration.as_secs().max(1) as usize;
    let input = dir.join("input.jsonl");
    let text = traffic::batch_lines(
        &options.model,
        lines,
        options.prompt_words,
        options.batch_output_tokens,
        seed,
    );
    std::fs::write(&input, text).map_err(|e| format!("{}: {e}", input.display()))?;
    let mut batch = BatchOptions::new(input, dir.join("output.jsonl"), options.url.clone());
    batch.request_path = "/v1/completions".to_owned();
    batch.max_in_flight = f64::from(max_sys);
    batch.progress = false;
    let task = tokio::spawn(async move {
        if let Err(e) = run_batch(&batch, gate, None, stop).await {
            tracing::warn!(error = %e, "live eval: the batch run failed");
        }
    });
    let give_up = Instant::now() + Duration::from_secs(10);
    while Instant::now() < give_up {
        let r = engine::read(client, &options.metrics_url).await?;
        if r.running + r.waiting > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((task, dir))
}

/// Sends every arrival at its time and waits for all answers.
async fn interactive(
    client: &reqwest::Client,
    options: &LiveOptions,
    arrivals: &[f64],
    seed: u64,
) -> Vec<Timing> {
    let start = Instant::now();
    let model: Arc<str> = options.model.as_str().into();
    let url: Arc<str> = options.url.as_str().into();
    let mut tasks = Vec::with_capacity(arrivals.len());
    for (i, at) in arrivals.iter().enumerate() {
        let (client, model, url) = (client.clone(), model.clone(), url.clone());
        let prompt = traffic::prompt(
            seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
            options.prompt_words,
        );
        let (tokens, at) = (options.output_tokens, start + Duration::from_secs_f64(*at));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            traffic::interactive_request(&client, &url, &model, &prompt, tokens, start, GIVE_UP)
                .await
        }));
    }
    let mut timings = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(timing) = t.await {
            timings.push(timing);
        }
    }
    timings
}

/// The engine's running, waiting and generated tokens once a second.
async fn sample(
    client: reqwest::Client,
    metrics_url: String,
    start: Instant,
    stop: CancellationToken,
) -> Vec<(f64, engine::EngineReading)> {
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = stop.cancelled() => return out,
            _ = tick.tick() => {}
        }
        if let Ok(r) = engine::read(&client, &metrics_url).await {
            out.push((start.elapsed().as_secs_f64(), r));
        }
    }
}

/// Per second of the run: interactive sends and violations by send second,
/// the engine's state and tokens from the samples.
fn timeline(
    timings: &[Timing],
    samples: &[(f64, engine::EngineReading)],
    slo: Slo,
) -> Vec<TimelineRow> {
    let seconds = (samples.last().map_or(0.0, |s| s.0))
        .max(timings.iter().map(|t| t.sent_s).fold(0.0, f64::max))
        .ceil() as u32;
    (0..seconds)
        .map(|second| {
            let of_second = timings.iter().filter(|t| t.sent_s as u32 == second);
            let sample_at = |s: u32| samples.iter().rfind(|(at, _)| *at <= f64::from(s) + 1.0);
            let now = sample_at(second);
            let prev = second.checked_sub(1).and_then(sample_at);
            TimelineRow {
                second,
                sent: of_second.clone().count() as u32,
                violations: of_second.filter(|t| !t.meets(slo)).count() as u32,
                running: now.map_or(0.0, |s| s.1.running),
                waiting: now.map_or(0.0, |s| s.1.waiting),
                tokens: match (now, prev) {
                    (Some(n), Some(p)) => n.1.generation_tokens - p.1.generation_tokens,
                    _ => 0.0,
                },
            }
        })
        .collect()
}

/// Every run second by second, as CSV.
pub fn timeline_csv(report: &LiveReport) -> String {
    let mut out = String::from("repeat,contender,second,sent,violations,running,waiting,tokens\n");
    for run in &report.runs {
        for row in &run.timeline {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{}",
                run.repeat,
                run.contender,
                row.second,
                row.sent,
                row.violations,
                row.running,
                row.waiting,
                row.tokens
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contenders_parse_by_name_and_refuse_the_unknown() {
        assert_eq!(LiveContender::parse("ungated"), Ok(LiveContender::Ungated));
        assert_eq!(
            LiveContender::parse("static-cap-2"),
            Ok(LiveContender::StaticCap(2))
        );
        assert_eq!(
            LiveContender::parse("feedback"),
            Ok(LiveContender::Gate("feedback".into()))
        );
        assert!(LiveContender::parse("static-cap-0").is_err());
        let err = LiveContender::parse("prometheus-budget").expect_err("needs Prometheus");
        assert!(
            err.contains("allowed: ungated, static-cap-N, feedback"),
            "{err}"
        );
        for name in ["ungated", "static-cap-4", "vllm"] {
            assert_eq!(
                LiveContender::parse(name).map(|c| c.name()),
                Ok(name.to_owned())
            );
        }
    }

    #[test]
    fn a_static_cap_is_a_constant_window_of_its_size() {
        let (gate, _, max_sys) =
            LiveContender::StaticCap(3).batch_gate("http://e/metrics", 32, Slo::default());
        assert_eq!((gate.as_str(), max_sys), ("constant", 3));
        let (gate, params, max_sys) =
            LiveContender::Gate("vllm".into()).batch_gate("http://e/metrics", 32, Slo::default());
        assert_eq!((gate.as_str(), max_sys), ("vllm", 32));
        assert_eq!(params["urls"][0], "http://e/metrics");
        let slo = Slo {
            ttft_s: 1.0,
            itl_s: 0.1,
        };
        for name in PAGE_GATES {
            let (gate, params, max_sys) =
                LiveContender::Gate((*name).into()).batch_gate("http://e/metrics", 32, slo);
            build_gate_for_batch(&gate, &params, f64::from(max_sys))
                .expect("builds with its defaults and the eval's SLO");
            if *name != "vllm" {
                assert_eq!(
                    (params["ttft_slo"].as_f64(), params["itl_slo"].as_f64()),
                    (Some(1.0), Some(0.1))
                );
            }
        }
    }

    #[test]
    fn a_gate_spec_gets_the_engine_page_and_the_slo_unless_it_names_its_own() {
        let slo = Slo {
            ttft_s: 1.0,
            itl_s: 0.1,
        };
        let spec = LiveContender::spec(
            r#"lulls={"gate_type": "feedback", "gate_params": {"lull_quantile": 0.2, "itl_slo": 0.2}}"#,
        )
        .expect("a spec");
        assert_eq!(spec.name(), "lulls");
        let (gate, params, max_sys) = spec.batch_gate("http://e/metrics", 32, slo);
        assert_eq!((gate.as_str(), max_sys), ("feedback", 32));
        assert_eq!(params["urls"][0], "http://e/metrics");
        assert_eq!(params["ttft_slo"].as_f64(), Some(1.0));
        assert_eq!(params["itl_slo"].as_f64(), Some(0.2), "its own SLO stays");
        assert_eq!(params["lull_quantile"].as_f64(), Some(0.2));
        build_gate_for_batch(&gate, &params, f64::from(max_sys)).expect("builds");
        // A gate that holds no SLO gets none.
        let spec = LiveContender::spec(r#"v={"gate_type": "vllm"}"#).expect("a spec");
        let (_, params, _) = spec.batch_gate("http://e/metrics", 32, slo);
        assert!(params.get("ttft_slo").is_none(), "{params}");
        // A gate that reads no page gets no `urls` (its parameters refuse
        // unknown keys) and builds from what it was given.
        let spec = LiveContender::spec(
            r#"cap={"gate_type": "local-max-concurrency", "gate_params": {"max_concurrency": 3}}"#,
        )
        .expect("a spec");
        let (gate, params, max_sys) = spec.batch_gate("http://e/metrics", 32, slo);
        assert!(params.get("urls").is_none(), "{params}");
        build_gate_for_batch(&gate, &params, f64::from(max_sys)).expect("builds");
        for bad in [
            "no-equals",
            "x={",
            r#"x={"gate_params": {}}"#,
            r#"x={"gate_type": "vllm", "gate_params": 3}"#,
        ] {
            assert!(LiveContender::spec(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_timeline_buckets_sends_by_second() {
        let t = |sent_s: f64, ok: bool| Timing {
            sent_s,
            ttft_s: Some(0.1),
            itl_p95_s: Some(0.01),
            itl_mean_s: Some(0.01),
            last_token_s: Some(0.5),
            output_tokens: 32,
            prompt_tokens: 250,
            ok,
        };
        let reading = |running: f64, tokens: f64| engine::EngineReading {
            generation_tokens: tokens,
            running,
            ..Default::default()
        };
        let samples = vec![(1.0, reading(2.0, 100.0)), (2.0, reading(5.0, 250.0))];
        let rows = timeline(
            &[t(0.2, true), t(0.7, false), t(1.5, true)],
            &samples,
            Slo::default(),
        );
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].sent, rows[0].violations), (2, 1));
        assert_eq!(
            (rows[1].sent, rows[1].running, rows[1].tokens),
            (1, 5.0, 150.0)
        );
    }
}
