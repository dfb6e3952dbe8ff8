//! Queue transports: where requests come from and where their results go.
//!
//! [`Queue`] is the contract every transport implements: `memory.rs` (in
//! process, tests and `run --input`), [`redis`] (sorted sets, wire
//! compatible with upstream), [`embedded`] (the single-machine durable
//! SQLite store), [`pubsub`] (Google Cloud Pub/Sub subscriptions), [`sql`]
//! (PostgreSQL, on upstream's tables). [`open`]
//! builds the configured transport's queues.

mod client;
pub mod due;
pub mod embedded;
pub mod idempotency;
mod lanes;
mod memory;
mod open;
pub mod pubsub;
pub mod redis;
pub mod sql;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::request::AttemptRecord;
use crate::result::ResultRecord;

pub use client::{
    CancelOutcome, Client, ClientError, ClientTarget, Cursor, Description, Mark, Outgoing,
    ReadResult, ResultPage, SubmissionRecord, Submitted, SubmittedRequest,
};
use embedded::EmbeddedError;
pub use lanes::TenantLanes;
pub use memory::{DeadLetter, MemoryQueue};
pub use open::{
    DEFAULT_EMBEDDED_PATH, OpenError, Transports, client_target, default_redis_config, open,
    open_client,
};

/// Transport handle of one delivery. Opaque to the dispatcher; a new tag
/// per delivery, so a holder whose lease expired cannot acknowledge a
/// message that was redelivered to someone else.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeliveryTag(pub String);

impl fmt::Display for DeliveryTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One message handed to the dispatcher under a lease.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Handle for ack, nack and lease extension.
    pub tag: DeliveryTag,
    /// The message bytes as the producer wrote them.
    pub body: Bytes,
    /// How many failed attempts the transport has recorded for it.
    pub retry_count: u32,
    /// The broker's own id of the message, when it has one (Pub/Sub's
    /// message id): a message whose body names no usable id is answered
    /// as `invalid:<source_id>`, so equal unparsable bodies still get one
    /// result each. `None`: such a message is named by a hash of its body.
    pub source_id: Option<String>,
}

/// A result to write, and the delivery it settles.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The delivery to acknowledge once the result is durable.
    pub tag: DeliveryTag,
    /// The one result record of this submission.
    pub result: ResultRecord,
}

/// Why a message goes back to the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackReason {
    /// A failed attempt (5xx, transport error): counts toward `max_attempts`.
    Failed,
    /// The pool was congested (429/503): not a failure.
    Congested,
    /// A gate said wait or refuse: not an attempt at all.
    NotAdmitted,
    /// The dispatcher is shutting down: hand it back at once.
    Shutdown,
}

impl NackReason {
    /// Whether this nack counts as a failed attempt.
    pub const fn counts_as_failure(self) -> bool {
        matches!(self, Self::Failed)
    }
}

/// What [`Queue::ack`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AckReport {
    /// Results written and messages removed.
    pub acked: usize,
    /// Results skipped because a result for the same id and token exists.
    pub duplicates: usize,
    /// Deliveries whose lease was lost (expired and redelivered): nothing
    /// written, the new holder will answer.
    pub lease_lost: usize,
}

/// A transport failure. Each variant keeps the backend's error as its
/// source.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// A Redis round trip failed (unreachable, timed out, or refused); the
    /// next attempt may work.
    #[error("queue backend unavailable: redis {op}: {source}")]
    Redis {
        /// The operation that failed (`claim`, `ack`, ...).
        op: &'static str,
        /// The Redis error.
        #[source]
        source: ::redis::RedisError,
    },
    /// A Pub/Sub RPC failed (unreachable, timed out, or refused); the next
    /// attempt may work.
    #[error("queue backend unavailable: pubsub {op}: {source}")]
    PubSub {
        /// The operation that failed (`pull`, `ack`, ...).
        op: &'static str,
        /// The gRPC status.
        #[source]
        source: gcloud_gax::grpc::Status,
    },
    /// The embedded store is busy or locked by another writer; retrying
    /// later may work.
    #[error("queue backend unavailable: {0}")]
    EmbeddedBusy(#[source] EmbeddedError),
    /// The embedded store refused the operation for good.
    #[error("queue operation failed: {0}")]
    Embedded(#[source] EmbeddedError),
    /// A PostgreSQL statement of the `sql` transport failed (server
    /// unreachable or restarting, connection lost); the next attempt
    /// reconnects and may work.
    #[error("queue backend unavailable: sql {op}: {source}")]
    Sql {
        /// The operation that failed (`claim`, `ack`, ...).
        op: &'static str,
        /// PostgreSQL's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The task running a queue operation (an embedded store's blocking
    /// call, a pull running beside the releases) panicked or was cancelled.
    #[error("queue operation failed: its task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

impl QueueError {
    /// Whether retrying the operation later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Redis { .. } | Self::PubSub { .. } | Self::EmbeddedBusy(_) | Self::Sql { .. }
        )
    }
}

/// A source of requests with at-least-once delivery and a sink for their
/// results.
///
/// Contract:
/// - `receive` leases up to `max` messages, earliest deadline first (FIFO
///   among equal deadlines), waiting up to `wait` for the first one. A leased
///   message is invisible to other receivers until its lease expires, then it
///   is delivered again (with a new tag). Nothing is lost if the receiver
///   dies.
/// - `ack` writes each result durably and only then removes its message. The
///   first result for an `(id, request_token)` wins; a later one is dropped,
///   so redelivery never produces a second result. A delivery whose lease
///   was lost is not acknowledged (its new holder will answer).
/// - `nack` returns a message to the queue, visible again after `delay`, in
///   its original deadline order (a retry never jumps ahead of earlier-due
///   work). Only [`NackReason::Failed`] increments its retry count. A
///   transport whose broker counts every redelivery as an attempt may
///   instead keep a not-failed message leased and hand it out again
///   itself after `delay` (Pub/Sub does: `pubsub/hold.rs`); the message is
///   then visible to this process only until the lease is given up.
/// - `receive_expired` leases only messages whose deadline has passed,
///   delayed or not, so the dispatcher answers them on time while its
///   window takes nothing else (a transport that cannot select by
///   deadline returns none; its expired messages are answered when
///   `receive` hands them out).
/// - `extend_lease` keeps long-running deliveries leased.
/// - `dead_letter` moves a message out of the queue with its last error,
///   after the attempts allowed for it are used up.
/// - `close` is called once, after the dispatcher has drained: it hands
///   every delivery this process still holds back to the queue at once
///   (visible immediately, no attempt counted), so another worker need not
///   wait for the leases to expire. Nothing is lost if it fails or is never
///   called: the leases expire and the messages are redelivered.
/// - `outstanding` counts messages not yet settled (waiting, delayed or
///   leased) for `--exit-when-done`; transports that cannot tell return
///   `None` and cannot be run that way.
pub trait Queue: Send + Sync + fmt::Debug {
    /// The queue's name, for logs and metric labels.
    fn name(&self) -> &str;

    /// Leases up to `max` messages for `lease`, waiting up to `wait`.
    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>>;

    /// Leases up to `max` messages whose deadline (Unix seconds) is at or
    /// before `now_unix`, visible or still delayed, without waiting. They
    /// are due for their `DEADLINE_EXCEEDED` (or last) answer, not for an
    /// attempt, so taking them uses no window room. Default: none.
    fn receive_expired(
        &self,
        _max: usize,
        _lease: Duration,
        _now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(std::future::ready(Ok(Vec::new())))
    }

    /// Writes results durably, then acknowledges their deliveries.
    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>>;

    /// Returns a delivery to the queue, visible again after `delay`.
    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>>;

    /// [`Queue::nack`] after an attempt that reached the gateway, keeping
    /// what it learned (attempt count, last HTTP answer) with the message
    /// so its next holder reports them. Default: a plain nack.
    fn requeue_after_attempt(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        _record: AttemptRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        self.nack(tag, delay, reason)
    }

    /// Extends the leases of deliveries still being worked on.
    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>>;

    /// Moves a delivery to the dead letters with its last error.
    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>>;

    /// Messages waiting (not leased), if the transport can tell cheaply.
    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>>;

    /// The waiting messages by time to deadline ([`due::DueProfile`]: counts
    /// within fixed horizons and the earliest deadline), read at the
    /// backlog's cadence; `None` when the transport cannot tell cheaply.
    /// Default: `None`.
    fn due(&self) -> BoxFuture<'_, Result<Option<due::DueProfile>, QueueError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Whether the submitter cancelled this delivery after it was received.
    /// The dispatcher asks right before sending a message that waited
    /// (parked at a gate), so a cancel that arrived meanwhile is honoured,
    /// and while a request is at the gateway, so a cancel aborts it
    /// (`dispatch::cancel`). Errors count as "not cancelled". Default:
    /// never cancelled.
    fn cancelled(&self, _tag: &DeliveryTag) -> BoxFuture<'_, bool> {
        Box::pin(std::future::ready(false))
    }

    /// Whether this transport records cancels ([`Queue::cancelled`] can
    /// answer true), so the dispatcher watches its requests in flight for
    /// them. Default: no.
    fn records_cancels(&self) -> bool {
        false
    }

    /// Reachability and counters for readiness and metrics, read without
    /// I/O; `None` when the transport keeps none.
    fn status(&self) -> Option<TransportStatus> {
        None
    }

    /// Hands back every delivery this process still holds (see the
    /// contract above); returns how many. Default: holds nothing beyond
    /// what the dispatcher already handed back.
    fn close(&self) -> BoxFuture<'_, Result<usize, QueueError>> {
        Box::pin(std::future::ready(Ok(0)))
    }

    /// Messages not yet settled, all holders; `None` when the transport
    /// cannot tell. Default: `None`.
    fn outstanding(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(std::future::ready(Ok(None)))
    }
}

/// What a transport reports about itself (see [`Queue::status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStatus {
    /// Whether the backend answered the last round trip.
    pub reachable: bool,
    /// Messages waiting, as last read by the transport's own housekeeping.
    pub backlog: Option<u64>,
    /// Claims (leases) currently recorded in the backend, all holders.
    pub claims_held: u64,
    /// Expired claims this process returned to the queue.
    pub reclaims_total: u64,
    /// Messages this process moved to the dead letters.
    pub dead_letters_total: u64,
}

/// One look of a long poll: what it took, and when to look again if it
/// took nothing (`None`: not before the poll ends, unless `arrived`).
#[derive(Debug)]
pub(crate) struct Look {
    pub(crate) got: Vec<Delivery>,
    pub(crate) again_at: Option<Instant>,
}

impl Look {
    /// A look at a backend other processes write to: what it took, and if
    /// nothing, another look after `period` (no local push announces
    /// their writes).
    pub(crate) fn again_after(got: Vec<Delivery>, period: Duration) -> Self {
        Self {
            got,
            again_at: Some(Instant::now() + period),
        }
    }
}

/// The long poll behind every transport's [`Queue::receive`]: looks until
/// something is taken or `wait` has passed, sleeping between looks until
/// the look's `again_at` or until `arrived` is notified (a local push),
/// whichever comes first. Interest in `arrived` is registered before each
/// look, so a push between the look and the sleep is never missed.
pub(crate) async fn long_poll<F, Fut>(
    wait: Duration,
    arrived: Option<&Notify>,
    mut look: F,
) -> Result<Vec<Delivery>, QueueError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Look, QueueError>>,
{
    let give_up = Instant::now() + wait;
    loop {
        let notified = arrived.map(Notify::notified);
        let Look { got, again_at } = look().await?;
        let now = Instant::now();
        if !got.is_empty() || now >= give_up {
            return Ok(got);
        }
        let until = again_at.map_or(give_up, |at| at.min(give_up));
        match notified {
            Some(notified) => tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(until) => {}
            },
            None => tokio::time::sleep_until(until).await,
        }
    }
}
