//! `prometheus-query`: any PromQL expression whose value is the budget `D`.
//! Several series: the smallest counts (explicitly, never "the first").
//! A value outside [0, 1] is an error, not clamped (upstream clamps, so a
//! query that returns 5 by mistake opens the gate fully).

use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose};
use super::reading::{Aggregate, MetricGate, SourceReport, pool_reading, series_values};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, PromQuery};

/// Parameters of `prometheus-query`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusQueryParams {
    /// The PromQL expression (required).
    #[serde(deserialize_with = "loose::string")]
    pub query: String,
    /// Budget when the query fails; `None` = 0 (fail closed).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub fallback: Option<f64>,
    /// Pool name, used only as a label.
    #[serde(deserialize_with = "loose::opt_string")]
    pub pool: Option<String>,
}

impl GateParams for PrometheusQueryParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        cx.require("query", "a PromQL expression");
        cx.fallback(self.fallback);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let client = ctx.prom_client("prometheus-query")?;
        let gate = PrometheusQueryGate::new(
            ctx.cache(client.query(self.query.clone())),
            self.pool.clone(),
        );
        Ok(Fallback::wrap(Box::new(gate), self.fallback))
    }
}

/// The `prometheus-query` gate.
#[derive(Debug)]
pub struct PrometheusQueryGate {
    query: Cached<PromQuery>,
    pool: Option<String>,
}

impl PrometheusQueryGate {
    /// The gate for one cached query.
    pub fn new(query: Cached<PromQuery>, pool: Option<String>) -> Self {
        Self { query, pool }
    }
}

impl MetricGate for PrometheusQueryGate {
    const KIND: &'static str = "prometheus-query";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let mut report = SourceReport::new("budget query", self.query.source().text());
        let reading = match self.query.get().await {
            Err(e) => {
                report.outcome = format!("error: {e}");
                Err(GateError::source("query", e))
            }
            Ok(t) => {
                report.values = series_values(&t.value);
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
                            // An arbitrary expression can be dated only when
                            // it was evaluated, not by its samples' scrape:
                            // so it never counts as seeing our load (the
                            // window is N itself), or every poll would add
                            // N again.
                            false,
                            format!("query value {d} (min of {} series)", t.value.len()),
                        ))
                    }
                }
            }
        };
        sources.push(report);
        reading
    }

    fn notes(&self) -> Vec<String> {
        self.pool
            .iter()
            .map(|p| format!("pool label: {p}"))
            .collect()
    }
}
