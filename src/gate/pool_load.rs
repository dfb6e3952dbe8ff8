//! The pool-load sources of `tier-priority-admission`'s `source` shape
//! (upstream PR #186's `PoolLoadSource`): whether the pool has room for
//! one more message, and, for a counter, the slot it took.
//!
//! - `prometheus`: a PromQL query read at most every
//!   `refresh_interval_ms`; saturated when its value is at or above
//!   `threshold` (several series: the largest counts). Upstream reads in
//!   the background and admits until the first reading and when its
//!   reading is older than `stale_after_ms` (fail open); here no reading,
//!   an error, no sample or a reading older than `stale_after_ms` is
//!   saturated (fail closed).
//! - `redis-counter`: an in-flight counter `<key_prefix>:inflight:<bucket>`
//!   against the cap in `<key_prefix>:cap:<bucket>` (else `fallback_cap`),
//!   taken by one script (INCR, EXPIRE `ttl_seconds`, DECR back when over
//!   the cap) and given back when the request ends. Upstream admits when
//!   Redis fails (fail open); here a Redis error is saturated.

use std::sync::Arc;
use std::time::Duration;

use crate::source::{Cached, PromQuery, RedisEndpoint, SourceError};

use super::Ticket;
use super::reading::{Aggregate, SourceReport, series_values};

/// Where `tier-priority-admission` reads the pool's load (the `source`
/// shape).
#[derive(Debug)]
pub(crate) enum PoolLoad {
    /// A cached PromQL query against a threshold.
    Prometheus {
        /// The query, cached for `refresh_interval_ms`, refused when older
        /// than `stale_after_ms`.
        query: Cached<PromQuery>,
        /// Saturated at or above this value.
        threshold: f64,
    },
    /// A shared in-flight counter in Redis.
    RedisCounter(RedisCounter),
}

/// What the pool has for one message.
#[derive(Debug)]
pub(crate) enum Room {
    /// Room: send it, holding the ticket (a counter slot) while in flight.
    Yes(Ticket),
    /// Saturated, or unknown (fail closed).
    No,
}

impl PoolLoad {
    /// Whether the pool has room for one message now; records how it read.
    pub(crate) async fn try_acquire(&self, report: &mut SourceReport) -> Room {
        match self {
            Self::Prometheus { query, threshold } => match query.get().await {
                Err(e) => {
                    report.outcome = format!("error, counted as saturated: {e}");
                    Room::No
                }
                Ok(t) => {
                    report.values = series_values(&t.value);
                    match Aggregate::Max.apply(t.value.iter().map(|s| s.value)) {
                        None => {
                            report.outcome = "no sample, counted as saturated".into();
                            Room::No
                        }
                        Some(v) if v.is_nan() => {
                            report.outcome = "NaN, counted as saturated".into();
                            Room::No
                        }
                        Some(v) if v >= *threshold => {
                            report.outcome = format!("{v} >= threshold {threshold}: saturated");
                            Room::No
                        }
                        Some(v) => {
                            report.outcome = format!("{v} < threshold {threshold}: room");
                            Room::Yes(Ticket::none())
                        }
                    }
                }
            },
            Self::RedisCounter(counter) => match counter.acquire().await {
                Err(e) => {
                    report.outcome = format!("error, counted as saturated: {e}");
                    Room::No
                }
                Ok(None) => {
                    report.outcome = "at the cap: saturated".into();
                    Room::No
                }
                Ok(Some(ticket)) => {
                    report.outcome = "slot taken: room".into();
                    Room::Yes(ticket)
                }
            },
        }
    }

    /// Reads the source without taking anything, for `gate probe`:
    /// whether a message would find room now.
    pub(crate) async fn peek(&self, report: &mut SourceReport) -> bool {
        match self {
            Self::Prometheus { .. } => matches!(self.try_acquire(report).await, Room::Yes(_)),
            Self::RedisCounter(counter) => match counter.peek().await {
                Err(e) => {
                    report.outcome = format!("error, counted as saturated: {e}");
                    false
                }
                Ok((in_flight, cap)) => {
                    report.values.push(("in flight".into(), in_flight as f64));
                    report.values.push(("cap".into(), f64::from(cap)));
                    let room = in_flight < i64::from(cap);
                    report.outcome = if room {
                        format!("{in_flight} of {cap} in flight: room")
                    } else {
                        format!("{in_flight} of {cap} in flight: saturated")
                    };
                    room
                }
            },
        }
    }

    /// How the source is named in `gate probe`.
    pub(crate) fn report(&self) -> SourceReport {
        match self {
            Self::Prometheus { query, .. } => {
                SourceReport::new("pool load query", query.source().text())
            }
            Self::RedisCounter(c) => SourceReport::new(
                "pool in-flight counter",
                format!(
                    "{} (cap {}) at {}",
                    c.inflight_key,
                    c.cap_key,
                    c.endpoint.shown()
                ),
            ),
        }
    }

    /// Facts for `gate probe`.
    pub(crate) fn notes(&self) -> Vec<String> {
        match self {
            Self::Prometheus { threshold, .. } => vec![format!(
                "source prometheus: saturated when the query's largest value is >= {threshold}; \
                 an error, no sample or a stale reading counts as saturated"
            )],
            Self::RedisCounter(c) => vec![format!(
                "source redis-counter: at most the value of {} (else fallback_cap {}) requests \
                 in flight over every replica; a Redis error counts as saturated; the counter \
                 expires {} s after the last admission",
                c.cap_key, c.fallback_cap, c.ttl_seconds
            )],
        }
    }
}

/// Takes a slot. KEYS: in-flight counter, cap. ARGV: TTL seconds, fallback
/// cap. 1 = taken, 0 = at the cap (nothing taken). Upstream's script.
const ACQUIRE_SCRIPT: &str = r#"
local cap = tonumber(redis.call("GET", KEYS[2])) or tonumber(ARGV[2])
local cur = redis.call("INCR", KEYS[1])
redis.call("EXPIRE", KEYS[1], ARGV[1])
if cur > cap then
  redis.call("DECR", KEYS[1])
  return 0
end
return 1
"#;

/// Gives a slot back without going below zero: a counter that expired
/// while the request was in flight must not start the next period in debt
/// (upstream DECRs unconditionally).
const RELEASE_SCRIPT: &str = r#"
local cur = tonumber(redis.call("GET", KEYS[1]) or "0")
if cur and cur > 0 then
  return redis.call("DECR", KEYS[1])
end
return 0
"#;

/// `redis-counter`: upstream's in-flight counter per bucket.
#[derive(Debug)]
pub(crate) struct RedisCounter {
    inner: Arc<CounterInner>,
    inflight_key: String,
    cap_key: String,
    ttl_seconds: u32,
    fallback_cap: u32,
    endpoint: Arc<RedisEndpoint>,
    acquire: redis::Script,
}

#[derive(Debug)]
struct CounterInner {
    endpoint: Arc<RedisEndpoint>,
    inflight_key: String,
    release: redis::Script,
}

impl RedisCounter {
    /// The counter of `bucket` under `key_prefix` at `endpoint`.
    pub(crate) fn new(
        endpoint: RedisEndpoint,
        key_prefix: &str,
        bucket: &str,
        ttl_seconds: u32,
        fallback_cap: u32,
    ) -> Self {
        let endpoint = Arc::new(endpoint);
        let inflight_key = inflight_key(key_prefix, bucket);
        Self {
            inner: Arc::new(CounterInner {
                endpoint: endpoint.clone(),
                inflight_key: inflight_key.clone(),
                release: redis::Script::new(RELEASE_SCRIPT),
            }),
            inflight_key,
            cap_key: cap_key(key_prefix, bucket),
            ttl_seconds,
            fallback_cap,
            endpoint,
            acquire: redis::Script::new(ACQUIRE_SCRIPT),
        }
    }

    async fn acquire(&self) -> Result<Option<Ticket>, SourceError> {
        let taken: i64 = self
            .endpoint
            .run(|mut conn| {
                let mut call = self.acquire.key(&self.inflight_key);
                call.key(&self.cap_key)
                    .arg(self.ttl_seconds)
                    .arg(self.fallback_cap);
                async move { call.invoke_async(&mut conn).await }
            })
            .await?;
        Ok((taken == 1).then(|| Ticket::holding(CounterSlot(self.inner.clone()))))
    }
}

impl RedisCounter {
    /// The counter and the cap in force (the cap key, else the fallback).
    async fn peek(&self) -> Result<(i64, u32), SourceError> {
        let (in_flight, cap): (Option<i64>, Option<String>) = self
            .endpoint
            .run(|mut conn| {
                let mut mget = redis::cmd("MGET");
                mget.arg(&self.inflight_key).arg(&self.cap_key);
                async move { mget.query_async(&mut conn).await }
            })
            .await?;
        // As the script: a cap key that is not a number means the fallback.
        let cap = cap
            .and_then(|c| c.trim().parse::<f64>().ok())
            .filter(|c| c.is_finite() && *c >= 0.0)
            .map_or(self.fallback_cap, |c| {
                c.floor().min(f64::from(u32::MAX)) as u32
            });
        Ok((in_flight.unwrap_or(0), cap))
    }
}

/// `<prefix>:inflight:<bucket>` (upstream's layout).
pub(crate) fn inflight_key(prefix: &str, bucket: &str) -> String {
    format!("{prefix}:inflight:{bucket}")
}

/// `<prefix>:cap:<bucket>` (upstream's layout).
pub(crate) fn cap_key(prefix: &str, bucket: &str) -> String {
    format!("{prefix}:cap:{bucket}")
}

/// One slot of the counter, held while the request is in flight; dropping
/// it gives the slot back (in the background: drops cannot wait). Without
/// a runtime (the process is ending) the slot stays taken until the
/// counter expires.
struct CounterSlot(Arc<CounterInner>);

impl Drop for CounterSlot {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = self.0.clone();
        runtime.spawn(async move {
            let released: Result<i64, SourceError> = inner
                .endpoint
                .run(|mut conn| {
                    let call = inner.release.key(&inner.inflight_key);
                    async move { call.invoke_async(&mut conn).await }
                })
                .await;
            if let Err(error) = released {
                tracing::warn!(%error, key = inner.inflight_key, "cannot give a pool slot back; it expires instead");
            }
        });
    }
}

/// The refresh interval and staleness limit of the `prometheus` source.
pub(crate) fn prometheus_timing(
    refresh_interval_ms: u32,
    stale_after_ms: u32,
) -> (Duration, Duration) {
    (
        Duration::from_millis(u64::from(refresh_interval_ms)),
        Duration::from_millis(u64::from(stale_after_ms)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_upstream_layout() {
        assert_eq!(inflight_key("rmp", "pool:groq"), "rmp:inflight:pool:groq");
        assert_eq!(cap_key("rmp", "pool:groq"), "rmp:cap:pool:groq");
    }
}
