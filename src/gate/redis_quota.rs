//! `redis-quota`: per-tenant admission in Redis, with upstream's keys and
//! parameters. The tenant is `metadata[attribute]`; its counter is the key
//! `<prefix><attribute>:<value>` (upstream's layout, e.g.
//! `quota:userid:alice`), one key per tenant so every script touches one
//! key (one slot on Redis Cluster).
//!
//! - `rate-limit`: a sliding window, as upstream: a ZSET of admissions
//!   scored by their time; at most `limit` in any `window`.
//! - `concurrency`: a ZSET of leases scored by their expiry; at most
//!   `limit` unexpired. Upstream counts a STRING it DECRs when a request
//!   ends, so a killed dispatcher's units never come back; here the ticket
//!   renews its lease while the request is in flight and removes it when
//!   the request ends, and a dead process's leases expire after `lease`.
//!
//! Scripts read the clock of the Redis server (`TIME`), so replicas with
//! skewed clocks share one window. A message within quota is classified
//! `reserved` (its ticket says so); one over quota waits or is refused per
//! `gating_mode`, or with `admit_overflow` goes on classified `overflow`
//! (upstream's classifying mode) for `tier-priority-admission` to judge.
//! Unlike upstream, a message without the attribute is refused unless
//! `missing_attribute = "allow"`, and Redis errors refuse (fail closed).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose};
use super::quota::{DEFAULT_LEASE, LeaseRenewal, MissingAttribute, QuotaMode, admission_only};
use super::{
    Admission, AdmissionRequest, BuildError, DispatchGate, GateContext, GateError, GatingMode,
    Observation, Ticket,
};
use crate::source::{RedisEndpoint, SourceError};
use crate::tasks::Tasks;

/// Parameters of `redis-quota`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisQuotaParams {
    /// `host:port` or `redis://host:port/db` (required).
    #[serde(deserialize_with = "loose::string")]
    pub address: String,
    /// Metadata attribute naming the tenant (default `userid`).
    #[serde(deserialize_with = "loose::string")]
    pub attribute: String,
    /// Rate limit or concurrency limit (default rate-limit).
    pub mode: QuotaMode,
    /// Limit per tenant, >= 1 (required).
    #[serde(deserialize_with = "loose::u32")]
    pub limit: u32,
    /// Rate-limit window, > 0 (default 60 s).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub window: Duration,
    /// Redis key prefix (default `quota:`).
    #[serde(deserialize_with = "loose::string")]
    pub prefix: String,
    /// Wait or refuse when over quota (default classifying = refuse).
    pub gating_mode: GatingMode,
    /// A message without the attribute: refuse (default) or allow.
    pub missing_attribute: MissingAttribute,
    /// Let over-quota messages go on classified `overflow` instead of
    /// waiting or refusing (default false); put `tier-priority-admission`
    /// after this gate in a composite so overflow only uses spare capacity.
    #[serde(deserialize_with = "loose::bool")]
    pub admit_overflow: bool,
    /// Concurrency mode: a unit's lease, renewed every third of it while
    /// the request is in flight; a dead dispatcher's units come back after
    /// it (default 30 s, at least 1 s).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub lease: Duration,
}

impl Default for RedisQuotaParams {
    fn default() -> Self {
        Self {
            address: String::new(),
            attribute: "userid".to_owned(),
            mode: QuotaMode::RateLimit,
            limit: 0,
            window: Duration::from_secs(60),
            prefix: "quota:".to_owned(),
            gating_mode: GatingMode::Classifying,
            missing_attribute: MissingAttribute::Refuse,
            admit_overflow: false,
            lease: DEFAULT_LEASE,
        }
    }
}

impl GateParams for RedisQuotaParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("address", "host:port or redis://host:port/db") {
            cx.redis_address("address", &self.address);
        }
        self.policy().validate(cx);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let endpoint = ctx.redis_endpoint("redis-quota", &self.address)?;
        Ok(Box::new(RedisQuotaGate::new(
            endpoint,
            self.clone(),
            ctx.tasks.clone(),
        )))
    }
}

/// Sliding-window rate limit. KEYS[1] the tenant's ZSET; ARGV: window µs,
/// limit, a unique member, key TTL ms. 1 = admitted, 0 = over quota.
const RATE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
";

/// Concurrency: drop expired leases, then take one if fewer than `limit`
/// remain. KEYS[1] the tenant's ZSET; ARGV: lease µs, limit, the lease's
/// member, key TTL ms. 1 = admitted, 0 = over quota.
const ACQUIRE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
";

/// Renews the leases ARGV[3..] that still exist (`XX`: an expired lease
/// that another tenant's admission removed is not brought back, so the
/// limit holds). ARGV: lease µs, key TTL ms, members.
const RENEW_SCRIPT: &str = r"
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1])
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// The `redis-quota` gate.
#[derive(Debug)]
pub struct RedisQuotaGate {
    inner: Arc<Inner>,
    renewal: LeaseRenewal,
}

#[derive(Debug)]
struct Inner {
    endpoint: RedisEndpoint,
    params: RedisQuotaParams,
    rate: redis::Script,
    acquire: redis::Script,
    renew: redis::Script,
    /// Concurrency leases this process holds: key -> members.
    held: Mutex<HashMap<String, HashSet<String>>>,
}

impl RedisQuotaGate {
    /// The gate counting at `endpoint` with `params`; its lease renewal
    /// runs on `tasks`.
    pub fn new(endpoint: RedisEndpoint, params: RedisQuotaParams, tasks: Tasks) -> Self {
        Self {
            inner: Arc::new(Inner {
                endpoint,
                params,
                rate: redis::Script::new(RATE_SCRIPT),
                acquire: redis::Script::new(ACQUIRE_SCRIPT),
                renew: redis::Script::new(RENEW_SCRIPT),
                held: Mutex::new(HashMap::new()),
            }),
            renewal: LeaseRenewal::new(tasks),
        }
    }

    /// The Redis key counting `tenant` (upstream's layout).
    pub fn key(&self, tenant: &str) -> String {
        self.inner.params.policy().key(tenant)
    }

    async fn take(&self, key: &str) -> Result<Option<Ticket>, SourceError> {
        let p = &self.inner.params;
        let member = format!("{:032x}", rand::random::<u128>());
        match p.mode {
            QuotaMode::RateLimit => {
                let admitted: i64 = self
                    .inner
                    .endpoint
                    .run(|mut conn| {
                        let mut call = self.inner.rate.key(key);
                        call.arg(micros(p.window))
                            .arg(p.limit)
                            .arg(&member)
                            .arg(millis(p.window) + 1000);
                        async move { call.invoke_async(&mut conn).await }
                    })
                    .await?;
                // Kept for the window once sent; given back if the
                // message is not sent after all (a later gate refused it),
                // so a parked message does not spend its tenant's quota
                // each time it asks again.
                Ok((admitted == 1).then(|| {
                    let (inner, key, member) = (self.inner.clone(), key.to_owned(), member.clone());
                    Ticket::none().refundable(move || inner.remove_later(key, member))
                }))
            }
            QuotaMode::Concurrency => {
                // Registered before the script runs, so a renewal never
                // misses a lease that was just taken.
                self.inner.hold(key, &member);
                let outcome: Result<i64, SourceError> = self
                    .inner
                    .endpoint
                    .run(|mut conn| {
                        let mut call = self.inner.acquire.key(key);
                        call.arg(micros(p.lease))
                            .arg(p.limit)
                            .arg(&member)
                            .arg(millis(p.lease) * 2);
                        async move { call.invoke_async(&mut conn).await }
                    })
                    .await;
                let slot = || Slot {
                    inner: self.inner.clone(),
                    key: key.to_owned(),
                    member: member.clone(),
                };
                match outcome {
                    Ok(1) => Ok(Some(Ticket::holding(slot()))),
                    Ok(_) => {
                        self.inner.forget(key, &member);
                        Ok(None)
                    }
                    Err(e) => {
                        // The lease may have been taken before the error:
                        // dropping the slot removes it.
                        drop(slot());
                        Err(e)
                    }
                }
            }
        }
    }
}

impl Inner {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<String>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hold(&self, key: &str, member: &str) {
        self.held()
            .entry(key.to_owned())
            .or_default()
            .insert(member.to_owned());
    }

    fn forget(&self, key: &str, member: &str) {
        let mut held = self.held();
        if let Some(members) = held.get_mut(key) {
            members.remove(member);
            if members.is_empty() {
                held.remove(key);
            }
        }
    }

    /// Renews every held lease, one script per tenant key.
    async fn renew_all(&self) {
        let snapshot: Vec<(String, Vec<String>)> = self
            .held()
            .iter()
            .map(|(k, m)| (k.clone(), m.iter().cloned().collect()))
            .collect();
        let lease = self.params.lease;
        for (key, members) in snapshot {
            let result: Result<i64, SourceError> = self
                .endpoint
                .run(|mut conn| {
                    let mut call = self.renew.key(&key);
                    call.arg(micros(lease)).arg(millis(lease) * 2).arg(&members);
                    async move { call.invoke_async(&mut conn).await }
                })
                .await;
            if let Err(error) = result {
                // The leases run out after `lease`: the tenant may then be
                // admitted beyond its limit by what we still have in flight.
                tracing::warn!(%error, key, "cannot renew quota leases");
            }
        }
    }
}

/// One concurrency unit held by an admitted request; dropping it (the
/// request ended) gives the unit back.
struct Slot {
    inner: Arc<Inner>,
    key: String,
    member: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.inner.forget(&self.key, &self.member);
        self.inner.clone().remove_later(
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.member),
        );
    }
}

impl Inner {
    /// Removes `member` from `key` in the background (called from drops,
    /// which cannot wait). Without a runtime (process ending) nothing is
    /// removed: a lease expires, a rate-limit admission ages out.
    fn remove_later(self: Arc<Self>, key: String, member: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let removed: Result<i64, SourceError> = self
                .endpoint
                .run(|mut conn| {
                    let mut zrem = redis::cmd("ZREM");
                    zrem.arg(&key).arg(&member);
                    async move { zrem.query_async(&mut conn).await }
                })
                .await;
            if let Err(error) = removed {
                tracing::warn!(%error, key, "cannot give a quota unit back; it expires instead");
            }
        });
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl DispatchGate for RedisQuotaGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        admission_only()
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            let policy = self.inner.params.policy();
            self.renewal.start(
                "redis-quota: lease renewal",
                policy,
                &self.inner,
                |inner| async move { inner.renew_all().await },
            );
            policy
                .admit(request.metadata, "quota", async |key| self.take(key).await)
                .await
        })
    }

    fn kind(&self) -> &'static str {
        "redis-quota"
    }
}
