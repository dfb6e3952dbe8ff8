//! `composite`: several gates at once. The budget is the tightest of the
//! inner gates; admission is all-or-nothing.

use futures_util::future::{BoxFuture, join_all};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::GateSpec;
use super::param::{GateParams, ParseCx, kind};
use super::{
    Admission, AdmissionRequest, BuildError, Capacity, DispatchEvent, DispatchGate, Explanation,
    GateContext, GateError, Observation, Ticket,
};

/// Parameters of `composite`: the inner gates, in order (at least one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompositeParams {
    /// The inner gates.
    pub gates: Vec<GateSpec>,
}

impl GateParams for CompositeParams {
    /// Upstream writes the list as an array or as JSON text of one; each
    /// inner gate's errors are reported under `gates[i]`.
    fn parse(mut map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        let key = cx.key("gates");
        let Some(raw) = cx.take(&mut map, "gates") else {
            cx.require("gates", "an array of gates");
            return None;
        };
        let list = match raw {
            Value::String(s) => match serde_json::from_str::<Value>(&s) {
                Ok(v) => v,
                Err(e) => {
                    cx.error("gates", format!("expected a JSON array of gates: {e}"));
                    return None;
                }
            },
            v => v,
        };
        let Value::Array(items) = list else {
            cx.error(
                "gates",
                format!("expected an array of gates, got {}", kind(&list)),
            );
            return None;
        };
        if items.is_empty() {
            cx.error("gates", "must hold at least one gate");
            return None;
        }
        let gates: Vec<Option<GateSpec>> = items
            .iter()
            .enumerate()
            .map(|(i, g)| cx.nested(g, &format!("{key}[{i}]")))
            .collect();
        Some(Self {
            gates: gates.into_iter().collect::<Option<Vec<_>>>()?,
        })
    }

    fn children(&self) -> Vec<&GateSpec> {
        self.gates.iter().collect()
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        if self.gates.is_empty() {
            return Err(BuildError::EmptyComposite);
        }
        let inner = self
            .gates
            .iter()
            .map(|g| g.build(ctx))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(CompositeGate::new(inner, ctx.capacity)))
    }
}

/// The tightest inner gate; a message goes only if every inner gate
/// admits it.
///
/// "Tightest" is in units, not budget fractions: an inner gate's headroom
/// times *its own* capacity (a live `max_SYS`, else the queue's), so one
/// gate's headroom is never paired with another gate's capacity. The
/// reading is dated by its freshest input, so a fresh closing reading is
/// never discarded for being newer than a stale open one; and it counts as
/// seeing our own load only if the chosen reading does and is itself the
/// freshest (otherwise the window is `N` itself, the safe side).
#[derive(Debug)]
pub struct CompositeGate {
    gates: Vec<Box<dyn DispatchGate>>,
    capacity: Capacity,
}

impl CompositeGate {
    /// A composite of at least one gate (the config loader rejects an empty
    /// list; an empty composite here would be an open gate, so it is closed
    /// by `observe`) for a queue of `capacity`.
    pub fn new(gates: Vec<Box<dyn DispatchGate>>, capacity: Capacity) -> Self {
        Self { gates, capacity }
    }
}

impl DispatchGate for CompositeGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            let observations = join_all(self.gates.iter().map(|g| g.observe())).await;
            // (units of headroom, the reading with its capacity made explicit)
            let mut tightest: Option<(f64, Observation)> = None;
            let mut newest: Option<tokio::time::Instant> = None;
            for observation in observations {
                // One unreadable inner gate closes the whole composite.
                let mut observation = observation?;
                newest = Some(newest.map_or(observation.taken_at, |t| t.max(observation.taken_at)));
                let capacity = self.capacity.effective(observation.max_sys);
                let units = capacity * observation.headroom();
                observation.max_sys = Some(capacity);
                if tightest.as_ref().is_none_or(|(u, _)| units < *u) {
                    tightest = Some((units, observation));
                }
            }
            let (Some((_, mut result)), Some(newest)) = (tightest, newest) else {
                return Err(GateError::SourceUnavailable(
                    "composite gate has no inner gates".into(),
                ));
            };
            result.sees_own_load = result.sees_own_load && result.taken_at == newest;
            result.counts_own_requests = result.counts_own_requests && result.sees_own_load;
            result.taken_at = newest;
            Ok(result)
        })
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            let mut ticket = Ticket::none();
            let mut request = request;
            for gate in &self.gates {
                match gate.admit(request).await {
                    Admission::Continue(t) => {
                        // A quota gate's classification reaches the gates
                        // after it (`tier-priority-admission`).
                        if let Some(c) = t.classification() {
                            request.classification = Some(c);
                        }
                        ticket.join(t);
                    }
                    // Refunding `ticket` here releases what earlier gates
                    // reserved, even a rate-limit admission: all or nothing.
                    refused => {
                        ticket.refund();
                        return refused;
                    }
                }
            }
            Admission::Continue(ticket)
        })
    }

    fn kind(&self) -> &'static str {
        "composite"
    }

    fn on_event(&self, event: DispatchEvent) {
        for gate in &self.gates {
            gate.on_event(event);
        }
    }

    /// Every inner gate's sources, labelled by gate; the reading itself is
    /// `observe`'s (inner sources are cached, so both see the same data).
    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let inner = join_all(self.gates.iter().map(|g| g.explain())).await;
            let mut sources = Vec::new();
            let mut notes = Vec::new();
            for (i, (gate, e)) in self.gates.iter().zip(inner).enumerate() {
                let tag = format!("gate {} ({})", i + 1, gate.kind());
                for mut s in e.sources {
                    s.role = format!("{tag}: {}", s.role);
                    sources.push(s);
                }
                notes.extend(e.notes.into_iter().map(|n| format!("{tag}: {n}")));
                notes.push(match e.observation {
                    Ok(o) => format!(
                        "{tag}: D {:.4}, B {:.4}, headroom {:.4}: {}",
                        o.budget.get(),
                        o.baseline.get(),
                        o.headroom(),
                        o.reason
                    ),
                    Err(err) => format!("{tag}: unavailable: {err}"),
                });
            }
            notes.push("the composite reads the inner gate with the least headroom".into());
            Explanation {
                observation: self.observe().await,
                sources,
                notes,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gate::GatingMode;
    use crate::gate::{Budget, Capacity, ConstantGate, LocalMaxConcurrencyGate};

    fn request<'a>(empty: &'a BTreeMap<String, String>) -> AdmissionRequest<'a> {
        AdmissionRequest::new("r", empty, empty)
    }

    #[tokio::test]
    async fn budget_is_the_minimum_of_inner_budgets() {
        let gate = CompositeGate::new(
            vec![
                Box::new(ConstantGate::new(Budget::saturating(0.8))),
                Box::new(ConstantGate::new(Budget::saturating(0.3))),
            ],
            Capacity::default(),
        );
        let o = gate.observe().await.expect("readable");
        assert_eq!(o.budget, Budget::saturating(0.3));
    }

    /// An inner gate that reads what it is told.
    #[derive(Debug)]
    struct Fixed(Observation);

    impl DispatchGate for Fixed {
        fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
            Box::pin(std::future::ready(Ok(self.0.clone())))
        }

        fn kind(&self) -> &'static str {
            "fixed"
        }
    }

    fn reading(d: f64, max_sys: Option<f64>, taken_at: tokio::time::Instant) -> Observation {
        let mut o = Observation::open(Budget::saturating(d), taken_at);
        o.max_sys = max_sys;
        o.sees_own_load = true;
        o
    }

    #[tokio::test]
    async fn tightest_is_counted_in_units_with_each_gates_own_capacity() {
        let now = tokio::time::Instant::now();
        // 50 % of a live 10 = 5 units; 10 % of the queue's 100 = 10 units.
        // Before: the 10 % reading won and was paired with the live 10,
        // giving 1 unit.
        let gate = CompositeGate::new(
            vec![
                Box::new(Fixed(reading(0.5, Some(10.0), now))),
                Box::new(Fixed(reading(0.1, None, now))),
            ],
            Capacity::default(),
        );
        let o = gate.observe().await.expect("readable");
        assert_eq!(o.budget, Budget::saturating(0.5));
        assert_eq!(o.max_sys, Some(10.0));
        assert!(o.sees_own_load);
    }

    #[tokio::test]
    async fn a_fresh_closing_reading_is_kept_and_dated_by_the_freshest_input() {
        let old = tokio::time::Instant::now();
        let fresh = old + std::time::Duration::from_secs(10);
        let gate = CompositeGate::new(
            vec![
                Box::new(Fixed(reading(0.9, None, old))),
                Box::new(Fixed(reading(0.0, None, fresh))),
            ],
            Capacity::default(),
        );
        let o = gate.observe().await.expect("readable");
        assert_eq!(o.budget, Budget::ZERO);
        assert_eq!(o.taken_at, fresh);
        // When the tightest input is older than the freshest, the reading
        // no longer counts as seeing our load (the window is N itself).
        let gate = CompositeGate::new(
            vec![
                Box::new(Fixed(reading(0.2, None, old))),
                Box::new(Fixed(reading(0.9, None, fresh))),
            ],
            Capacity::default(),
        );
        let o = gate.observe().await.expect("readable");
        assert_eq!(o.budget, Budget::saturating(0.2));
        assert_eq!(o.taken_at, fresh);
        assert!(!o.sees_own_load);
    }

    #[tokio::test]
    async fn empty_composite_is_closed() {
        assert!(
            CompositeGate::new(vec![], Capacity::default())
                .observe()
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn admission_is_all_or_nothing() {
        let empty = BTreeMap::new();
        let wide = std::sync::Arc::new(LocalMaxConcurrencyGate::new(2, GatingMode::Classifying));
        let narrow = LocalMaxConcurrencyGate::new(1, GatingMode::Classifying);
        let gate = CompositeGate::new(
            vec![Box::new(wide.clone()), Box::new(narrow)],
            Capacity::default(),
        );
        let first = gate.admit(request(&empty)).await;
        assert!(matches!(first, Admission::Continue(_)));
        let second = gate.admit(request(&empty)).await;
        assert!(matches!(second, Admission::Refuse { .. }));
        // The refused admission must not keep the slot it took in `wide`.
        assert_eq!(wide.in_flight(), 1);
        drop(first);
        assert_eq!(wide.in_flight(), 0);
    }
}
