//! Where a request goes and what it carries: a queue's gateway [`Target`],
//! per-message endpoints that cannot leave the gateway origin, and the
//! headers of docs/architecture.md ("Headers sent to the gateway"), assembled into a [`PreparedRequest`].

use std::fmt;

use bytes::Bytes;
use reqwest::Url;
use reqwest::header::{
    AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, InvalidHeaderName,
    InvalidHeaderValue,
};

use crate::headers::{is_forbidden, is_secret};
use crate::request::Request;
use crate::result::ErrorCode;

use super::{FAIRNESS_HEADER, MAX_FAIRNESS_ID_LEN};

/// Longest `tracestate` forwarded (W3C: 32 members of at most 256 bytes).
const MAX_TRACESTATE_LEN: usize = 8192;

/// One queue's gateway: base URL, default request path and inference
/// objective. Validated once, when the queue is configured.
#[derive(Debug, Clone)]
pub struct Target {
    /// The parsed base; its origin is the only one requests may reach.
    base: Url,
    /// The base URL without a trailing `/`, so paths append to it as they
    /// do upstream (`igw_base_url + request_path_url`).
    prefix: String,
    /// URL for messages without an `endpoint`.
    default_url: Url,
    /// The objective as a header value, validated once per queue.
    objective: Option<HeaderValue>,
    /// vLLM `priority` for bodies that carry none (`engine_priority`).
    engine_priority: Option<i64>,
}

impl Target {
    /// Validates a queue's gateway settings: `igw_base_url` must be an
    /// http(s) URL with a host and no credentials, query or fragment;
    /// `request_path` follows the same rules as a message's relative
    /// endpoint; an empty objective counts as none.
    pub fn new(
        igw_base_url: &str,
        request_path: &str,
        inference_objective: Option<String>,
    ) -> Result<Self, TargetError> {
        let base = Url::parse(igw_base_url.trim())
            .map_err(|source| TargetError::InvalidBaseUrl { source })?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(TargetError::UnsupportedScheme {
                scheme: base.scheme().to_owned(),
            });
        }
        if base.host_str().is_none_or(str::is_empty) {
            return Err(TargetError::MissingHost);
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(TargetError::CredentialsInUrl);
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(TargetError::QueryOrFragment);
        }
        let prefix = base.as_str().trim_end_matches('/').to_owned();
        let objective = inference_objective
            .filter(|objective| !objective.is_empty())
            .map(HeaderValue::try_from)
            .transpose()
            .map_err(|source| TargetError::InvalidObjective { source })?;
        let mut target = Self {
            default_url: base.clone(),
            base,
            prefix,
            objective,
            engine_priority: None,
        };
        target.default_url = target
            .join_path(request_path)
            .map_err(|source| TargetError::InvalidPath { source })?;
        Ok(target)
    }

    /// The configured base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The URL used when a message has no `endpoint`.
    pub fn default_url(&self) -> &Url {
        &self.default_url
    }

    /// Writes `priority` into every request body that carries none (vLLM's
    /// `--scheduling-policy priority`: lower runs first).
    #[must_use]
    pub fn with_engine_priority(mut self, priority: Option<i64>) -> Self {
        self.engine_priority = priority;
        self
    }

    /// The queue's inference objective, if any.
    pub fn inference_objective(&self) -> Option<&str> {
        self.objective.as_ref().and_then(|v| v.to_str().ok())
    }

    /// Resolves a message's `endpoint` against this target. `None` or an
    /// empty string (as upstream) means the default path. A relative path
    /// must start with a single `/` and contain no `.`/`..` segments
    /// (also percent-encoded), backslashes, whitespace or control
    /// characters; it is appended to the base URL. An absolute URL must
    /// have the base's scheme, host and port and no credentials.
    pub fn resolve(&self, endpoint: Option<&str>) -> Result<Url, EndpointError> {
        match endpoint {
            None | Some("") => Ok(self.default_url.clone()),
            Some(path) if path.starts_with('/') => self.join_path(path),
            Some(absolute) => self.check_absolute(absolute),
        }
    }

    fn join_path(&self, path: &str) -> Result<Url, EndpointError> {
        if !path.starts_with('/') {
            return Err(EndpointError::NotAPath);
        }
        if path.starts_with("//") {
            return Err(EndpointError::SchemeRelative);
        }
        check_characters(path)?;
        check_segments(path)?;
        let url = Url::parse(&format!("{}{path}", self.prefix))
            .map_err(|source| EndpointError::Invalid { source })?;
        // Defence in depth: the checks above make this unreachable, but the
        // origin rule is the one that matters.
        self.check_origin(&url)?;
        Ok(url)
    }

    fn check_absolute(&self, endpoint: &str) -> Result<Url, EndpointError> {
        check_characters(endpoint)?;
        let url = Url::parse(endpoint).map_err(|source| match source {
            url::ParseError::RelativeUrlWithoutBase => EndpointError::NotAPath,
            source => EndpointError::Invalid { source },
        })?;
        self.check_origin(&url)?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(EndpointError::Credentials);
        }
        // The parser has already removed dot segments; check the text as
        // written, after the authority.
        let after_scheme = endpoint
            .split_once("://")
            .map_or(endpoint, |(_, rest)| rest);
        let path = after_scheme.find('/').map_or("", |at| &after_scheme[at..]);
        check_segments(path)?;
        Ok(url)
    }

    fn check_origin(&self, url: &Url) -> Result<(), EndpointError> {
        if url.origin() == self.base.origin() {
            Ok(())
        } else {
            Err(EndpointError::OffHost {
                expected: self.base.origin().ascii_serialization(),
            })
        }
    }
}

fn check_characters(text: &str) -> Result<(), EndpointError> {
    if text
        .chars()
        .any(|c| c.is_control() || c.is_whitespace() || c == '\\')
    {
        Err(EndpointError::IllegalCharacter)
    } else {
        Ok(())
    }
}

/// Rejects `.` and `..` path segments, literal or percent-encoded, in the
/// path part (before `?` or `#`).
fn check_segments(path_and_query: &str) -> Result<(), EndpointError> {
    let path = path_and_query
        .split(['?', '#'])
        .next()
        .unwrap_or(path_and_query);
    let dotted = path.split('/').any(|segment| {
        let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
        decoded == "." || decoded == ".."
    });
    if dotted {
        Err(EndpointError::DotSegment)
    } else {
        Ok(())
    }
}

/// Why a queue's gateway settings are unusable (a startup error).
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// `igw_base_url` does not parse.
    #[error("igw_base_url is not a valid URL")]
    InvalidBaseUrl {
        /// The parse error.
        #[source]
        source: url::ParseError,
    },
    /// `igw_base_url` is not http or https.
    #[error("igw_base_url must use http or https, not {scheme:?}")]
    UnsupportedScheme {
        /// The scheme found.
        scheme: String,
    },
    /// `igw_base_url` has no host.
    #[error("igw_base_url must name a host")]
    MissingHost,
    /// `igw_base_url` embeds credentials, which would end up in logs.
    #[error("igw_base_url must not carry credentials; configure the bearer token instead")]
    CredentialsInUrl,
    /// `igw_base_url` has a query or fragment, to which paths cannot be appended.
    #[error("igw_base_url must not have a query or fragment")]
    QueryOrFragment,
    /// `request_path_url` breaks the endpoint rules.
    #[error("request_path_url is not usable")]
    InvalidPath {
        /// The rule it breaks.
        #[source]
        source: EndpointError,
    },
    /// The inference objective cannot be sent as a header value.
    #[error("inference_objective is not a legal header value")]
    InvalidObjective {
        /// The header error.
        #[source]
        source: InvalidHeaderValue,
    },
}

/// Why a message's `endpoint` was refused.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// Neither a path starting with `/` nor an absolute URL.
    #[error("endpoint must be a path starting with '/' or an absolute URL on the gateway")]
    NotAPath,
    /// A `//host/...` reference would name another host.
    #[error("endpoint must not start with '//'")]
    SchemeRelative,
    /// Control characters, whitespace or backslashes.
    #[error("endpoint must not contain control characters, whitespace or backslashes")]
    IllegalCharacter,
    /// A `.` or `..` segment, literal or percent-encoded.
    #[error("endpoint must not contain '.' or '..' path segments")]
    DotSegment,
    /// An absolute URL on another scheme, host or port.
    #[error("endpoint must stay on the gateway origin {expected}")]
    OffHost {
        /// The gateway's origin (scheme, host, port).
        expected: String,
    },
    /// An absolute URL carrying credentials.
    #[error("endpoint must not carry credentials")]
    Credentials,
    /// The resulting URL does not parse.
    #[error("endpoint does not form a valid URL")]
    Invalid {
        /// The parse error.
        #[source]
        source: url::ParseError,
    },
}

/// Why a message cannot be sent as it is; becomes an `INVALID_REQUEST`
/// result. Messages never echo header values, which may be secrets.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The `endpoint` is refused.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// A per-message header name is not a legal HTTP header name.
    #[error("header name {name:?} is not legal")]
    InvalidHeaderName {
        /// The name as given, shortened for display.
        name: String,
        /// The header error.
        #[source]
        source: InvalidHeaderName,
    },
    /// A per-message header value is not legal (for example contains CR or LF).
    #[error("value of header {name} is not legal")]
    InvalidHeaderValue {
        /// The header name.
        name: String,
        /// The header error.
        #[source]
        source: InvalidHeaderValue,
    },
    /// A per-message header controls framing or routing, or replaces the
    /// configured credentials.
    #[error("header {name} may not be set by a message")]
    ForbiddenHeader {
        /// The header name.
        name: String,
    },
}

impl PrepareError {
    /// The result error code for this failure (`INVALID_REQUEST`).
    pub const fn error_code(&self) -> ErrorCode {
        ErrorCode::InvalidRequest
    }
}

/// A request ready to send: URL, headers and body. Built once per message
/// and reused across attempts.
#[derive(Clone)]
pub struct PreparedRequest {
    /// Where to POST.
    url: Url,
    /// All headers, in the precedence of docs/architecture.md ("Headers sent to the gateway").
    headers: HeaderMap,
    /// The payload exactly as the message carried it.
    body: Bytes,
}

impl PreparedRequest {
    /// The URL the request is posted to.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The headers sent.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body sent (the payload bytes, unchanged).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Sets header `name` to `value`, replacing the message's own: for
    /// headers the dispatcher decides at release (the merge policy's
    /// priority header), whose names the config checked
    /// ([`crate::headers::may_pass_through`]).
    pub fn set_header(&mut self, name: HeaderName, value: HeaderValue) {
        self.headers.insert(name, value);
    }
}

// Hand-written so a debug log shows the body's size, not a whole prompt;
// sensitive header values print as "Sensitive".
impl fmt::Debug for PreparedRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedRequest")
            .field("url", &self.url.as_str())
            .field("headers", &self.headers)
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

/// `payload` (a JSON object, as [`crate::request`] checked) with
/// `"priority": priority` added, unless it has a top-level `priority`
/// already: the submitter's choice for one request wins over the queue's
/// default. The rest of the bytes are kept as they are (no re-encoding),
/// so only the inserted member differs from what the producer wrote.
fn with_priority(payload: &str, priority: i64) -> Bytes {
    use serde::de::IgnoredAny;
    let members: std::collections::HashMap<String, IgnoredAny> = match serde_json::from_str(payload)
    {
        Ok(members) => members,
        // Not an object after all: send it as it came, like any payload.
        Err(_) => return Bytes::copy_from_slice(payload.as_bytes()),
    };
    if members.contains_key("priority") {
        return Bytes::copy_from_slice(payload.as_bytes());
    }
    let Some(open) = payload.find('{') else {
        return Bytes::copy_from_slice(payload.as_bytes());
    };
    let (head, rest) = payload.split_at(open + 1);
    let separator = if members.is_empty() { "" } else { "," };
    Bytes::from(format!("{head}\"priority\":{priority}{separator}{rest}"))
}

/// The client-wide header rules, fixed when the client is built.
#[derive(Debug)]
pub(super) struct HeaderRules {
    /// Name of the objective header.
    pub(super) objective_header: HeaderName,
    /// Metadata key of the fairness id, if any.
    pub(super) fairness_attribute: Option<String>,
    /// `Bearer <token>`, marked sensitive, when a token is configured.
    pub(super) authorization: Option<HeaderValue>,
}

impl HeaderRules {
    /// Builds the request for `request` to `target` (see
    /// [`super::GatewayClient::prepare`]).
    pub(super) fn prepare(
        &self,
        target: &Target,
        request: &Request,
    ) -> Result<PreparedRequest, PrepareError> {
        let url = target.resolve(request.endpoint.as_deref())?;
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(objective) = &target.objective {
            headers.insert(self.objective_header.clone(), objective.clone());
        }
        for (name, value) in &request.headers {
            let (name, value) = self.message_header(name, value)?;
            headers.insert(name, value);
        }
        if let Some(fairness) = self.fairness_id(request) {
            headers.insert(HeaderName::from_static(FAIRNESS_HEADER), fairness);
        }
        if let Some(traceparent) = request
            .metadata
            .get("traceparent")
            .filter(|v| is_valid_traceparent(v))
            .and_then(|v| HeaderValue::from_str(v).ok())
        {
            headers.insert(HeaderName::from_static("traceparent"), traceparent);
            if let Some(tracestate) = request
                .metadata
                .get("tracestate")
                .filter(|v| !v.is_empty() && v.len() <= MAX_TRACESTATE_LEN)
                .and_then(|v| HeaderValue::from_str(v).ok())
            {
                headers.insert(HeaderName::from_static("tracestate"), tracestate);
            }
        }
        if let Some(authorization) = &self.authorization {
            headers.insert(AUTHORIZATION, authorization.clone());
        }
        let payload = request.payload.get();
        let body = match target.engine_priority {
            Some(priority) => with_priority(payload, priority),
            None => Bytes::copy_from_slice(payload.as_bytes()),
        };
        Ok(PreparedRequest { url, headers, body })
    }

    fn message_header(
        &self,
        name: &str,
        value: &str,
    ) -> Result<(HeaderName, HeaderValue), PrepareError> {
        let parsed = HeaderName::from_bytes(name.as_bytes()).map_err(|source| {
            PrepareError::InvalidHeaderName {
                name: shorten(name),
                source,
            }
        })?;
        if is_forbidden(&parsed, self.authorization.is_some()) {
            return Err(PrepareError::ForbiddenHeader {
                name: parsed.as_str().to_owned(),
            });
        }
        let mut value =
            HeaderValue::from_str(value).map_err(|source| PrepareError::InvalidHeaderValue {
                name: parsed.as_str().to_owned(),
                source,
            })?;
        if is_secret(&parsed) {
            value.set_sensitive(true);
        }
        Ok((parsed, value))
    }

    fn fairness_id(&self, request: &Request) -> Option<HeaderValue> {
        let attribute = self.fairness_attribute.as_deref()?;
        let id = request.metadata.get(attribute)?;
        if id.is_empty() || id.len() > MAX_FAIRNESS_ID_LEN {
            tracing::debug!(request_id = %request.id, "fairness id skipped: empty or too long");
            return None;
        }
        let value = HeaderValue::from_str(id).ok();
        if value.is_none() {
            tracing::debug!(request_id = %request.id, "fairness id skipped: not a legal header value");
        }
        value
    }
}

/// W3C trace context: `version-traceid-parentid-flags`, lowercase hex,
/// ids not all zero, version not `ff`. An invalid value is not forwarded.
fn is_valid_traceparent(value: &str) -> bool {
    let is_hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let mut parts = value.split('-');
    let (Some(version), Some(trace_id), Some(parent_id), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    // Version 00 has exactly four fields; later versions may append more.
    let extra_ok = version != "00" || parts.next().is_none();
    is_hex(version, 2)
        && version != "ff"
        && is_hex(trace_id, 32)
        && trace_id.bytes().any(|b| b != b'0')
        && is_hex(parent_id, 16)
        && parent_id.bytes().any(|b| b != b'0')
        && is_hex(flags, 2)
        && extra_ok
}

/// A header name as given, cut to a readable length for error messages.
fn shorten(name: &str) -> String {
    const MAX: usize = 64;
    match name.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &name[..at]),
        None => name.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target::new("http://gw.local:8080", "/v1/completions", None).expect("valid target")
    }

    #[test]
    fn default_and_relative_endpoints() {
        let t = target();
        assert_eq!(
            t.resolve(None).expect("default").as_str(),
            "http://gw.local:8080/v1/completions"
        );
        assert_eq!(
            t.resolve(Some("")).expect("empty means default").as_str(),
            "http://gw.local:8080/v1/completions"
        );
        assert_eq!(
            t.resolve(Some("/v1/chat/completions?x=1"))
                .expect("on host")
                .as_str(),
            "http://gw.local:8080/v1/chat/completions?x=1"
        );
    }

    #[test]
    fn base_path_prefix_is_kept() {
        let t = Target::new("https://gw.local/api/", "/v1/completions", None).expect("valid");
        assert_eq!(
            t.default_url().as_str(),
            "https://gw.local/api/v1/completions"
        );
    }

    #[test]
    fn absolute_endpoint_on_the_same_origin_is_accepted() {
        let t = target();
        let url = t
            .resolve(Some("http://GW.local:8080/v1/x"))
            .expect("same origin");
        assert_eq!(url.as_str(), "http://gw.local:8080/v1/x");
        let default_port = Target::new("http://gw.local", "/v1/completions", None).expect("valid");
        assert!(
            default_port
                .resolve(Some("http://gw.local:80/v1/x"))
                .is_ok()
        );
    }

    #[test]
    fn endpoints_that_leave_the_gateway_are_refused() {
        let t = target();
        let refused = [
            "http://evil.com/v1/completions",
            "http://gw.local:9090/v1/completions",
            "https://gw.local:8080/v1/completions",
            "http://user:pw@gw.local:8080/v1",
            "//evil.com/x",
            "/../admin",
            "/v1/../../admin",
            "/v1/%2e%2e/admin",
            "/v1/%2E./admin",
            "/./v1",
            "http://gw.local:8080/v1/../admin",
            "/\\evil.com/x",
            "/v1\r\nHost: evil",
            "/v1 x",
            "v1/completions",
            "evil.com/x",
            "file:///etc/passwd",
            "javascript:alert(1)",
        ];
        for endpoint in refused {
            assert!(t.resolve(Some(endpoint)).is_err(), "{endpoint:?} accepted");
        }
    }

    #[test]
    fn bad_base_urls_are_startup_errors() {
        for base in [
            "gw:8080",
            "ftp://gw",
            "http://u:p@gw",
            "http://gw/?q=1",
            "not a url",
        ] {
            assert!(
                Target::new(base, "/v1/completions", None).is_err(),
                "{base}"
            );
        }
        assert!(matches!(
            Target::new("http://gw", "v1", None),
            Err(TargetError::InvalidPath { .. })
        ));
        assert!(matches!(
            Target::new("http://gw", "/v1", Some("a\nb".into())),
            Err(TargetError::InvalidObjective { .. })
        ));
        let t = Target::new("http://gw", "/v1", Some(String::new())).expect("empty objective");
        assert_eq!(t.inference_objective(), None);
    }

    #[test]
    fn traceparent_validation() {
        assert!(is_valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xx",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad}");
        }
    }

    #[test]
    fn forbidden_headers() {
        for name in [
            "host",
            "content-length",
            "transfer-encoding",
            "connection",
            "upgrade",
            "te",
            "trailer",
            "keep-alive",
            "proxy-authorization",
            "proxy-connection",
            "expect",
        ] {
            let parsed = HeaderName::from_bytes(name.as_bytes()).expect("legal name");
            assert!(is_forbidden(&parsed, false), "{name}");
        }
        assert!(is_forbidden(&AUTHORIZATION, true));
        assert!(!is_forbidden(&AUTHORIZATION, false));
        assert!(!is_forbidden(&CONTENT_TYPE, true));
    }

    fn json(bytes: &Bytes) -> serde_json::Value {
        serde_json::from_slice(bytes).expect("valid JSON")
    }

    #[test]
    fn engine_priority_is_added_to_a_body_without_one() {
        let body = with_priority(r#"{"model":"m","prompt":"hi"}"#, 5);
        assert_eq!(
            json(&body),
            serde_json::json!({"priority": 5, "model": "m", "prompt": "hi"})
        );
        assert_eq!(
            json(&with_priority(" { } ", -2)),
            serde_json::json!({"priority": -2})
        );
    }

    #[test]
    fn a_priority_the_request_carries_wins_over_the_queues() {
        let payload = r#"{"model":"m","priority":0}"#;
        assert_eq!(with_priority(payload, 5).as_ref(), payload.as_bytes());
        // Only a top-level member counts: a nested one is another field.
        let nested = with_priority(r#"{"extra":{"priority":1}}"#, 5);
        assert_eq!(json(&nested)["priority"], 5);
    }
}
