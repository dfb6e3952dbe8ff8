//! Counted admission (`endpoint-scrape` with `admission = "counted"`,
//! upstream's headroom gate, llm-d-async #484): each reading of a count
//! metric grants its free slots, floor(capacity − count), and at most that
//! many requests start until the next reading. A failed reading admits
//! nothing.
//!
//! Why beside the window: the window already bounds what is in flight by
//! the last reading's free slots, but a request that finishes between two
//! readings gives its room back at once. Where the metric is a queue that
//! requests leave long after we see them finish (an endpoint picker's
//! batch queue), that refill overshoots; counting starts per reading
//! cannot. The reading is the gate's cached page, so a new reading comes
//! at most once per source cache interval.

use std::sync::Mutex;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{
    Admission, AdmissionRequest, DispatchEvent, DispatchGate, Explanation, GateError, Observation,
    Ticket,
};

/// The counting rule, pure: which reading the slots belong to and how many
/// of them were taken.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Allowance {
    /// When the reading the slots come from was taken; `None` before the
    /// first reading.
    reading: Option<Instant>,
    /// Free slots of that reading.
    slots: u64,
    /// Requests admitted on it.
    admitted: u64,
}

impl Allowance {
    /// Applies the latest reading (`Some((taken_at, free))`, or `None` when
    /// it failed), then takes one slot if this reading has one left. A new
    /// reading (another `taken_at`) starts a new count; the same reading
    /// read again keeps counting. A failure takes the slots away until a
    /// newer reading: the page that came before it is not counted again.
    pub(super) fn admit(&mut self, reading: Option<(Instant, f64)>) -> bool {
        match reading {
            None => self.slots = 0,
            Some((taken_at, free)) if self.reading != Some(taken_at) => {
                // `free` is a count of slots: a fraction of one is none.
                let slots = if free.is_finite() && free > 0.0 {
                    free.floor() as u64
                } else {
                    0
                };
                *self = Self {
                    reading: Some(taken_at),
                    slots,
                    admitted: 0,
                };
            }
            Some(_) => {}
        }
        if self.admitted < self.slots {
            self.admitted += 1;
            true
        } else {
            false
        }
    }
}

/// A count-metric gate whose admissions are counted per reading.
#[derive(Debug)]
pub(super) struct CountedAdmission {
    gate: Box<dyn DispatchGate>,
    allowance: Mutex<Allowance>,
}

impl CountedAdmission {
    /// Counts the admissions of `gate`, whose readings must carry their
    /// capacity (`max_sys`) and no baseline: free = max_sys × D.
    pub(super) fn new(gate: Box<dyn DispatchGate>) -> Self {
        Self {
            gate,
            allowance: Mutex::new(Allowance::default()),
        }
    }
}

/// Free slots of a reading: capacity × D, D = 1 − count / capacity.
fn free_slots(observation: &Observation) -> Option<(Instant, f64)> {
    let capacity = observation.max_sys?;
    Some((observation.taken_at, capacity * observation.budget.get()))
}

impl DispatchGate for CountedAdmission {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        self.gate.observe()
    }

    fn admit<'a>(&'a self, _request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            // The cached page: a new reading at most once per interval.
            let reading = self.gate.observe().await.ok();
            let failed = reading.is_none();
            let admitted = self
                .allowance
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .admit(reading.as_ref().and_then(free_slots));
            match (admitted, failed) {
                (true, _) => Admission::Continue(Ticket::none()),
                (false, true) => Admission::Wait {
                    reason: "reading_failed",
                },
                (false, false) => Admission::Wait {
                    reason: "no_free_slots",
                },
            }
        })
    }

    fn kind(&self) -> &'static str {
        self.gate.kind()
    }

    fn on_event(&self, event: DispatchEvent) {
        self.gate.on_event(event);
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        self.gate.explain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_reading_grants_its_whole_free_slots_once() {
        let t0 = Instant::now();
        let mut a = Allowance::default();
        let admitted = (0..5).filter(|_| a.admit(Some((t0, 3.7)))).count();
        assert_eq!(
            admitted, 3,
            "floor(3.7) slots, then none until a new reading"
        );
    }

    #[test]
    fn a_new_reading_starts_a_new_count_and_the_same_one_does_not() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut a = Allowance::default();
        assert!(a.admit(Some((t0, 1.0))));
        assert!(
            !a.admit(Some((t0, 5.0))),
            "same reading: its one slot is taken"
        );
        assert!(a.admit(Some((t1, 2.0))));
        assert!(a.admit(Some((t1, 2.0))));
        assert!(!a.admit(Some((t1, 2.0))));
    }

    #[test]
    fn a_failed_reading_admits_nothing_until_a_newer_reading() {
        let t0 = Instant::now();
        let mut a = Allowance::default();
        assert!(a.admit(Some((t0, 4.0))));
        assert!(!a.admit(None));
        assert!(
            !a.admit(Some((t0, 4.0))),
            "the page from before the failure is not counted again"
        );
        assert!(a.admit(Some((t0 + Duration::from_secs(1), 4.0))));
    }

    #[test]
    fn no_room_or_a_nonsense_reading_admits_nothing() {
        let t0 = Instant::now();
        for free in [0.0, 0.99, -3.0, f64::NAN, f64::NEG_INFINITY] {
            let mut a = Allowance::default();
            assert!(!a.admit(Some((t0, free))), "{free}");
        }
    }
}
