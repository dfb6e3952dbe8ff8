//! Pools: queues that send to the same inference pool share one window.
//!
//! The arithmetic ([`PoolWindow`]) is pure, like `window.rs`: no I/O, no
//! clock. The rule (docs/architecture.md, "Pools"):
//! - every queue of a pool is a *lane* with its own gate, so its own grant
//!   (`N` and the limit of its latest fresh reading);
//! - every lane counts the **pool's** sends and finishes, not only its own:
//!   a queue's window is `pool_in_flight_at(taken_at) + N`, and whatever
//!   any queue of the pool sent after `taken_at` counts against that `N`.
//!   So each queue's gate bounds the pool's total in flight for that
//!   queue's sends, and two queues reading the same gate release one
//!   window between them, not two;
//! - a 429/503 on any queue closes every lane until each lane's own gate
//!   gives a reading newer than the rejection (the gateway-wide hold,
//!   `congestion.rs`, is shared by the pool's queues too);
//! - an optional *cap* bounds the pool's in-flight total from outside: the
//!   units this replica holds in the shared window (`shared_window.rs`),
//!   valid until its lease would expire. Past that instant the cap is zero:
//!   a replica that cannot prove its lease sends nothing new.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::merge::{Merge, MergePolicy};
use super::pace::{Pace, Pacer};
use super::window::{Applied, Window};
use crate::config::Rounding;
use crate::config::Tier;
use crate::gate::{Capacity, Observation};

/// One queue's place in a [`PoolWindow`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lane(usize);

/// Units held from outside (the shared window) and until when they count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cap {
    units: u64,
    valid_until: Instant,
}

/// A lane's live reading, as the shared window uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// `N` in units.
    pub n: u64,
    /// What the reading already counted as in flight: its window less `N`
    /// (zero for a blind gate, whose window is `N`).
    pub base: u64,
    /// When its data was taken.
    pub taken_at: Instant,
    /// `max_SYS × (1 − B)`: the most the reading allows in flight at all.
    pub ceiling: u64,
}

/// The window of one pool: one [`Window`] per lane, all fed the pool's
/// sends and finishes, and an optional cap on the pool's in flight.
#[derive(Debug, Clone, Default)]
pub struct PoolWindow {
    lanes: Vec<Window>,
    /// `None`: no outside bound (no shared window).
    cap: Option<Cap>,
    /// A sync is out and the cap is held at what it reported in flight
    /// ([`Self::freeze_cap`]) until its reply.
    syncing: bool,
    /// The pool's in flight (every lane holds the same count).
    in_flight: u64,
    /// Paced release of the pool's sends (`dispatch.pace`), if on: it only
    /// ever withholds what the lanes' windows allow.
    pacer: Option<Pacer>,
    /// Which lane takes the next turn at the room (`merge.rs`); one entry
    /// per lane, in lane order.
    merge: Merge,
    /// Whether a policy was set ([`Self::set_merge`]: the first wins).
    merge_set: bool,
}

impl PoolWindow {
    /// Adds a lane for a queue whose gate's data is no data once older
    /// than `max_staleness`. It starts closed, and counts the pool's work
    /// in flight now as sent before any reading it will get.
    pub fn add_lane(&mut self, now: Instant, max_staleness: Duration) -> Lane {
        let mut window = Window::new(now, max_staleness);
        if self.in_flight > 0 {
            window.sent(now, self.in_flight);
        }
        self.lanes.push(window);
        self.merge.add_lane(Tier::Batch);
        Lane(self.lanes.len() - 1)
    }

    /// Sets the pool's merge policy, `seed` choosing the lane looked at
    /// first. The first call wins: every queue of a pool reads the same
    /// config, and a later call must not reset the turns.
    pub fn set_merge(&mut self, policy: MergePolicy, seed: u64) {
        if !self.merge_set {
            self.merge_set = true;
            self.merge.configure(policy, seed);
        }
    }

    /// Sets `lane`'s tier for `tier-priority`.
    pub fn set_tier(&mut self, lane: Lane, tier: Tier) {
        self.merge.set_tier(lane.0, tier);
    }

    /// Whether the pool's lanes take turns (a merge policy other than
    /// `first-come`, and more than one lane).
    pub fn takes_turns(&self) -> bool {
        self.merge.takes_turns()
    }

    /// Marks whether `lane`'s receiver holds releasable work. Returns
    /// whether that changed (then the other lanes should look again: a
    /// lane that stopped contending no longer holds the turn).
    pub fn mark_contending(&mut self, lane: Lane, has_work: bool) -> bool {
        self.merge.set_contending(lane.0, has_work)
    }

    /// Whether `lane`, which has releasable work and room now, takes the
    /// next turn: always without turns; with them, when the policy picks
    /// it among the lanes that contend and have room ([`Self::available`]),
    /// and the turn is then recorded. The lane stays marked contending
    /// until its receiver says otherwise, so a busy higher tier keeps its
    /// priority between two of its turns.
    pub fn take_turn(&mut self, lane: Lane, now: Instant) -> bool {
        if !self.merge.takes_turns() {
            return true;
        }
        self.merge.set_contending(lane.0, true);
        let has_room: Vec<bool> = (0..self.lanes.len())
            .map(|i| i == lane.0 || self.available(Lane(i), now) > 0)
            .collect();
        let ready = self.merge.contenders(&has_room);
        if self.merge.pick(&ready) == Some(lane.0) {
            self.merge.served(lane.0, &ready);
            true
        } else {
            false
        }
    }

    /// The window of `lane` (its grant, whether it is held).
    ///
    /// # Panics
    /// Never for a lane this pool returned from [`Self::add_lane`].
    pub fn lane(&self, lane: Lane) -> &Window {
        &self.lanes[lane.0]
    }

    /// The pool's work in flight, in units.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Applies a reading of `lane`'s gate (see [`Window::apply`]).
    pub fn apply(
        &mut self,
        lane: Lane,
        observation: &Observation,
        capacity: Capacity,
        rounding: Rounding,
    ) -> (u64, Applied) {
        self.lanes[lane.0].apply(observation, capacity, rounding)
    }

    /// Paces the pool's sends from `now` on (`None`: off). A pace already
    /// set is kept, with its credit: every queue of the pool shares one.
    pub fn set_pace(&mut self, pace: Option<Pace>, now: Instant) {
        if let (Some(pace), None) = (pace, &self.pacer) {
            self.pacer = Some(Pacer::new(pace, now));
        }
    }

    /// Units `lane` may still release now: its own window's room, within
    /// the cap and, for a `requests` pace, what the pace lets start now.
    pub fn available(&self, lane: Lane, now: Instant) -> u64 {
        self.lanes[lane.0]
            .available(now)
            .min(self.cap_room(now).unwrap_or(u64::MAX))
            .min(self.pace_room(now))
    }

    /// Requests the pace lets start now (`u64::MAX` without a pace; a
    /// `tokens` pace says 0 or 1 and the request's own cost is charged).
    fn pace_room(&self, now: Instant) -> u64 {
        self.pacer.as_ref().map_or(u64::MAX, |p| p.room(now))
    }

    /// When the pace lets the next request start, if it withholds one now.
    pub fn paced_until(&self, now: Instant) -> Option<Instant> {
        self.pacer
            .as_ref()
            .filter(|p| !p.allows(now))
            .map(|p| p.ready_at(now))
    }

    /// Charges a send of `pace_cost` (its cost in the pace's unit) to the
    /// pace; nothing without one.
    pub fn paced(&mut self, now: Instant, pace_cost: u64) {
        if let Some(pacer) = &mut self.pacer {
            pacer.spend(now, pace_cost);
        }
    }

    /// Whether `lane`'s window is open at `now` ([`Window::is_open`]) and
    /// the cap, if any, leaves room for anything.
    pub fn is_open(&self, lane: Lane, now: Instant) -> bool {
        self.lanes[lane.0].is_open(now) && self.cap(now).is_none_or(|units| units > 0)
    }

    /// Whether a request of `cost` units may go on `lane` now. The cap has
    /// no "at least one": what it bounds is held elsewhere.
    pub fn allows(&self, lane: Lane, now: Instant, cost: u64) -> bool {
        self.lanes[lane.0].allows(now, cost)
            && self.cap_room(now).is_none_or(|room| cost <= room)
            && self.pacer.as_ref().is_none_or(|p| p.allows(now))
    }

    /// Records `cost` units sent on any lane at `now`.
    pub fn sent(&mut self, now: Instant, cost: u64) {
        self.in_flight += cost;
        for window in &mut self.lanes {
            window.sent(now, cost);
        }
    }

    /// Records `cost` units of the pool finished at `now`.
    pub fn finished(&mut self, now: Instant, cost: u64) {
        self.in_flight = self.in_flight.saturating_sub(cost);
        for window in &mut self.lanes {
            window.finished(now, cost);
        }
    }

    /// A 429/503 at `at` closes every lane until its next fresher reading.
    pub fn congested(&mut self, at: Instant) {
        for window in &mut self.lanes {
            window.congested(at);
        }
    }

    /// Bounds the pool's in flight to `units` until `valid_until`; zero
    /// after it.
    pub fn set_cap(&mut self, units: u64, valid_until: Instant) {
        self.cap = Some(Cap { units, valid_until });
        self.syncing = false;
    }

    /// The cap's units while valid at `now` (zero once expired), `None`
    /// without a cap.
    pub fn cap(&self, now: Instant) -> Option<u64> {
        self.cap
            .map(|c| if now < c.valid_until { c.units } else { 0 })
    }

    /// Holds the cap at what is in flight now until the next
    /// [`Self::set_cap`]; returns what is in flight. Called as a sync
    /// starts: the sync reports this in flight, and Redis may cut the
    /// units down to it; a send between the report and the reply would be
    /// beyond what the reply holds, and its unit could go to another
    /// replica at the same time (found under load: 10 in flight with a
    /// window of 9, every holder within its units).
    pub fn freeze_cap(&mut self) -> u64 {
        if let Some(cap) = &mut self.cap {
            cap.units = cap.units.min(self.in_flight);
            self.syncing = true;
        }
        self.in_flight
    }

    /// Whether the lease behind the cap, if any, still holds at `now`.
    /// A request released while it held is sent only if it still does just
    /// before it goes out (`send.rs`): between the two the process may have
    /// paused, or waited on the queue, past the lease, and its units may be
    /// another replica's by now. An expired lease is zero units, also for
    /// requests already counted in flight but not yet sent. Without a cap
    /// (no shared window), always.
    pub fn lease_holds(&self, now: Instant) -> bool {
        self.cap.is_none_or(|c| now < c.valid_until)
    }

    /// What the cap leaves for new sends at `now`.
    fn cap_room(&self, now: Instant) -> Option<u64> {
        self.cap(now)
            .map(|units| units.saturating_sub(self.in_flight))
    }

    /// The reading the pool's total across replicas is built on: that of
    /// the lane with the largest live `N`. `None` without a live grant.
    pub fn reading(&self, now: Instant) -> Option<Reading> {
        self.lanes
            .iter()
            .filter_map(|w| {
                let n = w.live_n(now)?;
                let (_, limit) = w.grant()?;
                Some(Reading {
                    n,
                    base: limit.saturating_sub(n),
                    taken_at: w.taken_at()?,
                    ceiling: w.ceiling()?,
                })
            })
            .max_by_key(|r| r.n)
    }

    /// Whether some lane has budget that only the cap withholds (the
    /// shared window should take more units). Not while a sync is out: its
    /// reply sets the cap, and asking again meanwhile would start the next
    /// sync at once, and with it the next freeze.
    pub fn blocked_by_cap(&self, now: Instant) -> bool {
        if self.syncing {
            return false;
        }
        let Some(room) = self.cap_room(now) else {
            return false;
        };
        self.lanes.iter().any(|w| w.available(now) > room)
    }
}

/// The window and wake-ups shared by every queue of one pool in this
/// process.
#[derive(Debug, Default)]
pub struct Pool {
    /// The pool's name (config `pool`, or the gateway URL's origin).
    pub name: String,
    window: Mutex<PoolWindow>,
    /// Fired when the pool's window may have room again, for every queue.
    changed: Arc<Notify>,
    /// Asks the shared-window keeper to sync now (the cap is what stops
    /// sends, or a hold is to be published); nobody listens without a
    /// shared window.
    pub(super) wants_units: Notify,
    /// The longest congestion hold seen here since the keeper last
    /// published one to the other replicas.
    hold_to_publish: Mutex<Option<Duration>>,
}

impl Pool {
    /// A pool with no queue yet.
    pub fn new(name: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            ..Self::default()
        })
    }

    /// The pool's window, for a check-and-update that must be atomic.
    pub fn window(&self) -> MutexGuard<'_, PoolWindow> {
        // PoolWindow methods do not panic on lanes it handed out; a
        // poisoned lock still holds a consistent window.
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The notifier fired when the window may have room again.
    pub(super) fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// Wakes every queue of the pool (the window may have room again).
    pub(super) fn notify_changed(&self) {
        self.changed.notify_waiters();
    }

    /// A new 429/503 signal here held the pool for `hold`: tell the other
    /// replicas (with a shared window; otherwise it is never read).
    pub(super) fn publish_hold(&self, hold: Duration) {
        {
            let mut pending = self
                .hold_to_publish
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *pending = Some(pending.map_or(hold, |h| h.max(hold)));
        }
        self.wants_units.notify_one();
    }

    /// The hold to publish, if any, now taken.
    pub(super) fn take_hold(&self) -> Option<Duration> {
        self.hold_to_publish
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// One queue's lane in a pool, as its dispatcher's tasks use it: every
/// method reads or updates the pool's window for this lane.
#[derive(Debug)]
pub(super) struct LaneWindow<'a> {
    pub(super) pool: MutexGuard<'a, PoolWindow>,
    pub(super) lane: Lane,
}

impl LaneWindow<'_> {
    /// See [`PoolWindow::available`].
    pub(super) fn available(&self, now: Instant) -> u64 {
        self.pool.available(self.lane, now)
    }

    /// See [`PoolWindow::is_open`].
    pub(super) fn is_open(&self, now: Instant) -> bool {
        self.pool.is_open(self.lane, now)
    }

    /// The pool's in flight.
    pub(super) fn in_flight(&self) -> u64 {
        self.pool.in_flight()
    }

    /// See [`PoolWindow::lease_holds`].
    pub(super) fn lease_holds(&self, now: Instant) -> bool {
        self.pool.lease_holds(now)
    }

    /// See [`PoolWindow::allows`].
    pub(super) fn allows(&self, now: Instant, cost: u64) -> bool {
        self.pool.allows(self.lane, now, cost)
    }

    /// See [`PoolWindow::sent`].
    pub(super) fn sent(&mut self, now: Instant, cost: u64) {
        self.pool.sent(now, cost);
    }

    /// See [`PoolWindow::finished`].
    pub(super) fn finished(&mut self, now: Instant, cost: u64) {
        self.pool.finished(now, cost);
    }

    /// See [`PoolWindow::paced`].
    pub(super) fn paced(&mut self, now: Instant, pace_cost: u64) {
        self.pool.paced(now, pace_cost);
    }

    /// See [`PoolWindow::paced_until`].
    pub(super) fn paced_until(&self, now: Instant) -> Option<Instant> {
        self.pool.paced_until(now)
    }

    /// See [`PoolWindow::congested`].
    pub(super) fn congested(&mut self, at: Instant) {
        self.pool.congested(at);
    }

    /// See [`PoolWindow::apply`].
    pub(super) fn apply(
        &mut self,
        observation: &Observation,
        capacity: Capacity,
        rounding: Rounding,
    ) -> (u64, Applied) {
        self.pool.apply(self.lane, observation, capacity, rounding)
    }

    /// Whether a 429/503 holds this lane shut.
    pub(super) fn is_held(&self) -> bool {
        self.pool.lane(self.lane).is_held()
    }

    /// This lane's `(N, window)`.
    pub(super) fn grant(&self) -> Option<(u64, u64)> {
        self.pool.lane(self.lane).grant()
    }

    /// See [`super::window::Window::progress`]: the pool's sends and
    /// finishes as this lane counts them.
    pub(super) fn progress(&self) -> (u64, u64) {
        self.pool.lane(self.lane).progress()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STALE: Duration = Duration::from_secs(60);

    #[test]
    fn two_lanes_reading_the_same_headroom_share_one_window() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        let a = pool.add_lane(now, STALE);
        let b = pool.add_lane(now, STALE);
        // Both gates see the same pool: N = 5 each.
        pool.lanes[a.0].observe(now, 5, false, true);
        pool.lanes[b.0].observe(now, 5, false, true);
        for _ in 0..3 {
            assert!(pool.allows(a, now, 1));
            pool.sent(now, 1);
        }
        // b's window counts a's three: two left, not five.
        assert_eq!(pool.available(b, now), 2);
        pool.sent(now, 2);
        assert_eq!(pool.available(a, now), 0);
        assert_eq!(pool.available(b, now), 0);
        assert_eq!(pool.in_flight(), 5);
    }

    #[test]
    fn a_429_on_one_lane_closes_the_other_until_its_own_fresher_reading() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        let a = pool.add_lane(now, STALE);
        let b = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 5, false, true);
        pool.lanes[b.0].observe(now, 5, false, true);
        let rejected = now + Duration::from_secs(1);
        pool.congested(rejected);
        assert_eq!(pool.available(a, rejected), 0);
        assert_eq!(pool.available(b, rejected), 0);
        let later = rejected + Duration::from_millis(1);
        pool.lanes[a.0].observe(later, 5, false, true);
        assert_eq!(pool.available(a, later), 5);
        assert_eq!(pool.available(b, later), 0, "b's gate has not spoken since");
    }

    #[test]
    fn the_cap_bounds_the_pool_and_is_zero_once_expired() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        let a = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 10, true, true);
        let until = now + Duration::from_secs(5);
        pool.set_cap(3, until);
        assert_eq!(pool.available(a, now), 3);
        pool.sent(now, 3);
        assert!(!pool.allows(a, now, 1));
        pool.finished(now, 1);
        assert!(pool.allows(a, now, 1));
        assert!(
            !pool.allows(a, now, 2),
            "at-least-one does not pass the cap"
        );
        assert_eq!(pool.cap(until), Some(0));
        assert!(!pool.allows(a, until, 1), "an expired lease sends nothing");
    }

    #[test]
    fn no_send_goes_while_a_sync_reports_what_is_in_flight() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        let a = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 10, true, true);
        let until = now + Duration::from_secs(2);
        pool.set_cap(5, until);
        pool.sent(now, 2);
        assert_eq!(pool.available(a, now), 3);
        // The sync reports 2 in flight; until its reply nothing more goes
        // (the reply may hold only 2 units).
        assert_eq!(pool.freeze_cap(), 2);
        assert!(!pool.allows(a, now, 1));
        assert!(pool.lease_holds(now), "the lease itself still holds");
        assert!(
            !pool.blocked_by_cap(now),
            "no second sync asked for while this one is out"
        );
        // Finishing lowers the frozen cap's room further, never raises it.
        pool.finished(now, 1);
        assert!(pool.allows(a, now, 1), "one of the two reported units");
        pool.sent(now, 1);
        assert!(!pool.allows(a, now, 1));
        // The reply: units again.
        pool.set_cap(4, until);
        assert_eq!(pool.available(a, now), 2);
        assert!(
            pool.blocked_by_cap(now),
            "the lane's budget exceeds the units"
        );
        // Without a shared window there is nothing to freeze.
        let mut alone = PoolWindow::default();
        let b = alone.add_lane(now, STALE);
        alone.lanes[b.0].observe(now, 10, true, true);
        assert_eq!(alone.freeze_cap(), 0);
        assert_eq!(alone.available(b, now), 10);
    }

    #[test]
    fn a_request_released_under_a_lease_does_not_go_out_once_it_lapsed() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        assert!(pool.lease_holds(now), "no shared window: no lease to lose");
        let a = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 10, true, true);
        let until = now + Duration::from_secs(2);
        pool.set_cap(3, until);
        assert!(pool.allows(a, now, 1));
        pool.sent(now, 1);
        // Checked again just before it goes: the lease holds until `until`.
        assert!(pool.lease_holds(until - Duration::from_millis(1)));
        // A pause past it: the request counted in flight must not go.
        assert!(!pool.lease_holds(until));
        assert!(!pool.lease_holds(until + Duration::from_secs(10)));
        // A lost lease (failed or fenced sync) lapses at once, whatever
        // the units.
        pool.set_cap(3, now);
        assert!(!pool.lease_holds(now));
        // A new lease: the same request may go (its units are counted in
        // what the replica reports in flight, so held at the join).
        pool.set_cap(0, now + Duration::from_secs(2));
        assert!(pool.lease_holds(now));
    }

    #[test]
    fn a_lane_added_late_counts_what_is_already_in_flight() {
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        let a = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 4, false, true);
        pool.sent(now, 4);
        let later = now + Duration::from_secs(1);
        let b = pool.add_lane(later, STALE);
        pool.lanes[b.0].observe(later, 4, false, true);
        assert_eq!(pool.lane(b).in_flight(), 4);
        pool.finished(later, 4);
        assert_eq!(pool.lane(b).in_flight(), 0);
    }

    #[test]
    fn the_pace_spreads_a_window_and_never_lets_more_than_it_allow() {
        use crate::dispatch::pace::{Pace, PaceUnit};
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        pool.set_pace(
            Some(Pace::new(PaceUnit::Requests, 10.0, 2.0).expect("valid")),
            now,
        );
        let a = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 5, false, true);
        // A window of 5 opens: 2 go at once (the burst), then one per 100 ms.
        assert_eq!(pool.available(a, now), 2);
        for _ in 0..2 {
            assert!(pool.allows(a, now, 1));
            pool.sent(now, 1);
            pool.paced(now, 1);
        }
        assert!(!pool.allows(a, now, 1));
        let due = pool.paced_until(now).expect("the pace withholds");
        assert!(due > now && due <= now + Duration::from_millis(100));
        let mut t = now;
        let mut starts = 0;
        for _ in 0..100 {
            t += Duration::from_millis(50);
            while pool.allows(a, t, 1) {
                pool.sent(t, 1);
                pool.paced(t, 1);
                starts += 1;
            }
        }
        // Five seconds at 10/s, but the window holds 5 in all.
        assert_eq!(pool.in_flight(), 5);
        assert_eq!(starts, 3);
        assert_eq!(pool.available(a, t), 0);
        assert_eq!(pool.paced_until(t), None, "the window, not the pace, holds");
    }

    fn policy(kind: crate::dispatch::merge::MergeKind) -> MergePolicy {
        MergePolicy {
            kind,
            min_share: 0.1,
            share_window: 100,
        }
    }

    #[test]
    fn lanes_take_turns_only_among_those_with_room_and_no_room_is_granted() {
        use crate::dispatch::merge::MergeKind;
        let now = Instant::now();
        let mut pool = PoolWindow::default();
        pool.set_merge(policy(MergeKind::RandomRobin), 0);
        let a = pool.add_lane(now, STALE);
        let b = pool.add_lane(now, STALE);
        pool.lanes[a.0].observe(now, 4, false, true);
        pool.lanes[b.0].observe(now, 4, false, true);
        assert!(pool.takes_turns());
        // Both contend: the turns alternate, whoever asks.
        pool.mark_contending(a, true);
        pool.mark_contending(b, true);
        let first = if pool.take_turn(a, now) { a } else { b };
        let second = if first == a { b } else { a };
        assert!(!pool.take_turn(first, now), "the other lane's turn");
        assert!(pool.take_turn(second, now));
        assert!(pool.take_turn(first, now));
        // Taking turns grants nothing: the room is the window's.
        assert_eq!(pool.available(a, now), 4);
        assert_eq!(pool.in_flight(), 0);
        // A lane without work does not hold the turn.
        pool.mark_contending(second, false);
        assert!(pool.take_turn(first, now));
        assert!(pool.take_turn(first, now));
        // Nor does a lane whose window has no room (its gate closed).
        pool.mark_contending(second, true);
        let later = now + Duration::from_millis(1);
        pool.lanes[second.0].observe(later, 0, false, true);
        assert_eq!(pool.available(second, later), 0);
        assert!(pool.take_turn(first, later));
        assert!(pool.take_turn(first, later));
    }

    #[test]
    fn one_lane_or_first_come_never_waits_for_a_turn() {
        use crate::dispatch::merge::MergeKind;
        let now = Instant::now();
        let mut one = PoolWindow::default();
        one.set_merge(policy(MergeKind::TierPriority), 0);
        let a = one.add_lane(now, STALE);
        assert!(!one.takes_turns());
        assert!(one.take_turn(a, now));
        let mut first_come = PoolWindow::default();
        let a = first_come.add_lane(now, STALE);
        let b = first_come.add_lane(now, STALE);
        first_come.mark_contending(b, true);
        assert!(!first_come.takes_turns());
        for _ in 0..3 {
            assert!(first_come.take_turn(a, now));
        }
        // The first policy set wins (every queue of a pool sets it).
        first_come.set_merge(policy(MergeKind::RandomRobin), 0);
        assert!(first_come.takes_turns());
        first_come.set_merge(policy(MergeKind::FirstCome), 0);
        assert!(first_come.takes_turns());
    }

    #[derive(Debug, Clone)]
    enum Step {
        Advance(u64),
        Send { lane: usize, cost: u64 },
        Finish,
        Observe { lane: usize, lag_ms: u64, n: u64 },
        Cap(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..200).prop_map(Step::Advance),
            (0usize..3, 1u64..4).prop_map(|(lane, cost)| Step::Send { lane, cost }),
            Just(Step::Finish),
            (0usize..3, 0u64..2000, 0u64..15).prop_map(|(lane, lag_ms, n)| Step::Observe {
                lane,
                lag_ms,
                n
            }),
            (0u64..20).prop_map(Step::Cap),
        ]
    }

    proptest! {
        /// Three lanes on one pool whose gates all see the pool's load:
        /// the pool's in flight never exceeds the largest window any lane
        /// was granted, nor the cap.
        #[test]
        fn lanes_never_exceed_one_window_together(steps in proptest::collection::vec(step(), 1..300)) {
            let start = Instant::now();
            let mut now = start;
            let mut pool = PoolWindow::default();
            let lanes: Vec<Lane> = (0..3).map(|_| pool.add_lane(start, STALE)).collect();
            let mut in_flight: Vec<u64> = Vec::new();
            let mut cap: Option<u64> = None;
            for s in steps {
                match s {
                    Step::Advance(ms) => now += Duration::from_millis(ms),
                    Step::Send { lane, cost } => {
                        if pool.allows(lanes[lane], now, cost) {
                            pool.sent(now, cost);
                            in_flight.push(cost);
                            let (_, limit) = pool.lane(lanes[lane]).grant().expect("granted");
                            prop_assert!(pool.in_flight() <= limit);
                            if let Some(c) = cap {
                                prop_assert!(pool.in_flight() <= c);
                            }
                        }
                    }
                    Step::Finish => {
                        if let Some(cost) = in_flight.pop() {
                            pool.finished(now, cost);
                        }
                    }
                    Step::Observe { lane, lag_ms, n } => {
                        let taken = now.checked_sub(Duration::from_millis(lag_ms)).unwrap_or(now).max(start);
                        pool.lanes[lanes[lane].0].observe(taken, n, false, true);
                    }
                    Step::Cap(units) => {
                        pool.set_cap(units, now + Duration::from_secs(3600));
                        cap = Some(units);
                    }
                }
                prop_assert_eq!(pool.in_flight(), in_flight.iter().sum::<u64>());
            }
        }
    }
}
