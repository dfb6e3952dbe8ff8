//! Tunables of one queue's dispatcher, resolved from config.

use std::collections::BTreeMap;
use std::time::Duration;

use super::merge::{MergeKind, MergePolicy};
use super::pace::{Pace, PaceUnit};
use crate::config::Tier;
use crate::config::{DispatchConfig, MergePolicyKind, PaceKind, QueueConfig, Rounding, Unit};

/// How one queue is dispatched.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Unit of the window (requests, tokens, bytes).
    pub unit: Unit,
    /// How `N` is rounded to whole units.
    pub rounding: Rounding,
    /// Static capacity `max_SYS`, used when the gate does not supply one.
    pub max_sys: f64,
    /// How often the gate is observed (also on demand when the window is
    /// used up).
    pub poll_interval: Duration,
    /// Observations older than this are no observation.
    pub max_staleness: Duration,
    /// Lease taken on each message; renewed while the message is held.
    pub lease: Duration,
    /// Long-poll wait of one receive on an empty queue.
    pub receive_wait: Duration,
    /// Most messages pulled in one receive.
    pub receive_batch: usize,
    /// First hold after a 429/503 (grows exponentially, jittered, with
    /// consecutive signals; `Retry-After` can only make it longer).
    pub congestion_backoff: Duration,
    /// Ceiling of the computed congestion hold.
    pub congestion_max_backoff: Duration,
    /// Requeue delay when a gate refuses, or a parked message gives up.
    pub wait_requeue_delay: Duration,
    /// Longest a message stays parked at a gate (verdict wait) before it
    /// goes back to the queue.
    pub max_park: Duration,
    /// Most messages parked at once; beyond it a wait verdict requeues.
    pub max_parked: usize,
    /// Time in-flight requests get to finish at shutdown before they are
    /// abandoned and requeued.
    pub shutdown_grace: Duration,
    /// Messages held beyond what the window can send, for fair shares.
    pub tenant_lookahead: usize,
    /// Tenant weights in the window's round robin (others weigh 1).
    pub tenant_weights: BTreeMap<String, u32>,
    /// Most body bytes held at once (lookahead, parked, in flight, waiting
    /// for the result write); a single larger message still goes alone.
    pub max_buffered_bytes: u64,
    /// Whether readings that count our requests give the room of our
    /// requests finished since their data time back at once
    /// (`dispatch::window`, "Refill on own finishes"). Always on from
    /// config; `eval --no-refill` turns it off to measure what it buys.
    pub refill_own_finishes: bool,
    /// Paced release of each pool's sends (`dispatch.pace`); `None`: off.
    pub pace: Option<Pace>,
    /// How long an inert rule must hold before it is reported
    /// (`dispatch.inert_after`, `dispatch::inert`).
    pub inert_after: Duration,
    /// How often requests in flight are checked for a cancel, which
    /// aborts them (`dispatch.cancel_check_interval`, `cancel.rs`).
    pub cancel_check_interval: Duration,
    /// How the queues of this queue's pool take turns
    /// (`dispatch.merge_policy`, `dispatch::merge`).
    pub merge: MergeSettings,
}

/// The merge policy as one queue uses it.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeSettings {
    /// The pool's policy (every queue of a pool reads the same config).
    pub policy: MergePolicy,
    /// The label naming a queue's tier (`dispatch.merge_tier_label`).
    pub tier_label: String,
    /// This queue's tier, from its labels (`batch` without the label).
    pub tier: Tier,
    /// `tier-priority` only: the header that carries upstream's priority
    /// index; `None` otherwise or when disabled.
    pub priority_header: Option<reqwest::header::HeaderName>,
}

impl MergeSettings {
    fn from_config(d: &DispatchConfig) -> Self {
        let kind = match d.merge_policy {
            MergePolicyKind::FirstCome => MergeKind::FirstCome,
            MergePolicyKind::RandomRobin => MergeKind::RandomRobin,
            MergePolicyKind::TierPriority => MergeKind::TierPriority,
        };
        // The loader checked the name; a name that still failed to parse
        // would only leave the header out.
        let priority_header = (kind == MergeKind::TierPriority)
            .then_some(d.merge_priority_header.as_deref())
            .flatten()
            .and_then(|h| reqwest::header::HeaderName::from_bytes(h.as_bytes()).ok());
        Self {
            policy: MergePolicy {
                kind,
                min_share: d.merge_min_share,
                share_window: usize::try_from(d.merge_share_window).unwrap_or(usize::MAX),
            },
            tier_label: d.merge_tier_label.clone(),
            tier: Tier::Batch,
            priority_header,
        }
    }
}

/// Most messages pulled in one receive (not configurable: the window
/// bounds what is pulled).
pub const RECEIVE_BATCH: usize = 256;
/// Longest a message stays parked at a gate.
pub const MAX_PARK: Duration = Duration::from_secs(30);
/// Most messages parked at once.
pub const MAX_PARKED: usize = 256;

/// The `[dispatch]` timings; the per-queue fields (unit, rounding,
/// `max_sys`) take the `[[queue]]` defaults until [`DispatchSettings::for_queue`].
impl From<&DispatchConfig> for DispatchSettings {
    fn from(d: &DispatchConfig) -> Self {
        Self {
            unit: Unit::Requests,
            rounding: Rounding::Floor,
            max_sys: DEFAULT_MAX_SYS,
            poll_interval: d.poll_interval,
            max_staleness: d.max_staleness,
            lease: d.lease,
            receive_wait: d.receive_wait,
            receive_batch: RECEIVE_BATCH,
            congestion_backoff: d.congestion_backoff,
            congestion_max_backoff: d.congestion_max_backoff,
            wait_requeue_delay: d.wait_requeue_delay,
            max_park: MAX_PARK,
            max_parked: MAX_PARKED,
            shutdown_grace: d.shutdown_grace,
            tenant_lookahead: d.tenant_lookahead,
            tenant_weights: d.tenant_weights.clone(),
            max_buffered_bytes: d.max_buffered_bytes,
            refill_own_finishes: true,
            pace: pace(d),
            inert_after: d.inert_after,
            cancel_check_interval: d.cancel_check_interval,
            merge: MergeSettings::from_config(d),
        }
    }
}

/// `dispatch.pace` as a [`Pace`]. The loader has checked `pace_rate` and
/// `pace_burst` (finite, > 0), so `Pace::new` cannot fail here; if it ever
/// did, pacing would be off, which still keeps every send within the window.
fn pace(d: &DispatchConfig) -> Option<Pace> {
    let unit = match d.pace {
        PaceKind::Off => return None,
        PaceKind::Requests => PaceUnit::Requests,
        PaceKind::Tokens => PaceUnit::Tokens,
    };
    Pace::new(unit, d.pace_rate, d.pace_burst).ok()
}

/// `max_sys` of a `[[queue]]` that sets none.
const DEFAULT_MAX_SYS: f64 = 100.0;

impl DispatchSettings {
    /// These settings with the queue's unit, rounding and `max_sys`.
    #[must_use]
    pub fn for_queue(mut self, queue: &QueueConfig) -> Self {
        self.unit = queue.unit;
        self.rounding = queue.rounding;
        self.max_sys = queue.max_sys;
        // The loader refused a tier label value it does not know when the
        // policy reads it; without the label a queue is `batch` (upstream).
        self.merge.tier = queue
            .labels
            .get(&self.merge.tier_label)
            .and_then(|v| Tier::parse(v))
            .unwrap_or(Tier::Batch);
        self
    }
}

/// The config's defaults (one place for them).
impl Default for DispatchSettings {
    fn default() -> Self {
        Self::from(&DispatchConfig::default())
    }
}
