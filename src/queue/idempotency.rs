//! Idempotent submit (llm-d-async's proposal "idempotent producer submit
//! and lookup"): a caller-supplied key recorded with the requests it
//! enqueued, so a producer that lost the answer to a submit can repeat it
//! (the same key and the same requests: nothing is enqueued twice) or ask
//! what was accepted ([`crate::queue::Client::lookup`]).
//!
//! A submission's identity is the SHA-256 of the canonical JSON of its
//! requests in order (each one's id, payload, metadata,
//! headers and endpoint, object keys sorted) and its resolved request and
//! result routes; never the generated request token or timestamps, so a
//! caller can compute it before submitting. This file holds what every
//! transport shares: the record, the identity, the key's rules and the
//! comparison of a found record; each transport writes the record in the
//! same transaction as the requests.

use std::time::Duration;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::client::{ClientError, Outgoing, SubmissionRecord, Submitted, SubmittedRequest};
use crate::request::{Message, parse_message};

/// Longest idempotency key accepted: keys become Redis keys and table
/// rows, and OpenAI documents no longer ones.
pub const MAX_KEY_LEN: usize = 256;

/// A submission ready for a transport to write: its parsed messages, and
/// the record to write with them (tokens as the messages carry them; the
/// Redis producer sets its own).
#[derive(Debug)]
pub(crate) struct Prepared {
    /// The messages, in order.
    pub(crate) messages: Vec<Message>,
    /// The record to write when the key is new.
    pub(crate) record: SubmissionRecord,
}

/// Checks `key`, parses `requests` and computes their identity under the
/// routes. `keep` is how long the record outlives the last deadline (at
/// least the time results are kept).
pub(crate) fn prepare(
    key: &str,
    requests: &[Outgoing],
    request_route: &str,
    result_route: &str,
    keep: Duration,
) -> Result<Prepared, ClientError> {
    check_key(key)?;
    let messages = parse_all(requests)?;
    let last_deadline = (messages.iter())
        .map(|m| m.request.deadline)
        .max()
        .unwrap_or_else(crate::clock::unix_secs);
    let keep = i64::try_from(keep.as_secs()).unwrap_or(i64::MAX);
    let record = SubmissionRecord {
        key: key.to_owned(),
        identity: identity(&messages, request_route, result_route),
        request_route: request_route.to_owned(),
        result_route: result_route.to_owned(),
        requests: (messages.iter())
            .map(|m| SubmittedRequest {
                id: m.request.id.clone(),
                token: m.token().map(str::to_owned),
            })
            .collect(),
        expires_at: last_deadline.saturating_add(keep),
    };
    Ok(Prepared { messages, record })
}

/// Parses every request to enqueue; the first that is not one is
/// [`ClientError::Invalid`] with its index.
pub(crate) fn parse_all(requests: &[Outgoing]) -> Result<Vec<Message>, ClientError> {
    (requests.iter().enumerate())
        .map(|(index, request)| {
            parse_message(&request.body).map_err(|f| ClientError::Invalid {
                index,
                reason: f.reason,
            })
        })
        .collect()
}

/// What a transport's keyed enqueue did: `None`, it wrote `record` with
/// the requests; `Some(text)`, the key already held `text`.
pub(crate) fn settle(
    record: SubmissionRecord,
    found: Option<String>,
) -> Result<Submitted, ClientError> {
    match found {
        None => Ok(Submitted::New(record)),
        Some(text) => self::found(decode(&record.key, &text)?, &record),
    }
}

/// A lookup's answer from the stored text, if any.
pub(crate) fn read(
    key: &str,
    text: Option<String>,
) -> Result<Option<SubmissionRecord>, ClientError> {
    text.map(|t| decode(key, &t)).transpose()
}

/// Refuses an empty key, one longer than [`MAX_KEY_LEN`] or one with
/// control characters (it is printed and used in keys).
pub(crate) fn check_key(key: &str) -> Result<(), ClientError> {
    let reason = match () {
        () if key.is_empty() => "it is empty",
        () if key.len() > MAX_KEY_LEN => "it is longer than 256 bytes",
        () if key.chars().any(char::is_control) => "it holds control characters",
        () => return Ok(()),
    };
    Err(ClientError::IdempotencyKey {
        key: key.to_owned(),
        reason,
    })
}

/// The answer to a key that is already recorded: the same submission
/// (`Existing`) or a conflict naming the key.
pub(crate) fn found(
    found: SubmissionRecord,
    offered: &SubmissionRecord,
) -> Result<Submitted, ClientError> {
    match found.identity == offered.identity {
        true => Ok(Submitted::Existing(found)),
        false => Err(ClientError::IdempotencyConflict {
            key: offered.key.clone(),
            recorded: found.identity,
            offered: offered.identity.clone(),
        }),
    }
}

/// Reads a stored record of `key`.
pub(crate) fn decode(key: &str, text: &str) -> Result<SubmissionRecord, ClientError> {
    serde_json::from_str(text).map_err(|e| ClientError::IdempotencyRecord {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

/// The record as stored.
pub(crate) fn encode(record: &SubmissionRecord) -> String {
    // Strings, numbers and a list of them: serialising cannot fail.
    serde_json::to_string(record).unwrap_or_default()
}

/// SHA-256 (lowercase hex) of the canonical JSON of `messages` in order
/// under the two routes.
pub fn identity(messages: &[Message], request_route: &str, result_route: &str) -> String {
    let requests: Vec<Value> = messages.iter().map(canonical_request).collect();
    canonical_sha256(&serde_json::json!({
        "request_route": request_route,
        "result_route": result_route,
        "requests": requests,
    }))
}

/// SHA-256 (lowercase hex) of `value`'s canonical JSON (object keys
/// sorted at every depth): the identity of a JSON body (the Batch API's
/// `Idempotency-Key`).
pub fn canonical_sha256(value: &Value) -> String {
    sha256_hex(canonical(value).to_string().as_bytes())
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The fields of a request that make its identity: upstream's list
/// without `created` and `deadline`, which `submit` fills from the clock
/// for lines that carry none, so a retry a second later would otherwise
/// conflict with its own first try.
fn canonical_request(message: &Message) -> Value {
    let r = &message.request;
    // The payload was validated as JSON when the message was parsed; a
    // payload that no longer reads is hashed as its text.
    let payload = serde_json::from_str::<Value>(r.payload.get())
        .unwrap_or_else(|_| Value::String(r.payload.get().to_owned()));
    serde_json::json!({
        "id": r.id,
        "payload": payload,
        "metadata": r.metadata,
        "headers": r.headers,
        "endpoint": r.endpoint,
    })
}

/// `value` with every object's keys in sorted order, whether or not
/// serde_json keeps insertion order in this build (a dependency may turn
/// on `preserve_order`).
fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&map[k]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn outgoing(text: &str) -> Outgoing {
        Outgoing {
            body: Bytes::from(text.to_owned()),
            deadline: 0,
        }
    }

    fn prepared(lines: &[&str]) -> Prepared {
        let requests: Vec<Outgoing> = lines.iter().map(|l| outgoing(l)).collect();
        prepare("k", &requests, "q", "r", Duration::from_secs(60)).expect("valid")
    }

    const A: &str = r#"{"id":"a","deadline":2000000000,"payload":{"x":1,"b":[{"z":1,"a":2}]}}"#;
    const A_REORDERED: &str =
        r#"{"payload":{"b":[{"a":2,"z":1}],"x":1},"deadline":2000000000,"id":"a"}"#;
    const B: &str = r#"{"id":"b","deadline":2000000000,"payload":{}}"#;

    #[test]
    fn identity_ignores_key_order_the_token_and_the_deadline() {
        let envelope = r#"{"internal":{"request_token":"t1"},"request_kind":"redis","data":{"id":"a","deadline":2000000000,"payload":{"x":1,"b":[{"z":1,"a":2}]}}}"#;
        let a = prepared(&[A]).record.identity;
        assert_eq!(a, prepared(&[A_REORDERED]).record.identity);
        assert_eq!(a, prepared(&[envelope]).record.identity);
        // A retry whose default deadline was taken a second later.
        let later = A.replace("2000000000", "2000000001");
        assert_eq!(a, prepared(&[&later]).record.identity);
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn identity_covers_order_payload_and_routes() {
        let ab = prepared(&[A, B]).record;
        assert_ne!(ab.identity, prepared(&[B, A]).record.identity);
        let changed = A.replace(r#""x":1"#, r#""x":2"#);
        assert_ne!(
            prepared(&[A]).record.identity,
            prepared(&[&changed]).record.identity
        );
        let other_route = prepare(
            "k",
            &[outgoing(A), outgoing(B)],
            "q",
            "elsewhere",
            Duration::ZERO,
        )
        .expect("valid");
        assert_ne!(ab.identity, other_route.record.identity);
    }

    #[test]
    fn record_expires_after_the_last_deadline_plus_keep() {
        let record = prepared(&[A, B]).record;
        assert_eq!(record.expires_at, 2_000_000_060);
        assert_eq!(record.requests.len(), 2);
        assert_eq!(decode("k", &encode(&record)).expect("round trip"), record);
    }

    #[test]
    fn a_found_record_is_the_same_submission_or_a_conflict_naming_the_key() {
        let first = prepared(&[A]).record;
        assert_eq!(
            found(first.clone(), &first).expect("same"),
            Submitted::Existing(first.clone())
        );
        let other = prepared(&[B]).record;
        let error = found(first, &other).expect_err("conflict");
        assert!(matches!(error, ClientError::IdempotencyConflict { .. }));
        assert!(error.to_string().contains("`k`"), "{error}");
    }

    #[test]
    fn refuses_empty_long_and_control_keys() {
        for bad in [
            String::new(),
            "x".repeat(MAX_KEY_LEN + 1),
            "a\nb".to_owned(),
        ] {
            assert!(matches!(
                check_key(&bad),
                Err(ClientError::IdempotencyKey { .. })
            ));
        }
        assert!(check_key("order-2026-11-28/7").is_ok());
    }
}
