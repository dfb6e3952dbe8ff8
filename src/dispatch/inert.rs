//! Inert-gate detection (upstream llm-d-async #363): a gate whose threshold
//! the pool can never reach sends nothing and says nothing. Pure: no I/O,
//! no clock; the observer passes each reading, our own in-flight work and
//! the instant in.
//!
//! Two states, each judged per queue from the stream of readings the
//! observer applies (one per `dispatch.poll_interval`, more on demand):
//!
//! - **`never_opens`**: for at least `span` (`dispatch.inert_after`), every
//!   reading had its source available, `D ≤ B` (no headroom), was a reading
//!   of the pool (not `local-max-concurrency`'s own slots), and our own
//!   work in flight on the queue's pool (this process) was zero. Our load
//!   cannot be what keeps the gate shut, and the source answers: the
//!   pool's own reading never left room for batch work. Typical causes: a
//!   baseline `B` (or a `threshold`) above what `D` ever reaches, a
//!   `max_concurrency` or capacity parameter so low that the pool always
//!   reads full, a query that reads the wrong series.
//! - **`max_sys_below_capacity`**: for at least `span`, every reading had
//!   its source available, was a reading of the pool that does not charge
//!   our requests against its own capacity (`counts_own_requests` false),
//!   still showed room for at least one more unit (`max_SYS × (D − B)`,
//!   rounded as the queue rounds, ≥ 1), and our own work in flight was at
//!   least 90 % of the queue's ceiling `max_SYS × (1 − B)` (rounded the
//!   same way, at least one unit): everything `max_SYS` can ever allow is
//!   in use and the pool still has room, so `max_SYS`, not the pool, is
//!   the limit. `max_SYS` is the effective one: a reading's live capacity
//!   for a `requests` queue, else the queue's static `max_sys`. A reading
//!   that counts our requests (`vllm`, `prometheus-budget`'s running
//!   requests, `local-max-concurrency`) measures the pool's capacity in
//!   the very `max_SYS` it charges them to, so `max_SYS` cannot be below
//!   it: such readings are not judged (our window filling below that
//!   ceiling would otherwise look pinned).
//!
//! Any reading that breaks a rule ends that state at once (and restarts
//! its count). A state is reported once it has held for the whole span,
//! so one reading never raises it.
//!
//! Why a span, and why 10 minutes by default: a pool busy with interactive
//! load reads `D ≤ B` too, for as long as the busy period lasts, and the
//! two cannot be told apart from one reading. Bursts that fill a pool
//! typically last seconds to a few minutes (the evaluator's saturating
//! waves last 60 s, its bursts 30–60 s: `src/eval/scenario.rs`), so ten
//! minutes without a single reading with room, with none of our work in
//! flight, is well past them; the alert then waits 5 more minutes. A pool
//! that really is full for longer than that is reported too, and the
//! runbook says how to tell (`docs/operations.md`, "SluicegateGateInert").
//!
//! Not detected: `local-max-concurrency`'s readings (alone, or the tightest
//! reading of a `composite`) are our own slots, not the pool, so neither
//! rule judges them (their `D` says nothing about the pool's room).
//! Own in-flight is this process's: with several replicas on one pool,
//! another replica's batch work can hold `D` at `B` while this one has
//! none in flight, and this one then reads `never_opens`.

use std::time::Duration;

use tokio::time::Instant;

use super::window::headroom_units;
use crate::config::Rounding;
use crate::gate::{Capacity, Observation};

/// Default `dispatch.inert_after`.
pub const DEFAULT_INERT_AFTER: Duration = Duration::from_secs(600);

/// Why a gate is inert: the bounded `reason` label of
/// `sluicegate_gate_inert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InertReason {
    /// `D ≤ B` for the span with the source available and none of our
    /// work in flight.
    NeverOpens,
    /// Our work in flight at `max_SYS`'s ceiling for the span while the
    /// pool still read `D > B`.
    MaxSysBelowCapacity,
}

impl InertReason {
    /// Every reason, in label order.
    pub const ALL: [Self; 2] = [Self::NeverOpens, Self::MaxSysBelowCapacity];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NeverOpens => "never_opens",
            Self::MaxSysBelowCapacity => "max_sys_below_capacity",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::NeverOpens => 0,
            Self::MaxSysBelowCapacity => 1,
        }
    }
}

/// One reading as the detector judges it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// When the observer applied it.
    pub at: Instant,
    /// Whether the gate's source answered usably.
    pub source_available: bool,
    /// Whether `D` is our own free share of a local limit, not the pool.
    pub local_limit: bool,
    /// Budget `D`.
    pub budget: f64,
    /// Baseline `B`.
    pub baseline: f64,
    /// Effective `max_SYS` in the queue's unit.
    pub max_sys: f64,
    /// `max_SYS × (1 − B)` in whole units (the queue's rounding).
    pub ceiling: u64,
    /// `max_SYS × (D − B)` in whole units: the room the reading shows.
    pub room: u64,
    /// Whether the reading charges each request of ours against its live
    /// `max_SYS` (`Observation::counts_own_requests`).
    pub counts_own_requests: bool,
    /// Our own work in flight on the queue's pool (this process), in the
    /// queue's unit.
    pub own_in_flight: u64,
}

impl Reading {
    /// The reading of `observation` for a queue of `capacity` and
    /// `rounding`, with `own_in_flight` units of ours in flight at `at`.
    pub fn new(
        observation: &Observation,
        capacity: Capacity,
        rounding: Rounding,
        own_in_flight: u64,
        at: Instant,
    ) -> Self {
        let max_sys = capacity.effective(observation.max_sys);
        let baseline = observation.baseline.get();
        Self {
            at,
            source_available: observation.source_available,
            local_limit: observation.local_limit,
            budget: observation.budget.get(),
            baseline,
            max_sys,
            ceiling: headroom_units(max_sys, 1.0 - baseline, rounding),
            room: headroom_units(max_sys, observation.headroom(), rounding),
            counts_own_requests: observation.counts_own_requests,
            own_in_flight,
        }
    }

    /// Whether this reading keeps `reason`'s rule (module docs).
    pub fn keeps(&self, reason: InertReason) -> bool {
        if !self.source_available || self.local_limit {
            return false;
        }
        match reason {
            InertReason::NeverOpens => self.budget <= self.baseline && self.own_in_flight == 0,
            InertReason::MaxSysBelowCapacity => {
                !self.counts_own_requests
                    && self.budget > self.baseline
                    && self.room >= 1
                    && self.ceiling > 0
                    && self.own_in_flight.saturating_mul(10) >= self.ceiling.saturating_mul(9)
            }
        }
    }
}

/// A state change, for the log line and the gauge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Change {
    /// Which state.
    pub reason: InertReason,
    /// Entered (`true`) or left.
    pub inert: bool,
    /// When the rule started to hold (entering), or held from (leaving).
    pub since: Instant,
    /// How long it has held.
    pub held_for: Duration,
    /// The reading that made the change.
    pub reading: Reading,
    /// Over the run of readings that kept the rule: the highest `D`
    /// (`never_opens`: the closest the pool came to `B`) or the lowest
    /// (`max_sys_below_capacity`: the least room the pool showed).
    pub extreme_budget: f64,
}

/// One rule's run of readings.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    /// First reading of the current run.
    since: Option<Instant>,
    /// Reported as inert.
    inert: bool,
    /// Highest or lowest `D` of the run.
    extreme: f64,
}

/// Per-queue inert-gate detector.
#[derive(Debug, Clone)]
pub struct InertDetector {
    span: Duration,
    runs: [Run; 2],
}

impl InertDetector {
    /// A detector reporting a state once its rule held for `span`.
    pub fn new(span: Duration) -> Self {
        Self {
            span,
            runs: [Run::default(); 2],
        }
    }

    /// The span a rule must hold.
    pub fn span(&self) -> Duration {
        self.span
    }

    /// Whether `reason`'s state is reported now.
    pub fn is_inert(&self, reason: InertReason) -> bool {
        self.runs[reason.index()].inert
    }

    /// Judges one reading; returns the states it entered or left (at most
    /// one change per reason).
    pub fn update(&mut self, reading: &Reading) -> Vec<Change> {
        let mut changes = Vec::new();
        for reason in InertReason::ALL {
            let run = &mut self.runs[reason.index()];
            if reading.keeps(reason) {
                if run.since.is_none() {
                    run.since = Some(reading.at);
                    run.extreme = reading.budget;
                }
                let since = run.since.unwrap_or(reading.at);
                run.extreme = match reason {
                    InertReason::NeverOpens => run.extreme.max(reading.budget),
                    InertReason::MaxSysBelowCapacity => run.extreme.min(reading.budget),
                };
                let held_for = reading.at.saturating_duration_since(since);
                if !run.inert && held_for >= self.span {
                    run.inert = true;
                    changes.push(Change {
                        reason,
                        inert: true,
                        since,
                        held_for,
                        reading: *reading,
                        extreme_budget: run.extreme,
                    });
                }
            } else {
                let was = std::mem::take(run);
                if was.inert {
                    let since = was.since.unwrap_or(reading.at);
                    changes.push(Change {
                        reason,
                        inert: false,
                        since,
                        held_for: reading.at.saturating_duration_since(since),
                        reading: *reading,
                        extreme_budget: was.extreme,
                    });
                }
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: Duration = Duration::from_secs(600);

    fn reading(at: Instant, d: f64, b: f64, in_flight: u64) -> Reading {
        Reading {
            at,
            source_available: true,
            local_limit: false,
            budget: d,
            baseline: b,
            max_sys: 10.0,
            ceiling: headroom_units(10.0, 1.0 - b, Rounding::Floor),
            room: headroom_units(10.0, d - b, Rounding::Floor),
            counts_own_requests: false,
            own_in_flight: in_flight,
        }
    }

    /// Feeds one reading per second from `t0 + from` to `t0 + to`
    /// (exclusive), collecting changes.
    fn feed(
        det: &mut InertDetector,
        t0: Instant,
        from: u64,
        to: u64,
        f: impl Fn(Instant) -> Reading,
    ) -> Vec<(u64, Change)> {
        let mut out = Vec::new();
        for s in from..to {
            let at = t0 + Duration::from_secs(s);
            out.extend(det.update(&f(at)).into_iter().map(|c| (s, c)));
        }
        out
    }

    #[test]
    fn a_gate_whose_baseline_is_never_reached_is_never_opens_after_the_span_and_not_before() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        // B = 0.5, the pool reads D between 0.2 and 0.4, nothing of ours.
        let changes = feed(&mut det, t0, 0, 700, |at| {
            let s = at.duration_since(t0).as_secs();
            reading(at, 0.2 + 0.2 * ((s % 10) as f64 / 10.0), 0.5, 0)
        });
        assert_eq!(changes.len(), 1, "{changes:?}");
        let (s, c) = changes[0];
        assert_eq!(s, 600, "entered exactly when the span had passed");
        assert_eq!(c.reason, InertReason::NeverOpens);
        assert!(c.inert);
        assert_eq!(c.since, t0);
        assert_eq!(c.held_for, SPAN);
        assert!((c.extreme_budget - 0.38).abs() < 1e-9, "{c:?}");
        assert!(det.is_inert(InertReason::NeverOpens));
        assert!(!det.is_inert(InertReason::MaxSysBelowCapacity));
    }

    #[test]
    fn one_open_reading_restarts_the_count_and_a_busy_period_shorter_than_the_span_is_not_inert() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        // Nine minutes closed, one reading with room, nine more closed.
        let mut changes = feed(&mut det, t0, 0, 540, |at| reading(at, 0.0, 0.2, 0));
        changes.extend(
            det.update(&reading(t0 + Duration::from_secs(540), 0.5, 0.2, 0))
                .into_iter()
                .map(|c| (540, c)),
        );
        changes.extend(feed(&mut det, t0, 541, 1081, |at| reading(at, 0.1, 0.2, 0)));
        assert!(changes.is_empty(), "{changes:?}");
        assert!(!det.is_inert(InertReason::NeverOpens));
        // ... and the tenth minute of the second run reports it.
        let c = det.update(&reading(t0 + Duration::from_secs(1141), 0.1, 0.2, 0));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].since, t0 + Duration::from_secs(541));
    }

    #[test]
    fn our_own_work_in_flight_or_an_unavailable_source_is_not_never_opens() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        // Closed the whole time, but our own work runs: our load may be
        // what keeps it shut.
        let changes = feed(&mut det, t0, 0, 1200, |at| reading(at, 0.0, 0.1, 3));
        assert!(changes.is_empty());
        // Closed because the source cannot be read: its own alert.
        let changes = feed(&mut det, t0, 1200, 2400, |at| Reading {
            source_available: false,
            ..reading(at, 0.0, 0.1, 0)
        });
        assert!(changes.is_empty());
        // A local limit's readings are not the pool.
        let changes = feed(&mut det, t0, 2400, 3600, |at| Reading {
            local_limit: true,
            ..reading(at, 0.0, 0.0, 0)
        });
        assert!(changes.is_empty());
    }

    #[test]
    fn leaving_is_reported_once_at_the_first_reading_with_room() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        let entered = feed(&mut det, t0, 0, 900, |at| reading(at, 0.05, 0.3, 0));
        assert_eq!(entered.len(), 1);
        let left = det.update(&reading(t0 + Duration::from_secs(900), 0.6, 0.3, 0));
        assert_eq!(left.len(), 1);
        let c = left[0];
        assert_eq!(c.reason, InertReason::NeverOpens);
        assert!(!c.inert);
        assert_eq!(c.since, t0);
        assert_eq!(c.held_for, Duration::from_secs(900));
        assert!((c.extreme_budget - 0.05).abs() < 1e-12);
        assert!(!det.is_inert(InertReason::NeverOpens));
        // Staying open says nothing more.
        assert!(feed(&mut det, t0, 901, 2000, |at| reading(at, 0.6, 0.3, 2)).is_empty());
        // A source outage also ends the state (its own alert takes over).
        let _ = feed(&mut det, t0, 2000, 2700, |at| reading(at, 0.0, 0.3, 0));
        assert!(det.is_inert(InertReason::NeverOpens));
        let c = det.update(&Reading {
            source_available: false,
            ..reading(t0 + Duration::from_secs(2700), 0.0, 0.3, 0)
        });
        assert_eq!(c.len(), 1);
        assert!(!c[0].inert);
    }

    #[test]
    fn work_pinned_at_the_ceiling_while_the_pool_shows_room_is_max_sys_below_capacity() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        // max_SYS 10, B 0.2: ceiling 8; 8 of ours in flight, D 0.7..0.9.
        let changes = feed(&mut det, t0, 0, 601, |at| {
            let s = at.duration_since(t0).as_secs();
            reading(at, if s % 2 == 0 { 0.9 } else { 0.7 }, 0.2, 8)
        });
        assert_eq!(changes.len(), 1, "{changes:?}");
        let (s, c) = changes[0];
        assert_eq!(s, 600);
        assert_eq!(c.reason, InertReason::MaxSysBelowCapacity);
        assert!(c.inert);
        assert_eq!(c.reading.ceiling, 8);
        assert!((c.extreme_budget - 0.7).abs() < 1e-12);
        assert!(!det.is_inert(InertReason::NeverOpens));
        // A reading with room for less than one unit ends it: the pool,
        // not max_SYS, limits.
        let c = det.update(&reading(t0 + Duration::from_secs(601), 0.29, 0.2, 8));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].reason, InertReason::MaxSysBelowCapacity);
        assert!(!c[0].inert);
    }

    #[test]
    fn pinned_means_at_least_ninety_percent_of_the_ceiling() {
        let t0 = Instant::now();
        let r = |in_flight, max_sys: f64| Reading {
            max_sys,
            ceiling: headroom_units(max_sys, 1.0, Rounding::Floor),
            ..reading(t0, 0.9, 0.0, in_flight)
        };
        let keeps = |r: Reading| r.keeps(InertReason::MaxSysBelowCapacity);
        assert!(keeps(r(9, 10.0)));
        assert!(!keeps(r(8, 10.0)));
        assert!(keeps(r(1, 1.0)));
        assert!(!keeps(r(0, 1.0)));
        assert!(keeps(r(90, 100.0)));
        assert!(!keeps(r(89, 100.0)));
        // A ceiling of zero (B = 1 or max_SYS 0) is never "pinned".
        assert!(!keeps(Reading {
            ceiling: 0,
            ..r(0, 0.0)
        }));
    }

    #[test]
    fn a_window_filling_below_the_ceiling_or_a_local_limit_is_not_max_sys_below_capacity() {
        let t0 = Instant::now();
        let mut det = InertDetector::new(SPAN);
        // Room and work, but below the ceiling: the pool's reading limits.
        assert!(feed(&mut det, t0, 0, 1200, |at| reading(at, 0.5, 0.2, 5)).is_empty());
        // A reading that counts our requests against its live max_SYS: that
        // capacity is the pool's own (vllm: 9 of 10 running, D 0.12 > B).
        assert!(
            feed(&mut det, t0, 1200, 2400, |at| Reading {
                counts_own_requests: true,
                ..reading(at, 0.5, 0.1, 9)
            })
            .is_empty()
        );
        // local-max-concurrency at its limit: its D is our slots, not the
        // pool's room.
        assert!(
            feed(&mut det, t0, 1200, 2400, |at| Reading {
                local_limit: true,
                ..reading(at, 0.5, 0.0, 10)
            })
            .is_empty()
        );
    }

    #[test]
    fn the_labels_are_the_metrics_bounded_set() {
        let labels = InertReason::ALL.map(InertReason::label);
        assert_eq!(labels, crate::telemetry::INERT_REASONS);
    }

    #[test]
    fn the_reading_of_an_observation_uses_the_effective_max_sys() {
        use crate::config::Unit;
        use crate::gate::Budget;
        let t0 = Instant::now();
        let mut o = Observation::open(Budget::saturating(0.9), t0);
        o.baseline = Budget::saturating(0.25);
        let requests = Capacity {
            max_sys: 4.0,
            unit: Unit::Requests,
        };
        let r = Reading::new(&o, requests, Rounding::Floor, 3, t0);
        assert_eq!((r.max_sys, r.ceiling, r.room), (4.0, 3, 2));
        assert!(r.keeps(InertReason::MaxSysBelowCapacity));
        // Room for less than one unit is no room.
        o.budget = Budget::saturating(0.45);
        let r = Reading::new(&o, requests, Rounding::Floor, 3, t0);
        assert_eq!(r.room, 0);
        assert!(!r.keeps(InertReason::MaxSysBelowCapacity));
        o.budget = Budget::saturating(0.9);
        // A live max_SYS counts requests: it replaces a requests queue's
        // static one, not a tokens queue's.
        o.max_sys = Some(64.0);
        let r = Reading::new(&o, requests, Rounding::Floor, 3, t0);
        assert_eq!((r.max_sys, r.ceiling), (64.0, 48));
        assert!(!r.keeps(InertReason::MaxSysBelowCapacity));
        let tokens = Capacity {
            max_sys: 4000.0,
            unit: Unit::Tokens,
        };
        let r = Reading::new(&o, tokens, Rounding::Floor, 2600, t0);
        assert_eq!((r.max_sys, r.ceiling), (4000.0, 3000));
        assert!(!r.keeps(InertReason::MaxSysBelowCapacity));
        let r = Reading::new(&o, tokens, Rounding::Floor, 3000, t0);
        assert!(r.keeps(InertReason::MaxSysBelowCapacity));
    }
}
