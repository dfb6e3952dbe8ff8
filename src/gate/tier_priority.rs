//! `tier-priority-admission`: tier-aware admission when the pool is full
//! (upstream's three-way verdict):
//!
//! | saturated | classification | tier             | verdict                      |
//! |-----------|----------------|------------------|------------------------------|
//! | no        | any            | any              | admitted (the saturation gate's own verdict) |
//! | yes       | reserved       | any              | wait (parked until room)     |
//! | yes       | other          | `fail_fast_tier` | drop: `GATE_DROPPED` result  |
//! | yes       | other          | other            | refuse (requeue with delay)  |
//!
//! Two shapes say how saturation is read, and a config sets exactly one:
//!
//! - upstream `main`'s `saturation_gate` (+ `saturation_gate_params`): a
//!   gate whose reading has no headroom (`D <= B`), cannot be read or is
//!   older than the staleness limit means saturated (fail closed);
//! - upstream PR #186's `source = prometheus | redis-counter`
//!   (`pool_load.rs`): a PromQL value against `threshold`, or an in-flight
//!   counter in Redis against a cap; errors and stale readings are
//!   saturated here (upstream fails open).
//!
//! The classification is the one an earlier `redis-quota` gave the message
//! in the same composite, else the label `class_label` (unset: the envelope
//! label `classification`, upstream `main`'s, then `class`, PR #186's
//! default) compared with `reserved_value`; anything else counts as
//! overflow (it holds no reservation). The dropped message's result
//! carries `fail_fast_body` as its payload (PR #186; its default names
//! `fail_fast_status`); in the `saturation_gate` shape without either
//! parameter it is the plain `GATE_DROPPED` payload, as before. The gate's
//! own budget is open: it decides per message.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, decode, loose};
use super::pool_load::{PoolLoad, RedisCounter, Room, cap_key, inflight_key, prometheus_timing};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, Classification, DispatchEvent, DispatchGate,
    DropAnswer, Explanation, GateContext, GateError, Observation,
};
use super::{GATE_TYPES, GateSpec};
use crate::source::{Cached, PromAuth, PromClient};

/// The tier whose overflow is dropped rather than refused when saturated
/// (upstream's fail-fast tier: its SLA is too short for a requeue).
pub(crate) const FAIL_FAST_TIER: &str = "interactive";
/// The envelope label that may carry a quota classification (upstream
/// `main`).
pub(crate) const CLASSIFICATION_LABEL: &str = "classification";
/// PR #186's default `class_label`.
const CLASS_LABEL: &str = "class";

/// Where the `source` shape reads the pool's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadSource {
    /// A PromQL query against `threshold`.
    Prometheus,
    /// An in-flight counter in Redis against a cap.
    RedisCounter,
}

impl LoadSource {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prometheus => "prometheus",
            Self::RedisCounter => "redis-counter",
        }
    }

    /// The parameters that belong to this source only.
    fn keys(self) -> &'static [&'static str] {
        match self {
            Self::Prometheus => PROMETHEUS_KEYS,
            Self::RedisCounter => REDIS_COUNTER_KEYS,
        }
    }
}

const PROMETHEUS_KEYS: &[&str] = &[
    "url",
    "query",
    "threshold",
    "refresh_interval_ms",
    "stale_after_ms",
];
const REDIS_COUNTER_KEYS: &[&str] = &[
    "address",
    "bucket",
    "key_prefix",
    "ttl_seconds",
    "fallback_cap",
];

/// Parameters of `tier-priority-admission`: upstream `main`'s
/// `saturation_gate` shape or PR #186's `source` shape, and what both share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierPriorityAdmissionParams {
    /// The gate that measures saturation (upstream `main`). Upstream also
    /// writes it as a type name with `saturation_gate_params` beside it.
    pub saturation_gate: Option<Box<GateSpec>>,
    /// Where saturation is read instead (PR #186).
    pub source: Option<LoadSource>,
    /// Message label holding the tier (default `tier`).
    #[serde(deserialize_with = "loose::string")]
    pub tier_label: String,
    /// Message label holding the class (unset: `classification`, then
    /// `class`).
    #[serde(deserialize_with = "loose::opt_string")]
    pub class_label: Option<String>,
    /// The class value that means reserved (default `reserved`).
    #[serde(deserialize_with = "loose::string")]
    pub reserved_value: String,
    /// The class value that means overflow (default `overflow`); accepted
    /// for upstream's configs: anything not reserved is overflow, as there.
    #[serde(deserialize_with = "loose::string")]
    pub overflow_value: String,
    /// The tier whose overflow is dropped (default `interactive`).
    #[serde(deserialize_with = "loose::string")]
    pub fail_fast_tier: String,
    /// The status named in the default `fail_fast_body` (default 429). The
    /// result has no `status_code`: the gateway never answered.
    #[serde(deserialize_with = "loose::opt_u32")]
    pub fail_fast_status: Option<u32>,
    /// The payload of a dropped message's result (default
    /// `{"error":"pool saturated","status":<fail_fast_status>}`).
    #[serde(deserialize_with = "loose::opt_string")]
    pub fail_fast_body: Option<String>,
    /// Upstream's poll of a blocked reserved message (default 100); here a
    /// waiting message is parked and asks again when a request finishes or
    /// the park recheck comes, so it only has to be >= 1.
    #[serde(deserialize_with = "loose::opt_u32")]
    pub block_poll_interval_ms: Option<u32>,
    /// `prometheus`: Prometheus base URL (default `[prometheus] url`, whose
    /// credentials are used only then).
    #[serde(deserialize_with = "loose::opt_string")]
    pub url: Option<String>,
    /// `prometheus`: the PromQL expression (required).
    #[serde(deserialize_with = "loose::opt_string")]
    pub query: Option<String>,
    /// `prometheus`: saturated at or above this value (required).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub threshold: Option<f64>,
    /// `prometheus`: how often the query is read at most (default 1000).
    #[serde(deserialize_with = "loose::opt_u32")]
    pub refresh_interval_ms: Option<u32>,
    /// `prometheus`: a reading older than this is saturated (default 30000).
    #[serde(deserialize_with = "loose::opt_u32")]
    pub stale_after_ms: Option<u32>,
    /// `redis-counter`: `host:port` or `redis://…` (ours; default `[redis]
    /// url`, as upstream uses the transport's Redis).
    #[serde(deserialize_with = "loose::opt_string")]
    pub address: Option<String>,
    /// `redis-counter`: the counter's name, e.g. `pool:groq` (required).
    #[serde(deserialize_with = "loose::opt_string")]
    pub bucket: Option<String>,
    /// `redis-counter`: key prefix (default `rmp`).
    #[serde(deserialize_with = "loose::opt_string")]
    pub key_prefix: Option<String>,
    /// `redis-counter`: the counter expires this long after the last
    /// admission (default 86400: what a killed dispatcher leaks lasts that
    /// long).
    #[serde(deserialize_with = "loose::opt_u32")]
    pub ttl_seconds: Option<u32>,
    /// `redis-counter`: the cap while the cap key is unset (default 0:
    /// always saturated until a cap is written).
    #[serde(deserialize_with = "loose::opt_u32")]
    pub fallback_cap: Option<u32>,
}

impl Default for TierPriorityAdmissionParams {
    fn default() -> Self {
        Self {
            saturation_gate: None,
            source: None,
            tier_label: "tier".to_owned(),
            class_label: None,
            reserved_value: Classification::Reserved.as_str().to_owned(),
            overflow_value: Classification::Overflow.as_str().to_owned(),
            fail_fast_tier: FAIL_FAST_TIER.to_owned(),
            fail_fast_status: None,
            fail_fast_body: None,
            block_poll_interval_ms: None,
            url: None,
            query: None,
            threshold: None,
            refresh_interval_ms: None,
            stale_after_ms: None,
            address: None,
            bucket: None,
            key_prefix: None,
            ttl_seconds: None,
            fallback_cap: None,
        }
    }
}

const DEFAULT_FAIL_FAST_STATUS: u32 = 429;
const DEFAULT_REFRESH_MS: u32 = 1000;
const DEFAULT_STALE_AFTER_MS: u32 = 30_000;
const DEFAULT_KEY_PREFIX: &str = "rmp";
const DEFAULT_TTL_SECONDS: u32 = 86_400;

impl TierPriorityAdmissionParams {
    /// The payload of a dropped message's result, `None` for the plain
    /// `GATE_DROPPED` payload (the `saturation_gate` shape without
    /// fail-fast parameters, as before PR #186).
    pub fn fail_fast_payload(&self) -> Option<String> {
        if let Some(body) = &self.fail_fast_body {
            return Some(body.clone());
        }
        if self.source.is_none() && self.fail_fast_status.is_none() {
            return None;
        }
        let status = self.fail_fast_status.unwrap_or(DEFAULT_FAIL_FAST_STATUS);
        // Upstream marshals a Go map: keys in order, no spaces.
        Some(serde_json::json!({"error": "pool saturated", "status": status}).to_string())
    }

    fn build_load(&self, source: LoadSource, ctx: &GateContext) -> Result<PoolLoad, BuildError> {
        const GATE: &str = "tier-priority-admission";
        match source {
            LoadSource::Prometheus => {
                let client = match &self.url {
                    Some(url) => {
                        let parsed = url::Url::parse(url).map_err(|source| BuildError::Url {
                            url: url.clone(),
                            source,
                        })?;
                        PromClient::new(&parsed, &PromAuth::None, ctx.source_timeout).map_err(
                            |source| BuildError::Source {
                                what: format!("{GATE} url {url}"),
                                source,
                            },
                        )?
                    }
                    None => ctx.prom_client(GATE)?,
                };
                let (refresh, stale) = prometheus_timing(
                    self.refresh_interval_ms.unwrap_or(DEFAULT_REFRESH_MS),
                    self.stale_after_ms.unwrap_or(DEFAULT_STALE_AFTER_MS),
                );
                // Validation requires both; a hand-built spec without them
                // must not become a source that never saturates.
                let (Some(query), Some(threshold)) = (&self.query, self.threshold) else {
                    return Err(BuildError::MissingParam {
                        gate_type: GATE,
                        param: "query",
                        why: "source = prometheus needs query and threshold".into(),
                    });
                };
                Ok(PoolLoad::Prometheus {
                    query: Cached::new(client.query(query.clone()), refresh, stale),
                    threshold,
                })
            }
            LoadSource::RedisCounter => {
                let address = match (&self.address, &ctx.redis) {
                    (Some(a), _) => a.clone(),
                    (None, Some(r)) => r.url.expose().to_string(),
                    (None, None) => {
                        return Err(BuildError::MissingParam {
                            gate_type: GATE,
                            param: "address",
                            why: "source = redis-counter needs a Redis: set address or [redis] url"
                                .into(),
                        });
                    }
                };
                let endpoint = ctx.redis_endpoint(GATE, &address)?;
                let prefix = self.key_prefix.as_deref().unwrap_or(DEFAULT_KEY_PREFIX);
                let Some(bucket) = self.bucket.as_deref() else {
                    return Err(BuildError::MissingParam {
                        gate_type: GATE,
                        param: "bucket",
                        why: "source = redis-counter needs a bucket".into(),
                    });
                };
                // One script touches both keys: on a cluster they must share a
                // slot, which a hash tag in the bucket (`{groq}`) gives.
                let cluster = ctx.redis.as_ref().is_some_and(|r| r.cluster);
                let (a, b) = (inflight_key(prefix, bucket), cap_key(prefix, bucket));
                if cluster && crate::redis::key_slot(&a) != crate::redis::key_slot(&b) {
                    return Err(BuildError::MissingParam {
                        gate_type: GATE,
                        param: "bucket",
                        why: format!(
                            "on a Redis Cluster `{a}` and `{b}` must hash to one slot: \
                             put a hash tag in bucket (e.g. `{{{bucket}}}`)"
                        ),
                    });
                }
                Ok(PoolLoad::RedisCounter(RedisCounter::new(
                    endpoint,
                    prefix,
                    bucket,
                    self.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS),
                    self.fallback_cap.unwrap_or(0),
                )))
            }
        }
    }
}

impl GateParams for TierPriorityAdmissionParams {
    const EXTRA_KEYS: &'static [&'static str] = &["saturation_gate_params"];

    fn parse(mut map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        // The nested gate is parsed here (its errors keyed under it); the
        // rest by the common decoder, whose `validate` sees which shape
        // was given.
        let gate = cx.take(&mut map, "saturation_gate");
        let gate_params = cx.take(&mut map, "saturation_gate_params");
        let params = decode::<Self>(map, cx);
        let gate_key = cx.key("saturation_gate");
        let saturation_gate = match gate {
            // A gate type name, with its parameters beside it.
            Some(Value::String(s)) if !s.trim_start().starts_with('{') => {
                let params_key = cx.key("saturation_gate_params");
                GateSpec::parse_split(
                    &Value::String(s),
                    gate_params.as_ref(),
                    gate_key,
                    params_key,
                    cx.depth,
                    cx.errors,
                )
            }
            Some(v) => {
                if gate_params.is_some() {
                    cx.error(
                        "saturation_gate_params",
                        "not allowed when saturation_gate is a gate object (put gate_params inside it)",
                    );
                }
                cx.nested(&v, &gate_key)
            }
            None => {
                if gate_params.is_some() {
                    cx.error(
                        "saturation_gate_params",
                        "only with saturation_gate (the gate type they are for)",
                    );
                }
                None
            }
        };
        let mut params = params?;
        params.saturation_gate = saturation_gate.map(Box::new);
        (params.saturation_gate.is_some() || params.source.is_some()).then_some(params)
    }

    fn validate(&self, cx: &mut ParseCx<'_>) {
        let legacy = cx.is_set("saturation_gate");
        match (legacy, self.source) {
            (true, Some(_)) => cx.error(
                "source",
                "set either saturation_gate (with saturation_gate_params) or source \
                 (prometheus | redis-counter), not both",
            ),
            (false, None) if !cx.is_set("source") => {
                let gate = cx.gate_type;
                cx.error(
                    "source",
                    format!(
                        "required parameter of gate `{gate}` is missing: source (prometheus | \
                         redis-counter) or saturation_gate (a gate type name or gate object; \
                         allowed types: {})",
                        GATE_TYPES.join(", ")
                    ),
                );
            }
            _ => {}
        }
        // Parameters of the other source, or of a source with the
        // saturation_gate shape, would be silently ignored: errors.
        for other in [LoadSource::Prometheus, LoadSource::RedisCounter] {
            if self.source == Some(other) {
                continue;
            }
            for key in other.keys() {
                if cx.is_set(key) {
                    cx.error(
                        key,
                        format!(
                            "only with source = {} (set here: {})",
                            other.as_str(),
                            match self.source {
                                Some(s) => format!("source = {}", s.as_str()),
                                None => "saturation_gate".to_owned(),
                            }
                        ),
                    );
                }
            }
        }
        match self.source {
            Some(LoadSource::Prometheus) => {
                cx.require(
                    "query",
                    "a PromQL expression whose value is the pool's load",
                );
                cx.require("threshold", "saturated at or above this value");
                if let Some(url) = &self.url {
                    cx.http_url("url", url);
                }
                for (key, v) in [
                    ("refresh_interval_ms", self.refresh_interval_ms),
                    ("stale_after_ms", self.stale_after_ms),
                ] {
                    if let Some(v) = v {
                        cx.at_least_one(key, v);
                    }
                }
            }
            Some(LoadSource::RedisCounter) => {
                cx.require("bucket", "the counter's name, e.g. pool:groq");
                if let Some(address) = &self.address {
                    cx.redis_address("address", address);
                }
                if let Some(ttl) = self.ttl_seconds {
                    cx.at_least_one("ttl_seconds", ttl);
                }
                if self.key_prefix.as_deref() == Some("") {
                    cx.error("key_prefix", "must not be empty");
                }
            }
            None => {}
        }
        if let Some(status) = self.fail_fast_status
            && !(100..=599).contains(&status)
        {
            cx.error(
                "fail_fast_status",
                format!("must be an HTTP status in 100..=599, got {status}"),
            );
        }
        if let Some(ms) = self.block_poll_interval_ms {
            cx.at_least_one("block_poll_interval_ms", ms);
        }
        for (key, v) in [
            ("tier_label", &self.tier_label),
            ("reserved_value", &self.reserved_value),
            ("fail_fast_tier", &self.fail_fast_tier),
        ] {
            if v.is_empty() {
                cx.error(key, "must not be empty");
            }
        }
        if self.class_label.as_deref() == Some("") {
            cx.error("class_label", "must not be empty");
        }
    }

    fn children(&self) -> Vec<&GateSpec> {
        self.saturation_gate.iter().map(AsRef::as_ref).collect()
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let judge = match (&self.saturation_gate, self.source) {
            (Some(gate), _) => Judge::Gate {
                saturation: gate.build(ctx)?,
                max_staleness: ctx.max_staleness,
            },
            (None, Some(source)) => Judge::Load(self.build_load(source, ctx)?),
            // Validation requires one of them; a hand-built spec without
            // either would be an open gate: refuse it.
            (None, None) => {
                return Err(BuildError::MissingParam {
                    gate_type: "tier-priority-admission",
                    param: "source",
                    why: "set source or saturation_gate".into(),
                });
            }
        };
        Ok(Box::new(TierPriorityGate {
            judge,
            labels: Labels {
                tier: self.tier_label.clone(),
                class: self.class_label.clone(),
                reserved: self.reserved_value.clone(),
                fail_fast_tier: self.fail_fast_tier.clone(),
            },
            fail_fast: self.fail_fast_payload().map(Arc::from),
        }))
    }
}

/// How the gate reads saturation.
#[derive(Debug)]
enum Judge {
    /// Upstream `main`: a gate; unreadable or stale counts as saturated.
    Gate {
        saturation: Box<dyn DispatchGate>,
        max_staleness: Duration,
    },
    /// PR #186: a pool-load source.
    Load(PoolLoad),
}

/// Which labels say what.
#[derive(Debug, Clone)]
struct Labels {
    tier: String,
    class: Option<String>,
    reserved: String,
    fail_fast_tier: String,
}

impl Labels {
    /// Whether the message is reserved: a quota classification first, then
    /// the class label.
    fn reserved(&self, request: &AdmissionRequest<'_>) -> bool {
        if let Some(c) = request.classification {
            return c == Classification::Reserved;
        }
        let class = match &self.class {
            Some(label) => request.labels.get(label),
            None => request
                .labels
                .get(CLASSIFICATION_LABEL)
                .or_else(|| request.labels.get(CLASS_LABEL)),
        };
        class.is_some_and(|c| *c == self.reserved)
    }
}

/// The `tier-priority-admission` gate.
#[derive(Debug)]
pub struct TierPriorityGate {
    judge: Judge,
    labels: Labels,
    /// The payload of a dropped message's result; `None`: plain.
    fail_fast: Option<Arc<str>>,
}

impl TierPriorityGate {
    /// Judges messages by `saturation`'s reading and the `tier_label`
    /// label (upstream `main`'s shape, default labels); a reading older
    /// than `max_staleness` counts as saturated.
    pub fn new(
        saturation: Box<dyn DispatchGate>,
        tier_label: impl Into<String>,
        max_staleness: Duration,
    ) -> Self {
        Self {
            judge: Judge::Gate {
                saturation,
                max_staleness,
            },
            labels: Labels {
                tier: tier_label.into(),
                class: None,
                reserved: Classification::Reserved.as_str().to_owned(),
                fail_fast_tier: FAIL_FAST_TIER.to_owned(),
            },
            fail_fast: None,
        }
    }

    /// The verdict at saturation.
    fn saturated(&self, request: &AdmissionRequest<'_>) -> Admission {
        let tier = request.labels.get(&self.labels.tier).map(String::as_str);
        saturated_verdict(
            self.labels.reserved(request),
            tier == Some(self.labels.fail_fast_tier.as_str()),
            self.fail_fast.as_ref(),
        )
    }
}

/// The verdict at saturation for a message that is `reserved` or not and
/// of the fail-fast tier or not.
pub(crate) fn saturated_verdict(
    reserved: bool,
    fail_fast_tier: bool,
    fail_fast_body: Option<&Arc<str>>,
) -> Admission {
    if reserved {
        Admission::Wait {
            reason: "saturated_reserved",
        }
    } else if fail_fast_tier {
        Admission::Drop {
            reason: "saturated_interactive_overflow",
            answer: fail_fast_body.map_or(DropAnswer::GateDropped, |b| {
                DropAnswer::GateDroppedWith(b.clone())
            }),
        }
    } else {
        Admission::Refuse {
            reason: "saturated_overflow",
        }
    }
}

impl DispatchGate for TierPriorityGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        // An admission gate says nothing about the pool: like `constant`,
        // every call is a fresh, open reading, so the window is the other
        // gates' business (a fixed date would never refill it).
        let mut reading = Observation::open(Budget::FULL, Instant::now());
        reading.reason = "tier admission: saturation is judged per message".into();
        Box::pin(std::future::ready(Ok(reading)))
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            match &self.judge {
                Judge::Gate {
                    saturation,
                    max_staleness,
                } => {
                    let saturated = match saturation.observe().await {
                        Ok(r) => !r.is_open() || r.taken_at.elapsed() > *max_staleness,
                        Err(error) => {
                            tracing::debug!(%error, "saturation gate unreadable; counted as saturated");
                            true
                        }
                    };
                    if saturated {
                        self.saturated(&request)
                    } else {
                        saturation.admit(request).await
                    }
                }
                Judge::Load(load) => {
                    let mut report = load.report();
                    match load.try_acquire(&mut report).await {
                        Room::Yes(ticket) => Admission::Continue(ticket),
                        Room::No => self.saturated(&request),
                    }
                }
            }
        })
    }

    fn kind(&self) -> &'static str {
        "tier-priority-admission"
    }

    fn on_event(&self, event: DispatchEvent) {
        if let Judge::Gate { saturation, .. } = &self.judge {
            saturation.on_event(event);
        }
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let l = &self.labels;
            let class = l.class.as_deref().map_or_else(
                || format!("label {CLASSIFICATION_LABEL} or {CLASS_LABEL}"),
                |c| format!("label {c}"),
            );
            let verdicts = format!(
                "when saturated: reserved ({class} = {:?}, or a redis-quota classification) \
                 waits; {} = {:?} overflow is dropped ({}); other overflow is refused",
                l.reserved,
                l.tier,
                l.fail_fast_tier,
                self.fail_fast.as_deref().map_or_else(
                    || "GATE_DROPPED".to_owned(),
                    |b| format!("GATE_DROPPED, payload {b}")
                ),
            );
            match &self.judge {
                Judge::Gate { saturation, .. } => {
                    let mut e = saturation.explain().await;
                    e.notes.push(format!(
                        "saturated when the saturation gate ({}) has no headroom, cannot be read or is stale",
                        saturation.kind()
                    ));
                    e.notes.push(verdicts);
                    e
                }
                Judge::Load(load) => {
                    let mut report = load.report();
                    let room = load.peek(&mut report).await;
                    let mut notes = load.notes();
                    notes.push(format!(
                        "now: {}",
                        if room {
                            "room: messages are admitted"
                        } else {
                            "saturated"
                        }
                    ));
                    notes.push(verdicts);
                    Explanation {
                        observation: self.observe().await,
                        sources: vec![report],
                        notes,
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gate::param::parse_errors as errors;

    #[test]
    fn reserved_waits_whatever_the_tier() {
        for fail_fast in [false, true] {
            assert!(matches!(
                saturated_verdict(true, fail_fast, None),
                Admission::Wait { .. }
            ));
        }
    }

    #[test]
    fn fail_fast_overflow_drops_with_the_body_and_other_overflow_refuses() {
        let body: Arc<str> = Arc::from("{\"error\":\"busy\"}");
        match saturated_verdict(false, true, Some(&body)) {
            Admission::Drop { reason, answer } => {
                assert_eq!(reason, "saturated_interactive_overflow");
                assert_eq!(answer, DropAnswer::GateDroppedWith(body));
            }
            other => panic!("expected a drop, got {other:?}"),
        }
        assert!(matches!(
            saturated_verdict(false, true, None),
            Admission::Drop {
                answer: DropAnswer::GateDropped,
                ..
            }
        ));
        assert!(matches!(
            saturated_verdict(false, false, None),
            Admission::Refuse { .. }
        ));
    }

    #[test]
    fn class_comes_from_the_quota_then_the_label() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let empty = BTreeMap::new();
        let default = Labels {
            tier: "tier".into(),
            class: None,
            reserved: "reserved".into(),
            fail_fast_tier: "interactive".into(),
        };
        fn req<'a>(
            empty: &'a BTreeMap<String, String>,
            l: &'a BTreeMap<String, String>,
        ) -> AdmissionRequest<'a> {
            AdmissionRequest::new("r", empty, l)
        }
        for l in [
            labels(&[("classification", "reserved")]),
            labels(&[("class", "reserved")]),
        ] {
            assert!(default.reserved(&req(&empty, &l)));
        }
        let overflow = labels(&[("class", "overflow")]);
        assert!(!default.reserved(&req(&empty, &overflow)));
        let mut by_quota = req(&empty, &empty);
        by_quota.classification = Some(Classification::Reserved);
        assert!(default.reserved(&by_quota));
        let own = Labels {
            class: Some("lane".into()),
            reserved: "gold".into(),
            ..default
        };
        let lane = labels(&[("lane", "gold")]);
        let class = labels(&[("class", "gold")]);
        assert!(own.reserved(&req(&empty, &lane)));
        assert!(!own.reserved(&req(&empty, &class)));
    }

    #[test]
    fn fail_fast_payload_defaults_by_shape() {
        let source = TierPriorityAdmissionParams {
            source: Some(LoadSource::RedisCounter),
            ..Default::default()
        };
        assert_eq!(
            source.fail_fast_payload().as_deref(),
            Some(r#"{"error":"pool saturated","status":429}"#)
        );
        let status = TierPriorityAdmissionParams {
            fail_fast_status: Some(503),
            ..source.clone()
        };
        assert_eq!(
            status.fail_fast_payload().as_deref(),
            Some(r#"{"error":"pool saturated","status":503}"#)
        );
        let legacy = TierPriorityAdmissionParams::default();
        assert_eq!(legacy.fail_fast_payload(), None);
        let body = TierPriorityAdmissionParams {
            fail_fast_body: Some("busy".into()),
            ..legacy
        };
        assert_eq!(body.fail_fast_payload().as_deref(), Some("busy"));
    }

    #[test]
    fn both_shapes_parse_and_round_trip() {
        use serde_json::json;
        for params in [
            json!({"saturation_gate": {"gate_type": "constant"}}),
            json!({"saturation_gate": "constant", "fail_fast_status": 503}),
            json!({"source": "prometheus", "query": "up", "threshold": "0.8",
                   "refresh_interval_ms": 500, "class_label": "class"}),
            json!({"source": "redis-counter", "bucket": "pool:groq", "key_prefix": "rmp",
                   "ttl_seconds": 60, "fallback_cap": 3, "fail_fast_body": "{}",
                   "overflow_value": "overflow", "block_poll_interval_ms": 100}),
        ] {
            let spec = GateSpec::parse("tier-priority-admission", &params, "q")
                .unwrap_or_else(|e| panic!("{params}: {e}"));
            let again = GateSpec::parse(
                "tier-priority-admission",
                &spec.to_upstream()["gate_params"],
                "q",
            )
            .unwrap_or_else(|e| panic!("round trip of {params}: {e}"));
            assert_eq!(again, spec, "{params}");
        }
    }

    #[test]
    fn shape_errors_name_the_keys_and_allowed_values() {
        use serde_json::json;
        let e = errors("tier-priority-admission", json!({}));
        assert_eq!(e[0].0, "q.gate_params.source");
        assert!(
            e[0].1.contains("prometheus | redis-counter") && e[0].1.contains("saturation_gate"),
            "{e:?}"
        );
        let e = errors(
            "tier-priority-admission",
            json!({"saturation_gate": "constant", "source": "prometheus", "query": "up",
                   "threshold": 1}),
        );
        assert_eq!(e[0].0, "q.gate_params.source");
        assert!(
            e[0].1.contains("saturation_gate") && e[0].1.contains("not both"),
            "{e:?}"
        );
        let e = errors("tier-priority-admission", json!({"source": "kafka"}));
        assert_eq!(e[0].0, "q.gate_params.source");
        assert!(
            e[0].1.contains("prometheus") && e[0].1.contains("redis-counter"),
            "{e:?}"
        );
        let e = errors("tier-priority-admission", json!({"source": "prometheus"}));
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            ["q.gate_params.query", "q.gate_params.threshold"],
            "{e:?}"
        );
        let e = errors(
            "tier-priority-admission",
            json!({"source": "redis-counter"}),
        );
        assert_eq!(e[0].0, "q.gate_params.bucket");
        // Another source's parameters would be ignored: errors.
        let e = errors(
            "tier-priority-admission",
            json!({"source": "redis-counter", "bucket": "b", "query": "up"}),
        );
        assert_eq!(e[0].0, "q.gate_params.query");
        assert!(e[0].1.contains("only with source = prometheus"), "{e:?}");
        let e = errors(
            "tier-priority-admission",
            json!({"saturation_gate": "constant", "bucket": "b"}),
        );
        assert_eq!(e[0].0, "q.gate_params.bucket");
        assert!(e[0].1.contains("only with source = redis-counter"), "{e:?}");
        let e = errors(
            "tier-priority-admission",
            json!({"source": "redis-counter", "bucket": "b", "fail_fast_status": 42,
                   "ttl_seconds": 0}),
        );
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "q.gate_params.ttl_seconds",
                "q.gate_params.fail_fast_status"
            ],
            "{e:?}"
        );
        let e = errors(
            "tier-priority-admission",
            json!({"saturation_gate_params": {"address": "a:1"}, "source": "redis-counter",
                   "bucket": "b"}),
        );
        assert_eq!(e[0].0, "q.gate_params.saturation_gate_params");
    }

    #[test]
    fn redis_counter_without_a_redis_is_a_build_error() {
        use serde_json::json;
        let spec = GateSpec::parse(
            "tier-priority-admission",
            &json!({"source": "redis-counter", "bucket": "b"}),
            "q",
        )
        .expect("valid");
        let ctx = GateContext::new(None, None, Duration::from_secs(1), Duration::from_secs(10));
        let err = spec.build(&ctx).expect_err("no Redis to count in");
        assert!(err.to_string().contains("address"), "{err}");
    }
}
