//! `redis`: the budget `D` is written to a Redis key by an external
//! controller, as a bare number (upstream) or a decision record with a
//! timestamp and a decision id, which this gate acknowledges (format in
//! `source::redis_key`). A missing key, an unparsable or out-of-range value
//! closes the gate unless `missing` opts into a fallback (upstream opens on
//! a missing key).

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::param::{GateParams, ParseCx, loose, show};
use super::reading::{MetricGate, SourceReport, pool_reading};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, DecisionAcks, RedisKey, parse_budget_record};

/// What the `redis` gate does when the budget key is missing or unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum MissingBudget {
    /// Budget 0 (the default; upstream opens instead).
    #[default]
    Closed,
    /// Use this budget in [0, 1] (`"open"` means 1.0, upstream's behaviour).
    Fallback(f64),
}

impl Serialize for MissingBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Closed => s.serialize_str("closed"),
            Self::Fallback(x) => s.serialize_f64(*x),
        }
    }
}

impl<'de> Deserialize<'de> for MissingBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        match &v {
            Value::String(s) if s == "closed" => Ok(Self::Closed),
            Value::String(s) if s == "open" => Ok(Self::Fallback(1.0)),
            other => loose::to_f64(other)
                .ok()
                .filter(|x| (0.0..=1.0).contains(x))
                .map(Self::Fallback)
                .ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "allowed: \"closed\", \"open\" or a budget in [0, 1], got {}",
                        show(other)
                    ))
                }),
        }
    }
}

/// Parameters of `redis`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisParams {
    /// `host:port` or `redis://host:port/db` (credentials come from
    /// `[redis]`); required.
    #[serde(deserialize_with = "loose::string")]
    pub address: String,
    /// The key holding the budget as a float (default
    /// `dispatch-gate-budget`).
    #[serde(deserialize_with = "loose::string")]
    pub budget_key: String,
    /// Behaviour when the key is missing (default closed).
    pub missing: MissingBudget,
}

impl Default for RedisParams {
    fn default() -> Self {
        Self {
            address: String::new(),
            budget_key: "dispatch-gate-budget".to_owned(),
            missing: MissingBudget::Closed,
        }
    }
}

impl GateParams for RedisParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("address", "host:port or redis://host:port/db") {
            cx.redis_address("address", &self.address);
        }
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let key = ctx.redis_key(&self.address, &self.budget_key)?;
        let fallback = match self.missing {
            MissingBudget::Closed => None,
            MissingBudget::Fallback(f) => Some(f),
        };
        Ok(Fallback::wrap(
            Box::new(RedisBudgetGate::new(
                ctx.cache(key),
                ctx.replica.clone(),
                ctx.max_staleness,
            )),
            fallback,
        ))
    }
}

/// The `redis` gate.
#[derive(Debug)]
pub struct RedisBudgetGate {
    key: Cached<RedisKey>,
    /// This replica's acknowledgements of the controller's decisions.
    acks: DecisionAcks,
    /// A decision older than this is refused by the staleness wrapper, so
    /// it is not acknowledged as applied either.
    max_staleness: Duration,
}

impl RedisBudgetGate {
    /// The gate reading one cached key; `replica` names this process when
    /// it acknowledges a controller's decision.
    pub fn new(key: Cached<RedisKey>, replica: impl Into<String>, max_staleness: Duration) -> Self {
        Self {
            key,
            acks: DecisionAcks::new(replica),
            max_staleness,
        }
    }
}

impl MetricGate for RedisBudgetGate {
    const KIND: &'static str = "redis";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let mut report = SourceReport::new("budget key", self.key.source().describe_key());
        let reading = match self.key.get().await {
            Err(e) => {
                report.outcome = format!("error: {e}");
                Err(GateError::source("redis", e))
            }
            Ok(t) => match t.value.as_deref() {
                None => {
                    report.outcome = "key missing".into();
                    Err(GateError::SourceUnavailable("budget key is missing".into()))
                }
                Some(text) => match parse_budget_record(text, t.taken_at, SystemTime::now()) {
                    Ok(record) => {
                        report.values.push((String::new(), record.budget));
                        report.outcome = "used".into();
                        let mut reason = format!("budget key holds {}", record.budget);
                        if let Some(id) = &record.decision_id {
                            reason.push_str(&format!(" (decision {id})"));
                        }
                        // A bare number has no date and says nothing about
                        // our load; a record says whether it does. Never
                        // `counts_own_requests`: the record's budget is a
                        // fraction of an outside controller's capacity, not
                        // of our requests, so finishes wait for its next
                        // decision.
                        let reading = pool_reading(
                            record.budget,
                            0.0,
                            record.taken_at.unwrap_or(t.taken_at),
                            None,
                            record.sees_own_load,
                            reason,
                        );
                        let usable = reading.taken_at.elapsed() <= self.max_staleness;
                        if let (Some(id), true) = (&record.decision_id, usable) {
                            self.key.source().acknowledge(&self.acks, id).await;
                        }
                        Ok(reading)
                    }
                    Err(e) => {
                        report.outcome = format!("invalid: {e}");
                        Err(GateError::Record(e))
                    }
                },
            },
        };
        sources.push(report);
        reading
    }
}
