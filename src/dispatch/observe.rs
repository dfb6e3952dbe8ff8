//! The observer: reads the gate every poll interval (and on demand when
//! the window is used up) and applies each reading to the window.
//!
//! It also logs every change of the gate's state (opened / closed, source
//! lost / back) as one structured event, rate-limited per queue and kind
//! ([`ChangeLog`]) so that a flapping gate cannot flood the log.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::inert::{Change, InertDetector, InertReason, Reading};
use super::state::{Shared, saturating_i64};
use super::window::Applied;
use crate::gate::Capacity;

/// Reads the gate and applies each reading to the window.
pub(super) async fn observe_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let settings = shared.settings().clone();
    let mut was_open: Option<bool> = None;
    let mut was_available: Option<bool> = None;
    let mut open_log = ChangeLog::new(MIN_LOG_GAP);
    let mut source_log = ChangeLog::new(MIN_LOG_GAP);
    let mut next_backlog = Instant::now();
    let mut inert = InertDetector::new(settings.inert_after);
    loop {
        let observation = shared.config.gate.observe().await;
        let now = Instant::now();
        let capacity = Capacity {
            max_sys: settings.max_sys,
            unit: settings.unit,
        };
        let (applied, n, held, own_in_flight) = {
            let mut window = shared.window();
            let (n, applied) = window.apply(&observation, capacity, settings.rounding);
            shared.export_window(&window, now);
            (
                applied,
                n,
                window.is_held() || shared.congestion_held(now),
                window.in_flight(),
            )
        };
        let m = shared.metrics();
        let reading = Reading::new(
            &observation,
            capacity,
            settings.rounding,
            own_in_flight,
            now,
        );
        for change in inert.update(&reading) {
            m.set_inert(change.reason.label(), change.inert);
            log_inert(&shared, &change, inert.span(), &observation.reason);
        }
        m.budget.set(observation.budget.get());
        m.baseline.set(observation.baseline.get());
        m.source_available
            .set(i64::from(observation.source_available));
        let open = observation.is_open() && !held;
        m.gate_open.set(i64::from(open));
        m.observation_age.set(
            now.saturating_duration_since(observation.taken_at)
                .as_secs_f64(),
        );
        let source_changed = was_available != Some(observation.source_available);
        was_available = Some(observation.source_available);
        if let Some(suppressed) = source_log.record(source_changed, now) {
            if observation.source_available {
                tracing::info!(
                    queue = shared.queue().name(),
                    event = "gate_source_available",
                    suppressed,
                    "gate source available"
                );
            } else {
                tracing::warn!(
                    queue = shared.queue().name(),
                    event = "gate_source_unavailable",
                    reason = observation.reason,
                    suppressed,
                    "gate source unavailable; gate closed"
                );
            }
        }
        let open_changed = was_open != Some(open);
        was_open = Some(open);
        if let Some(suppressed) = open_log.record(open_changed, now) {
            tracing::info!(
                queue = shared.queue().name(),
                event = if open { "gate_opened" } else { "gate_closed" },
                open,
                budget = observation.budget.get(),
                baseline = observation.baseline.get(),
                n,
                // Why it is closed: the gate's own reason, or a 429/503
                // (or Retry-After) hold although D > B.
                held,
                source_available = observation.source_available,
                reason = observation.reason,
                suppressed,
                "gate {}",
                if open { "opened" } else { "closed" }
            );
        }
        if applied == Applied::Fresh {
            shared.changed.notify_waiters();
        }
        // On-demand readings can come fast; the backlog is worth one queue
        // call per poll interval at most.
        if now >= next_backlog {
            next_backlog = now + settings.poll_interval;
            if let Ok(Some(backlog)) = shared.queue().backlog().await {
                m.backlog.set(saturating_i64(backlog));
            }
            // How close the waiting work is to its deadlines, for
            // autoscalers (`queue::due`), at the same cadence.
            if let Ok(Some(due)) = shared.queue().due().await {
                m.set_due(&due);
            }
        }
        // A fresh reading that opened the window may be refilled as soon as
        // it is used up (a constant gate would otherwise cap throughput at N
        // per poll). A closed or not-newer reading waits for the next poll:
        // asking again at once would spin without learning anything.
        let refill_on_demand = applied == Applied::Fresh && n > 0;
        let next_poll = tokio::time::sleep(settings.poll_interval);
        if refill_on_demand {
            tokio::select! {
                () = stop.cancelled() => return,
                () = next_poll => {}
                () = shared.refresh.notified() => {}
            }
        } else {
            tokio::select! {
                () = stop.cancelled() => return,
                () = next_poll => {}
            }
        }
    }
}

/// The WARN line of an inert state entered or left (once per change).
fn log_inert(shared: &Shared, change: &Change, span: Duration, gate_reason: &str) {
    let r = &change.reading;
    let queue = shared.queue().name();
    let gate = shared.config.gate.kind();
    let reason = change.reason.label();
    let span_secs = span.as_secs_f64();
    let held_secs = change.held_for.as_secs_f64();
    // never_opens: the highest D of the run; max_sys_below_capacity: the
    // lowest (the least room the pool showed while we were at the ceiling).
    let extreme_budget = change.extreme_budget;
    let (event, what) = match (change.inert, change.reason) {
        (true, InertReason::NeverOpens) => (
            "gate_inert",
            "gate inert: D never exceeded B with the source available and none of our work in flight",
        ),
        (true, InertReason::MaxSysBelowCapacity) => (
            "gate_inert",
            "gate inert: our work in flight held at max_SYS x (1 - B) while the pool still read D > B",
        ),
        (false, _) => ("gate_not_inert", "gate no longer inert"),
    };
    tracing::warn!(
        queue,
        event,
        gate,
        reason,
        span_secs,
        held_secs,
        budget = r.budget,
        baseline = r.baseline,
        max_sys = r.max_sys,
        ceiling = r.ceiling,
        own_in_flight = r.own_in_flight,
        extreme_budget,
        source_available = r.source_available,
        gate_reason,
        "{what}"
    );
}

/// Least time between two log lines of one kind (open/closed, source
/// available/unavailable) for one queue.
const MIN_LOG_GAP: Duration = Duration::from_secs(1);

/// Rate limit for the state-change log lines of one queue and kind.
///
/// The first change is logged at once; further changes within `min_gap` of
/// the last line are counted, not logged. The first observation after the
/// gap then logs the state as it is now with the count of changes left out
/// (`suppressed`), even if the state has flipped back, so the last line
/// always tells the current state.
#[derive(Debug)]
struct ChangeLog {
    /// Least time between two lines.
    min_gap: Duration,
    /// When the last line was written.
    last: Option<Instant>,
    /// Changes not logged since the last line.
    suppressed: u64,
}

impl ChangeLog {
    fn new(min_gap: Duration) -> Self {
        Self {
            min_gap,
            last: None,
            suppressed: 0,
        }
    }

    /// Records one observation (`changed`: its state differs from the
    /// previous one). Returns `Some(suppressed)` when a line is due now,
    /// with the number of changes not logged since the previous line.
    fn record(&mut self, changed: bool, now: Instant) -> Option<u64> {
        if !changed && self.suppressed == 0 {
            return None;
        }
        let too_soon = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.min_gap);
        if too_soon {
            if changed {
                self.suppressed += 1;
            }
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_change_is_logged_and_steady_state_is_not() {
        let t0 = Instant::now();
        let mut log = ChangeLog::new(Duration::from_secs(1));
        assert_eq!(log.record(true, t0), Some(0));
        for i in 1..10 {
            assert_eq!(log.record(false, t0 + Duration::from_millis(300 * i)), None);
        }
    }

    #[test]
    fn a_flapping_gate_writes_at_most_one_line_per_gap_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut log = ChangeLog::new(Duration::from_secs(1));
        // A change every 100 ms for 10 s: 100 changes.
        let mut lines = Vec::new();
        for i in 0..100u64 {
            if let Some(suppressed) = log.record(true, t0 + Duration::from_millis(100 * i)) {
                lines.push(suppressed);
            }
        }
        assert_eq!(lines.len(), 10, "one line per second: {lines:?}");
        assert_eq!(lines[0], 0);
        assert!(lines[1..].iter().all(|&s| s == 9), "{lines:?}");
        // Every change is either logged or counted.
        assert_eq!(
            lines.len() as u64 + lines.iter().sum::<u64>() + log.suppressed,
            100
        );
    }

    #[test]
    fn suppressed_changes_are_reported_once_the_gap_has_passed_without_a_new_change() {
        let t0 = Instant::now();
        let mut log = ChangeLog::new(Duration::from_secs(1));
        assert_eq!(log.record(true, t0), Some(0));
        assert_eq!(log.record(true, t0 + Duration::from_millis(200)), None);
        assert_eq!(log.record(true, t0 + Duration::from_millis(400)), None);
        assert_eq!(log.record(false, t0 + Duration::from_millis(900)), None);
        // The state settled; the next observation after the gap says so.
        assert_eq!(log.record(false, t0 + Duration::from_millis(1000)), Some(2));
        assert_eq!(log.record(false, t0 + Duration::from_millis(3000)), None);
        assert_eq!(log.record(true, t0 + Duration::from_millis(3100)), Some(0));
    }
}
