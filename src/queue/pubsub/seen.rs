//! Which messages this process already answered (issue 36): Pub/Sub
//! delivers at least once, and it redelivers a message whose ack was lost
//! or whose ack deadline ran out even after its result is confirmed on the
//! topic. Sending such a delivery again makes the pool do the work twice,
//! in exactly the storms where capacity is scarcest. A redelivery of a
//! message answered here is acked instead, without a second inference.
//! Pure: no I/O.
//!
//! A message is known by its broker message id *and* a hash of its data:
//! the emulator numbers message ids from 1 again after a restart, so an id
//! alone could name a new message that must be answered, never acked
//! unseen.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};

/// How many answered messages are remembered. A redelivery of an answered
/// message comes within an ack deadline or a retry backoff of its ack (at
/// most minutes); at hundreds of results a second this still covers
/// minutes, and costs a few MB at most (a message id and a hash each).
pub(super) const REMEMBERED: usize = 50_000;

/// One message: its broker id and a hash of its data.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct MessageKey {
    message_id: String,
    data_hash: u64,
}

impl MessageKey {
    pub(super) fn new(message_id: &str, data: &[u8]) -> Self {
        let mut hasher = DefaultHasher::new();
        data.hash(&mut hasher);
        Self {
            message_id: message_id.to_owned(),
            data_hash: hasher.finish(),
        }
    }
}

/// The last [`REMEMBERED`] (or `capacity`) messages answered, oldest
/// forgotten first.
#[derive(Debug)]
pub(super) struct Answered {
    keys: HashSet<MessageKey>,
    order: VecDeque<MessageKey>,
    capacity: usize,
}

impl Default for Answered {
    fn default() -> Self {
        Self::with_capacity(REMEMBERED)
    }
}

impl Answered {
    pub(super) fn with_capacity(capacity: usize) -> Self {
        Self {
            keys: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers that `key`'s result is confirmed on the result topic.
    pub(super) fn insert(&mut self, key: MessageKey) {
        if !self.keys.insert(key.clone()) {
            return;
        }
        self.order.push_back(key);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.keys.remove(&old);
            }
        }
    }

    pub(super) fn contains(&self, key: &MessageKey) -> bool {
        self.keys.contains(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_its_id_and_its_data() {
        let mut answered = Answered::default();
        answered.insert(MessageKey::new("1", b"a"));
        assert!(answered.contains(&MessageKey::new("1", b"a")));
        // The emulator after a restart: the same id on another message.
        assert!(!answered.contains(&MessageKey::new("1", b"b")));
        assert!(!answered.contains(&MessageKey::new("2", b"a")));
    }

    #[test]
    fn the_oldest_answers_are_forgotten_past_the_capacity() {
        let mut answered = Answered::with_capacity(2);
        for id in ["1", "2", "2", "3"] {
            answered.insert(MessageKey::new(id, b"x"));
        }
        assert!(!answered.contains(&MessageKey::new("1", b"x")));
        assert!(answered.contains(&MessageKey::new("2", b"x")));
        assert!(answered.contains(&MessageKey::new("3", b"x")));
    }
}
