//! `constant-decision`: every message gets the same verdict (upstream PR
//! #186): `continue` (the default), `drop` or `refuse`. A kill switch
//! (`refuse` stops sending without losing a message), a fixture that forces
//! the drop or refuse paths, or a stand-in while the real gate is not
//! ready. The budget is open: the gate decides per message.

use std::fmt;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use tokio::time::Instant;

use super::param::{GateParams, show};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, DispatchGate, Explanation, GateContext,
    GateError, Observation, Ticket,
};

/// The verdict of `constant-decision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decision {
    /// Admit every message.
    #[default]
    Continue,
    /// End every message with a `GATE_DROPPED` result.
    Drop,
    /// Send every message back to the queue with the requeue delay.
    Refuse,
}

/// The spellings upstream's `parseDecision` accepts, and nothing else: a
/// typo must not become a default.
const DECISIONS: &[(&str, Decision)] = &[
    ("continue", Decision::Continue),
    ("Continue", Decision::Continue),
    ("CONTINUE", Decision::Continue),
    ("drop", Decision::Drop),
    ("Drop", Decision::Drop),
    ("DROP", Decision::Drop),
    ("refuse", Decision::Refuse),
    ("Refuse", Decision::Refuse),
    ("REFUSE", Decision::Refuse),
];

impl Decision {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Continue => "continue",
            Self::Drop => "drop",
            Self::Refuse => "refuse",
        }
    }

    /// Reads a decision as upstream does (lower, capitalised or upper case).
    pub fn parse(text: &str) -> Result<Self, String> {
        DECISIONS
            .iter()
            .find(|(s, _)| *s == text)
            .map(|(_, d)| *d)
            .ok_or_else(|| format!("unknown decision {text:?}; allowed: continue, drop, refuse"))
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Decision {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Decision {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let text = match &v {
            Value::String(s) => s.trim().to_owned(),
            other => {
                return Err(serde::de::Error::custom(format!(
                    "expected one of continue, drop, refuse, got {}",
                    show(other)
                )));
            }
        };
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Parameters of `constant-decision`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConstantDecisionParams {
    /// The verdict for every message (default `continue`).
    pub decision: Decision,
}

impl GateParams for ConstantDecisionParams {
    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(ConstantDecisionGate::new(self.decision)))
    }
}

/// The `constant-decision` gate.
#[derive(Debug, Clone, Copy)]
pub struct ConstantDecisionGate {
    decision: Decision,
}

impl ConstantDecisionGate {
    /// A gate answering `decision` to every message.
    pub fn new(decision: Decision) -> Self {
        Self { decision }
    }

    fn verdict(self) -> Admission {
        match self.decision {
            Decision::Continue => Admission::Continue(Ticket::none()),
            Decision::Drop => Admission::dropped("constant_drop"),
            Decision::Refuse => Admission::Refuse {
                reason: "constant_refuse",
            },
        }
    }
}

impl DispatchGate for ConstantDecisionGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        // An admission gate says nothing about the pool: every call is a
        // fresh, open reading (as `constant`), so the window is the other
        // gates' business. Messages must reach `admit` to be dropped or
        // refused, so even `refuse` does not close the budget.
        let mut reading = Observation::open(Budget::FULL, Instant::now());
        reading.reason = format!("constant decision: {} every message", self.decision);
        Box::pin(std::future::ready(Ok(reading)))
    }

    fn admit<'a>(&'a self, _request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(std::future::ready(self.verdict()))
    }

    fn kind(&self) -> &'static str {
        "constant-decision"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let note = match self.decision {
                Decision::Continue => "every message is admitted (budget stays open)",
                Decision::Drop => {
                    "every message is dropped: it ends at once with a GATE_DROPPED result"
                }
                Decision::Refuse => {
                    "every message is refused: back to the queue after the requeue delay, \
                     none is sent and none is answered"
                }
            };
            Explanation::sourceless(
                self.observe().await,
                vec![format!("decision = {}: {note}", self.decision)],
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gate::param::parse_errors as errors;

    #[test]
    fn parses_upstream_spellings_only() {
        assert_eq!(Decision::parse("continue"), Ok(Decision::Continue));
        assert_eq!(Decision::parse("DROP"), Ok(Decision::Drop));
        assert_eq!(Decision::parse("Refuse"), Ok(Decision::Refuse));
        for bad in ["", "dRop", "wait", "allow"] {
            let e = Decision::parse(bad).expect_err(bad);
            assert!(e.contains("allowed: continue, drop, refuse"), "{e}");
        }
    }

    #[tokio::test]
    async fn every_message_gets_the_decision() {
        let empty = BTreeMap::new();
        let req = AdmissionRequest::new("r", &empty, &empty);
        let shape = |a: &Admission| (a.verdict_label(), a.reason_label());
        let gate = ConstantDecisionGate::new(Decision::Continue);
        assert_eq!(shape(&gate.admit(req).await), ("continue", "admitted"));
        let gate = ConstantDecisionGate::new(Decision::Drop);
        assert_eq!(shape(&gate.admit(req).await), ("drop", "constant_drop"));
        let gate = ConstantDecisionGate::new(Decision::Refuse);
        assert_eq!(shape(&gate.admit(req).await), ("refuse", "constant_refuse"));
        assert!(gate.observe().await.expect("open").is_open());
    }

    #[test]
    fn config_names_the_key_and_the_allowed_decisions() {
        use crate::gate::GateSpec;
        use serde_json::json;
        let spec = GateSpec::parse("constant-decision", &json!({}), "q").expect("default");
        assert_eq!(
            spec,
            GateSpec::ConstantDecision(ConstantDecisionParams {
                decision: Decision::Continue
            })
        );
        let spec =
            GateSpec::parse("constant-decision", &json!({"decision": "REFUSE"}), "q").expect("ok");
        assert_eq!(spec.to_upstream()["gate_params"]["decision"], "refuse");
        let e = errors("constant-decision", json!({"decision": "wait"}));
        assert_eq!(e[0].0, "q.gate_params.decision");
        assert!(e[0].1.contains("continue, drop, refuse"), "{e:?}");
        let e = errors("constant-decision", json!({"verdict": "drop"}));
        assert_eq!(e[0].0, "q.gate_params.verdict");
        assert!(e[0].1.contains("allowed: decision"), "{e:?}");
    }
}
