//! Redis connections: one client per process built from `[redis]`, and a
//! [`RedisConnection`] for every command, in one of three shapes
//! (`[redis] mode`): a multiplexed [`ConnectionManager`] that reconnects
//! with backoff (one server), a slot-routing cluster connection, or the
//! master that Redis Sentinel names, followed across failovers
//! ([`SentinelConnection`]). Nothing blocks on the server (no `BRPOP`):
//! every command has a response timeout.

mod sentinel;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisFuture,
    TlsMode, Value,
};
use serde::Serialize;

use crate::secret::{EndpointUrl, Secret};
pub use sentinel::SentinelConnection;

/// How the Redis of `[redis]` is deployed (`mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RedisMode {
    /// One server (or a proxy in front of several) at `url` (default).
    #[serde(rename = "standalone")]
    Standalone,
    /// A Redis Cluster seeded by `url` (and `addrs`); the same as
    /// `cluster = true`.
    #[serde(rename = "cluster")]
    Cluster,
    /// The master named `master_name` by the sentinels at `addrs`.
    #[serde(rename = "sentinel")]
    Sentinel,
}

impl RedisMode {
    /// Every accepted spelling (the config's `mode`).
    pub const CHOICES: &'static [(&'static str, RedisMode)] = &[
        ("standalone", RedisMode::Standalone),
        ("cluster", RedisMode::Cluster),
        ("sentinel", RedisMode::Sentinel),
    ];

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Standalone => "standalone",
            Self::Cluster => "cluster",
            Self::Sentinel => "sentinel",
        }
    }
}

/// `[redis]`: connection for the Redis transport and Redis-backed gates
/// (its keys, defaults and checks are declared in `config/`, which
/// assembles the sections; the type is Redis's own).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` URL (a password in it is masked when shown).
    pub url: EndpointUrl,
    /// ACL user name.
    pub username: Option<String>,
    /// Password (inline, or read from `password_file` at load).
    pub password: Option<Secret>,
    /// File the password was read from, when given that way.
    pub password_file: Option<PathBuf>,
    /// `url` is one seed node of a Redis Cluster: the queue, its results,
    /// the shared window and quota keys are routed by hash slot. Set by
    /// `mode = "cluster"` too.
    pub cluster: bool,
    /// How the Redis is deployed: one server, a cluster, or a master
    /// behind Redis Sentinel (upstream's `mode`).
    pub mode: RedisMode,
    /// With `mode = "sentinel"`: the sentinels (`host:port`, or a
    /// `redis://` / `rediss://` URL each); with `mode = "cluster"`: more
    /// seed nodes besides `url` (upstream's `addrs`).
    pub addrs: Vec<String>,
    /// With `mode = "sentinel"`: the name the sentinels monitor the master
    /// under (upstream's `master_name`).
    pub master_name: Option<String>,
    /// ACL user for the sentinels (the master's is `username`).
    pub sentinel_username: Option<String>,
    /// Password for the sentinels (inline, or read from
    /// `sentinel_password_file` at load); the master's is `password`.
    pub sentinel_password: Option<Secret>,
    /// File the sentinels' password was read from, when given that way.
    pub sentinel_password_file: Option<PathBuf>,
}

/// The sentinels to ask and the master to ask them for.
#[derive(Debug, Clone, Copy)]
pub struct Sentinels<'a> {
    /// Sentinel addresses: `host:port` or `redis[s]://host:port`.
    pub addrs: &'a [String],
    /// The monitored master's name.
    pub master_name: &'a str,
    /// ACL user for the sentinels.
    pub username: Option<&'a str>,
    /// Password for the sentinels.
    pub password: Option<&'a str>,
}

/// `[redis]` is what the Redis connections of every user (transport,
/// gates, sources, the shared window, `serve`) are built from.
impl RedisSettings for RedisConfig {
    fn url(&self) -> &url::Url {
        self.url.expose()
    }

    fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    fn password(&self) -> Option<&str> {
        self.password.as_ref().map(Secret::expose)
    }

    fn cluster(&self) -> bool {
        self.cluster
    }

    fn sentinels(&self) -> Option<Sentinels<'_>> {
        (self.mode == RedisMode::Sentinel).then(|| Sentinels {
            addrs: &self.addrs,
            master_name: self.master_name.as_deref().unwrap_or_default(),
            username: self.sentinel_username.as_deref(),
            password: self.sentinel_password.as_ref().map(Secret::expose),
        })
    }

    fn seeds(&self) -> &[String] {
        &self.addrs
    }
}

/// Where a Redis is and how to sign in: what `[redis]` ([`RedisConfig`])
/// and the producer tools' flags say.
pub trait RedisSettings {
    /// `redis://` or `rediss://` URL, database number in the path.
    fn url(&self) -> &url::Url;
    /// ACL user name.
    fn username(&self) -> Option<&str>;
    /// Password (a password file was read into it at load).
    fn password(&self) -> Option<&str>;
    /// Whether `url` is a seed node of a Redis Cluster.
    fn cluster(&self) -> bool;
    /// The sentinels, when the master is found through Redis Sentinel
    /// (then `url` gives only the scheme, database and credentials).
    fn sentinels(&self) -> Option<Sentinels<'_>> {
        None
    }
    /// More cluster seed nodes besides `url`.
    fn seeds(&self) -> &[String] {
        &[]
    }
}

/// Why a Redis client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a usable Redis URL.
    #[error("redis.url: {0}")]
    Url(#[source] redis::RedisError),
    /// A sentinel address is not usable.
    #[error("redis.addrs: {0}")]
    Sentinel(#[source] redis::RedisError),
}

/// The connection every Redis user of the process shares: the transport,
/// the shared window, the Redis gates and the producer tools.
///
/// On a cluster, a pipeline or script must touch one hash slot; the
/// callers keep each one within a queue's `{queue}` tag (see
/// docs/transports.md, "Redis Cluster").
#[derive(Clone)]
pub enum RedisConnection {
    /// One Redis server (or a proxy in front of several).
    Single(ConnectionManager),
    /// A Redis Cluster: commands are routed by key slot, topology changes
    /// and failovers are followed by the client.
    Cluster(ClusterConnection),
    /// The master Redis Sentinel names: a failover is followed by asking
    /// the sentinels again.
    Sentinel(SentinelConnection),
}

impl RedisConnection {
    /// Whether this is a cluster connection (one slot per script or
    /// pipeline).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "RedisConnection::Single",
            Self::Cluster(_) => "RedisConnection::Cluster",
            Self::Sentinel(_) => "RedisConnection::Sentinel",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.get_db(),
        }
    }
}

/// The Redis Cluster hash slot of `key`: CRC16 (XMODEM) of its
/// [`hash_tag`] or of the whole key, modulo 16384, as `CLUSTER KEYSLOT`
/// computes it.
pub fn key_slot(key: &str) -> u16 {
    crc16_xmodem(hash_tag(key).unwrap_or(key).as_bytes()) % 16384
}

/// A key's hash tag: the text between its first `{` and the next `}`,
/// when not empty. Keys with the same tag share a cluster slot.
pub fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let len = rest.find('}')?;
    (len > 0).then(|| &rest[..len])
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// How long a pipelined batch may take before the manager reconnects.
/// Generous: one batch settles up to 512 messages.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Builds the client for `config`: URL (`redis://`, `rediss://`, database
/// number in the path), then username and password from the config, the
/// password file or the URL, in that order.
pub fn client(config: &dyn RedisSettings) -> Result<Client, ConnectError> {
    Client::open(connection_info(config)?).map_err(ConnectError::Url)
}

/// `config.url` with the configured credentials: where one server is, or
/// (behind Sentinel) how to sign in to the master and which database to
/// select on it.
fn connection_info(config: &dyn RedisSettings) -> Result<ConnectionInfo, ConnectError> {
    let info = (config.url().as_str())
        .into_connection_info()
        .map_err(ConnectError::Url)?;
    Ok(with_credentials(info, config.username(), config.password()))
}

/// `info` signed in as `username` / `password` when given (an empty user
/// name is none).
fn with_credentials(
    info: ConnectionInfo,
    username: Option<&str>,
    password: Option<&str>,
) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(user) = username.filter(|u| !u.is_empty()) {
        settings = settings.set_username(user);
    }
    // A `password_file` was read into `password` when the config (or the
    // command's flags) were loaded.
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    info.set_redis_settings(settings)
}

/// The shared connection for `config`: a manager for one server, a
/// cluster connection when `cluster` is set, the sentinels' master with
/// `mode = "sentinel"`. All connect lazily, so an unreachable Redis is an
/// error of the first command, not of start-up.
pub fn connection(config: &dyn RedisSettings) -> Result<RedisConnection, ConnectError> {
    if let Some(master) = sentinel_master(config, None, CONNECT_TIMEOUT, Some(RESPONSE_TIMEOUT))? {
        Ok(RedisConnection::Sentinel(master))
    } else if config.cluster() {
        cluster(config).map(RedisConnection::Cluster)
    } else {
        manager(&client(config)?).map(RedisConnection::Single)
    }
}

/// With `mode = "sentinel"`, a lazily resolving connection to the master
/// of `config`, asking `ask_first` (a gate's `address`) before the
/// configured sentinels; `None` in the other modes.
pub fn sentinel_master(
    config: &dyn RedisSettings,
    ask_first: Option<&str>,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
) -> Result<Option<SentinelConnection>, ConnectError> {
    let Some(mut sentinels) = config.sentinels() else {
        return Ok(None);
    };
    let addrs: Vec<String> = ask_first
        .into_iter()
        .map(str::to_owned)
        .chain(sentinels.addrs.iter().cloned())
        .fold(Vec::new(), |mut seen, a| {
            if !seen.contains(&a) {
                seen.push(a);
            }
            seen
        });
    sentinels.addrs = &addrs;
    sentinel_connection(
        &connection_info(config)?,
        sentinels,
        connect_timeout,
        response_timeout,
    )
    .map(Some)
}

/// A lazily resolving connection to the master `sentinels` name: signed
/// in, with TLS and the database as `master` says (its host is not used),
/// each sentinel with the sentinels' own credentials.
pub fn sentinel_connection(
    master: &ConnectionInfo,
    sentinels: Sentinels<'_>,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
) -> Result<SentinelConnection, ConnectError> {
    let nodes = (sentinels.addrs.iter())
        .map(|addr| sentinel_info(addr, sentinels.username, sentinels.password))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ConnectError::Sentinel)?;
    let mut node = SentinelNodeConnectionInfo::default()
        .set_redis_connection_info(master.redis_settings().clone());
    // The sentinels hand out host and port only: TLS to the master is the
    // `rediss://` of `url`, as it would be without them.
    if let ConnectionAddr::TcpTls { insecure, .. } = master.addr() {
        node = node.set_tls_mode(if *insecure {
            TlsMode::Insecure
        } else {
            TlsMode::Secure
        });
    }
    let resolver = SentinelClient::build(
        nodes,
        sentinels.master_name,
        Some(node),
        SentinelServerType::Master,
    )
    .map_err(ConnectError::Sentinel)?;
    Ok(SentinelConnection::new(
        resolver,
        sentinels.master_name,
        master.redis_settings().db(),
        connect_timeout,
        response_timeout,
    ))
}

/// One sentinel: `host:port` or a `redis://` / `rediss://` URL, signed in
/// with the sentinels' credentials.
fn sentinel_info(
    addr: &str,
    username: Option<&str>,
    password: Option<&str>,
) -> Result<ConnectionInfo, redis::RedisError> {
    let url = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("redis://{addr}")
    };
    Ok(with_credentials(
        url.as_str().into_connection_info()?,
        username,
        password,
    ))
}

/// A lazily connecting cluster connection seeded by `config.url`, with the
/// configured credentials.
fn cluster(config: &dyn RedisSettings) -> Result<ClusterConnection, ConnectError> {
    let seeds = std::iter::once(config.url().to_string())
        .chain(config.seeds().iter().map(|a| seed_url(a, config.url())))
        .collect::<Vec<_>>();
    cluster_connection_seeded(
        &seeds,
        config.username(),
        config.password(),
        CONNECT_TIMEOUT,
        Some(RESPONSE_TIMEOUT),
    )
    .map_err(ConnectError::Url)
}

/// A lazily connecting cluster connection seeded by `seed` (any node's
/// URL), with credentials when given. `response_timeout: None` waits as
/// long as the server takes.
pub fn cluster_connection(
    seed: &str,
    username: Option<&str>,
    password: Option<&str>,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
) -> Result<ClusterConnection, redis::RedisError> {
    cluster_connection_seeded(
        &[seed.to_owned()],
        username,
        password,
        connect_timeout,
        response_timeout,
    )
}

/// A seed node of `addrs` as a URL: as given when it is one, else
/// `host:port` with `url`'s scheme (TLS to every node or none).
fn seed_url(addr: &str, url: &url::Url) -> String {
    if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("{}://{addr}", url.scheme())
    }
}

/// [`cluster_connection`] seeded by every node of `seeds`: the first that
/// answers gives the topology.
fn cluster_connection_seeded(
    seeds: &[String],
    username: Option<&str>,
    password: Option<&str>,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
) -> Result<ClusterConnection, redis::RedisError> {
    let mut builder = ClusterClient::builder(seeds.iter().map(String::as_str));
    if let Some(user) = username.filter(|u| !u.is_empty()) {
        builder = builder.username(user);
    }
    if let Some(password) = password {
        builder = builder.password(password);
    }
    let client = builder.build()?;
    // A day stands for "no timeout": the cluster config has no unset value.
    let timeout = response_timeout.unwrap_or(Duration::from_secs(86_400));
    let cluster_config = ClusterConfig::new()
        .set_connection_timeout(connect_timeout)
        .set_response_timeout(timeout);
    Ok(client.get_pending_async_connection_with_config(cluster_config))
}

/// A connection manager that connects lazily and reconnects with
/// exponential backoff; commands fail fast while Redis is down.
pub fn manager(client: &Client) -> Result<ConnectionManager, ConnectError> {
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(100))
        .set_max_delay(Duration::from_secs(2));
    ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(ConnectError::Url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster_keyslot() {
        // Values from `CLUSTER KEYSLOT` and the cluster specification.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("{jobs}:results"), key_slot("jobs"));
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(key_slot("{}jobs"), crc16_xmodem(b"{}jobs") % 16384);
    }
}
