//! `endpoint-scrape`: saturation read straight from a `/metrics` page, no
//! Prometheus. Either the metric is already a saturation
//! (`max_count_per_pod = 0`; several series: the largest counts) or it is a
//! count (several series: summed) divided by `ready pods × max_count_per_pod`,
//! with the ready-pod count read live from `pods_metric` (at `pods_url`, or
//! `url`; several series: the largest counts). `D = 1 − saturation`
//! (`value_type = "budget"`: the normalized value is `D` itself),
//! `B = baseline`. `absent_value` stands in for a metric the page lacks;
//! `admission = "counted"` counts starts per reading (`counted.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::counted::CountedAdmission;
use super::param::{GateParams, ParseCx, loose};
use super::reading::{
    Aggregate, MetricGate, SourceReport, non_negative, pool_reading, show_labels,
};
use super::{BuildError, DispatchGate, Fallback, GateContext, GateError, Observation};
use crate::source::{Cached, Exposition, Scrape, Timestamped};

/// Parameters of `endpoint-scrape`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EndpointScrapeParams {
    /// The `/metrics` URL (required).
    #[serde(deserialize_with = "loose::string")]
    pub url: String,
    /// Metric name (required).
    #[serde(deserialize_with = "loose::string")]
    pub metric: String,
    /// Label matchers on the metric.
    #[serde(deserialize_with = "loose::string_map")]
    pub labels: BTreeMap<String, String>,
    /// Capacity per ready pod; 0 = the value is already a saturation.
    #[serde(deserialize_with = "loose::f64")]
    pub max_count_per_pod: f64,
    /// Reserved baseline in [0, 1] (default 0).
    #[serde(deserialize_with = "loose::f64")]
    pub baseline: f64,
    /// Budget when the scrape fails; `None` = 0 (fail closed).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub fallback: Option<f64>,
    /// Where to read the ready-pod count, if not `url`.
    #[serde(deserialize_with = "loose::opt_string")]
    pub pods_url: Option<String>,
    /// Ready-pod metric name.
    #[serde(deserialize_with = "loose::opt_string")]
    pub pods_metric: Option<String>,
    /// Label matchers on the ready-pod metric.
    #[serde(deserialize_with = "loose::string_map")]
    pub pods_labels: BTreeMap<String, String>,
    /// Whether `metric` counts this dispatcher's requests once they run
    /// (running requests, KV use: true; waiting-queue sizes: false, the
    /// default). Only then may the window add `N` to what is in flight.
    /// Not in upstream's parameters. Its readings never refill the window
    /// on our own finishes (`Observation::counts_own_requests`): the
    /// metric may be KV use, which a request of ours moves by a fraction
    /// of a unit, and nothing here tells which.
    #[serde(deserialize_with = "loose::bool")]
    pub sees_own_load: bool,
    /// Whether the normalized value is a saturation (`D = 1 − value`, the
    /// default) or the budget itself (`D = value`).
    pub value_type: ValueType,
    /// The raw value assumed when the page is read but no series matches
    /// (a gauge that exists only while there is something to count);
    /// unset: no series is a failed reading.
    #[serde(deserialize_with = "loose::opt_f64")]
    pub absent_value: Option<f64>,
    /// `budget` (default): the reading is a budget for the window.
    /// `counted`: each reading also grants floor(free slots) starts, and
    /// no more start until the next reading (`counted.rs`).
    pub admission: AdmissionKind,
}

/// What the scraped, normalized value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueType {
    /// A saturation: `D = 1 − value`.
    #[default]
    Saturation,
    /// The budget: `D = value`.
    Budget,
}

/// How the gate admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdmissionKind {
    /// The reading is a budget for the window.
    #[default]
    Budget,
    /// Starts counted per reading, at most its free slots.
    Counted,
}

impl GateParams for EndpointScrapeParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("url", "an http(s) URL") {
            cx.http_url("url", &self.url);
        }
        cx.require("metric", "a metric name");
        cx.non_negative("max_count_per_pod", self.max_count_per_pod);
        cx.fraction("baseline", self.baseline);
        cx.fallback(self.fallback);
        if let Some(u) = &self.pods_url {
            cx.http_url("pods_url", u);
        }
        if let Some(v) = self.absent_value {
            cx.non_negative("absent_value", v);
        }
        if self.admission == AdmissionKind::Counted {
            // Upstream's rules: free slots need a count and its capacity.
            if self.max_count_per_pod <= 0.0 || self.value_type != ValueType::Saturation {
                cx.error(
                    "admission",
                    "`counted` needs a count metric: max_count_per_pod > 0 and value_type = \"saturation\"",
                );
            } else if self.baseline != 0.0 || self.fallback.is_some_and(|f| f != 0.0) {
                cx.error(
                    "admission",
                    "`counted` takes neither baseline nor fallback: size the headroom with max_count_per_pod; a failed reading admits nothing",
                );
            }
        }
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let pods = match &self.pods_metric {
            None => None,
            Some(m) => Some(PodsSource {
                page: match &self.pods_url {
                    Some(u) if *u != self.url => Some(ctx.scrape(u)?),
                    _ => None,
                },
                metric: m.clone(),
                labels: self.pods_labels.clone(),
            }),
        };
        let gate = EndpointScrapeGate::new(
            ctx.scrape(&self.url)?,
            self.metric.clone(),
            self.labels.clone(),
            self.max_count_per_pod,
            self.baseline,
            pods,
        )
        .seeing_own_load(self.sees_own_load)
        .valuing(self.value_type, self.absent_value);
        Ok(match self.admission {
            AdmissionKind::Budget => Fallback::wrap(Box::new(gate), self.fallback),
            AdmissionKind::Counted => Box::new(CountedAdmission::new(Box::new(gate))),
        })
    }
}

/// Where the ready-pod count comes from.
#[derive(Debug)]
pub struct PodsSource {
    /// The page (a second scrape, or `None` to reuse the metric's page).
    pub page: Option<Cached<Scrape>>,
    /// Metric name.
    pub metric: String,
    /// Label matchers.
    pub labels: BTreeMap<String, String>,
}

/// The `endpoint-scrape` gate.
#[derive(Debug)]
pub struct EndpointScrapeGate {
    page: Cached<Scrape>,
    metric: String,
    labels: BTreeMap<String, String>,
    max_count_per_pod: f64,
    baseline: f64,
    pods: Option<PodsSource>,
    sees_own_load: bool,
    value_type: ValueType,
    absent_value: Option<f64>,
}

fn select(
    page: &Exposition,
    metric: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<(String, f64)> {
    page.named(metric)
        .filter(|s| s.matches(labels))
        .map(|s| (show_labels(&s.labels), s.value))
        .collect()
}

fn selector(metric: &str, labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        metric.to_owned()
    } else {
        format!("{metric}{}", show_labels(labels))
    }
}

impl EndpointScrapeGate {
    /// The gate. `pods` is `None` when no `pods_metric` is configured.
    pub fn new(
        page: Cached<Scrape>,
        metric: String,
        labels: BTreeMap<String, String>,
        max_count_per_pod: f64,
        baseline: f64,
        pods: Option<PodsSource>,
    ) -> Self {
        Self {
            page,
            metric,
            labels,
            max_count_per_pod,
            baseline,
            pods,
            sees_own_load: false,
            value_type: ValueType::Saturation,
            absent_value: None,
        }
    }

    /// Declares what the normalized value is, and the raw value assumed
    /// when the page has no matching series (`None`: a failed reading).
    #[must_use]
    pub fn valuing(mut self, value_type: ValueType, absent_value: Option<f64>) -> Self {
        self.value_type = value_type;
        self.absent_value = absent_value;
        self
    }

    /// `D` from the normalized value, clamped to [0, 1] as upstream does.
    fn budget_of(&self, normalized: f64) -> f64 {
        let normalized = normalized.clamp(0.0, 1.0);
        match self.value_type {
            ValueType::Saturation => 1.0 - normalized,
            ValueType::Budget => normalized,
        }
    }

    fn explain_budget(&self) -> &'static str {
        match self.value_type {
            ValueType::Saturation => "D = 1 − saturation",
            ValueType::Budget => "D = the value (value_type budget)",
        }
    }

    /// Declares whether the metric counts our own running requests (the
    /// default is no: the window is then `N` itself).
    #[must_use]
    pub fn seeing_own_load(mut self, sees_own_load: bool) -> Self {
        self.sees_own_load = sees_own_load;
        self
    }

    async fn fetch(
        page: &Cached<Scrape>,
        report: &mut SourceReport,
    ) -> Result<Timestamped<Arc<Exposition>>, GateError> {
        page.get().await.map_err(|e| {
            report.outcome = format!("error: {e}");
            GateError::source(report.target.clone(), e)
        })
    }

    async fn read_page(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let target = format!(
            "{} at {}",
            selector(&self.metric, &self.labels),
            self.page.source().url()
        );
        let mut report = SourceReport::new("metric", target);
        let page = match Self::fetch(&self.page, &mut report).await {
            Ok(p) => p,
            Err(e) => {
                sources.push(report);
                return Err(e);
            }
        };
        report.values = select(&page.value, &self.metric, &self.labels);
        let direct = self.max_count_per_pod <= 0.0;
        let how = if direct {
            Aggregate::Max
        } else {
            Aggregate::Sum
        };
        let (value, absent) = match (
            how.apply(report.values.iter().map(|(_, v)| *v)),
            self.absent_value,
        ) {
            (Some(v), _) => (v, false),
            (None, Some(assumed)) => (assumed, true),
            (None, None) => {
                report.outcome = "no sample".into();
                sources.push(report);
                return Err(GateError::SourceUnavailable(format!(
                    "no sample of {} (typo in the name or labels?)",
                    selector(&self.metric, &self.labels)
                )));
            }
        };
        let value = match non_negative(value, &self.metric) {
            Ok(v) => v,
            Err(e) => {
                report.outcome = format!("invalid: {e}");
                sources.push(report);
                return Err(e);
            }
        };
        report.outcome = if absent {
            format!("no series: absent_value {value} assumed")
        } else {
            format!("used ({} of {} series)", how.name(), report.values.len())
        };
        sources.push(report);
        if direct {
            return Ok(pool_reading(
                self.budget_of(value),
                self.baseline,
                page.taken_at,
                None,
                self.sees_own_load,
                format!("value {value} read directly; {}", self.explain_budget()),
            ));
        }
        let (pods, pods_at) = match &self.pods {
            None => (1.0, page.taken_at),
            Some(p) => self.read_pods(p, &page, sources).await?,
        };
        let max_sys = pods * self.max_count_per_pod;
        let taken_at = pods_at.min(page.taken_at);
        if pods < 1.0 {
            return Ok(pool_reading(
                0.0,
                self.baseline,
                taken_at,
                Some(0.0),
                self.sees_own_load,
                "no ready pods: closed".into(),
            ));
        }
        let normalized = value / max_sys;
        Ok(pool_reading(
            self.budget_of(normalized),
            self.baseline,
            taken_at,
            Some(max_sys),
            self.sees_own_load,
            format!(
                "{value} / ({pods} pods × {}) = {normalized:.4}; {}",
                self.max_count_per_pod,
                self.explain_budget()
            ),
        ))
    }

    async fn read_pods(
        &self,
        p: &PodsSource,
        metric_page: &Timestamped<Arc<Exposition>>,
        sources: &mut Vec<SourceReport>,
    ) -> Result<(f64, Instant), GateError> {
        let cache = p.page.as_ref().unwrap_or(&self.page);
        let target = format!(
            "{} at {}",
            selector(&p.metric, &p.labels),
            cache.source().url()
        );
        let mut report = SourceReport::new("ready pods", target);
        let page = match &p.page {
            None => metric_page.clone(),
            Some(c) => match Self::fetch(c, &mut report).await {
                Ok(page) => page,
                Err(e) => {
                    sources.push(report);
                    return Err(e);
                }
            },
        };
        report.values = select(&page.value, &p.metric, &p.labels);
        let Some(pods) = Aggregate::Max.apply(report.values.iter().map(|(_, v)| *v)) else {
            report.outcome = "no sample".into();
            sources.push(report);
            return Err(GateError::SourceUnavailable(format!(
                "no sample of the ready-pod metric {}",
                selector(&p.metric, &p.labels)
            )));
        };
        match non_negative(pods, &p.metric) {
            Ok(v) => {
                report.outcome = format!("used (max of {} series)", report.values.len());
                sources.push(report);
                Ok((v, page.taken_at))
            }
            Err(e) => {
                report.outcome = format!("invalid: {e}");
                sources.push(report);
                Err(e)
            }
        }
    }
}

impl MetricGate for EndpointScrapeGate {
    const KIND: &'static str = "endpoint-scrape";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        self.read_page(sources).await
    }
}
