//! PromQL instant queries over Prometheus' HTTP API
//! (`prometheus-http-query`, on the process' one reqwest/rustls stack).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use prometheus_http_query::response::Data;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use tokio::time::Instant;

use super::{Source, SourceError, Timestamped};

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

/// A Prometheus HTTP API client with its authentication and timeout.
#[derive(Clone)]
pub struct PromClient {
    client: prometheus_http_query::Client,
    /// Base URL with any password masked, for messages.
    shown_url: String,
    timeout: Duration,
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
            .map_err(|e| SourceError::Parse(e.to_string()))?;
        Ok(Self {
            client,
            shown_url: crate::config::mask_url(url),
            timeout,
        })
    }

    /// The base URL, password masked.
    pub fn url(&self) -> &str {
        &self.shown_url
    }

    /// A source that runs `query`.
    pub fn query(&self, query: impl Into<String>) -> PromQuery {
        PromQuery {
            client: self.clone(),
            query: Arc::from(query.into()),
        }
    }

    /// Runs one instant query.
    pub async fn instant(&self, query: &str) -> Result<Timestamped<PromVector>, SourceError> {
        let sent = Instant::now();
        let answer = tokio::time::timeout(self.timeout, self.client.query(query).get())
            .await
            .map_err(|_| SourceError::Timeout(self.timeout))?;
        let result = answer.map_err(|e| match e {
            prometheus_http_query::Error::Prometheus(p) => SourceError::Query(p.to_string()),
            other => SourceError::transport(other),
        })?;
        let samples = match result.into_inner().0 {
            Data::Vector(v) => v
                .into_iter()
                .map(|s| {
                    let (labels, sample) = s.into_inner();
                    PromSample {
                        labels: labels.into_iter().collect(),
                        value: sample.value(),
                    }
                })
                .collect(),
            Data::Scalar(s) => vec![PromSample {
                labels: BTreeMap::new(),
                value: s.value(),
            }],
            Data::Matrix(_) => {
                return Err(SourceError::Parse(
                    "a range vector; the query must return an instant vector or scalar".into(),
                ));
            }
        };
        // Prometheus evaluates at its own "now", which is when it got the
        // query; the result's timestamp says nothing about how old the
        // scraped samples are, and comparing clocks would only measure
        // clock skew. So the data is dated when the query was sent.
        Ok(Timestamped {
            value: samples,
            taken_at: sent,
        })
    }
}

/// A [`Source`] that runs one PromQL instant query.
#[derive(Debug, Clone)]
pub struct PromQuery {
    client: PromClient,
    query: Arc<str>,
}

impl PromQuery {
    /// The PromQL text.
    pub fn text(&self) -> &str {
        &self.query
    }
}

impl Source for PromQuery {
    type Output = PromVector;

    fn fetch(&self) -> BoxFuture<'_, Result<Timestamped<PromVector>, SourceError>> {
        Box::pin(self.client.instant(&self.query))
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
