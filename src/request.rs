//! Request messages as submitters write them (REFERENCE.md §1), and their
//! parsing from the bytes a queue delivers.
//!
//! A message is either the Redis envelope `{"internal", "request_kind",
//! "data"}` or a bare request object. Parsing never panics and never drops a
//! message: anything unusable becomes a [`ParseFailure`] that still carries
//! the best id we could recover, so the dispatcher can write an
//! `INVALID_REQUEST` result for it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Longest request id we accept; ids are keys in Redis and labels in logs.
pub const MAX_ID_LEN: usize = 512;

/// One inference request, validated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// Correlation key for the result.
    pub id: String,
    /// Creation time in Unix seconds (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<i64>,
    /// Deadline in Unix seconds; orders the queue and bounds every attempt.
    #[serde(deserialize_with = "deadline_from_int_or_string")]
    pub deadline: i64,
    /// The inference request body, forwarded verbatim.
    pub payload: Box<RawValue>,
    /// Opaque pass-through attributes (tenant, trace context).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Extra headers for the gateway request.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Per-request path on the gateway; overrides the queue's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Model name, for labels only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl PartialEq for Request {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.created == other.created
            && self.deadline == other.deadline
            && self.payload.get() == other.payload.get()
            && self.metadata == other.metadata
            && self.headers == other.headers
            && self.endpoint == other.endpoint
            && self.model == other.model
    }
}

/// Routing facts the Redis envelope carries next to the request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Internal {
    /// How many times the message went back to the queue for another try.
    pub retry_count: u32,
    /// Queue the message was submitted to (informational).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_id: Option<String>,
    /// Random hex per submission; fences results and cancellation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
    /// Origin queue, used to route retries back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_queue_name: Option<String>,
    /// Result list requested by the producer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
    /// Labels such as `tier` or the quota `classification`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Time to live of the result record, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_ttl_seconds: Option<u64>,
    /// When the producer enqueued the message, Unix milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enqueued_at_ms: Option<i64>,
}

/// A parsed queue message: the request plus the envelope's routing facts
/// (defaults for a bare request).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The request itself.
    pub request: Request,
    /// Envelope routing facts.
    pub internal: Internal,
    /// `request_kind` of the envelope (`plain` for a bare request).
    pub kind: String,
}

impl Message {
    /// The submission token, if the producer set one.
    pub fn token(&self) -> Option<&str> {
        self.internal.request_token.as_deref()
    }

    /// Serialises the message as a Redis envelope.
    pub fn to_envelope_json(&self) -> String {
        let envelope = EnvelopeOut {
            internal: &self.internal,
            request_kind: &self.kind,
            data: &self.request,
        };
        // Serialising plain structs of strings, maps and a RawValue cannot fail.
        serde_json::to_string(&envelope).unwrap_or_default()
    }
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    internal: &'a Internal,
    request_kind: &'a str,
    data: &'a Request,
}

/// Why a message could not become a [`Message`]. Carries what was
/// recoverable so the failure can still be answered with a result.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid request: {reason}")]
pub struct ParseFailure {
    /// The request id, when one could be read.
    pub id: Option<String>,
    /// The submission token, when one could be read.
    pub token: Option<String>,
    /// Human-readable reason, safe to return to the submitter.
    pub reason: String,
}

/// Parses queue bytes (envelope or bare request) into a validated message.
pub fn parse_message(bytes: &[u8]) -> Result<Message, ParseFailure> {
    let text = std::str::from_utf8(bytes).map_err(|e| ParseFailure {
        id: None,
        token: None,
        reason: format!("message is not valid UTF-8: {e}"),
    })?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ParseFailure {
        id: None,
        token: None,
        reason: format!("message is not valid JSON: {e}"),
    })?;
    let Some(object) = value.as_object() else {
        return Err(ParseFailure {
            id: None,
            token: None,
            reason: "message is not a JSON object".into(),
        });
    };
    let is_envelope = object.contains_key("data")
        && (object.contains_key("internal") || object.contains_key("request_kind"));
    let (id, token) = recover_ids(&value, is_envelope);
    let fail = |reason: String| ParseFailure {
        id: id.clone(),
        token: token.clone(),
        reason,
    };
    let message = if is_envelope {
        let envelope: EnvelopeIn = serde_json::from_str(text).map_err(|e| fail(e.to_string()))?;
        Message {
            request: envelope.data,
            internal: envelope.internal,
            kind: envelope.request_kind.unwrap_or_else(|| "redis".into()),
        }
    } else {
        let request: Request = serde_json::from_str(text).map_err(|e| fail(e.to_string()))?;
        Message {
            request,
            internal: Internal::default(),
            kind: "plain".into(),
        }
    };
    validate(&message.request).map_err(fail)?;
    Ok(message)
}

#[derive(Deserialize)]
struct EnvelopeIn {
    #[serde(default)]
    internal: Internal,
    #[serde(default)]
    request_kind: Option<String>,
    data: Request,
}

/// Best-effort id and token from a message that may not parse, so even a
/// broken message gets a result its submitter can correlate.
fn recover_ids(value: &serde_json::Value, is_envelope: bool) -> (Option<String>, Option<String>) {
    let request = if is_envelope { &value["data"] } else { value };
    let id = request["id"]
        .as_str()
        .filter(|id| !id.is_empty() && id.len() <= MAX_ID_LEN)
        .map(str::to_owned);
    let token = value["internal"]["request_token"]
        .as_str()
        .map(str::to_owned);
    (id, token)
}

fn validate(request: &Request) -> Result<(), String> {
    if request.id.is_empty() {
        return Err("id must not be empty".into());
    }
    if request.id.len() > MAX_ID_LEN {
        return Err(format!("id is longer than {MAX_ID_LEN} bytes"));
    }
    if request.deadline <= 0 {
        return Err("deadline must be a positive Unix time in seconds".into());
    }
    if !request.payload.get().trim_start().starts_with('{') {
        return Err("payload must be a JSON object".into());
    }
    Ok(())
}

fn deadline_from_int_or_string<'de, D>(deserializer: D) -> Result<i64, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum IntOrString {
        Int(i64),
        Float(f64),
        Text(String),
    }
    match IntOrString::deserialize(deserializer)? {
        IntOrString::Int(v) => Ok(v),
        IntOrString::Float(v) if v.is_finite() && v.fract() == 0.0 => Ok(v as i64),
        IntOrString::Float(v) => Err(serde::de::Error::custom(format!(
            "deadline {v} is not a whole number of seconds"
        ))),
        IntOrString::Text(s) => s
            .trim()
            .parse::<i64>()
            .map_err(|_| serde::de::Error::custom(format!("deadline {s:?} is not an integer"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bare_request_with_string_deadline() {
        let m = parse_message(br#"{"id":"a","deadline":"1700000000","payload":{"model":"m"}}"#)
            .expect("valid");
        assert_eq!(m.request.id, "a");
        assert_eq!(m.request.deadline, 1_700_000_000);
        assert_eq!(m.request.payload.get(), r#"{"model":"m"}"#);
        assert_eq!(m.kind, "plain");
    }

    #[test]
    fn parses_envelope_and_keeps_token() {
        let m = parse_message(
            br#"{"internal":{"retry_count":2,"request_token":"ab12"},"request_kind":"redis","data":{"id":"x","deadline":5,"payload":{}}}"#,
        )
        .expect("valid");
        assert_eq!(m.internal.retry_count, 2);
        assert_eq!(m.token(), Some("ab12"));
        let again = parse_message(m.to_envelope_json().as_bytes()).expect("round trip");
        assert_eq!(again, m);
    }

    #[test]
    fn broken_message_keeps_recoverable_id() {
        let err = parse_message(br#"{"id":"k","deadline":"soon","payload":{}}"#)
            .expect_err("deadline is not a number");
        assert_eq!(err.id.as_deref(), Some("k"));
        assert!(err.reason.contains("deadline"), "{}", err.reason);
    }

    #[test]
    fn rejects_non_object_payload_and_bad_bytes() {
        assert!(parse_message(br#"{"id":"k","deadline":1,"payload":"text"}"#).is_err());
        assert!(parse_message(b"\xff\xfe").is_err());
        assert!(parse_message(b"[1,2]").is_err());
        assert!(parse_message(br#"{"id":"","deadline":1,"payload":{}}"#).is_err());
        assert!(parse_message(br#"{"id":"k","deadline":0,"payload":{}}"#).is_err());
    }
}
