//! In-process metric endpoints: how `sluicegate eval` serves the simulated
//! pool's `/metrics` pages and PromQL answers to gates without sockets, so
//! the very gates and sources that run in production run in virtual time.
//!
//! A [`MetricsAccess`] in the gate context picks the transport: the network
//! (production) or an in-process [`MetricsEndpoint`]. Everything above the
//! transport (parsing, dating by scrape time, caching, the gates' formulas)
//! is shared.

use std::sync::Arc;

use super::{PromVector, SourceError};

/// A PromQL answer from an in-process endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct PromAnswer {
    /// The instant vector (a scalar is one series without labels).
    pub samples: PromVector,
    /// Evaluation time in the endpoint's own Unix seconds (Prometheus'
    /// clock); sample timestamps from `timestamp()` use the same clock.
    pub evaluated_at: f64,
}

/// Metric pages and PromQL served in-process.
///
/// Contract: answers describe the endpoint's "now", which the caller keeps
/// in step with tokio's clock; an error means what the same failure would
/// mean over the network (a down target, a rejected query).
pub trait MetricsEndpoint: Send + Sync + std::fmt::Debug {
    /// The text-format page at `url`.
    fn page(&self, url: &url::Url) -> Result<String, SourceError>;

    /// One PromQL instant query.
    fn query(&self, promql: &str) -> Result<PromAnswer, SourceError>;
}

/// Where metric sources read: over the network, or from an in-process
/// endpoint (`sluicegate eval`).
#[derive(Debug, Clone, Default)]
pub enum MetricsAccess {
    /// HTTP scrapes and Prometheus' HTTP API (production).
    #[default]
    Network,
    /// Pages and queries answered in-process.
    InProcess(Arc<dyn MetricsEndpoint>),
}
