//! Window arithmetic: how many units of batch work may be released, given
//! gate observations and what this dispatcher already sent. Pure: no I/O,
//! no clock; callers pass instants in.
//!
//! The rule (docs/architecture.md, "The dispatch budget and the window"):
//! - `N = max_SYS × (D − B)` when `D > B`, else 0, rounded per [`Rounding`];
//! - `window = own_in_flight_at(taken_at) + N`, and new work goes only
//!   while `own_in_flight < window`;
//! - between two fresh observations at most `N` is released in total, and
//!   everything sent after `taken_at` counts against `N`, because the pool's
//!   metrics do not show it yet.
//!
//! A re-delivered observation (same or older `taken_at`) changes nothing,
//! so a cached metric cannot refill the window. A 429/503 closes the window
//! until an observation newer than the rejection arrives.
//!
//! Refill on own finishes (readings that see our own load only): a unit of
//! ours sent after `taken_at` that has finished since gives its room back
//! at once, so a slow source (a 15 s scrape) does not idle the pool
//! between readings. The rule keeps the reading's allowance: what is in
//! flight of ours *sent after* `taken_at` never exceeds `N`, so in-flight
//! never exceeds `own_in_flight_at(taken_at) + N`.
//! - A finish before `taken_at` frees nothing: the reading already shows
//!   it (it is not in `own_in_flight_at(taken_at)`, so `N` already counts
//!   its room).
//! - A finish after `taken_at` of work the reading counted as running
//!   frees nothing either: the reading charged that work to the pool, not
//!   to `N`; refilling it too would keep in-flight pinned at the window
//!   limit, so the next reading counts that refilled work as its base and
//!   adds a new `N` on top: the window ratchets up by `N` per reading
//!   wherever the metric moves less than one unit per request of ours
//!   (a saturation or KV signal).
//! - The window cannot tell which request finished, so it counts the first
//!   `own_in_flight_at(taken_at)` finishes after `taken_at` as the
//!   reading's own work and only the rest as ours sent since: never more
//!   room than the exact rule, and the exact room once the reading's own
//!   work is all done (the idle gap after a wave).
//!
//! A blind reading (its window is `N` itself) keeps the plain rule: `N`
//! per fresh reading.
//!
//! Caps on own in-flight (`Observation::caps_own_in_flight`: `feedback`'s
//! window, `slo-headroom`'s admitted amount): `N` is not room the pool
//! showed but the most of our own work the gate wants in flight, and the
//! gate counts that work itself. The window is `N` and every finish of
//! ours frees its room at once, so in-flight stays at `N` between
//! readings. Under the plain rule such a gate sent at most `N` per fresh
//! reading: with requests shorter than two readings apart, in-flight
//! drained to a quarter of `N` and the next reading released the rest in
//! one tick (measured in `sluicegate eval`, `feedback` on 16 replicas:
//! 27 → 102 in flight in 50 ms, every other reading); those prompts
//! shared the engines' next steps, raised interactive TTFT, and finished
//! together to be released together again.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{Rounding, Unit};
use crate::gate::{Capacity, Observation};

/// Relative tolerance so `50 × (0.7 − 0.1)` floors to 30, not 29: budgets
/// come from float arithmetic and must not lose a unit to representation
/// error.
const ROUNDING_TOLERANCE: f64 = 1e-9;

/// Marks closer together than this share one history entry.
const MARK_GRANULARITY: Duration = Duration::from_millis(5);

/// `N` in whole units: `max_sys × headroom`, rounded. `headroom` is
/// `D − B`; zero or less means closed.
pub fn headroom_units(max_sys: f64, headroom: f64, rounding: Rounding) -> u64 {
    // Written so NaN fails every comparison and closes the window.
    let usable = headroom > 0.0 && max_sys > 0.0 && max_sys.is_finite();
    if !usable {
        return 0;
    }
    let exact = max_sys * headroom.min(1.0);
    let slack = ROUNDING_TOLERANCE * exact.max(1.0);
    let units = match rounding {
        Rounding::Floor => (exact + slack).floor(),
        Rounding::Ceil => (exact - slack).ceil(),
        Rounding::AtLeastOne => (exact + slack).floor().max(1.0),
    };
    // `as` saturates for huge values, which is what we want here.
    units as u64
}

/// Counters of this dispatcher's own work at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mark {
    at: Instant,
    sent: u64,
    done: u64,
}

/// The allowance granted by the latest fresh observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grant {
    taken_at: Instant,
    /// `N` in units.
    n: u64,
    /// `own_in_flight_at(taken_at) + N`.
    limit: u64,
    /// Units sent up to `taken_at`; everything after counts against `n`.
    sent_at_taken: u64,
    /// Units finished up to `taken_at` (refill only).
    done_at_taken: u64,
    /// Own units in flight at `taken_at`, which the reading counted as
    /// load: the first this many finishes after it free nothing.
    in_flight_at_taken: u64,
    /// Which finishes after `taken_at` give their room back (module docs).
    refill: Refill,
    /// Let one whole request through even when it is larger than `n`
    /// (rounding `at-least-one` in token or byte units).
    at_least_one: bool,
    /// The most the reading could ever allow: `max_SYS × (1 − B)`, the
    /// window if everything in flight were ours (`u64::MAX` when the
    /// reading was applied without its baseline).
    ceiling: u64,
}

/// Which of our finishes after a reading free room before the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refill {
    /// None: at most `N` goes out per fresh reading.
    Off,
    /// Those beyond the work the reading counted as running (readings that
    /// count our requests one for one: "Refill on own finishes").
    BeyondCounted,
    /// All of them: `N` caps our in-flight ("Caps on own in-flight").
    Every,
}

/// What happened to an observation offered to the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// It was newer than anything seen: the window now follows it.
    Fresh,
    /// It was not newer than the last applied observation (cached data).
    NotNewer,
    /// It predates a congestion signal, which overrides it.
    BeforeCongestion,
}

/// The dispatch window of one queue.
#[derive(Debug, Clone)]
pub struct Window {
    sent: u64,
    done: u64,
    last_event: Instant,
    /// History of counters, oldest first, so the window can ask "what was in
    /// flight when the observation's data was taken?".
    marks: VecDeque<Mark>,
    history: Duration,
    /// A grant is spent or void once its observation is this old: budget
    /// from data older than `max_staleness` is no budget, even while the
    /// observer is blocked and no newer reading replaces it.
    grant_lifetime: Duration,
    grant: Option<Grant>,
    last_taken_at: Option<Instant>,
    congested_at: Option<Instant>,
    /// Whether [`Self::apply`] lets readings that count our requests refill
    /// on our own finishes (on unless switched off to measure it).
    refill_enabled: bool,
}

impl Window {
    /// A closed window created at `now` for a gate whose data is no data
    /// once older than `max_staleness`. It remembers twice that span of its
    /// own sends, so any usable observation finds the counters of its time.
    pub fn new(now: Instant, max_staleness: Duration) -> Self {
        let mut marks = VecDeque::new();
        marks.push_back(Mark {
            at: now,
            sent: 0,
            done: 0,
        });
        Self {
            sent: 0,
            done: 0,
            last_event: now,
            marks,
            history: max_staleness.saturating_mul(2),
            grant_lifetime: max_staleness,
            grant: None,
            last_taken_at: None,
            congested_at: None,
            refill_enabled: true,
        }
    }

    /// Switches refill on own finishes for later readings (on by default;
    /// `eval --no-refill` turns it off to measure what it buys).
    pub fn set_refill_own_finishes(&mut self, enabled: bool) {
        self.refill_enabled = enabled;
    }

    /// Own work in flight, in units.
    pub fn in_flight(&self) -> u64 {
        self.sent - self.done
    }

    /// Units sent and finished so far: differs from an earlier value
    /// exactly when this dispatcher's own work moved since.
    pub fn progress(&self) -> (u64, u64) {
        (self.sent, self.done)
    }

    /// Applies an observation whose data describes `taken_at` and allows `n`
    /// more units (see [`headroom_units`]). `sees_own_load` says whether the
    /// reading already counts our in-flight work: if it does, the window is
    /// `in_flight_at(taken_at) + n`; if not (a blind gate), the window is
    /// `n` itself and sends count from now.
    pub fn observe(
        &mut self,
        taken_at: Instant,
        n: u64,
        at_least_one: bool,
        sees_own_load: bool,
    ) -> Applied {
        self.observe_with(taken_at, n, at_least_one, sees_own_load, Refill::Off)
    }

    /// Like [`Self::observe`] for a reading that sees our own load and
    /// charges each request of ours as one unit of `N`
    /// ([`Observation::counts_own_requests`]): our units that finish after
    /// `taken_at` give their room back at once, within the reading's
    /// allowance (module docs, "Refill on own finishes").
    pub fn observe_refilling(&mut self, taken_at: Instant, n: u64, at_least_one: bool) -> Applied {
        self.observe_with(taken_at, n, at_least_one, true, Refill::BeyondCounted)
    }

    /// Like [`Self::observe`] for a reading whose `N` caps our own work in
    /// flight ([`Observation::caps_own_in_flight`]): the window is `N` and
    /// every finish of ours after `taken_at` frees its room at once.
    pub fn observe_cap(&mut self, taken_at: Instant, n: u64, at_least_one: bool) -> Applied {
        self.observe_with(taken_at, n, at_least_one, false, Refill::Every)
    }

    fn observe_with(
        &mut self,
        taken_at: Instant,
        n: u64,
        at_least_one: bool,
        sees_own_load: bool,
        refill: Refill,
    ) -> Applied {
        if self.last_taken_at.is_some_and(|last| taken_at <= last) {
            return Applied::NotNewer;
        }
        if self.congested_at.is_some_and(|c| taken_at <= c) {
            return Applied::BeforeCongestion;
        }
        self.congested_at = None;
        self.last_taken_at = Some(taken_at);
        let (limit, sent_at, done_at) = if sees_own_load {
            let (sent_at, done_at) = self.counters_at(taken_at);
            ((sent_at - done_at).saturating_add(n), sent_at, done_at)
        } else {
            (n, self.sent, self.done)
        };
        self.grant = Some(Grant {
            taken_at,
            n,
            limit,
            sent_at_taken: sent_at,
            done_at_taken: done_at,
            in_flight_at_taken: sent_at - done_at,
            refill: match refill {
                Refill::BeyondCounted if !sees_own_load => Refill::Off,
                other => other,
            },
            at_least_one: at_least_one && n > 0,
            ceiling: u64::MAX,
        });
        Applied::Fresh
    }

    /// Applies a gate's reading for a queue of static `capacity`: `N` from
    /// the reading's headroom and capacity (its live `max_SYS` counts
    /// requests, so token and byte queues use their own), then
    /// [`Self::observe`]. The dispatcher's observer and `sluicegate eval`
    /// both go through here, so what `eval` measures is what `run` does.
    pub fn apply(
        &mut self,
        observation: &Observation,
        capacity: Capacity,
        rounding: Rounding,
    ) -> (u64, Applied) {
        let max_sys = capacity.effective(observation.max_sys);
        let n = headroom_units(max_sys, observation.headroom(), rounding);
        // Refill only where N is in the reading's own requests: a token or
        // byte queue's N comes from its static max_sys, which a running
        // request of ours does not shrink one for one.
        let refill = if observation.caps_own_in_flight && !observation.sees_own_load {
            // The gate counts its own work in the queue's unit, so this
            // holds for requests, tokens and bytes alike.
            Refill::Every
        } else if self.refill_enabled
            && observation.sees_own_load
            && observation.counts_own_requests
            && capacity.unit == Unit::Requests
            && observation.max_sys.is_some()
        {
            Refill::BeyondCounted
        } else {
            Refill::Off
        };
        let applied = self.observe_with(
            observation.taken_at,
            n,
            rounding == Rounding::AtLeastOne,
            observation.sees_own_load,
            refill,
        );
        if applied == Applied::Fresh
            && let Some(grant) = &mut self.grant
        {
            grant.ceiling = headroom_units(max_sys, 1.0 - observation.baseline.get(), rounding);
        }
        (n, applied)
    }

    /// The gateway said the pool is saturated (429/503) at `at`: budget zero
    /// until an observation newer than `at`. (How long nothing at all is
    /// sent, `Retry-After` and backoff, is the gateway-wide
    /// [`super::congestion::CongestionHold`]'s business.)
    pub fn congested(&mut self, at: Instant) {
        self.congested_at = Some(self.congested_at.map_or(at, |c| c.max(at)));
        self.grant = None;
    }

    /// Whether a 429/503 holds the window shut until a newer observation.
    pub fn is_held(&self) -> bool {
        self.congested_at.is_some()
    }

    /// Whether the latest live reading allows work in flight at all (its
    /// window is above zero and no 429/503 holds it), even if that window
    /// is full now: work leased then goes as soon as some finishes.
    pub fn is_open(&self, now: Instant) -> bool {
        !self.is_held() && self.live_grant(now).is_some_and(|g| g.limit > 0)
    }

    /// Units that may still be released now.
    pub fn available(&self, now: Instant) -> u64 {
        if self.is_held() {
            return 0;
        }
        let Some(grant) = self.live_grant(now) else {
            return 0;
        };
        let released = self.sent - grant.sent_at_taken;
        let by_budget = grant
            .n
            .saturating_add(refilled(&grant, self.done))
            .saturating_sub(released);
        let by_window = grant.limit.saturating_sub(self.in_flight());
        by_budget.min(by_window)
    }

    /// Whether a request of `cost` units may go now. Requests are whole: one
    /// that does not fit waits for the next budget.
    pub fn allows(&self, now: Instant, cost: u64) -> bool {
        if cost <= self.available(now) {
            return self.live_grant(now).is_some();
        }
        match self.live_grant(now) {
            Some(grant) if grant.at_least_one && !self.is_held() => {
                self.sent == grant.sent_at_taken
            }
            _ => false,
        }
    }

    /// The grant, unless its observation has outlived `max_staleness`.
    fn live_grant(&self, now: Instant) -> Option<Grant> {
        self.grant
            .filter(|g| now.saturating_duration_since(g.taken_at) <= self.grant_lifetime)
    }

    /// Records `cost` units sent at `now`. Call only after [`Self::allows`].
    pub fn sent(&mut self, now: Instant, cost: u64) {
        self.record(now);
        self.sent += cost;
    }

    /// Records `cost` units finished (answered or abandoned) at `now`.
    pub fn finished(&mut self, now: Instant, cost: u64) {
        self.record(now);
        self.done = (self.done + cost).min(self.sent);
    }

    /// The grant's `N` and window limit, for metrics: `(n, window)`.
    pub fn grant(&self) -> Option<(u64, u64)> {
        self.grant.map(|g| (g.n, g.limit))
    }

    /// The grant's `N` while its observation is younger than
    /// `max_staleness` (spent or not); `None` without a live grant.
    pub fn live_n(&self, now: Instant) -> Option<u64> {
        self.live_grant(now).map(|g| g.n)
    }

    /// The grant's ceiling `max_SYS × (1 − B)` (`u64::MAX` when unknown).
    pub fn ceiling(&self) -> Option<u64> {
        self.grant.map(|g| g.ceiling)
    }

    /// When the latest applied observation was taken.
    pub fn taken_at(&self) -> Option<Instant> {
        self.grant.map(|g| g.taken_at)
    }

    /// Adds a history mark holding the counters *before* the event at `now`,
    /// and forgets marks older than the history span.
    fn record(&mut self, now: Instant) {
        self.last_event = self.last_event.max(now);
        let newest = self.marks.back().map(|m| m.at);
        if newest.is_none_or(|at| now.saturating_duration_since(at) >= MARK_GRANULARITY) {
            self.marks.push_back(Mark {
                at: now,
                sent: self.sent,
                done: self.done,
            });
        }
        let cutoff = now.checked_sub(self.history);
        if let Some(cutoff) = cutoff {
            // Keep one mark at or before the cutoff so any observation within
            // the history span finds the counters that applied then.
            while self.marks.len() > 1 && self.marks[1].at <= cutoff {
                self.marks.pop_front();
            }
        }
    }

    /// Counters as of `at`. Errs on the side of counting more work as sent
    /// after `at` (so less is released), never less.
    fn counters_at(&self, at: Instant) -> (u64, u64) {
        if at >= self.last_event {
            return (self.sent, self.done);
        }
        match self.marks.iter().rev().find(|m| m.at <= at) {
            Some(mark) => (mark.sent, mark.done),
            // Older than our history: assume all current work was sent after
            // `at`, which releases nothing until a newer observation.
            None => (0, 0),
        }
    }
}

/// Units of ours sent after the grant's reading that have finished since,
/// at least: the finishes after `taken_at` beyond the work the reading
/// counted as running (module docs, "Refill on own finishes"). Zero for a
/// grant that does not refill.
fn refilled(grant: &Grant, done: u64) -> u64 {
    let since = done.saturating_sub(grant.done_at_taken);
    match grant.refill {
        Refill::Off => 0,
        Refill::BeyondCounted => since.saturating_sub(grant.in_flight_at_taken),
        Refill::Every => since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn worked_example_fullness_point_three() {
        // F = 0.3, B = 0.1, 5 ready × max_concurrency 10.
        let d = 1.0 - 0.3;
        let n = headroom_units(5.0 * 10.0, d - 0.1, Rounding::Floor);
        assert_eq!(n, 30);
    }

    #[test]
    fn rounding_modes() {
        assert_eq!(headroom_units(10.0, 0.05, Rounding::Floor), 0);
        assert_eq!(headroom_units(10.0, 0.05, Rounding::Ceil), 1);
        assert_eq!(headroom_units(10.0, 0.05, Rounding::AtLeastOne), 1);
        assert_eq!(headroom_units(10.0, 0.0, Rounding::AtLeastOne), 0);
        assert_eq!(headroom_units(10.0, -0.2, Rounding::Ceil), 0);
        assert_eq!(headroom_units(10.0, f64::NAN, Rounding::Ceil), 0);
        assert_eq!(headroom_units(10.0, 0.35, Rounding::Ceil), 4);
    }

    #[test]
    fn byte_window_truncates_to_whole_requests() {
        // 1 MiB capacity at headroom 0.6 = 614.4 KiB.
        let now = t0();
        let n = headroom_units(1024.0 * 1024.0, 0.6, Rounding::Floor);
        assert_eq!(n, 629_145);
        let mut w = Window::new(now, Duration::from_secs(60));
        w.observe(now, n, false, true);
        assert!(w.allows(now, 600 * 1024));
        w.sent(now, 600 * 1024);
        assert!(!w.allows(now, 100 * 1024), "the second request waits");
        let later = now + Duration::from_secs(1);
        w.finished(later, 600 * 1024);
        assert!(!w.allows(later, 100 * 1024), "still waits: no new budget");
        w.observe(later, n, false, true);
        assert!(w.allows(later, 100 * 1024));
    }

    #[test]
    fn at_least_one_lets_one_oversized_request_through() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        w.observe(now, 100, true, true);
        assert!(w.allows(now, 500));
        w.sent(now, 500);
        assert!(!w.allows(now, 1));
    }

    #[test]
    fn cached_observation_does_not_refill() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        assert_eq!(w.observe(now, 3, false, true), Applied::Fresh);
        for _ in 0..3 {
            assert!(w.allows(now, 1));
            w.sent(now, 1);
        }
        assert!(!w.allows(now, 1));
        assert_eq!(w.observe(now, 3, false, true), Applied::NotNewer);
        assert!(!w.allows(now, 1));
    }

    #[test]
    fn sends_after_the_observation_count_against_n() {
        let start = t0();
        let mut w = Window::new(start, Duration::from_secs(60));
        // Send 4 at t = 1 s; the pool's metrics describe t = 0.5 s.
        let t1 = start + Duration::from_secs(1);
        w.observe(start, 10, false, true);
        for _ in 0..4 {
            w.sent(t1, 1);
        }
        let lagging = start + Duration::from_millis(500);
        assert_eq!(w.observe(lagging, 10, false, true), Applied::Fresh);
        // 4 sent after the data was taken: only 6 more.
        assert_eq!(w.available(t1), 6);
        // A fresh observation at t1 sees the 4 in flight: window = 4 + 10.
        let t2 = t1 + Duration::from_millis(1);
        w.observe(t2, 10, false, true);
        assert_eq!(w.grant(), Some((10, 14)));
        assert_eq!(w.available(t2), 10);
    }

    #[test]
    fn blind_readings_cap_in_flight_at_n() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        for step in 0..10u64 {
            let t = now + Duration::from_millis(step);
            w.observe(t, 4, false, false);
            while w.allows(t, 1) {
                w.sent(t, 1);
            }
            assert_eq!(
                w.in_flight(),
                4,
                "refreshing a blind reading never grows in-flight past N"
            );
        }
        let later = now + Duration::from_secs(1);
        w.finished(later, 1);
        w.observe(later, 4, false, false);
        assert_eq!(w.available(later), 1);
    }

    #[test]
    fn window_limits_in_flight_even_when_n_is_unused() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        w.observe(now, 5, false, true);
        assert_eq!(w.grant(), Some((5, 5)));
        w.sent(now, 5);
        assert_eq!(w.available(now), 0);
    }

    #[test]
    fn congestion_closes_until_newer_observation() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        w.observe(now, 10, false, true);
        let rejected = now + Duration::from_secs(1);
        w.congested(rejected);
        assert_eq!(w.available(rejected), 0);
        // An observation older than the rejection does not reopen.
        let before = now + Duration::from_millis(500);
        assert_eq!(
            w.observe(before, 10, false, true),
            Applied::BeforeCongestion
        );
        assert_eq!(w.available(rejected), 0);
        // A newer one does.
        let newer = now + Duration::from_secs(2);
        assert_eq!(w.observe(newer, 10, false, true), Applied::Fresh);
        assert_eq!(w.available(newer), 10);
    }

    #[test]
    fn grant_expires_when_its_observation_outlives_max_staleness() {
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(10));
        w.observe(now, 10, false, true);
        w.sent(now, 2);
        let late = now + Duration::from_secs(10);
        assert_eq!(w.available(late), 8);
        let stale = now + Duration::from_millis(10_001);
        assert_eq!(w.available(stale), 0);
        assert!(!w.allows(stale, 1));
    }

    #[test]
    fn a_finish_after_the_reading_frees_its_units() {
        let t = t0();
        let s = Duration::from_secs(1);
        let mut plain = Window::new(t, Duration::from_secs(60));
        let mut refilling = Window::new(t, Duration::from_secs(60));
        plain.observe(t, 3, false, true);
        refilling.observe_refilling(t, 3, false);
        for w in [&mut plain, &mut refilling] {
            for _ in 0..3 {
                assert!(w.allows(t + s, 1));
                w.sent(t + s, 1);
            }
            assert_eq!(w.available(t + s), 0);
            w.finished(t + 2 * s, 1);
        }
        assert_eq!(refilling.available(t + 2 * s), 1, "its room comes back");
        assert_eq!(plain.available(t + 2 * s), 0, "waits for a reading");
        refilling.sent(t + 2 * s, 1);
        assert_eq!(refilling.in_flight(), 3);
        assert_eq!(refilling.available(t + 2 * s), 0);
    }

    #[test]
    fn a_finish_before_the_readings_data_time_frees_nothing() {
        let t = t0();
        let s = Duration::from_secs(1);
        let mut w = Window::new(t, Duration::from_secs(60));
        w.observe_refilling(t, 3, false);
        w.sent(t + s, 3);
        w.finished(t + 2 * s, 1);
        // Data of 3 s: two of ours running, headroom 2 more. The finish at
        // 2 s is in the reading already (its room is part of N).
        let taken = t + 3 * s;
        assert_eq!(w.observe_refilling(taken, 2, false), Applied::Fresh);
        assert_eq!(w.grant(), Some((2, 4)));
        assert_eq!(w.available(taken), 2, "N, not N + the earlier finish");
        w.sent(taken, 2);
        assert_eq!(w.available(taken), 0);
        // A reading lagging behind a finish: data of 3 s, finish at 4 s of
        // work the reading counted as running frees nothing.
        w.finished(taken + s, 1);
        assert_eq!(w.available(taken + s), 0);
    }

    #[test]
    fn work_the_reading_counted_frees_nothing_until_it_is_all_done() {
        let t = t0();
        let s = Duration::from_secs(1);
        let mut w = Window::new(t, Duration::from_secs(60));
        w.observe_refilling(t, 4, false);
        w.sent(t, 4);
        // Taken with our 4 running: window 4 + 2.
        let taken = t + s;
        w.observe_refilling(taken, 2, false);
        w.sent(taken + s, 2);
        assert_eq!(w.in_flight(), 6);
        // Finishes after the reading: the first four are taken to be the
        // four it counted (it charged them to the pool, not to N).
        for k in 1..=4u32 {
            w.finished(taken + s * (1 + k), 1);
            assert_eq!(w.available(taken + s * (1 + k)), 0, "finish {k}");
        }
        // From then on a finish can only be one of the two sent since.
        let later = taken + 6 * s;
        w.finished(later, 1);
        assert_eq!(w.available(later), 1);
        w.finished(later, 1);
        assert_eq!(w.available(later), 2, "never more than N in flight since");
        assert_eq!(w.in_flight(), 0);
    }

    fn reading(sees_own_load: bool, counts_own_requests: bool) -> Observation {
        let mut o = Observation::open(crate::gate::Budget::saturating(0.5), Instant::now());
        o.sees_own_load = sees_own_load;
        o.counts_own_requests = counts_own_requests;
        o.max_sys = Some(8.0);
        o
    }

    /// Sends the 4 the reading allows, finishes one after it, and tells
    /// what is available then.
    fn room_after_one_finish(o: &Observation, unit: Unit) -> u64 {
        room_after_one_finish_with(o, unit, true)
    }

    fn room_after_one_finish_with(o: &Observation, unit: Unit, enabled: bool) -> u64 {
        let t = o.taken_at;
        let mut w = Window::new(t, Duration::from_secs(60));
        w.set_refill_own_finishes(enabled);
        let capacity = Capacity { max_sys: 8.0, unit };
        let (n, applied) = w.apply(o, capacity, Rounding::Floor);
        assert_eq!((n, applied), (4, Applied::Fresh));
        let later = t + Duration::from_secs(1);
        w.sent(later, 4);
        w.finished(later + Duration::from_secs(1), 1);
        w.available(later + Duration::from_secs(1))
    }

    #[test]
    fn only_readings_that_count_our_requests_refill() {
        assert_eq!(
            room_after_one_finish(&reading(true, true), Unit::Requests),
            1
        );
        // Sees our load in KV or saturation only: N per reading.
        assert_eq!(
            room_after_one_finish(&reading(true, false), Unit::Requests),
            0
        );
        // Blind: today's rule.
        assert_eq!(
            room_after_one_finish(&reading(false, true), Unit::Requests),
            0
        );
        // A token queue's N is not in the reading's requests.
        assert_eq!(room_after_one_finish(&reading(true, true), Unit::Tokens), 0);
        let mut no_live_capacity = reading(true, true);
        no_live_capacity.max_sys = None;
        assert_eq!(room_after_one_finish(&no_live_capacity, Unit::Requests), 0);
        // Switched off (`eval --no-refill`): N per reading.
        assert_eq!(
            room_after_one_finish_with(&reading(true, true), Unit::Requests, false),
            0
        );
    }

    #[test]
    fn a_cap_on_own_in_flight_frees_room_at_every_finish() {
        let mut cap = reading(false, false);
        cap.caps_own_in_flight = true;
        // Whatever the unit, and with the other refill rule off: the gate
        // counts its own work.
        assert_eq!(room_after_one_finish(&cap, Unit::Requests), 1);
        assert_eq!(room_after_one_finish(&cap, Unit::Tokens), 1);
        assert_eq!(room_after_one_finish_with(&cap, Unit::Requests, false), 1);
        // A reading that sees our load is no cap: its own rules hold.
        let mut seeing = reading(true, false);
        seeing.caps_own_in_flight = true;
        assert_eq!(room_after_one_finish(&seeing, Unit::Requests), 0);
    }

    #[test]
    fn a_cap_holds_in_flight_at_n_between_readings() {
        // The eval's failure: one reading of N = 4, requests finishing
        // and being replaced many times before the next reading.
        let now = t0();
        let mut w = Window::new(now, Duration::from_secs(60));
        w.observe_cap(now, 4, false);
        let mut sent = 0;
        for k in 1..=20u64 {
            let t = now + Duration::from_millis(10 * k);
            while w.allows(t, 1) {
                w.sent(t, 1);
                sent += 1;
            }
            assert_eq!(w.in_flight(), 4, "at N, never above");
            w.finished(t, 1);
        }
        assert_eq!(sent, 4 + 19, "every finish was replaced at once");
    }

    #[derive(Debug, Clone)]
    enum Step {
        Advance(u64),
        Send(u64),
        Finish,
        Observe { lag_ms: u64, n: u64, blind: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..200).prop_map(Step::Advance),
            (1u64..5).prop_map(Step::Send),
            Just(Step::Finish),
            (0u64..3000, 0u64..20, proptest::bool::ANY)
                .prop_map(|(lag_ms, n, blind)| Step::Observe { lag_ms, n, blind }),
        ]
    }

    #[derive(Debug, Clone)]
    enum RefillStep {
        Advance(u64),
        Send(u64),
        Finish(usize),
        Observe { lag_ms: u64, n: u64 },
    }

    fn refill_step() -> impl Strategy<Value = RefillStep> {
        prop_oneof![
            (1u64..200).prop_map(RefillStep::Advance),
            (1u64..5).prop_map(RefillStep::Send),
            (0usize..64).prop_map(RefillStep::Finish),
            (0u64..3000, 0u64..20).prop_map(|(lag_ms, n)| RefillStep::Observe { lag_ms, n }),
        ]
    }

    proptest! {
        /// Between two fresh observations the window never releases more
        /// than N, and in-flight never exceeds the window limit (which is N
        /// itself for blind readings).
        #[test]
        fn never_releases_more_than_n(steps in proptest::collection::vec(step(), 1..200)) {
            let start = t0() + Duration::from_secs(10);
            let mut now = start;
            let mut w = Window::new(start, Duration::from_secs(60));
            let mut in_flight: Vec<u64> = Vec::new();
            let mut released_since_fresh = 0u64;
            let mut current_n = 0u64;
            for s in steps {
                match s {
                    Step::Advance(ms) => now += Duration::from_millis(ms),
                    Step::Send(cost) => {
                        if w.allows(now, cost) {
                            w.sent(now, cost);
                            in_flight.push(cost);
                            released_since_fresh += cost;
                            prop_assert!(released_since_fresh <= current_n);
                            let (_, limit) = w.grant().expect("a grant allowed the send");
                            prop_assert!(w.in_flight() <= limit);
                        }
                    }
                    Step::Finish => {
                        if let Some(cost) = in_flight.pop() {
                            w.finished(now, cost);
                        }
                    }
                    Step::Observe { lag_ms, n, blind } => {
                        let taken = now.checked_sub(Duration::from_millis(lag_ms)).unwrap_or(now).max(start);
                        if w.observe(taken, n, false, !blind) == Applied::Fresh {
                            released_since_fresh = 0;
                            current_n = n;
                        }
                    }
                }
            }
        }

        /// With refill, our units finishing after a reading give room
        /// back, but the work in flight that was sent after the reading's
        /// data time never exceeds its N, so in flight never exceeds its
        /// window. Requests finish in any order, known here by send time.
        #[test]
        fn refilling_never_exceeds_the_readings_allowance(
            steps in proptest::collection::vec(refill_step(), 1..300)
        ) {
            let start = t0() + Duration::from_secs(10);
            let mut now = start;
            let mut w = Window::new(start, Duration::from_secs(60));
            let mut in_flight: Vec<(u64, Instant)> = Vec::new();
            for s in steps {
                match s {
                    RefillStep::Advance(ms) => now += Duration::from_millis(ms),
                    RefillStep::Send(cost) => {
                        if w.allows(now, cost) {
                            w.sent(now, cost);
                            in_flight.push((cost, now));
                            let (n, limit) = w.grant().expect("a grant allowed the send");
                            prop_assert!(w.in_flight() <= limit);
                            let taken = w.taken_at().expect("granted");
                            let since: u64 = in_flight.iter().filter(|(_, at)| *at > taken).map(|(c, _)| c).sum();
                            prop_assert!(since <= n, "{since} sent since the reading, N {n}");
                        }
                    }
                    RefillStep::Finish(pick) => {
                        if !in_flight.is_empty() {
                            let (cost, _) = in_flight.remove(pick % in_flight.len());
                            w.finished(now, cost);
                        }
                    }
                    RefillStep::Observe { lag_ms, n } => {
                        let taken = now.checked_sub(Duration::from_millis(lag_ms)).unwrap_or(now).max(start);
                        w.observe_refilling(taken, n, false);
                    }
                }
                prop_assert_eq!(w.in_flight(), in_flight.iter().map(|(c, _)| c).sum::<u64>());
            }
        }

        #[test]
        fn headroom_is_monotone_in_budget(max_sys in 0.0f64..10_000.0, a in 0.0f64..1.0, b in 0.0f64..1.0) {
            let (lo, hi) = if a < b { (a, b) } else { (b, a) };
            for r in [Rounding::Floor, Rounding::Ceil, Rounding::AtLeastOne] {
                prop_assert!(headroom_units(max_sys, lo, r) <= headroom_units(max_sys, hi, r));
            }
            prop_assert!(headroom_units(max_sys, hi, Rounding::Floor) as f64 <= max_sys * hi + 1e-6 * max_sys.max(1.0));
        }
    }
}
