//! `redis`: the budget `D` is a float written to a Redis key by an external
//! controller. A missing key, an unparsable or out-of-range value closes
//! the gate unless `missing` opts into a fallback (upstream opens on a
//! missing key).

use futures_util::future::BoxFuture;

use super::reading::{Explanation, SourceReport, pool_reading, with_fallback};
use super::{DispatchGate, GateError, Observation};
use crate::config::MissingBudget;
use crate::source::{Cached, RedisKey};

/// The `redis` gate.
#[derive(Debug)]
pub struct RedisBudgetGate {
    key: Cached<RedisKey>,
    missing: MissingBudget,
}

impl RedisBudgetGate {
    /// The gate reading one cached key.
    pub fn new(key: Cached<RedisKey>, missing: MissingBudget) -> Self {
        Self { key, missing }
    }

    async fn evaluate(&self) -> Explanation {
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
        let fallback = match self.missing {
            MissingBudget::Closed => None,
            MissingBudget::Fallback(f) => Some(f),
        };
        Explanation {
            observation: with_fallback(reading, fallback),
            sources: vec![report],
            notes: Vec::new(),
        }
    }
}

impl DispatchGate for RedisBudgetGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move { self.evaluate().await.observation })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(self.evaluate())
    }
}
