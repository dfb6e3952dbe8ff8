//! The metrics registry: every sluicegate metric, owned by one struct and
//! handed out as per-queue handles. No globals. Every metric here is listed
//! in `docs/metrics.md` (a test scrapes `/metrics` for each name).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

use crate::batch_status::BatchStatus;

/// A gauge holding an `f64`.
type FloatGauge = Gauge<f64, AtomicU64>;

/// Label set `{queue}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct QueueLabel {
    /// Queue name.
    pub queue: String,
}

/// Label set `{pool}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PoolLabel {
    /// Pool name (`[[queue]] pool`, or the gateway URL).
    pub pool: String,
}

/// Label set `{queue, outcome}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Queue name.
    pub queue: String,
    /// Bounded outcome label.
    pub outcome: &'static str,
}

/// Label set `{queue, within_seconds}`: one horizon of
/// [`crate::queue::due::HORIZONS`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DueLabels {
    /// Queue name.
    pub queue: String,
    /// The horizon in seconds.
    pub within_seconds: i64,
}

/// Label set `{queue, reason}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Queue name.
    pub queue: String,
    /// Bounded reason label.
    pub reason: &'static str,
}

/// Label set `{queue, verdict, reason}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DecisionLabels {
    /// Queue name.
    pub queue: String,
    /// `continue`, `wait`, `refuse`, `drop`.
    pub verdict: &'static str,
    /// Bounded reason label.
    pub reason: &'static str,
}

/// Label set `{queue, status}` (Batch API batch status).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StatusLabels {
    /// The queue the batches' requests go into.
    pub queue: String,
    /// Bounded status label.
    pub status: &'static str,
}

/// Label set `{queue, tenant}` (Batch API tenant holdings; tenants are
/// the configured API keys' tenants, so bounded).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TenantLabels {
    /// The queue the batches' requests go into.
    pub queue: String,
    /// The tenant.
    pub tenant: String,
}

/// Outcomes of a Batch API request: a 2xx answer (`completed`), any
/// other answer or error (`failed`), stopped by the completion window
/// (`expired`) or by a cancel (`cancelled`).
pub const BATCH_OUTCOMES: [&str; 4] = ["completed", "failed", "expired", "cancelled"];

/// The Batch API server's metric handles for its queue (`sluicegate
/// serve`), cheap to clone.
#[derive(Debug, Clone)]
pub struct BatchApiMetrics {
    queue: String,
    batches: Family<StatusLabels, Gauge>,
    requests: Family<OutcomeLabels, Counter>,
    file_bytes: Family<QueueLabel, Gauge>,
    enqueued_requests: Family<TenantLabels, Gauge>,
    enqueued_tokens: Family<TenantLabels, Gauge>,
}

impl BatchApiMetrics {
    /// Sets the bytes of file bodies the store holds (all servers of the
    /// store).
    pub fn set_file_bytes(&self, bytes: u64) {
        let labels = QueueLabel {
            queue: self.queue.clone(),
        };
        (self.file_bytes.get_or_create(&labels)).set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets how many batches are in `status` (all servers of the store).
    pub fn set_batches(&self, status: &'static str, n: u64) {
        let labels = StatusLabels {
            queue: self.queue.clone(),
            status,
        };
        (self.batches.get_or_create(&labels)).set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Sets what `tenant`'s unfinished batches hold against its
    /// `serve.tenant_limits` (all servers of the store).
    pub fn set_tenant_enqueued(&self, tenant: &str, requests: u64, tokens: u64) {
        let labels = TenantLabels {
            queue: self.queue.clone(),
            tenant: tenant.to_owned(),
        };
        let n = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        (self.enqueued_requests.get_or_create(&labels)).set(n(requests));
        (self.enqueued_tokens.get_or_create(&labels)).set(n(tokens));
    }

    /// Counts one batch request settled with `outcome` (of [`BATCH_OUTCOMES`]).
    pub fn request(&self, outcome: &'static str) {
        let labels = OutcomeLabels {
            queue: self.queue.clone(),
            outcome,
        };
        self.requests.get_or_create(&labels).inc();
    }
}

/// Every metric family of the process.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    received: Family<QueueLabel, Counter>,
    sent: Family<QueueLabel, Counter>,
    outcomes: Family<OutcomeLabels, Counter>,
    attempts: Family<OutcomeLabels, Counter>,
    retries: Family<ReasonLabels, Counter>,
    decisions: Family<DecisionLabels, Counter>,
    congestion: Family<QueueLabel, Counter>,
    result_write_errors: Family<QueueLabel, Counter>,
    leases_lost: Family<QueueLabel, Counter>,
    in_flight: Family<QueueLabel, Gauge>,
    window: Family<QueueLabel, Gauge>,
    headroom: Family<QueueLabel, Gauge>,
    available: Family<QueueLabel, Gauge>,
    budget: Family<QueueLabel, FloatGauge>,
    baseline: Family<QueueLabel, FloatGauge>,
    gate_open: Family<QueueLabel, Gauge>,
    source_available: Family<QueueLabel, Gauge>,
    gate_inert: Family<ReasonLabels, Gauge>,
    observation_age: Family<QueueLabel, FloatGauge>,
    parked: Family<QueueLabel, Gauge>,
    awaiting_deadline: Family<QueueLabel, Gauge>,
    backlog: Family<QueueLabel, Gauge>,
    due: Family<DueLabels, Gauge>,
    earliest_deadline: Family<QueueLabel, Gauge>,
    claims_held: Family<QueueLabel, Gauge>,
    reclaims: Family<QueueLabel, Counter>,
    dead_letters: Family<QueueLabel, Counter>,
    attempt_latency: HistogramFamily,
    dispatch_delay: HistogramFamily,
    batches: Family<StatusLabels, Gauge>,
    batch_requests: Family<OutcomeLabels, Counter>,
    batch_file_bytes: Family<QueueLabel, Gauge>,
    batch_enqueued_requests: Family<TenantLabels, Gauge>,
    batch_enqueued_tokens: Family<TenantLabels, Gauge>,
    flex: FlexFamilies,
    shared_held: Family<PoolLabel, Gauge>,
    shared_total: Family<PoolLabel, Gauge>,
    shared_all_held: Family<PoolLabel, Gauge>,
    shared_all_in_flight: Family<PoolLabel, Gauge>,
    shared_renewals: Family<PoolLabel, Counter>,
    shared_failures: Family<PoolLabel, Counter>,
    shared_holds: Family<PoolLabel, Counter>,
    pubsub: PubSubFamilies,
}

/// Flex requests and background responses (`sluicegate serve`,
/// `docs/flex.md`), per queue.
#[derive(Debug, Clone)]
struct FlexFamilies {
    waiting: Family<QueueLabel, Gauge>,
    dispatch: HistogramFamily,
    refusals: Family<ReasonLabels, Counter>,
    background: Family<StatusLabels, Counter>,
    streams: Family<ReasonLabels, Counter>,
    first_chunk: HistogramFamily,
}

/// How a streamed flex answer relayed to its client ended
/// (`sluicegate_flex_streams_total`).
pub const FLEX_STREAM_ENDS: [&str; 2] = ["complete", "interrupted"];

/// Why a flex request was refused (`sluicegate_flex_refusals_total`).
pub const FLEX_REFUSALS: [&str; 4] = ["max_wait", "held_total", "held_tenant", "background_bound"];

/// The flex and background metric handles of one queue, cheap to clone.
#[derive(Debug, Clone)]
pub struct FlexMetrics {
    /// Flex requests held waiting for their answer (not yet started or
    /// running).
    pub waiting: Gauge,
    /// Time from enqueue to a dispatcher taking a flex request.
    pub dispatch: Histogram,
    /// Time from enqueue to the first relayed piece of a streamed flex
    /// answer written to its client.
    pub first_chunk: Histogram,
    queue: String,
    refusals: Family<ReasonLabels, Counter>,
    background: Family<StatusLabels, Counter>,
    streams: Family<ReasonLabels, Counter>,
}

impl FlexMetrics {
    /// Counts one refusal with `cause` (of [`FLEX_REFUSALS`]).
    pub fn refused(&self, cause: &'static str) {
        let labels = ReasonLabels {
            queue: self.queue.clone(),
            reason: cause,
        };
        self.refusals.get_or_create(&labels).inc();
    }

    /// Counts one streamed flex answer relayed to its client, ended `how`
    /// (of [`FLEX_STREAM_ENDS`]).
    pub fn streamed(&self, how: &'static str) {
        let labels = ReasonLabels {
            queue: self.queue.clone(),
            reason: how,
        };
        self.streams.get_or_create(&labels).inc();
    }

    /// Counts one background response reaching `status` on this server.
    pub fn background(&self, status: &'static str) {
        let labels = StatusLabels {
            queue: self.queue.clone(),
            status,
        };
        self.background.get_or_create(&labels).inc();
    }
}

/// The Pub/Sub transport's families (`src/queue/pubsub/`), per queue.
#[derive(Debug)]
struct PubSubFamilies {
    in_flight: Family<QueueLabel, Gauge>,
    acks: Family<QueueLabel, Counter>,
    nacks: Family<QueueLabel, Counter>,
    deadline_extensions: Family<QueueLabel, Counter>,
    pull_restarts: Family<QueueLabel, Counter>,
    publish_latency: HistogramFamily,
    duplicates: Family<OutcomeLabels, Counter>,
}

/// Metric handles of one Pub/Sub queue, cheap to clone.
#[derive(Debug, Clone)]
pub struct PubSubMetrics {
    /// Deliveries held by this process (pulled, not yet acked or nacked).
    pub in_flight: Gauge,
    /// Messages acknowledged (after their result was confirmed).
    pub acks: Counter,
    /// Messages handed back to the broker (ack deadline 0).
    pub nacks: Counter,
    /// Ack-deadline extensions of held deliveries, one per message.
    pub deadline_extensions: Counter,
    /// Times pulling resumed after a failed Pull (never on a budget change).
    pub pull_restarts: Counter,
    /// Time from publishing a result batch to its confirmation.
    pub publish_latency: Histogram,
    /// Deliveries of a message this process still held, joined to its
    /// lease instead of sent again.
    pub duplicates_joined: Counter,
    /// Deliveries of a message this process already answered, acked
    /// instead of sent again.
    pub duplicates_answered: Counter,
}

impl PubSubMetrics {
    /// Handles registered nowhere, for tools that open a queue without a
    /// metrics endpoint.
    pub fn unregistered() -> Self {
        Self {
            in_flight: Gauge::default(),
            acks: Counter::default(),
            nacks: Counter::default(),
            deadline_extensions: Counter::default(),
            pull_restarts: Counter::default(),
            publish_latency: publish_histogram(),
            duplicates_joined: Counter::default(),
            duplicates_answered: Counter::default(),
        }
    }
}

/// Buckets for a result publish round trip (milliseconds to seconds).
fn publish_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// Histogram family with fixed buckets per family.
type HistogramFamily = Family<QueueLabel, Histogram, fn() -> Histogram>;

/// Latency buckets from 5 ms to ~20 min: gateway attempts are LLM calls
/// that take from milliseconds to many minutes.
fn latency_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        600.0, 1200.0,
    ])
}

/// Buckets for the time from receiving a message to sending it (mostly
/// sub-millisecond, long when the gate holds work back).
fn delay_histogram() -> Histogram {
    Histogram::new([
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0,
    ])
}

/// A family registered as `name` with `help` (counters get `_total` in
/// the exposition); the registry keeps a clone, the caller the handle.
fn family<L, M>(r: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    Family<L, M>: Metric + Clone,
    L: Clone + std::hash::Hash + Eq,
    M: Default,
{
    let family = Family::<L, M>::default();
    r.register(name, help, family.clone());
    family
}

/// A histogram family with `buckets`, registered as [`family`] does.
fn histograms(
    r: &mut Registry,
    name: &str,
    help: &str,
    buckets: fn() -> Histogram,
) -> HistogramFamily {
    let family = HistogramFamily::new_with_constructor(buckets);
    r.register(name, help, family.clone());
    family
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates every family, each registered under its name and help.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let r = &mut registry;
        let pubsub = PubSubFamilies {
            in_flight: family(
                r,
                "sluicegate_pubsub_in_flight_messages",
                "Pub/Sub deliveries held by this process (pulled, not yet acked or handed back; holds included)",
            ),
            acks: family(
                r,
                "sluicegate_pubsub_acks",
                "Pub/Sub messages acknowledged after their result was confirmed",
            ),
            nacks: family(
                r,
                "sluicegate_pubsub_nacks",
                "Pub/Sub messages handed back to the broker (ack deadline 0); waits for the pool are held, not counted",
            ),
            deadline_extensions: family(
                r,
                "sluicegate_pubsub_deadline_extensions",
                "Ack deadline extensions of held Pub/Sub messages, one per message",
            ),
            pull_restarts: family(
                r,
                "sluicegate_pubsub_pull_stream_restarts",
                "Times pulling resumed after a failed Pull; a budget change never counts",
            ),
            publish_latency: histograms(
                r,
                "sluicegate_pubsub_publish_duration_seconds",
                "Result publish round trip, from publish to confirmation",
                publish_histogram,
            ),
            duplicates: family(
                r,
                "sluicegate_pubsub_duplicate_deliveries",
                "Pub/Sub deliveries of a message this process held (joined) or already answered (acked), never sent again",
            ),
        };
        Self {
            received: family(
                r,
                "sluicegate_requests_received",
                "Messages received from the queue",
            ),
            sent: family(
                r,
                "sluicegate_requests_sent",
                "Requests sent to the gateway (attempts)",
            ),
            outcomes: family(
                r,
                "sluicegate_outcomes",
                "Messages settled, by final outcome",
            ),
            attempts: family(
                r,
                "sluicegate_attempts",
                "Gateway attempts by classification",
            ),
            retries: family(
                r,
                "sluicegate_retries",
                "Messages returned to the queue for another try, by reason",
            ),
            decisions: family(
                r,
                "sluicegate_gate_decisions",
                "Admission verdicts by verdict and reason",
            ),
            congestion: family(
                r,
                "sluicegate_congestion_signals",
                "429/503 answers that forced the budget to zero",
            ),
            result_write_errors: family(
                r,
                "sluicegate_result_write_errors",
                "Failed attempts to write results (retried)",
            ),
            leases_lost: family(
                r,
                "sluicegate_leases_lost",
                "Results not written because the message lease was lost",
            ),
            in_flight: family(
                r,
                "sluicegate_in_flight_requests",
                "Own requests in flight at the gateway",
            ),
            window: family(
                r,
                "sluicegate_window_units",
                "Dispatch window: own in-flight at observation time + N",
            ),
            headroom: family(
                r,
                "sluicegate_headroom_units",
                "N = max_SYS x (D - B) of the latest fresh observation",
            ),
            available: family(
                r,
                "sluicegate_window_available_units",
                "Units that may still be released now",
            ),
            budget: family(
                r,
                "sluicegate_budget_ratio",
                "Latest budget D read by the gate",
            ),
            baseline: family(r, "sluicegate_baseline_ratio", "Reserved baseline B"),
            gate_open: family(
                r,
                "sluicegate_gate_open",
                "1 when D > B and no congestion holds the window",
            ),
            source_available: family(
                r,
                "sluicegate_source_available",
                "1 when the gate's metric source answered usably",
            ),
            gate_inert: family(
                r,
                "sluicegate_gate_inert",
                "1 while the gate has been inert for dispatch.inert_after, by reason (never_opens, max_sys_below_capacity)",
            ),
            observation_age: family(
                r,
                "sluicegate_observation_age_seconds",
                "Age of the data behind the latest observation",
            ),
            parked: family(
                r,
                "sluicegate_parked_requests",
                "Messages parked at a gate (verdict wait)",
            ),
            awaiting_deadline: family(
                r,
                "sluicegate_deadline_waiting_requests",
                "Messages turned away by congestion with no attempt possible before their deadline, kept until it",
            ),
            backlog: family(
                r,
                "sluicegate_queue_backlog_messages",
                "Messages waiting in the queue",
            ),
            due: family(
                r,
                "sluicegate_queue_due_messages",
                "Waiting messages whose deadline is at most within_seconds away (overdue included)",
            ),
            earliest_deadline: family(
                r,
                "sluicegate_queue_earliest_deadline_timestamp_seconds",
                "Earliest deadline among waiting messages (Unix seconds); absent when nothing waits",
            ),
            claims_held: family(
                r,
                "sluicegate_queue_claims_held",
                "Claims (leased messages) recorded in the transport, all holders",
            ),
            reclaims: family(
                r,
                "sluicegate_queue_reclaims",
                "Expired claims returned to the queue by this process",
            ),
            dead_letters: family(
                r,
                "sluicegate_queue_dead_letters",
                "Messages moved to the dead letters by this process",
            ),
            attempt_latency: histograms(
                r,
                "sluicegate_attempt_duration_seconds",
                "Gateway attempt latency",
                latency_histogram,
            ),
            dispatch_delay: histograms(
                r,
                "sluicegate_dispatch_delay_seconds",
                "Time from receiving a message to sending it",
                delay_histogram,
            ),
            batches: family(
                r,
                "sluicegate_batches",
                "Batch API batches, by status (sluicegate serve)",
            ),
            batch_requests: family(
                r,
                "sluicegate_batch_requests",
                "Batch API requests settled, by outcome (sluicegate serve)",
            ),
            batch_file_bytes: family(
                r,
                "sluicegate_batch_file_bytes",
                "Bytes of Batch API file bodies held, by their records (sluicegate serve)",
            ),
            batch_enqueued_requests: family(
                r,
                "sluicegate_batch_enqueued_requests",
                "Batch API requests of a tenant's unfinished batches without a result, held against serve.tenant_limits (sluicegate serve)",
            ),
            batch_enqueued_tokens: family(
                r,
                "sluicegate_batch_enqueued_tokens",
                "Estimated tokens of those requests, held against serve.tenant_limits (sluicegate serve)",
            ),
            flex: FlexFamilies {
                waiting: family(
                    r,
                    "sluicegate_flex_waiting",
                    "Flex requests held on their connections, waiting for their answer (sluicegate serve)",
                ),
                dispatch: histograms(
                    r,
                    "sluicegate_flex_dispatch_seconds",
                    "Time from a flex request's enqueue to a dispatcher taking it past the gate, seen by serve's probe (sluicegate serve)",
                    latency_histogram,
                ),
                refusals: family(
                    r,
                    "sluicegate_flex_refusals",
                    "Flex and background requests answered 429, by reason: max_wait, held_total, held_tenant, background_bound (sluicegate serve)",
                ),
                background: family(
                    r,
                    "sluicegate_background_responses",
                    "Background responses that reached each status on this server: queued at creation, in_progress when seen leased, then completed, failed, cancelled or incomplete (sluicegate serve)",
                ),
                streams: family(
                    r,
                    "sluicegate_flex_streams",
                    "Streamed flex answers relayed to their clients as they arrived, by how they ended: complete, interrupted (an error event ended them) (sluicegate serve)",
                ),
                first_chunk: histograms(
                    r,
                    "sluicegate_flex_first_chunk_seconds",
                    "Time from a streamed flex request's enqueue to the first relayed piece of its answer written to the client (sluicegate serve)",
                    latency_histogram,
                ),
            },
            shared_held: family(
                r,
                "sluicegate_shared_window_held_units",
                "Units this replica holds in the pool's shared window",
            ),
            shared_total: family(
                r,
                "sluicegate_shared_window_total_units",
                "The pool's window across replicas (the semaphore's total)",
            ),
            shared_all_held: family(
                r,
                "sluicegate_shared_window_all_held_units",
                "Units held by every replica of the pool",
            ),
            shared_all_in_flight: family(
                r,
                "sluicegate_shared_window_all_in_flight_units",
                "In flight reported by every replica of the pool",
            ),
            shared_renewals: family(
                r,
                "sluicegate_shared_window_renewals",
                "Successful shared-window syncs (lease renewals)",
            ),
            shared_failures: family(
                r,
                "sluicegate_shared_window_failures",
                "Failed shared-window syncs or lost leases (window closed)",
            ),
            shared_holds: family(
                r,
                "sluicegate_shared_window_holds_applied",
                "429/503 holds published by another replica and applied here",
            ),
            pubsub,
            registry,
        }
    }

    /// Handles for one Pub/Sub queue's transport metrics.
    pub fn pubsub(&self, name: &str) -> PubSubMetrics {
        let l = QueueLabel {
            queue: name.to_owned(),
        };
        let p = &self.pubsub;
        PubSubMetrics {
            in_flight: p.in_flight.get_or_create_owned(&l),
            acks: p.acks.get_or_create_owned(&l),
            nacks: p.nacks.get_or_create_owned(&l),
            deadline_extensions: p.deadline_extensions.get_or_create_owned(&l),
            pull_restarts: p.pull_restarts.get_or_create_owned(&l),
            publish_latency: p.publish_latency.get_or_create_owned(&l),
            duplicates_joined: p.duplicates.get_or_create_owned(&OutcomeLabels {
                queue: name.to_owned(),
                outcome: "joined",
            }),
            duplicates_answered: p.duplicates.get_or_create_owned(&OutcomeLabels {
                queue: name.to_owned(),
                outcome: "acked",
            }),
        }
    }

    /// Handles for one pool's shared-window metrics, created at zero.
    pub fn pool(&self, name: &str) -> PoolMetrics {
        let l = PoolLabel {
            pool: name.to_owned(),
        };
        PoolMetrics {
            held: self.shared_held.get_or_create_owned(&l),
            total: self.shared_total.get_or_create_owned(&l),
            all_held: self.shared_all_held.get_or_create_owned(&l),
            all_in_flight: self.shared_all_in_flight.get_or_create_owned(&l),
            renewals: self.shared_renewals.get_or_create_owned(&l),
            failures: self.shared_failures.get_or_create_owned(&l),
            holds_applied: self.shared_holds.get_or_create_owned(&l),
        }
    }

    /// Handles for one queue's metrics. Every bounded label value is
    /// created at zero, so series exist (and `rate()` works) before the
    /// first event.
    pub fn queue(&self, name: &str) -> QueueMetrics {
        let l = QueueLabel {
            queue: name.to_owned(),
        };
        let queue = || name.to_owned();
        for outcome in OUTCOMES {
            let _ = self.outcomes.get_or_create_owned(&OutcomeLabels {
                queue: queue(),
                outcome,
            });
        }
        for outcome in ATTEMPT_OUTCOMES {
            let _ = self.attempts.get_or_create_owned(&OutcomeLabels {
                queue: queue(),
                outcome,
            });
        }
        // A queue may take Batch API work (`sluicegate serve`).
        let _ = self.batch_api(name);
        for reason in RETRY_REASONS {
            let _ = self.retries.get_or_create_owned(&ReasonLabels {
                queue: queue(),
                reason,
            });
        }
        let _ = self.decisions.get_or_create_owned(&DecisionLabels {
            queue: queue(),
            verdict: "continue",
            reason: "admitted",
        });
        for reason in INERT_REASONS {
            let _ = self.gate_inert.get_or_create_owned(&ReasonLabels {
                queue: queue(),
                reason,
            });
        }
        QueueMetrics {
            queue: name.to_owned(),
            received: self.received.get_or_create_owned(&l),
            sent: self.sent.get_or_create_owned(&l),
            outcomes: self.outcomes.clone(),
            attempts: self.attempts.clone(),
            retries: self.retries.clone(),
            decisions: self.decisions.clone(),
            gate_inert: self.gate_inert.clone(),
            congestion: self.congestion.get_or_create_owned(&l),
            result_write_errors: self.result_write_errors.get_or_create_owned(&l),
            leases_lost: self.leases_lost.get_or_create_owned(&l),
            in_flight: self.in_flight.get_or_create_owned(&l),
            window: self.window.get_or_create_owned(&l),
            headroom: self.headroom.get_or_create_owned(&l),
            available: self.available.get_or_create_owned(&l),
            budget: self.budget.get_or_create_owned(&l),
            baseline: self.baseline.get_or_create_owned(&l),
            gate_open: self.gate_open.get_or_create_owned(&l),
            source_available: self.source_available.get_or_create_owned(&l),
            observation_age: self.observation_age.get_or_create_owned(&l),
            parked: self.parked.get_or_create_owned(&l),
            awaiting_deadline: self.awaiting_deadline.get_or_create_owned(&l),
            backlog: self.backlog.get_or_create_owned(&l),
            due: crate::queue::due::HORIZONS.map(|h| {
                self.due.get_or_create_owned(&DueLabels {
                    queue: name.to_owned(),
                    within_seconds: h,
                })
            }),
            earliest_deadline: self.earliest_deadline.clone(),
            claims_held: self.claims_held.get_or_create_owned(&l),
            reclaims: self.reclaims.get_or_create_owned(&l),
            dead_letters: self.dead_letters.get_or_create_owned(&l),
            attempt_latency: self.attempt_latency.get_or_create_owned(&l),
            dispatch_delay: self.dispatch_delay.get_or_create_owned(&l),
        }
    }

    /// The Batch API server's handles for `queue`, every status and
    /// outcome created at zero.
    pub fn batch_api(&self, queue: &str) -> BatchApiMetrics {
        for outcome in BATCH_OUTCOMES {
            let _ = self.batch_requests.get_or_create_owned(&OutcomeLabels {
                queue: queue.to_owned(),
                outcome,
            });
        }
        for status in BatchStatus::ALL {
            let _ = self.batches.get_or_create_owned(&StatusLabels {
                queue: queue.to_owned(),
                status: status.as_str(),
            });
        }
        let _ = self.batch_file_bytes.get_or_create_owned(&QueueLabel {
            queue: queue.to_owned(),
        });
        BatchApiMetrics {
            queue: queue.to_owned(),
            batches: self.batches.clone(),
            requests: self.batch_requests.clone(),
            file_bytes: self.batch_file_bytes.clone(),
            enqueued_requests: self.batch_enqueued_requests.clone(),
            enqueued_tokens: self.batch_enqueued_tokens.clone(),
        }
    }

    /// The flex handles for `queue`, every refusal cause and background
    /// status created at zero.
    pub fn flex(&self, queue: &str) -> FlexMetrics {
        let f = &self.flex;
        for reason in FLEX_REFUSALS {
            let _ = f.refusals.get_or_create_owned(&ReasonLabels {
                queue: queue.to_owned(),
                reason,
            });
        }
        for status in crate::serve::background::ResponseStatus::ALL {
            let _ = f.background.get_or_create_owned(&StatusLabels {
                queue: queue.to_owned(),
                status: status.as_str(),
            });
        }
        for how in FLEX_STREAM_ENDS {
            let _ = f.streams.get_or_create_owned(&ReasonLabels {
                queue: queue.to_owned(),
                reason: how,
            });
        }
        let l = QueueLabel {
            queue: queue.to_owned(),
        };
        FlexMetrics {
            waiting: f.waiting.get_or_create_owned(&l),
            dispatch: f.dispatch.get_or_create_owned(&l),
            first_chunk: f.first_chunk.get_or_create_owned(&l),
            queue: queue.to_owned(),
            refusals: f.refusals.clone(),
            background: f.background.clone(),
            streams: f.streams.clone(),
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Shared-window metric handles of one pool, cheap to clone.
#[derive(Debug, Clone)]
pub struct PoolMetrics {
    /// Units this replica holds.
    pub held: Gauge,
    /// The pool's total across replicas.
    pub total: Gauge,
    /// Units held by every replica.
    pub all_held: Gauge,
    /// In flight reported by every replica.
    pub all_in_flight: Gauge,
    /// Successful syncs.
    pub renewals: Counter,
    /// Failed syncs and lost leases.
    pub failures: Counter,
    /// Holds from other replicas applied here.
    pub holds_applied: Counter,
}

/// Metric handles of one queue, cheap to clone.
#[derive(Debug, Clone)]
pub struct QueueMetrics {
    queue: String,
    /// Messages received.
    pub received: Counter,
    /// Attempts sent to the gateway.
    pub sent: Counter,
    outcomes: Family<OutcomeLabels, Counter>,
    attempts: Family<OutcomeLabels, Counter>,
    retries: Family<ReasonLabels, Counter>,
    decisions: Family<DecisionLabels, Counter>,
    gate_inert: Family<ReasonLabels, Gauge>,
    /// 429/503 congestion signals.
    pub congestion: Counter,
    /// Failed result writes.
    pub result_write_errors: Counter,
    /// Results skipped because the lease was lost.
    pub leases_lost: Counter,
    /// Own in-flight requests.
    pub in_flight: Gauge,
    /// Window limit in units.
    pub window: Gauge,
    /// N in units.
    pub headroom: Gauge,
    /// Units releasable now.
    pub available: Gauge,
    /// Budget D.
    pub budget: FloatGauge,
    /// Baseline B.
    pub baseline: FloatGauge,
    /// Gate open (0/1).
    pub gate_open: Gauge,
    /// Source available (0/1).
    pub source_available: Gauge,
    /// Age of the latest observation's data.
    pub observation_age: FloatGauge,
    /// Messages parked at a gate.
    pub parked: Gauge,
    /// Messages kept until their deadline: congestion leaves no attempt
    /// before it (`dispatch::congestion::after_congestion`).
    pub awaiting_deadline: Gauge,
    /// Queue backlog.
    pub backlog: Gauge,
    /// Waiting messages due within each of `queue::due::HORIZONS`.
    due: [Gauge; crate::queue::due::HORIZONS.len()],
    /// The family of the earliest waiting deadline: its series is removed
    /// when nothing waits (no number means "nothing due" truthfully).
    earliest_deadline: Family<QueueLabel, Gauge>,
    /// Claims recorded in the transport.
    pub claims_held: Gauge,
    /// Expired claims returned to the queue.
    pub reclaims: Counter,
    /// Messages dead-lettered by the transport.
    pub dead_letters: Counter,
    /// Gateway attempt latency.
    pub attempt_latency: Histogram,
    /// Receive-to-send delay.
    pub dispatch_delay: Histogram,
}

impl QueueMetrics {
    /// Sets the deadline-proximity gauges from a transport's profile.
    pub fn set_due(&self, profile: &crate::queue::due::DueProfile) {
        for (gauge, n) in self.due.iter().zip(profile.within) {
            gauge.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let label = QueueLabel {
            queue: self.queue.clone(),
        };
        match profile.earliest {
            Some(at) => {
                self.earliest_deadline.get_or_create(&label).set(at);
            }
            None => {
                self.earliest_deadline.remove(&label);
            }
        }
    }

    /// Counts a settled message by outcome.
    pub fn outcome(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&OutcomeLabels {
                queue: self.queue.clone(),
                outcome,
            })
            .inc();
    }

    /// Counts one gateway attempt by classification.
    pub fn attempt(&self, outcome: &'static str) {
        self.attempts
            .get_or_create(&OutcomeLabels {
                queue: self.queue.clone(),
                outcome,
            })
            .inc();
    }

    /// Counts a message returned to the queue.
    pub fn retry(&self, reason: &'static str) {
        self.retries
            .get_or_create(&ReasonLabels {
                queue: self.queue.clone(),
                reason,
            })
            .inc();
    }

    /// Sets whether the gate is inert for `reason` (of [`INERT_REASONS`]).
    pub fn set_inert(&self, reason: &'static str, inert: bool) {
        self.gate_inert
            .get_or_create(&ReasonLabels {
                queue: self.queue.clone(),
                reason,
            })
            .set(i64::from(inert));
    }

    /// Counts an admission verdict.
    pub fn decision(&self, verdict: &'static str, reason: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                queue: self.queue.clone(),
                verdict,
                reason,
            })
            .inc();
    }
}

/// Final outcomes (`ResultRecord::outcome_label` plus `dead_letter`).
const OUTCOMES: [&str; 11] = [
    "success",
    "http_4xx",
    "http_other",
    "deadline_exceeded",
    "cancelled",
    "gate_dropped",
    "gate_error",
    "inference_error",
    "invalid_request",
    "payload_unavailable",
    "dead_letter",
];

/// Gateway attempt classifications (`AttemptOutcome::label`).
const ATTEMPT_OUTCOMES: [&str; 6] = [
    "success",
    "final",
    "congested",
    "retryable",
    "failed",
    "deadline_exceeded",
];

/// Reasons of `sluicegate_gate_inert` (`dispatch::inert::InertReason`).
pub const INERT_REASONS: [&str; 2] = ["never_opens", "max_sys_below_capacity"];

/// Reasons a message goes back to the queue.
const RETRY_REASONS: [&str; 4] = ["failed", "congested", "not_admitted", "shutdown"];

/// Every metric name as it appears in `/metrics` (counters with `_total`),
/// for the documentation test.
pub const METRIC_NAMES: &[&str] = &[
    "sluicegate_requests_received_total",
    "sluicegate_requests_sent_total",
    "sluicegate_outcomes_total",
    "sluicegate_attempts_total",
    "sluicegate_retries_total",
    "sluicegate_gate_decisions_total",
    "sluicegate_congestion_signals_total",
    "sluicegate_result_write_errors_total",
    "sluicegate_leases_lost_total",
    "sluicegate_in_flight_requests",
    "sluicegate_window_units",
    "sluicegate_headroom_units",
    "sluicegate_window_available_units",
    "sluicegate_budget_ratio",
    "sluicegate_baseline_ratio",
    "sluicegate_gate_open",
    "sluicegate_source_available",
    "sluicegate_gate_inert",
    "sluicegate_observation_age_seconds",
    "sluicegate_parked_requests",
    "sluicegate_deadline_waiting_requests",
    "sluicegate_queue_backlog_messages",
    "sluicegate_queue_due_messages",
    "sluicegate_queue_earliest_deadline_timestamp_seconds",
    "sluicegate_queue_claims_held",
    "sluicegate_queue_reclaims_total",
    "sluicegate_queue_dead_letters_total",
    "sluicegate_attempt_duration_seconds",
    "sluicegate_dispatch_delay_seconds",
    "sluicegate_batches",
    "sluicegate_batch_requests_total",
    "sluicegate_batch_file_bytes",
    "sluicegate_batch_enqueued_requests",
    "sluicegate_batch_enqueued_tokens",
    "sluicegate_flex_waiting",
    "sluicegate_flex_dispatch_seconds",
    "sluicegate_flex_refusals_total",
    "sluicegate_flex_streams_total",
    "sluicegate_flex_first_chunk_seconds",
    "sluicegate_background_responses_total",
    "sluicegate_pubsub_in_flight_messages",
    "sluicegate_pubsub_acks_total",
    "sluicegate_pubsub_nacks_total",
    "sluicegate_pubsub_deadline_extensions_total",
    "sluicegate_pubsub_pull_stream_restarts_total",
    "sluicegate_pubsub_publish_duration_seconds",
    "sluicegate_pubsub_duplicate_deliveries_total",
    "sluicegate_shared_window_held_units",
    "sluicegate_shared_window_total_units",
    "sluicegate_shared_window_all_held_units",
    "sluicegate_shared_window_all_in_flight_units",
    "sluicegate_shared_window_renewals_total",
    "sluicegate_shared_window_failures_total",
    "sluicegate_shared_window_holds_applied_total",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_metric_is_exported() {
        let metrics = Metrics::new();
        let q = metrics.queue("q");
        q.outcome("success");
        q.attempt("success");
        q.retry("failed");
        q.decision("continue", "admitted");
        // The earliest waiting deadline has a series only while work waits.
        q.set_due(&crate::queue::due::DueProfile::of(0, [5]));
        let _ = metrics.pubsub("q");
        let _ = metrics.pool("p");
        // Per-tenant gauges have a series only for a tenant with a limit.
        metrics.batch_api("q").set_tenant_enqueued("t", 1, 2);
        let _ = metrics.flex("q");
        let text = metrics.encode();
        for name in METRIC_NAMES {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }
}
