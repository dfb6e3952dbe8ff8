//! `redis-leased-rate`: admission at a rate a planner leases in a Redis
//! hash (upstream `pkg/redis/leased_rate_gate.go`; NVIDIA Dynamo's planner
//! writes it). The planner decides how much, the dispatcher enforces it.
//!
//! The control hash `control_key` holds upstream's five fields:
//!
//! | field | value |
//! |---|---|
//! | `api_version` | `llm-d.ai/v1alpha1` |
//! | `pool_id` | the worker pool the lease is for (must be ours) |
//! | `max_admission_rps` | admissions per second, finite, >= 0 (0 = an explicit pause) |
//! | `valid_until_unix_ms` | the lease's expiry, whole Unix milliseconds |
//! | `decision_id` | the planner's decision, non-empty |
//!
//! A missing, empty, malformed, mismatched or expired lease, or an
//! unreadable Redis, is budget zero (fail closed) and every message is
//! refused. Admission takes one token from a bucket kept in Redis at
//! `state_key` (default `<control_key>:state`, fields `tokens` and
//! `last_ms`, upstream's layout) by one script on the Redis clock, so every
//! replica shares one rate and skewed replica clocks do not matter; the
//! bucket holds `max(1, rate × burst_seconds)` tokens. A valid lease's
//! decision id is acknowledged once per decision in `<control_key>:applied`
//! (field = replica name), as the `redis` gate acknowledges its decisions
//! (upstream acknowledges nothing; it exports gauges instead).

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, loose};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, DispatchGate, Explanation, GateContext,
    GateError, Observation, SourceReport, Ticket,
};
use crate::source::{DecisionAcks, RedisEndpoint, SourceError};

/// The wire-contract version a lease must carry (upstream's
/// `DispatchRateLimitAPIVersion`).
pub const LEASE_API_VERSION: &str = "llm-d.ai/v1alpha1";

/// The control hash's fields, in the order they are read.
const FIELDS: [&str; 5] = [
    "api_version",
    "pool_id",
    "max_admission_rps",
    "valid_until_unix_ms",
    "decision_id",
];

/// Parameters of `redis-leased-rate` (upstream's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisLeasedRateParams {
    /// `host:port` or `redis://host:port/db` (required; credentials come
    /// from `[redis]`).
    #[serde(deserialize_with = "loose::string")]
    pub address: String,
    /// The hash the planner writes (required).
    #[serde(deserialize_with = "loose::string")]
    pub control_key: String,
    /// The pool a lease must name (default: the queue's `worker_pool_id`).
    #[serde(deserialize_with = "loose::opt_string")]
    pub pool_id: Option<String>,
    /// Seconds of the leased rate the bucket may save up, > 0 (default 1).
    #[serde(deserialize_with = "loose::f64")]
    pub burst_seconds: f64,
    /// Where the token bucket lives (default `<control_key>:state`).
    #[serde(deserialize_with = "loose::opt_string")]
    pub state_key: Option<String>,
}

impl Default for RedisLeasedRateParams {
    fn default() -> Self {
        Self {
            address: String::new(),
            control_key: String::new(),
            pool_id: None,
            burst_seconds: 1.0,
            state_key: None,
        }
    }
}

impl GateParams for RedisLeasedRateParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("address", "host:port or redis://host:port/db") {
            cx.redis_address("address", &self.address);
        }
        cx.require("control_key", "the Redis hash the planner writes");
        // Upstream refuses a non-finite or non-positive burst at startup
        // too; a NaN cannot get here (numbers are finite).
        cx.positive("burst_seconds", self.burst_seconds);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let endpoint = ctx.redis_endpoint("redis-leased-rate", &self.address)?;
        let state_key = self
            .state_key
            .clone()
            .unwrap_or_else(|| format!("{}:state", self.control_key));
        // One script reads the lease and writes the bucket: on a cluster
        // both keys must live in one slot (a hash tag in `control_key`,
        // e.g. `{dynamo-batch}:drain-limit`, covers the default state key).
        let cluster = ctx.redis.as_ref().is_some_and(|r| r.cluster);
        if cluster
            && crate::redis::key_slot(&self.control_key) != crate::redis::key_slot(&state_key)
        {
            return Err(BuildError::MissingParam {
                gate_type: "redis-leased-rate",
                param: "state_key",
                why: format!(
                    "on a Redis Cluster `{}` and `{state_key}` must hash to one slot: \
                     put a hash tag in control_key (e.g. `{{pool}}:drain-limit`)",
                    self.control_key
                ),
            });
        }
        let pool_id = self
            .pool_id
            .clone()
            .unwrap_or_else(|| ctx.worker_pool_id.clone());
        Ok(Box::new(RedisLeasedRateGate {
            endpoint,
            control_key: self.control_key.clone(),
            state_key,
            pool_id,
            burst_seconds: self.burst_seconds,
            acks: DecisionAcks::new(ctx.replica.clone()),
            script: redis::Script::new(ACQUIRE_SCRIPT),
        }))
    }
}

/// A valid lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// Admissions per second (0 = paused).
    pub rps: f64,
    /// Expiry, Unix milliseconds.
    pub valid_until_ms: i64,
    /// The planner's decision.
    pub decision_id: String,
}

/// Why the control hash holds no usable lease.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LeaseError {
    /// A field is absent or empty (no hash at all included).
    #[error("lease field {0} is missing")]
    Missing(&'static str),
    /// `api_version` is not the one this gate speaks.
    #[error("lease api_version {0:?} is not {LEASE_API_VERSION:?}")]
    Version(String),
    /// The lease is for another pool.
    #[error("lease is for pool {found:?}, this queue's pool is {want:?}")]
    OtherPool {
        /// The lease's pool.
        found: String,
        /// Ours.
        want: String,
    },
    /// A field does not parse or is out of range.
    #[error("lease field {field} is {value:?}: {why}")]
    Malformed {
        /// The field.
        field: &'static str,
        /// Its text (shortened).
        value: String,
        /// What it should be.
        why: &'static str,
    },
    /// `valid_until_unix_ms` is not after now.
    #[error("lease expired {ago_ms} ms ago")]
    Expired {
        /// How long ago.
        ago_ms: i64,
    },
}

/// Checks the five fields of the control hash (in `FIELDS` order) at
/// `now_ms` (Unix milliseconds) for `pool_id`, as upstream's
/// `ValidateAt` plus its pool check.
pub fn parse_lease(
    values: &[Option<String>],
    pool_id: &str,
    now_ms: i64,
) -> Result<Lease, LeaseError> {
    let field = |i: usize| -> Result<&str, LeaseError> {
        values
            .get(i)
            .and_then(Option::as_deref)
            .filter(|v| !v.is_empty())
            .ok_or(LeaseError::Missing(FIELDS[i]))
    };
    let (version, pool, rps, until, decision) =
        (field(0)?, field(1)?, field(2)?, field(3)?, field(4)?);
    let malformed = |field: &'static str, value: &str, why: &'static str| LeaseError::Malformed {
        field,
        value: value.chars().take(40).collect(),
        why,
    };
    if version != LEASE_API_VERSION {
        return Err(LeaseError::Version(version.to_owned()));
    }
    if pool != pool_id {
        return Err(LeaseError::OtherPool {
            found: pool.to_owned(),
            want: pool_id.to_owned(),
        });
    }
    let rps = rps
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|r| r.is_finite() && *r >= 0.0)
        .ok_or_else(|| malformed(FIELDS[2], rps, "a finite number >= 0"))?;
    // Whole milliseconds, as upstream's ParseInt: "1700000060000.5" and
    // "+Inf" are malformed, not rounded.
    let valid_until_ms = until
        .trim()
        .parse::<i64>()
        .map_err(|_| malformed(FIELDS[3], until, "whole Unix milliseconds"))?;
    if valid_until_ms <= now_ms {
        return Err(LeaseError::Expired {
            ago_ms: now_ms - valid_until_ms,
        });
    }
    Ok(Lease {
        rps,
        valid_until_ms,
        decision_id: decision.to_owned(),
    })
}

/// Takes one token if the lease allows. KEYS: control hash, state hash.
/// ARGV: api version, pool id, burst seconds. Returns {allowed, lease
/// valid, rate as text, valid until ms}. The lease is checked again here,
/// on the Redis clock, so a lease that expires between a reading and an
/// admission admits nothing; a malformed lease creates no state.
const ACQUIRE_SCRIPT: &str = r#"
local c = redis.call("HMGET", KEYS[1], "api_version", "pool_id", "max_admission_rps",
  "valid_until_unix_ms", "decision_id")
for i = 1, 5 do
  if not c[i] or c[i] == "" then return {0, 0, "0", 0} end
end
if c[1] ~= ARGV[1] or c[2] ~= ARGV[2] then return {0, 0, "0", 0} end
local rate = tonumber(c[3])
local valid_until = tonumber(c[4])
local burst = tonumber(ARGV[3])
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not rate or rate ~= rate or rate == math.huge or rate < 0 then return {0, 0, "0", 0} end
if not valid_until or valid_until ~= valid_until or valid_until == math.huge
  or valid_until == -math.huge or valid_until % 1 ~= 0 or valid_until <= now then
  return {0, 0, "0", 0}
end
if not burst or burst ~= burst or burst == math.huge or burst <= 0 then return {0, 0, "0", 0} end
if rate == 0 then return {0, 1, "0", valid_until} end
local capacity = rate * burst
if capacity ~= capacity or capacity == math.huge then return {0, 0, "0", 0} end
if capacity < 1 then capacity = 1 end
local tokens = tonumber(redis.call("HGET", KEYS[2], "tokens"))
local last = tonumber(redis.call("HGET", KEYS[2], "last_ms"))
if not tokens or not last then
  tokens = capacity
  last = now
else
  -- A Redis clock that stepped back must not refill the same time twice.
  if now < last then now = last end
  tokens = math.min(capacity, tokens + ((now - last) / 1000.0) * rate)
end
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call("HSET", KEYS[2], "tokens", tostring(tokens), "last_ms", tostring(now))
redis.call("PEXPIRE", KEYS[2], math.max(1000, valid_until - now + 1000))
return {allowed, 1, tostring(rate), valid_until}
"#;

/// The `redis-leased-rate` gate.
#[derive(Debug)]
pub struct RedisLeasedRateGate {
    endpoint: RedisEndpoint,
    control_key: String,
    state_key: String,
    pool_id: String,
    burst_seconds: f64,
    /// This replica's acknowledgements in `<control_key>:applied`.
    acks: DecisionAcks,
    script: redis::Script,
}

impl RedisLeasedRateGate {
    /// Reads the control hash.
    async fn read_fields(&self) -> Result<Vec<Option<String>>, SourceError> {
        self.endpoint
            .run(|mut conn| {
                let mut hmget = redis::cmd("HMGET");
                hmget.arg(&self.control_key).arg(&FIELDS[..]);
                async move { hmget.query_async::<Vec<Option<String>>>(&mut conn).await }
            })
            .await
    }

    /// Reads the lease and says how, for `observe` and `explain`;
    /// `acknowledge`: write a valid lease's decision back (the dispatcher
    /// applies it; `gate probe` only looks, and must not say it applied).
    async fn read(
        &self,
        report: &mut SourceReport,
        acknowledge: bool,
    ) -> Result<Observation, GateError> {
        let fields = match self.read_fields().await {
            Ok(f) => f,
            Err(e) => {
                report.outcome = format!("error: {e}");
                return Err(GateError::source("redis-leased-rate", e));
            }
        };
        let now_ms = crate::clock::unix_millis();
        match parse_lease(&fields, &self.pool_id, now_ms) {
            Err(e) => {
                report.outcome = format!("no usable lease: {e}");
                Err(GateError::SourceUnavailable(e.to_string()))
            }
            Ok(lease) => {
                report.values.push(("max_admission_rps".into(), lease.rps));
                report.outcome = "used".into();
                if acknowledge {
                    self.acks
                        .acknowledge(&self.endpoint, &self.control_key, &lease.decision_id)
                        .await;
                }
                let left_ms = lease.valid_until_ms - now_ms;
                // The exact rate is the bucket's business at admission; the
                // budget only says whether the lease lets anything through
                // (as upstream's Budget), read afresh at every call.
                let (budget, what) = if lease.rps > 0.0 {
                    (Budget::FULL, format!("{} admissions/s", lease.rps))
                } else {
                    (Budget::ZERO, "paused (max_admission_rps 0)".to_owned())
                };
                let mut reading = Observation::open(budget, Instant::now());
                reading.reason = format!(
                    "lease {}: {what}, valid for {} ms more",
                    lease.decision_id, left_ms
                );
                Ok(reading)
            }
        }
    }

    fn report(&self) -> SourceReport {
        SourceReport::new(
            "rate lease",
            format!("HMGET {} at {}", self.control_key, self.endpoint.shown()),
        )
    }

    /// One token from the shared bucket, if the lease allows.
    async fn acquire(&self) -> Result<Acquired, SourceError> {
        let (allowed, valid, rate, _until): (i64, i64, String, i64) = self
            .endpoint
            .run(|mut conn| {
                let mut call = self.script.key(&self.control_key);
                call.key(&self.state_key)
                    .arg(LEASE_API_VERSION)
                    .arg(&self.pool_id)
                    .arg(self.burst_seconds);
                async move { call.invoke_async(&mut conn).await }
            })
            .await?;
        Ok(match (allowed, valid) {
            (1, _) => Acquired::Token,
            (_, 1) if rate.trim().parse::<f64>().is_ok_and(|r| r == 0.0) => Acquired::Paused,
            (_, 1) => Acquired::Empty,
            _ => Acquired::NoLease,
        })
    }
}

/// What one admission found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Acquired {
    /// A token was taken.
    Token,
    /// The bucket is empty.
    Empty,
    /// The lease is valid with rate 0.
    Paused,
    /// No usable lease.
    NoLease,
}

impl DispatchGate for RedisLeasedRateGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            let mut report = self.report();
            self.read(&mut report, true).await
        })
    }

    fn admit<'a>(&'a self, _request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            // Refused, never dropped or failed, as upstream: a planner
            // outage must not turn into results. Wrap the gate in
            // `wait-on-refuse` to park messages instead of requeueing them.
            match self.acquire().await {
                // Kept once taken, as upstream (its token is not returned
                // if a later gate says no).
                Ok(Acquired::Token) => Admission::Continue(Ticket::none()),
                Ok(Acquired::Empty) => Admission::Refuse {
                    reason: "rate_limited",
                },
                Ok(Acquired::Paused) => Admission::Refuse {
                    reason: "lease_paused",
                },
                Ok(Acquired::NoLease) => Admission::Refuse {
                    reason: "lease_invalid",
                },
                Err(error) => {
                    tracing::warn!(%error, key = %self.control_key, "rate lease unreadable; refusing");
                    Admission::Refuse {
                        reason: "lease_unavailable",
                    }
                }
            }
        })
    }

    fn kind(&self) -> &'static str {
        "redis-leased-rate"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let mut report = self.report();
            let observation = self.read(&mut report, false).await;
            let notes = vec![
                format!(
                    "the lease must carry api_version {LEASE_API_VERSION:?} and pool_id {:?}, \
                     and valid_until_unix_ms after now; otherwise budget 0 and every message \
                     is refused",
                    self.pool_id
                ),
                format!(
                    "admission takes a token from {} (shared by every replica, Redis clock), \
                     holding up to max(1, rate × {} s)",
                    self.state_key, self.burst_seconds
                ),
                format!(
                    "the dispatcher acknowledges each decision in {}:applied as its replica \
                     name (this probe reads without acknowledging)",
                    self.control_key
                ),
            ];
            Explanation {
                observation,
                sources: vec![report],
                notes,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::param::parse_errors as errors;

    const NOW: i64 = 1_700_000_000_000;

    fn lease(rps: &str, until: &str) -> Vec<Option<String>> {
        [LEASE_API_VERSION, "pool-a", rps, until, "d-1"]
            .iter()
            .map(|s| Some((*s).to_owned()))
            .collect()
    }

    #[test]
    fn a_valid_lease_parses() {
        let l = parse_lease(&lease("2.5", "1700000060000"), "pool-a", NOW).expect("valid");
        assert_eq!(l.rps, 2.5);
        assert_eq!(l.valid_until_ms, 1_700_000_060_000);
        assert_eq!(l.decision_id, "d-1");
        let paused = parse_lease(&lease("0", "1700000060000"), "pool-a", NOW).expect("a pause");
        assert_eq!(paused.rps, 0.0);
    }

    #[test]
    fn expiry_is_exclusive() {
        assert_eq!(
            parse_lease(&lease("1", "1700000000000"), "pool-a", NOW),
            Err(LeaseError::Expired { ago_ms: 0 })
        );
        assert_eq!(
            parse_lease(&lease("1", "1699999999000"), "pool-a", NOW),
            Err(LeaseError::Expired { ago_ms: 1000 })
        );
        assert!(parse_lease(&lease("1", "1700000000001"), "pool-a", NOW).is_ok());
    }

    #[test]
    fn missing_empty_and_foreign_leases_are_refused() {
        assert_eq!(
            parse_lease(&[None, None, None, None, None], "pool-a", NOW),
            Err(LeaseError::Missing("api_version"))
        );
        let mut no_decision = lease("1", "1700000060000");
        no_decision[4] = Some(String::new());
        assert_eq!(
            parse_lease(&no_decision, "pool-a", NOW),
            Err(LeaseError::Missing("decision_id"))
        );
        assert!(matches!(
            parse_lease(&lease("1", "1700000060000"), "pool-b", NOW),
            Err(LeaseError::OtherPool { .. })
        ));
        let mut old = lease("1", "1700000060000");
        old[0] = Some("llm-d.ai/v0".into());
        assert!(matches!(
            parse_lease(&old, "pool-a", NOW),
            Err(LeaseError::Version(_))
        ));
        assert!(matches!(
            parse_lease(&lease("1", "1700000060000")[..3], "pool-a", NOW),
            Err(LeaseError::Missing("valid_until_unix_ms"))
        ));
    }

    #[test]
    fn malformed_numbers_are_refused_as_upstream() {
        for rps in ["NaN", "+Inf", "-Inf", "-1", "fast"] {
            assert!(
                matches!(
                    parse_lease(&lease(rps, "1700000060000"), "pool-a", NOW),
                    Err(LeaseError::Malformed {
                        field: "max_admission_rps",
                        ..
                    })
                ),
                "{rps}"
            );
        }
        for until in ["1700000060000.5", "NaN", "+Inf", "soon"] {
            assert!(
                matches!(
                    parse_lease(&lease("1", until), "pool-a", NOW),
                    Err(LeaseError::Malformed {
                        field: "valid_until_unix_ms",
                        ..
                    })
                ),
                "{until}"
            );
        }
    }

    #[test]
    fn config_takes_upstream_names_with_upstream_defaults() {
        use crate::gate::GateSpec;
        use serde_json::json;
        let spec = GateSpec::parse(
            "redis-leased-rate",
            &json!({"address": "127.0.0.1:6379", "control_key": "drain"}),
            "q",
        )
        .expect("valid");
        let p = spec.to_upstream()["gate_params"].clone();
        assert_eq!(p["burst_seconds"], 1.0);
        assert!(p.get("state_key").is_none() && p.get("pool_id").is_none());
        let again = GateSpec::parse("redis-leased-rate", &p, "q").expect("round trip");
        assert_eq!(again, spec);
        let e = errors("redis-leased-rate", json!({"burst_seconds": 0}));
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "q.gate_params.address",
                "q.gate_params.control_key",
                "q.gate_params.burst_seconds"
            ],
            "{e:?}"
        );
        let e = errors(
            "redis-leased-rate",
            json!({"address": "a:1", "control_key": "k", "rate": 5}),
        );
        assert!(
            e[0].1
                .contains("allowed: address, control_key, pool_id, burst_seconds, state_key"),
            "{e:?}"
        );
    }

    #[test]
    fn builds_without_connecting_and_names_the_pool() {
        use crate::gate::GateSpec;
        use serde_json::json;
        let spec = GateSpec::parse(
            "redis-leased-rate",
            &json!({"address": "127.0.0.1:1", "control_key": "drain"}),
            "q",
        )
        .expect("valid");
        let mut ctx = GateContext::new(
            None,
            None,
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(10),
        );
        ctx.worker_pool_id = "batch-pool".into();
        let gate = spec.build(&ctx).expect("builds");
        assert_eq!(gate.kind(), "redis-leased-rate");
        assert!(format!("{gate:?}").contains("batch-pool"));
    }
}
