//! Fair shares among the tenants of one queue: the pure scheduling of the
//! receiver's lookahead buffer (`receive.rs` holds the leases and does the
//! I/O).
//!
//! The queue hands out messages earliest deadline first, whoever sent them,
//! so one tenant's backlog at the head would take the whole window, and a
//! tenant its gate refuses would be asked again for every message before
//! anyone behind it gets a turn (upstream's weakness; `docs/compatibility.md`
//! item 5). The receiver instead
//! pulls a bounded lookahead and releases from it by deficit round robin
//! over the tenant (the `[gateway] fairness_attribute` of each message):
//! every visit credits a tenant `weight × quantum` of window units and it
//! sends while its credit covers its next message; within a tenant,
//! messages go earliest deadline first, so EDF holds per tenant.
//!
//! A tenant the gate refuses is *blocked* for the requeue delay: its
//! buffered messages go back to the queue at once and new ones are returned
//! unasked until the block ends, so its refusals cost the others one queue
//! round trip per message, never a gate call or a turn.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// One buffered message: ordered by deadline, then arrival.
#[derive(Debug)]
struct Entry<T> {
    deadline: i64,
    seq: u64,
    cost: u64,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.deadline, self.seq) == (other.deadline, other.seq)
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.deadline, self.seq).cmp(&(other.deadline, other.seq))
    }
}

#[derive(Debug)]
struct Tenant<T> {
    /// Earliest deadline on top.
    queue: BinaryHeap<Reverse<Entry<T>>>,
    /// Window units this tenant may still send this round.
    deficit: u64,
    /// Refused until then: skipped, and its new messages returned unasked.
    blocked_until: Option<Instant>,
}

impl<T> Default for Tenant<T> {
    fn default() -> Self {
        Self {
            queue: BinaryHeap::new(),
            deficit: 0,
            blocked_until: None,
        }
    }
}

/// The lookahead buffer of one queue, scheduled by weighted deficit round
/// robin over tenants.
#[derive(Debug)]
pub(crate) struct FairQueue<T> {
    tenants: HashMap<String, Tenant<T>>,
    /// Tenants with buffered messages, in visiting order; the front is
    /// being served.
    ring: VecDeque<String>,
    weights: BTreeMap<String, u32>,
    /// Credit per visit per unit of weight, in window units.
    quantum: u64,
    len: usize,
    seq: u64,
}

/// Weight of a tenant the configuration does not name.
pub(crate) const DEFAULT_WEIGHT: u32 = 1;

impl<T> FairQueue<T> {
    /// An empty buffer; `weights` by tenant (others weigh
    /// [`DEFAULT_WEIGHT`]), `quantum` window units per visit per weight.
    pub(crate) fn new(weights: BTreeMap<String, u32>, quantum: u64) -> Self {
        Self {
            tenants: HashMap::new(),
            ring: VecDeque::new(),
            weights,
            quantum: quantum.max(1),
            len: 0,
            seq: 0,
        }
    }

    /// Messages buffered.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is buffered.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn weight(&self, tenant: &str) -> u64 {
        u64::from(
            self.weights
                .get(tenant)
                .copied()
                .unwrap_or(DEFAULT_WEIGHT)
                .max(1),
        )
    }

    /// How much longer `tenant` is blocked at `now`, if it is.
    pub(crate) fn blocked(&self, tenant: &str, now: Instant) -> Option<Duration> {
        self.tenants
            .get(tenant)
            .and_then(|t| t.blocked_until)
            .filter(|until| *until > now)
            .map(|until| until - now)
    }

    /// Whether [`Self::pop`] at `now` would release something: a tenant
    /// with a message that is not blocked. One step per buffered tenant.
    pub(crate) fn has_ready(&self, now: Instant) -> bool {
        self.ring.iter().any(|name| {
            self.tenants.get(name).is_some_and(|t| {
                !t.queue.is_empty() && t.blocked_until.is_none_or(|until| until <= now)
            })
        })
    }

    /// Buffers `item` of `tenant` with its deadline (Unix s) and cost in
    /// window units.
    pub(crate) fn push(&mut self, tenant: &str, deadline: i64, cost: u64, item: T) {
        self.seq += 1;
        let t = self.tenants.entry(tenant.to_owned()).or_default();
        if t.queue.is_empty() {
            self.ring.push_back(tenant.to_owned());
        }
        t.queue.push(Reverse(Entry {
            deadline,
            seq: self.seq,
            cost,
            item,
        }));
        self.len += 1;
    }

    /// The next message to release at `now`, with its tenant: deficit
    /// round robin over the tenants not blocked, earliest deadline first
    /// within one. `None` when every buffered tenant is blocked (or
    /// nothing is buffered).
    pub(crate) fn pop(&mut self, now: Instant) -> Option<(String, T)> {
        // Each pass over the ring credits every unblocked tenant at least
        // its head's cost, so two passes always find one.
        let mut skipped_blocked = 0usize;
        let mut visits = 0usize;
        while let Some(name) = self.ring.front().cloned() {
            visits += 1;
            if skipped_blocked >= self.ring.len() || visits > 2 * self.ring.len() + 2 {
                return None;
            }
            let weight = self.weight(&name);
            let quantum = self.quantum;
            let Some(t) = self.tenants.get_mut(&name) else {
                self.ring.pop_front();
                continue;
            };
            if t.blocked_until.is_some_and(|until| until > now) {
                skipped_blocked += 1;
                self.ring.rotate_left(1);
                continue;
            }
            skipped_blocked = 0;
            let Some(head_cost) = t.queue.peek().map(|Reverse(e)| e.cost) else {
                t.deficit = 0;
                self.ring.pop_front();
                continue;
            };
            if t.deficit < head_cost {
                // A message dearer than the quantum is still sent on this
                // visit: credit at least its cost per unit of weight.
                t.deficit = t
                    .deficit
                    .saturating_add(weight.saturating_mul(quantum.max(head_cost)));
                // A fresh credit is spent on this visit; the next tenant
                // is visited when it runs out.
                if t.deficit < head_cost {
                    self.ring.rotate_left(1);
                    continue;
                }
            }
            let Reverse(entry) = t.queue.pop()?;
            t.deficit -= entry.cost;
            self.len -= 1;
            if t.queue.is_empty() {
                // An idle tenant keeps no credit (DRR): it cannot save up
                // a burst while it has nothing queued.
                t.deficit = 0;
                self.ring.pop_front();
                if t.blocked_until.is_none() {
                    self.tenants.remove(&name);
                }
            } else if t.deficit < t.queue.peek().map_or(0, |Reverse(e)| e.cost) {
                self.ring.rotate_left(1);
            }
            return Some((name, entry.item));
        }
        None
    }

    /// Blocks `tenant` until `until` and hands back its buffered messages
    /// (to be requeued).
    pub(crate) fn block(&mut self, tenant: &str, until: Instant) -> Vec<T> {
        let t = self.tenants.entry(tenant.to_owned()).or_default();
        t.blocked_until = Some(until);
        t.deficit = 0;
        let taken: Vec<T> = std::mem::take(&mut t.queue)
            .into_sorted_vec()
            .into_iter()
            .rev()
            .map(|Reverse(e)| e.item)
            .collect();
        self.len -= taken.len();
        self.ring.retain(|n| n != tenant);
        taken
    }

    /// Forgets blocks that ended before `now` (bounded memory with many
    /// tenants).
    pub(crate) fn expire_blocks(&mut self, now: Instant) {
        self.tenants.retain(|_, t| {
            if t.blocked_until.is_some_and(|until| until <= now) {
                t.blocked_until = None;
            }
            t.blocked_until.is_some() || !t.queue.is_empty()
        });
    }

    /// Takes every buffered message whose deadline (Unix s) is at or before
    /// `now_unix`, whatever its tenant's turn or block: an expired message
    /// is answered, not sent, so it must not wait for room (issue 22).
    pub(crate) fn take_expired(&mut self, now_unix: i64) -> Vec<T> {
        let mut out = Vec::new();
        let mut emptied = Vec::new();
        for (name, t) in &mut self.tenants {
            let before = out.len();
            while t
                .queue
                .peek()
                .is_some_and(|Reverse(e)| e.deadline <= now_unix)
            {
                if let Some(Reverse(e)) = t.queue.pop() {
                    out.push(e.item);
                }
            }
            if out.len() > before && t.queue.is_empty() {
                t.deficit = 0;
                emptied.push(name.clone());
            }
        }
        if !emptied.is_empty() {
            // An emptied tenant leaves the ring, as `pop` would take it out,
            // so a later `push` does not put it in twice.
            self.ring.retain(|n| !emptied.contains(n));
            self.tenants
                .retain(|_, t| t.blocked_until.is_some() || !t.queue.is_empty());
        }
        self.len -= out.len();
        out
    }

    /// Everything buffered (shutdown), earliest deadline first per tenant.
    pub(crate) fn drain(&mut self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len);
        for (_, t) in self.tenants.drain() {
            out.extend(
                t.queue
                    .into_sorted_vec()
                    .into_iter()
                    .rev()
                    .map(|Reverse(e)| e.item),
            );
        }
        self.ring.clear();
        self.len = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn weights(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn has_ready_says_whether_pop_would_release_something() {
        let mut q = FairQueue::new(BTreeMap::new(), 1);
        let now = Instant::now();
        assert!(!q.has_ready(now), "empty");
        q.push("a", 10, 1, "a10");
        let _ = q.block("a", now + Duration::from_secs(60));
        q.push("a", 11, 1, "a11");
        assert!(!q.has_ready(now), "only a blocked tenant");
        assert!(q.pop(now).is_none());
        assert!(
            q.has_ready(now + Duration::from_secs(61)),
            "the block ended"
        );
        q.push("b", 12, 1, "b12");
        assert!(q.has_ready(now));
        assert_eq!(q.pop(now).map(|(t, _)| t).as_deref(), Some("b"));
        assert!(!q.has_ready(now));
    }

    #[test]
    fn expired_messages_leave_the_buffer_whatever_their_turn() {
        let mut q = FairQueue::new(BTreeMap::new(), 1);
        let now = Instant::now();
        q.push("a", 10, 1, "a10");
        q.push("a", 30, 1, "a30");
        q.push("b", 5, 1, "b5");
        q.push("c", 40, 1, "c40");
        // A blocked tenant's expired messages are taken too.
        q.push("d", 8, 1, "d8");
        let _ = q.block("d", now + Duration::from_secs(60));
        q.push("d", 9, 1, "d9");
        let mut expired = q.take_expired(20);
        expired.sort_unstable();
        assert_eq!(expired, ["a10", "b5", "d9"]);
        assert_eq!(q.len(), 2);
        assert!(q.take_expired(20).is_empty());
        // b left the ring: pushing it again does not give it two turns.
        q.push("b", 50, 1, "b50");
        let mut order = Vec::new();
        while let Some((_, item)) = q.pop(now) {
            order.push(item);
        }
        order.sort_unstable();
        assert_eq!(order, ["a30", "b50", "c40"]);
        assert!(q.is_empty());
    }

    #[test]
    fn equal_weights_alternate_and_edf_holds_within_a_tenant() {
        let mut q = FairQueue::new(BTreeMap::new(), 1);
        let now = Instant::now();
        for d in [30, 10, 20] {
            q.push("a", d, 1, format!("a{d}"));
            q.push("b", d + 100, 1, format!("b{}", d + 100));
        }
        let order: Vec<String> = std::iter::from_fn(|| q.pop(now).map(|(_, x)| x)).collect();
        assert_eq!(order, ["a10", "b110", "a20", "b120", "a30", "b130"]);
        assert!(q.is_empty());
    }

    #[test]
    fn weights_share_by_ratio() {
        let mut q = FairQueue::new(weights(&[("a", 3)]), 1);
        let now = Instant::now();
        for i in 0..100 {
            q.push("a", i, 1, "a");
            q.push("b", i, 1, "b");
        }
        let first: Vec<&str> = (0..40).filter_map(|_| q.pop(now).map(|(_, x)| x)).collect();
        let a = first.iter().filter(|x| **x == "a").count();
        assert_eq!(a, 30, "{first:?}");
    }

    #[test]
    fn a_blocked_tenant_is_skipped_and_returns_its_messages() {
        let mut q = FairQueue::new(BTreeMap::new(), 1);
        let now = Instant::now();
        for i in 0..5 {
            q.push("a", i, 1, format!("a{i}"));
        }
        q.push("b", 99, 1, "b".to_owned());
        let back = q.block("a", now + Duration::from_secs(5));
        assert_eq!(back, ["a0", "a1", "a2", "a3", "a4"]);
        assert_eq!(q.blocked("a", now), Some(Duration::from_secs(5)));
        assert_eq!(q.pop(now), Some(("b".to_owned(), "b".to_owned())));
        assert_eq!(q.pop(now), None);
        // Buffered while blocked (the receiver returns them instead, but
        // the queue must still skip them), then served once the block ends.
        q.push("a", 7, 1, "a7".to_owned());
        assert_eq!(q.pop(now), None);
        let later = now + Duration::from_secs(6);
        assert_eq!(q.blocked("a", later), None);
        assert_eq!(q.pop(later), Some(("a".to_owned(), "a7".to_owned())));
        q.expire_blocks(later);
        assert!(q.tenants.is_empty());
    }

    #[test]
    fn dear_messages_are_sent_and_charged() {
        // Token-counted queues: a message costing more than the quantum
        // still goes, and its tenant then waits its turn.
        let mut q = FairQueue::new(BTreeMap::new(), 10);
        let now = Instant::now();
        q.push("a", 1, 500, "a-big");
        q.push("a", 2, 5, "a-small");
        q.push("b", 3, 5, "b");
        assert_eq!(q.pop(now).map(|x| x.1), Some("a-big"));
        assert_eq!(q.pop(now).map(|x| x.1), Some("b"));
        assert_eq!(q.pop(now).map(|x| x.1), Some("a-small"));
    }

    proptest! {
        /// Nothing is lost or duplicated, and each tenant's messages come
        /// out in deadline order, whatever is pushed, popped or blocked.
        #[test]
        fn conserves_messages_and_keeps_edf_per_tenant(
            ops in proptest::collection::vec((0u8..4, 0u8..4, 0i64..50, 1u64..20), 1..200),
            w in 1u32..5,
        ) {
            let mut q = FairQueue::new(weights(&[("t0", w)]), 4);
            let now = Instant::now();
            let mut pushed = 0usize;
            let mut out: Vec<(String, (i64, usize))> = Vec::new();
            let mut returned = 0usize;
            for (i, (op, tenant, deadline, cost)) in ops.into_iter().enumerate() {
                let name = format!("t{tenant}");
                match op {
                    0 | 1 => { q.push(&name, deadline, cost, (deadline, i)); pushed += 1; }
                    2 => { if let Some((t, x)) = q.pop(now) { out.push((t, x)); } }
                    _ => {
                        returned += q.block(&name, now + Duration::from_millis(1)).len();
                    }
                }
                prop_assert!(q.len() + out.len() + returned == pushed);
            }
            let later = now + Duration::from_secs(1);
            let mut tail = Vec::new();
            while let Some((t, x)) = q.pop(later) { tail.push((t, x)); }
            prop_assert!(q.is_empty());
            prop_assert_eq!(out.len() + tail.len() + returned, pushed);
            for t in 0..4 {
                let name = format!("t{t}");
                let d: Vec<i64> = tail.iter().filter(|(n, _)| *n == name).map(|(_, x)| x.0).collect();
                prop_assert!(d.windows(2).all(|p| p[0] <= p[1]), "{:?}", d);
            }
        }

        /// Among tenants that always have work, shares follow the weights.
        #[test]
        fn backlogged_shares_follow_weights(wa in 1u32..6, wb in 1u32..6) {
            let mut q = FairQueue::new(weights(&[("a", wa), ("b", wb)]), 1);
            let now = Instant::now();
            let rounds = 60 * (wa + wb) as usize;
            for i in 0..rounds {
                q.push("a", i as i64, 1, 'a');
                q.push("b", i as i64, 1, 'b');
            }
            let taken = 20 * (wa + wb) as usize;
            let a = (0..taken).filter_map(|_| q.pop(now)).filter(|(_, x)| *x == 'a').count();
            prop_assert_eq!(a, 20 * wa as usize);
        }
    }
}
