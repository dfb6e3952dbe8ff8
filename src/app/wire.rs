//! Building the parts of a run: pools, dispatchers, shared windows.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::{Config, QueueConfig, SharedWindowKind};
use crate::dispatch::congestion::CongestionHold;
use crate::dispatch::shared_window::{SharedWindow, SharedWindowSettings};
use crate::dispatch::{DispatchSettings, Pool, QueueDispatcher, RetryPolicy};
use crate::gate::{DispatchGate, FailClosed};
use crate::gateway::{GatewayClient, Target};
use crate::queue::Queue;
use crate::tasks::Tasks;
use crate::telemetry::{Health, Metrics};

use super::AppError;

/// What the queues of one pool share in this process.
#[derive(Debug)]
pub(super) struct PoolParts {
    pub(super) pool: Arc<Pool>,
    pub(super) congestion: Arc<CongestionHold>,
    pub(super) slots: Arc<std::sync::atomic::AtomicUsize>,
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
        relay: crate::relay::Relay::default(),
    })
}

/// Creates every pool's shared-window metrics (at zero when the shared
/// window is off) and, with `dispatch.shared_window = "redis"`, spawns one
/// keeper per pool. The keepers stop with the task tree's root, after the
/// dispatchers drained, and give their units back then.
pub(super) fn start_shared_windows(
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
    let conn = crate::redis::connection(&redis).map_err(AppError::SharedWindow)?;
    let settings = SharedWindowSettings {
        lease: config.dispatch.shared_window_lease,
        chunk: config.dispatch.shared_window_chunk,
        max_staleness: config.dispatch.max_staleness,
        orphan_hold: config.gateway.attempt_timeout,
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
