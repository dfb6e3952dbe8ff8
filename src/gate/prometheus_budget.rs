//! `prometheus-budget`: the endpoint picker's queue / running-requests
//! cascade over PromQL, with `max_SYS` = ready endpoints × `max_concurrency`.
//!
//! Sources, in order; the first that returns a sample wins, each tried
//! under the current endpoint-picker names, then the legacy ones:
//! 1. flow-control queue: `D = 1 − sum(queue) / (ready × MC)`
//! 2. per-endpoint queue: `D = 1 − avg(queue per endpoint) / MC`
//! 3. running requests: `D = 1 − sum(vllm:num_requests_running) / (ready × MC)`
//!
//! Only an *absent* source falls through; a source that errors closes the
//! gate (a broken Prometheus never reads as "try the next, maybe idle").
//! Zero ready endpoints reads closed, never idle.

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, loose};
use super::reading::{
    MetricGate, SourceReport, non_negative, pool_reading, promql_string, series_values,
};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, PromClient, PromQuery, PromVector, Timestamped};

/// Parameters of `prometheus-budget`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrometheusBudgetParams {
    /// InferencePool name (required).
    #[serde(deserialize_with = "loose::string")]
    pub pool: String,
    /// Namespace label filter, if any.
    #[serde(deserialize_with = "loose::opt_string")]
    pub namespace: Option<String>,
    /// Concurrency per ready pod, > 0 (default 100).
    #[serde(deserialize_with = "loose::f64")]
    pub max_concurrency: f64,
    /// Reserved baseline in [0, 1] (default 0.05).
    #[serde(deserialize_with = "loose::f64")]
    pub baseline: f64,
    /// Budget when no source returns a sample; `None` = 0 (fail closed).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub fallback: Option<f64>,
}

impl Default for PrometheusBudgetParams {
    fn default() -> Self {
        Self {
            pool: String::new(),
            namespace: None,
            max_concurrency: 100.0,
            baseline: 0.05,
            fallback: None,
        }
    }
}

impl GateParams for PrometheusBudgetParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        cx.require("pool", "the InferencePool name");
        cx.positive("max_concurrency", self.max_concurrency);
        cx.fraction("baseline", self.baseline);
        cx.fallback(self.fallback);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let client = ctx.prom_client("prometheus-budget")?;
        let gate = PrometheusBudgetGate::new(
            &client,
            |q| ctx.cache(q),
            &self.pool,
            self.namespace.as_deref(),
            self.max_concurrency,
            self.baseline,
        );
        Ok(Fallback::wrap(Box::new(gate), self.fallback))
    }
}

/// A cached PromQL query with its role.
#[derive(Debug)]
struct Query {
    role: &'static str,
    query: Cached<PromQuery>,
    /// Whether the metric counts this dispatcher's own requests once they
    /// run. The endpoint picker's queues count only *queued* requests:
    /// batch work that runs never lowers them, so for those the window
    /// must be `N` itself, never in-flight + `N` (docs/architecture.md, "The dispatch budget and the window").
    sees_own_load: bool,
}

/// One cascade step: how its value becomes `D`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Pool-wide load, divided by ready × MC.
    PoolLoad,
    /// Average load per endpoint, divided by MC.
    PerEndpoint,
}

/// The `prometheus-budget` gate.
#[derive(Debug)]
pub struct PrometheusBudgetGate {
    pool: String,
    max_concurrency: f64,
    baseline: f64,
    /// Ready endpoints: current name, then legacy.
    ready: Vec<Query>,
    /// The cascade, each step with its queries in name order.
    steps: Vec<(Step, Vec<Query>)>,
}

/// What a query answered.
enum Answer {
    Value(f64, Instant),
    Absent,
}

impl PrometheusBudgetGate {
    /// The gate for `pool` (optionally filtered by `namespace`).
    pub fn new(
        client: &PromClient,
        cache: impl Fn(PromQuery) -> Cached<PromQuery>,
        pool: &str,
        namespace: Option<&str>,
        max_concurrency: f64,
        baseline: f64,
    ) -> Self {
        let ns = namespace
            .map(|n| format!(",namespace={}", promql_string(n)))
            .unwrap_or_default();
        let by_name = format!("{{name={}{ns}}}", promql_string(pool));
        let by_pool = format!("{{inference_pool={}{ns}}}", promql_string(pool));
        // Every query is `agg(metric{labels})`, dated by the scrape time of
        // the samples behind it, so re-reading one scrape releases nothing.
        let q = |role: &'static str, agg: &str, metric: &str, labels: &str, sees_own_load| Query {
            role,
            query: cache(client.dated_query(
                format!("{agg}({metric}{labels})"),
                &format!("{metric}{labels}"),
            )),
            sees_own_load,
        };
        let ready = vec![
            q(
                "ready endpoints (current name)",
                "max",
                "llm_d_epp_ready_endpoints",
                &by_name,
                false,
            ),
            q(
                "ready endpoints (legacy name)",
                "max",
                "inference_pool_ready_pods",
                &by_name,
                false,
            ),
        ];
        let steps = vec![
            (
                Step::PoolLoad,
                vec![
                    q(
                        "flow-control queue (current name)",
                        "sum",
                        "llm_d_epp_flow_control_queue_size",
                        &by_pool,
                        false,
                    ),
                    q(
                        "flow-control queue (legacy name)",
                        "sum",
                        "inference_extension_flow_control_queue_size",
                        &by_pool,
                        false,
                    ),
                ],
            ),
            (
                Step::PerEndpoint,
                vec![
                    q(
                        "per-endpoint queue (current name)",
                        "avg",
                        "llm_d_epp_per_endpoint_queue_size",
                        &by_name,
                        false,
                    ),
                    q(
                        "per-endpoint queue (legacy name)",
                        "avg",
                        "inference_pool_per_pod_queue_size",
                        &by_name,
                        false,
                    ),
                ],
            ),
            (
                Step::PoolLoad,
                vec![q(
                    "running requests (vLLM)",
                    "sum",
                    "vllm:num_requests_running",
                    &by_pool,
                    true,
                )],
            ),
        ];
        let gate = Self {
            pool: pool.to_owned(),
            max_concurrency,
            baseline,
            ready,
            steps,
        };
        tracing::info!(
            pool,
            max_concurrency,
            baseline,
            closes_at_load_per_ready_pod = gate.closing_load(),
            "prometheus-budget gate closes when the load per ready pod reaches max_concurrency × (1 − baseline); an oversized max_concurrency makes a gate that never closes"
        );
        gate
    }

    /// The load per ready pod at which `D` falls to the baseline.
    fn closing_load(&self) -> f64 {
        self.max_concurrency * (1.0 - self.baseline)
    }

    /// Runs one query; a single aggregated series is expected (the
    /// queries aggregate), several are summed explicitly.
    async fn ask(&self, q: &Query, report: &mut SourceReport) -> Result<Answer, GateError> {
        let answer: Result<Timestamped<PromVector>, _> = q.query.get().await;
        match answer {
            Err(e) => {
                report.outcome = format!("error: {e}");
                Err(GateError::source(q.role, e))
            }
            Ok(t) if t.value.is_empty() => {
                report.outcome = "no sample".into();
                Ok(Answer::Absent)
            }
            Ok(t) => {
                report.values = series_values(&t.value);
                let sum: f64 = t.value.iter().map(|s| s.value).sum();
                match non_negative(sum, q.role) {
                    Ok(v) => {
                        report.outcome = "answered".into();
                        Ok(Answer::Value(v, t.taken_at))
                    }
                    Err(e) => {
                        report.outcome = format!("invalid: {e}");
                        Err(e)
                    }
                }
            }
        }
    }

    async fn cascade(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let mut ready: Option<(f64, Instant)> = None;
        for q in &self.ready {
            let mut report = SourceReport::new(q.role, q.query.source().text());
            let answer = self.ask(q, &mut report).await;
            sources.push(report);
            if let Answer::Value(v, at) = answer? {
                ready = Some((v, at));
                break;
            }
        }
        if let Some((r, at)) = ready
            && r < 1.0
        {
            return Ok(pool_reading(
                0.0,
                self.baseline,
                at,
                Some(0.0),
                // Closed whatever it sees: N is 0.
                false,
                format!("pool {} has no ready endpoints: closed", self.pool),
            ));
        }
        for (step, queries) in &self.steps {
            if *step == Step::PoolLoad && ready.is_none() {
                for q in queries {
                    let mut report = SourceReport::new(q.role, q.query.source().text());
                    report.outcome = "skipped: needs the ready-endpoint count".into();
                    sources.push(report);
                }
                continue;
            }
            for q in queries {
                let mut report = SourceReport::new(q.role, q.query.source().text());
                let answer = self.ask(q, &mut report).await;
                let answer = match answer {
                    Ok(a) => a,
                    Err(e) => {
                        sources.push(report);
                        return Err(e);
                    }
                };
                let Answer::Value(load, at) = answer else {
                    sources.push(report);
                    continue;
                };
                report.outcome = "used".into();
                sources.push(report);
                let max_sys = ready.map(|(r, _)| r * self.max_concurrency);
                let (d, explain) = match (step, ready) {
                    (Step::PoolLoad, Some((r, _))) => (
                        1.0 - load / (r * self.max_concurrency),
                        format!("D = 1 − {load} / ({r} ready × {})", self.max_concurrency),
                    ),
                    _ => (
                        1.0 - load / self.max_concurrency,
                        format!("D = 1 − {load} / {}", self.max_concurrency),
                    ),
                };
                // The data is as old as the older of the two inputs.
                let taken_at = match ready {
                    Some((_, r_at)) if r_at < at => r_at,
                    _ => at,
                };
                let mut observation = pool_reading(
                    d,
                    self.baseline,
                    taken_at,
                    max_sys,
                    q.sees_own_load,
                    format!("{} ({explain}; overload reads 0)", q.role),
                );
                // The one step that sees our load (vLLM running requests)
                // counts each running request of ours as one of ready ×
                // max_concurrency, which is max_SYS when the ready count is
                // known: its finished requests may be refilled. The queue
                // steps are blind and keep N per reading.
                observation.counts_own_requests =
                    q.sees_own_load && *step == Step::PoolLoad && ready.is_some();
                return Ok(observation);
            }
        }
        Err(GateError::SourceUnavailable(format!(
            "no source of the cascade returned a sample for pool {} (a missing sample means closed, never idle)",
            self.pool
        )))
    }
}

impl MetricGate for PrometheusBudgetGate {
    const KIND: &'static str = "prometheus-budget";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        self.cascade(sources).await
    }

    fn notes(&self) -> Vec<String> {
        vec![format!(
            "closes when the load per ready pod reaches {:.3} (max_concurrency {} × (1 − baseline {}))",
            self.closing_load(),
            self.max_concurrency,
            self.baseline
        )]
    }
}
