//! `prometheus-saturation`: `D = 1 − S`, `B = 1 − threshold`, where `S` is
//! the endpoint picker's flow-control pool saturation (current name, then
//! the legacy one). Upstream's budget `(1 − S) − (1 − threshold)` is the
//! same headroom.

use futures_util::future::BoxFuture;

use super::reading::{
    Aggregate, Explanation, SourceReport, non_negative, pool_reading, promql_string, show_labels,
    with_fallback,
};
use super::{DispatchGate, GateError, Observation};
use crate::source::{Cached, PromClient, PromQuery};

/// The `prometheus-saturation` gate.
#[derive(Debug)]
pub struct PrometheusSaturationGate {
    pool: String,
    threshold: f64,
    fallback: Option<f64>,
    queries: Vec<(&'static str, Cached<PromQuery>)>,
}

impl PrometheusSaturationGate {
    /// The gate for `pool`, closing at saturation `threshold`.
    pub fn new(
        client: &PromClient,
        cache: impl Fn(PromQuery) -> Cached<PromQuery>,
        pool: &str,
        namespace: Option<&str>,
        threshold: f64,
        fallback: Option<f64>,
    ) -> Self {
        let ns = namespace
            .map(|n| format!(",namespace={}", promql_string(n)))
            .unwrap_or_default();
        let sel = format!("{{inference_pool={}{ns}}}", promql_string(pool));
        let queries = vec![
            (
                "pool saturation (current name)",
                cache(client.query(format!("llm_d_epp_flow_control_pool_saturation{sel}"))),
            ),
            (
                "pool saturation (legacy name)",
                cache(client.query(format!(
                    "inference_extension_flow_control_pool_saturation{sel}"
                ))),
            ),
        ];
        Self {
            pool: pool.to_owned(),
            threshold,
            fallback,
            queries,
        }
    }

    async fn evaluate(&self) -> Explanation {
        let mut sources = Vec::new();
        let reading = self.read(&mut sources).await;
        Explanation {
            observation: with_fallback(reading, self.fallback),
            sources,
            notes: vec![format!(
                "closes at saturation {} (B = 1 − threshold)",
                self.threshold
            )],
        }
    }

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        for (role, query) in &self.queries {
            let mut report = SourceReport::new(*role, query.source().text());
            let answer = query.get().await;
            let t = match answer {
                Err(e) => {
                    report.outcome = format!("error: {e}");
                    sources.push(report);
                    return Err(GateError::SourceUnavailable(format!("{role}: {e}")));
                }
                Ok(t) => t,
            };
            report.values = t
                .value
                .iter()
                .map(|s| (show_labels(&s.labels), s.value))
                .collect();
            // Several series (e.g. one per endpoint-picker replica): the
            // most saturated one counts.
            let Some(s) = Aggregate::Max.apply(t.value.iter().map(|s| s.value)) else {
                report.outcome = "no sample".into();
                sources.push(report);
                continue;
            };
            let s = match non_negative(s, role) {
                Ok(s) => s,
                Err(e) => {
                    report.outcome = format!("invalid: {e}");
                    sources.push(report);
                    return Err(e);
                }
            };
            report.outcome = "used".into();
            sources.push(report);
            return Ok(pool_reading(
                1.0 - s,
                1.0 - self.threshold,
                t.taken_at,
                None,
                format!(
                    "{role}: S = {s} (max of {} series), D = 1 − S",
                    t.value.len()
                ),
            ));
        }
        Err(GateError::SourceUnavailable(format!(
            "no pool-saturation sample for pool {}",
            self.pool
        )))
    }
}

impl DispatchGate for PrometheusSaturationGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move { self.evaluate().await.observation })
    }

    fn kind(&self) -> &'static str {
        "prometheus-saturation"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(self.evaluate())
    }
}
