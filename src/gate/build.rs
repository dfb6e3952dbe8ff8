//! Turns a validated [`GateSpec`] into a gate. Every catalogue name is
//! known to the config loader; a gate whose implementation is not in this
//! build is a startup error, never an open gate.

use crate::config::GateSpec;

use super::{CompositeGate, ConstantGate, DispatchGate, LocalMaxConcurrencyGate, WaitOnRefuseGate};

/// A gate that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The gate type is valid configuration but not implemented here yet.
    #[error(
        "gate type `{gate_type}` is not available in this build; available: constant, composite, local-max-concurrency, wait-on-refuse"
    )]
    NotAvailable {
        /// The upstream gate name.
        gate_type: &'static str,
    },
    /// A composite without inner gates would be an open gate.
    #[error("composite gate has no inner gates")]
    EmptyComposite,
}

/// Builds the gate described by `spec`.
pub fn build_gate(spec: &GateSpec) -> Result<Box<dyn DispatchGate>, BuildError> {
    Ok(match spec {
        GateSpec::Constant => Box::new(ConstantGate::default()),
        GateSpec::Composite { gates } => {
            if gates.is_empty() {
                return Err(BuildError::EmptyComposite);
            }
            let inner = gates
                .iter()
                .map(build_gate)
                .collect::<Result<Vec<_>, _>>()?;
            Box::new(CompositeGate::new(inner))
        }
        GateSpec::LocalMaxConcurrency { limit, gating_mode } => {
            Box::new(LocalMaxConcurrencyGate::new(
                usize::try_from(*limit).unwrap_or(usize::MAX),
                *gating_mode,
            ))
        }
        GateSpec::WaitOnRefuse { gate } => Box::new(WaitOnRefuseGate::new(build_gate(gate)?)),
        other => {
            return Err(BuildError::NotAvailable {
                gate_type: other.upstream_name(),
            });
        }
    })
}
