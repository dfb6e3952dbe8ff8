//! `tier-priority-admission`: tier-aware admission when a saturation gate
//! says the pool is full. Parsed and validated; not built yet, so a queue
//! using it refuses to start (never an open gate).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::param::{GateParams, ParseCx, loose};
use super::{BuildError, DispatchGate, GateContext};
use crate::config::{GATE_TYPES, GateSpec};

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
    const BUILT: bool = false;

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

    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Err(BuildError::NotAvailable {
            gate_type: "tier-priority-admission",
        })
    }
}
