//! Configuration: a TOML file plus an environment overlay (`SLUICEGATE_*`)
//! plus command-line flags, validated into typed structs.
//!
//! Precedence: flag > environment > file > default. Loading collects every
//! problem (unknown keys and variables, unknown gate types, missing or
//! out-of-range values) and fails closed: nothing is guessed, and a typo
//! never becomes an open gate. Secrets are [`Secret`]s and URLs that may
//! hold a password are [`EndpointUrl`]s, so neither appears in `Debug`
//! output, summaries or [`Config::to_redacted_toml`].
//!
//! Files: `raw` (serde shape of the file), `env` (environment and flag
//! overlay), `values` (loose → typed conversions), `gate` ([`GateSpec`]),
//! `validate` (raw → typed), `render` (summary and redacted TOML),
//! `duration`, `secret`, `error`.
//!
//! ```
//! use std::collections::BTreeMap;
//! use sluicegate::config::{Config, ConfigSources, GateSpec, TransportKind};
//!
//! let env: BTreeMap<String, String> = [
//!     ("SLUICEGATE_TRANSPORT", "memory"),
//!     ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
//!     ("SLUICEGATE_GATE_TYPE", "constant"),
//! ]
//! .into_iter()
//! .map(|(k, v)| (k.to_owned(), v.to_owned()))
//! .collect();
//! let config = Config::load(&ConfigSources { env, ..Default::default() }).unwrap();
//! assert_eq!(config.transport, TransportKind::Memory);
//! assert_eq!(config.queues[0].gate, GateSpec::Constant(Default::default()));
//! ```

mod duration;
mod env;
mod error;
mod gate;
mod raw;
mod render;
mod secret;
mod validate;
mod values;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use duration::{format_duration, parse_duration};
pub use env::{CONTRACT_ENV_VARS, ConfigSources, ENV_PREFIX, Overrides, known_env_vars};
pub use error::{ConfigError, ConfigErrors};
pub use gate::{
    GATE_TYPES, GateSpec, GatingMode, MAX_GATE_DEPTH, MissingBudget, QuotaMode, allowed_params,
};
// Loose value conversions the gates' parameter adapters share.
pub use secret::{EndpointUrl, MASKED_PASSWORD, REDACTED, Secret, mask_url};
pub(crate) use values::{
    as_duration, as_f64, as_string, as_string_list, as_string_map, kind, show,
};

/// The effective, validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Which queue transport to consume from.
    pub transport: TransportKind,
    /// How to reach the inference gateway.
    pub gateway: GatewayConfig,
    /// Redis connection, when configured or when `transport = redis`.
    pub redis: Option<RedisConfig>,
    /// Prometheus connection, when configured (required by `prometheus-*` gates).
    pub prometheus: Option<PrometheusConfig>,
    /// Pub/Sub settings, when configured or when `transport = pubsub`.
    pub pubsub: Option<PubSubConfig>,
    /// Embedded store settings, when configured or when `transport = embedded`.
    pub embedded: Option<EmbeddedConfig>,
    /// Dispatch loop timings and retry policy.
    pub dispatch: DispatchConfig,
    /// Metrics/health listener and logging.
    pub telemetry: TelemetryConfig,
    /// The queues to drain; at least one, names unique.
    pub queues: Vec<QueueConfig>,
}

/// Queue transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// In-process queue (tests, demos).
    Memory,
    /// Redis sorted sets, wire-compatible with upstream `redis-sortedset`.
    Redis,
    /// Google Cloud Pub/Sub (`gcp-pubsub` upstream).
    PubSub,
    /// Embedded durable single-node store.
    Embedded,
}

impl TransportKind {
    /// The canonical config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis => "redis",
            Self::PubSub => "pubsub",
            Self::Embedded => "embedded",
        }
    }
}

/// The unit `max_SYS` and the headroom `N` are counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Requests in flight.
    Requests,
    /// Tokens in flight.
    Tokens,
    /// Request body bytes in flight.
    Bytes,
}

impl Unit {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
            Self::Bytes => "bytes",
        }
    }
}

/// How the real-valued headroom `N` becomes a whole number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Round down (default).
    Floor,
    /// Round up.
    Ceil,
    /// Round down, but at least one while the gate is open.
    AtLeastOne,
}

impl Rounding {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Floor => "floor",
            Self::Ceil => "ceil",
            Self::AtLeastOne => "at-least-one",
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

/// Which header carries the queue's inference objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectiveHeader {
    /// `x-gateway-inference-objective` (upstream's name; default).
    Gateway,
    /// `x-llm-d-inference-objective` (newer routers).
    LlmD,
}

impl ObjectiveHeader {
    /// The header name.
    pub fn header_name(self) -> &'static str {
        match self {
            Self::Gateway => "x-gateway-inference-objective",
            Self::LlmD => "x-llm-d-inference-objective",
        }
    }
}

/// `[gateway]`: the inference gateway and the HTTP client's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    /// Default `igw_base_url` for queues that do not set one.
    pub url: Option<EndpointUrl>,
    /// Default `request_path_url` for queues; starts with '/'.
    pub request_path: String,
    /// Ceiling per attempt (each attempt is also bounded by the deadline).
    pub attempt_timeout: Duration,
    /// TCP/TLS connect timeout.
    pub connect_timeout: Duration,
    /// Largest response body read; larger bodies are an error.
    pub max_response_bytes: u64,
    /// Idle connections kept per host.
    pub max_connections_per_host: usize,
    /// Bearer token sent to the gateway.
    pub token: Option<Secret>,
    /// File the token was read from, when given that way.
    pub token_file: Option<PathBuf>,
    /// Header that carries the inference objective.
    pub objective_header: ObjectiveHeader,
    /// Metadata attribute sent as `x-llm-d-inference-fairness-id`; `None` disables.
    pub fairness_attribute: Option<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            url: None,
            request_path: "/v1/completions".to_owned(),
            attempt_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(5),
            max_response_bytes: 16 * 1024 * 1024,
            max_connections_per_host: 256,
            token: None,
            token_file: None,
            objective_header: ObjectiveHeader::Gateway,
            fairness_attribute: Some("userid".to_owned()),
        }
    }
}

/// `[redis]`: connection for the Redis transport and Redis-backed gates.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` URL (a password in it is masked when shown).
    pub url: EndpointUrl,
    /// ACL user name.
    pub username: Option<String>,
    /// Password (from `password` or `password_file`).
    pub password: Option<Secret>,
    /// File the password was read from, when given that way.
    pub password_file: Option<PathBuf>,
}

/// `[prometheus]`: where `prometheus-*` gates send PromQL.
#[derive(Debug, Clone, PartialEq)]
pub struct PrometheusConfig {
    /// Base URL of the Prometheus HTTP API.
    pub url: EndpointUrl,
    /// Bearer token.
    pub bearer_token: Option<Secret>,
    /// File the bearer token was read from.
    pub bearer_token_file: Option<PathBuf>,
    /// Basic-auth user.
    pub basic_user: Option<String>,
    /// Basic-auth password.
    pub basic_password: Option<Secret>,
    /// File the basic-auth password was read from.
    pub basic_password_file: Option<PathBuf>,
}

/// `[pubsub]`: Google Cloud Pub/Sub (parsed now, used by a later transport).
#[derive(Debug, Clone, PartialEq)]
pub struct PubSubConfig {
    /// GCP project.
    pub project_id: String,
    /// Topic results are published to.
    pub result_topic_id: Option<String>,
    /// `host:port` of the emulator, when testing.
    pub emulator_host: Option<String>,
}

/// `[embedded]`: the single-node durable store (SQLite file) of the `embedded` transport.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddedConfig {
    /// Database file.
    pub path: PathBuf,
}

/// `[dispatch]`: timings of the dispatch loop and the retry policy.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchConfig {
    /// How often the gate is observed (also on demand when the window is used up).
    pub poll_interval: Duration,
    /// Observations older than this count as no observation (budget 0).
    pub max_staleness: Duration,
    /// Message lease / visibility timeout.
    pub lease: Duration,
    /// Long-poll wait when the queue is empty.
    pub receive_wait: Duration,
    /// Dead-letter after this many failed attempts; `None` = unlimited
    /// (the deadline bounds retries). Never `Some(0)`.
    pub max_attempts: Option<u32>,
    /// First retry delay after a 5xx or transport error.
    pub retry_initial_backoff: Duration,
    /// Largest retry delay.
    pub retry_max_backoff: Duration,
    /// Requeue delay after 429/503 without `Retry-After`.
    pub congestion_backoff: Duration,
    /// Requeue delay when an admission gate says wait or refuse.
    pub wait_requeue_delay: Duration,
    /// Time allowed for in-flight work at shutdown.
    pub shutdown_grace: Duration,
    /// Deadline given to submissions that carry none (submit tools).
    pub default_deadline: Duration,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            max_staleness: Duration::from_secs(30),
            lease: Duration::from_secs(300),
            receive_wait: Duration::from_secs(1),
            max_attempts: None,
            retry_initial_backoff: Duration::from_secs(1),
            retry_max_backoff: Duration::from_secs(60),
            congestion_backoff: Duration::from_secs(2),
            wait_requeue_delay: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(30),
            default_deadline: Duration::from_secs(24 * 3600),
        }
    }
}

/// `[telemetry]`: the metrics/health listener and logging.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// Address serving `/metrics`, `/healthz` and `/readyz`.
    pub listen: SocketAddr,
    /// Log format.
    pub log_format: LogFormat,
    /// An `EnvFilter` directive string, e.g. `info,sluicegate=debug`.
    pub log_level: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            log_format: LogFormat::Text,
            log_level: "info".to_owned(),
        }
    }
}

/// One `[[queue]]`: where messages come from, where they go and which gate
/// paces them. Field names follow upstream's queue entries.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// Queue (sorted-set key) or, for Pub/Sub, subscription id.
    pub queue_name: String,
    /// Gateway base URL for this queue.
    pub igw_base_url: EndpointUrl,
    /// Request path appended to `igw_base_url`; starts with '/'.
    pub request_path_url: String,
    /// Inference objective sent in the objective header, if any.
    pub inference_objective: Option<String>,
    /// Worker pool id (upstream label).
    pub worker_pool_id: String,
    /// Labels copied onto messages (e.g. `tier`).
    pub labels: BTreeMap<String, String>,
    /// Redis list results go to, when the queue sets one: it wins over the
    /// message's `result_queue_name`, which wins over `result-list`.
    pub result_queue_name: Option<String>,
    /// TTL of result records in seconds; 0 = none.
    pub result_ttl_seconds: u64,
    /// Static capacity `max_SYS` in `unit`s; > 0.
    pub max_sys: f64,
    /// Unit of `max_sys` and of the headroom.
    pub unit: Unit,
    /// Rounding of the headroom.
    pub rounding: Rounding,
    /// The dispatch gate.
    pub gate: GateSpec,
}

impl Config {
    /// Loads the configuration from a file (if any), the environment map
    /// and flags, with precedence flag > environment > file > default.
    /// Returns every problem found, not just the first.
    pub fn load(sources: &ConfigSources) -> Result<Config, ConfigErrors> {
        env::load(sources)
    }

    /// Loads from TOML text instead of a file, with an environment map and
    /// no flags (for tests and tools).
    pub fn from_toml_str(
        text: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigErrors> {
        env::load_text(Some((text, "<string>")), env, &Overrides::default())
    }

    /// A human summary for `check-config`; secrets are never included.
    pub fn summary(&self) -> String {
        render::summary(self)
    }

    /// The effective configuration as TOML (for `config show`): every key
    /// spelled out, secrets `<redacted>`, URL passwords masked.
    pub fn to_redacted_toml(&self) -> String {
        render::to_redacted_toml(self)
    }
}
