//! Metric sources: where metric-driven gates read the pool.
//!
//! Each source returns [`Timestamped`] data: the value plus the instant the
//! data describes, so the staleness limit and the dispatch window can reason
//! about its age.
//!
//! Files: `prom.rs` (PromQL instant queries over Prometheus' HTTP API),
//! `scrape.rs` (GET a text-format `/metrics` page), `text.rs` (our own
//! text-format parser, which keeps names with `:`), `redis_key.rs` (a budget
//! written to a Redis key by an external controller), `cache.rs` (a
//! single-flight TTL cache with a staleness limit that wraps any source),
//! `local.rs` (in-process endpoints for pages and PromQL, how `eval` runs
//! the same sources in virtual time).

mod cache;
mod local;
mod prom;
mod redis_key;
mod scrape;
pub mod text;

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

pub use cache::Cached;
pub use local::{MetricsAccess, MetricsEndpoint, PromAnswer};
pub use prom::{PromAuth, PromClient, PromQuery, PromSample, PromVector, PrometheusConfig};
pub use redis_key::{
    APPLIED_SUFFIX, BudgetRecord, DecisionAcks, RecordError, RedisEndpoint, RedisKey,
    parse_budget_record,
};
pub use scrape::Scrape;
pub use text::{Exposition, MetricType, ParseError};

/// Data and the instant it describes.
#[derive(Debug, Clone, PartialEq)]
pub struct Timestamped<T> {
    /// The data.
    pub value: T,
    /// When the data was true (for a scrape, when the request was sent; for
    /// a PromQL query, the evaluation time).
    pub taken_at: Instant,
}

/// A source of metric data.
///
/// Contract: `fetch` reads the source once (no caching; wrap in [`Cached`]
/// for that) and never returns data it could not read: a failed request,
/// an error status or an unparsable answer is a [`SourceError`].
pub trait Source: Send + Sync + std::fmt::Debug + 'static {
    /// What one read returns.
    type Output: Clone + Send + Sync + 'static;

    /// Reads the source once.
    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<Self::Output>, SourceError>>;

    /// The query, URL or key, for logs and `gate probe` (no secrets).
    fn describe(&self) -> String;
}

/// Why a source could not be read. Cheap to clone, so one failed attempt
/// can be handed to every caller that waited for it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    /// The request did not complete (connection refused, reset, TLS).
    #[error("request failed: {0}")]
    Transport(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The server answered with an error status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// Prometheus rejected the query (syntax error, execution error).
    #[error("query rejected: {0}")]
    Query(String),
    /// The answer could not be read.
    #[error("cannot parse the answer: {0}")]
    Parse(String),
    /// A scraped page is not UTF-8.
    #[error("cannot parse the answer: not UTF-8: {0}")]
    NotUtf8(#[source] std::str::Utf8Error),
    /// A scraped page is not valid Prometheus text exposition.
    #[error("cannot parse the answer: {0}")]
    Exposition(#[source] text::ParseError),
    /// The Prometheus API client could not be built for the URL.
    #[error("cannot build the Prometheus client: {0}")]
    Client(#[source] Arc<prometheus_http_query::Error>),
    /// The request took longer than the source's timeout.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The cached data is older than the staleness limit and no fresh read
    /// succeeded.
    #[error("data is {age_ms} ms old, limit {limit_ms} ms")]
    Stale {
        /// Age of the newest data.
        age_ms: u128,
        /// The limit.
        limit_ms: u128,
    },
    /// The fetch task ended without an answer (runtime shutting down).
    #[error("fetch was abandoned")]
    Abandoned,
}

impl SourceError {
    /// Wraps a transport error.
    pub fn transport(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Transport(Arc::new(e))
    }
}
