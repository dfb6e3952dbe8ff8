//! Request messages as submitters write them (docs/architecture.md, "Request messages"), and their
//! parsing from the bytes a queue delivers.
//!
//! A message is either the Redis envelope `{"internal", "request_kind",
//! "data"}` or a bare request object. Parsing never panics and never drops a
//! message: anything unusable becomes a [`ParseFailure`] that still carries
//! the best id we could recover, so the dispatcher can write an
//! `INVALID_REQUEST` result for it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Longest request id we accept; ids are keys in Redis and labels in logs.
pub const MAX_ID_LEN: usize = 512;

/// Furthest a deadline may lie in the future: 10 years (of 365.25 days).
/// A later deadline (year 9999, a millisecond timestamp written as
/// seconds) is a producer bug, answered with `INVALID_REQUEST` rather than
/// silently clamped.
pub const MAX_DEADLINE_HORIZON: Duration = Duration::from_secs(315_576_000);

/// The envelope `request_kind`s upstream producers write; any other is
/// `INVALID_REQUEST`.
pub const REQUEST_KINDS: [&str; 3] = ["plain", "redis", "pubsub"];

/// Longest id written into a log line or an error message (longer ones
/// are cut and marked with `…`).
pub const LOG_ID_LEN: usize = 64;

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
    /// Result list some upstream producers set on the request itself;
    /// below the queue's and the envelope's (`docs/transports.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_queue_name: Option<String>,
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
            && self.result_queue_name == other.result_queue_name
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
    /// Attempts sent to the gateway so far, congested ones included
    /// (sluicegate addition; `retry_count` counts failures only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// The last HTTP answer of an earlier attempt (sluicegate addition), so
    /// a deadline that ends the message while it waits in the queue still
    /// answers with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_answer: Option<LastAnswer>,
}

/// An HTTP answer of the gateway, kept across requeues.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LastAnswer {
    /// HTTP status.
    pub status_code: u16,
    /// The body as the result would carry it.
    pub body: String,
}

/// What an attempt that went back to the queue learned, for the next
/// holder of the message (see `Queue::requeue_after_attempt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Attempts sent so far, this one included.
    pub attempts: u32,
    /// The latest HTTP answer seen, this attempt's or an earlier one's.
    pub last_answer: Option<LastAnswer>,
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

    /// Attempts sent before this delivery: the envelope's count, and never
    /// fewer than the transport's failure count (`retry_count`), which is
    /// all a message from an upstream dispatcher carries.
    pub fn previous_attempts(&self, retry_count: u32) -> u32 {
        self.internal
            .attempts
            .unwrap_or(0)
            .max(self.internal.retry_count)
            .max(retry_count)
    }

    /// The last HTTP answer an earlier attempt got, if any.
    pub fn last_answer(&self) -> Option<&LastAnswer> {
        self.internal.last_answer.as_ref()
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
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid request: {reason}")]
pub struct ParseFailure {
    /// The request id, when a usable one could be read.
    pub id: Option<String>,
    /// The id to file the `INVALID_REQUEST` result under: the request id
    /// when usable, else a stable printable synthetic one
    /// ([`synthetic_id`]), never longer than [`MAX_ID_LEN`] and never
    /// containing NUL.
    pub result_id: String,
    /// The submission token, when one could be read.
    pub token: Option<String>,
    /// Human-readable reason, safe to return to the submitter.
    pub reason: String,
    /// The decoding error the reason was made from, if there was one
    /// (its text is already part of `reason`).
    #[source]
    pub source: Option<DecodeError>,
}

impl ParseFailure {
    /// Whether no id at all could be read (not UTF-8, not JSON, not an
    /// object, no `id`): `result_id` is then a hash of the bytes, which
    /// equal bodies share. A transport that has its own id for the message
    /// names the result by that instead (`Delivery::source_id`).
    pub fn is_anonymous(&self) -> bool {
        self.id.is_none() && self.result_id.starts_with(ANONYMOUS_PREFIX)
    }
}

/// The result id of a message with no readable id whose transport has its
/// own id for it (`Delivery::source_id`, Pub/Sub's message id):
/// `invalid:<source id>`. Distinct messages get distinct results even when
/// their bodies are equal, and a redelivery of one message gets the same
/// id (readers dedupe it).
pub fn source_result_id(source_id: &str) -> String {
    format!("{ANONYMOUS_PREFIX}{source_id}")
}

/// Prefix of the result id of a message with no readable id; a message
/// whose id is unusable gets [`synthetic_id`] (`invalid-id-…`) instead.
const ANONYMOUS_PREFIX: &str = "invalid:";

/// The error underneath a [`ParseFailure`]: the bytes were not UTF-8 or
/// not the expected JSON. Shared, so the failure stays cheap to clone.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DecodeError {
    /// The message is not UTF-8.
    #[error(transparent)]
    Utf8(#[from] std::str::Utf8Error),
    /// The message is not JSON of the expected shape.
    #[error(transparent)]
    Json(Arc<serde_json::Error>),
}

impl From<serde_json::Error> for DecodeError {
    fn from(e: serde_json::Error) -> Self {
        Self::Json(Arc::new(e))
    }
}

/// Why a decoded request is unusable. Its text becomes
/// [`ParseFailure::reason`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Invalid {
    /// The id cannot be a result id (see [`id_problem`]).
    #[error("{0}")]
    Id(String),
    #[error("deadline must be a positive Unix time in seconds")]
    DeadlineNotPositive,
    #[error("deadline {0} is more than 10 years ahead (Unix seconds expected)")]
    DeadlineTooFar(i64),
    #[error("payload must be a JSON object")]
    PayloadNotObject,
}

/// Parses queue bytes (envelope or bare request) into a validated message.
pub fn parse_message(bytes: &[u8]) -> Result<Message, ParseFailure> {
    parse_message_at(bytes, crate::clock::unix_secs())
}

/// [`parse_message`] with the current Unix time supplied, for tests.
pub fn parse_message_at(bytes: &[u8], now_unix: i64) -> Result<Message, ParseFailure> {
    let anonymous = |reason: String, source: Option<DecodeError>| ParseFailure {
        id: None,
        result_id: format!("{ANONYMOUS_PREFIX}{:016x}", fnv1a(bytes)),
        token: None,
        reason,
        source,
    };
    let text = std::str::from_utf8(bytes)
        .map_err(|e| anonymous(format!("message is not valid UTF-8: {e}"), Some(e.into())))?;
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| anonymous(format!("message is not valid JSON: {e}"), Some(e.into())))?;
    let Some(object) = value.as_object() else {
        return Err(anonymous("message is not a JSON object".into(), None));
    };
    let is_envelope = object.contains_key("data")
        && (object.contains_key("internal") || object.contains_key("request_kind"));
    let (id, token) = recover_ids(&value, is_envelope);
    let result_id = match &id {
        RecoveredId::Usable(id) => id.clone(),
        RecoveredId::Unusable { synthetic, .. } => synthetic.clone(),
        RecoveredId::Missing => anonymous(String::new(), None).result_id,
    };
    let usable = match &id {
        RecoveredId::Usable(id) => Some(id.clone()),
        _ => None,
    };
    let fail = |reason: String, source: Option<DecodeError>| ParseFailure {
        id: usable.clone(),
        result_id: result_id.clone(),
        token: token.clone(),
        reason,
        source,
    };
    let decode = |e: serde_json::Error| fail(e.to_string(), Some(e.into()));
    // An unusable id is named first: it is why the result has another id.
    if let RecoveredId::Unusable { problem, .. } = &id {
        return Err(fail(problem.clone(), None));
    }
    let message = if is_envelope {
        let envelope: EnvelopeIn = serde_json::from_str(text).map_err(decode)?;
        Message {
            request: envelope.data,
            internal: envelope.internal,
            kind: envelope.request_kind.unwrap_or_else(|| "redis".into()),
        }
    } else {
        let request: Request = serde_json::from_str(text).map_err(decode)?;
        Message {
            request,
            internal: Internal::default(),
            kind: "plain".into(),
        }
    };
    if !REQUEST_KINDS.contains(&message.kind.as_str()) {
        return Err(fail(
            format!(
                "unknown request_kind {:?}; expected one of {}",
                log_id(&message.kind),
                REQUEST_KINDS.join(", ")
            ),
            None,
        ));
    }
    validate(&message.request, now_unix).map_err(|invalid| fail(invalid.to_string(), None))?;
    Ok(message)
}

/// A stable, printable stand-in for an id that cannot be used as one
/// (too long, or containing NUL): `invalid-id-<16 hex digits>`, a 64-bit
/// FNV-1a hash of the original bytes, so every redelivery gets the same id.
pub fn synthetic_id(original: &str) -> String {
    format!("invalid-id-{:016x}", fnv1a(original.as_bytes()))
}

/// An id as it may appear in a log line or an error message: at most
/// [`LOG_ID_LEN`] characters (cut ones end in `…`), control characters
/// (NUL, newlines) escaped.
pub fn log_id(id: &str) -> String {
    let mut out: String = id
        .chars()
        .take(LOG_ID_LEN)
        .flat_map(char::escape_debug)
        .collect();
    if id.chars().nth(LOG_ID_LEN).is_some() {
        out.push('…');
    }
    out
}

/// 64-bit FNV-1a: tiny, and stable across Rust releases (unlike the
/// standard library's hasher), which keeps synthetic ids stable.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

#[derive(Deserialize)]
struct EnvelopeIn {
    #[serde(default)]
    internal: Internal,
    #[serde(default)]
    request_kind: Option<String>,
    data: Request,
}

/// What could be read of a message's id.
enum RecoveredId {
    /// A string id fit for results and Redis keys.
    Usable(String),
    /// A string id that is not: its stand-in and why.
    Unusable { synthetic: String, problem: String },
    /// No string id at all.
    Missing,
}

/// Why `id` cannot be used as a result id and Redis key part, if it
/// cannot: empty, over [`MAX_ID_LEN`] bytes, or containing NUL (claim keys
/// are `id\0token`).
fn id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        Some("id must not be empty".into())
    } else if id.len() > MAX_ID_LEN {
        Some(format!(
            "id \"{}\" ({} bytes) is longer than {MAX_ID_LEN} bytes",
            log_id(id),
            id.len()
        ))
    } else if id.contains('\0') {
        Some(format!("id \"{}\" contains a NUL character", log_id(id)))
    } else {
        None
    }
}

/// Best-effort id and token from a message that may not parse, so even a
/// broken message gets a result its submitter can correlate.
fn recover_ids(value: &serde_json::Value, is_envelope: bool) -> (RecoveredId, Option<String>) {
    let request = if is_envelope { &value["data"] } else { value };
    let id = match request["id"].as_str() {
        None | Some("") => RecoveredId::Missing,
        Some(id) => match id_problem(id) {
            None => RecoveredId::Usable(id.to_owned()),
            Some(problem) => RecoveredId::Unusable {
                synthetic: synthetic_id(id),
                problem,
            },
        },
    };
    let token = value["internal"]["request_token"]
        .as_str()
        .map(str::to_owned);
    (id, token)
}

fn validate(request: &Request, now_unix: i64) -> Result<(), Invalid> {
    if let Some(problem) = id_problem(&request.id) {
        return Err(Invalid::Id(problem));
    }
    if request.deadline <= 0 {
        return Err(Invalid::DeadlineNotPositive);
    }
    let horizon = i64::try_from(MAX_DEADLINE_HORIZON.as_secs()).unwrap_or(i64::MAX);
    if request.deadline > now_unix.saturating_add(horizon) {
        return Err(Invalid::DeadlineTooFar(request.deadline));
    }
    if !request.payload.get().trim_start().starts_with('{') {
        return Err(Invalid::PayloadNotObject);
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
        // Whole seconds within i64 only: `as` would saturate, and the error
        // would then quote i64::MAX instead of what was sent.
        IntOrString::Float(v) if v.is_finite() && v.fract() == 0.0 && v.abs() < i64::MAX as f64 => {
            Ok(v as i64)
        }
        IntOrString::Float(v) if v.is_finite() && v.fract() == 0.0 => {
            Err(serde::de::Error::custom(format!(
                "deadline {v} is out of range (Unix seconds expected)"
            )))
        }
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

    const NOW: i64 = 1_700_000_000;

    #[test]
    fn unknown_request_kind_is_invalid() {
        let bytes = br#"{"internal":{},"request_kind":"sqs","data":{"id":"k","deadline":1700000100,"payload":{}}}"#;
        let err = parse_message_at(bytes, NOW).expect_err("unknown kind");
        assert!(err.reason.contains("request_kind"), "{}", err.reason);
        assert_eq!(err.result_id, "k");
        for kind in REQUEST_KINDS {
            let ok = format!(
                r#"{{"request_kind":"{kind}","data":{{"id":"k","deadline":1700000100,"payload":{{}}}}}}"#
            );
            assert!(parse_message_at(ok.as_bytes(), NOW).is_ok(), "{kind}");
        }
    }

    #[test]
    fn deadline_beyond_ten_years_is_invalid_not_clamped() {
        let year_9999 = br#"{"id":"k","deadline":253402300799,"payload":{}}"#;
        let err = parse_message_at(year_9999, NOW).expect_err("too far");
        assert!(err.reason.contains("10 years"), "{}", err.reason);
        let horizon = NOW + 315_576_000;
        let at = format!(r#"{{"id":"k","deadline":{horizon},"payload":{{}}}}"#);
        assert!(parse_message_at(at.as_bytes(), NOW).is_ok());
        let past = format!(r#"{{"id":"k","deadline":{},"payload":{{}}}}"#, horizon + 1);
        assert!(parse_message_at(past.as_bytes(), NOW).is_err());
    }

    #[test]
    fn a_deadline_beyond_i64_is_refused_quoting_the_value_sent() {
        // Issue 22: 1e30 was saturated to i64::MAX and the error quoted
        // 9223372036854775807.
        for (sent, quoted) in [
            ("1e30", "1000000000000000000000000000000"),
            ("100000000000000000000", "100000000000000000000"),
        ] {
            let bytes = format!(r#"{{"id":"k","deadline":{sent},"payload":{{}}}}"#);
            let err = parse_message_at(bytes.as_bytes(), NOW).expect_err("out of range");
            assert!(err.reason.contains(quoted), "{sent}: {}", err.reason);
            assert!(
                !err.reason.contains("9223372036854775807"),
                "{}",
                err.reason
            );
        }
    }

    #[test]
    fn unusable_ids_get_a_stable_printable_synthetic_id() {
        let long = "x".repeat(MAX_ID_LEN + 1);
        for id in [long.as_str(), r"a\u0000b"] {
            let bytes = format!(r#"{{"id":"{id}","deadline":1700000100,"payload":{{}}}}"#);
            let err = parse_message_at(bytes.as_bytes(), NOW).expect_err("unusable id");
            assert!(
                err.result_id.starts_with("invalid-id-"),
                "{}",
                err.result_id
            );
            assert!(!err.is_anonymous());
            assert!(err.result_id.len() <= MAX_ID_LEN);
            assert!(err.result_id.chars().all(|c| c.is_ascii_graphic()));
            assert_eq!(err.id, None);
            let again = parse_message_at(bytes.as_bytes(), NOW).expect_err("unusable id");
            assert_eq!(again.result_id, err.result_id);
            assert!(!err.reason.contains('\0'), "{:?}", err.reason);
            assert!(err.reason.len() < 200, "{}", err.reason);
        }
        let at_limit = "y".repeat(MAX_ID_LEN);
        let bytes = format!(r#"{{"id":"{at_limit}","deadline":1700000100,"payload":{{}}}}"#);
        assert!(parse_message_at(bytes.as_bytes(), NOW).is_ok());
    }

    #[test]
    fn messages_without_an_id_get_a_stable_result_id() {
        let a = parse_message(b"not json").expect_err("garbage");
        assert!(a.result_id.starts_with("invalid:"), "{}", a.result_id);
        assert!(a.is_anonymous());
        assert_eq!(source_result_id("123"), "invalid:123");
        assert_eq!(
            parse_message(b"not json").expect_err("garbage").result_id,
            a.result_id
        );
        assert_ne!(
            parse_message(b"not json!").expect_err("garbage").result_id,
            a.result_id
        );
    }

    #[test]
    fn log_ids_are_cut_and_escaped() {
        assert_eq!(log_id("abc"), "abc");
        assert_eq!(log_id("a\0b\n"), "a\\0b\\n");
        let cut = log_id(&"z".repeat(1000));
        assert!(cut.ends_with('…') && cut.chars().count() == LOG_ID_LEN + 1);
    }

    #[test]
    fn request_result_list_and_attempt_record_round_trip() {
        let m = parse_message_at(
            br#"{"internal":{"retry_count":1,"attempts":4,"last_answer":{"status_code":429,"body":"busy"}},"request_kind":"redis","data":{"id":"x","deadline":1700000100,"payload":{},"result_queue_name":"mine"}}"#,
            NOW,
        )
        .expect("valid");
        assert_eq!(m.request.result_queue_name.as_deref(), Some("mine"));
        assert_eq!(m.previous_attempts(0), 4);
        assert_eq!(m.previous_attempts(7), 7);
        assert_eq!(m.last_answer().map(|a| a.status_code), Some(429));
        let again = parse_message_at(m.to_envelope_json().as_bytes(), NOW).expect("round trip");
        assert_eq!(again, m);
    }
}
