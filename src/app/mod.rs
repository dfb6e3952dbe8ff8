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

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::{Config, TransportKind};
use crate::dispatch::Pool;
use crate::dispatch::congestion::CongestionHold;
use crate::gate::{GateContext, build_gate};
use crate::gateway::{GatewayClient, GatewaySettings, Target};
use crate::queue::{Queue, Transports};
use crate::tasks::Tasks;
use crate::telemetry::traces::TraceExport;
use crate::telemetry::{Health, Metrics, QueueMetrics};

mod error;
mod watch;
mod wire;

pub use error::{AppError, EXIT_CONFIG, EXIT_FAILURE};
use watch::{all_reachable, exit_when_done, watch_transports, write_memory_results};
use wire::{PoolParts, start_shared_windows};
pub use wire::{build_dispatcher, pool_name};

/// Least time given to the span flush at shutdown, even with a zero
/// `shutdown_grace` (which bounds it otherwise).
const TRACE_FLUSH_MIN: Duration = Duration::from_secs(2);

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
    /// The streamed flex requests held in this process (`serve` with its
    /// dispatcher in process): their answers are relayed to them directly
    /// (`crate::relay`).
    pub relay: Option<Arc<crate::relay::local::LocalRelay>>,
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
                "--exit-when-done is for the memory, embedded and sql transports",
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
    let context = GateContext {
        tasks: tasks.clone(),
        ..GateContext::from_config(config)
    };
    // Off (no exporter, no provider) unless an OTLP endpoint is set.
    let trace_export = config.traces.as_ref().map(TraceExport::start).transpose()?;
    let mut built = Vec::with_capacity(queues.len());
    // One pool per name: queues on one pool share one window, one
    // congestion hold (a 429 seen by one queue holds them all) and one
    // `local-max-concurrency` slot counter.
    let mut pools: BTreeMap<String, PoolParts> = BTreeMap::new();
    // On the Redis transport every dispatcher relays streamed flex
    // answers to the queue's streams (a `serve` anywhere may hold them):
    // one more multiplexed connection, written to only for those.
    let relay_conn = match config.transport {
        TransportKind::Redis => {
            let redis = (config.redis.clone()).unwrap_or_else(crate::queue::default_redis_config);
            Some(crate::redis::connection(&redis).map_err(AppError::Relay)?)
        }
        _ => None,
    };
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
        dispatcher.relay = crate::relay::Relay::new(
            options.relay.clone(),
            (relay_conn.clone())
                .map(|conn| crate::relay::redis::RedisRelay::new(conn, &queue_config.queue_name)),
        );
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
