//! `prometheus-saturation`: `D = 1 − S`, `B = 1 − threshold`, where `S` is
//! the endpoint picker's flow-control pool saturation (current name, then
//! the legacy one). Upstream's budget `(1 − S) − (1 − threshold)` is the
//! same headroom.

use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose};
use super::reading::{
    Aggregate, MetricGate, SourceReport, non_negative, pool_reading, promql_string, series_values,
};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, PromClient, PromQuery};

/// Parameters of `prometheus-saturation`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusSaturationParams {
    /// InferencePool name (required).
    #[serde(deserialize_with = "loose::string")]
    pub pool: String,
    /// Namespace label filter, if any.
    #[serde(deserialize_with = "loose::opt_string")]
    pub namespace: Option<String>,
    /// Saturation at which the gate closes, in [0, 1] (default 0.8).
    #[serde(deserialize_with = "loose::f64")]
    pub threshold: f64,
    /// Budget when the metric is unreadable; `None` = 0 (fail closed).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub fallback: Option<f64>,
}

impl Default for PrometheusSaturationParams {
    fn default() -> Self {
        Self {
            pool: String::new(),
            namespace: None,
            threshold: 0.8,
            fallback: None,
        }
    }
}

impl GateParams for PrometheusSaturationParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        cx.require("pool", "the InferencePool name");
        cx.fraction("threshold", self.threshold);
        cx.fallback(self.fallback);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let client = ctx.prom_client("prometheus-saturation")?;
        let gate = PrometheusSaturationGate::new(
            &client,
            |q| ctx.cache(q),
            &self.pool,
            self.namespace.as_deref(),
            self.threshold,
        );
        Ok(Fallback::wrap(Box::new(gate), self.fallback))
    }
}

/// The `prometheus-saturation` gate.
#[derive(Debug)]
pub struct PrometheusSaturationGate {
    pool: String,
    threshold: f64,
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
    ) -> Self {
        let ns = namespace
            .map(|n| format!(",namespace={}", promql_string(n)))
            .unwrap_or_default();
        let sel = format!("{{inference_pool={}{ns}}}", promql_string(pool));
        // Dated by the samples' scrape time, so re-reading one scrape
        // releases nothing new. The saturation detectors count requests in
        // flight through the picker and KV use, which include ours.
        let series = |metric: &str| {
            let selector = format!("{metric}{sel}");
            cache(client.dated_query(selector.clone(), &selector))
        };
        let queries = vec![
            (
                "pool saturation (current name)",
                series("llm_d_epp_flow_control_pool_saturation"),
            ),
            (
                "pool saturation (legacy name)",
                series("inference_extension_flow_control_pool_saturation"),
            ),
        ];
        Self {
            pool: pool.to_owned(),
            threshold,
            queries,
        }
    }

    async fn read_saturation(
        &self,
        sources: &mut Vec<SourceReport>,
    ) -> Result<Observation, GateError> {
        for (role, query) in &self.queries {
            let mut report = SourceReport::new(*role, query.source().text());
            let answer = query.get().await;
            let t = match answer {
                Err(e) => {
                    report.outcome = format!("error: {e}");
                    sources.push(report);
                    return Err(GateError::source(*role, e));
                }
                Ok(t) => t,
            };
            report.values = series_values(&t.value);
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
                // The picker's detectors count in-flight requests and KV use.
                // Not `counts_own_requests`: S is the larger of queue depth
                // and KV use per endpoint, and a running request of ours
                // moves KV use by a fraction of one request of max_SYS
                // (steady/small: 640 of 131 072 tokens per engine), so its
                // N barely shrinks as ours grow. Refilling finished
                // requests on it pinned in-flight at the window, which the
                // next reading took as its base and added N to: in the
                // eval, ΔV +2.28 → +92.76 pp on steady/small (seed 0,
                // docs/gate-quality.md, "Refill on own finishes").
                true,
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

impl MetricGate for PrometheusSaturationGate {
    const KIND: &'static str = "prometheus-saturation";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        self.read_saturation(sources).await
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "closes at saturation {} (B = 1 − threshold)",
            self.threshold
        )]
    }
}
