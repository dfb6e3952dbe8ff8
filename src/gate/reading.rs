//! What the metric-driven gates share: the [`MetricGate`] trait (a gate
//! that reads sources; observe and explain are written once here), checks
//! that turn raw values into budgets or errors (never a guess), explicit
//! aggregation of multi-series results, the explanation `gate probe`
//! prints, and the opt-in fallback reading.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{Budget, DispatchEvent, DispatchGate, GateError, Observation};

/// A gate that reads metric sources and turns them into a budget. Each
/// gate supplies only its sources and formula ([`MetricGate::read`]);
/// `observe`, `explain` and `kind` are implemented once, below, for every
/// metric gate. The opt-in fallback is a wrapper (`guard::Fallback`).
pub(crate) trait MetricGate: Send + Sync + fmt::Debug {
    /// The gate's catalogue name.
    const KIND: &'static str;

    /// Reads the sources, recording each in `sources` (for `gate probe`),
    /// and computes the observation. An unreadable or invalid source is an
    /// error, never a guess.
    fn read<'a>(
        &'a self,
        sources: &'a mut Vec<SourceReport>,
    ) -> impl Future<Output = Result<Observation, GateError>> + Send + 'a;

    /// The last reading again, when the gate can tell without reading its
    /// sources anew that nothing it depends on has changed (its cached
    /// data is the same). `observe` asks this first, so a warm decision
    /// costs a comparison, not a rescan of the data and a report; `explain`
    /// always reads. The default never reuses.
    fn reuse(&self) -> impl Future<Output = Option<Observation>> + Send + '_ {
        std::future::ready(None)
    }

    /// Facts about the gate's configuration for the explanation.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// What happened to a batch request ([`DispatchGate::on_event`]); the
    /// feedback gates learn their own in-flight work and 429/503s here.
    fn on_event(&self, event: DispatchEvent) {
        let _ = event;
    }
}

/// Reads a metric gate once and says how.
async fn evaluate<G: MetricGate>(gate: &G) -> Explanation {
    let mut sources = Vec::new();
    let observation = gate.read(&mut sources).await;
    Explanation {
        observation,
        sources,
        notes: gate.notes(),
    }
}

impl<G: MetricGate> DispatchGate for G {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            if let Some(observation) = self.reuse().await {
                return Ok(observation);
            }
            evaluate(self).await.observation
        })
    }

    fn kind(&self) -> &'static str {
        G::KIND
    }

    fn on_event(&self, event: DispatchEvent) {
        MetricGate::on_event(self, event);
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(evaluate(self))
    }
}

/// One source a gate read, for `gate probe` and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceReport {
    /// What the source is for, e.g. `flow-control queue (current names)`.
    pub role: String,
    /// The query, URL or key (no secrets).
    pub target: String,
    /// Raw values read: series labels (`{a="b"}`) and value.
    pub values: Vec<(String, f64)>,
    /// What came of it: `used`, `no sample`, `not tried`, or the error.
    pub outcome: String,
}

impl SourceReport {
    /// A report with no values yet.
    pub fn new(role: impl Into<String>, target: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            target: target.into(),
            values: Vec::new(),
            outcome: String::new(),
        }
    }
}

/// A reading and the sources behind it.
#[derive(Debug)]
pub struct Explanation {
    /// The reading (errors become budget 0 behind the fail-closed wrapper).
    pub observation: Result<Observation, GateError>,
    /// Every source consulted, in order.
    pub sources: Vec<SourceReport>,
    /// Further facts (e.g. the load per ready pod at which the gate closes).
    pub notes: Vec<String>,
}

impl Explanation {
    /// The reading of a gate that consults no source (admission and local
    /// gates), with `notes`.
    pub fn sourceless(observation: Result<Observation, GateError>, notes: Vec<String>) -> Self {
        Self {
            observation,
            sources: Vec::new(),
            notes,
        }
    }
}

/// Renders labels as `{a="b",c="d"}` (empty labels as `{}`).
pub(crate) fn show_labels(labels: &BTreeMap<String, String>) -> String {
    let inner: Vec<String> = labels
        .iter()
        .filter(|(k, _)| k.as_str() != "__name__")
        .map(|(k, v)| format!("{k}={v:?}"))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// The series of a PromQL answer as `(labels, value)` rows for a report.
pub(crate) fn series_values(vector: &crate::source::PromVector) -> Vec<(String, f64)> {
    vector
        .iter()
        .map(|s| (show_labels(&s.labels), s.value))
        .collect()
}

/// A value that must be a finite, non-negative number (a count, a
/// saturation, a usage). NaN, infinities and negatives are errors.
pub(crate) fn non_negative(value: f64, what: &str) -> Result<f64, GateError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(GateError::SourceUnavailable(format!(
            "{what} is {value}, not a finite number >= 0"
        )))
    }
}

/// How several series of one source become one number. Explicit, because
/// taking "the first series" reads an arbitrary pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Aggregate {
    /// Sum (counts over pods).
    Sum,
    /// Maximum (saturations and usages: the most loaded wins).
    Max,
    /// Minimum (budgets: the tightest wins).
    Min,
}

impl Aggregate {
    pub(crate) fn apply(self, values: impl IntoIterator<Item = f64>) -> Option<f64> {
        values.into_iter().reduce(|a, b| match self {
            Self::Sum => a + b,
            // NaN must survive aggregation so the checks reject it.
            Self::Max => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            }
            Self::Min => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.min(b)
                }
            }
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::Max => "max",
            Self::Min => "min",
        }
    }
}

/// An available reading of a metric source. `sees_own_load` is the
/// source's own property (does its metric count our running requests?),
/// so every gate states it where it reads the source.
pub(crate) fn pool_reading(
    d: f64,
    baseline: f64,
    taken_at: Instant,
    max_sys: Option<f64>,
    sees_own_load: bool,
    reason: String,
) -> Observation {
    // `counts_own_requests` stays off: it is opted into per gate where
    // its metric counts requests one for one.
    Observation {
        baseline: Budget::saturating(baseline),
        max_sys,
        sees_own_load,
        reason,
        ..Observation::open(Budget::saturating(d), taken_at)
    }
}

/// Applies the opt-in `fallback` (for the `Fallback` wrapper): without one
/// an error stays an error (budget 0 behind the fail-closed wrapper); with
/// one the gate reads
/// `fallback` as its headroom, marked unavailable and blind (it says
/// nothing about our own load, so the window caps own in-flight at N).
pub(crate) fn with_fallback(
    reading: Result<Observation, GateError>,
    fallback: Option<f64>,
) -> Result<Observation, GateError> {
    match (reading, fallback) {
        (Ok(o), _) => Ok(o),
        (Err(e), None) => Err(e),
        (Err(e), Some(f)) => Ok(Observation {
            source_available: false,
            reason: format!("fallback {f} because {e}"),
            ..Observation::open(Budget::saturating(f), Instant::now())
        }),
    }
}

/// Escapes a PromQL label value inside double quotes.
pub(crate) fn promql_string(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregation_keeps_nan_so_it_is_rejected() {
        assert!(
            Aggregate::Max
                .apply([1.0, f64::NAN])
                .is_some_and(f64::is_nan)
        );
        assert!(
            Aggregate::Min
                .apply([f64::NAN, 1.0])
                .is_some_and(f64::is_nan)
        );
        assert_eq!(Aggregate::Sum.apply([1.0, 2.0]), Some(3.0));
        assert_eq!(Aggregate::Max.apply(Vec::<f64>::new()), None);
    }

    #[test]
    fn rejects_non_finite_and_negative_values() {
        assert!(non_negative(f64::NAN, "x").is_err());
        assert!(non_negative(f64::INFINITY, "x").is_err());
        assert!(non_negative(-1.0, "x").is_err());
        assert_eq!(non_negative(0.0, "x").ok(), Some(0.0));
    }

    #[test]
    fn fallback_is_opt_in_and_marked_unavailable() {
        let err = || Err(GateError::SourceUnavailable("down".into()));
        assert!(with_fallback(err(), None).is_err());
        let o = with_fallback(err(), Some(0.2)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.budget.get(), 0.2);
        assert!(!o.source_available);
        assert!(!o.sees_own_load);
    }

    #[test]
    fn escapes_promql_strings() {
        assert_eq!(promql_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }
}
