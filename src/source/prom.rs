//! PromQL instant queries over Prometheus' HTTP API
//! (`prometheus-http-query`, on the process' one reqwest/rustls stack).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use prometheus_http_query::response::Data;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use serde::Serialize;
use tokio::time::Instant;

use super::{MetricsEndpoint, Source, SourceError, Timestamped};
use crate::secret::{EndpointUrl, Secret};

/// One series of an instant vector.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    /// The series' labels (including `__name__` when Prometheus keeps it).
    pub labels: BTreeMap<String, String>,
    /// Its value at the evaluation time.
    pub value: f64,
}

/// The result of an instant query: every series (a scalar result is one
/// series without labels).
pub type PromVector = Vec<PromSample>;

/// `[prometheus]`: where `prometheus-*` gates send PromQL. `url` is
/// required when the section is present; the default is only a
/// placeholder. (Its keys, defaults and checks are declared in `config/`,
/// which assembles the sections; the type is the source's own.)
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrometheusConfig {
    /// Base URL of the Prometheus HTTP API.
    pub url: EndpointUrl,
    /// Bearer token (inline, or read from `bearer_token_file` at load).
    pub bearer_token: Option<Secret>,
    /// File the bearer token was read from.
    pub bearer_token_file: Option<PathBuf>,
    /// Basic-auth user.
    pub basic_user: Option<String>,
    /// Basic-auth password (inline, or read from `basic_password_file` at load).
    pub basic_password: Option<Secret>,
    /// File the basic-auth password was read from.
    pub basic_password_file: Option<PathBuf>,
}

/// A Prometheus HTTP API client with its authentication and timeout.
#[derive(Clone)]
pub struct PromClient {
    backend: Backend,
    /// Base URL with any password masked, for messages.
    shown_url: String,
    timeout: Duration,
}

/// Who answers the queries.
#[derive(Clone)]
enum Backend {
    /// Prometheus' HTTP API.
    Http(prometheus_http_query::Client),
    /// An in-process endpoint (`sluicegate eval`).
    InProcess(Arc<dyn MetricsEndpoint>),
}

impl std::fmt::Debug for PromClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromClient")
            .field("url", &self.shown_url)
            .finish_non_exhaustive()
    }
}

/// How to authenticate to Prometheus.
#[derive(Debug, Clone, Default)]
pub enum PromAuth {
    /// No credentials.
    #[default]
    None,
    /// `Authorization: Bearer <token>`.
    Bearer(String),
    /// HTTP basic auth.
    Basic {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
}

impl PromClient {
    /// A client for the API at `url` (http or https; TLS through rustls).
    pub fn new(url: &url::Url, auth: &PromAuth, timeout: Duration) -> Result<Self, SourceError> {
        let mut headers = HeaderMap::new();
        let value = match auth {
            PromAuth::None => None,
            PromAuth::Bearer(token) => Some(format!("Bearer {token}")),
            PromAuth::Basic { user, password } => Some(format!(
                "Basic {}",
                base64(format!("{user}:{password}").as_bytes())
            )),
        };
        if let Some(value) = value {
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| SourceError::Parse("credentials are not a valid header".into()))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(SourceError::transport)?;
        let client = prometheus_http_query::Client::from(http, url.as_str())
            .map_err(|e| SourceError::Client(Arc::new(e)))?;
        Ok(Self {
            backend: Backend::Http(client),
            shown_url: crate::secret::mask_url(url),
            timeout,
        })
    }

    /// A client whose queries an in-process endpoint answers
    /// (`sluicegate eval`: the simulated pool's Prometheus view).
    pub fn in_process(endpoint: Arc<dyn MetricsEndpoint>) -> Self {
        Self {
            backend: Backend::InProcess(endpoint),
            shown_url: "in-process".to_owned(),
            timeout: Duration::ZERO,
        }
    }

    /// The base URL, password masked.
    pub fn url(&self) -> &str {
        &self.shown_url
    }

    /// A source that runs `query`, dated when the query is sent: Prometheus
    /// cannot tell the age of the samples behind an arbitrary expression.
    /// Gates that read such a source must treat it as blind to their own
    /// load (see [`PromQuery::is_dated_by_scrape`]).
    pub fn query(&self, query: impl Into<String>) -> PromQuery {
        PromQuery {
            client: self.clone(),
            query: Arc::from(query.into()),
            freshness: None,
            dating: Arc::new(Mutex::new(None)),
        }
    }

    /// A source that runs `query` and dates its answer by the scrape time
    /// of the oldest sample `selector` (a plain series selector such as
    /// `vllm:num_requests_running{inference_pool="p"}`) matches, read with
    /// `min(timestamp(selector))` in the same round trip.
    ///
    /// Why: an instant query is evaluated at Prometheus' "now", so its
    /// result says nothing about how old the scraped data is. With a 15 s
    /// scrape and a 1 s poll, dating by the query would make every poll a
    /// "fresh" observation that releases another `N` on top of work the
    /// metrics do not show yet.
    pub fn dated_query(&self, query: impl Into<String>, selector: &str) -> PromQuery {
        PromQuery {
            freshness: Some(Arc::from(format!("min(timestamp({selector}))"))),
            ..self.query(query)
        }
    }

    /// Runs one instant query, dated when it was sent.
    pub async fn instant(&self, query: &str) -> Result<Timestamped<PromVector>, SourceError> {
        let (samples, sent, _) = self.evaluate(query).await?;
        Ok(Timestamped {
            value: samples,
            taken_at: sent,
        })
    }

    /// Runs one instant query: its samples, when it was sent, and
    /// Prometheus' evaluation time (Unix seconds, Prometheus' clock) when
    /// the answer carries one.
    async fn evaluate(
        &self,
        query: &str,
    ) -> Result<(PromVector, Instant, Option<f64>), SourceError> {
        let sent = Instant::now();
        let client = match &self.backend {
            Backend::Http(client) => client,
            Backend::InProcess(endpoint) => {
                let answer = endpoint.query(query)?;
                return Ok((answer.samples, sent, Some(answer.evaluated_at)));
            }
        };
        let answer = tokio::time::timeout(self.timeout, client.query(query).get())
            .await
            .map_err(|_| SourceError::Timeout(self.timeout))?;
        let result = answer.map_err(|e| match e {
            prometheus_http_query::Error::Prometheus(p) => SourceError::Query(p.to_string()),
            other => SourceError::transport(other),
        })?;
        let mut evaluated_at = None;
        let samples = match result.into_inner().0 {
            Data::Vector(v) => v
                .into_iter()
                .map(|s| {
                    let (labels, sample) = s.into_inner();
                    evaluated_at = Some(sample.timestamp());
                    PromSample {
                        labels: labels.into_iter().collect(),
                        value: sample.value(),
                    }
                })
                .collect(),
            Data::Scalar(s) => {
                evaluated_at = Some(s.timestamp());
                vec![PromSample {
                    labels: BTreeMap::new(),
                    value: s.value(),
                }]
            }
            Data::Matrix(_) => {
                return Err(SourceError::Parse(
                    "a range vector; the query must return an instant vector or scalar".into(),
                ));
            }
        };
        Ok((samples, sent, evaluated_at))
    }
}

/// A [`Source`] that runs one PromQL instant query.
#[derive(Debug, Clone)]
pub struct PromQuery {
    client: PromClient,
    query: Arc<str>,
    /// `min(timestamp(selector))`, when the data can be dated by scrape.
    freshness: Option<Arc<str>>,
    /// The newest scrape time seen (Prometheus' Unix seconds) and the local
    /// instant it was mapped to, so re-reading the same scrape gives the
    /// very same `taken_at` (and so releases nothing new).
    dating: Arc<Mutex<Option<(f64, Instant)>>>,
}

impl PromQuery {
    /// The PromQL text.
    pub fn text(&self) -> &str {
        &self.query
    }

    /// Whether answers are dated by the scrape time of their samples (true)
    /// or by when the query was sent (false).
    pub fn is_dated_by_scrape(&self) -> bool {
        self.freshness.is_some()
    }

    async fn fetch_dated(&self, freshness: &str) -> Result<Timestamped<PromVector>, SourceError> {
        let (main, dates) = futures_util::future::join(
            self.client.evaluate(&self.query),
            self.client.evaluate(freshness),
        )
        .await;
        let (samples, sent, _) = main?;
        let (dates, _, evaluated_at) = dates?;
        let scraped_at = dates.first().map(|s| s.value).filter(|v| v.is_finite());
        let taken_at = match (scraped_at, evaluated_at) {
            (Some(scraped_at), Some(evaluated_at)) => {
                self.local_instant(scraped_at, evaluated_at, sent)
            }
            // No series behind the query: nothing to date, and gates read
            // an empty answer as "absent" whatever its time.
            _ => sent,
        };
        Ok(Timestamped {
            value: samples,
            taken_at,
        })
    }

    /// Maps a scrape time to a local instant. The age is measured on
    /// Prometheus' own clock (evaluation time − scrape time), so clock skew
    /// between hosts does not matter; it is subtracted from when the query
    /// was sent, which makes the data look slightly older than it is (the
    /// safe side: more of our sends count against its `N`).
    fn local_instant(&self, scraped_at: f64, evaluated_at: f64, sent: Instant) -> Instant {
        let age = Duration::try_from_secs_f64((evaluated_at - scraped_at).max(0.0))
            .unwrap_or(Duration::MAX);
        let estimate = sent.checked_sub(age).unwrap_or(sent);
        let mut dating = self.dating.lock().unwrap_or_else(|p| p.into_inner());
        let taken_at = match *dating {
            Some((seen, at)) if scraped_at == seen => at,
            // A newer scrape must not map to an earlier instant than the
            // one before it (network jitter), or it would read as not newer.
            Some((seen, at)) if scraped_at > seen => estimate.max(at + Duration::from_millis(1)),
            Some(_) | None => estimate,
        };
        if dating.is_none_or(|(seen, _)| scraped_at >= seen) {
            *dating = Some((scraped_at, taken_at));
        }
        taken_at
    }
}

impl Source for PromQuery {
    type Output = PromVector;

    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<PromVector>, SourceError>> {
        match &self.freshness {
            Some(freshness) => Box::pin(self.fetch_dated(freshness)),
            None => Box::pin(self.client.instant(&self.query)),
        }
    }

    fn describe(&self) -> String {
        format!("{} at {}", self.query, self.client.url())
    }
}

/// Standard base64 with padding (basic auth only; not worth a crate).
fn base64(input: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(TABLE[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), coded);
        }
    }
}
