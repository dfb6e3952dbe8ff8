//! Pure conversions between Pub/Sub messages and the queue contract: no
//! I/O, so every rule here is unit-tested on its own.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::value::RawValue;

use crate::result::ResultRecord;

/// Longest ack deadline Pub/Sub accepts, in seconds.
pub(super) const MAX_ACK_DEADLINE_SECS: i32 = 600;
/// Most messages one Pull may return.
pub const MAX_PULL: usize = 1000;
/// Metadata key (and result attribute) that routes results to filtered
/// subscriptions (upstream's format).
pub(super) const RESULT_ROUTE: &str = "result_route";

/// What the transport keeps from a delivered message until it is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Received {
    /// The body handed to the dispatcher (attributes merged into metadata).
    pub(super) body: Vec<u8>,
    /// `metadata.result_route` of the request, if any.
    pub(super) result_route: Option<String>,
    /// The request's `deadline` (Unix seconds), when the body has a
    /// readable one: a hold never outlasts it.
    pub(super) deadline: Option<i64>,
}

/// The top-level `deadline` of a request: an integer, or a number in a
/// string, as the request parser accepts it (`src/request.rs`).
fn deadline_of(raw: Option<&RawValue>) -> Option<i64> {
    let value: serde_json::Value = serde_json::from_str(raw?.get()).ok()?;
    let number = match &value {
        serde_json::Value::String(s) => s.trim().parse::<f64>().ok()?,
        v => v.as_f64()?,
    };
    // Whole seconds, as the parser reads them; out-of-range values are
    // the parser's to refuse.
    number.is_finite().then_some(number as i64)
}

/// Message attributes merge into the request's `metadata`, and where the
/// body's metadata has the same key the attribute's value wins, as in
/// upstream's Pub/Sub consumer (`docs/compatibility.md`): a producer or a
/// relay that sets an attribute (a tenant, a route) overrides what the body
/// carries. Only the top level is re-written: the
/// `payload` and every other field keep their exact text, so the request
/// is still forwarded verbatim. A body that is not a JSON object is handed
/// on unchanged: the dispatcher answers it with `INVALID_REQUEST`.
pub(super) fn received(data: &[u8], attributes: &HashMap<String, String>) -> Received {
    let Ok(mut top) = serde_json::from_slice::<BTreeMap<String, Box<RawValue>>>(data) else {
        return Received {
            body: data.to_vec(),
            result_route: None,
            deadline: None,
        };
    };
    let deadline = deadline_of(top.get("deadline").map(AsRef::as_ref));
    let mut metadata: BTreeMap<String, String> = match top.get("metadata") {
        Some(raw) => match serde_json::from_str(raw.get()) {
            Ok(m) => m,
            // A metadata of the wrong shape is the request's own error: leave
            // the body alone so the parser reports it.
            Err(_) => {
                return Received {
                    body: data.to_vec(),
                    result_route: None,
                    deadline,
                };
            }
        },
        None => BTreeMap::new(),
    };
    let mut changed = false;
    for (key, value) in attributes {
        if metadata.get(key) != Some(value) {
            metadata.insert(key.clone(), value.clone());
            changed = true;
        }
    }
    let result_route = metadata.get(RESULT_ROUTE).cloned();
    if !changed {
        return Received {
            body: data.to_vec(),
            result_route,
            deadline,
        };
    }
    // Maps of strings and raw JSON values always serialise.
    let merged = serde_json::value::to_raw_value(&metadata).ok();
    let body = merged
        .and_then(|m| {
            top.insert("metadata".to_owned(), m);
            serde_json::to_vec(&top).ok()
        })
        .unwrap_or_else(|| data.to_vec());
    Received {
        body,
        result_route,
        deadline,
    }
}

/// The retry count of a delivery: Pub/Sub's delivery attempt minus one
/// (upstream's Pub/Sub format, docs/compatibility.md). The broker fills the attempt only on subscriptions with
/// a dead-letter policy; without one it is unknown, counted as 0.
pub(super) fn retry_count(delivery_attempt: Option<usize>) -> u32 {
    delivery_attempt
        .map_or(0, |a| a.saturating_sub(1))
        .try_into()
        .unwrap_or(u32::MAX)
}

/// An ack deadline for a lease or a nack delay, in whole seconds: rounded
/// up (a retry is never earlier than the policy asked), at most 600 s
/// (Pub/Sub's ceiling; a longer lease is kept by extensions).
pub(super) fn deadline_secs(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs)
        .unwrap_or(MAX_ACK_DEADLINE_SECS)
        .min(MAX_ACK_DEADLINE_SECS)
}

/// The result message: the record as JSON, with attributes `id`,
/// `request_token` when the request has one (readers dedupe by the two),
/// and `result_route` when the request's metadata had it.
pub fn result_message(
    result: &ResultRecord,
    result_route: Option<&str>,
) -> (Vec<u8>, HashMap<String, String>) {
    let mut attributes = HashMap::from([("id".to_owned(), result.id.clone())]);
    if let Some(token) = &result.request_token {
        attributes.insert("request_token".to_owned(), token.clone());
    }
    if let Some(route) = result_route {
        attributes.insert(RESULT_ROUTE.to_owned(), route.to_owned());
    }
    // A result is strings and numbers: serialising cannot fail.
    (serde_json::to_vec(result).unwrap_or_default(), attributes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::ErrorCode;

    fn attrs(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn attributes_merge_into_metadata_and_win_as_upstream() {
        let body = br#"{"id":"a","deadline":9,"payload":{"b": [1, 2]},"metadata":{"userid":"u1","k":"body"}}"#;
        let r = received(body, &attrs(&[("userid", "u2"), ("result_route", "r7")]));
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(v["metadata"]["userid"], "u2");
        assert_eq!(v["metadata"]["k"], "body");
        assert_eq!(r.deadline, Some(9));
        assert_eq!(v["metadata"]["result_route"], "r7");
        assert_eq!(r.result_route.as_deref(), Some("r7"));
        // The payload's own text is kept byte for byte.
        let text = String::from_utf8(r.body).expect("utf8");
        assert!(text.contains(r#""payload":{"b": [1, 2]}"#), "{text}");
    }

    #[test]
    fn bodies_without_new_attributes_are_untouched() {
        let body = br#"{"id":"a", "metadata":{"result_route":"x"}}"#;
        let r = received(body, &HashMap::new());
        assert_eq!(r.body, body.to_vec());
        assert_eq!(r.result_route.as_deref(), Some("x"));
        // An attribute equal to the body's value changes nothing either.
        let same = received(body, &attrs(&[("result_route", "x")]));
        assert_eq!(same.body, body.to_vec());
    }

    #[test]
    fn deadlines_are_read_as_the_parser_reads_them() {
        for (body, want) in [
            (&br#"{"deadline": 1700000000}"#[..], Some(1_700_000_000)),
            (br#"{"deadline": "1700000000.5"}"#, Some(1_700_000_000)),
            (br#"{"deadline": "soon"}"#, None),
            (br#"{"id": "x"}"#, None),
            (b"not json", None),
        ] {
            assert_eq!(received(body, &HashMap::new()).deadline, want);
        }
    }

    #[test]
    fn unparsable_bodies_pass_through_for_the_parser_to_answer() {
        for body in [&b"not json"[..], br#"[1,2]"#, br#"{"metadata":[1]}"#] {
            let r = received(body, &attrs(&[("k", "v")]));
            assert_eq!(r.body, body.to_vec());
            assert_eq!(r.result_route, None);
        }
    }

    #[test]
    fn delivery_attempt_minus_one_is_the_retry_count() {
        assert_eq!(retry_count(None), 0);
        assert_eq!(retry_count(Some(1)), 0);
        assert_eq!(retry_count(Some(4)), 3);
    }

    #[test]
    fn deadlines_round_up_and_stop_at_600s() {
        assert_eq!(deadline_secs(Duration::ZERO), 0);
        assert_eq!(deadline_secs(Duration::from_millis(300)), 1);
        assert_eq!(deadline_secs(Duration::from_secs(30)), 30);
        assert_eq!(deadline_secs(Duration::from_secs(3600)), 600);
    }

    #[test]
    fn results_carry_id_token_and_route() {
        let r = ResultRecord::error("r1", Some("t1"), ErrorCode::InvalidRequest, "bad");
        let (data, attributes) = result_message(&r, Some("blue"));
        assert_eq!(attributes["id"], "r1");
        assert_eq!(attributes["request_token"], "t1");
        assert_eq!(attributes["result_route"], "blue");
        let back: ResultRecord = serde_json::from_slice(&data).expect("record");
        assert_eq!(back, r);
        let (_, plain) = result_message(
            &ResultRecord::error("r2", None, ErrorCode::InvalidRequest, "x"),
            None,
        );
        assert_eq!(plain.len(), 1);
    }
}
