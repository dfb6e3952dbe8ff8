//! Batch input lines: OpenAI Batch API lines (`custom_id`, `method`, `url`,
//! `body`), sluicegate request lines (docs/architecture.md, "Request
//! messages") and upstream envelopes, turned into queue messages. The one
//! line validator `sluicegate batch`, `submit` and `submit --embedded`
//! share, so they accept the same lines and word their errors alike.

use std::collections::HashMap;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::endpoint::Endpoints;
use crate::request::parse_message;

/// One usable input line, as the queue message it becomes.
#[derive(Debug, Clone)]
pub struct InputLine {
    /// 1-based line number in the file.
    pub line: usize,
    /// The OpenAI `custom_id`, or the request `id`: the message id.
    pub custom_id: String,
    /// The request message bytes (a bare request object).
    pub body: Bytes,
    /// The request deadline, Unix seconds.
    pub deadline: i64,
}

/// One line that cannot be sent, with why.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidLine {
    /// 1-based line number in the file.
    pub line: usize,
    /// The id, when one could be read.
    pub custom_id: Option<String>,
    /// What is wrong, naming the line.
    pub message: String,
}

/// A whole input file, sorted into usable and invalid lines.
#[derive(Debug, Default)]
pub struct ParsedInput {
    /// Lines that become queue messages, in file order.
    pub valid: Vec<InputLine>,
    /// Lines answered with an error, in file order.
    pub invalid: Vec<InvalidLine>,
    /// Lines whose id an earlier line already has, in file order. With
    /// [`DuplicateIds::Refuse`] they are in `invalid` too; with
    /// [`DuplicateIds::Allow`] they are in `valid` too.
    pub duplicates: Vec<InvalidLine>,
}

/// What [`parse_input_with`] does with a line whose id an earlier line
/// already has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateIds {
    /// The line is invalid (the first line with the id wins): results are
    /// keyed by id, so a second line with it could not be told apart.
    Refuse,
    /// The line is kept (`submit --allow-duplicates`); it is still listed
    /// in [`ParsedInput::duplicates`] so the caller can warn.
    Allow,
}

impl ParsedInput {
    /// Non-blank lines in the file.
    pub fn total(&self) -> usize {
        self.valid.len() + self.invalid.len()
    }
}

#[derive(Deserialize)]
struct OpenAiLine {
    custom_id: Value,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    body: Option<Box<RawValue>>,
}

/// Parses every non-blank line of `text`. Requests without a deadline get
/// `default_deadline` (Unix seconds). A repeated id is invalid (the first
/// line with it wins), because results are keyed by id.
pub fn parse_input(text: &str, default_deadline: i64) -> ParsedInput {
    parse_input_with(text, default_deadline, DuplicateIds::Refuse)
}

/// [`parse_input`] with a choice about repeated ids.
pub fn parse_input_with(
    text: &str,
    default_deadline: i64,
    duplicates: DuplicateIds,
) -> ParsedInput {
    let mut out = ParsedInput::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (index, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line = index + 1;
        match convert_line(raw, line, default_deadline) {
            Ok(input) => {
                if let Some(first) = seen.get(&input.custom_id) {
                    let duplicate = InvalidLine {
                        line,
                        custom_id: Some(input.custom_id.clone()),
                        message: format!(
                            "line {line}: duplicate custom_id `{}` (first on line {first})",
                            input.custom_id
                        ),
                    };
                    out.duplicates.push(duplicate.clone());
                    match duplicates {
                        DuplicateIds::Refuse => out.invalid.push(duplicate),
                        DuplicateIds::Allow => out.valid.push(input),
                    }
                } else {
                    seen.insert(input.custom_id.clone(), line);
                    out.valid.push(input);
                }
            }
            Err(invalid) => out.invalid.push(invalid),
        }
    }
    out
}

/// Moves the lines that name an endpoint `endpoints` does not take, or
/// whose body misses what a known endpoint needs, from `valid` to
/// `invalid` (answered `invalid_request`, never sent). Lines without an
/// endpoint (request lines, sent to `--request-path`) are left alone.
pub fn restrict_endpoints(parsed: &mut ParsedInput, endpoints: &Endpoints) {
    let (keep, refuse): (Vec<InputLine>, Vec<InputLine>) = std::mem::take(&mut parsed.valid)
        .into_iter()
        .partition(|l| refusal(l, endpoints).is_none());
    parsed.valid = keep;
    if refuse.is_empty() {
        return;
    }
    parsed.invalid.extend(refuse.into_iter().filter_map(|l| {
        let why = refusal(&l, endpoints)?;
        Some(InvalidLine {
            line: l.line,
            message: format!("line {}: {why}", l.line),
            custom_id: Some(l.custom_id),
        })
    }));
    // The output merges valid and invalid lines in file order.
    parsed.invalid.sort_by_key(|l| l.line);
}

/// Why `line` may not go to its endpoint, if it may not.
fn refusal(line: &InputLine, endpoints: &Endpoints) -> Option<String> {
    let message = parse_message(&line.body).ok()?;
    let path = message.request.endpoint.as_deref()?;
    let body: Option<Map<String, Value>> = serde_json::from_str(message.request.payload.get()).ok();
    endpoints
        .check(path, body.as_ref())
        .err()
        .map(|e| e.message)
}

/// Converts one line (OpenAI batch line or request line) into a queue
/// message.
pub fn convert_line(
    text: &str,
    line: usize,
    default_deadline: i64,
) -> Result<InputLine, InvalidLine> {
    let invalid = |custom_id: Option<String>, why: String| InvalidLine {
        line,
        custom_id,
        message: format!("line {line}: {why}"),
    };
    let object: Map<String, Value> = match serde_json::from_str(text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err(invalid(None, "not a JSON object".into())),
        Err(e) => return Err(invalid(None, format!("not valid JSON: {e}"))),
    };
    let bytes = if object.contains_key("custom_id") {
        openai_request(text, default_deadline).map_err(|(id, why)| invalid(id, why))?
    } else if is_envelope(&object) {
        // An upstream envelope: the deadline belongs to its `data`.
        let mut object = object;
        if let Some(Value::Object(data)) = object.get_mut("data")
            && !data.contains_key("deadline")
        {
            data.insert("deadline".into(), Value::from(default_deadline));
        }
        serde_json::to_vec(&Value::Object(object)).map_err(|e| invalid(None, e.to_string()))?
    } else if object.contains_key("id") {
        if object.contains_key("deadline") {
            text.as_bytes().to_vec()
        } else {
            let mut object = object;
            object.insert("deadline".into(), Value::from(default_deadline));
            serde_json::to_vec(&Value::Object(object)).map_err(|e| invalid(None, e.to_string()))?
        }
    } else {
        return Err(invalid(
            None,
            "neither an OpenAI batch line (custom_id, method, url, body), a request (id, deadline, payload) nor an envelope (internal, data)".into(),
        ));
    };
    match parse_message(&bytes) {
        Ok(message) => Ok(InputLine {
            line,
            custom_id: message.request.id,
            deadline: message.request.deadline,
            body: Bytes::from(bytes),
        }),
        Err(failure) => Err(invalid(failure.id, failure.reason)),
    }
}

/// Whether `object` is an upstream envelope (`data` with `internal` or
/// `request_kind`), the rule [`parse_message`] applies.
fn is_envelope(object: &Map<String, Value>) -> bool {
    object.contains_key("data")
        && (object.contains_key("internal") || object.contains_key("request_kind"))
}

/// Converts one OpenAI Batch API line (`custom_id`, `method`, `url`,
/// `body`) into the bytes of a request message with `default_deadline`:
/// the one converter `batch`, `submit` and `submit --embedded` share.
/// Errors carry the id when one was read, and say what is wrong.
pub fn openai_request(
    text: &str,
    default_deadline: i64,
) -> Result<Vec<u8>, (Option<String>, String)> {
    let parsed: OpenAiLine =
        serde_json::from_str(text).map_err(|e| (None, format!("not an OpenAI batch line: {e}")))?;
    let Value::String(custom_id) = parsed.custom_id else {
        return Err((None, "custom_id must be a non-empty string".into()));
    };
    if custom_id.is_empty() {
        return Err((None, "custom_id must be a non-empty string".into()));
    }
    let id = Some(custom_id.clone());
    if let Some(method) = parsed.method.as_deref().filter(|m| *m != "POST") {
        return Err((id, format!("method {method} is not supported; only POST")));
    }
    let Some(url) = parsed.url.filter(|u| u.starts_with('/')) else {
        return Err((
            id,
            "url must be a path starting with '/', e.g. /v1/chat/completions".into(),
        ));
    };
    let Some(body) = parsed.body else {
        return Err((id, "body is required".into()));
    };
    if !body.get().trim_start().starts_with('{') {
        return Err((id, "body must be a JSON object".into()));
    }
    #[derive(serde::Serialize)]
    struct Out<'a> {
        id: &'a str,
        deadline: i64,
        payload: &'a RawValue,
        endpoint: &'a str,
    }
    serde_json::to_vec(&Out {
        id: &custom_id,
        deadline: default_deadline,
        payload: &body,
        endpoint: &url,
    })
    .map_err(|e| (id, e.to_string()))
}

/// A fingerprint of the input file (length and 64-bit FNV-1a), recorded at
/// import so a resume against a different file is refused.
pub fn fingerprint(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{}:{hash:016x}", bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_openai_line_to_request() {
        let line = r#"{"custom_id":"r1","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"hi"}]}}"#;
        let got = convert_line(line, 3, 1000).expect("valid");
        assert_eq!(got.custom_id, "r1");
        assert_eq!(got.deadline, 1000);
        let m = parse_message(&got.body).expect("parses");
        assert_eq!(m.request.endpoint.as_deref(), Some("/v1/chat/completions"));
        assert!(m.request.payload.get().contains("messages"));
    }

    #[test]
    fn keeps_request_lines_and_fills_missing_deadline() {
        let got = convert_line(r#"{"id":"a","payload":{"prompt":"x"}}"#, 1, 77).expect("valid");
        assert_eq!((got.custom_id.as_str(), got.deadline), ("a", 77));
        let got = convert_line(r#"{"id":"b","deadline":"55","payload":{}}"#, 1, 77).expect("valid");
        assert_eq!(got.deadline, 55);
    }

    #[test]
    fn invalid_lines_name_their_line_number() {
        let text = "{\"custom_id\":\"a\",\"url\":\"/v1/completions\",\"body\":{}}\n\nnot json\n{\"custom_id\":\"a\",\"url\":\"/v1/completions\",\"body\":{}}\n{\"custom_id\":\"c\",\"method\":\"GET\",\"url\":\"/x\",\"body\":{}}\n[1]\n";
        let parsed = parse_input(text, 10);
        assert_eq!(parsed.valid.len(), 1);
        let lines: Vec<usize> = parsed.invalid.iter().map(|i| i.line).collect();
        assert_eq!(lines, vec![3, 4, 5, 6]);
        // One wording for `batch` and `submit` (issue 16 item 5): "not
        // valid JSON", as `submit` always said.
        assert!(
            parsed.invalid[0]
                .message
                .starts_with("line 3: not valid JSON")
        );
        assert!(parsed.invalid[1].message.contains("duplicate custom_id"));
        assert_eq!(parsed.invalid[2].custom_id.as_deref(), Some("c"));
        assert_eq!(parsed.total(), 5);
    }

    #[test]
    fn duplicates_are_refused_or_kept_and_always_listed() {
        let line =
            |id: &str| format!(r#"{{"custom_id":"{id}","url":"/v1/completions","body":{{}}}}"#);
        let text = [line("a"), line("b"), line("a"), line("a")].join("\n");
        let refused = parse_input_with(&text, 10, DuplicateIds::Refuse);
        assert_eq!(refused.valid.len(), 2);
        let lines: Vec<usize> = refused.duplicates.iter().map(|d| d.line).collect();
        assert_eq!(lines, vec![3, 4]);
        assert_eq!(refused.invalid.len(), 2);
        assert_eq!(
            refused.duplicates[0].message,
            "line 3: duplicate custom_id `a` (first on line 1)"
        );
        let kept = parse_input_with(&text, 10, DuplicateIds::Allow);
        assert_eq!((kept.valid.len(), kept.invalid.len()), (4, 0));
        assert_eq!(kept.duplicates.len(), 2);
    }

    #[test]
    fn envelopes_get_the_default_deadline_in_their_data() {
        let got = convert_line(
            r#"{"internal":{"request_token":"t"},"request_kind":"redis","data":{"id":"e","payload":{}}}"#,
            1,
            42,
        )
        .expect("valid");
        assert_eq!((got.custom_id.as_str(), got.deadline), ("e", 42));
        let m = parse_message(&got.body).expect("parses");
        assert_eq!(m.token(), Some("t"));
    }

    #[test]
    fn fingerprint_changes_with_content() {
        assert_ne!(fingerprint(b"a"), fingerprint(b"b"));
        assert_eq!(fingerprint(b"abc"), fingerprint(b"abc"));
    }
}
