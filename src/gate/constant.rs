//! `constant`: always the same budget (1.0 by default): the ungated
//! baseline, and the gate for pools that need no protection.

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::param::GateParams;
use super::{Budget, BuildError, DispatchGate, GateContext, GateError, Observation};

/// Parameters of `constant`: none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConstantParams {}

impl GateParams for ConstantParams {
    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(ConstantGate::default()))
    }
}

/// A gate whose budget never changes.
#[derive(Debug, Clone)]
pub struct ConstantGate {
    budget: Budget,
}

impl ConstantGate {
    /// A constant gate with the given budget.
    pub fn new(budget: Budget) -> Self {
        Self { budget }
    }
}

impl Default for ConstantGate {
    fn default() -> Self {
        Self::new(Budget::FULL)
    }
}

impl DispatchGate for ConstantGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        // Every call is a fresh observation: nothing lags, so the window may
        // be refilled as soon as it is used up.
        let mut observation = Observation::open(self.budget, Instant::now());
        observation.reason = format!("constant budget {}", self.budget);
        Box::pin(std::future::ready(Ok(observation)))
    }

    fn kind(&self) -> &'static str {
        "constant"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn constant_gate_is_fully_open() {
        let o = ConstantGate::default()
            .observe()
            .await
            .expect("never fails");
        assert_eq!(o.budget, Budget::FULL);
        assert!(o.source_available);
        assert!(o.is_open());
    }
}
