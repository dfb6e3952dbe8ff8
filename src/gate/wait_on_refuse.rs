//! `wait-on-refuse`: turns an inner gate's Refuse into Wait, so refused
//! messages park instead of going back to the queue.

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::GateSpec;
use super::param::{GateParams, ParseCx};
use super::{
    Admission, AdmissionRequest, BuildError, DispatchEvent, DispatchGate, GateContext, GateError,
    Observation,
};

/// Parameters of `wait-on-refuse`: the wrapped gate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitOnRefuseParams {
    /// The wrapped gate.
    pub gate: Box<GateSpec>,
}

impl GateParams for WaitOnRefuseParams {
    fn parse(mut map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        let key = cx.key("gate");
        let Some(v) = cx.take(&mut map, "gate") else {
            cx.require("gate", "a gate: {\"gate_type\": …, \"gate_params\": {…}}");
            return None;
        };
        let gate = cx.nested(&v, &key)?;
        Some(Self {
            gate: Box::new(gate),
        })
    }

    fn children(&self) -> Vec<&GateSpec> {
        vec![&self.gate]
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(WaitOnRefuseGate::new(self.gate.build(ctx)?)))
    }
}

/// Wraps a gate; budget passes through, Refuse becomes Wait.
#[derive(Debug)]
pub struct WaitOnRefuseGate {
    inner: Box<dyn DispatchGate>,
}

impl WaitOnRefuseGate {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn DispatchGate>) -> Self {
        Self { inner }
    }
}

impl DispatchGate for WaitOnRefuseGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        self.inner.observe()
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            match self.inner.admit(request).await {
                Admission::Refuse { reason } => Admission::Wait { reason },
                other => other,
            }
        })
    }

    fn kind(&self) -> &'static str {
        "wait-on-refuse"
    }

    fn on_event(&self, event: DispatchEvent) {
        self.inner.on_event(event);
    }

    fn explain(&self) -> BoxFuture<'_, super::Explanation> {
        self.inner.explain()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gate::GatingMode;
    use crate::gate::LocalMaxConcurrencyGate;

    #[tokio::test]
    async fn refuse_becomes_wait() {
        let empty = BTreeMap::new();
        let req = AdmissionRequest::new("r", &empty, &empty);
        let gate = WaitOnRefuseGate::new(Box::new(LocalMaxConcurrencyGate::new(
            1,
            GatingMode::Classifying,
        )));
        let _held = gate.admit(req).await;
        assert!(matches!(gate.admit(req).await, Admission::Wait { .. }));
    }
}
