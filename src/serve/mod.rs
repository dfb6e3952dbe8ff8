//! `sluicegate serve`: the OpenAI Files and Batches API in front of the
//! queue (`docs/batch-api.md`). A batch's requests become queue messages
//! like any other, so the gate paces them and interactive users stay
//! protected; their results come back through the queue and become the
//! batch's output and error files.
//!
//! Files, one role each: `model` (records and the OpenAI shapes), `auth`
//! (API keys → tenants), `files` (bodies on disk, bounded line reads),
//! `store` (records and results: SQLite or Redis), `sink` (enqueue and
//! cancel on the configured queue), `engine` (validation, collection,
//! expiry, cancel, finalizing), `quota` (per-tenant limits on enqueued
//! work), `retention` (file expiry and its
//! sweeper), `order` (the order a batch's lines are enqueued in:
//! arrival, or by model and shared prompt prefix), `http` (the endpoints).
//! One request at a time (`docs/flex.md`): `flex` (flex requests and the
//! inference routes), `replies` (reply routes to held connections),
//! `background` (background response records), `responses` (their
//! creation and endpoints), `passthrough` (`serve.passthrough`). This
//! file wires them for [`start`].

pub mod auth;
pub mod background;
pub mod engine;
pub mod files;
pub mod flex;
pub mod http;
pub mod idempotency;
pub mod model;
pub mod order;
pub mod passthrough;
pub mod quota;
pub mod replies;
pub mod responses;
pub mod retention;
pub mod sink;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use reqwest::header::HeaderName;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::{AppError, RunOptions, Running};
use crate::config::{Config, ServeConfig, ServeDispatcher, TransportKind};
use crate::queue::{OpenError, client_target, open_client};
use crate::redis::{ConnectError, hash_tag, key_slot};
use crate::tasks::Tasks;
use crate::telemetry::{Health, Metrics};

use self::auth::{Keys, KeysError};
use self::engine::{Engine, Limits};
use self::files::Bodies;
use self::flex::{Flex, FlexSettings};
use self::replies::{HeldLimits, Replies};
use self::retention::{Retention, Sweeper};
use self::sink::Sink;
use self::store::{RedisStore, SqliteStore, Store, StoreError};

/// Store file of the embedded deployment, in `serve.data_dir`.
const STORE_FILE: &str = "batches.db";

/// Why the server could not start or failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// No API keys and a listen address other hosts can reach.
    #[error(
        "serve.listen: {0} is not a loopback address and no API keys are configured; set serve.api_keys_file or SLUICEGATE_SERVE_API_KEYS (tenant:key entries), or listen on 127.0.0.1"
    )]
    Unauthenticated(SocketAddr),
    /// The key list is unusable.
    #[error(transparent)]
    Keys(#[from] KeysError),
    /// `serve.tenant_limits` overrides a tenant no API key has (a typo
    /// would leave the real tenant on the default limits).
    #[error(
        "serve.tenant_limits.tenants: no API key has tenant `{tenant}`; the tenants are: {known}"
    )]
    LimitTenant {
        /// The tenant named.
        tenant: String,
        /// The tenants of the keys.
        known: String,
    },
    /// A `serve.pass_headers` entry that cannot be passed to the gateway.
    #[error(
        "serve.pass_headers: `{name}` cannot be passed to the gateway ({why}); allowed: legal header names other than framing, routing, credential and content-type headers"
    )]
    PassHeader {
        /// The entry.
        name: String,
        /// Why not.
        why: &'static str,
    },
    /// The transport cannot carry batches.
    #[error(
        "transport: `{0}` cannot serve the Batch API; allowed: embedded (one node), redis (replicas)"
    )]
    Transport(&'static str),
    /// On a Redis Cluster the result list must share the queue's hash
    /// slot (the dispatcher writes the result and settles the message in
    /// one script).
    #[error(
        "queue `{queue}`: result_queue_name: with redis.cluster = true, `serve` needs the queue to name a result list in its hash slot, e.g. `{{{tag}}}:results` for the queue `{{{tag}}}` (serve.result_list `{list}` is not used on a cluster)"
    )]
    ClusterResultList {
        /// The queue.
        queue: String,
        /// Its hash tag, for the suggestion.
        tag: String,
        /// `serve.result_list`.
        list: String,
    },
    /// `serve.queue` names no `[[queue]]`.
    #[error("serve.queue: no queue named `{name}`; configured: {known}")]
    Queue {
        /// The name given.
        name: String,
        /// The configured names.
        known: String,
    },
    /// The data directory is unusable.
    #[error("serve.data_dir: {path}: {source}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The queue's client could not be opened.
    #[error(transparent)]
    OpenQueue(#[from] OpenError),
    /// The Redis client could not be built.
    #[error(transparent)]
    Redis(#[from] ConnectError),
    /// An address could not be bound.
    #[error("{key}: cannot listen on {addr}: {source}")]
    Listen {
        /// `serve.listen` or `telemetry.listen`.
        key: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// The in-process dispatcher failed to start or while running.
    #[error(transparent)]
    App(#[from] AppError),
}

impl ServeError {
    /// The process exit code: 2 when it could not start, 1 when it failed
    /// while running.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::App(e) => e.exit_code(),
            _ => crate::app::EXIT_CONFIG,
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// Where the API is served.
    pub addr: SocketAddr,
    /// Where `/metrics` is served.
    pub telemetry_addr: SocketAddr,
    /// The process metrics (the Batch API's among them).
    pub metrics: Arc<Metrics>,
    stop: CancellationToken,
    tasks: Tasks,
    app: Option<Running>,
}

/// The API keys, and the rule that without keys only a loopback address
/// may serve, and that `serve.tenant_limits` overrides name tenants the
/// keys have: checked by `serve` at start and by `check-config`, so the
/// two never disagree (issue 22).
pub fn check_access(serve: &ServeConfig) -> Result<Keys, ServeError> {
    let keys = Keys::load(
        serve.api_keys.as_ref().map(|s| s.expose()),
        serve.api_keys_file.as_deref(),
    )?;
    if keys.is_empty() && !http::is_loopback(&serve.listen) {
        return Err(ServeError::Unauthenticated(serve.listen));
    }
    pass_headers(serve)?;
    let known = keys.tenants();
    if let Some(tenant) = (serve.tenant_limits.tenants.keys()).find(|t| !known.contains(t)) {
        return Err(ServeError::LimitTenant {
            tenant: tenant.clone(),
            known: known.join(", "),
        });
    }
    Ok(keys)
}

/// `serve.pass_headers` as header names, each one the gateway client may
/// send.
fn pass_headers(serve: &ServeConfig) -> Result<Vec<HeaderName>, ServeError> {
    serve
        .pass_headers
        .iter()
        .map(|name| {
            let refuse = |why| ServeError::PassHeader {
                name: name.clone(),
                why,
            };
            let header = HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| refuse("not a header name"))?;
            if !crate::headers::may_pass_through(&header) {
                return Err(refuse("the gateway client sets or refuses it"));
            }
            Ok(header)
        })
        .collect()
}

/// `config` with a relative `[embedded] path` taken inside
/// `serve.data_dir`: everything `serve` persists lives under its data
/// directory, so a restart from another working directory finds the
/// queued requests beside the batch records (issue 26: it found the
/// records and not the requests, and the batch never finished).
///
/// With `serve.dispatcher = separate` the path stays as configured: the
/// separate `run` process, which knows no data directory, must open the
/// same file.
fn queue_under_data_dir(config: &Config, serve: &ServeConfig) -> Config {
    let mut config = config.clone();
    if config.transport == TransportKind::Embedded && serve.dispatcher == ServeDispatcher::InProcess
    {
        let mut embedded = config.embedded.take().unwrap_or_default();
        if embedded.path.is_relative() {
            embedded.path = serve.data_dir.join(&embedded.path);
        }
        config.embedded = Some(embedded);
    }
    config
}

/// Opens the store and the queue, starts the dispatcher (unless
/// `serve.dispatcher = separate`), the lifecycle loops and the API;
/// returns once it serves. [`Server::wait`] runs until `shutdown`.
pub async fn start(
    config: &Config,
    serve: &ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Server, ServeError> {
    let keys = check_access(serve)?;
    let config = &queue_under_data_dir(config, serve);
    if !matches!(
        config.transport,
        TransportKind::Embedded | TransportKind::Redis
    ) {
        return Err(ServeError::Transport(config.transport.as_str()));
    }
    let queue_config = match &serve.queue {
        None => config.queues.first(),
        Some(name) => config.queues.iter().find(|q| &q.queue_name == name),
    }
    .ok_or_else(|| ServeError::Queue {
        name: serve.queue.clone().unwrap_or_default(),
        known: (config.queues.iter())
            .map(|q| q.queue_name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let data_dir_error = |source| ServeError::DataDir {
        path: serve.data_dir.clone(),
        source,
    };
    std::fs::create_dir_all(&serve.data_dir).map_err(data_dir_error)?;
    let bodies = Bodies::open(&serve.data_dir).map_err(data_dir_error)?;

    // Every loop runs on the task tree: one that panics is logged by name
    // and stops the server (its drain token is `stop`), instead of the API
    // answering while, say, the collector is dead.
    let tasks = Tasks::new();
    let stop = tasks.drain_token().clone();
    {
        let stop = stop.clone();
        tasks.spawn("serve: shutdown signal", async move {
            tokio::select! {
                () = shutdown => stop.cancel(),
                () = stop.cancelled() => {}
            }
        });
    }
    // The streamed flex requests this server holds: a dispatcher in
    // process relays their answers here directly (`crate::relay`).
    let relay = Arc::new(crate::relay::local::LocalRelay::default());
    let (app, metrics, telemetry_addr) = match serve.dispatcher {
        ServeDispatcher::InProcess => {
            let running = crate::app::start(
                config,
                RunOptions {
                    relay: Some(relay.clone()),
                    ..RunOptions::default()
                },
                stop.clone().cancelled_owned(),
            )
            .await?;
            let (metrics, addr) = (running.metrics.clone(), running.telemetry_addr);
            (Some(running), metrics, addr)
        }
        ServeDispatcher::Separate => {
            let metrics = Arc::new(Metrics::new());
            let health = Arc::new(Health::default());
            health.set_ready(true);
            let addr = config.telemetry.listen;
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Listen {
                    key: "telemetry.listen",
                    addr,
                    source,
                })?;
            let local = listener.local_addr().unwrap_or(addr);
            let server = crate::telemetry::serve(
                listener,
                metrics.clone(),
                health,
                stop.clone().cancelled_owned(),
            );
            tasks.spawn("serve: telemetry server", async move {
                if let Err(error) = server.await {
                    tracing::error!(%error, "telemetry server failed");
                }
            });
            (None, metrics, local)
        }
    };

    let limits = Limits {
        in_flight_grace: config.gateway.attempt_timeout,
        max_file_bytes: serve.max_file_bytes,
        max_line_bytes: serve.max_line_bytes,
        max_lines: serve.max_lines_per_batch,
        retention: Retention::new(serve.file_retention),
        intake_chunk: usize::try_from(serve.intake_chunk).unwrap_or(usize::MAX),
        takeover_after: serve.takeover_after,
    };
    let fairness = config.gateway.fairness_attribute.clone();
    let queue_name = queue_config.queue_name.clone();
    // The queue is reached through its client, whatever the transport;
    // only the store of records differs: Redis beside a Redis queue (so
    // replicas share it), SQLite beside an embedded one.
    let target = client_target(config, queue_config)?.or_result_list(&serve.result_list);
    let store = match config.transport {
        TransportKind::Redis => {
            let redis_config = config
                .redis
                .clone()
                .unwrap_or_else(crate::queue::default_redis_config);
            let list = (queue_config.result_queue_name.clone())
                .unwrap_or_else(|| serve.result_list.clone());
            // As `run` checks at start (also for `dispatcher = separate`,
            // whose `run` would refuse the same config).
            if redis_config.cluster
                && (queue_config.result_queue_name.is_none()
                    || key_slot(&list) != key_slot(&queue_name))
            {
                return Err(ServeError::ClusterResultList {
                    queue: queue_name,
                    tag: hash_tag(&queue_config.queue_name)
                        .unwrap_or(&queue_config.queue_name)
                        .to_owned(),
                    list: serve.result_list.clone(),
                });
            }
            let conn = crate::redis::connection(&redis_config)?;
            // Answers a dispatcher elsewhere relays come through the
            // queue's streams, read on a connection of their own
            // (`XREAD BLOCK` holds it).
            let reader = crate::redis::connection(&redis_config)?;
            tasks.spawn(
                "serve: stream relay reader",
                crate::relay::redis::read_loop(
                    relay.clone(),
                    reader,
                    queue_name.clone(),
                    stop.clone(),
                ),
            );
            Store::Redis(RedisStore::new(conn, serve.key_prefix.clone()))
        }
        _ => Store::Sqlite(SqliteStore::open(&serve.data_dir.join(STORE_FILE))?),
    };
    let client = open_client(target).await?;
    let sink = Sink::new(client, store.intake_mark_prefix());
    let flex = Arc::new(Flex::new(
        sink.clone(),
        Arc::new(Replies::new(HeldLimits {
            total: serve.flex_max_held,
            per_tenant: serve.flex_max_held_per_tenant,
        })),
        relay,
        FlexSettings {
            max_wait: serve.flex_max_wait,
            attempt_grace: config.gateway.attempt_timeout,
            background_total: serve.background_max_total,
            background_per_tenant: serve.background_max_per_tenant,
            keep_secs: i64::try_from(serve.file_retention.as_secs()).unwrap_or(i64::MAX),
            fairness: config.gateway.fairness_attribute.clone(),
            passthrough: (serve.passthrough).then(|| queue_config.igw_base_url.to_string()),
            max_body: usize::try_from(serve.max_line_bytes).unwrap_or(usize::MAX),
        },
        metrics.flex(&queue_config.queue_name),
    ));
    let engine = Arc::new(
        Engine::new(
            store,
            bodies,
            sink,
            limits,
            fairness,
            metrics.batch_api(&queue_config.queue_name),
            tasks.clone(),
        )
        .with_tenant_limits(serve.tenant_limits.clone()),
    );
    let _ = engine.flex.set(flex.clone());
    tasks.spawn(
        "serve: flex probe",
        flex.clone().probe(engine.store.clone(), stop.clone()),
    );
    tasks.spawn(
        "serve: background responses",
        flex.clone().resume(engine.store.clone(), stop.clone()),
    );
    tasks.spawn(
        "serve: result collector",
        engine.clone().collect(stop.clone()),
    );
    tasks.spawn(
        "serve: batch sweeps",
        engine.clone().run_sweeps(stop.clone()),
    );
    let sweeper = Sweeper {
        store: engine.store.clone(),
        bodies: engine.bodies.clone(),
        metrics: metrics.batch_api(&queue_config.queue_name),
        every: limits.retention.sweep_every(),
    };
    tasks.spawn("serve: retention sweeper", sweeper.run(stop.clone()));

    let listener = TcpListener::bind(serve.listen)
        .await
        .map_err(|source| ServeError::Listen {
            key: "serve.listen",
            addr: serve.listen,
            source,
        })?;
    let addr = listener.local_addr().unwrap_or(serve.listen);
    let pass_headers = pass_headers(serve)?;
    let state = Arc::new(http::AppState {
        engine,
        keys,
        pass_headers,
        order: serve.order.into(),
        // Validated when the configuration was loaded.
        endpoints: crate::endpoint::Endpoints::new(&serve.endpoints).unwrap_or_default(),
    });
    let router = http::router(state.clone()).merge(flex::router(state, flex));
    let graceful = stop.clone().cancelled_owned();
    tasks.spawn("serve: batch api server", async move {
        if let Err(error) = axum::serve(listener, router)
            .with_graceful_shutdown(graceful)
            .await
        {
            tracing::error!(%error, "batch api server failed");
        }
    });
    tracing::info!(%addr, %telemetry_addr, "batch api serving");
    Ok(Server {
        addr,
        telemetry_addr,
        metrics,
        stop,
        tasks,
        app,
    })
}

impl Server {
    /// Stops the server now (as the shutdown future would).
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Runs until shutdown (or a loop panicked), then stops the API and
    /// the loops and drains the in-process dispatcher. A panic is an
    /// error naming the task.
    pub async fn wait(self) -> Result<(), ServeError> {
        self.stop.cancelled().await;
        self.tasks.stop().await;
        if let Some(app) = self.app {
            app.wait().await?;
        }
        let panicked = self.tasks.panicked();
        if !panicked.is_empty() {
            return Err(AppError::Panicked(panicked).into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A server with its in-process dispatcher on an embedded queue in a
    /// fresh directory (removed by the caller), no batches.
    async fn server(dir: &std::path::Path) -> Server {
        let text = format!(
            "transport = \"embedded\"\n[embedded]\npath = \"{}\"\n[gateway]\nurl = \"http://127.0.0.1:9\"\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"batch-api\"\ngate_type = \"constant\"\n",
            dir.join("queue.db").display()
        );
        let config = Config::from_toml_str(&text, &Default::default()).expect("config loads");
        let serve = ServeConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            data_dir: dir.join("data"),
            ..ServeConfig::default()
        };
        start(&config, &serve, std::future::pending())
            .await
            .expect("the server starts")
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sluicegate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[tokio::test]
    async fn a_panicking_serve_task_fails_the_run_and_is_named() {
        let dir = fresh_dir("serve-panic");
        let server = server(&dir).await;
        server
            .tasks
            .spawn("serve: a loop that panics", async { panic!("boom") });
        // The panic starts the drain by itself: no shutdown is asked for.
        let result = tokio::time::timeout(Duration::from_secs(60), server.wait())
            .await
            .expect("the panic stopped the server");
        let _ = std::fs::remove_dir_all(&dir);
        match result {
            Err(ServeError::App(AppError::Panicked(names))) => {
                assert_eq!(names, vec!["serve: a loop that panics".to_owned()]);
            }
            other => panic!("expected a named panic, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_shutdown_ends_every_loop() {
        let dir = fresh_dir("serve-shutdown");
        let server = server(&dir).await;
        server.shutdown();
        // Every loop (collector, sweeps, retention sweeper, API, the
        // dispatcher's) selects on the drain: `wait` returns, cleanly.
        let result = tokio::time::timeout(Duration::from_secs(60), server.wait())
            .await
            .expect("every loop ended after the shutdown");
        let _ = std::fs::remove_dir_all(&dir);
        result.expect("a clean stop");
    }
}
