//! Wiring: builds every component from the config, owns the task tree and
//! the shutdown order.
//!
//! [`run`] (or [`start`] then [`Running::wait`]) is the one way the
//! dispatcher runs: it opens the configured transport ([`crate::queue::open`]),
//! builds one dispatcher per queue ([`build_dispatcher`], also used by the
//! batch runner and the demo), serves telemetry, and spawns every
//! long-lived task under one [`Tasks`] tree. The caller supplies the
//! shutdown trigger as a future, so tests bring their own.
//!
//! Shutdown order: stop receiving → finish in flight within
//! `shutdown_grace` → requeue the rest → write results → ack (all inside
//! each dispatcher) → [`Queue::close`] hands back what is still held →
//! the memory transport's results are written → spans are flushed and the
//! tracer provider shut down (when traces are on), within `shutdown_grace`
//! → telemetry stops → exit.
//! A task that panics starts the same drain and fails the run.

mod tasks;

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::{Config, QueueConfig, SharedWindowKind, TransportKind};
use crate::dispatch::congestion::CongestionHold;
use crate::dispatch::shared_window::{SharedWindow, SharedWindowSettings};
use crate::dispatch::{DispatchSettings, Pool, QueueDispatcher, RetryPolicy};
use crate::gate::{BuildError, DispatchGate, FailClosed, GateContext, build_gate};
use crate::gateway::{GatewayBuildError, GatewayClient, GatewaySettings, Target, TargetError};
use crate::queue::{MemoryQueue, OpenError, Queue, Transports};
use crate::telemetry::traces::{TraceExport, TraceStartError};
use crate::telemetry::{Health, Metrics, QueueMetrics};

pub use tasks::Tasks;

/// Exit code of a run that could not start (configuration, as
/// `check-config` documents).
pub const EXIT_CONFIG: u8 = 2;
/// Exit code of a run that failed while running (a task panicked, results
/// could not be written).
pub const EXIT_FAILURE: u8 = 1;

/// How often `--exit-when-done` asks the queues whether anything is left.
const DONE_POLL: Duration = Duration::from_millis(50);
/// Least time given to the span flush at shutdown, even with a zero
/// `shutdown_grace` (which bounds it otherwise).
const TRACE_FLUSH_MIN: Duration = Duration::from_secs(2);
/// How often transport status feeds readiness and metrics.
const STATUS_EVERY: Duration = Duration::from_millis(250);

/// Why the application could not start, or failed while running.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The run options do not fit the configured transport.
    #[error("{0}")]
    Options(&'static str),
    /// `--input` could not be read.
    #[error("--input: cannot read {path}: {source}")]
    Input {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The transport could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The telemetry address could not be bound.
    #[error("telemetry.listen: cannot listen on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP client could not be built.
    #[error("gateway: {0}")]
    Gateway(#[from] GatewayBuildError),
    /// A queue's gateway URL or path is unusable.
    #[error("queue `{queue}`: {source}")]
    Target {
        /// The queue name.
        queue: String,
        /// What is wrong.
        #[source]
        source: TargetError,
    },
    /// A queue's gate cannot be built.
    #[error("queue `{queue}`: {source}")]
    Gate {
        /// The queue name.
        queue: String,
        /// What is wrong.
        #[source]
        source: BuildError,
    },
    /// Tasks panicked; the run drained and stopped.
    #[error("task panicked: {}", .0.join(", "))]
    Panicked(Vec<String>),
    /// The memory transport's results could not be written.
    #[error("cannot write results: {0}")]
    Output(#[source] std::io::Error),
    /// The OTLP trace exporter could not be built.
    #[error(transparent)]
    Traces(#[from] TraceStartError),
    /// The shared window's Redis client could not be built.
    #[error("dispatch.shared_window: {0}")]
    SharedWindow(#[source] crate::queue::redis::ConnectError),
}

impl AppError {
    /// The process exit code for this error: [`EXIT_CONFIG`] when the run
    /// could not start, [`EXIT_FAILURE`] when it failed while running.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Panicked(_) | Self::Output(_) => EXIT_FAILURE,
            Self::Options(_)
            | Self::Input { .. }
            | Self::Open(_)
            | Self::Listen { .. }
            | Self::Gateway(_)
            | Self::Target { .. }
            | Self::Gate { .. }
            | Self::Traces(_)
            | Self::SharedWindow(_) => EXIT_CONFIG,
        }
    }
}

/// Where the memory transport's results go at exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResultsOutput {
    /// JSON lines on standard output; unsettled messages on standard error.
    Stdout,
    /// JSON lines in this file; unsettled messages in
    /// `<file>.unsettled.jsonl`.
    File(PathBuf),
}

/// What `run` does beyond the config (the command line's `run` flags).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Memory transport only: request messages to load (JSON lines) into
    /// the single configured queue.
    pub input: Option<PathBuf>,
    /// Memory transport only: write results there at exit; `None` keeps
    /// them in the queues (in-process callers read [`Running::transports`]).
    pub output: Option<ResultsOutput>,
    /// Memory and embedded transports: drain once every message is settled.
    pub exit_when_done: bool,
}

/// A running application.
#[derive(Debug)]
pub struct Running {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub telemetry_addr: SocketAddr,
    /// The process-wide metrics.
    pub metrics: Arc<Metrics>,
    /// Readiness.
    pub health: Arc<Health>,
    /// The opened queues (tests push into memory queues through these).
    transports: Transports,
    /// The task tree; its drain token is the run's shutdown.
    tasks: Tasks,
    /// One per queue, awaited in the drain before anything closes.
    dispatchers: Vec<JoinHandle<Option<()>>>,
    /// Stops first at shutdown, so nothing sets ready again.
    watcher: JoinHandle<Option<()>>,
    /// Where the memory transport's results go.
    output: Option<ResultsOutput>,
    /// The tracer provider, when traces are on; shut down after results
    /// are written.
    traces: Option<TraceExport>,
    /// Bounds the span flush at shutdown.
    shutdown_grace: Duration,
}

/// Runs the dispatcher on the configured transport until `shutdown`
/// resolves (or, with `exit_when_done`, every message is settled), then
/// drains. The whole application in one call.
pub async fn run(
    config: &Config,
    options: RunOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    start(config, options, shutdown).await?.wait().await
}

/// Everything about `config` that `run` would refuse before it opens
/// anything: a transport or gate that is valid configuration but not in
/// this build, a gateway client that cannot be built, a gate that cannot
/// be built from its parameters and context, a queue's target. [`start`]
/// calls it first and `check-config` calls it after loading, so the two
/// never disagree. Opens no connection (Redis and gateways are only
/// reached once running).
pub fn preflight(config: &Config) -> Result<(), AppError> {
    GatewayClient::new(GatewaySettings::for_config(config))?;
    let context = GateContext::from_config(config);
    for queue_config in &config.queues {
        build_gate(&queue_config.gate, &context.clone().for_queue(queue_config)).map_err(
            |source| AppError::Gate {
                queue: queue_config.queue_name.clone(),
                source,
            },
        )?;
        Target::new(
            queue_config.igw_base_url.expose().as_str(),
            &queue_config.request_path_url,
            queue_config.inference_objective.clone(),
        )
        .map_err(|source| AppError::Target {
            queue: queue_config.queue_name.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Opens the transport, builds every dispatcher and starts them, with
/// telemetry; returns once everything runs. [`Running::wait`] drains.
pub async fn start(
    config: &Config,
    options: RunOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Running, AppError> {
    let memory_only = options.input.is_some() || options.output.is_some();
    match config.transport {
        TransportKind::Memory => {}
        TransportKind::Embedded if memory_only => {
            return Err(AppError::Options(
                "--input/--output are for the memory transport; feed the embedded store with `sluicegate submit --embedded PATH`",
            ));
        }
        TransportKind::Embedded => {}
        TransportKind::Redis | TransportKind::PubSub | TransportKind::Sql if memory_only => {
            return Err(AppError::Options(
                "--input/--output are for the memory transport",
            ));
        }
        TransportKind::Redis | TransportKind::PubSub if options.exit_when_done => {
            return Err(AppError::Options(
                "--exit-when-done is for the memory and embedded transports",
            ));
        }
        TransportKind::Redis | TransportKind::PubSub | TransportKind::Sql => {}
    }
    preflight(config)?;
    if options.input.is_some() && config.queues.len() != 1 {
        return Err(AppError::Options(
            "--input needs exactly one configured queue",
        ));
    }
    let input = match &options.input {
        Some(path) => Some(
            std::fs::read_to_string(path).map_err(|source| AppError::Input {
                path: path.clone(),
                source,
            })?,
        ),
        None => None,
    };

    // The task tree exists before the transports: their housekeeping runs
    // on it.
    let tasks = Tasks::new();
    let metrics = Arc::new(Metrics::new());
    let transports = crate::queue::open(config, &tasks, &metrics).await?;
    if let (Some(text), Some(queue)) = (&input, transports.memory().first()) {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            queue.push_message(line.to_owned());
        }
    }
    let queues = transports.queues();
    let health = Arc::new(Health::default());
    let gateway = GatewayClient::new(GatewaySettings::for_config(config))?;
    let context = GateContext::from_config(config);
    // Off (no exporter, no provider) unless an OTLP endpoint is set.
    let trace_export = config.traces.as_ref().map(TraceExport::start).transpose()?;
    let mut built = Vec::with_capacity(queues.len());
    // One pool per name: queues on one pool share one window, one
    // congestion hold (a 429 seen by one queue holds them all) and one
    // `local-max-concurrency` slot counter.
    let mut pools: BTreeMap<String, PoolParts> = BTreeMap::new();
    // `open` made one queue per `[[queue]]`, in order.
    for (queue_config, queue) in config.queues.iter().zip(&queues) {
        let name = pool_name(queue_config);
        let parts = pools.entry(name.clone()).or_insert_with(|| PoolParts {
            pool: Pool::new(name),
            congestion: Arc::new(CongestionHold::new((&config.dispatch).into())),
            slots: Arc::default(),
        });
        let mut gate_context = context.clone().for_queue(queue_config);
        gate_context.pool_slots = parts.slots.clone();
        let gate =
            build_gate(&queue_config.gate, &gate_context).map_err(|source| AppError::Gate {
                queue: queue_config.queue_name.clone(),
                source,
            })?;
        let mut dispatcher = build_dispatcher(
            config,
            queue_config,
            queue.clone(),
            gate,
            gateway.clone(),
            (parts.pool.clone(), parts.congestion.clone()),
            &metrics,
        )?;
        dispatcher.traces = trace_export.as_ref().map(TraceExport::traces);
        built.push(dispatcher);
    }
    start_shared_windows(config, &pools, &context.replica, &metrics, &health, &tasks)?;
    let addr = config.telemetry.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Listen { addr, source })?;
    let telemetry_addr = listener
        .local_addr()
        .map_err(|source| AppError::Listen { addr, source })?;

    {
        let root = tasks.root_token().clone();
        let server =
            crate::telemetry::serve(listener, metrics.clone(), health.clone(), async move {
                root.cancelled().await;
            });
        tasks.spawn("telemetry server", async move {
            if let Err(error) = server.await {
                tracing::error!(%error, "telemetry server failed");
            }
        });
    }
    {
        let drain = tasks.drain_token().clone();
        tasks.spawn("shutdown trigger", async move {
            tokio::select! {
                () = shutdown => drain.cancel(),
                () = drain.cancelled() => {}
            }
        });
    }
    if options.exit_when_done {
        tasks.spawn(
            "exit-when-done watcher",
            exit_when_done(queues.clone(), tasks.drain_token().clone()),
        );
    }
    let statuses: Vec<(Arc<dyn Queue>, QueueMetrics)> = built
        .iter()
        .map(|d| (d.queue.clone(), d.metrics.clone()))
        .collect();
    let dispatchers: Vec<_> = built
        .into_iter()
        .map(|d| {
            let name = format!("queue `{}`: dispatcher", d.queue.name());
            let stop = tasks.drain_token().child_token();
            let run = d.run(stop, tasks.clone());
            tasks.spawn(name, run)
        })
        .collect();
    health.set_ready(all_reachable(&statuses));
    let watcher = tasks.spawn(
        "transport watcher",
        watch_transports(statuses, health.clone(), tasks.drain_token().child_token()),
    );
    tracing::info!(%telemetry_addr, queues = dispatchers.len(), "sluicegate started");
    Ok(Running {
        telemetry_addr,
        metrics,
        health,
        transports,
        tasks,
        dispatchers,
        watcher,
        output: options.output,
        traces: trace_export,
        shutdown_grace: config.dispatch.shutdown_grace,
    })
}

impl Running {
    /// The opened queues.
    pub fn transports(&self) -> &Transports {
        &self.transports
    }

    /// Waits for the shutdown trigger (or a panic, or exit-when-done), then
    /// drains in order (see the module docs). Fails when a task panicked
    /// or the memory transport's results could not be written.
    pub async fn wait(self) -> Result<(), AppError> {
        self.tasks.drain_token().cancelled().await;
        // The watcher stops at once; after it, nothing sets ready again.
        let _ = self.watcher.await;
        self.health.set_ready(false);
        tracing::info!("shutting down");
        for dispatcher in self.dispatchers {
            // A panic was logged and recorded by the task tree.
            let _ = dispatcher.await;
        }
        for queue in self.transports.queues() {
            match queue.close().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(queue = %queue.name(), released = n, "claims handed back"),
                Err(error) => tracing::warn!(
                    queue = %queue.name(),
                    %error,
                    "could not hand claims back; they return when their lease expires"
                ),
            }
        }
        let written = match &self.output {
            Some(output) => write_memory_results(self.transports.memory(), output),
            None => Ok(()),
        };
        if let Some(traces) = self.traces {
            traces
                .shutdown(self.shutdown_grace.max(TRACE_FLUSH_MIN))
                .await;
        }
        // Telemetry stays up through the drain so it can be watched.
        self.tasks.stop().await;
        let panicked = self.tasks.panicked();
        if !panicked.is_empty() {
            return Err(AppError::Panicked(panicked));
        }
        written.map_err(AppError::Output)
    }
}

/// What the queues of one pool share in this process.
#[derive(Debug)]
struct PoolParts {
    pool: Arc<Pool>,
    congestion: Arc<CongestionHold>,
    slots: Arc<std::sync::atomic::AtomicUsize>,
}

/// The pool a queue sends to: its `pool`, else its gateway URL's origin
/// and path (no credentials, query or trailing slash), so queues on one
/// gateway URL share a pool unless told otherwise.
pub fn pool_name(queue: &QueueConfig) -> String {
    if let Some(pool) = &queue.pool {
        return pool.clone();
    }
    let url = queue.igw_base_url.expose();
    format!(
        "{}{}",
        url.origin().ascii_serialization(),
        url.path().trim_end_matches('/')
    )
}

/// Builds the dispatcher of `queue_config` on `queue`, paced by `gate`
/// (behind the fail-closed wrapper), with settings and retry policy from
/// the config, on `pool` with its congestion hold. The one construction
/// `run`, the batch runner and the demo share.
pub fn build_dispatcher(
    config: &Config,
    queue_config: &QueueConfig,
    queue: Arc<dyn Queue>,
    gate: Box<dyn DispatchGate>,
    gateway: GatewayClient,
    (pool, congestion): (Arc<Pool>, Arc<CongestionHold>),
    metrics: &Metrics,
) -> Result<QueueDispatcher, AppError> {
    let name = queue_config.queue_name.clone();
    let target = Target::new(
        queue_config.igw_base_url.expose().as_str(),
        &queue_config.request_path_url,
        queue_config.inference_objective.clone(),
    )
    .map(|target| target.with_engine_priority(queue_config.engine_priority))
    .map_err(|source| AppError::Target {
        queue: name.clone(),
        source,
    })?;
    let settings = DispatchSettings::from(&config.dispatch).for_queue(queue_config);
    Ok(QueueDispatcher {
        queue,
        gate: Arc::new(FailClosed::new(gate, settings.max_staleness)),
        gateway,
        target,
        retry: RetryPolicy::from(&config.dispatch),
        congestion,
        pool,
        settings,
        metrics: metrics.queue(&name),
        labels: queue_config.labels.clone(),
        traces: None,
    })
}

/// Creates every pool's shared-window metrics (at zero when the shared
/// window is off) and, with `dispatch.shared_window = "redis"`, spawns one
/// keeper per pool. The keepers stop with the task tree's root, after the
/// dispatchers drained, and give their units back then.
fn start_shared_windows(
    config: &Config,
    pools: &BTreeMap<String, PoolParts>,
    replica: &str,
    metrics: &Metrics,
    health: &Arc<Health>,
    tasks: &Tasks,
) -> Result<(), AppError> {
    let pool_metrics: Vec<_> = pools.keys().map(|name| metrics.pool(name)).collect();
    if config.dispatch.shared_window == SharedWindowKind::Off {
        return Ok(());
    }
    let redis = config
        .redis
        .clone()
        .unwrap_or_else(crate::queue::default_redis_config);
    // The shared connection type: one server or a cluster (`{pool}`-tagged
    // keys keep each script in one slot).
    let conn = crate::queue::redis::connection(&redis).map_err(AppError::SharedWindow)?;
    let settings = SharedWindowSettings {
        lease: config.dispatch.shared_window_lease,
        chunk: config.dispatch.shared_window_chunk,
        max_staleness: config.dispatch.max_staleness,
    };
    for (parts, pool_metrics) in pools.values().zip(pool_metrics) {
        let keeper = SharedWindow::new(
            conn.clone(),
            parts.pool.clone(),
            parts.congestion.clone(),
            replica,
            settings,
            pool_metrics,
            health.clone(),
        );
        tasks.spawn(
            format!("pool `{}`: shared window", parts.pool.name),
            keeper.run(tasks.root_token().child_token()),
        );
    }
    Ok(())
}

/// Starts the drain once no queue has anything left to settle (memory and
/// embedded transports; `start` refuses the others).
async fn exit_when_done(queues: Vec<Arc<dyn Queue>>, drain: tokio_util::sync::CancellationToken) {
    loop {
        let mut left = 0u64;
        for queue in &queues {
            // An error or "cannot tell" counts as work left.
            left += match queue.outstanding().await {
                Ok(Some(n)) => n,
                Ok(None) | Err(_) => 1,
            };
        }
        if left == 0 {
            tracing::info!("every message settled; draining");
            drain.cancel();
            return;
        }
        tokio::select! {
            () = drain.cancelled() => return,
            () = tokio::time::sleep(DONE_POLL) => {}
        }
    }
}

fn all_reachable(queues: &[(Arc<dyn Queue>, QueueMetrics)]) -> bool {
    queues
        .iter()
        .all(|(q, _)| q.status().is_none_or(|s| s.reachable))
}

/// Readiness follows the transports' reachability (not ready while a
/// backend is down); their counters become metrics. Stops at shutdown,
/// which owns readiness from then on.
async fn watch_transports(
    queues: Vec<(Arc<dyn Queue>, QueueMetrics)>,
    health: Arc<Health>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut seen: Vec<(u64, u64)> = vec![(0, 0); queues.len()];
    let mut was_ready = health.is_ready();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(STATUS_EVERY) => {}
        }
        for ((queue, m), seen) in queues.iter().zip(seen.iter_mut()) {
            let Some(status) = queue.status() else {
                continue;
            };
            if let Some(backlog) = status.backlog {
                m.backlog.set(i64::try_from(backlog).unwrap_or(i64::MAX));
            }
            m.claims_held
                .set(i64::try_from(status.claims_held).unwrap_or(i64::MAX));
            m.reclaims
                .inc_by(status.reclaims_total.saturating_sub(seen.0));
            m.dead_letters
                .inc_by(status.dead_letters_total.saturating_sub(seen.1));
            *seen = (
                seen.0.max(status.reclaims_total),
                seen.1.max(status.dead_letters_total),
            );
        }
        let ready = all_reachable(&queues);
        if shutdown.is_cancelled() {
            return;
        }
        if ready != was_ready {
            if ready {
                tracing::info!("queue backends reachable; ready");
            } else {
                tracing::warn!("a queue backend is unreachable; not ready");
            }
            was_ready = ready;
        }
        health.set_ready(ready);
    }
}

/// Writes the memory queues' results as JSON lines, and hands on what is
/// still unsettled (the memory transport keeps nothing after exit).
fn write_memory_results(
    queues: &[Arc<MemoryQueue>],
    output: &ResultsOutput,
) -> std::io::Result<()> {
    let mut results = String::new();
    let mut unsettled = String::new();
    let mut unsettled_count = 0usize;
    for queue in queues {
        for result in queue.results() {
            // A result is plain strings and numbers: serialising cannot fail.
            results.push_str(&serde_json::to_string(&result).unwrap_or_default());
            results.push('\n');
        }
        for dead in queue.dead_letters() {
            // Not `eprintln!` here or below: it panics on a closed stderr,
            // and the results must still be written.
            let _ = writeln!(
                std::io::stderr(),
                "dead letter: {}",
                serde_json::to_string(&dead.last_error).unwrap_or_default()
            );
        }
        for body in queue.unsettled() {
            unsettled.push_str(&String::from_utf8_lossy(&body));
            unsettled.push('\n');
            unsettled_count += 1;
        }
    }
    match output {
        ResultsOutput::File(path) => {
            std::fs::write(path, &results)?;
            if unsettled_count == 0 {
                return Ok(());
            }
            let mut rest = path.clone().into_os_string();
            rest.push(".unsettled.jsonl");
            let rest = PathBuf::from(rest);
            std::fs::write(&rest, &unsettled)?;
            let _ = writeln!(
                std::io::stderr(),
                "{unsettled_count} messages were not settled; written to {}",
                rest.display()
            );
            Ok(())
        }
        ResultsOutput::Stdout => {
            if unsettled_count > 0 {
                let _ = writeln!(
                    std::io::stderr(),
                    "{unsettled_count} messages were not settled:\n{unsettled}"
                );
            }
            std::io::stdout().write_all(results.as_bytes())
        }
    }
}
