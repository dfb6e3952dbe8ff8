//! Parsing an OpenAI request body into what the engine needs.

use std::sync::Arc;

use serde_json::Value;

use crate::sim::bad_request::{BadRequest, bad_request};
use crate::sim::config::SimConfig;
use crate::sim::endpoints::{EmbedRequest, embed_request, response_prompt_tokens};
use crate::sim::scoring::{PoolingApi, PoolingRequest, pooling_request};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Completions,
    Chat,
    Embeddings,
    Responses,
    /// vLLM's pooling-model endpoints (`scoring.rs`).
    Pooling(PoolingApi),
}

impl Api {
    /// Whether the request is a prefill alone (no decode, no stream).
    fn prefill_only(self) -> bool {
        matches!(self, Self::Embeddings | Self::Pooling(_))
    }
}

/// A parsed and validated OpenAI request.
#[derive(Debug)]
pub(super) struct Parsed {
    pub(super) model: String,
    pub(super) prompt_tokens: u32,
    pub(super) max_tokens: u32,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) priority: i32,
    /// Embeddings only: the vectors to answer with.
    pub(super) embed: Option<EmbedRequest>,
    /// Pooling endpoints only: what to answer with.
    pub(super) pooling: Option<PoolingRequest>,
    /// The prompt's block identities, for the prefix cache.
    pub(super) prefix: Arc<[u64]>,
}

/// The identities of the prompt's full KV blocks: its text
/// (`crate::prompt::text`) cut into blocks of `block_size` tokens at
/// `chars_per_token` characters each (64 characters by default), chained
/// from the model name.
fn prefix_blocks(model: &str, body: &Value, cfg: &SimConfig) -> Arc<[u64]> {
    let tokens_per_block = f64::from(cfg.engine.block_size);
    let chars = (tokens_per_block * cfg.http.chars_per_token)
        .round()
        .max(1.0) as usize;
    let max = (cfg.engine.max_model_len / cfg.engine.block_size) as usize;
    crate::prompt::blocks(model, &crate::prompt::text(body), chars, max).into()
}

pub(super) fn text_tokens(text: &str, chars_per_token: f64) -> u64 {
    ((text.chars().count() as f64 / chars_per_token).ceil() as u64).max(1)
}

pub(super) fn parse(api: Api, body: &[u8], cfg: &SimConfig) -> Result<Parsed, BadRequest> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("invalid JSON body: {e}"), None))?;
    let Some(obj) = v.as_object() else {
        return Err(bad_request("request body must be a JSON object", None));
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => cfg.model_name.clone(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(bad_request("model must be a string", Some("model"))),
    };
    let cpt = cfg.http.chars_per_token;
    let mut embed = None;
    let mut pooling = None;
    let prompt_tokens: u64 = match api {
        Api::Pooling(kind) => {
            let p = pooling_request(kind, obj, |s| text_tokens(s, cpt))?;
            let n = p.tokens.max(1);
            pooling = Some(p);
            n
        }
        Api::Embeddings => {
            let e = embed_request(obj, |s| text_tokens(s, cpt))?;
            let n = e.tokens;
            embed = Some(e);
            n
        }
        Api::Responses => response_prompt_tokens(obj, |s| text_tokens(s, cpt))?,
        Api::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => text_tokens(s, cpt),
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut n = 0u64;
                for it in items {
                    n += match it {
                        Value::String(s) => text_tokens(s, cpt),
                        Value::Number(_) => 1,
                        Value::Array(ids) if ids.iter().all(Value::is_number) => ids.len() as u64,
                        _ => {
                            return Err(bad_request(
                                "prompt must be a string, an array of strings or token ids",
                                Some("prompt"),
                            ));
                        }
                    };
                }
                n.max(1)
            }
            _ => {
                return Err(bad_request(
                    "prompt is required (string, array of strings or token ids)",
                    Some("prompt"),
                ));
            }
        },
        Api::Chat => {
            let Some(Value::Array(msgs)) = obj.get("messages") else {
                return Err(bad_request(
                    "messages is required and must be an array",
                    Some("messages"),
                ));
            };
            if msgs.is_empty() {
                return Err(bad_request("messages must not be empty", Some("messages")));
            }
            let mut n = 0u64;
            for m in msgs {
                let Some(m) = m.as_object() else {
                    return Err(bad_request(
                        "each message must be an object",
                        Some("messages"),
                    ));
                };
                if !m.get("role").is_some_and(Value::is_string) {
                    return Err(bad_request(
                        "each message needs a string role",
                        Some("messages"),
                    ));
                }
                // A few tokens of chat template per message, as real templates add.
                n += 4;
                n += match m.get("content") {
                    None | Some(Value::Null) => 0,
                    Some(Value::String(s)) => text_tokens(s, cpt),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(|s| text_tokens(s, cpt))
                        .sum(),
                    Some(_) => {
                        return Err(bad_request(
                            "message content must be a string or an array of parts",
                            Some("messages"),
                        ));
                    }
                };
            }
            n
        }
    };
    let max_key = match api {
        Api::Chat if obj.contains_key("max_completion_tokens") => "max_completion_tokens",
        Api::Responses => "max_output_tokens",
        _ => "max_tokens",
    };
    let max_tokens = match obj.get(max_key) {
        // An embedding is its prefill: the one token the engine emits at
        // the end of the prefill step ends it, and no decode step runs.
        _ if api.prefill_only() => 1,
        None | Some(Value::Null) => cfg.http.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX),
            _ => {
                return Err(bad_request(
                    format!("{max_key} must be an integer >= 1"),
                    Some(max_key),
                ));
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        _ if api.prefill_only() => false,
        Some(Value::Bool(true)) if api == Api::Responses => {
            return Err(bad_request(
                "stream is not supported on /v1/responses by the simulator",
                Some("stream"),
            ));
        }
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad_request("stream must be a boolean", Some("stream"))),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => cfg.http.default_priority,
        Some(v) => match v.as_i64().and_then(|p| i32::try_from(p).ok()) {
            Some(p) => p,
            None => return Err(bad_request("priority must be an integer", Some("priority"))),
        },
    };
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(_) => return Err(bad_request("only n = 1 is supported", Some("n"))),
    }
    let max_len = u64::from(cfg.engine.max_model_len);
    if prompt_tokens + u64::from(max_tokens) > max_len {
        return Err(bad_request(
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). Please reduce the length of the prompt or completion.",
                prompt_tokens + u64::from(max_tokens)
            ),
            None,
        ));
    }
    Ok(Parsed {
        prefix: prefix_blocks(&model, &v, cfg),
        model,
        prompt_tokens: prompt_tokens as u32, // < max_model_len, checked above
        max_tokens,
        stream,
        include_usage,
        priority,
        embed,
        pooling,
    })
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    use super::*;

    #[test]
    fn parse_estimates_tokens_and_rejects_bad_input() {
        let cfg = SimConfig::default();
        let p = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"abcdefgh","max_tokens":5}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens, p.stream), (2, 5, false));
        let p = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"abcd"}],"stream":true}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!(p.prompt_tokens, 5);
        assert!(p.stream);
        for bad in [
            &br#"{"prompt": 3"#[..],
            br#"[1,2]"#,
            br#"{"max_tokens": 5}"#,
            br#"{"prompt": "x", "max_tokens": 0}"#,
            br#"{"prompt": "x", "stream": "yes"}"#,
            br#"{"prompt": "x", "max_tokens": 100000}"#,
        ] {
            let r = parse(Api::Completions, bad, &cfg)
                .unwrap_err()
                .into_response();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        }
        assert!(parse(Api::Chat, br#"{"messages": []}"#, &cfg).is_err());
    }

    #[test]
    fn embeddings_are_prefill_only_and_responses_take_max_output_tokens() {
        let cfg = SimConfig::default();
        // `max_tokens` and `stream` mean nothing to embeddings: one token,
        // the prefill's, ends them.
        let p = parse(
            Api::Embeddings,
            br#"{"model":"e","input":["abcd","efgh"],"max_tokens":50,"stream":true}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens, p.stream), (2, 1, false));
        assert_eq!(p.embed.map(|e| e.seeds.len()), Some(2));
        let p = parse(
            Api::Responses,
            br#"{"input":"abcdefgh","max_output_tokens":7,"max_tokens":99}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens), (2, 7));
        for bad in [
            &br#"{"input":"x","stream":true}"#[..],
            br#"{"input":[]}"#,
            br#"{"input":"x","max_output_tokens":0}"#,
        ] {
            let r = parse(Api::Responses, bad, &cfg)
                .unwrap_err()
                .into_response();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        }
        assert!(parse(Api::Embeddings, br#"{"input":[]}"#, &cfg).is_err());
    }
}
