//! The gateway client: a single bounded attempt per call, over one shared
//! connection pool per protocol: our HTTP/1.1 client for `http://`
//! gateways (`http1.rs`, a few KiB per request in flight instead of
//! hyper's ~30), and one `reqwest::Client` for `https://` gateways and
//! HTTP/2 with prior knowledge.

use std::error::Error as _;
use std::fmt;
use std::sync::Arc;

use reqwest::header::{
    HeaderMap, HeaderName, HeaderValue, InvalidHeaderName, InvalidHeaderValue, RETRY_AFTER,
};
use reqwest::redirect;
use tokio::time::Instant;

use crate::request::Request;

use super::classify::{AttemptFailure, AttemptOutcome, StatusClass, classify_status};
use super::http1::{Answer, Body, ExchangeError, Http1Client};
use super::target::HeaderRules;
use super::{DROPPED_REASON_HEADER, GatewaySettings, PrepareError, PreparedRequest, Target};
use crate::headers::is_forbidden;

/// Longest dropped reason kept from the endpoint picker's header.
const MAX_DROPPED_REASON_LEN: usize = 256;
/// How long an idle connection is kept for reuse (reqwest's default).
const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);
/// Sent as `User-Agent` unless the message sets its own.
const USER_AGENT: &str = concat!("sluicegate/", env!("CARGO_PKG_VERSION"));

/// Sees a success's body as it arrives, piece by piece, while the client
/// still builds the whole body for the result (the stream relay,
/// `crate::relay`). Called only for 2xx answers, with the bytes in order
/// and never more than the body limit.
pub trait BodyTap: Send {
    /// The next bytes of the body.
    fn bytes(&mut self, bytes: &[u8]);
}

/// No tap: what [`GatewayClient::send`] uses. Monomorphised away, so an
/// untapped attempt costs what it did before taps existed.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTap;

impl BodyTap for NoTap {
    #[inline(always)]
    fn bytes(&mut self, _: &[u8]) {}
}

/// Sends requests to the inference gateway. Cheap to clone: every clone
/// shares one connection pool.
#[derive(Clone)]
pub struct GatewayClient {
    /// Shared state; the pool lives inside the reqwest client.
    inner: Arc<Inner>,
}

struct Inner {
    /// The pool for plain `http://` gateways over HTTP/1.1; `None` with
    /// `http2_prior_knowledge`, which reqwest speaks.
    http1: Option<Http1Client>,
    /// The client for `https://` gateways and HTTP/2, with its own pool.
    http: reqwest::Client,
    /// Per-attempt ceiling (also cut at the deadline).
    attempt_timeout: std::time::Duration,
    /// Largest body read.
    max_response_bytes: usize,
    /// Header rules fixed at build time, including the bearer token.
    rules: HeaderRules,
}

// Hand-written: the header rules hold the bearer token.
impl fmt::Debug for GatewayClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewayClient")
            .field("attempt_timeout", &self.inner.attempt_timeout)
            .field("max_response_bytes", &self.inner.max_response_bytes)
            .field("objective_header", &self.inner.rules.objective_header)
            .field("fairness_attribute", &self.inner.rules.fairness_attribute)
            .finish_non_exhaustive()
    }
}

/// Why the gateway client cannot be built (a startup error). Messages
/// never contain the bearer token.
#[derive(Debug, thiserror::Error)]
pub enum GatewayBuildError {
    /// `attempt_timeout` is zero, so no attempt could ever complete.
    #[error("gateway attempt_timeout must be greater than zero")]
    ZeroAttemptTimeout,
    /// `max_response_bytes` is zero, so no answer could be read.
    #[error("gateway max_response_bytes must be greater than zero")]
    ZeroResponseLimit,
    /// The objective header name is not a legal header name.
    #[error("objective header {name:?} is not a legal header name")]
    InvalidObjectiveHeader {
        /// The configured name.
        name: String,
        /// The header error.
        #[source]
        source: InvalidHeaderName,
    },
    /// The objective header name is one that controls framing or routing.
    #[error("objective header {name:?} is reserved")]
    ReservedObjectiveHeader {
        /// The configured name.
        name: String,
    },
    /// The bearer token cannot be sent as a header value.
    #[error("gateway bearer token is not a legal header value")]
    InvalidBearerToken {
        /// The header error (does not contain the token).
        #[source]
        source: InvalidHeaderValue,
    },
    /// reqwest could not build the client (for example no TLS roots).
    #[error("could not build the gateway HTTP client")]
    Client {
        /// The reqwest error.
        #[source]
        source: reqwest::Error,
    },
}

impl GatewayClient {
    /// The metadata attribute naming the tenant (`[gateway]
    /// fairness_attribute`), also what the dispatcher shares the window by.
    pub fn fairness_attribute(&self) -> Option<&str> {
        self.inner.rules.fairness_attribute.as_deref()
    }

    /// Builds the client and its connection pool. Redirects are never
    /// followed (a 3xx is a final answer), so no request leaves the host.
    pub fn new(settings: GatewaySettings) -> Result<Self, GatewayBuildError> {
        if settings.attempt_timeout.is_zero() {
            return Err(GatewayBuildError::ZeroAttemptTimeout);
        }
        if settings.max_response_bytes == 0 {
            return Err(GatewayBuildError::ZeroResponseLimit);
        }
        let objective_header = HeaderName::from_bytes(settings.objective_header.trim().as_bytes())
            .map_err(|source| GatewayBuildError::InvalidObjectiveHeader {
                name: settings.objective_header.clone(),
                source,
            })?;
        if is_forbidden(&objective_header, true) {
            return Err(GatewayBuildError::ReservedObjectiveHeader {
                name: settings.objective_header,
            });
        }
        let authorization = settings
            .bearer_token
            .as_deref()
            .map(|token| {
                HeaderValue::from_str(&format!("Bearer {token}")).map(|mut value| {
                    value.set_sensitive(true);
                    value
                })
            })
            .transpose()
            .map_err(|source| GatewayBuildError::InvalidBearerToken { source })?;
        let mut http = reqwest::Client::builder()
            .pool_max_idle_per_host(settings.max_idle_per_host)
            .connect_timeout(settings.connect_timeout)
            .tcp_nodelay(true)
            .pool_idle_timeout(IDLE_TIMEOUT)
            .redirect(redirect::Policy::none())
            .user_agent(USER_AGENT);
        if settings.http2_prior_knowledge {
            http = http.http2_prior_knowledge();
        }
        let http = http
            .build()
            .map_err(|source| GatewayBuildError::Client { source })?;
        let http1 = (!settings.http2_prior_knowledge).then(|| {
            Http1Client::new(
                settings.max_idle_per_host,
                IDLE_TIMEOUT,
                settings.connect_timeout,
                USER_AGENT,
            )
        });
        Ok(Self {
            inner: Arc::new(Inner {
                http1,
                http,
                attempt_timeout: settings.attempt_timeout,
                max_response_bytes: settings.max_response_bytes,
                rules: HeaderRules {
                    objective_header,
                    fairness_attribute: settings.fairness_attribute,
                    authorization,
                },
            }),
        })
    }

    /// Resolves the URL and builds the headers and body for `request` sent
    /// to `target`.
    ///
    /// The message's `endpoint` overrides the target's path: a relative
    /// path must start with a single `/` and may not contain `.`/`..`
    /// segments, backslashes, whitespace or control characters; an
    /// absolute URL must have the base's scheme, host and port. Headers
    /// follow docs/architecture.md ("Headers sent to the gateway"), later wins: `Content-Type:
    /// application/json`; the objective header when the target has an
    /// objective; the message's `headers` (illegal names or values,
    /// framing and hop-by-hop headers, `proxy-*`, and `Authorization` when
    /// a bearer token is configured are errors); the fairness id from
    /// `metadata[fairness_attribute]` (skipped when empty, over 256 bytes
    /// or not a legal value); `traceparent` (skipped unless valid W3C) and
    /// `tracestate` from metadata; finally the bearer token. The body is
    /// the payload's bytes, unchanged.
    ///
    /// Errors become `INVALID_REQUEST` results.
    pub fn prepare(
        &self,
        target: &Target,
        request: &Request,
    ) -> Result<PreparedRequest, PrepareError> {
        self.inner.rules.prepare(target, request)
    }

    /// Makes one attempt, bounded by `min(attempt_timeout, deadline − now)`
    /// for connect, send and the whole body. A deadline already passed
    /// returns [`AttemptOutcome::DeadlineExceeded`] without sending; a
    /// deadline reached during the attempt abandons it with the same
    /// outcome, while the attempt timeout alone gives a retryable
    /// [`AttemptFailure::Timeout`].
    pub async fn send(&self, request: &PreparedRequest, deadline: Instant) -> AttemptOutcome {
        self.send_tapped(request, deadline, &mut NoTap).await
    }

    /// [`Self::send`], handing a success's body to `tap` as it arrives
    /// (a streamed answer reaches its relay before the engine finishes).
    pub async fn send_tapped<T: BodyTap>(
        &self,
        request: &PreparedRequest,
        deadline: Instant,
        tap: &mut T,
    ) -> AttemptOutcome {
        let now = Instant::now();
        if now >= deadline {
            return AttemptOutcome::DeadlineExceeded;
        }
        let attempt_end = now
            .checked_add(self.inner.attempt_timeout)
            .map_or(deadline, |end| end.min(deadline));
        match tokio::time::timeout_at(attempt_end, self.attempt(request, tap)).await {
            Ok(outcome) => outcome,
            Err(_) if attempt_end >= deadline => AttemptOutcome::DeadlineExceeded,
            Err(_) => AttemptOutcome::Retryable {
                failure: AttemptFailure::Timeout,
                retry_after: None,
            },
        }
    }

    async fn attempt<T: BodyTap>(&self, request: &PreparedRequest, tap: &mut T) -> AttemptOutcome {
        let limit = self.inner.max_response_bytes;
        let plain = request.url().scheme() == "http";
        let answer = match self.inner.http1.as_ref().filter(|_| plain) {
            Some(http1) => {
                let posted = http1
                    .post(request.url(), request.headers(), request.body(), limit, tap)
                    .await;
                match posted {
                    Ok(answer) => answer,
                    Err(error) => return exchange_outcome(error),
                }
            }
            None => match self.attempt_with_reqwest(request, tap).await {
                Ok(answer) => answer,
                Err(outcome) => return outcome,
            },
        };
        outcome_of(answer, limit)
    }

    async fn attempt_with_reqwest<T: BodyTap>(
        &self,
        request: &PreparedRequest,
        tap: &mut T,
    ) -> Result<Answer, AttemptOutcome> {
        let sent = self
            .inner
            .http
            .post(request.url().clone())
            .headers(request.headers().clone())
            .body(request.body().clone())
            .send()
            .await;
        let mut response = sent.map_err(transport_outcome)?;
        let status = response.status().as_u16();
        let headers = std::mem::take(response.headers_mut());
        let body = read_body(&mut response, self.inner.max_response_bytes, tap).await;
        Ok(Answer {
            status,
            headers,
            body,
        })
    }
}

/// What one answer means for the dispatch loop.
fn outcome_of(answer: Answer, limit: usize) -> AttemptOutcome {
    let Answer {
        status,
        headers,
        body,
    } = answer;
    match classify_status(status) {
        StatusClass::Success => match body {
            Body::Complete(bytes) => AttemptOutcome::Success {
                status,
                body: lossy(bytes),
            },
            Body::TooLarge(_) => AttemptOutcome::Failed {
                failure: AttemptFailure::BodyTooLarge { limit },
            },
            Body::Broken(_, error) => AttemptOutcome::Retryable {
                failure: AttemptFailure::Body(error),
                retry_after: None,
            },
        },
        // For answers that are not a success the status decides; a broken
        // or oversized body keeps what was read.
        StatusClass::Final => AttemptOutcome::Final {
            status,
            body: lossy(body.into_bytes()),
        },
        StatusClass::Congested => AttemptOutcome::Congested {
            status,
            body: lossy(body.into_bytes()),
            retry_after: retry_after(&headers),
            dropped_reason: dropped_reason(&headers),
        },
        StatusClass::Retryable => AttemptOutcome::Retryable {
            failure: AttemptFailure::Http {
                status,
                body: lossy(body.into_bytes()),
            },
            retry_after: retry_after(&headers),
        },
    }
}

/// An exchange of the HTTP/1.1 client that produced no answer.
fn exchange_outcome(error: ExchangeError) -> AttemptOutcome {
    let failure = match error {
        ExchangeError::Connect(reason) => AttemptFailure::Connect(reason),
        ExchangeError::Reset(reason) => AttemptFailure::Reset(reason),
        ExchangeError::Request(reason) => {
            return AttemptOutcome::Failed {
                failure: AttemptFailure::Request(reason),
            };
        }
    };
    AttemptOutcome::Retryable {
        failure,
        retry_after: None,
    }
}

/// Reads the body chunk by chunk, never holding more than `limit` bytes.
async fn read_body<T: BodyTap>(
    response: &mut reqwest::Response,
    limit: usize,
    tap: &mut T,
) -> Body {
    let tapped = response.status().is_success();
    let declared = response
        .content_length()
        .and_then(|len| usize::try_from(len).ok());
    if declared.is_some_and(|len| len > limit) && response.status().is_success() {
        // A success this large is refused whole; no need to read it.
        return Body::TooLarge(Vec::new());
    }
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - bytes.len();
                if chunk.len() > room {
                    bytes.extend_from_slice(&chunk[..room]);
                    return Body::TooLarge(bytes);
                }
                if tapped {
                    tap.bytes(&chunk);
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => return Body::Complete(bytes),
            Err(error) => return Body::Broken(bytes, render(&error)),
        }
    }
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes)
        .unwrap_or_else(|invalid| String::from_utf8_lossy(invalid.as_bytes()).into_owned())
}

fn retry_after(headers: &HeaderMap) -> Option<std::time::Duration> {
    headers
        .get(RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(super::parse_retry_after)
}

fn dropped_reason(headers: &HeaderMap) -> Option<String> {
    let reason = headers.get(DROPPED_REASON_HEADER)?.to_str().ok()?.trim();
    if reason.is_empty() {
        return None;
    }
    let cut = reason
        .char_indices()
        .nth(MAX_DROPPED_REASON_LEN)
        .map_or(reason.len(), |(at, _)| at);
    Some(reason[..cut].to_owned())
}

/// Classifies an error from sending the request, by reqwest's own
/// classification methods rather than by its text.
fn transport_outcome(error: reqwest::Error) -> AttemptOutcome {
    let error = error.without_url();
    let failure = if error.is_builder() {
        return AttemptOutcome::Failed {
            failure: AttemptFailure::Request(render(&error)),
        };
    } else if error.is_connect() {
        AttemptFailure::Connect(render(&error))
    } else if error.is_timeout() {
        AttemptFailure::Timeout
    } else {
        AttemptFailure::Reset(render(&error))
    };
    AttemptOutcome::Retryable {
        failure,
        retry_after: None,
    }
}

/// The error and its sources as one line, skipping repeated messages.
fn render(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut last = text.clone();
    let mut source = error.source();
    while let Some(cause) = source {
        let message = cause.to_string();
        if message != last && !last.ends_with(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        last = message;
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn refuses_unusable_settings() {
        let base = GatewaySettings::default();
        assert!(matches!(
            GatewayClient::new(GatewaySettings {
                attempt_timeout: Duration::ZERO,
                ..base.clone()
            }),
            Err(GatewayBuildError::ZeroAttemptTimeout)
        ));
        assert!(matches!(
            GatewayClient::new(GatewaySettings {
                max_response_bytes: 0,
                ..base.clone()
            }),
            Err(GatewayBuildError::ZeroResponseLimit)
        ));
        assert!(matches!(
            GatewayClient::new(GatewaySettings {
                objective_header: "bad header".into(),
                ..base.clone()
            }),
            Err(GatewayBuildError::InvalidObjectiveHeader { .. })
        ));
        assert!(matches!(
            GatewayClient::new(GatewaySettings {
                objective_header: "Host".into(),
                ..base.clone()
            }),
            Err(GatewayBuildError::ReservedObjectiveHeader { .. })
        ));
        let bad_token = GatewayClient::new(GatewaySettings {
            bearer_token: Some("tok\nen-secret".into()),
            ..base
        });
        match bad_token {
            Err(error @ GatewayBuildError::InvalidBearerToken { .. }) => {
                assert!(!error.to_string().contains("secret"));
            }
            other => panic!("expected InvalidBearerToken, got {other:?}"),
        }
    }

    #[test]
    fn client_debug_hides_the_token() {
        let client = GatewayClient::new(GatewaySettings {
            bearer_token: Some("s3cr3t".into()),
            ..GatewaySettings::default()
        })
        .expect("valid settings");
        assert!(!format!("{client:?}").contains("s3cr3t"));
    }

    #[test]
    fn lossy_decoding_keeps_valid_text_and_replaces_bad_bytes() {
        assert_eq!(lossy(b"ok".to_vec()), "ok");
        assert_eq!(lossy(vec![b'a', 0xff, b'b']), "a\u{fffd}b");
    }
}
