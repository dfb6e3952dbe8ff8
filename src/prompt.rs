//! The prompt of an OpenAI request body as text, and the identities of
//! its leading blocks: the tokenization proxy that the simulator's prefix
//! cache (`sim::engine`) and `serve`'s prefix order (`serve::order`)
//! share, so "two requests share a prefix" means the same thing to both.
//!
//! No tokenizer runs. A prompt is rendered to text ([`text`]) and cut into
//! fixed-size character chunks ([`blocks`]); a chunk stands for one KV
//! block (the simulator uses `block_size × chars_per_token` characters,
//! 16 × 4 = 64 by default, the same 4 characters per token it counts
//! prompt tokens with). As in vLLM's automatic prefix caching, a block's
//! identity is a hash chained on its predecessor's, so equal identities at
//! position `k` mean the whole prefix up to `k` is equal. Only full chunks
//! get an identity: a trailing partial block is never cached. Pure, no I/O.

use serde_json::Value;

/// FNV-1a, 64 bits, continued from `state` (start with [`FNV_OFFSET`]): a
/// stable hash of bytes that needs no table and no random seed, so block
/// identities are the same in every process and every run.
pub fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    let mut hash = state;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The FNV-1a 64-bit offset basis: the state of an empty hash.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The prompt text of an OpenAI request body, in the order the model
/// reads it: `instructions` (Responses), then chat `messages` (each as
/// `role`, a newline, its text and a newline), the completion `prompt`, or
/// the `input` of embeddings and Responses (strings, token ids written as
/// decimal numbers, Responses input items as messages). Parts that carry
/// no text (images, tool calls) add nothing. A body with none of these
/// fields renders empty.
pub fn text(body: &Value) -> String {
    let mut out = String::new();
    if let Some(Value::String(s)) = body.get("instructions") {
        out.push_str(s);
        out.push('\n');
    }
    for key in ["messages", "prompt", "input"] {
        if let Some(v) = body.get(key) {
            render(v, &mut out);
        }
    }
    out
}

/// Appends one prompt value: a string, a token id, a message object, or
/// an array of them.
fn render(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => out.push_str(s),
        Value::Number(n) => {
            out.push_str(&n.to_string());
            out.push(' ');
        }
        Value::Array(items) => {
            for item in items {
                render(item, out);
            }
        }
        Value::Object(m) => {
            // A message or Responses input item: its role heads it, so a
            // system prompt and a user turn with the same words differ.
            if let Some(Value::String(role)) = m.get("role") {
                out.push_str(role);
                out.push('\n');
            }
            match (m.get("content"), m.get("text")) {
                (Some(content), _) => render_content(content, out),
                (None, Some(Value::String(t))) => out.push_str(t),
                _ => {}
            }
            out.push('\n');
        }
        Value::Null | Value::Bool(_) => {}
    }
}

/// A message's `content`: a string, or content parts of which only the
/// `text` ones are read.
fn render_content(content: &Value, out: &mut String) {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for part in parts {
                if let Some(t) = part.get("text").and_then(Value::as_str) {
                    out.push_str(t);
                }
            }
        }
        _ => {}
    }
}

/// The identities of the first `max_blocks` full blocks of `text`, blocks
/// of `chars_per_block` characters (at least 1). The chain starts from a
/// hash of `scope` (the model name: equal text sent to another model
/// shares nothing), and each identity hashes its predecessor's with the
/// block's bytes.
pub fn blocks(scope: &str, text: &str, chars_per_block: usize, max_blocks: usize) -> Vec<u64> {
    let per = chars_per_block.max(1);
    let mut out = Vec::new();
    let mut prev = fnv1a(FNV_OFFSET, scope.as_bytes());
    let (mut start, mut chars) = (0usize, 0usize);
    for (at, c) in text.char_indices() {
        chars += 1;
        if chars < per {
            continue;
        }
        if out.len() >= max_blocks {
            break;
        }
        let end = at + c.len_utf8();
        prev = fnv1a(
            fnv1a(FNV_OFFSET, &prev.to_le_bytes()),
            &text.as_bytes()[start..end],
        );
        out.push(prev);
        (start, chars) = (end, 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn chat_messages_render_with_their_roles_in_order() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        ]});
        assert_eq!(text(&body), "system\nBe brief.\nuser\nHi\n");
    }

    #[test]
    fn prompts_inputs_and_instructions_render() {
        assert_eq!(text(&json!({"prompt": "abc"})), "abc");
        assert_eq!(text(&json!({"prompt": [1, 2]})), "1 2 ");
        assert_eq!(text(&json!({"input": ["a", "b"]})), "ab");
        assert_eq!(
            text(&json!({"instructions": "Be kind.", "input": [{"role": "user", "content": "x"}]})),
            "Be kind.\nuser\nx\n"
        );
        assert_eq!(text(&json!({"model": "m"})), "");
    }

    #[test]
    fn blocks_are_full_chunks_chained_on_their_predecessor() {
        let a = blocks("m", "aaaabbbbcc", 4, 100);
        assert_eq!(a.len(), 2, "the partial chunk `cc` has no identity");
        let b = blocks("m", "aaaabbbbdddd", 4, 100);
        assert_eq!(a[..], b[..2], "a shared prefix gives equal identities");
        let c = blocks("m", "xaaabbbb", 4, 100);
        assert_ne!(a[0], c[0]);
        assert_ne!(
            a[1], c[1],
            "a different first block changes every later identity"
        );
        assert_ne!(blocks("other", "aaaa", 4, 1), blocks("m", "aaaa", 4, 1));
        assert_eq!(blocks("m", "aaaabbbbcccc", 4, 2).len(), 2, "capped");
    }

    #[test]
    fn blocks_count_characters_not_bytes() {
        let ids = blocks("m", "ééééé", 2, 100);
        assert_eq!(ids.len(), 2);
        assert_eq!(ids, blocks("m", "éééé", 2, 100));
    }
}
