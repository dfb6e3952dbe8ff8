//! What one request costs in the queue's window unit. Pure.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::Unit;
use crate::endpoint::Endpoint;

/// Characters per token for prompt estimates; the common rule of thumb for
/// English text with BPE tokenizers. Estimates only need to be stable and
/// roughly proportional: the gate corrects with live metrics.
const CHARS_PER_TOKEN: usize = 4;

/// `max_tokens` assumed when a request does not say (vLLM would generate up
/// to the context limit; a bounded guess keeps token windows meaningful).
pub const DEFAULT_MAX_TOKENS: u64 = 1024;

/// The fields of an OpenAI-style body that decide its token cost.
#[derive(Deserialize, Default)]
struct CostFields<'a> {
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    /// `/v1/responses`, `/v1/embeddings`, `/classify` and `/pooling`
    /// carry their text here.
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    /// `/v1/rerank`: a query read beside each of `documents`.
    #[serde(borrow, default)]
    query: Option<&'a RawValue>,
    #[serde(borrow, default)]
    documents: Option<&'a RawValue>,
    /// `/v1/score`: the two sides of each pair.
    #[serde(borrow, default)]
    text_1: Option<&'a RawValue>,
    #[serde(borrow, default)]
    text_2: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// `/v1/responses`' output cap.
    #[serde(default)]
    max_output_tokens: Option<u64>,
}

/// Cost of a request with this payload, sent to `endpoint` (the request's
/// own, when it names one), in `unit`: 1 for requests; prompt estimate +
/// `max_tokens` for tokens (the prompt alone for embeddings, which
/// generate nothing); payload length for bytes. Never 0, so every request
/// uses some window.
pub fn request_cost(unit: Unit, payload: &RawValue, endpoint: Option<&str>) -> u64 {
    match unit {
        Unit::Requests => 1,
        Unit::Bytes => (payload.get().len() as u64).max(1),
        Unit::Tokens => {
            let fields: CostFields<'_> = serde_json::from_str(payload.get()).unwrap_or_default();
            let prompt_tokens = prompt_estimate(&fields);
            let output = if reads_only(endpoint) {
                0
            } else {
                fields
                    .max_tokens
                    .or(fields.max_completion_tokens)
                    .or(fields.max_output_tokens)
                    .unwrap_or(DEFAULT_MAX_TOKENS)
            };
            (prompt_tokens + output).max(1)
        }
    }
}

/// Whether `endpoint` (a path, or a URL ending in one) is a known endpoint
/// that generates nothing: embeddings and vLLM's pooling endpoints.
fn reads_only(endpoint: Option<&str>) -> bool {
    endpoint.is_some_and(|e| {
        let e = e.trim_end_matches('/');
        Endpoint::ALL
            .iter()
            .any(|known| !known.generates() && e.ends_with(known.as_str()))
    })
}

/// Estimated prompt tokens of a request with this payload (what a
/// `tokens` pace charges): its prompt or messages text at
/// `CHARS_PER_TOKEN`; 0 when the body has neither.
pub fn prompt_tokens(payload: &RawValue) -> u64 {
    let fields: CostFields<'_> = serde_json::from_str(payload.get()).unwrap_or_default();
    prompt_estimate(&fields)
}

fn prompt_estimate(fields: &CostFields<'_>) -> u64 {
    let chars = |raw: Option<&RawValue>| raw.map_or(0, |r| text_chars(r.get()));
    let prompt_chars = match (
        fields.prompt.or(fields.messages).or(fields.input),
        fields.query,
    ) {
        (Some(text), _) => chars(Some(text)),
        // A reranker reads the query once beside each document.
        (None, Some(query)) => {
            let documents = fields
                .documents
                .and_then(|d| serde_json::from_str::<Vec<serde_json::Value>>(d.get()).ok())
                .map_or(1, |d| d.len().max(1));
            chars(Some(query)) * documents + chars(fields.documents)
        }
        (None, None) => chars(fields.text_1) + chars(fields.text_2),
    };
    prompt_chars.div_ceil(CHARS_PER_TOKEN) as u64
}

/// Characters of text in a prompt or messages value: the sum of string
/// lengths inside it (message roles and JSON punctuation are not tokens the
/// model reads at that rate, but they are few).
fn text_chars(json: &str) -> usize {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(value) => string_chars(&value),
        Err(_) => json.len(),
    }
}

fn string_chars(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::String(s) => s.chars().count(),
        serde_json::Value::Array(items) => items.iter().map(string_chars).sum(),
        serde_json::Value::Object(map) => map.values().map(string_chars).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).expect("valid json")
    }

    #[test]
    fn prompt_tokens_count_the_prompt_only() {
        let p = raw(r#"{"prompt":"abcdefgh","max_tokens":10}"#);
        assert_eq!(prompt_tokens(&p), 2);
        assert_eq!(prompt_tokens(&raw(r#"{"max_tokens":10}"#)), 0);
    }

    #[test]
    fn token_cost_is_prompt_estimate_plus_max_tokens() {
        let p = raw(r#"{"prompt":"abcdefgh","max_tokens":10}"#);
        assert_eq!(request_cost(Unit::Tokens, &p, None), 2 + 10);
        let c = raw(r#"{"messages":[{"role":"user","content":"abcd"}],"max_completion_tokens":5}"#);
        // "user" + "abcd" = 8 chars = 2 tokens.
        assert_eq!(request_cost(Unit::Tokens, &c, None), 2 + 5);
        // `/v1/responses`: text in `input`, cap in `max_output_tokens`.
        let r = raw(r#"{"input":"abcdefgh","max_output_tokens":7}"#);
        assert_eq!(request_cost(Unit::Tokens, &r, None), 2 + 7);
        let none = raw(r#"{"model":"m"}"#);
        assert_eq!(request_cost(Unit::Tokens, &none, None), DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn embeddings_cost_their_input_only() {
        let e = raw(r#"{"model":"m","input":"abcdefgh"}"#);
        assert_eq!(request_cost(Unit::Tokens, &e, Some("/v1/embeddings")), 2);
        let url = Some("http://gw/v1/embeddings/");
        assert_eq!(request_cost(Unit::Tokens, &e, url), 2);
        assert_eq!(
            request_cost(Unit::Tokens, &e, Some("/v1/responses")),
            2 + DEFAULT_MAX_TOKENS
        );
        // Never 0: an empty input still uses some window.
        let empty = raw(r#"{"model":"m","input":""}"#);
        assert_eq!(
            request_cost(Unit::Tokens, &empty, Some("/v1/embeddings")),
            1
        );
    }

    #[test]
    fn pooling_endpoints_cost_the_texts_they_read() {
        // The query beside each of two documents: 4 × 2 + 4 + 4 = 16 chars.
        let r = raw(r#"{"query":"abcd","documents":["efgh","ijkl"]}"#);
        assert_eq!(request_cost(Unit::Tokens, &r, Some("/v1/rerank")), 4);
        let s = raw(r#"{"text_1":"abcd","text_2":["efgh","ijkl"]}"#);
        assert_eq!(
            request_cost(Unit::Tokens, &s, Some("http://gw/v1/score")),
            3
        );
        let c = raw(r#"{"input":["abcdefgh"]}"#);
        assert_eq!(request_cost(Unit::Tokens, &c, Some("/classify")), 2);
        assert_eq!(request_cost(Unit::Tokens, &c, Some("/pooling")), 2);
    }

    #[test]
    fn request_and_byte_costs() {
        let p = raw(r#"{"a":1}"#);
        assert_eq!(request_cost(Unit::Requests, &p, None), 1);
        assert_eq!(request_cost(Unit::Bytes, &p, None), 7);
    }
}
