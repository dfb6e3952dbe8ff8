//! `tier-priority-admission`: tier-aware admission when a saturation gate
//! says the pool is full (upstream's three-way verdict):
//!
//! | saturated | classification | tier          | verdict                      |
//! |-----------|----------------|---------------|------------------------------|
//! | no        | any            | any           | the saturation gate's own    |
//! | yes       | `reserved`     | any           | wait (parked until room)     |
//! | yes       | other          | `interactive` | drop: `GATE_DROPPED` result  |
//! | yes       | other          | other         | refuse (requeue with delay)  |
//!
//! Saturated means the saturation gate's reading has no headroom
//! (`D <= B`), or it could not be read, or it is older than the staleness
//! limit (fail closed). The classification is the one an earlier
//! `redis-quota` gave the message in the same composite, else the envelope
//! label `classification`; none counts as overflow (it holds no
//! reservation). The gate's own budget is open: it decides per message.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, loose};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, Classification, DispatchEvent, DispatchGate,
    GateContext, GateError, Observation,
};
use crate::config::{GATE_TYPES, GateSpec};

/// The tier whose overflow is dropped rather than refused when saturated
/// (upstream's fail-fast tier: its SLA is too short for a requeue).
pub(crate) const FAIL_FAST_TIER: &str = "interactive";
/// The envelope label that may carry a quota classification.
pub(crate) const CLASSIFICATION_LABEL: &str = "classification";

/// Parameters of `tier-priority-admission`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierPriorityAdmissionParams {
    /// The gate that measures saturation. Upstream also writes it as a
    /// type name with `saturation_gate_params` beside it.
    pub saturation_gate: Box<GateSpec>,
    /// Message label holding the tier (default `tier`).
    #[serde(deserialize_with = "loose::string", default = "default_tier_label")]
    pub tier_label: String,
}

fn default_tier_label() -> String {
    "tier".to_owned()
}

impl GateParams for TierPriorityAdmissionParams {
    const EXTRA_KEYS: &'static [&'static str] = &["saturation_gate_params"];

    fn parse(mut map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        let tier_label = match cx.take(&mut map, "tier_label") {
            None => default_tier_label(),
            Some(v) => match loose::to_string(&v) {
                Ok(s) => s,
                Err(e) => {
                    cx.error("tier_label", e);
                    return None;
                }
            },
        };
        let gate_key = cx.key("saturation_gate");
        let params = cx.take(&mut map, "saturation_gate_params");
        let saturation_gate = match cx.take(&mut map, "saturation_gate") {
            // A gate type name, with its parameters beside it.
            Some(Value::String(s)) if !s.trim_start().starts_with('{') => {
                let params_key = cx.key("saturation_gate_params");
                GateSpec::parse_split(
                    &Value::String(s),
                    params.as_ref(),
                    gate_key,
                    params_key,
                    cx.depth,
                    cx.errors,
                )
            }
            Some(v) => {
                if params.is_some() {
                    cx.error(
                        "saturation_gate_params",
                        "not allowed when saturation_gate is a gate object (put gate_params inside it)",
                    );
                }
                cx.nested(&v, &gate_key)
            }
            None => {
                cx.require(
                    "saturation_gate",
                    &format!(
                        "a gate type name or gate object; allowed types: {}",
                        GATE_TYPES.join(", ")
                    ),
                );
                None
            }
        };
        Some(Self {
            saturation_gate: Box::new(saturation_gate?),
            tier_label,
        })
    }

    fn children(&self) -> Vec<&GateSpec> {
        vec![&self.saturation_gate]
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(TierPriorityGate::new(
            self.saturation_gate.build(ctx)?,
            self.tier_label.clone(),
            ctx.max_staleness,
        )))
    }
}

/// The `tier-priority-admission` gate.
#[derive(Debug)]
pub struct TierPriorityGate {
    saturation: Box<dyn DispatchGate>,
    tier_label: String,
    max_staleness: Duration,
}

impl TierPriorityGate {
    /// Judges messages by `saturation`'s reading and the `tier_label`
    /// label; a reading older than `max_staleness` counts as saturated.
    pub fn new(
        saturation: Box<dyn DispatchGate>,
        tier_label: impl Into<String>,
        max_staleness: Duration,
    ) -> Self {
        Self {
            saturation,
            tier_label: tier_label.into(),
            max_staleness,
        }
    }

    /// Whether the pool is saturated now (unknown counts as saturated).
    async fn saturated(&self) -> bool {
        match self.saturation.observe().await {
            Ok(reading) => !reading.is_open() || reading.taken_at.elapsed() > self.max_staleness,
            Err(error) => {
                tracing::debug!(%error, "saturation gate unreadable; counted as saturated");
                true
            }
        }
    }
}

/// The verdict at saturation for a message of `tier` with `classification`.
pub(crate) fn saturated_verdict(
    classification: Option<Classification>,
    tier: Option<&str>,
) -> Admission {
    match (classification, tier) {
        (Some(Classification::Reserved), _) => Admission::Wait {
            reason: "saturated_reserved",
        },
        (_, Some(FAIL_FAST_TIER)) => Admission::Drop {
            reason: "saturated_interactive_overflow",
        },
        _ => Admission::Refuse {
            reason: "saturated_overflow",
        },
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
            if !self.saturated().await {
                return self.saturation.admit(request).await;
            }
            let classification = request.classification.or_else(|| {
                request
                    .labels
                    .get(CLASSIFICATION_LABEL)
                    .and_then(|c| Classification::parse(c))
            });
            let tier = request.labels.get(&self.tier_label).map(String::as_str);
            saturated_verdict(classification, tier)
        })
    }

    fn kind(&self) -> &'static str {
        "tier-priority-admission"
    }

    fn on_event(&self, event: DispatchEvent) {
        self.saturation.on_event(event);
    }

    fn explain(&self) -> BoxFuture<'_, super::Explanation> {
        self.saturation.explain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_waits_whatever_the_tier() {
        for tier in [None, Some("interactive"), Some("batch")] {
            assert!(matches!(
                saturated_verdict(Some(Classification::Reserved), tier),
                Admission::Wait { .. }
            ));
        }
    }

    #[test]
    fn interactive_overflow_drops_and_unclassified_counts_as_overflow() {
        for c in [Some(Classification::Overflow), None] {
            assert!(matches!(
                saturated_verdict(c, Some("interactive")),
                Admission::Drop {
                    reason: "saturated_interactive_overflow"
                }
            ));
            assert!(matches!(
                saturated_verdict(c, Some("batch")),
                Admission::Refuse { .. }
            ));
            assert!(matches!(
                saturated_verdict(c, None),
                Admission::Refuse { .. }
            ));
        }
    }
}
