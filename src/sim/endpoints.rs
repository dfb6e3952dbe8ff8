//! `/v1/embeddings` and `/v1/responses` of the HTTP front: how their
//! request bodies become prompt lengths, and the OpenAI objects they are
//! answered with. The pool sees them as any request: an embedding is a
//! prefill whose single engine step ends it (no decode), a response is a
//! chat-like generation.

use serde_json::{Map, Value, json};

use super::bad_request::{BadRequest, bad_request};

/// Vector length when the request names no `dimensions` (small, so batch
/// output files stay small; real models have hundreds).
pub(super) const DEFAULT_DIMENSIONS: usize = 16;
/// Largest `dimensions` a request may ask for.
const MAX_DIMENSIONS: usize = 4096;

/// What an embeddings request asks for, beyond its prompt length.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct EmbedRequest {
    /// One seed per input item, from its content: the same text (or
    /// tokens) always gets the same vector.
    pub(super) seeds: Vec<u64>,
    /// Vector length.
    pub(super) dimensions: usize,
    /// `encoding_format: base64` (little-endian f32 bytes) instead of floats.
    pub(super) base64: bool,
    /// Prompt tokens over every item.
    pub(super) tokens: u64,
}

/// FNV-1a, 64 bits: a stable seed from bytes.
fn fnv(bytes: &[u8]) -> u64 {
    crate::prompt::fnv1a(crate::prompt::FNV_OFFSET, bytes)
}

/// Reads an embeddings body: `input` in OpenAI's four forms (a string,
/// strings, token ids, token arrays), `dimensions`, `encoding_format`.
pub(super) fn embed_request(
    obj: &Map<String, Value>,
    text_tokens: impl Fn(&str) -> u64,
) -> Result<EmbedRequest, BadRequest> {
    let bad = || {
        bad_request(
            "input must be a non-empty string, array of strings, array of token ids or array of token arrays",
            Some("input"),
        )
    };
    let is_token = |v: &Value| v.as_u64().is_some();
    let items: Vec<(u64, u64)> = match obj.get("input") {
        Some(Value::String(s)) if !s.is_empty() => vec![(fnv(s.as_bytes()), text_tokens(s))],
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(is_token) => {
            vec![(
                fnv(Value::Array(a.clone()).to_string().as_bytes()),
                a.len() as u64,
            )]
        }
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|item| match item {
                Value::String(s) if !s.is_empty() => Ok((fnv(s.as_bytes()), text_tokens(s))),
                Value::Array(t) if !t.is_empty() && t.iter().all(is_token) => {
                    Ok((fnv(item.to_string().as_bytes()), t.len() as u64))
                }
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    let dimensions = match obj.get("dimensions") {
        None | Some(Value::Null) => DEFAULT_DIMENSIONS,
        Some(v) => v
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .filter(|d| (1..=MAX_DIMENSIONS).contains(d))
            .ok_or_else(|| {
                bad_request(
                    format!("dimensions must be an integer in 1..={MAX_DIMENSIONS}"),
                    Some("dimensions"),
                )
            })?,
    };
    let base64 = match obj.get("encoding_format").and_then(Value::as_str) {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return Err(bad_request(
                "encoding_format must be float or base64",
                Some("encoding_format"),
            ));
        }
    };
    Ok(EmbedRequest {
        tokens: items.iter().map(|i| i.1).sum::<u64>().max(1),
        seeds: items.into_iter().map(|i| i.0).collect(),
        dimensions,
        base64,
    })
}

/// A unit vector of `n` components drawn from `seed` (splitmix64): the
/// same seed gives the same vector on every run and every front.
pub(super) fn vector(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    // Top 24 bits to [-1, 1): exact in f32.
    let raw: Vec<f32> = (0..n)
        .map(|_| (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    let norm = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    match norm > 0.0 {
        true => raw.into_iter().map(|x| x / norm).collect(),
        false => raw,
    }
}

/// Standard base64 (RFC 4648, padded), for `encoding_format: base64`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> shift) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The OpenAI embeddings object (`object: list` of `embedding`s).
pub(super) fn embeddings_body(model: &str, req: &EmbedRequest, prompt_tokens: u32) -> Value {
    let data: Vec<Value> = (req.seeds.iter().enumerate())
        .map(|(index, seed)| {
            let v = vector(*seed, req.dimensions);
            let embedding = match req.base64 {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Value::String(base64(&bytes))
                }
                false => json!(v),
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

/// Prompt tokens of a Responses body: `instructions` plus `input` (a
/// string, or items whose `content` is text or parts with `text`, or
/// function-call `output`s), a few template tokens per item as chat adds
/// per message.
pub(super) fn response_prompt_tokens(
    obj: &Map<String, Value>,
    text_tokens: impl Fn(&str) -> u64,
) -> Result<u64, BadRequest> {
    let instructions = match obj.get("instructions") {
        None | Some(Value::Null) => 0,
        Some(Value::String(s)) => text_tokens(s),
        Some(_) => {
            return Err(bad_request(
                "instructions must be a string",
                Some("instructions"),
            ));
        }
    };
    let input = match obj.get("input") {
        Some(Value::String(s)) if !s.is_empty() => text_tokens(s),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_object) => {
            items
                .iter()
                .map(|item| {
                    let text = |v: Option<&Value>| match v {
                        Some(Value::String(s)) => text_tokens(s),
                        Some(Value::Array(parts)) => parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .map(&text_tokens)
                            .sum(),
                        _ => 0,
                    };
                    4 + text(item.get("content")) + text(item.get("output"))
                })
                .sum()
        }
        _ => {
            return Err(bad_request(
                "input is required: a non-empty string or array of input items",
                Some("input"),
            ));
        }
    };
    Ok((instructions + input).max(1))
}

/// Ids and times of one answer.
#[derive(Debug)]
pub(super) struct ResponseIds {
    /// `resp_…`, `chatcmpl-…`, `cmpl-…`.
    pub(super) id: String,
    /// Unix seconds.
    pub(super) created: u64,
    /// The model the request named.
    pub(super) model: String,
}

/// The OpenAI Response object: one assistant message of `text`, `usage`
/// in the Responses spelling, `incomplete` when `max_output_tokens` cut
/// it short (as OpenAI reports it).
pub(super) fn response_body(
    ids: &ResponseIds,
    text: &str,
    prompt_tokens: u32,
    output_tokens: u32,
    max_output_tokens: u32,
) -> Value {
    let cut = output_tokens >= max_output_tokens;
    let number = ids.id.trim_start_matches("resp_");
    json!({
        "id": ids.id,
        "object": "response",
        "created_at": ids.created,
        "status": if cut { "incomplete" } else { "completed" },
        "incomplete_details": if cut { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null,
        "model": ids.model,
        "output": [{
            "type": "message",
            "id": format!("msg_{number}"),
            "status": if cut { "incomplete" } else { "completed" },
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        "max_output_tokens": max_output_tokens,
        // Fields every Response carries (the official clients' types
        // require the first three), with the values of a plain request.
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "instructions": null,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    fn chars(s: &str) -> u64 {
        s.chars().count() as u64
    }

    #[test]
    fn the_same_input_gets_the_same_unit_vector() {
        let a =
            embed_request(&obj(json!({"input": ["same", "other", "same"]})), chars).expect("valid");
        assert_eq!((a.tokens, a.dimensions, a.seeds.len()), (13, 16, 3));
        assert_eq!(a.seeds[0], a.seeds[2]);
        assert_ne!(a.seeds[0], a.seeds[1]);
        let v = vector(a.seeds[0], 16);
        assert_eq!(v, vector(a.seeds[0], 16));
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
        let tokens =
            embed_request(&obj(json!({"input": [[1, 2, 3], [4]]})), chars).expect("token arrays");
        assert_eq!((tokens.tokens, tokens.seeds.len()), (4, 2));
        let flat = embed_request(&obj(json!({"input": [1, 2, 3]})), chars).expect("tokens");
        assert_eq!((flat.tokens, flat.seeds.len()), (3, 1));
        for bad in [
            json!({}),
            json!({"input": ""}),
            json!({"input": []}),
            json!({"input": ["a", 1]}),
            json!({"input": "a", "dimensions": 0}),
            json!({"input": "a", "encoding_format": "hex"}),
        ] {
            assert!(embed_request(&obj(bad.clone()), chars).is_err(), "{bad}");
        }
    }

    #[test]
    fn base64_embeddings_decode_to_the_float_vector() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        let req = embed_request(
            &obj(json!({"input": "x", "encoding_format": "base64", "dimensions": 3})),
            chars,
        )
        .expect("valid");
        let body = embeddings_body("m", &req, 1);
        let text = body["data"][0]["embedding"].as_str().expect("base64 text");
        assert_eq!(text.len(), 16, "12 bytes of 3 f32s");
    }

    #[test]
    fn responses_count_instructions_and_items() {
        let n = response_prompt_tokens(
            &obj(json!({"instructions": "abc", "input": [
                {"role": "user", "content": "hello"},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            ]})),
            chars,
        )
        .expect("valid");
        assert_eq!(n, 3 + (4 + 5) + (4 + 2));
        assert!(response_prompt_tokens(&obj(json!({"input": []})), chars).is_err());
        assert!(response_prompt_tokens(&obj(json!({"input": ["x"]})), chars).is_err());
        let ids = ResponseIds {
            id: "resp_7".into(),
            created: 1,
            model: "m".into(),
        };
        let done = response_body(&ids, "hi", 3, 2, 8);
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "hi");
        assert_eq!(done["usage"]["total_tokens"], 5);
        let cut = response_body(&ids, "hi", 3, 8, 8);
        assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
    }
}
