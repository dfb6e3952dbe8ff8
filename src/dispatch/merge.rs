//! Merge policies: which queue of a pool takes the next unit of window
//! room (issue 25 item 4; upstream's request merge policies).
//!
//! Pure, like `window.rs`: no I/O, no clock, no lock. The rule
//! (docs/architecture.md, "Pools"):
//! - each queue of a pool is a *lane*; a lane *contends* for the next
//!   *turn* while its receiver holds releasable work and its own window
//!   has room now. A lane with an empty queue, with every tenant
//!   blocked, or whose gate grants nothing does not contend, so it never
//!   holds the turn;
//! - a turn is one message released from the winner's buffer to its gate
//!   (its fair tenants, `fair.rs`, choose which message); it is spent
//!   whether or not the gate admits it, so a refusing gate cannot keep the
//!   turn;
//! - the policy only orders the contenders. It never grants room: a lane
//!   still sends only what the pool's window allows it (`pool.rs`);
//! - `first-come` (the default, and the behaviour before merge policies):
//!   no turns, whichever receiver finds room takes it;
//! - `random-robin`: contenders take turns in lane order, starting at a
//!   random lane (seeded), so no queue is favoured;
//! - `tier-priority`: each lane has a tier (its queue's `tier` label:
//!   `interactive` > `async` > `batch`). The highest tier with a
//!   contender is served first, round robin among its lanes. A lower
//!   tier is never starved below `min_share`: over the last
//!   `share_window` turns, a tier gets the turn when granting it keeps its
//!   share of the turns during which it contended within its floor
//!   (`served + 1 <= min_share × (contended + 1)`); the tier furthest below
//!   its floor goes first. `min_share = 0` is upstream's strict priority.

use std::collections::VecDeque;

use crate::config::Tier;

/// Which merge policy orders a pool's lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeKind {
    /// No turns: whichever lane finds room takes it.
    FirstCome,
    /// Turns in lane order from a random start.
    RandomRobin,
    /// The highest tier first, lower tiers kept at their floor.
    TierPriority,
}

/// A pool's merge policy and its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MergePolicy {
    /// The policy.
    pub kind: MergeKind,
    /// `tier-priority`: the least share of turns a lower tier gets while
    /// it contends, in [0, 0.5].
    pub min_share: f64,
    /// `tier-priority`: how many recent turns the shares are counted over.
    pub share_window: usize,
}

impl Default for MergePolicy {
    fn default() -> Self {
        Self {
            kind: MergeKind::FirstCome,
            min_share: 0.1,
            share_window: 100,
        }
    }
}

/// One past turn, for the shares of `tier-priority`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Turn {
    winner: Tier,
    /// The tiers that contended for it (one bit each).
    contended: u8,
}

/// The turn-taking state of one pool: its policy, each lane's tier and
/// whether it contends, and what the turns so far were.
#[derive(Debug, Clone)]
pub struct Merge {
    policy: MergePolicy,
    tiers: Vec<Tier>,
    contending: Vec<bool>,
    /// `random-robin`: the lane looked at first for the next turn.
    cursor: usize,
    /// `tier-priority`: the same, per tier.
    tier_cursor: [usize; 3],
    /// `tier-priority`: the last `share_window` turns.
    history: VecDeque<Turn>,
}

impl Default for Merge {
    fn default() -> Self {
        Self::new(MergePolicy::default(), 0)
    }
}

impl Merge {
    /// No lanes yet; `seed` picks the lane (and, per tier, the lane of
    /// the tier) that is looked at first.
    pub fn new(policy: MergePolicy, seed: u64) -> Self {
        // Spread one seed over the four cursors (taken modulo the lane
        // count when used).
        let part = |k: u64| usize::try_from(seed.rotate_left(16 * k as u32) % 65_521).unwrap_or(0);
        Self {
            policy,
            tiers: Vec::new(),
            contending: Vec::new(),
            cursor: part(0),
            tier_cursor: [part(1), part(2), part(3)],
            history: VecDeque::new(),
        }
    }

    /// Sets the policy and the cursors from `seed`, keeping the lanes.
    pub fn configure(&mut self, policy: MergePolicy, seed: u64) {
        let fresh = Self::new(policy, seed);
        self.policy = fresh.policy;
        self.cursor = fresh.cursor;
        self.tier_cursor = fresh.tier_cursor;
        self.history.clear();
    }

    /// The policy.
    pub fn policy(&self) -> MergePolicy {
        self.policy
    }

    /// Adds a lane (index = the count of lanes before it), of `tier`, not
    /// contending.
    pub fn add_lane(&mut self, tier: Tier) -> usize {
        self.tiers.push(tier);
        self.contending.push(false);
        self.tiers.len() - 1
    }

    /// Sets the tier of `lane` (ignored for a lane not added).
    pub fn set_tier(&mut self, lane: usize, tier: Tier) {
        if let Some(t) = self.tiers.get_mut(lane) {
            *t = tier;
        }
    }

    /// Whether lanes take turns at all: a policy other than `first-come`
    /// and more than one lane. A pool of one queue behaves as without a
    /// policy.
    pub fn takes_turns(&self) -> bool {
        self.policy.kind != MergeKind::FirstCome && self.tiers.len() > 1
    }

    /// Marks whether `lane`'s receiver holds releasable work and waits at
    /// the turn. Returns whether that changed.
    pub fn set_contending(&mut self, lane: usize, contending: bool) -> bool {
        match self.contending.get_mut(lane) {
            Some(c) if *c != contending => {
                *c = contending;
                true
            }
            _ => false,
        }
    }

    /// Whether `lane` is marked contending.
    pub fn is_contending(&self, lane: usize) -> bool {
        self.contending.get(lane).copied().unwrap_or(false)
    }

    /// The lanes that contend now, given which have room (`has_room[i]`
    /// for lane `i`; missing = no room).
    pub fn contenders(&self, has_room: &[bool]) -> Vec<bool> {
        self.contending
            .iter()
            .enumerate()
            .map(|(i, c)| *c && has_room.get(i).copied().unwrap_or(false))
            .collect()
    }

    /// The lane whose turn it is among `ready` (the contenders), `None`
    /// when none contends. `first-come` names none: there are no turns.
    pub fn pick(&self, ready: &[bool]) -> Option<usize> {
        match self.policy.kind {
            MergeKind::FirstCome => None,
            MergeKind::RandomRobin => next_in_ring(ready, self.cursor, |_| true),
            MergeKind::TierPriority => {
                let tier = self.tier_to_serve(ready)?;
                next_in_ring(ready, self.tier_cursor[tier.index()], |i| {
                    self.tiers[i] == tier
                })
            }
        }
    }

    /// The tier `tier-priority` serves next among `ready`.
    fn tier_to_serve(&self, ready: &[bool]) -> Option<Tier> {
        let contended = self.contended_tiers(ready);
        let top = Tier::ALL
            .iter()
            .map(|(_, t)| *t)
            .find(|t| contended & t.bit() != 0)?;
        Some(starved_tier(&self.history, contended, top, self.policy.min_share).unwrap_or(top))
    }

    fn contended_tiers(&self, ready: &[bool]) -> u8 {
        ready
            .iter()
            .zip(&self.tiers)
            .filter(|(r, _)| **r)
            .fold(0, |m, (_, t)| m | t.bit())
    }

    /// Records that `lane` took a turn among `ready`: the next turn looks
    /// at the lane after it first, and its tier's share counts it.
    pub fn served(&mut self, lane: usize, ready: &[bool]) {
        let Some(&tier) = self.tiers.get(lane) else {
            return;
        };
        match self.policy.kind {
            MergeKind::FirstCome => {}
            MergeKind::RandomRobin => self.cursor = lane + 1,
            MergeKind::TierPriority => {
                self.tier_cursor[tier.index()] = lane + 1;
                let contended = self.contended_tiers(ready) | tier.bit();
                self.history.push_back(Turn {
                    winner: tier,
                    contended,
                });
                while self.history.len() > self.policy.share_window.max(1) {
                    self.history.pop_front();
                }
            }
        }
    }
}

/// The first `i` with `ready[i]` and `keep(i)`, looking from `from`
/// (modulo the lane count) round the ring.
fn next_in_ring(ready: &[bool], from: usize, keep: impl Fn(usize) -> bool) -> Option<usize> {
    let n = ready.len();
    if n == 0 {
        return None;
    }
    (0..n)
        .map(|k| (from + k) % n)
        .find(|&i| ready[i] && keep(i))
}

/// The tier below `top` among `contended` that is furthest below its
/// floor: one whose next turn keeps its share of the turns it contended
/// for within `min_share` (`served + 1 <= min_share × (contended + 1)`).
/// Ties go to the higher tier. `None`: every lower tier has its share.
fn starved_tier(
    history: &VecDeque<Turn>,
    contended: u8,
    top: Tier,
    min_share: f64,
) -> Option<Tier> {
    let mut best: Option<(f64, Tier)> = None;
    for (_, tier) in Tier::ALL {
        if tier <= top || contended & tier.bit() == 0 {
            continue;
        }
        let (mut served, mut waited) = (0u64, 0u64);
        for turn in history.iter().filter(|t| t.contended & tier.bit() != 0) {
            waited += 1;
            served += u64::from(turn.winner == tier);
        }
        // How far the next turn would leave it below its floor; at least
        // zero when it is owed a turn. A small tolerance so that a share
        // exactly on the floor (0.1 × 10) counts as owed.
        let owed = min_share * (waited + 1) as f64 - (served + 1) as f64;
        if min_share > 0.0 && owed > -1e-9 && best.is_none_or(|(b, _)| owed > b) {
            best = Some((owed, tier));
        }
    }
    best.map(|(_, t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(kind: MergeKind, min_share: f64) -> MergePolicy {
        MergePolicy {
            kind,
            min_share,
            share_window: 100,
        }
    }

    /// Runs `turns` turns with every lane in `busy` always contending
    /// (and room for all); returns the winners.
    fn run(merge: &mut Merge, busy: &[bool], turns: usize) -> Vec<usize> {
        for (i, b) in busy.iter().enumerate() {
            merge.set_contending(i, *b);
        }
        let ready = merge.contenders(&vec![true; busy.len()]);
        (0..turns)
            .map(|_| {
                let lane = merge.pick(&ready).expect("a contender");
                merge.served(lane, &ready);
                lane
            })
            .collect()
    }

    #[test]
    fn random_robin_takes_turns_from_the_seeded_start() {
        for seed in 0..20 {
            let mut merge = Merge::new(policy(MergeKind::RandomRobin, 0.0), seed);
            for _ in 0..3 {
                merge.add_lane(Tier::Batch);
            }
            let winners = run(&mut merge, &[true, true, true], 9);
            let first = winners[0];
            for (k, w) in winners.iter().enumerate() {
                assert_eq!(*w, (first + k) % 3, "seed {seed}: {winners:?}");
            }
        }
    }

    #[test]
    fn the_seed_spreads_the_first_turn() {
        let firsts: std::collections::BTreeSet<usize> = (0..30)
            .map(|seed| {
                let mut merge = Merge::new(policy(MergeKind::RandomRobin, 0.0), seed * 7919);
                merge.add_lane(Tier::Batch);
                merge.add_lane(Tier::Batch);
                run(&mut merge, &[true, true], 1)[0]
            })
            .collect();
        assert_eq!(firsts.len(), 2, "both lanes start some run");
    }

    #[test]
    fn lanes_without_work_or_room_are_skipped_and_never_hold_the_turn() {
        let mut merge = Merge::new(policy(MergeKind::RandomRobin, 0.0), 0);
        for _ in 0..3 {
            merge.add_lane(Tier::Batch);
        }
        // Lane 1 has no work: 0 and 2 alternate.
        let winners = run(&mut merge, &[true, false, true], 4);
        assert!(winners.iter().all(|w| *w != 1), "{winners:?}");
        assert!(winners.windows(2).all(|p| p[0] != p[1]), "{winners:?}");
        // Lane 0 has work but no room (gate closed): only 2 contends.
        let ready = merge.contenders(&[false, true, true]);
        assert_eq!(ready, vec![false, false, true]);
        assert_eq!(merge.pick(&ready), Some(2));
        // Nobody with room: no turn at all (the policy grants no room).
        assert_eq!(merge.pick(&merge.contenders(&[false, false, false])), None);
        assert_eq!(merge.pick(&[]), None);
    }

    #[test]
    fn first_come_and_a_single_lane_take_no_turns() {
        let mut merge = Merge::new(policy(MergeKind::FirstCome, 0.1), 3);
        merge.add_lane(Tier::Batch);
        merge.add_lane(Tier::Interactive);
        assert!(!merge.takes_turns());
        assert_eq!(merge.pick(&[true, true]), None);
        let mut one = Merge::new(policy(MergeKind::TierPriority, 0.1), 3);
        one.add_lane(Tier::Batch);
        assert!(!one.takes_turns());
        one.add_lane(Tier::Batch);
        assert!(one.takes_turns());
    }

    #[test]
    fn strict_tier_priority_serves_only_the_highest_contending_tier() {
        let mut merge = Merge::new(policy(MergeKind::TierPriority, 0.0), 1);
        merge.add_lane(Tier::Batch);
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Async);
        let winners = run(&mut merge, &[true, true, true], 50);
        assert!(winners.iter().all(|w| *w == 1), "{winners:?}");
        // Interactive idle: async next, then batch.
        assert!(
            run(&mut merge, &[true, false, true], 10)
                .iter()
                .all(|w| *w == 2)
        );
        assert!(
            run(&mut merge, &[true, false, false], 10)
                .iter()
                .all(|w| *w == 0)
        );
    }

    #[test]
    fn a_lower_tier_gets_its_floor_and_no_more() {
        let mut merge = Merge::new(policy(MergeKind::TierPriority, 0.1), 5);
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Batch);
        let winners = run(&mut merge, &[true, true], 300);
        // The first turn goes to the high tier; the low tier's share over
        // every prefix is its floor, rounded down, within one turn (once
        // the share window slides, a turn leaving it is made up on the
        // next one).
        assert_eq!(winners[0], 0);
        for k in 1..=winners.len() {
            let low = winners[..k].iter().filter(|w| **w == 1).count();
            let floor = (0.1 * k as f64 + 1e-9).floor() as usize;
            if k <= 100 {
                assert!(low >= floor, "after {k} turns: {low} < {floor}");
            }
            assert!(low + 1 >= floor, "after {k} turns: {low} + 1 < {floor}");
            assert!(low <= floor + 1, "after {k} turns: {low} > {floor} + 1");
        }
    }

    #[test]
    fn two_lower_tiers_each_keep_their_floor() {
        let mut merge = Merge::new(policy(MergeKind::TierPriority, 0.2), 9);
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Async);
        merge.add_lane(Tier::Batch);
        let winners = run(&mut merge, &[true, true, true], 100);
        let count = |lane| winners.iter().filter(|w| **w == lane).count();
        // Two tiers owed at once: one of them waits a turn.
        assert!(count(1) >= 19 && count(2) >= 19, "{winners:?}");
        assert!(count(0) >= 55, "the top tier gets the rest: {winners:?}");
    }

    #[test]
    fn a_tier_that_was_idle_is_not_owed_the_turns_it_did_not_want() {
        let mut merge = Merge::new(policy(MergeKind::TierPriority, 0.1), 2);
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Batch);
        // 100 turns with batch idle, then both busy.
        run(&mut merge, &[true, false], 100);
        let winners = run(&mut merge, &[true, true], 20);
        let low = winners.iter().filter(|w| **w == 1).count();
        assert!(low <= 3, "no catch-up burst: {winners:?}");
        assert!(low >= 2, "{winners:?}");
    }

    #[test]
    fn lanes_of_one_tier_take_turns() {
        let mut merge = Merge::new(policy(MergeKind::TierPriority, 0.0), 4);
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Batch);
        merge.add_lane(Tier::Interactive);
        let winners = run(&mut merge, &[true, true, true], 6);
        assert!(winners.iter().all(|w| *w != 1), "{winners:?}");
        assert!(winners.windows(2).all(|p| p[0] != p[1]), "{winners:?}");
    }

    #[test]
    fn the_share_window_bounds_the_history() {
        let mut merge = Merge::new(
            MergePolicy {
                kind: MergeKind::TierPriority,
                min_share: 0.1,
                share_window: 10,
            },
            0,
        );
        merge.add_lane(Tier::Interactive);
        merge.add_lane(Tier::Batch);
        run(&mut merge, &[true, true], 1000);
        assert_eq!(merge.history.len(), 10);
    }

    #[test]
    fn tiers_parse_upstreams_values_and_give_upstreams_priority_index() {
        assert_eq!(Tier::parse("interactive"), Some(Tier::Interactive));
        assert_eq!(Tier::parse("async"), Some(Tier::Async));
        assert_eq!(Tier::parse("batch"), Some(Tier::Batch));
        assert_eq!(Tier::parse("Batch"), None);
        assert_eq!(Tier::Interactive.priority_index(true), 0);
        assert_eq!(Tier::Batch.priority_index(true), 2);
        assert_eq!(Tier::Interactive.priority_index(false), 3);
        assert_eq!(Tier::Batch.priority_index(false), 5);
    }
}
