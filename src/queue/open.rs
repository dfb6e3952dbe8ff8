//! Opening the configured transport: one queue per `[[queue]]`, in config
//! order, so the wiring never has to check that the two lists match; and
//! the client face of one queue ([`open_client`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, EndpointUrl, QueueConfig, RedisConfig, RedisMode, TransportKind};
use crate::tasks::Tasks;
use crate::telemetry::Metrics;

use super::embedded::{EmbeddedClient, EmbeddedError, EmbeddedQueue};
use super::pubsub::{PubSubClient, PubSubError, PubSubQueue};
use super::redis::{RedisClient, RedisQueue, RedisQueueSettings};
use super::sql::{Db, SqlClient, SqlError, SqlQueue, SqlQueueClient, SqlQueueSettings};
use super::{Client, ClientTarget, MemoryQueue, Queue, TenantLanes};
use crate::redis::{ConnectError, connection, hash_tag, key_slot};

/// Store file of the embedded transport when `[embedded]` names none.
pub const DEFAULT_EMBEDDED_PATH: &str = "sluicegate.db";
/// How long the start-up PING may take before Redis is reported down.
const REDIS_PING_TIMEOUT: Duration = Duration::from_secs(3);

/// The opened queues of one transport: `queues()[i]` serves
/// `config.queues[i]`. The concrete handles stay reachable for what only
/// one transport does (the memory transport's input and output).
#[derive(Debug, Clone)]
pub enum Transports {
    /// In-process queues (tests, `run --input`).
    Memory(Vec<Arc<MemoryQueue>>),
    /// Redis sorted-set queues.
    Redis(Vec<Arc<RedisQueue>>),
    /// Queues in one embedded store file.
    Embedded(Vec<Arc<EmbeddedQueue>>),
    /// Pub/Sub subscriptions sharing one client and result publisher.
    PubSub(Vec<Arc<PubSubQueue>>),
    /// PostgreSQL queues sharing one connection.
    Sql(Vec<Arc<SqlQueue>>),
}

impl Transports {
    /// The queues behind the [`Queue`] contract, in config order.
    pub fn queues(&self) -> Vec<Arc<dyn Queue>> {
        match self {
            Self::Memory(q) => q.iter().map(|q| q.clone() as Arc<dyn Queue>).collect(),
            Self::Redis(q) => q.iter().map(|q| q.clone() as Arc<dyn Queue>).collect(),
            Self::Embedded(q) => q.iter().map(|q| q.clone() as Arc<dyn Queue>).collect(),
            Self::PubSub(q) => q.iter().map(|q| q.clone() as Arc<dyn Queue>).collect(),
            Self::Sql(q) => q.iter().map(|q| q.clone() as Arc<dyn Queue>).collect(),
        }
    }

    /// Which transport these are.
    pub fn kind(&self) -> TransportKind {
        match self {
            Self::Memory(_) => TransportKind::Memory,
            Self::Redis(_) => TransportKind::Redis,
            Self::Embedded(_) => TransportKind::Embedded,
            Self::PubSub(_) => TransportKind::PubSub,
            Self::Sql(_) => TransportKind::Sql,
        }
    }

    /// The memory queues; empty for other transports.
    pub fn memory(&self) -> &[Arc<MemoryQueue>] {
        match self {
            Self::Memory(q) => q,
            Self::Redis(_) | Self::Embedded(_) | Self::PubSub(_) | Self::Sql(_) => &[],
        }
    }

    /// The Redis queues; empty for other transports.
    pub fn redis(&self) -> &[Arc<RedisQueue>] {
        match self {
            Self::Redis(q) => q,
            Self::Memory(_) | Self::Embedded(_) | Self::PubSub(_) | Self::Sql(_) => &[],
        }
    }
}

/// Why the configured transport could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The transport is accepted by the config but not implemented yet.
    #[error("transport: `{}` is not built yet; available: memory, redis, embedded, pubsub, sql", .0.as_str())]
    NotBuilt(TransportKind),
    /// The Redis client could not be built from `[redis]`.
    #[error(transparent)]
    Redis(#[from] ConnectError),
    /// The embedded store could not be opened.
    #[error("embedded.path: {0}")]
    Embedded(#[source] EmbeddedError),
    /// On a Redis Cluster, a queue's result list must share the queue's
    /// hash slot, or writing the result and settling the message could
    /// not be one atomic step (exactly one result per request).
    #[error(
        "queue `{queue}`: result_queue_name: with redis.cluster = true, set it to a list in the queue's hash slot, e.g. `{{{tag}}}:results` for the queue `{{{tag}}}`{got}"
    )]
    ClusterSlot {
        /// The queue name.
        queue: String,
        /// A hash tag to suggest.
        tag: String,
        /// What was configured, for the message.
        got: String,
    },
    /// The Pub/Sub client, result topic or a subscription could not be
    /// opened.
    #[error(transparent)]
    PubSub(#[from] PubSubError),
    /// The PostgreSQL database could not be reached or its schema
    /// created.
    #[error(transparent)]
    Sql(#[from] SqlError),
    /// The configuration does not say where this transport's client
    /// writes and reads.
    #[error(
        "transport: `{}` has no client opened from the config (memory queues live in their process; Pub/Sub needs a request topic and a result subscription)",
        .0.as_str()
    )]
    NoClient(TransportKind),
}

/// Opens one queue per `[[queue]]` on the configured transport. Redis is
/// not waited for: an unreachable server is logged, and the transport
/// retries in the background (readiness follows it). Pub/Sub checks that
/// the result topic and every subscription exist: a missing one stops
/// startup naming its key. `metrics` receives transport metrics.
pub async fn open(
    config: &Config,
    tasks: &Tasks,
    metrics: &Metrics,
) -> Result<Transports, OpenError> {
    // Tenant lanes where the transport files them itself (Redis reads the
    // same settings in `open_redis`; Pub/Sub has none).
    let lanes = (config.gateway.fairness_attribute.clone()).map(|attribute| TenantLanes {
        attribute,
        weights: config.dispatch.tenant_weights.clone(),
    });
    match config.transport {
        TransportKind::Memory => Ok(Transports::Memory(
            config
                .queues
                .iter()
                .map(|q| Arc::new(MemoryQueue::with_lanes(q.queue_name.clone(), lanes.clone())))
                .collect(),
        )),
        TransportKind::Redis => open_redis(config, tasks).await,
        TransportKind::Embedded => {
            let path = embedded_path(config);
            let mut queues = Vec::with_capacity(config.queues.len());
            for q in &config.queues {
                let queue =
                    EmbeddedQueue::open_with_lanes(&path, q.queue_name.clone(), lanes.clone())
                        .map_err(OpenError::Embedded)?;
                queues.push(Arc::new(queue));
            }
            Ok(Transports::Embedded(queues))
        }
        TransportKind::PubSub => open_pubsub(config, tasks, metrics).await,
        TransportKind::Sql => open_sql(config, lanes).await,
    }
}

/// The client target of `queue` on the configured transport: the same
/// queue, result list or route and store as the dispatcher's.
pub fn client_target(config: &Config, queue: &QueueConfig) -> Result<ClientTarget, OpenError> {
    let name = queue.queue_name.clone();
    match config.transport {
        TransportKind::Redis => Ok(ClientTarget::Redis {
            config: config.redis.clone().unwrap_or_else(default_redis_config),
            queue: name,
            result_list: queue.result_queue_name.clone(),
            fairness_attribute: config.gateway.fairness_attribute.clone(),
        }),
        TransportKind::Embedded => Ok(ClientTarget::Embedded {
            path: embedded_path(config),
            queue: name,
            create: true,
        }),
        TransportKind::Sql => {
            // Config loading requires [sql] url for this transport; the
            // defaults only keep this total.
            let sql = config.sql.clone().unwrap_or_default();
            Ok(ClientTarget::Sql {
                url: sql.url.clone().ok_or(SqlError::MissingUrl)?,
                connect_timeout: sql.connect_timeout,
                queue: name,
                // Precedence queue > [sql], as the dispatcher routes them.
                route: (queue.result_queue_name.clone()).unwrap_or(sql.result_queue_name),
                fairness_attribute: config.gateway.fairness_attribute.clone(),
            })
        }
        kind @ (TransportKind::Memory | TransportKind::PubSub) => Err(OpenError::NoClient(kind)),
    }
}

/// Opens the client face of the queue `target` names. Redis connects
/// lazily (an unreachable server is an error of the first call); the
/// others connect or open their store here.
pub async fn open_client(target: ClientTarget) -> Result<Arc<dyn Client>, OpenError> {
    Ok(match target {
        ClientTarget::Memory(queue) => queue,
        ClientTarget::Redis {
            config,
            queue,
            result_list,
            fairness_attribute,
        } => Arc::new(RedisClient::new(
            connection(&config)?,
            queue,
            result_list,
            fairness_attribute,
        )),
        ClientTarget::Embedded {
            path,
            queue,
            create,
        } => {
            let opened = match create {
                true => EmbeddedQueue::open(&path, queue),
                false => EmbeddedQueue::open_existing(&path, queue),
            };
            Arc::new(EmbeddedClient::new(opened.map_err(OpenError::Embedded)?))
        }
        ClientTarget::PubSub {
            config,
            topic,
            subscription,
        } => {
            let client = super::pubsub::connect(&config).await?;
            Arc::new(PubSubClient::new(&client, topic, subscription))
        }
        ClientTarget::Sql {
            url,
            connect_timeout,
            queue,
            route,
            fairness_attribute,
        } => {
            let client = SqlClient::open(&url, connect_timeout).await?;
            Arc::new(SqlQueueClient::new(client, queue, route).in_lanes(fairness_attribute))
        }
    })
}

/// The embedded store file `[embedded]` names, or the default.
fn embedded_path(config: &Config) -> PathBuf {
    (config.embedded.as_ref())
        .map_or_else(|| PathBuf::from(DEFAULT_EMBEDDED_PATH), |e| e.path.clone())
}

/// Opens the `[sql]` database once (creating the schema) and one queue per
/// `[[queue]]` on it. Unlike Redis, an unreachable database stops
/// startup: the schema must exist before anything is claimed.
async fn open_sql(config: &Config, lanes: Option<TenantLanes>) -> Result<Transports, OpenError> {
    // Config loading requires [sql] url for this transport; the defaults
    // only keep this total.
    let sql = config.sql.clone().unwrap_or_default();
    let url = sql.url.clone().ok_or(SqlError::MissingUrl)?;
    let db = Db::open(&url, &sql.tls_keys(), sql.connect_timeout).await?;
    tracing::info!(url = %db.masked_url(), "postgresql reachable; sql schema ready");
    let queues = config
        .queues
        .iter()
        .map(|q| {
            let mut settings = SqlQueueSettings::new(q.queue_name.clone());
            // Precedence queue > [sql]: the queue's own result route wins.
            settings.route =
                (q.result_queue_name.clone()).unwrap_or_else(|| sql.result_queue_name.clone());
            settings.result_ttl_seconds =
                (q.result_ttl_seconds > 0).then_some(q.result_ttl_seconds);
            settings.poll_interval = sql.poll_interval;
            settings.batch_size = sql.batch_size;
            settings.lease_ttl = sql.lease_ttl;
            settings.lanes = lanes.clone();
            Arc::new(SqlQueue::new(db.clone(), settings))
        })
        .collect();
    Ok(Transports::Sql(queues))
}

async fn open_pubsub(
    config: &Config,
    tasks: &Tasks,
    metrics: &Metrics,
) -> Result<Transports, OpenError> {
    // Config loading requires [pubsub] with project_id and result_topic_id
    // for this transport; the defaults only keep this total.
    let pubsub = config.pubsub.clone().unwrap_or_default();
    let result_topic = pubsub.result_topic_id.clone().unwrap_or_default();
    let client = super::pubsub::connect(&pubsub).await?;
    let exists = client
        .topic(&result_topic)
        .exists(None)
        .await
        .map_err(|source| PubSubError::Rpc {
            op: "get topic",
            name: result_topic.clone(),
            source,
        })?;
    if !exists {
        return Err(PubSubError::Missing {
            key: "pubsub.result_topic_id",
            what: "topic",
            name: result_topic,
            project: pubsub.project_id,
        }
        .into());
    }
    let results = super::pubsub::result_publisher(&client, &result_topic);
    let mut queues = Vec::with_capacity(config.queues.len());
    for q in &config.queues {
        let queue = PubSubQueue::open(
            &client,
            &q.queue_name,
            results.clone(),
            &pubsub.project_id,
            (&pubsub).into(),
            metrics.pubsub(&q.queue_name),
            tasks,
        )
        .await?;
        tracing::info!(subscription = %q.queue_name, topic = %result_topic, "pubsub subscription opened");
        queues.push(Arc::new(queue));
    }
    Ok(Transports::PubSub(queues))
}

/// `[redis]` when the config names none: local Redis, database 0.
pub fn default_redis_config() -> RedisConfig {
    RedisConfig {
        // A constant, valid URL: parsing cannot fail.
        url: EndpointUrl::new(
            url::Url::parse("redis://127.0.0.1:6379/0").unwrap_or_else(|_| unreachable!()),
        ),
        username: None,
        password: None,
        password_file: None,
        cluster: false,
        ..RedisConfig::default()
    }
}

async fn open_redis(config: &Config, tasks: &Tasks) -> Result<Transports, OpenError> {
    let redis_config = config.redis.clone().unwrap_or_else(default_redis_config);
    if redis_config.cluster {
        check_cluster_slots(config)?;
    }
    let conn = connection(&redis_config)?;
    let url = redis_config.url.expose();
    // host:port, as the client reports it: never the credentials. Behind
    // Sentinel, the master's name and the sentinels asked for it.
    let addr = match redis_config.mode {
        RedisMode::Sentinel => format!(
            "master `{}` via sentinels {}",
            redis_config.master_name.as_deref().unwrap_or_default(),
            redis_config.addrs.join(",")
        ),
        _ => format!(
            "{}:{}",
            url.host_str().unwrap_or_default(),
            url.port().unwrap_or(6379)
        ),
    };
    let mut probe = conn.clone();
    let ping = tokio::time::timeout(
        REDIS_PING_TIMEOUT,
        redis::cmd("PING").query_async::<String>(&mut probe),
    )
    .await;
    match ping {
        Ok(Ok(_)) => tracing::info!(%addr, "redis reachable"),
        Ok(Err(error)) => tracing::error!(
            "redis at {addr} is unreachable: {error}; retrying in the background, not ready until it answers"
        ),
        Err(_) => tracing::error!(
            "redis at {addr} did not answer within {}s; retrying in the background, not ready until it answers",
            REDIS_PING_TIMEOUT.as_secs()
        ),
    }
    let queues = config
        .queues
        .iter()
        .map(|q| {
            let mut settings = RedisQueueSettings::new(q.queue_name.clone());
            // Precedence queue > message > default: only a list the queue
            // names overrides the message's.
            settings.result_list = q.result_queue_name.clone();
            settings.result_ttl_seconds = q.result_ttl_seconds;
            settings.cluster = redis_config.cluster;
            settings.fairness_attribute = config.gateway.fairness_attribute.clone();
            settings.tenant_weights = config.dispatch.tenant_weights.clone();
            Arc::new(RedisQueue::start(conn.clone(), settings, tasks))
        })
        .collect();
    Ok(Transports::Redis(queues))
}

/// Every queue's result list is named on the queue and hashes to the
/// queue's slot (the queue name's `{tag}`, or the whole name).
fn check_cluster_slots(config: &Config) -> Result<(), OpenError> {
    for q in &config.queues {
        let name = &q.queue_name;
        let ok = q
            .result_queue_name
            .as_deref()
            .is_some_and(|list| key_slot(list) == key_slot(name));
        if !ok {
            let tag = hash_tag(name).unwrap_or(name).to_owned();
            let got = match q.result_queue_name.as_deref() {
                Some(list) => format!(" (`{list}` is in another slot)"),
                None => " (none is set)".to_owned(),
            };
            return Err(OpenError::ClusterSlot {
                queue: name.clone(),
                tag,
                got,
            });
        }
    }
    Ok(())
}
