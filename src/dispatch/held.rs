//! What the dispatcher holds of a queue: every delivery not yet settled
//! (buffered in the lookahead, parked, in flight or waiting for its result
//! to be written), with the bytes of its body. The lease keeper renews the
//! tags; the receiver bounds the bytes (`dispatch.max_buffered_bytes`,
//! issue 22: ten 8 MiB messages at once had peaked at 360 MB). Pure.

use std::collections::HashMap;

use crate::queue::DeliveryTag;

/// Unsettled deliveries and their body bytes.
#[derive(Debug, Default)]
pub(super) struct Held {
    tags: HashMap<DeliveryTag, u64>,
    bytes: u64,
    /// A decaying maximum of the body sizes taken in: what one more
    /// message may weigh.
    largest: u64,
}

impl Held {
    /// Holds `tag` with a body of `bytes`.
    pub(super) fn insert(&mut self, tag: DeliveryTag, bytes: u64) {
        // Decays by 1/64 per message, so one huge message long ago does not
        // throttle the receiver for ever.
        self.largest = bytes.max(self.largest - self.largest / 64);
        if let Some(old) = self.tags.insert(tag, bytes) {
            self.bytes = self.bytes.saturating_sub(old);
        }
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Stops holding `tag` (settled, handed back or given up); false if it
    /// was not held.
    pub(super) fn remove(&mut self, tag: &DeliveryTag) -> bool {
        match self.tags.remove(tag) {
            Some(bytes) => {
                self.bytes = self.bytes.saturating_sub(bytes);
                true
            }
            None => false,
        }
    }

    /// Whether one more body of `bytes` fits within `budget` (always,
    /// when nothing is held: a message larger than the budget goes alone).
    pub(super) fn fits(&self, bytes: u64, budget: u64) -> bool {
        self.tags.is_empty() || self.bytes.saturating_add(bytes) <= budget
    }

    /// Every tag held.
    pub(super) fn iter(&self) -> impl Iterator<Item = &DeliveryTag> {
        self.tags.keys()
    }

    /// Body bytes held.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How many more messages the receiver may pull within `budget` bytes:
    /// the room left divided by what one message may weigh (the decaying
    /// largest body seen; before any, no limit: `fits` then sends back what
    /// a first large pull brought beyond the budget). At least one while
    /// nothing is held, so a single message larger than the budget still
    /// goes (alone).
    pub(super) fn messages_within(&self, budget: u64) -> usize {
        let idle = self.tags.is_empty();
        let left = if idle {
            budget
        } else {
            budget.saturating_sub(self.bytes)
        };
        let n = usize::try_from(left / self.largest.max(1)).unwrap_or(usize::MAX);
        if idle { n.max(1) } else { n }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(s: &str) -> DeliveryTag {
        DeliveryTag(s.to_owned())
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn bytes_follow_what_is_held() {
        let mut h = Held::default();
        h.insert(tag("a"), 10);
        h.insert(tag("b"), 5);
        h.insert(tag("a"), 12);
        assert_eq!(h.bytes(), 17);
        assert!(h.remove(&tag("a")));
        assert!(!h.remove(&tag("a")));
        assert_eq!(h.bytes(), 5);
        assert_eq!(h.iter().count(), 1);
    }

    #[test]
    fn large_bodies_bound_the_pull_by_the_budget() {
        let mut h = Held::default();
        // Nothing seen yet: no estimate (`fits` guards the first pull).
        assert_eq!(h.messages_within(256 * MIB), (256 * MIB) as usize);
        assert!(h.fits(300 * MIB, 256 * MIB), "anything fits an empty hold");
        h.insert(tag("a"), 8 * MIB);
        assert!(h.fits(248 * MIB, 256 * MIB));
        assert!(!h.fits(248 * MIB + 1, 256 * MIB));
        // 248 MiB left, 8 MiB per message.
        assert_eq!(h.messages_within(256 * MIB), 31);
        for i in 0..31 {
            h.insert(tag(&format!("m{i}")), 8 * MIB);
        }
        assert_eq!(h.bytes(), 256 * MIB);
        assert_eq!(h.messages_within(256 * MIB), 0, "full");
        // Never more than the budget: at most 32 messages of 8 MiB.
        assert!(h.bytes() <= 256 * MIB);
    }

    #[test]
    fn one_message_over_the_budget_still_goes_alone() {
        let mut h = Held::default();
        h.insert(tag("huge"), 300 * MIB);
        assert_eq!(h.messages_within(256 * MIB), 0, "not beside it");
        h.remove(&tag("huge"));
        assert_eq!(h.messages_within(256 * MIB), 1, "alone");
    }

    #[test]
    fn the_largest_body_decays_with_small_ones() {
        let mut h = Held::default();
        h.insert(tag("big"), 64 * MIB);
        h.remove(&tag("big"));
        for i in 0..1000 {
            h.insert(tag(&format!("s{i}")), 1024);
            h.remove(&tag(&format!("s{i}")));
        }
        // 64 MiB × (63/64)^1000 is under 1 KiB: the largest is the small
        // messages' size again, and they pull freely.
        assert_eq!(h.messages_within(256 * MIB), 256 * 1024);
    }
}
