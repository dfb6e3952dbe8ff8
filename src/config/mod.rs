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
//! Each key is declared once, below, with the `section!` macro: its doc,
//! type, default and conversion. That declaration drives the key checks,
//! the `SLUICEGATE_<SECTION>_<KEY>` variables, error messages and the
//! derived `Serialize` behind `config show`. Files: `layer` (file,
//! environment and flags layered onto one loose tree), `check` (tree →
//! typed: unknown keys, cross-key rules), `values` (this config's own
//! loose → typed conversions), `context` (the gates' build context from a
//! loaded config), `render` (summary and redacted TOML). On the ground
//! floor: the general conversions, duration text and [`ConfigError`]
//! (`crate::values`, shared with the gates' parameters), secrets and URLs
//! that may hold one (`crate::secret`); the gate catalogue ([`GateSpec`])
//! is the gates' own (`crate::gate`).
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

mod check;
mod context;
mod layer;
mod render;
mod tenant_limits;
mod tier;
mod values;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};

use values::{
    Ctx, NONZERO, as_bool, as_f64_in, as_nonempty_string, as_positive_f64, as_string_list,
    as_string_map, as_u64, as_u64_in, attempts, choice, constant_url, duration_min, env_filter,
    header_name, host_port, http_url, inline_secret, optional_i64, optional_string, path,
    pool_name, postgres_url, redis_addrs, redis_url, retention, socket_addr, tenant_limits,
    tenant_weights, url_path,
};

use crate::telemetry::LogFormat;

pub use crate::gate::{
    GATE_TYPES, GateSpec, GatingMode, MAX_GATE_DEPTH, MissingBudget, QuotaMode, Unit,
    allowed_params,
};
pub use crate::postgres::{SqlConfig, SslMode};
pub use crate::redis::{RedisConfig, RedisMode};
pub use crate::secret::{
    EndpointUrl, MASKED_PASSWORD, REDACTED, Secret, SecretFileError, mask_url, read_secret_file,
};
pub use crate::source::PrometheusConfig;
pub use crate::values::{ConfigError, ConfigErrors, format_duration, parse_duration};
pub use layer::{CONTRACT_ENV_VARS, ConfigSources, ENV_PREFIX, Overrides, known_env_vars};
pub use tenant_limits::{TenantLimit, TenantLimits};
pub use tier::Tier;

/// Declares a closed set of config spellings once: the enum, its spelling
/// function, the accepted names (canonical first, then aliases) for
/// parsing and error messages, and a `Serialize` that writes the canonical one.
macro_rules! spelled {
    ($($(#[$m:meta])* pub enum $name:ident, $spelling:ident {
        $($(#[$vm:meta])* $variant:ident = $text:literal $(| $alias:literal)*,)+
    })+) => {$(
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
        pub enum $name { $($(#[$vm])* #[serde(rename = $text)] $variant,)+ }

        impl $name {
            /// Every accepted spelling, canonical first, then aliases.
            pub(crate) const CHOICES: &'static [(&'static str, $name)] =
                &[$(($text, $name::$variant), $(($alias, $name::$variant),)*)+];

            /// The canonical config spelling.
            pub fn $spelling(self) -> &'static str {
                match self { $(Self::$variant => $text,)+ }
            }
        }
    )+};
}

/// A `[section]` declared with `section!`.
pub(crate) trait Section: Default {
    /// The table's name in the file.
    const NAME: &'static str;
    /// Its keys.
    const KEYS: &'static [&'static str];
    /// Sets the fields whose keys are in `map` (errors under `<path>.<key>`).
    fn merge(&mut self, map: &Map<String, Value>, path: &str, ctx: &mut Ctx);
}

/// Declares a config section once. Each key line gives the field's doc,
/// type, default and conversion (a function from the loose value to the
/// field type, whose error message says what is allowed); from it come the
/// typed struct (with derived `Serialize` for `config show`), its
/// `Default`, the key list (unknown-key errors, environment variable names)
/// and `merge`, which reads the keys present in a loose table. The
/// `with_defaults` form (`[[queue]]`, whose defaults depend on `[gateway]`)
/// adds hand-parsed fields and extra keys, and makes a constructor taking
/// the hand fields and the arguments the defaults use, instead of `Default`.
/// A section marked `elsewhere` is a type its component declares (with
/// the fields' docs): `[redis]` in `crate::redis`, `[prometheus]` in
/// `crate::source`, `[sql]` in `crate::postgres`, so the gates and sources
/// that take one stand below this config; its keys, defaults and
/// conversions are declared here all the same.
macro_rules! section {
    ($($(#[$m:meta])* pub struct $name:ident in $section:literal $($elsewhere:ident)? {
        $($(#[$fm:meta])* $field:ident: $ty:ty = $default:expr, $conv:expr;)+
    })+) => {
        /// The sections with their keys, in file order: the one list the
        /// key checks, the environment overlay and error messages walk.
        pub(crate) const SECTIONS: &[(&str, &[&str])] = &[$(($section, $name::KEYS)),+];
        $(
        section!(@declare [$($elsewhere)?] $(#[$m])* $name {} { $($(#[$fm])* $field: $ty, $conv;)+ } []);

        impl Default for $name {
            fn default() -> Self {
                Self { $($field: $default,)+ }
            }
        }

        impl Section for $name {
            const NAME: &'static str = $section;
            const KEYS: &'static [&'static str] = $name::KEYS;
            fn merge(&mut self, map: &Map<String, Value>, path: &str, ctx: &mut Ctx) {
                $name::merge(self, map, path, ctx)
            }
        }
    )+};
    ($(#[$m:meta])* pub struct $name:ident with_defaults($($arg:ident: $aty:ty),*) {
        $($(#[$hm:meta])* $hand:ident: $hty:ty,)*
    } {
        $($(#[$fm:meta])* $field:ident: $ty:ty = $default:expr, $conv:expr;)+
    } [$($extra:literal),*]) => {
        section!(@struct $(#[$m])* $name { $($(#[$hm])* $hand: $hty,)* }
            { $($(#[$fm])* $field: $ty, $conv;)+ } [$($extra),*]);

        impl $name {
            /// The keys `merge` reads (each also a `SLUICEGATE_QUEUE_<KEY>`
            /// variable): `KEYS` less the hand-parsed ones.
            pub(crate) const FIELD_KEYS: &'static [&'static str] = &[$(stringify!($field)),+];

            /// An entry with every default.
            pub(crate) fn with_defaults($($hand: $hty,)* $($arg: $aty),*) -> Self {
                Self { $($hand,)* $($field: $default,)+ }
            }
        }
    };
    (@declare [] $($rest:tt)*) => { section!(@struct $($rest)*); };
    (@declare [elsewhere] $(#[$m:meta])* $name:ident $($rest:tt)*) => {
        section!(@impl $name $($rest)*);
    };
    (@struct $(#[$m:meta])* $name:ident { $($(#[$hm:meta])* $hand:ident: $hty:ty,)* }
        { $($(#[$fm:meta])* $field:ident: $ty:ty, $conv:expr;)+ } [$($extra:literal),*]) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq, Serialize)]
        pub struct $name {
            $($(#[$hm])* pub $hand: $hty,)*
            $($(#[$fm])* pub $field: $ty,)+
        }

        section!(@impl $name { $($hand: $hty,)* } { $($field: $ty, $conv;)+ } [$($extra),*]);
    };
    (@impl $name:ident { $($(#[$hm:meta])* $hand:ident: $hty:ty,)* }
        { $($(#[$fm:meta])* $field:ident: $ty:ty, $conv:expr;)+ } [$($extra:literal),*]) => {
        impl $name {
            /// Every key the section accepts in a file.
            pub(crate) const KEYS: &'static [&'static str] =
                &[$($extra,)* $(stringify!($field)),+];

            /// Sets each field whose key is in `map`; a bad value is recorded
            /// under `<path>.<key>` and leaves the field as it was.
            pub(crate) fn merge(&mut self, map: &Map<String, Value>, path: &str, ctx: &mut Ctx) {
                $(
                    let key = format!("{path}.{}", stringify!($field));
                    if let Some(v) = ctx.conv(&key, map.get(stringify!($field)), $conv) {
                        self.$field = v;
                    }
                )+
            }
        }
    };
}

spelled! {
    /// Queue transport.
    pub enum TransportKind, as_str {
        /// In-process queue (tests, demos).
        Memory = "memory",
        /// Redis sorted sets, wire-compatible with upstream `redis-sortedset`.
        Redis = "redis" | "redis-sortedset",
        /// Google Cloud Pub/Sub (`gcp-pubsub` upstream).
        PubSub = "pubsub" | "gcp-pubsub",
        /// Embedded durable single-node store.
        Embedded = "embedded",
        /// PostgreSQL, on upstream's `sql` transport tables.
        Sql = "sql",
    }

    /// How the real-valued headroom `N` becomes a whole number.
    pub enum Rounding, as_str {
        /// Round down (default).
        Floor = "floor",
        /// Round up.
        Ceil = "ceil",
        /// Round down, but at least one while the gate is open.
        AtLeastOne = "at-least-one",
    }

    /// What paced release counts (`dispatch.pace`).
    pub enum PaceKind, as_str {
        /// No pacing: a window that opens releases what it allows at once
        /// (default).
        Off = "off",
        /// Requests started per second.
        Requests = "requests",
        /// Prompt tokens started per second.
        Tokens = "tokens",
    }

    /// Where a pool's window is shared across replicas.
    pub enum SharedWindowKind, as_str {
        /// Each process has its own window (default).
        Off = "off",
        /// A lease semaphore per pool in Redis (`[redis]`).
        Redis = "redis",
    }

    /// How the queues of one pool take turns at its window
    /// (`dispatch.merge_policy`, `dispatch::merge`).
    pub enum MergePolicyKind, as_str {
        /// No turns: whichever queue finds room takes it (default; the
        /// behaviour before merge policies).
        FirstCome = "first-come",
        /// Queues with work take turns from a random start.
        RandomRobin = "random-robin",
        /// The highest `tier` label first; lower tiers keep
        /// `merge_min_share` of the turns.
        TierPriority = "tier-priority",
    }

    /// Where `sluicegate serve` runs the dispatcher.
    pub enum ServeDispatcher, as_str {
        /// In the API server's process (default).
        InProcess = "in-process",
        /// Elsewhere (`sluicegate run`): the server only serves the API.
        Separate = "separate",
    }

    /// The order `sluicegate serve` enqueues a batch's lines in
    /// (`serve.order`; a batch's metadata may pick its own).
    pub enum ServeOrder, as_str {
        /// The input file's order (default).
        Arrival = "arrival",
        /// By model, then by shared prompt prefix (llm-d's
        /// `model-prefix-v1`).
        ModelPrefix = "model-prefix" | "model-prefix-v1",
    }

    /// Which header carries the queue's inference objective; the config
    /// spelling is the header name.
    pub enum ObjectiveHeader, header_name {
        /// `x-gateway-inference-objective` (upstream's name; default).
        Gateway = "x-gateway-inference-objective",
        /// `x-llm-d-inference-objective` (newer routers).
        LlmD = "x-llm-d-inference-objective",
    }
}

/// The effective, validated configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// PostgreSQL settings, when configured or when `transport = sql`.
    pub sql: Option<SqlConfig>,
    /// Dispatch loop timings and retry policy.
    pub dispatch: DispatchConfig,
    /// Metrics/health listener and logging.
    pub telemetry: TelemetryConfig,
    /// The queues to drain (`[[queue]]`); at least one, names unique.
    #[serde(rename = "queue")]
    pub queues: Vec<QueueConfig>,
    /// OTLP trace export, from the standard `OTEL_EXPORTER_OTLP_*`
    /// variables of the environment map; `None` (the default) exports
    /// nothing. Not a file key, so not rendered.
    #[serde(skip)]
    pub traces: Option<crate::telemetry::TraceSettings>,
}

/// Default `[redis] url`.
pub(crate) const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/0";
/// Default queue name (upstream's `request-sortedset`).
pub(crate) const DEFAULT_QUEUE_NAME: &str = "request-sortedset";
/// `[gateway] fairness_attribute` when not set, which `submit` also files
/// Redis tenant lanes by unless told otherwise: the two must agree for a
/// dispatcher to find its tenants' lanes.
pub(crate) const DEFAULT_FAIRNESS_ATTRIBUTE: &str = "userid";

section! {
    /// `[gateway]`: the inference gateway and the HTTP client's limits.
    pub struct GatewayConfig in "gateway" {
        /// Default `igw_base_url` for queues that do not set one.
        url: Option<EndpointUrl> = None, |v| http_url(v).map(Some);
        /// Default `request_path_url` for queues; starts with '/'.
        request_path: String = "/v1/completions".to_owned(), url_path;
        /// Ceiling per attempt (each attempt is also bounded by the deadline).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        attempt_timeout: Duration = Duration::from_secs(120), duration_min(NONZERO);
        /// TCP/TLS connect timeout.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        connect_timeout: Duration = Duration::from_secs(5), duration_min(NONZERO);
        /// Largest response body read; larger bodies are an error.
        max_response_bytes: u64 = 16 * 1024 * 1024, |v| as_u64_in(v, 1, u64::MAX);
        /// Idle connections kept per host (at least the queues' static
        /// windows in requests; high by default so a window whose live
        /// `max_SYS` is larger does not churn connections either).
        max_connections_per_host: usize = 4096,
            |v| usize::try_from(as_u64_in(v, 1, 1 << 20)?).map_err(|_| "too large".to_owned());
        /// Speak HTTP/2 to the gateway without negotiation (h2c on
        /// `http://`): every request multiplexes over a few connections
        /// instead of one connection each. Only for gateways that accept it
        /// (Envoy-based inference gateways do; vLLM's own server does not).
        http2_prior_knowledge: bool = false, as_bool;
        /// Bearer token sent to the gateway (inline, or read from `token_file` at load).
        token: Option<Secret> = None, inline_secret;
        /// File the token was read from, when given that way.
        token_file: Option<PathBuf> = None, |v| path(v).map(Some);
        /// Header that carries the inference objective.
        objective_header: ObjectiveHeader = ObjectiveHeader::Gateway,
            choice(ObjectiveHeader::CHOICES);
        /// Metadata attribute sent as `x-llm-d-inference-fairness-id`; `None` (empty) disables.
        #[serde(serialize_with = "render::or_empty")]
        fairness_attribute: Option<String> = Some(DEFAULT_FAIRNESS_ATTRIBUTE.to_owned()), optional_string;
    }

    /// `[redis]` (`crate::redis::RedisConfig`, documented there).
    pub struct RedisConfig in "redis" elsewhere {
        url: EndpointUrl = constant_url(DEFAULT_REDIS_URL), redis_url;
        username: Option<String> = None, optional_string;
        password: Option<Secret> = None, inline_secret;
        password_file: Option<PathBuf> = None, |v| path(v).map(Some);
        cluster: bool = false, as_bool;
        mode: RedisMode = RedisMode::Standalone, choice(RedisMode::CHOICES);
        addrs: Vec<String> = Vec::new(), redis_addrs;
        master_name: Option<String> = None, optional_string;
        sentinel_username: Option<String> = None, optional_string;
        sentinel_password: Option<Secret> = None, inline_secret;
        sentinel_password_file: Option<PathBuf> = None, |v| path(v).map(Some);
    }

    /// `[prometheus]` (`crate::source::PrometheusConfig`, documented there).
    pub struct PrometheusConfig in "prometheus" elsewhere {
        url: EndpointUrl = constant_url("http://127.0.0.1:9090"), http_url;
        bearer_token: Option<Secret> = None, inline_secret;
        bearer_token_file: Option<PathBuf> = None, |v| path(v).map(Some);
        basic_user: Option<String> = None, optional_string;
        basic_password: Option<Secret> = None, inline_secret;
        basic_password_file: Option<PathBuf> = None, |v| path(v).map(Some);
    }

    /// `[pubsub]`: Google Cloud Pub/Sub. `project_id` is required.
    pub struct PubSubConfig in "pubsub" {
        /// GCP project.
        project_id: String = String::new(), as_nonempty_string;
        /// Topic results are published to.
        result_topic_id: Option<String> = None, optional_string;
        /// `host:port` of the emulator, when testing (anonymous credentials;
        /// the standard `PUBSUB_EMULATOR_HOST` variable does the same).
        emulator_host: Option<String> = None, host_port;
        /// Service-account key file; unset = application default credentials.
        credentials_file: Option<PathBuf> = None, |v| path(v).map(Some);
        /// Longest a delivery waiting for the pool (congestion hold, gate
        /// wait, failed-attempt backoff) is kept leased by ack-deadline
        /// extensions, counted from its Pull; then it goes back to the
        /// broker (ack deadline 0), which counts a delivery attempt.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        max_hold: Duration = Duration::from_secs(3600), duration_min(Duration::from_secs(1));
        /// Most message bytes held leased for the pool at once; a hold
        /// beyond it goes back to the broker at once.
        max_hold_bytes: u64 = 64 * 1024 * 1024, |v| as_u64_in(v, 0, u64::MAX);
    }

    /// `[embedded]`: the single-node durable store (SQLite file) of the
    /// `embedded` transport.
    pub struct EmbeddedConfig in "embedded" {
        /// Database file.
        path: PathBuf = PathBuf::from("sluicegate.db"), path;
    }

    /// `[sql]` (`crate::postgres::SqlConfig`, documented there).
    pub struct SqlConfig in "sql" elsewhere {
        url: Option<EndpointUrl> = None, |v| postgres_url(v).map(Some);
        result_queue_name: String = "result-sql".to_owned(), as_nonempty_string;
        poll_interval: Duration = Duration::from_secs(1), duration_min(Duration::from_millis(10));
        batch_size: usize = 10,
            |v| usize::try_from(as_u64_in(v, 1, 10_000)?).map_err(|_| "too large".to_owned());
        lease_ttl: Option<Duration> = None, |v| duration_min(Duration::from_secs(1))(v).map(Some);
        connect_timeout: Duration = Duration::from_secs(5), duration_min(NONZERO);
        sslmode: Option<SslMode> = None, |v| choice(SslMode::CHOICES)(v).map(Some);
        tls_ca: Option<PathBuf> = None, |v| path(v).map(Some);
    }

    /// `[dispatch]`: timings of the dispatch loop and the retry policy.
    pub struct DispatchConfig in "dispatch" {
        /// How often the gate is observed (also on demand when the window is used up).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        poll_interval: Duration = Duration::from_secs(1), duration_min(NONZERO);
        /// Observations older than this count as no observation (budget 0).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        max_staleness: Duration = Duration::from_secs(30), duration_min(NONZERO);
        /// Message lease / visibility timeout.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        lease: Duration = Duration::from_secs(30), duration_min(Duration::from_secs(1));
        /// Long-poll wait when the queue is empty.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        receive_wait: Duration = Duration::from_secs(1), duration_min(Duration::ZERO);
        /// Dead-letter after this many failed attempts; `None` (0) = unlimited
        /// (the deadline bounds retries). Never `Some(0)`.
        #[serde(serialize_with = "render::attempts")]
        max_attempts: Option<u32> = None, attempts;
        /// First retry delay after a 5xx or transport error.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        retry_initial_backoff: Duration = Duration::from_secs(1), duration_min(NONZERO);
        /// Largest retry delay.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        retry_max_backoff: Duration = Duration::from_secs(60), duration_min(NONZERO);
        /// First hold of every queue on the gateway after a 429/503; it
        /// doubles with each consecutive signal (jittered), and a longer
        /// `Retry-After` wins. Zero would let a storm through.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        congestion_backoff: Duration = Duration::from_secs(2), duration_min(NONZERO);
        /// Ceiling of the congestion hold computed from the backoff.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        congestion_max_backoff: Duration = Duration::from_secs(60), duration_min(NONZERO);
        /// Requeue delay when an admission gate says wait or refuse. Zero
        /// would re-claim a refused message in a loop.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        wait_requeue_delay: Duration = Duration::from_secs(1), duration_min(NONZERO);
        /// Messages the receiver may hold beyond what the window can send
        /// now, so it sees past one tenant's backlog at the head of the
        /// queue and shares the window among tenants (0 = no lookahead).
        tenant_lookahead: usize = 64,
            |v| usize::try_from(as_u64_in(v, 0, 4096)?).map_err(|_| "too large".to_owned());
        /// Weight of each tenant (value of `[gateway] fairness_attribute`)
        /// in the window's round robin; tenants not named weigh 1.
        tenant_weights: BTreeMap<String, u32> = BTreeMap::new(), tenant_weights;
        /// Most message body bytes a queue's dispatcher holds at once (the
        /// lookahead, parked, in flight and awaiting the result write); the
        /// receiver pulls no more while they would not fit. A single
        /// message larger than this still goes, alone.
        max_buffered_bytes: u64 = 256 * 1024 * 1024, |v| as_u64_in(v, 1, i64::MAX as u64);
        /// Time allowed for in-flight work at shutdown.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        shutdown_grace: Duration = Duration::from_secs(30), duration_min(Duration::ZERO);
        /// Where the pools' windows are shared across replicas: `off`
        /// (each process has its own window) or `redis` (a lease semaphore
        /// per pool in `[redis]`).
        shared_window: SharedWindowKind = SharedWindowKind::Off,
            choice(SharedWindowKind::CHOICES);
        /// Lease on the units a replica holds in the shared window; it is
        /// renewed every third of it, and a replica whose lease lapses
        /// sends nothing new.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        shared_window_lease: Duration = Duration::from_secs(6),
            duration_min(Duration::from_secs(1));
        /// Units a replica takes from the shared window beyond its in
        /// flight, and gives back past twice that (batches, not one round
        /// trip per request).
        shared_window_chunk: u64 = 4, |v| as_u64_in(v, 1, 1 << 20);
        /// Paced release: spread each pool's sends over time, counted in
        /// `requests` or prompt `tokens` per second (`off`: what the window
        /// allows goes at once).
        pace: PaceKind = PaceKind::Off, choice(PaceKind::CHOICES);
        /// Units of `pace` started per second, per pool.
        pace_rate: f64 = 10.0, as_positive_f64;
        /// Most units of `pace` that may start at once (the credit's cap).
        pace_burst: f64 = 1.0, as_positive_f64;
        /// Deadline given to submissions that carry none (submit tools).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        default_deadline: Duration = Duration::from_secs(24 * 3600), duration_min(NONZERO);
        /// How long a gate's inert rule must hold before
        /// `sluicegate_gate_inert` reports it (`dispatch::inert`): long
        /// enough that a pool busy with interactive load is not inert.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        inert_after: Duration = Duration::from_secs(600), duration_min(NONZERO);
        /// How often requests in flight are checked for a submitter's
        /// cancel, which aborts them (transports that record cancels).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        cancel_check_interval: Duration = Duration::from_secs(1),
            duration_min(Duration::from_millis(100));
        /// How the queues of one pool take turns at its window:
        /// `first-come` (no turns), `random-robin` or `tier-priority`
        /// (upstream's merge policy `type`). A pool of one queue is
        /// unaffected.
        merge_policy: MergePolicyKind = MergePolicyKind::FirstCome,
            choice(MergePolicyKind::CHOICES);
        /// `tier-priority`: the queue label holding a queue's tier
        /// (`interactive`, `async`, `batch`; none = `batch`).
        merge_tier_label: String = "tier".to_owned(), as_nonempty_string;
        /// `tier-priority`: header sent with upstream's priority index
        /// (`class × 3 + tier`); empty disables it.
        #[serde(serialize_with = "render::or_empty")]
        merge_priority_header: Option<String> = Some("x-gateway-priority".to_owned()),
            header_name;
        /// `tier-priority`: the least share, in [0, 0.5], of the recent
        /// turns a lower tier gets while it has work (0 = strict priority).
        merge_min_share: f64 = 0.1, |v| as_f64_in(v, 0.0, 0.5);
        /// `tier-priority`: how many recent turns the shares count.
        merge_share_window: u64 = 100, |v| as_u64_in(v, 10, 100_000);
    }

    /// `[telemetry]`: the metrics/health listener and logging.
    pub struct TelemetryConfig in "telemetry" {
        /// Address serving `/metrics`, `/healthz` and `/readyz`.
        listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9464)), socket_addr;
        /// Log format.
        log_format: LogFormat = LogFormat::Text, choice(LogFormat::CHOICES);
        /// An `EnvFilter` directive string, e.g. `info,sluicegate=debug`.
        log_level: String = "info".to_owned(), env_filter;
    }

    /// `[serve]`: the OpenAI Batch API server (`sluicegate serve`,
    /// `docs/batch-api.md`). Read by [`ServeConfig::load`] only; the
    /// dispatcher ignores it.
    pub struct ServeConfig in "serve" {
        /// Address of the Files and Batches API.
        listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 8080)), socket_addr;
        /// Directory of file bodies; with the embedded transport also the
        /// batch records (`batches.db`). A shared volume for Redis replicas.
        data_dir: PathBuf = PathBuf::from("sluicegate-data"), path;
        /// The `[[queue]]` batches go into; empty = the first one.
        #[serde(serialize_with = "render::or_empty")]
        queue: Option<String> = None, optional_string;
        /// Where the dispatcher runs: `in-process` or `separate`.
        dispatcher: ServeDispatcher = ServeDispatcher::InProcess,
            choice(ServeDispatcher::CHOICES);
        /// API keys: `tenant:key` entries separated by commas or newlines.
        api_keys: Option<Secret> = None, inline_secret;
        /// File of API keys, one `tenant:key` per line (`#` comments).
        api_keys_file: Option<PathBuf> = None, |v| path(v).map(Some);
        /// Largest uploaded file in bytes.
        max_file_bytes: u64 = 200 * 1024 * 1024, |v| as_u64_in(v, 1, u64::MAX);
        /// Largest input line in bytes.
        max_line_bytes: u64 = 1024 * 1024, |v| as_u64_in(v, 1, u64::MAX);
        /// Most requests in one batch.
        max_lines_per_batch: u64 = 50_000, |v| as_u64_in(v, 1, u64::MAX);
        /// How long a file is kept when it names no expiry (an upload
        /// without `expires_after`, the output of a batch without
        /// `output_expires_after`); `0` keeps it until deleted. 30 days
        /// is OpenAI's default for `purpose=batch` files.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        file_retention: Duration = Duration::from_secs(30 * 86_400), retention;
        /// Limits on each tenant's enqueued work (requests without a
        /// result, and their estimated tokens): `requests` and `tokens`
        /// for every tenant, `tenants.<name>` to override them; a batch
        /// that would pass one is refused with 429 at creation.
        tenant_limits: TenantLimits = TenantLimits::default(), tenant_limits;
        /// Headers of `POST /v1/batches` copied onto every request of
        /// the batch (an SLO hint such as a TTFT target for the endpoint
        /// picker); names, case-insensitive. Checked at start: a header
        /// the gateway client sets or refuses cannot be listed.
        pass_headers: Vec<String> = Vec::new(), as_string_list;
        /// The endpoints a batch may name (`POST /v1/batches`' `endpoint`):
        /// OpenAI's four by default; vLLM's `/v1/rerank`, `/v1/score`,
        /// `/classify` and `/pooling` are known too (body checks, token
        /// estimates), and any other path is sent as it is.
        endpoints: Vec<String> = crate::endpoint::Endpoints::default().paths().to_vec(),
            |v| {
                let paths = as_string_list(v)?;
                crate::endpoint::Endpoints::new(&paths)?;
                Ok(paths)
            };
        /// The order a batch's lines are enqueued in: `arrival` (the
        /// file's) or `model-prefix` (by model, then shared prompt prefix,
        /// so the engines' prefix cache hits); a batch's metadata key
        /// `sluicegate_order` overrides it.
        order: ServeOrder = ServeOrder::Arrival, choice(ServeOrder::CHOICES);
        /// Redis transport: the list the batch requests' results go to
        /// (unless the queue sets `result_queue_name`); only serve reads it.
        result_list: String = "sluicegate-batch-results".to_owned(), as_nonempty_string;
        /// Redis transport: prefix of the batch-record keys.
        key_prefix: String = "sluicegate:batchapi:".to_owned(), as_nonempty_string;
        /// Requests per enqueue round trip of a batch's intake; a
        /// restarted intake resumes after the last chunk enqueued.
        intake_chunk: u64 = 500, |v| as_u64_in(v, 1, 100_000);
        /// How long a batch step (validation, enqueuing, finalizing, a
        /// cancel) may go untouched before another server takes it over:
        /// its server died. Must be well above the time one chunk of the
        /// step takes.
        #[serde(serialize_with = "crate::values::serialize_duration")]
        takeover_after: Duration = Duration::from_secs(60), duration_min(Duration::from_secs(1));
        /// Flex requests (`service_tier: "flex"`): how long one may wait
        /// in the queue before it is answered 429 (`docs/flex.md`).
        #[serde(serialize_with = "crate::values::serialize_duration")]
        flex_max_wait: Duration = Duration::from_secs(600), duration_min(Duration::from_millis(100));
        /// Flex connections held at once, all tenants together; one more
        /// is answered 429.
        flex_max_held: u64 = 10_000, |v| as_u64_in(v, 1, 1_000_000);
        /// Flex connections one tenant may hold at once.
        flex_max_held_per_tenant: u64 = 2_000, |v| as_u64_in(v, 1, 1_000_000);
        /// Background responses not yet finished, all tenants together;
        /// one more is answered 429.
        background_max_total: u64 = 100_000, |v| as_u64_in(v, 1, 100_000_000);
        /// Background responses not yet finished, per tenant.
        background_max_per_tenant: u64 = 10_000, |v| as_u64_in(v, 1, 100_000_000);
        /// Requests without `service_tier: "flex"` (or `background`) on the
        /// inference endpoints: `false` refuses them with 400; `true`
        /// forwards them straight to the gateway as interactive traffic,
        /// outside the gate's window.
        passthrough: bool = false, as_bool;
    }
}

section! {
    /// One `[[queue]]`: where messages come from, where they go and which gate
    /// paces them. Field names follow upstream's queue entries; some
    /// defaults come from `[gateway]`.
    pub struct QueueConfig with_defaults(url: EndpointUrl, gateway: &GatewayConfig) {
        /// Queue (sorted-set key) or, for Pub/Sub, subscription id (alias
        /// `subscriber_id`; variable `SLUICEGATE_QUEUE`).
        queue_name: String,
        /// The dispatch gate (`gate_type` + `gate_params`).
        #[serde(flatten, serialize_with = "render::gate")]
        gate: GateSpec,
    } {
        /// Gateway base URL for this queue (default `gateway.url`).
        igw_base_url: EndpointUrl = url, http_url;
        /// Request path appended to `igw_base_url`; starts with '/'.
        request_path_url: String = gateway.request_path.clone(), url_path;
        /// Inference objective sent in the objective header, if any.
        inference_objective: Option<String> = None, optional_string;
        /// vLLM `priority` written into request bodies that carry none
        /// (engine `--scheduling-policy priority`: lower runs first).
        engine_priority: Option<i64> = None, optional_i64;
        /// Inference pool this queue sends to: queues naming the same pool
        /// share one window, congestion hold and shared-window semaphore.
        /// Default: the pool of `igw_base_url` (its origin and path).
        pool: Option<String> = None, pool_name;
        /// Worker pool id (upstream label).
        worker_pool_id: String = "default".to_owned(), as_nonempty_string;
        /// Upstream's queue id, there only the `queue_id` metric label:
        /// accepted so an upstream queue array loads unchanged; our
        /// metrics label a queue by `queue_name`.
        id: Option<String> = None, optional_string;
        /// Labels copied onto messages (e.g. `tier`).
        labels: BTreeMap<String, String> = BTreeMap::new(), as_string_map;
        /// Redis list results go to, when the queue sets one: it wins over the
        /// message's `result_queue_name`, which wins over `result-list`.
        result_queue_name: Option<String> = None, |v| as_nonempty_string(v).map(Some);
        /// TTL of result records in seconds; 0 = none.
        result_ttl_seconds: u64 = 0, as_u64;
        /// Static capacity `max_SYS` in `unit`s; > 0.
        max_sys: f64 = 100.0, as_positive_f64;
        /// Unit of `max_sys` and of the headroom.
        unit: Unit = Unit::Requests, choice(Unit::CHOICES);
        /// Rounding of the headroom.
        rounding: Rounding = Rounding::Floor, choice(Rounding::CHOICES);
    } ["queue_name", "subscriber_id", "gate_type", "gate_params"]
}
