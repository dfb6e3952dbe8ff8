//! The prefix cache of one simulated replica, after vLLM V1's automatic
//! prefix caching: full KV blocks of prompts are kept under their block
//! identity (a hash chained on the predecessor's, `crate::prompt`), shared
//! by every running sequence whose prompt starts with them, and kept after
//! the last one lets go until the space is needed: free cached blocks are
//! evicted least recently freed first. Pure bookkeeping; the engine owns
//! the block counts (`sim::engine`).

use std::collections::{BTreeMap, HashMap};

/// A cached block.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Running sequences holding it; 0 = free, evictable.
    refs: u32,
    /// Its key in [`PrefixCache::free`] while free.
    stamp: u64,
}

/// Cached blocks by identity, and the free ones in eviction order.
#[derive(Debug, Default)]
pub(crate) struct PrefixCache {
    /// Every cached block (held or free).
    blocks: HashMap<u64, Entry>,
    /// Free cached blocks by the time they were freed (a counter): the
    /// first is evicted first. A `BTreeMap` so eviction order never
    /// depends on hashing.
    free: BTreeMap<u64, u64>,
    /// The next stamp.
    next_stamp: u64,
}

impl PrefixCache {
    /// Free cached blocks: free KV space that still holds a prefix.
    pub(crate) fn free_len(&self) -> u32 {
        u32::try_from(self.free.len()).unwrap_or(u32::MAX)
    }

    /// How many of `ids` lead with cached blocks (at most `max`), and how
    /// many of those are free (taking them costs free space).
    pub(crate) fn hits(&self, ids: &[u64], max: usize) -> (u32, u32) {
        let (mut hit, mut free) = (0u32, 0u32);
        for id in ids.iter().take(max) {
            let Some(e) = self.blocks.get(id) else {
                break;
            };
            hit += 1;
            free += u32::from(e.refs == 0);
        }
        (hit, free)
    }

    /// One more holder of cached block `id`; true when it was free (it
    /// leaves the free space). The caller checked it is cached.
    pub(crate) fn acquire(&mut self, id: u64) -> bool {
        let Some(e) = self.blocks.get_mut(&id) else {
            return false;
        };
        e.refs += 1;
        let was_free = e.refs == 1;
        if was_free {
            self.free.remove(&e.stamp);
        }
        was_free
    }

    /// A block just computed by a holder: cached from now on. `Some(was
    /// free)` when an equal block was cached already (computed by another
    /// sequence meanwhile): the holder joins it, and its own copy is
    /// surplus.
    pub(crate) fn hold_computed(&mut self, id: u64) -> Option<bool> {
        if self.blocks.contains_key(&id) {
            return Some(self.acquire(id));
        }
        self.blocks.insert(id, Entry { refs: 1, stamp: 0 });
        None
    }

    /// A holder lets go of `id`; true when it became free (it joins the
    /// free space, still cached).
    pub(crate) fn release(&mut self, id: u64) -> bool {
        let Some(e) = self.blocks.get_mut(&id) else {
            return false;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs > 0 {
            return false;
        }
        e.stamp = self.next_stamp;
        self.free.insert(self.next_stamp, id);
        self.next_stamp += 1;
        true
    }

    /// Drops the `n` least recently freed blocks from the cache (their
    /// space is being allocated).
    pub(crate) fn evict(&mut self, n: u32) {
        for _ in 0..n {
            let Some((_, id)) = self.free.pop_first() else {
                return;
            };
            self.blocks.remove(&id);
        }
    }

    /// Forgets everything (the engine was emptied).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.free.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_count_the_leading_run_and_its_free_blocks() {
        let mut c = PrefixCache::default();
        for id in [1, 2, 3] {
            assert_eq!(c.hold_computed(id), None);
        }
        assert!(c.release(3));
        assert_eq!(c.hits(&[1, 2, 3, 4], 10), (3, 1));
        assert_eq!(
            c.hits(&[1, 9, 3], 10),
            (1, 0),
            "the run stops at the first miss"
        );
        assert_eq!(c.hits(&[1, 2, 3], 2), (2, 0), "capped");
        assert!(c.acquire(3), "a free block taken leaves the free space");
        assert_eq!(c.free_len(), 0);
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_first() {
        let mut c = PrefixCache::default();
        for id in [1, 2, 3] {
            c.hold_computed(id);
        }
        for id in [2, 1, 3] {
            c.release(id);
        }
        c.evict(2);
        assert_eq!(c.hits(&[3], 1), (1, 1));
        assert_eq!(c.hits(&[1], 1), (0, 0));
        assert_eq!(c.hits(&[2], 1), (0, 0));
        assert_eq!(c.hold_computed(3), Some(true), "joins the cached copy");
    }
}
