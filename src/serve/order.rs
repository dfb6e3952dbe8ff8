//! The order a batch's lines are enqueued (and so dispatched) in:
//! `arrival` (the input file's order, the default) or `model-prefix`
//! (grouped by model, then by shared prompt prefix, so lines that share a
//! long prefix reach the pool one after another and the engines' prefix
//! cache holds it while they run). Chosen per server (`serve.order`) and
//! per batch (metadata key [`METADATA_KEY`]), fixed in the batch's record
//! at creation. Pure: the intake reads the file (`engine/lines.rs`).
//!
//! llm-d's batch gateway has the same idea as its `model-prefix-v1`
//! policy (sort by model, then by a hash of the system prompt, then by
//! position; `docs/compatibility.md`). Here the prefix is the whole
//! prompt as the engine reads it (`crate::prompt::text`), compared in
//! blocks of [`KEY_CHARS_PER_BLOCK`] characters by their chained
//! identities: lines with the same system prompt are grouped as there,
//! and within a group those that also share the start of their user
//! turn sit together too.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::ServeOrder;

/// The batch metadata key that picks a batch's order (its value is an
/// [`Order`] spelling), overriding `serve.order`.
pub const METADATA_KEY: &str = "sluicegate_order";

/// Characters per prefix block of the sort key: 16 tokens at the 4
/// characters per token the simulator and the token estimate count,
/// vLLM's default block size.
pub const KEY_CHARS_PER_BLOCK: usize = 64;

/// Blocks of a prompt the sort key compares (16 384 characters, about
/// 4 096 tokens): lines that share more are ordered by position beyond
/// it. A key holds 8 bytes per 64 characters of prompt (and the model
/// name), so the keys of a whole file stay a fraction of its size.
pub const KEY_MAX_BLOCKS: usize = 256;

/// How a batch's lines are ordered before they are enqueued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// As in the input file (OpenAI's behaviour).
    #[default]
    Arrival,
    /// By model, then by shared prompt prefix, ties by position.
    ModelPrefix,
}

impl Order {
    /// The order spelled `text` (a spelling `serve.order` accepts, so a
    /// batch's metadata and the config take the same words), if it is one.
    pub fn parse(text: &str) -> Option<Self> {
        ServeOrder::CHOICES
            .iter()
            .find(|(name, _)| *name == text)
            .map(|(_, order)| Self::from(*order))
    }

    /// Every accepted spelling, for error messages.
    pub fn spellings() -> String {
        let names: Vec<&str> = ServeOrder::CHOICES.iter().map(|(n, _)| *n).collect();
        names.join(", ")
    }

    /// The canonical spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Arrival => "arrival",
            Self::ModelPrefix => "model-prefix",
        }
    }

    /// Whether this is the default (left out of stored records).
    pub fn is_arrival(&self) -> bool {
        *self == Self::Arrival
    }
}

impl From<ServeOrder> for Order {
    fn from(order: ServeOrder) -> Self {
        match order {
            ServeOrder::Arrival => Self::Arrival,
            ServeOrder::ModelPrefix => Self::ModelPrefix,
        }
    }
}

/// What a line is sorted by: its model, then the identities of its
/// prompt's leading blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Key {
    /// `body.model` (empty when absent).
    pub model: String,
    /// `crate::prompt::blocks` of the prompt, at most [`KEY_MAX_BLOCKS`].
    pub blocks: Vec<u64>,
}

impl Key {
    /// The key of a batch line's `body`.
    pub fn of(body: &Value) -> Self {
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let text = crate::prompt::text(body);
        let blocks = crate::prompt::blocks(&model, &text, KEY_CHARS_PER_BLOCK, KEY_MAX_BLOCKS);
        Self { model, blocks }
    }
}

/// The dispatch order of lines with `keys` (in file order): a permutation
/// of `0..keys.len()`. Lines are grouped by model (in name order); within
/// a model, sorted by their block identities compared one by one, so
/// lines that share `k` leading blocks are contiguous for every `k`, and
/// each line's neighbours share with it the longest prefix any other line
/// does. Equal keys keep file order (a stable sort), so the permutation
/// is a function of the keys alone: the same file always gives the same
/// order, also in an intake resumed after a crash.
pub fn plan(keys: &[Key]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..keys.len())
        .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
        .collect();
    order.sort_by(|&a, &b| compare(&keys[a as usize], &keys[b as usize]));
    order
}

fn compare(a: &Key, b: &Key) -> Ordering {
    a.model.cmp(&b.model).then_with(|| a.blocks.cmp(&b.blocks))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(model: &str, system: &str, user: &str) -> Key {
        Key::of(&json!({"model": model, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]}))
    }

    fn long(c: char, n: usize) -> String {
        std::iter::repeat_n(c, n).collect()
    }

    /// Characters two keys' lines share, in whole blocks.
    fn shared_blocks(a: &Key, b: &Key) -> usize {
        if a.model != b.model {
            return 0;
        }
        a.blocks
            .iter()
            .zip(&b.blocks)
            .take_while(|(x, y)| x == y)
            .count()
    }

    #[test]
    fn lines_group_by_model_first() {
        let keys = [
            chat("m2", "x", "1"),
            chat("m1", "x", "2"),
            chat("m2", "x", "3"),
            chat("m1", "x", "4"),
        ];
        assert_eq!(plan(&keys), vec![1, 3, 0, 2]);
    }

    #[test]
    fn shared_prefixes_become_adjacent_and_ties_keep_file_order() {
        let (a, b) = (long('a', 640), long('b', 640));
        let keys = [
            chat("m", &a, "q1"),
            chat("m", &b, "q2"),
            chat("m", &a, "q3"),
            chat("m", &b, "q4"),
            chat("m", &a, "q5"),
        ];
        let order = plan(&keys);
        let groups: Vec<bool> = order
            .iter()
            .map(|&i| keys[i as usize].blocks[0] == keys[0].blocks[0])
            .collect();
        assert!(
            groups == [true, true, true, false, false]
                || groups == [false, false, true, true, true],
            "{order:?}"
        );
        // The short user turns end inside a partial block: equal keys, so
        // file order within each group.
        let a_lines: Vec<u32> = order.iter().copied().filter(|i| i % 2 == 0).collect();
        assert_eq!(a_lines, vec![0, 2, 4]);
        let b_lines: Vec<u32> = order.iter().copied().filter(|i| i % 2 == 1).collect();
        assert_eq!(b_lines, vec![1, 3]);
    }

    #[test]
    fn neighbours_share_the_longest_prefix_any_line_shares() {
        // Three system prompts; two of them with two shared openings of
        // the user turn: every line's best partner must be next to it.
        let systems = [long('s', 640), long('t', 640), long('u', 128)];
        let openings = [long('o', 256), long('p', 256)];
        let mut keys = Vec::new();
        for i in 0..36usize {
            let system = &systems[(i * 7) % 3];
            let opening = &openings[(i * 5) % 2];
            keys.push(chat("m", system, &format!("{opening}{i}")));
        }
        let order = plan(&keys);
        for (pos, &i) in order.iter().enumerate() {
            let me = &keys[i as usize];
            let best = (keys.iter().enumerate())
                .filter(|(j, _)| *j != i as usize)
                .map(|(_, k)| shared_blocks(me, k))
                .max()
                .unwrap_or(0);
            let next = |p: Option<usize>| {
                p.and_then(|p| order.get(p))
                    .map_or(0, |&j| shared_blocks(me, &keys[j as usize]))
            };
            let neighbour = next(pos.checked_sub(1)).max(next(Some(pos + 1)));
            assert_eq!(neighbour, best, "line {i} at {pos}");
        }
    }

    #[test]
    fn the_plan_is_a_deterministic_permutation() {
        let keys: Vec<Key> = (0..200)
            .map(|i| {
                chat(
                    ["m1", "m2"][i % 2],
                    &long('a', 64 * (i % 5)),
                    &i.to_string(),
                )
            })
            .collect();
        let order = plan(&keys);
        assert_eq!(order, plan(&keys));
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..200).collect::<Vec<u32>>());
    }

    #[test]
    fn every_order_spelling_parses_and_others_do_not() {
        assert_eq!(Order::parse("arrival"), Some(Order::Arrival));
        assert_eq!(Order::parse("model-prefix"), Some(Order::ModelPrefix));
        assert_eq!(Order::parse("model-prefix-v1"), Some(Order::ModelPrefix));
        assert_eq!(Order::parse("random"), None);
        assert_eq!(Order::spellings(), "arrival, model-prefix, model-prefix-v1");
        assert_eq!(
            serde_json::to_value(Order::ModelPrefix).expect("serialises"),
            json!("model-prefix")
        );
    }
}
