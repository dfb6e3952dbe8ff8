//! Connection flags the producer tools and benchmarks share (Redis,
//! Pub/Sub, PostgreSQL), and opening a queue client from them.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::config::{EndpointUrl, PubSubConfig, RedisConfig, RedisMode, Secret, read_secret_file};
use crate::queue::{Client, ClientTarget, OpenError, open_client};
use crate::redis::{RedisConnection, connection};

/// How long connecting to PostgreSQL may take.
const SQL_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Redis is.
#[derive(Debug, Args)]
pub(super) struct RedisArgs {
    /// Redis URL (`redis://` or `rediss://`, database number in the path).
    #[arg(
        long,
        env = "SLUICEGATE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    redis_url: String,
    /// Redis ACL user.
    #[arg(long, env = "SLUICEGATE_REDIS_USERNAME")]
    redis_username: Option<String>,
    /// Redis password (prefer the environment or a file).
    #[arg(long, env = "SLUICEGATE_REDIS_PASSWORD", hide_env_values = true)]
    redis_password: Option<String>,
    /// File holding the Redis password.
    #[arg(long, env = "SLUICEGATE_REDIS_PASSWORD_FILE")]
    redis_password_file: Option<PathBuf>,
    /// `--redis-url` is a seed node of a Redis Cluster.
    #[arg(long, env = "SLUICEGATE_REDIS_CLUSTER")]
    redis_cluster: bool,
    /// How Redis is deployed: standalone, cluster or sentinel (then
    /// `--redis-url` gives only the scheme, database and credentials).
    #[arg(long, env = "SLUICEGATE_REDIS_MODE", default_value = "standalone")]
    redis_mode: String,
    /// The sentinels (or more cluster seeds), comma-separated `host:port`.
    #[arg(long, env = "SLUICEGATE_REDIS_ADDRS", value_delimiter = ',')]
    redis_addrs: Vec<String>,
    /// The master's name at the sentinels.
    #[arg(long, env = "SLUICEGATE_REDIS_MASTER_NAME")]
    redis_master_name: Option<String>,
    /// ACL user for the sentinels.
    #[arg(long, env = "SLUICEGATE_REDIS_SENTINEL_USERNAME")]
    redis_sentinel_username: Option<String>,
    /// Password for the sentinels (prefer the environment or a file).
    #[arg(
        long,
        env = "SLUICEGATE_REDIS_SENTINEL_PASSWORD",
        hide_env_values = true
    )]
    redis_sentinel_password: Option<String>,
    /// File holding the sentinels' password.
    #[arg(long, env = "SLUICEGATE_REDIS_SENTINEL_PASSWORD_FILE")]
    redis_sentinel_password_file: Option<PathBuf>,
}

impl RedisArgs {
    /// The connection settings these flags describe.
    pub(super) fn config(&self) -> Result<RedisConfig, String> {
        let url = url::Url::parse(&self.redis_url).map_err(|e| format!("--redis-url: {e}"))?;
        let password = match (&self.redis_password, &self.redis_password_file) {
            (Some(p), _) => Some(Secret::new(p.clone())),
            (None, Some(path)) => {
                Some(read_secret_file(path).map_err(|e| format!("--redis-password-file: {e}"))?)
            }
            (None, None) => None,
        };
        let sentinel_password = match (
            &self.redis_sentinel_password,
            &self.redis_sentinel_password_file,
        ) {
            (Some(p), _) => Some(Secret::new(p.clone())),
            (None, Some(path)) => Some(
                read_secret_file(path)
                    .map_err(|e| format!("--redis-sentinel-password-file: {e}"))?,
            ),
            (None, None) => None,
        };
        let mode = redis_mode(&self.redis_mode)?;
        if mode == RedisMode::Sentinel {
            if self.redis_master_name.is_none() {
                return Err("--redis-master-name (or SLUICEGATE_REDIS_MASTER_NAME) is required with --redis-mode sentinel".to_owned());
            }
            if self.redis_addrs.is_empty() {
                return Err("--redis-addrs (or SLUICEGATE_REDIS_ADDRS) is required with --redis-mode sentinel: the sentinels, comma-separated host:port".to_owned());
            }
        }
        Ok(RedisConfig {
            url: EndpointUrl::new(url),
            username: self.redis_username.clone(),
            password,
            password_file: self.redis_password_file.clone(),
            cluster: self.redis_cluster || mode == RedisMode::Cluster,
            mode,
            addrs: self.redis_addrs.clone(),
            master_name: self.redis_master_name.clone(),
            sentinel_username: self.redis_sentinel_username.clone(),
            sentinel_password,
            sentinel_password_file: self.redis_sentinel_password_file.clone(),
        })
    }

    /// A lazily connecting connection, or a message for the user.
    pub(super) fn connect(&self) -> Result<RedisConnection, String> {
        connection(&self.config()?).map_err(|e| e.to_string())
    }
}

/// `--redis-mode`: one of [`RedisMode::CHOICES`].
fn redis_mode(text: &str) -> Result<RedisMode, String> {
    crate::values::choice(RedisMode::CHOICES)(&serde_json::Value::String(text.to_owned()))
        .map_err(|e| format!("--redis-mode: {e}"))
}

/// Which Pub/Sub project and credentials.
#[derive(Debug, Args)]
pub(super) struct PubSubArgs {
    /// GCP project (the config's `pubsub.project_id`).
    #[arg(long, env = "SLUICEGATE_PUBSUB_PROJECT_ID")]
    pub(super) pubsub_project: Option<String>,
    /// Emulator `host:port` (anonymous); `PUBSUB_EMULATOR_HOST` works too.
    #[arg(long, env = "SLUICEGATE_PUBSUB_EMULATOR_HOST")]
    pub(super) pubsub_emulator_host: Option<String>,
    /// Service-account key file; default: application default credentials.
    #[arg(long, env = "SLUICEGATE_PUBSUB_CREDENTIALS_FILE")]
    pub(super) pubsub_credentials_file: Option<PathBuf>,
}

impl PubSubArgs {
    /// The `[pubsub]` settings these flags describe.
    pub(super) fn config(&self) -> Result<PubSubConfig, String> {
        let project_id = self
            .pubsub_project
            .clone()
            .ok_or("--pubsub-project (or SLUICEGATE_PUBSUB_PROJECT_ID) is required")?;
        Ok(PubSubConfig {
            project_id,
            result_topic_id: None,
            emulator_host: self.pubsub_emulator_host.clone(),
            credentials_file: self.pubsub_credentials_file.clone(),
            ..PubSubConfig::default()
        })
    }

    /// A Pub/Sub client of the project, or a message for the user.
    pub(super) async fn client(&self) -> Result<gcloud_pubsub::client::Client, String> {
        crate::queue::pubsub::connect(&self.config()?)
            .await
            .map_err(|e| e.to_string())
    }
}

/// `--sql-url`: a `postgres://` or `postgresql://` URL.
fn sql_url(url: &str) -> Result<EndpointUrl, String> {
    match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "postgres" | "postgresql") => Ok(EndpointUrl::new(u)),
        Ok(u) => Err(format!(
            "--sql-url: expected a postgres:// or postgresql:// URL, got scheme {:?}",
            u.scheme()
        )),
        Err(e) => Err(format!("--sql-url: {e}")),
    }
}

/// The store `--embedded PATH` or `--sql-url URL` names, if either is
/// given: `queue` in it, results of the `sql` transport under `route`.
/// Only a producer may `create` a missing embedded store.
pub(super) fn store_target(
    embedded: Option<&PathBuf>,
    sql: Option<&str>,
    queue: &str,
    route: &str,
    create: bool,
) -> Option<Result<ClientTarget, String>> {
    if let Some(path) = embedded {
        return Some(Ok(ClientTarget::Embedded {
            path: path.clone(),
            queue: queue.to_owned(),
            create,
        }));
    }
    let url = sql?;
    Some(sql_url(url).map(|url| ClientTarget::Sql {
        url,
        connect_timeout: SQL_CONNECT_TIMEOUT,
        queue: queue.to_owned(),
        route: route.to_owned(),
        // Readers file nothing; `submit` sets its attribute.
        fairness_attribute: None,
    }))
}

/// Opens the client the flags chose (`target`, or why the flags are
/// wrong), saying on standard error why it cannot: exit 2 for flags and
/// settings, 1 when the queue cannot be reached or opened.
pub(super) async fn open(
    target: Result<ClientTarget, String>,
) -> Result<Arc<dyn Client>, ExitCode> {
    let target = target.map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(super::EXIT_CONFIG)
    })?;
    open_client(target).await.map_err(|e| {
        eprintln!("{e}");
        match e {
            OpenError::Redis(_) => ExitCode::from(super::EXIT_CONFIG),
            _ => ExitCode::FAILURE,
        }
    })
}
