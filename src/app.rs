//! Wiring: builds every component from the config, owns the task tree and
//! the shutdown order (stop receiving → finish in flight → write results →
//! ack → stop telemetry).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, GatewayConfig, QueueConfig};
use crate::dispatch::{DispatchSettings, QueueDispatcher};
use crate::gate::{BuildError, FailClosed, GateContext, build_gate};
use crate::gateway::{
    GatewayBuildError, GatewayClient, GatewaySettings, RetryPolicy, Target, TargetError,
};
use crate::queue::Queue;
use crate::telemetry::{Health, Metrics};

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The telemetry address could not be bound.
    #[error("telemetry.listen: cannot listen on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// A secret file could not be read.
    #[error("{key}: cannot read {path}: {source}")]
    SecretFile {
        /// The config key naming the file.
        key: &'static str,
        /// The file.
        path: String,
        /// The read error.
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
    /// The queues given do not match the configured queues.
    #[error("{0}")]
    Queues(String),
}

/// A running application: its telemetry address and its task.
#[derive(Debug)]
pub struct Running {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub telemetry_addr: SocketAddr,
    /// The process-wide metrics.
    pub metrics: Arc<Metrics>,
    /// Readiness.
    pub health: Arc<Health>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Waits until the application has drained after `shutdown`.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Starts dispatching every configured queue; `queues[i]` is the transport
/// of `config.queues[i]`. Runs until `shutdown` is cancelled, then drains.
pub async fn start(
    config: &Config,
    queues: Vec<Arc<dyn Queue>>,
    shutdown: CancellationToken,
) -> Result<Running, AppError> {
    if queues.len() != config.queues.len() {
        return Err(AppError::Queues(format!(
            "{} queues configured but {} transports given",
            config.queues.len(),
            queues.len()
        )));
    }
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let gateway = GatewayClient::new(gateway_settings(&config.gateway)?)?;
    let mut dispatchers = Vec::with_capacity(queues.len());
    for (queue_config, queue) in config.queues.iter().zip(queues) {
        dispatchers.push(dispatcher(
            config,
            queue_config,
            queue,
            gateway.clone(),
            &metrics,
        )?);
    }
    let addr = config.telemetry.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Listen { addr, source })?;
    let telemetry_addr = listener
        .local_addr()
        .map_err(|source| AppError::Listen { addr, source })?;

    let telemetry_stop = CancellationToken::new();
    let server = {
        let stop = telemetry_stop.clone();
        tokio::spawn(crate::telemetry::serve(
            listener,
            metrics.clone(),
            health.clone(),
            async move { stop.cancelled().await },
        ))
    };
    let statuses: Vec<(Arc<dyn Queue>, crate::telemetry::QueueMetrics)> = dispatchers
        .iter()
        .map(|d| (d.queue.clone(), d.metrics.clone()))
        .collect();
    let runs: Vec<_> = dispatchers
        .into_iter()
        .map(|d| tokio::spawn(d.run(shutdown.child_token())))
        .collect();
    health.set_ready(all_reachable(&statuses));
    let watcher = tokio::spawn(watch_transports(statuses, health.clone(), shutdown.clone()));
    tracing::info!(%telemetry_addr, queues = runs.len(), "sluicegate started");

    let task = {
        let health = health.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            // The watcher stops at once; after it, nothing sets ready again.
            let _ = watcher.await;
            health.set_ready(false);
            tracing::info!("shutting down");
            for run in runs {
                let _ = run.await;
            }
            // Telemetry stays up through the drain so it can be watched.
            telemetry_stop.cancel();
            let _ = server.await;
        })
    };
    Ok(Running {
        telemetry_addr,
        metrics,
        health,
        task,
    })
}

/// How often transport status feeds readiness and metrics.
const STATUS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

fn all_reachable(queues: &[(Arc<dyn Queue>, crate::telemetry::QueueMetrics)]) -> bool {
    queues
        .iter()
        .all(|(q, _)| q.status().is_none_or(|s| s.reachable))
}

/// Readiness follows the transports' reachability (not ready while a
/// backend is down); their counters become metrics. Stops at shutdown,
/// which owns readiness from then on.
async fn watch_transports(
    queues: Vec<(Arc<dyn Queue>, crate::telemetry::QueueMetrics)>,
    health: Arc<Health>,
    shutdown: CancellationToken,
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

fn gateway_settings(config: &GatewayConfig) -> Result<GatewaySettings, AppError> {
    let bearer_token = match (&config.token, &config.token_file) {
        (Some(token), _) => Some(token.expose().to_owned()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|source| AppError::SecretFile {
                    key: "gateway.token_file",
                    path: path.display().to_string(),
                    source,
                })?
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    Ok(GatewaySettings {
        attempt_timeout: config.attempt_timeout,
        connect_timeout: config.connect_timeout,
        max_response_bytes: usize::try_from(config.max_response_bytes).unwrap_or(usize::MAX),
        max_idle_per_host: config.max_connections_per_host,
        bearer_token,
        objective_header: config.objective_header.header_name().to_owned(),
        fairness_attribute: config.fairness_attribute.clone().filter(|a| !a.is_empty()),
    })
}

fn dispatcher(
    config: &Config,
    queue_config: &QueueConfig,
    queue: Arc<dyn Queue>,
    gateway: GatewayClient,
    metrics: &Metrics,
) -> Result<QueueDispatcher, AppError> {
    let name = queue_config.queue_name.clone();
    let d = &config.dispatch;
    let target = Target::new(
        queue_config.igw_base_url.expose().as_str(),
        &queue_config.request_path_url,
        queue_config.inference_objective.clone(),
    )
    .map_err(|source| AppError::Target {
        queue: name.clone(),
        source,
    })?;
    let gate =
        build_gate(&queue_config.gate, &GateContext::from_config(config)).map_err(|source| {
            AppError::Gate {
                queue: name.clone(),
                source,
            }
        })?;
    let settings = DispatchSettings {
        unit: queue_config.unit,
        rounding: queue_config.rounding,
        max_sys: queue_config.max_sys,
        poll_interval: d.poll_interval,
        max_staleness: d.max_staleness,
        lease: d.lease,
        receive_wait: d.receive_wait,
        congestion_backoff: d.congestion_backoff,
        wait_requeue_delay: d.wait_requeue_delay,
        shutdown_grace: d.shutdown_grace,
        ..DispatchSettings::default()
    };
    Ok(QueueDispatcher {
        queue,
        gate: Arc::new(FailClosed::new(gate, d.max_staleness)),
        gateway,
        target,
        retry: RetryPolicy {
            initial: d.retry_initial_backoff,
            max: d.retry_max_backoff,
            max_attempts: d.max_attempts,
            jitter: true,
        },
        settings,
        metrics: metrics.queue(&name),
        labels: queue_config.labels.clone(),
    })
}
