//! `redis`: the budget `D` is a float written to a Redis key by an external
//! controller. A missing key, an unparsable or out-of-range value closes
//! the gate unless `missing` opts into a fallback (upstream opens on a
//! missing key).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::param::{GateParams, ParseCx, loose, show};
use super::reading::{MetricGate, SourceReport, pool_reading};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, RedisKey};

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
            Box::new(RedisBudgetGate::new(ctx.cache(key))),
            fallback,
        ))
    }
}

/// The `redis` gate.
#[derive(Debug)]
pub struct RedisBudgetGate {
    key: Cached<RedisKey>,
}

impl RedisBudgetGate {
    /// The gate reading one cached key.
    pub fn new(key: Cached<RedisKey>) -> Self {
        Self { key }
    }
}

impl MetricGate for RedisBudgetGate {
    const KIND: &'static str = "redis";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let mut report = SourceReport::new("budget key", self.key.source().describe_key());
        let reading = match self.key.get().await {
            Err(e) => {
                report.outcome = format!("error: {e}");
                Err(GateError::SourceUnavailable(format!("redis: {e}")))
            }
            Ok(t) => match t.value.as_deref().map(str::trim) {
                None => {
                    report.outcome = "key missing".into();
                    Err(GateError::SourceUnavailable("budget key is missing".into()))
                }
                Some(text) => match text.parse::<f64>() {
                    Ok(d) if (0.0..=1.0).contains(&d) => {
                        report.values.push((String::new(), d));
                        report.outcome = "used".into();
                        Ok(pool_reading(
                            d,
                            0.0,
                            t.taken_at,
                            None,
                            format!("budget key holds {d}"),
                        ))
                    }
                    _ => {
                        report.outcome = format!("invalid: {text:?} is not a number in [0, 1]");
                        Err(GateError::SourceUnavailable(format!(
                            "budget key holds {text:?}, not a number in [0, 1]"
                        )))
                    }
                },
            },
        };
        sources.push(report);
        reading
    }
}
