//! What a queue's dispatcher is built from ([`QueueDispatcher`], filled in
//! by `app`) and the state its tasks share ([`Shared`]: the window lane,
//! the wake-ups, the held deliveries), with the checked message the
//! receiver hands to a worker ([`Ready`]). Every task file (`receive.rs`,
//! `send.rs`, `settle.rs`, `observe.rs`) stands on this one; `dispatcher.rs`
//! starts and drains them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::cancel::Running;
use super::congestion::{Clearance, CongestionHold};
use super::held::Held;
use super::pool::{Lane, LaneWindow, Pool};
use super::retry::RetryPolicy;
use super::settings::DispatchSettings;
use crate::gate::FailClosed;
use crate::gateway::{GatewayClient, PreparedRequest, Target};
use crate::queue::{Completion, Delivery, DeliveryTag, NackReason, Queue};
use crate::request::{AttemptRecord, Message};
use crate::telemetry::QueueMetrics;
use crate::telemetry::traces::{MessageTrace, StepSpan};

/// Everything a queue's dispatcher needs, built by `app`.
#[derive(Debug)]
pub struct QueueDispatcher {
    /// Where messages come from and results go.
    pub queue: Arc<dyn Queue>,
    /// The queue's gate, behind the staleness and fail-closed wrappers.
    pub gate: Arc<FailClosed>,
    /// The shared HTTP client.
    pub gateway: GatewayClient,
    /// Gateway URL, path and objective of this queue.
    pub target: Target,
    /// Backoff and attempt limits for failed attempts.
    pub retry: RetryPolicy,
    /// The congestion hold of this queue's pool, shared with every other
    /// queue that sends there.
    pub congestion: Arc<CongestionHold>,
    /// The pool this queue sends to: its window is shared with the pool's
    /// other queues (a pool of its own by default).
    pub pool: Arc<Pool>,
    /// Tunables.
    pub settings: DispatchSettings,
    /// Metric handles of this queue.
    pub metrics: QueueMetrics,
    /// Queue labels (e.g. `tier`), merged under each message's own labels
    /// for admission.
    pub labels: BTreeMap<String, String>,
    /// Span export, `None` when traces are off (the default): then no
    /// `traceparent` is parsed and no span is built.
    pub traces: Option<crate::telemetry::Traces>,
    /// Where streamed flex requests' answers are relayed as they arrive
    /// (`crate::relay`); off by default.
    pub relay: crate::relay::Relay,
}

/// State shared by the dispatcher's tasks.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) config: QueueDispatcher,
    /// This queue's lane in its pool's window.
    pub(super) lane: Lane,
    /// Fired when the pool's window may have room again (fresh
    /// observation, finished request), for every queue of the pool.
    pub(super) changed: Arc<Notify>,
    /// Asks the observer for a fresh reading now.
    pub(super) refresh: Notify,
    /// Fired when a sent request ends, so parked messages ask their gate
    /// again (a concurrency slot may be free).
    pub(super) finished: Notify,
    /// Deliveries not yet settled, whose leases the keeper renews, and
    /// their bytes, which the receiver bounds.
    pub(super) held: Mutex<Held>,
    pub(super) parked: AtomicUsize,
    /// Open `settle` spans until the writer acknowledges their results;
    /// stays empty when traces are off.
    pub(super) settling: Mutex<HashMap<DeliveryTag, StepSpan>>,
    /// Attempts at the gateway, which a cancel aborts (`cancel.rs`).
    pub(super) running: Running,
}

impl Shared {
    /// The state of a dispatcher that has sent nothing yet.
    pub(super) fn new(config: QueueDispatcher) -> Self {
        let lane = {
            let now = Instant::now();
            let mut window = config.pool.window();
            window.set_pace(config.settings.pace, now);
            // A random start, so no queue of the pool is favoured
            // (`random-robin`).
            window.set_merge(config.settings.merge.policy, rand::random());
            let lane = window.add_lane(now, config.settings.max_staleness);
            window.set_tier(lane, config.settings.merge.tier);
            lane
        };
        let changed = config.pool.changed();
        Self {
            config,
            lane,
            changed,
            refresh: Notify::new(),
            finished: Notify::new(),
            held: Mutex::new(Held::default()),
            parked: AtomicUsize::new(0),
            settling: Mutex::new(HashMap::new()),
            running: Running::default(),
        }
    }

    /// This queue's lane of the pool's window, locked.
    pub(super) fn window(&self) -> LaneWindow<'_> {
        LaneWindow {
            pool: self.config.pool.window(),
            lane: self.lane,
        }
    }

    pub(super) fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn settling(&self) -> MutexGuard<'_, HashMap<DeliveryTag, StepSpan>> {
        self.settling.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn metrics(&self) -> &QueueMetrics {
        &self.config.metrics
    }

    pub(super) fn settings(&self) -> &DispatchSettings {
        &self.config.settings
    }

    pub(super) fn queue(&self) -> &dyn Queue {
        self.config.queue.as_ref()
    }

    /// Whether this queue may release its next buffered message now under
    /// the pool's merge policy (`merge.rs`), with `has_work` whether its
    /// buffer holds a releasable message and `has_room` whether the window
    /// has room for it. Without turns (one queue, `first-come`) it is
    /// `has_work && has_room`, as before merge policies. Wakes the pool's
    /// other queues when the turns moved on, or this queue stopped
    /// contending, so none waits for a lane that will not go.
    pub(super) fn take_turn(&self, now: Instant, has_work: bool, has_room: bool) -> bool {
        let (go, moved) = {
            let mut window = self.config.pool.window();
            if !window.takes_turns() {
                return has_work && has_room;
            }
            if has_work && has_room {
                let go = window.take_turn(self.lane, now);
                (go, go)
            } else {
                (false, window.mark_contending(self.lane, has_work))
            }
        };
        if moved {
            self.config.pool.notify_changed();
        }
        go
    }

    /// Marks whether this queue holds a releasable message (merge
    /// policies), waking the pool's other queues when that changed: a
    /// receiver about to block (a long poll of an empty queue) must not
    /// leave the others waiting for its turn.
    pub(super) fn contending(&self, has_work: bool) {
        let moved = {
            let mut window = self.config.pool.window();
            window.takes_turns() && window.mark_contending(self.lane, has_work)
        };
        if moved {
            self.config.pool.notify_changed();
        }
    }

    /// Whether the pool's queues take turns (`merge.rs`).
    pub(super) fn takes_turns(&self) -> bool {
        self.config.pool.window().takes_turns()
    }

    /// Whether the gateway's congestion hold lets nothing through now.
    pub(super) fn congestion_held(&self, now: Instant) -> bool {
        matches!(
            self.config.congestion.clearance(now),
            Clearance::Held { .. }
        )
    }

    /// Whether work leased now would go soon: the window is open (maybe
    /// full) and no congestion hold lasts.
    pub(super) fn is_open(&self, now: Instant) -> bool {
        self.window().is_open(now) && !self.congestion_held(now)
    }

    /// Units that may be pulled now: the window's room, none while the
    /// gateway's congestion hold lasts, one while it waits for a probe.
    pub(super) fn room(&self, now: Instant) -> u64 {
        let available = {
            let window = self.window();
            let available = window.available(now);
            if available == 0 && window.pool.blocked_by_cap(now) {
                // Budget the shared window's units withhold: its keeper
                // takes more at once instead of at the next renewal.
                self.config.pool.wants_units.notify_one();
            }
            available
        };
        match self.config.congestion.clearance(now) {
            Clearance::Open => available,
            Clearance::Probe => available.min(1),
            Clearance::Held { .. } => 0,
        }
    }

    /// Whether a request of `cost` units may go now, and if so whether it is
    /// the probe after a congestion hold.
    pub(super) fn may_send(
        &self,
        window: &LaneWindow<'_>,
        now: Instant,
        cost: u64,
    ) -> Option<SendKind> {
        if !window.allows(now, cost) {
            return None;
        }
        match self.config.congestion.clearance(now) {
            Clearance::Open => Some(SendKind::Normal),
            Clearance::Probe => Some(SendKind::Probe),
            Clearance::Held { .. } => None,
        }
    }

    /// Records a send decided by [`Self::may_send`]; `None` when the
    /// clearance changed meanwhile (another queue took the probe). The
    /// window lock is held by the caller, so the check and the record are
    /// one step.
    pub(super) fn record_send(
        &self,
        window: &mut LaneWindow<'_>,
        now: Instant,
        cost: u64,
        pace_cost: u64,
    ) -> Option<SendKind> {
        if !window.allows(now, cost) {
            return None;
        }
        let send = {
            let mut congestion = self.config.congestion.lock();
            match congestion.clearance(now) {
                Clearance::Open => SendKind::Normal,
                Clearance::Probe => {
                    congestion.probe_started();
                    SendKind::Probe
                }
                Clearance::Held { .. } => return None,
            }
        };
        window.sent(now, cost);
        window.paced(now, pace_cost);
        self.export_window(window, now);
        Some(send)
    }

    /// When to look for room again at the latest: the next poll, or sooner
    /// when only the pace withholds a send (`dispatch.pace`).
    pub(super) fn next_look(&self, now: Instant) -> Instant {
        let poll = now + self.settings().poll_interval;
        self.window()
            .paced_until(now)
            .map_or(poll, |due| due.min(poll))
    }

    /// Publishes the window's numbers to metrics.
    pub(super) fn export_window(&self, window: &LaneWindow<'_>, now: Instant) {
        let m = self.metrics();
        let (n, limit) = window.grant().unwrap_or((0, 0));
        m.headroom.set(saturating_i64(n));
        m.window.set(saturating_i64(limit));
        m.available.set(saturating_i64(window.available(now)));
        m.in_flight.set(saturating_i64(window.in_flight()));
    }

    /// Hands a delivery back to the queue and stops renewing its lease.
    pub(super) async fn nack(&self, tag: DeliveryTag, delay: Duration, reason: NackReason) {
        self.requeue(tag, delay, reason, None).await;
    }

    /// [`Self::nack`], keeping what a sent attempt learned with the message
    /// (attempt count, last HTTP answer) where the transport can carry it.
    pub(super) async fn requeue(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: Option<AttemptRecord>,
    ) {
        let label = match reason {
            NackReason::Failed => "failed",
            NackReason::Congested => "congested",
            NackReason::NotAdmitted => "not_admitted",
            NackReason::Shutdown => "shutdown",
        };
        self.metrics().retry(label);
        let requeued = match record {
            Some(r) => self
                .queue()
                .requeue_after_attempt(tag.clone(), delay, reason, r),
            None => self.queue().nack(tag.clone(), delay, reason),
        };
        if let Err(error) = requeued.await {
            // Not lost: the lease expires and the message is redelivered.
            tracing::warn!(%error, %tag, "nack failed; message returns when its lease expires");
        }
        self.held().remove(&tag);
    }
}

pub(super) fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// How a released request goes (named `SendKind` so it never shadows the
/// `Send` marker trait in the files that use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SendKind {
    /// Within the window, no congestion.
    Normal,
    /// The one request after a congestion hold; its answer decides whether
    /// the hold ends.
    Probe,
}

/// A message that passed parsing, deadline and request checks.
#[derive(Debug)]
pub(super) struct Ready {
    pub(super) delivery: Delivery,
    pub(super) message: Message,
    pub(super) prepared: PreparedRequest,
    pub(super) cost: u64,
    /// Its cost in the pace's unit (`dispatch.pace`): 1, or its prompt
    /// tokens estimated from the body; 1 without a pace.
    pub(super) pace_cost: u64,
    pub(super) received_at: Instant,
    /// The message's trace, when traces are on.
    pub(super) trace: Option<MessageTrace>,
}

/// Channel to the result writer.
pub(super) type Results = mpsc::Sender<Completion>;
