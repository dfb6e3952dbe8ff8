//! A value written to a Redis key by an external controller, and the
//! controller's decision protocol.
//!
//! The key holds either a bare number (upstream llm-d-async: `0.42`) or a
//! decision record (JSON):
//!
//! ```json
//! {"budget": 0.42, "timestamp": 1763900000.25, "decision_id": "d-17", "sees_own_load": true}
//! ```
//!
//! - `budget` (required): `D` in [0, 1].
//! - `timestamp` (required in a record): Unix seconds, when the data the
//!   controller decided on was taken. The reading is dated by it, so a key
//!   left behind by a dead controller goes stale and closes the gate.
//! - `decision_id` (optional): each replica that applies the decision
//!   writes it back to the hash `<key>:applied` (field = replica name), so
//!   the controller can tell when its decision took effect.
//! - `sees_own_load` (optional, default false): whether the controller's
//!   data already counts the batch work sluicegate has in flight; only then
//!   may the window add `N` to what is in flight.
//!
//! A bare number has no date: it is dated when read and never sees our load
//! (the window is `N` itself).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use redis::AsyncCommands;
use redis::aio::ConnectionManagerConfig;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::{Source, SourceError, Timestamped};
use crate::redis::{RedisConnection, SentinelConnection, cluster_connection};

/// A lazily connected Redis endpoint with credentials and a per-command
/// timeout: what every Redis-backed gate opens (the `redis` budget key,
/// `redis-quota`), so auth, TLS and Redis Cluster are handled once.
pub struct RedisEndpoint {
    client: redis::Client,
    /// Address for messages (no credentials).
    shown: String,
    timeout: Duration,
    /// The URL and credentials, kept for a cluster connection.
    url: String,
    username: Option<String>,
    password: Option<String>,
    /// The address is a seed node of a Redis Cluster.
    cluster: bool,
    /// The master behind Redis Sentinel, when `[redis]` says every Redis
    /// is behind it (see [`RedisEndpoint::behind_sentinel`]).
    sentinel: Option<SentinelConnection>,
    /// Connected on first use, so a Redis that is down at startup only
    /// closes the gate instead of failing the process.
    connection: OnceCell<RedisConnection>,
}

impl std::fmt::Debug for RedisEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisEndpoint")
            .field("address", &self.shown)
            .finish_non_exhaustive()
    }
}

impl RedisEndpoint {
    /// `address` (`host:port` or a `redis://` / `rediss://` URL; a seed
    /// node when `cluster`), authenticating with `username` / `password`
    /// when given; every command is bounded by `timeout`.
    pub fn new(
        address: &str,
        username: Option<&str>,
        password: Option<&str>,
        timeout: Duration,
        cluster: bool,
    ) -> Result<Self, SourceError> {
        let url = if address.contains("://") {
            address.to_owned()
        } else {
            format!("redis://{address}")
        };
        let shown = url::Url::parse(&url)
            .map(|u| crate::secret::mask_url(&u))
            .unwrap_or_else(|_| address.to_owned());
        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
            .map_err(|e| SourceError::Redis(Arc::new(e)))?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = username {
            settings = settings.set_username(user);
        }
        if let Some(password) = password {
            settings = settings.set_password(password);
        }
        let client = redis::Client::open(info.set_redis_settings(settings))
            .map_err(|e| SourceError::Redis(Arc::new(e)))?;
        Ok(Self {
            client,
            shown,
            timeout,
            url: url.clone(),
            username: username.map(str::to_owned),
            password: password.map(str::to_owned),
            cluster,
            sentinel: None,
            connection: OnceCell::new(),
        })
    }

    /// Reaches the master through `master` (made by
    /// [`crate::redis::sentinel_master`], the address asked first) instead
    /// of connecting to the address itself.
    pub fn behind_sentinel(mut self, master: SentinelConnection) -> Self {
        self.sentinel = Some(master);
        self
    }

    /// The address without credentials.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// The bound on one command.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The connection, opened on first use.
    pub async fn connection(&self) -> Result<RedisConnection, SourceError> {
        self.connection
            .get_or_try_init(|| async {
                if let Some(master) = &self.sentinel {
                    return Ok(RedisConnection::Sentinel(master.clone()));
                }
                if self.cluster {
                    return cluster_connection(
                        &self.url,
                        self.username.as_deref(),
                        self.password.as_deref(),
                        self.timeout,
                        Some(self.timeout),
                    )
                    .map(RedisConnection::Cluster);
                }
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_number_of_retries(1);
                self.client
                    .get_connection_manager_with_config(config)
                    .await
                    .map(RedisConnection::Single)
            })
            .await
            .cloned()
            .map_err(|e| SourceError::Redis(Arc::new(e)))
    }

    /// The connection if one was opened already.
    pub fn connected(&self) -> Option<RedisConnection> {
        self.connection.get().cloned()
    }

    /// Runs `work` on the connection within the timeout.
    pub async fn run<T, F>(&self, work: impl FnOnce(RedisConnection) -> F) -> Result<T, SourceError>
    where
        F: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let attempt = async {
            let conn = self.connection().await?;
            work(conn)
                .await
                .map_err(|e| SourceError::Redis(Arc::new(e)))
        };
        tokio::time::timeout(self.timeout, attempt)
            .await
            .map_err(|_| SourceError::Timeout(self.timeout))?
    }
}

/// A [`Source`] reading one string key; `None` when the key is missing.
#[derive(Debug)]
pub struct RedisKey {
    endpoint: RedisEndpoint,
    key: String,
}

impl RedisKey {
    /// Reads `key` at `endpoint`.
    pub fn new(endpoint: RedisEndpoint, key: impl Into<String>) -> Self {
        Self {
            endpoint,
            key: key.into(),
        }
    }

    /// `GET <key> at <address>`, without credentials.
    pub fn describe_key(&self) -> String {
        format!("GET {} at {}", self.key, self.endpoint.shown())
    }

    async fn read(&self) -> Result<Timestamped<Option<String>>, SourceError> {
        let taken_at = Instant::now();
        let value = self
            .endpoint
            .run(|mut conn| async move { conn.get::<_, Option<String>>(&self.key).await })
            .await?;
        Ok(Timestamped { value, taken_at })
    }
}

/// Suffix of the hash where replicas acknowledge decisions.
pub const APPLIED_SUFFIX: &str = ":applied";

/// How long acknowledgements are kept after the last write: long enough for
/// a controller to read them, short enough that dead replicas disappear.
const APPLIED_TTL_SECONDS: i64 = 3600;

/// What the budget key says.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetRecord {
    /// `D`, in [0, 1].
    pub budget: f64,
    /// When the controller's data was taken (a local instant); `None` for
    /// a bare number, which is dated when it was read.
    pub taken_at: Option<Instant>,
    /// The controller's decision id, if any.
    pub decision_id: Option<String>,
    /// Whether the controller's data counts our own in-flight work.
    pub sees_own_load: bool,
}

/// Why a budget key's value is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecordError {
    /// Neither a number nor a decision record.
    #[error("{0:?} is neither a number in [0, 1] nor a decision record")]
    Unreadable(String),
    /// The budget is outside [0, 1] or not a number.
    #[error("budget {0} is not a number in [0, 1]")]
    OutOfRange(f64),
    /// A record without a usable `timestamp`.
    #[error("a decision record needs \"timestamp\" (Unix seconds of the controller's data)")]
    NoTimestamp,
    /// The record's timestamp is in the future (beyond clock tolerance).
    #[error("timestamp is {0:.1} s in the future; check the controller's clock")]
    FromTheFuture(f64),
}

/// Clock difference between the controller and us that is tolerated
/// before a future timestamp is an error.
const CLOCK_TOLERANCE_SECONDS: f64 = 5.0;

/// Parses the key's value read at `read_at` (local) / `wall` (Unix clock).
/// Ages are measured on the wall clock, so the controller's clock must be
/// synchronised (NTP); a record from the future beyond a small tolerance
/// is refused rather than trusted.
pub fn parse_budget_record(
    text: &str,
    read_at: Instant,
    wall: SystemTime,
) -> Result<BudgetRecord, RecordError> {
    let text = text.trim();
    let in_range = |d: f64| {
        if (0.0..=1.0).contains(&d) {
            Ok(d)
        } else {
            Err(RecordError::OutOfRange(d))
        }
    };
    if let Ok(d) = text.parse::<f64>() {
        return Ok(BudgetRecord {
            budget: in_range(d)?,
            taken_at: None,
            decision_id: None,
            sees_own_load: false,
        });
    }
    #[derive(serde::Deserialize)]
    struct Raw {
        budget: f64,
        timestamp: Option<f64>,
        decision_id: Option<String>,
        #[serde(default)]
        sees_own_load: bool,
    }
    let raw: Raw = serde_json::from_str(text)
        .map_err(|_| RecordError::Unreadable(text.chars().take(80).collect()))?;
    let budget = in_range(raw.budget)?;
    let timestamp = raw
        .timestamp
        .filter(|t| t.is_finite() && *t > 0.0)
        .ok_or(RecordError::NoTimestamp)?;
    let now = wall
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let age = now - timestamp;
    if age < -CLOCK_TOLERANCE_SECONDS {
        return Err(RecordError::FromTheFuture(-age));
    }
    let age = Duration::try_from_secs_f64(age.max(0.0)).unwrap_or(Duration::MAX);
    Ok(BudgetRecord {
        budget,
        // Older than the process' clock can express: as old as possible,
        // which the staleness limit then refuses.
        taken_at: Some(read_at.checked_sub(age).unwrap_or(read_at)),
        decision_id: raw.decision_id,
        sees_own_load: raw.sees_own_load,
    })
}

impl RedisKey {
    /// Records that `replica` applied `decision_id`: `HSET <key>:applied
    /// <replica> <decision_id>`, kept for an hour after the last write.
    pub async fn acknowledge(&self, acks: &DecisionAcks, decision_id: &str) {
        acks.acknowledge(&self.endpoint, &self.key, decision_id)
            .await;
    }
}

/// This replica's acknowledgements of a controller's decisions (the
/// `redis` and `redis-leased-rate` gates): each decision id is written
/// back once ([`RedisEndpoint::acknowledge`]); a failed write is logged
/// and retried at the next reading, so the controller only learns late.
#[derive(Debug)]
pub struct DecisionAcks {
    /// This replica's name in `<key>:applied`.
    replica: String,
    /// The newest decision acknowledged.
    last: std::sync::Mutex<Option<String>>,
}

impl DecisionAcks {
    /// Acknowledgements as `replica`.
    pub fn new(replica: impl Into<String>) -> Self {
        Self {
            replica: replica.into(),
            last: std::sync::Mutex::new(None),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // Plain field writes: a poisoned lock still holds a usable value.
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes `decision_id` to `<key>:applied` at `endpoint` unless it was
    /// the last one written.
    pub async fn acknowledge(&self, endpoint: &RedisEndpoint, key: &str, decision_id: &str) {
        if self.last().as_deref() == Some(decision_id) {
            return;
        }
        match endpoint.acknowledge(key, &self.replica, decision_id).await {
            Ok(()) => *self.last() = Some(decision_id.to_owned()),
            Err(error) => {
                tracing::warn!(%error, key, decision_id, "cannot acknowledge the controller's decision");
            }
        }
    }
}

impl RedisEndpoint {
    /// Records that `replica` applied the decision `decision_id` read from
    /// `key`: `HSET <key>:applied <replica> <decision_id>`, kept for an
    /// hour after the last write (the `redis` and `redis-leased-rate`
    /// gates).
    pub async fn acknowledge(
        &self,
        key: &str,
        replica: &str,
        decision_id: &str,
    ) -> Result<(), SourceError> {
        let applied = format!("{key}{APPLIED_SUFFIX}");
        if self.connected().is_none() {
            return Err(SourceError::Parse("not connected yet".into()));
        }
        self.run(|mut conn| async move {
            redis::pipe()
                .hset(&applied, replica, decision_id)
                .ignore()
                .expire(&applied, APPLIED_TTL_SECONDS)
                .ignore()
                .query_async::<()>(&mut conn)
                .await
        })
        .await
    }
}

impl Source for RedisKey {
    type Output = Option<String>;

    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<Option<String>>, SourceError>> {
        Box::pin(self.read())
    }

    fn describe(&self) -> String {
        self.describe_key()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix: f64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs_f64(unix)
    }

    #[test]
    fn bare_number_is_undated_and_blind() {
        let now = Instant::now();
        let r = parse_budget_record(" 0.4 ", now, at(1000.0)).unwrap();
        assert_eq!(r.budget, 0.4);
        assert_eq!(r.taken_at, None);
        assert!(!r.sees_own_load);
        assert_eq!(
            parse_budget_record("1.5", now, at(1000.0)),
            Err(RecordError::OutOfRange(1.5))
        );
    }

    #[test]
    fn record_is_dated_by_its_timestamp() {
        let now = Instant::now() + Duration::from_secs(100);
        let r = parse_budget_record(
            r#"{"budget": 0.25, "timestamp": 990.0, "decision_id": "d-1", "sees_own_load": true}"#,
            now,
            at(1000.0),
        )
        .unwrap();
        assert_eq!(r.budget, 0.25);
        assert_eq!(r.taken_at, Some(now - Duration::from_secs(10)));
        assert_eq!(r.decision_id.as_deref(), Some("d-1"));
        assert!(r.sees_own_load);
    }

    #[test]
    fn record_without_timestamp_or_from_the_future_is_refused() {
        let now = Instant::now();
        assert_eq!(
            parse_budget_record(r#"{"budget": 0.5}"#, now, at(1000.0)),
            Err(RecordError::NoTimestamp)
        );
        assert!(matches!(
            parse_budget_record(r#"{"budget": 0.5, "timestamp": 1100}"#, now, at(1000.0)),
            Err(RecordError::FromTheFuture(_))
        ));
        assert!(matches!(
            parse_budget_record("open", now, at(1000.0)),
            Err(RecordError::Unreadable(_))
        ));
    }
}
