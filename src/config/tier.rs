//! A queue's priority tier (its `tier` label, upstream's
//! `api.PriorityTier`): checked when the config loads, ordered by the
//! `tier-priority` merge policy (`dispatch::merge`).

/// A queue's priority tier, highest first (upstream's `api.PriorityTier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// `interactive`: served first.
    Interactive = 0,
    /// `async`.
    Async = 1,
    /// `batch`: served last (also a queue without the tier label).
    Batch = 2,
}

impl Tier {
    /// Every tier, highest first, with its label value.
    pub const ALL: [(&'static str, Tier); 3] = [
        ("interactive", Tier::Interactive),
        ("async", Tier::Async),
        ("batch", Tier::Batch),
    ];

    /// The tier a label value names; `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.iter().find(|(s, _)| *s == value).map(|(_, t)| *t)
    }

    /// 0 for the highest tier.
    pub fn index(self) -> usize {
        self as usize
    }

    /// This tier's bit in a set of tiers (`dispatch::merge`).
    pub(crate) fn bit(self) -> u8 {
        1 << self.index()
    }

    /// The value of upstream's priority header for this tier:
    /// `class × 3 + tier`, `class` 0 for a message classified `reserved`
    /// by a quota gate and 1 otherwise (overflow or unclassified).
    pub fn priority_index(self, reserved: bool) -> u8 {
        let class = if reserved { 0 } else { 1 };
        class * 3 + self as u8
    }
}
