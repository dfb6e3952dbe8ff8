//! `prometheus-query`: any PromQL expression whose value is the budget `D`.
//! Several series: the smallest counts (explicitly, never "the first").
//! A value outside [0, 1] is an error, not clamped (upstream clamps, so a
//! query that returns 5 by mistake opens the gate fully).

use futures_util::future::BoxFuture;

use super::reading::{
    Aggregate, Explanation, SourceReport, pool_reading, show_labels, with_fallback,
};
use super::{DispatchGate, GateError, Observation};
use crate::source::{Cached, PromQuery};

/// The `prometheus-query` gate.
#[derive(Debug)]
pub struct PrometheusQueryGate {
    query: Cached<PromQuery>,
    fallback: Option<f64>,
    pool: Option<String>,
}

impl PrometheusQueryGate {
    /// The gate for one cached query.
    pub fn new(query: Cached<PromQuery>, fallback: Option<f64>, pool: Option<String>) -> Self {
        Self {
            query,
            fallback,
            pool,
        }
    }

    async fn evaluate(&self) -> Explanation {
        let mut report = SourceReport::new("budget query", self.query.source().text());
        let reading = match self.query.get().await {
            Err(e) => {
                report.outcome = format!("error: {e}");
                Err(GateError::SourceUnavailable(format!("query: {e}")))
            }
            Ok(t) => {
                report.values = t
                    .value
                    .iter()
                    .map(|s| (show_labels(&s.labels), s.value))
                    .collect();
                match Aggregate::Min.apply(t.value.iter().map(|s| s.value)) {
                    None => {
                        report.outcome = "no sample".into();
                        Err(GateError::SourceUnavailable(
                            "query returned no sample".into(),
                        ))
                    }
                    Some(d) if !(0.0..=1.0).contains(&d) => {
                        report.outcome = format!("invalid: {d} is outside [0, 1]");
                        Err(GateError::SourceUnavailable(format!(
                            "query value {d} is outside [0, 1]"
                        )))
                    }
                    Some(d) => {
                        report.outcome = "used".into();
                        Ok(pool_reading(
                            d,
                            0.0,
                            t.taken_at,
                            None,
                            format!("query value {d} (min of {} series)", t.value.len()),
                        ))
                    }
                }
            }
        };
        Explanation {
            observation: with_fallback(reading, self.fallback),
            sources: vec![report],
            notes: self
                .pool
                .iter()
                .map(|p| format!("pool label: {p}"))
                .collect(),
        }
    }
}

impl DispatchGate for PrometheusQueryGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move { self.evaluate().await.observation })
    }

    fn kind(&self) -> &'static str {
        "prometheus-query"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(self.evaluate())
    }
}
