//! A gate wrapper that records what the gate said, for the progress line
//! and the summary (through [`super::status::BatchState`]) and the demo's
//! chart.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::gate::{
    Admission, AdmissionRequest, DispatchEvent, DispatchGate, GateError, Observation,
};

/// What a watched gate has said so far.
#[derive(Debug, Clone, Default)]
pub struct GateStats {
    /// Budget `D` of the last observation (zero after an error).
    pub budget: f64,
    /// Baseline `B` of the last observation.
    pub baseline: f64,
    /// Whether the last observation was open (`D > B`, source available).
    pub open: bool,
    /// Whether the last observation's source answered (false after an
    /// error, or for a fallback reading).
    pub source_available: bool,
    /// Whether the last observation was a local limit's free share
    /// ([`crate::gate::Observation::local_limit`]): closed then means a
    /// full window, not a busy pool.
    pub local_limit: bool,
    /// Total time the gate read closed (closed observation until the next
    /// one), a full local limit included.
    pub closed: Duration,
    /// Observations made.
    pub observations: u64,
    /// Observations that failed (source unavailable).
    pub errors: u64,
    /// The reason of the last observation.
    pub reason: String,
    /// Batch work in flight (sent, not yet answered or failed), in the
    /// queue's unit, as the dispatcher reports it through
    /// [`DispatchGate::on_event`].
    pub in_flight: u64,
    last_at: Option<Instant>,
}

/// A shared handle on [`GateStats`].
#[derive(Debug, Clone, Default)]
pub struct GateWatchHandle(Arc<Mutex<GateStats>>);

impl GateWatchHandle {
    /// A copy of the stats now (closed time counted up to now).
    pub fn snapshot(&self) -> GateStats {
        let stats = self.lock().clone();
        let mut out = stats.clone();
        if let (Some(at), false) = (stats.last_at, stats.open) {
            out.closed += at.elapsed();
        }
        out
    }

    fn lock(&self) -> MutexGuard<'_, GateStats> {
        // Plain counters: a poisoned lock still holds usable numbers.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Wraps a gate and records its observations.
#[derive(Debug)]
pub struct GateWatch {
    inner: Box<dyn DispatchGate>,
    stats: GateWatchHandle,
}

impl GateWatch {
    /// Watches `inner`; read the stats through the returned handle.
    pub fn new(inner: Box<dyn DispatchGate>) -> (Self, GateWatchHandle) {
        let stats = GateWatchHandle::default();
        (
            Self {
                inner,
                stats: stats.clone(),
            },
            stats,
        )
    }
}

impl DispatchGate for GateWatch {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            let result = self.inner.observe().await;
            let now = Instant::now();
            let mut s = self.stats.lock();
            if let (Some(at), false) = (s.last_at, s.open) {
                s.closed += now.saturating_duration_since(at);
            }
            s.last_at = Some(now);
            s.observations += 1;
            match &result {
                Ok(o) => {
                    s.budget = o.budget.get();
                    s.baseline = o.baseline.get();
                    s.open = o.is_open() && o.source_available;
                    s.source_available = o.source_available;
                    s.local_limit = o.local_limit;
                    s.reason.clone_from(&o.reason);
                }
                Err(e) => {
                    s.budget = 0.0;
                    s.open = false;
                    s.source_available = false;
                    s.local_limit = false;
                    s.errors += 1;
                    s.reason = e.to_string();
                }
            }
            drop(s);
            result
        })
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        self.inner.admit(request)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn on_event(&self, event: DispatchEvent) {
        {
            let mut s = self.stats.lock();
            match event {
                DispatchEvent::Sent { cost, .. } => s.in_flight += cost,
                DispatchEvent::Answered { cost, .. } | DispatchEvent::Failed { cost, .. } => {
                    s.in_flight = s.in_flight.saturating_sub(cost);
                }
            }
        }
        self.inner.on_event(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::{Budget, ConstantGate};

    #[test]
    fn counts_batch_in_flight_from_dispatch_events() {
        let (watch, stats) = GateWatch::new(Box::new(ConstantGate::new(Budget::FULL)));
        let at = Instant::now();
        watch.on_event(DispatchEvent::Sent { at, cost: 3 });
        watch.on_event(DispatchEvent::Sent { at, cost: 2 });
        watch.on_event(DispatchEvent::Answered {
            at,
            sent_at: at,
            status: 200,
            cost: 3,
        });
        assert_eq!(stats.snapshot().in_flight, 2);
        // More finished than sent (a caller's miscount) stays at zero.
        watch.on_event(DispatchEvent::Failed {
            at,
            sent_at: at,
            cost: 5,
        });
        assert_eq!(stats.snapshot().in_flight, 0);
    }
}
