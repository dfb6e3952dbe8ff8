//! The batch-file runner: an OpenAI Batch API input file (or request
//! lines) through a gate into the gateway, results in the OpenAI batch
//! output shape, resumable after Ctrl-C or a crash.
//!
//! Files: `endpoint.rs` names the endpoints a batch may use and checks
//! their request bodies; `input.rs` parses and converts input lines; `output.rs` writes
//! output lines; `watch.rs` records what the gate said; `status.rs` tells
//! apart what holds the batch back (gate closed, source unavailable,
//! congestion hold, window full) for the progress line and summary (the
//! demo's chart is drawn by [`crate::chart`]). Gates are the catalogue's ([`crate::gate::build_gate`]); the
//! dispatcher is built as `run` builds it ([`crate::app::build_dispatcher`]).
//!
//! Resume: the state directory holds an embedded store
//! ([`crate::queue::embedded`]). The first run imports every valid line
//! into it in one transaction (with the input's fingerprint); every result
//! is written and its message removed in one transaction. A re-run with
//! the same input imports nothing, ends the leases of the dead run, and
//! dispatches only what has no result yet, so nothing that already has a
//! result is sent again. The output file is rewritten from the store, in
//! input order, at the end of every run.

pub mod input;
pub mod output;
pub mod status;
pub mod watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::app::AppError;
use crate::config::{
    Config, DispatchConfig, EndpointUrl, GateSpec, GatewayConfig, QueueConfig, Rounding,
    TelemetryConfig, TransportKind, Unit,
};
use crate::dispatch::QueueDispatcher;
use crate::dispatch::congestion::CongestionHold;
use crate::endpoint::Endpoints;
use crate::gate::{Capacity, DispatchGate, GateContext, build_gate};
use crate::gateway::{GatewayBuildError, GatewayClient, GatewaySettings};
use crate::queue::embedded::{EmbeddedError, EmbeddedQueue, OwnerLock};
use crate::result::ResultRecord;
use crate::tasks::Tasks;
use crate::telemetry::Metrics;

pub use status::{BatchState, StateTimes, format_rate};
pub use watch::{GateStats, GateWatch, GateWatchHandle};

/// Queue name of the batch inside its store.
const QUEUE: &str = "batch";
/// Meta key holding the imported input's fingerprint.
const INPUT_KEY: &str = "batch.input_fingerprint";

/// What to run and how.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Input file (JSON lines).
    pub input: PathBuf,
    /// Output file (JSON lines, OpenAI batch output shape).
    pub output: PathBuf,
    /// State directory; `<output>.state` when absent.
    pub state: Option<PathBuf>,
    /// Gateway base URL.
    pub gateway_url: String,
    /// Path for request lines without an endpoint (OpenAI lines carry
    /// their own `url`).
    pub request_path: String,
    /// `max_SYS`: batch requests in flight at budget 1.
    pub max_in_flight: f64,
    /// Failed attempts before a request is dead-lettered; `None` = until
    /// its deadline.
    pub max_attempts: Option<u32>,
    /// Deadline given to lines without one, from import.
    pub deadline: Duration,
    /// How often the gate is read.
    pub poll_interval: Duration,
    /// Per-attempt timeout.
    pub attempt_timeout: Duration,
    /// Show progress (bars on a terminal, a line every few seconds
    /// otherwise).
    pub progress: bool,
    /// The endpoints lines may name (`--endpoints`); others are answered
    /// `invalid_request` without being sent.
    pub endpoints: Endpoints,
}

impl BatchOptions {
    /// Options with defaults for everything but the files and gateway.
    pub fn new(input: PathBuf, output: PathBuf, gateway_url: String) -> Self {
        Self {
            input,
            output,
            state: None,
            gateway_url,
            request_path: "/v1/chat/completions".to_owned(),
            max_in_flight: 64.0,
            max_attempts: Some(5),
            deadline: Duration::from_secs(24 * 3600),
            poll_interval: Duration::from_millis(250),
            attempt_timeout: Duration::from_secs(300),
            progress: true,
            endpoints: Endpoints::default(),
        }
    }

    /// The state directory in use.
    pub fn state_dir(&self) -> PathBuf {
        self.state.clone().unwrap_or_else(|| {
            let mut s = self.output.as_os_str().to_owned();
            s.push(".state");
            PathBuf::from(s)
        })
    }
}

/// A gate for a batch run (`sluicegate batch`, the demo, the live eval):
/// no `[prometheus]` or `[redis]` section, so gates that need one report
/// it, and scrape gates (`vllm`, `endpoint-scrape`, `feedback`, ...) take
/// their URLs from the parameters; read every 250 ms, stale after 10 s.
pub fn build_gate_for_batch(
    gate_type: &str,
    params: &serde_json::Value,
    max_sys: f64,
) -> Result<Box<dyn DispatchGate>, String> {
    let spec = GateSpec::parse(gate_type, params, "--gate").map_err(|e| e.to_string())?;
    let mut ctx = GateContext::new(
        None,
        None,
        Duration::from_millis(250),
        Duration::from_secs(10),
    );
    ctx.capacity = Capacity {
        max_sys,
        unit: Unit::Requests,
    };
    build_gate(&spec, &ctx).map_err(|e| format!("--gate: {e}"))
}

/// Extra text for the progress line (the demo shows budget and TTFT).
pub type StatusHook = Arc<dyn Fn() -> String + Send + Sync>;

/// Why a batch run could not run.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The input file cannot be read.
    #[error("--input {path}: {source}")]
    Input {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The state directory holds a different input's batch.
    #[error(
        "state directory {state} belongs to a different input file (it was changed since the first run); use another --state or remove it"
    )]
    InputChanged {
        /// The state directory.
        state: PathBuf,
    },
    /// The store failed or is owned by another process.
    #[error(transparent)]
    Store(#[from] EmbeddedError),
    /// `--gateway-url` is not a URL.
    #[error("gateway: {url}: {source}")]
    GatewayUrl {
        /// The URL as given.
        url: String,
        /// The parse error.
        #[source]
        source: url::ParseError,
    },
    /// The gateway client could not be built.
    #[error("gateway: {0}")]
    Gateway(#[source] GatewayBuildError),
    /// The dispatcher could not be built from the batch's config (the
    /// gateway target is unusable).
    #[error("gateway: {0}")]
    Dispatcher(#[source] Box<AppError>),
    /// Dispatcher tasks panicked (logged with their names); the store
    /// keeps what was settled and a re-run resumes.
    #[error("task panicked: {}", .0.join(", "))]
    Panicked(Vec<String>),
    /// The output could not be written.
    #[error("--output {path}: {source}")]
    Output {
        /// The file.
        path: PathBuf,
        /// The write error.
        #[source]
        source: std::io::Error,
    },
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct BatchSummary {
    /// Non-blank input lines.
    pub lines: usize,
    /// Lines with a 2xx answer.
    pub completed: u64,
    /// Lines that ended otherwise, by kind (`http_4xx`, `invalid_request`,
    /// `dead_letter`, `deadline_exceeded`, ...).
    pub failed: BTreeMap<String, u64>,
    /// Lines still without a result (interrupted run).
    pub pending: u64,
    /// Prompt tokens of 2xx answers (whole batch).
    pub prompt_tokens: u64,
    /// Completion tokens of 2xx answers (whole batch).
    pub completion_tokens: u64,
    /// Lines settled by this run.
    pub settled_this_run: u64,
    /// Completion tokens answered in this run.
    pub completion_tokens_this_run: u64,
    /// Wall time of this run.
    pub elapsed: Duration,
    /// Time this run spent in each state (sending, window full, gate
    /// closed, source unavailable, congestion hold).
    pub states: StateTimes,
    /// Whether the run stopped before every line had a result.
    pub interrupted: bool,
    /// Whether earlier runs had already settled lines.
    pub resumed: bool,
    /// The output file.
    pub output: PathBuf,
}

impl BatchSummary {
    /// Total failed lines.
    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }
}

impl std::fmt::Display for BatchSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "{}: {} lines, {} completed, {} failed{}",
            if self.interrupted {
                "batch interrupted"
            } else {
                "batch done"
            },
            self.lines,
            self.completed,
            self.failed_total(),
            if self.pending > 0 {
                format!(
                    ", {} pending (re-run the same command to resume)",
                    self.pending
                )
            } else {
                String::new()
            }
        )?;
        if !self.failed.is_empty() {
            let kinds: Vec<String> = self
                .failed
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            writeln!(f, "  failed by type: {}", kinds.join(", "))?;
        }
        writeln!(
            f,
            "  tokens: {} prompt, {} completion",
            self.prompt_tokens, self.completion_tokens
        )?;
        writeln!(
            f,
            "  this run: {} lines in {:.1} s ({} lines/s, {} completion tokens/s){}",
            self.settled_this_run,
            secs,
            format_rate(self.settled_this_run as f64 / secs),
            format_rate(self.completion_tokens_this_run as f64 / secs),
            if self.resumed { ", resumed" } else { "" }
        )?;
        writeln!(f, "  time by state: {} (of {:.1} s)", self.states, secs)?;
        write!(f, "  output: {}", self.output.display())
    }
}

/// Usage of a 2xx body: `(prompt, completion)` tokens.
fn usage(result: &ResultRecord) -> (u64, u64) {
    let Some(200..=299) = result.status_code else {
        return (0, 0);
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&result.payload) else {
        return (0, 0);
    };
    let get = |k: &str| v["usage"][k].as_u64().unwrap_or(0);
    (get("prompt_tokens"), get("completion_tokens"))
}

/// Runs (or resumes) a batch: imports the input into the state store if
/// needed, dispatches what has no result yet through `gate` until every
/// line is settled or `shutdown` fires, then writes the output file.
pub async fn run_batch(
    options: &BatchOptions,
    gate: Box<dyn DispatchGate>,
    status: Option<StatusHook>,
    shutdown: CancellationToken,
) -> Result<(BatchSummary, GateWatchHandle), BatchError> {
    let started = Instant::now();
    let state = options.state_dir();
    std::fs::create_dir_all(&state).map_err(|source| BatchError::Output {
        path: state.clone(),
        source,
    })?;
    let db = state.join("queue.db");
    let _owner = OwnerLock::acquire(&db)?;
    let queue = EmbeddedQueue::open(&db, QUEUE)?;

    let bytes = std::fs::read(&options.input).map_err(|source| BatchError::Input {
        path: options.input.clone(),
        source,
    })?;
    let fp = input::fingerprint(&bytes);
    let text = String::from_utf8_lossy(&bytes);
    let imported = queue.meta(INPUT_KEY)?;
    let default_deadline = crate::clock::unix_secs()
        .saturating_add(i64::try_from(options.deadline.as_secs()).unwrap_or(i64::MAX));
    let mut parsed = input::parse_input(&text, default_deadline);
    input::restrict_endpoints(&mut parsed, &options.endpoints);
    match imported {
        Some(existing) if existing != fp => return Err(BatchError::InputChanged { state }),
        Some(_) => {
            // A resume: the dead run's leases end now (we are the only owner).
            queue.release_all_leases()?;
        }
        None => {
            let items: Vec<(bytes::Bytes, i64)> = parsed
                .valid
                .iter()
                .map(|l| (l.body.clone(), l.deadline))
                .collect();
            queue.enqueue_with_deadlines(&items, &[(INPUT_KEY, &fp)])?;
        }
    }
    let total = parsed.valid.len() as u64;
    let settled_ids = |q: &EmbeddedQueue| -> Result<HashSet<String>, EmbeddedError> {
        let mut ids: HashSet<String> = q.results()?.into_iter().map(|r| r.id).collect();
        ids.extend(q.dead_letters()?.into_iter().map(|d| d.last_error.id));
        Ok(ids)
    };
    let before = settled_ids(&queue)?;
    let settled_at_start = before.len() as u64;

    let (watch, stats) = GateWatch::new(gate);
    let mut interrupted = false;
    let mut states = StateTimes::default();
    if queue.unsettled_count()? > 0 {
        let metrics = Metrics::new();
        let congestion = Arc::new(CongestionHold::new(
            (&batch_config(options)?.dispatch).into(),
        ));
        let dispatcher = build_dispatcher(
            options,
            Arc::new(queue.clone()),
            watch,
            &metrics,
            (crate::dispatch::Pool::new(QUEUE), congestion.clone()),
        )?;
        // The dispatcher's own gauges: the window and own in-flight.
        let gauges = metrics.queue(QUEUE);
        let tasks = Tasks::new();
        let stop = tasks.drain_token().child_token();
        let task = tasks.spawn(
            format!("queue `{QUEUE}`: dispatcher"),
            dispatcher.run(stop.clone(), tasks.clone()),
        );
        let bar = progress_bar(options, total, settled_at_start);
        let mut last_line = Instant::now();
        let mut last_sample = Instant::now();
        loop {
            let settled = queue.result_count()? + queue.dead_letter_count()?;
            let now = Instant::now();
            let state = BatchState::classify(
                &stats.snapshot(),
                u64::try_from(gauges.in_flight.get()).unwrap_or(0),
                u64::try_from(gauges.window.get()).unwrap_or(0),
                congestion.clearance(now),
                now,
            );
            states.add(&state, now.saturating_duration_since(last_sample));
            last_sample = now;
            let done_here = settled.saturating_sub(settled_at_start);
            let rate = done_here as f64 / started.elapsed().as_secs_f64().max(1e-3);
            let extra = status.as_ref().map(|s| s()).unwrap_or_default();
            let msg = format!(
                "{state}; {} lines/s{}{}",
                format_rate(rate),
                if extra.is_empty() { "" } else { " | " },
                extra
            );
            bar.set_position(settled.min(total));
            bar.set_message(msg.clone());
            if options.progress && bar.is_hidden() && last_line.elapsed() >= Duration::from_secs(5)
            {
                eprintln!("progress: {settled}/{total} lines; {msg}");
                last_line = Instant::now();
            }
            if settled >= total {
                break;
            }
            if shutdown.is_cancelled() {
                interrupted = true;
                break;
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
        bar.finish_and_clear();
        stop.cancel();
        let _ = task.await;
        tasks.stop().await;
        let panicked = tasks.panicked();
        if !panicked.is_empty() {
            return Err(BatchError::Panicked(panicked));
        }
    }

    // Output, in input order, from the store.
    let results: HashMap<String, ResultRecord> = queue
        .results()?
        .into_iter()
        .map(|r| (r.id.clone(), r))
        .collect();
    let dead: HashMap<String, ResultRecord> = queue
        .dead_letters()?
        .into_iter()
        .map(|d| (d.last_error.id.clone(), d.last_error))
        .collect();
    let mut summary = BatchSummary {
        lines: parsed.total(),
        resumed: settled_at_start > 0,
        output: options.output.clone(),
        ..BatchSummary::default()
    };
    let mut lines = Vec::with_capacity(parsed.total());
    let mut invalid = parsed.invalid.iter().peekable();
    for valid in &parsed.valid {
        while let Some(bad) = invalid.next_if(|b| b.line < valid.line) {
            lines.push(output::invalid_line(bad));
            *summary.failed.entry("invalid_request".into()).or_default() += 1;
        }
        let (record, dead_lettered) =
            match (results.get(&valid.custom_id), dead.get(&valid.custom_id)) {
                (Some(r), _) => (r, false),
                (None, Some(d)) => (d, true),
                (None, None) => {
                    summary.pending += 1;
                    continue;
                }
            };
        lines.push(output::result_line(valid.line, &valid.custom_id, record));
        let (p, c) = usage(record);
        summary.prompt_tokens += p;
        summary.completion_tokens += c;
        if !before.contains(&valid.custom_id) {
            summary.settled_this_run += 1;
            summary.completion_tokens_this_run += c;
        }
        let label = if dead_lettered {
            "dead_letter"
        } else {
            record.outcome_label()
        };
        if label == "success" {
            summary.completed += 1;
        } else {
            *summary.failed.entry(label.to_owned()).or_default() += 1;
        }
    }
    for bad in invalid {
        lines.push(output::invalid_line(bad));
        *summary.failed.entry("invalid_request".into()).or_default() += 1;
    }
    output::write_lines(&options.output, &lines).map_err(|source| BatchError::Output {
        path: options.output.clone(),
        source,
    })?;
    summary.interrupted = interrupted || summary.pending > 0;
    summary.elapsed = started.elapsed();
    summary.states = states;
    Ok((summary, stats))
}

fn progress_bar(options: &BatchOptions, total: u64, start: u64) -> ProgressBar {
    let target = if options.progress && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} ETA {eta}\n  {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_position(start);
    bar.reset_eta();
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// The batch run as a typed config: the embedded store's one queue, the
/// batch's timings, a constant gate placeholder (the real gate is passed
/// in already built). The dispatcher is then built exactly as `run` builds
/// it ([`crate::app::build_dispatcher`]).
fn batch_config(options: &BatchOptions) -> Result<Config, BatchError> {
    let url = url::Url::parse(&options.gateway_url).map_err(|source| BatchError::GatewayUrl {
        url: options.gateway_url.clone(),
        source,
    })?;
    let url = EndpointUrl::new(url);
    Ok(Config {
        transport: TransportKind::Embedded,
        gateway: GatewayConfig {
            url: Some(url.clone()),
            request_path: options.request_path.clone(),
            attempt_timeout: options.attempt_timeout,
            max_connections_per_host: 64,
            ..GatewayConfig::default()
        },
        redis: None,
        prometheus: None,
        pubsub: None,
        embedded: None,
        sql: None,
        // The batch runner exports no traces.
        traces: None,
        dispatch: DispatchConfig {
            poll_interval: options.poll_interval,
            max_staleness: Duration::from_secs(10),
            lease: Duration::from_secs(120),
            receive_wait: Duration::from_millis(250),
            max_attempts: options.max_attempts,
            retry_initial_backoff: Duration::from_millis(500),
            retry_max_backoff: Duration::from_secs(30),
            congestion_backoff: Duration::from_secs(1),
            congestion_max_backoff: Duration::from_secs(30),
            wait_requeue_delay: Duration::from_millis(500),
            shutdown_grace: Duration::from_secs(10),
            default_deadline: options.deadline,
            ..DispatchConfig::default()
        },
        telemetry: TelemetryConfig::default(),
        queues: vec![QueueConfig {
            queue_name: QUEUE.to_owned(),
            igw_base_url: url,
            request_path_url: options.request_path.clone(),
            inference_objective: None,
            engine_priority: None,
            pool: None,
            worker_pool_id: String::new(),
            id: None,
            labels: BTreeMap::new(),
            result_queue_name: None,
            result_ttl_seconds: 0,
            max_sys: options.max_in_flight.max(1.0),
            unit: Unit::Requests,
            rounding: Rounding::Floor,
            gate: GateSpec::Constant(Default::default()),
        }],
    })
}

fn build_dispatcher(
    options: &BatchOptions,
    queue: Arc<EmbeddedQueue>,
    watch: GateWatch,
    metrics: &Metrics,
    pool: (Arc<crate::dispatch::Pool>, Arc<CongestionHold>),
) -> Result<QueueDispatcher, BatchError> {
    let config = batch_config(options)?;
    let settings = GatewaySettings::for_config(&config);
    let gateway = GatewayClient::new(settings).map_err(BatchError::Gateway)?;
    crate::app::build_dispatcher(
        &config,
        &config.queues[0],
        queue,
        Box::new(watch),
        gateway,
        pool,
        metrics,
    )
    .map_err(|e| BatchError::Dispatcher(Box::new(e)))
}

/// Whether `path` looks like a batch state directory (holds a store).
pub fn is_state_dir(path: &Path) -> bool {
    path.join("queue.db").exists()
}
