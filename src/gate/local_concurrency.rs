//! `local-max-concurrency`: at most `limit` requests of this process's pool
//! in flight (summed over the queues that send to it), whatever the pool
//! says.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, decode, loose};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, DispatchGate, GateContext, GateError,
    Observation, Ticket,
};

/// What an admission gate does when it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GatingMode {
    /// Wait (park the message locally) until there is room.
    #[default]
    Blocking,
    /// Refuse (requeue with delay) so messages behind it are not blocked.
    Classifying,
}

impl GatingMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Blocking => "blocking",
            Self::Classifying => "classifying",
        }
    }
}

/// Parameters of `local-max-concurrency`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalMaxConcurrencyParams {
    /// Maximum requests in flight, >= 1 (required; newer upstream
    /// releases call it `max_concurrency`).
    #[serde(deserialize_with = "loose::u32")]
    pub limit: u32,
    /// Wait or refuse when full (default blocking).
    pub gating_mode: GatingMode,
}

impl GateParams for LocalMaxConcurrencyParams {
    const EXTRA_KEYS: &'static [&'static str] = &["max_concurrency"];

    fn parse(mut map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        if let Some(v) = map.remove("max_concurrency") {
            if map.contains_key("limit") {
                cx.error(
                    "max_concurrency",
                    "set either limit or max_concurrency, not both",
                );
            } else {
                map.insert("limit".to_owned(), v);
            }
        }
        decode(map, cx)
    }

    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("limit", "maximum in flight, >= 1") {
            cx.at_least_one("limit", self.limit);
        }
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(LocalMaxConcurrencyGate::sharing(
            usize::try_from(self.limit).unwrap_or(usize::MAX),
            self.gating_mode,
            ctx.pool_slots.clone(),
        )))
    }
}

/// Caps the in-flight requests of this process's pool (every queue that
/// sends to it shares the slot counter; `limit` bounds the pool's total for
/// this queue's sends). Budget = free fraction of the limit; when full,
/// `blocking` mode waits and `classifying` refuses.
#[derive(Debug)]
pub struct LocalMaxConcurrencyGate {
    limit: usize,
    mode: GatingMode,
    in_flight: Arc<AtomicUsize>,
}

/// Releases one slot when the admitted request ends.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl LocalMaxConcurrencyGate {
    /// A gate allowing `limit` (at least 1) concurrent requests.
    pub fn new(limit: usize, mode: GatingMode) -> Self {
        Self::sharing(limit, mode, Arc::default())
    }

    /// A gate counting its slots in `in_flight`, shared with the other
    /// queues of its pool.
    pub fn sharing(limit: usize, mode: GatingMode, in_flight: Arc<AtomicUsize>) -> Self {
        Self {
            limit: limit.max(1),
            mode,
            in_flight,
        }
    }

    /// Requests currently holding a slot.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

impl DispatchGate for LocalMaxConcurrencyGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        let used = self.in_flight().min(self.limit);
        let free = (self.limit - used) as f64 / self.limit as f64;
        let mut observation = Observation::open(Budget::saturating(free), Instant::now());
        // D is read from our own requests in flight at this very instant:
        // it sees our load exactly, and max_SYS is the limit (in requests),
        // so the window is in-flight + (limit − used) = the limit. Marking
        // it blind would count our work twice and fill half the limit.
        observation.sees_own_load = true;
        // Each request of ours holds one slot of `limit` (= max_SYS).
        observation.counts_own_requests = true;
        observation.max_sys = Some(self.limit as f64);
        // D is our own free slots, not the pool's: full is a full window.
        observation.local_limit = true;
        observation.reason = format!("{used} of {} local slots in use", self.limit);
        Box::pin(std::future::ready(Ok(observation)))
    }

    fn admit<'a>(&'a self, _request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        let taken = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .is_ok();
        let verdict = if taken {
            Admission::Continue(Ticket::holding(Slot(self.in_flight.clone())))
        } else {
            match self.mode {
                GatingMode::Blocking => Admission::Wait {
                    reason: "local_concurrency_full",
                },
                GatingMode::Classifying => Admission::Refuse {
                    reason: "local_concurrency_full",
                },
            }
        };
        Box::pin(std::future::ready(verdict))
    }

    fn kind(&self) -> &'static str {
        "local-max-concurrency"
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[tokio::test]
    async fn blocking_mode_waits_and_budget_tracks_free_slots() {
        let empty = BTreeMap::new();
        let req = AdmissionRequest::new("r", &empty, &empty);
        let gate = LocalMaxConcurrencyGate::new(2, GatingMode::Blocking);
        let a = gate.admit(req).await;
        assert_eq!(
            gate.observe().await.expect("ok").budget,
            Budget::saturating(0.5)
        );
        let b = gate.admit(req).await;
        // The reading is our own in-flight work: it sees our load, with the
        // limit as max_SYS, so the window is in-flight + free = the limit
        // (read as blind, 2 in flight + N = 0 would be a window of 0).
        let full = gate.observe().await.expect("ok");
        assert!(full.sees_own_load);
        assert_eq!(full.max_sys, Some(2.0));
        assert!(matches!(gate.admit(req).await, Admission::Wait { .. }));
        assert_eq!(gate.observe().await.expect("ok").budget, Budget::ZERO);
        drop((a, b));
        assert_eq!(gate.in_flight(), 0);
        assert!(matches!(gate.admit(req).await, Admission::Continue(_)));
    }
}
