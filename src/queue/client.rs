//! The queue's client face: what producers and result readers do
//! (`submit`, `results`, `cancel`, the bench drains, `serve`'s intake and
//! collector), one implementation per transport beside its consumer.
//! [`super::open_client`] opens the one a [`ClientTarget`] names.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::idempotency::{SubmissionRecord, Submitted};
use super::{MemoryQueue, QueueError};
use crate::config::{EndpointUrl, PubSubConfig, RedisConfig};
use crate::result::ResultRecord;

/// One request to enqueue: the message bytes as the producer wrote them
/// (a bare request, or an upstream envelope), already validated, and the
/// deadline read from them (Unix seconds), which orders the queue.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The message bytes.
    pub body: Bytes,
    /// Its deadline, Unix seconds.
    pub deadline: i64,
}

/// A key set to a value in the same transaction as an enqueue, so a
/// producer that records its progress in it never enqueues a message
/// twice after a crash (the Batch API's intake).
#[derive(Debug, Clone)]
pub struct Mark {
    /// The key, in the caller's namespace (the transport may tag it to
    /// keep it beside the queue).
    pub key: String,
    /// Its value.
    pub value: String,
    /// Where the transport can expire keys (Redis), how long the mark may
    /// outlive the last enqueue: a bound on a leak, since its producer
    /// forgets it when done. Stores keep it until forgotten.
    pub ttl: Duration,
}

/// What [`Client::cancel`] did for one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// Stopped: it is answered `CANCELLED` (at once where the transport
    /// removes waiting messages, else by the dispatcher that takes it).
    Cancelled,
    /// Leased by a dispatcher: flagged, so it is answered `CANCELLED`
    /// unless it was already sent.
    InFlight,
    /// No unsettled submission has the id (finished, expired or unknown).
    NotActive,
}

/// Where a reader stands in a transport's results: the position of the
/// last result it has read (0: before the first). Transports whose reads
/// consume results (a Redis list, a Pub/Sub subscription) keep no
/// positions: there a confirmed result is gone and the cursor is ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor(pub i64);

/// One result as a reader received it.
#[derive(Debug, Clone)]
pub struct ReadResult {
    /// The result record; `None` when the stored text is not one of ours
    /// (then only `raw` is known).
    pub record: Option<ResultRecord>,
    /// The text as stored or published.
    pub raw: String,
    /// What [`Client::confirm`] needs to settle it.
    pub(crate) receipt: Receipt,
}

/// How a transport settles a result once its reader has it durably.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Receipt {
    /// Results stay where they are (a store): nothing to settle.
    Kept,
    /// An entry of a Redis result list, removed by value.
    ListEntry,
    /// A Pub/Sub delivery, acknowledged by its ack id.
    Ack(String),
}

impl ReadResult {
    /// A result a store keeps: an earlier cursor reads it again.
    pub(crate) fn kept(raw: String) -> Self {
        Self::with_receipt(raw, Receipt::Kept)
    }

    pub(crate) fn with_receipt(raw: String, receipt: Receipt) -> Self {
        Self {
            record: serde_json::from_str(&raw).ok(),
            raw,
            receipt,
        }
    }

    /// Whether the gateway answered it with a 2xx.
    pub fn is_success(&self) -> bool {
        (self.record.as_ref())
            .is_some_and(|r| r.status_code.is_some_and(|s| (200..300).contains(&s)))
    }
}

/// Results read after a cursor, oldest first, and the cursor after them.
#[derive(Debug, Clone, Default)]
pub struct ResultPage {
    /// The results.
    pub results: Vec<ReadResult>,
    /// Pass it to the next read.
    pub cursor: Cursor,
}

/// How a client's transport is named to a user: `submit`, `results` and
/// `cancel` print one summary for every transport, in its words.
#[derive(Debug, Clone)]
pub struct Description {
    /// Where requests go and results come from (`` `q` ``,
    /// `` topic `t` ``, `` queue `q` (store.db) ``).
    pub place: String,
    /// Where results are read from, when it is not `place` (a Redis
    /// result list, a Pub/Sub subscription, a `sql` route).
    pub results: String,
    /// What one enqueued item is called: `requests` on a broker,
    /// `messages` in a store.
    pub items: &'static str,
    /// What an id found by [`Client::active`] is (`waiting in this
    /// queue`).
    pub active: &'static str,
}

/// A client operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The transport failed; [`QueueError::is_retryable`] tells whether a
    /// later attempt may work.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The transport has no such operation (Pub/Sub cannot cancel; only
    /// a store or Redis records marks).
    #[error("{transport} cannot {what}")]
    Unsupported {
        /// The transport.
        transport: &'static str,
        /// The operation, in words.
        what: &'static str,
    },
    /// A message to enqueue is not a request (producers validate every
    /// line first, so this is a caller's bug).
    #[error("request {index} of the batch cannot be enqueued: {reason}")]
    Invalid {
        /// Its index in the batch.
        index: usize,
        /// Why.
        reason: String,
    },
    /// An idempotency key already records a different submission (other
    /// requests, another order or other routes).
    #[error(
        "idempotency key `{key}` already records a different submission (identity {recorded}; this one is {offered})"
    )]
    IdempotencyConflict {
        /// The key.
        key: String,
        /// The recorded submission's identity.
        recorded: String,
        /// This submission's identity.
        offered: String,
    },
    /// An idempotency key that cannot be used.
    #[error("idempotency key `{key}` is refused: {reason}")]
    IdempotencyKey {
        /// The key.
        key: String,
        /// Why.
        reason: &'static str,
    },
    /// The record under an idempotency key is not one this build reads.
    #[error("idempotency key `{key}` holds an unreadable record: {reason}")]
    IdempotencyRecord {
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// The producer's side of a queue: enqueue requests, cancel them, read
/// their results, ask which ids are still active.
///
/// Contract:
/// - `enqueue` writes the requests in order, each visible to the
///   dispatcher only once it is durable; among equal deadlines they are
///   served in the order one client enqueued them (Pub/Sub: the broker's
///   order). A `mark` is written in the same transaction as the requests
///   (both or neither), on transports that can (`Unsupported` elsewhere).
///   On an error, an unknown prefix of the batch may be enqueued; with a
///   mark, none or all of it. It returns how many it enqueued (a `sql`
///   row already queued under the same id and token is not counted).
/// - `cancel` stops the requests with these ids that have not been sent:
///   each is answered `CANCELLED`, once. One already leased is flagged
///   and answered `CANCELLED` unless it was sent before the flag.
/// - `results` returns up to `max` results written after `cursor`,
///   oldest first, without waiting. Delivery is at least once: a reader
///   that crashes before [`Client::confirm`] reads the same results
///   again (a store keeps them all; a list or subscription hands back the
///   unconfirmed ones), and Pub/Sub may repeat a result outright, so
///   readers dedupe by `(id, request_token)`. Results stay readable in a
///   store until their TTL; a Redis list or a subscription gives each to
///   one reader.
/// - `confirm` is called once the reader has what it read durably:
///   `taken` are settled (removed from a list, acknowledged); `foreign`
///   are results this reader does not own (another producer's), kept for
///   their owner (a Redis list moves them to `<list>-unclaimed`).
/// - `active` returns the ids among `ids` still submitted and unsettled,
///   in the order given; `None` when the transport cannot tell.
/// - `enqueue_idempotent` enqueues `requests` and records them under the
///   caller's `key` in the same transaction (Redis: one script; a store:
///   one transaction), unless the key is already recorded: then it
///   enqueues nothing and returns the record when its identity (see
///   [`super::idempotency`]) equals this submission's, else
///   [`ClientError::IdempotencyConflict`] naming the key. The record is
///   kept at least `keep` past the last deadline of its requests (pass at
///   least the time results are kept), then removed. A whole file under
///   one key is one submission: the identity covers every request in
///   order. Transports that cannot write the record with the requests
///   (Pub/Sub, memory, a Redis Cluster) answer `Unsupported`, never
///   ignore the key.
/// - `lookup` returns the record under `key`, `None` when there is none
///   (never recorded, or expired: a caller must not treat that as leave
///   to submit again).
/// - Errors are [`ClientError::Queue`] (the backend, often retryable) or
///   `Unsupported`; nothing is lost by an error, but an enqueue may have
///   to be repeated (with a key, repeating it is safe).
pub trait Client: Send + Sync + fmt::Debug {
    /// Names the transport's places for messages to a user.
    fn describe(&self) -> Description;

    /// Enqueues `requests` in order, with `mark` in the same transaction.
    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>>;

    /// The value of a mark set by [`Client::enqueue`], if it is set.
    /// Default: this transport records no marks.
    fn mark(&self, key: String) -> BoxFuture<'_, Result<Option<String>, ClientError>> {
        let _ = key;
        Box::pin(std::future::ready(Err(self.unsupported(NO_MARKS))))
    }

    /// Forgets a mark (nothing when it is absent). Default: this
    /// transport records no marks.
    fn forget_mark(&self, key: String) -> BoxFuture<'_, Result<(), ClientError>> {
        let _ = key;
        Box::pin(std::future::ready(Err(self.unsupported(NO_MARKS))))
    }

    /// Enqueues `requests` recorded under `key`, or finds the submission
    /// the key records (see the contract). Default: unsupported.
    fn enqueue_idempotent(
        &self,
        key: String,
        requests: Vec<Outgoing>,
        keep: Duration,
    ) -> BoxFuture<'_, Result<Submitted, ClientError>> {
        let _ = (key, requests, keep);
        Box::pin(std::future::ready(Err(self.unsupported(NO_IDEMPOTENCY))))
    }

    /// The submission recorded under `key`, if any. Default: unsupported.
    fn lookup(&self, key: String) -> BoxFuture<'_, Result<Option<SubmissionRecord>, ClientError>> {
        let _ = key;
        Box::pin(std::future::ready(Err(self.unsupported(NO_IDEMPOTENCY))))
    }

    /// Cancels the unsent requests with these ids; one outcome per id.
    fn cancel(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>>;

    /// Up to `max` results after `cursor`, oldest first.
    fn results(&self, cursor: Cursor, max: usize)
    -> BoxFuture<'_, Result<ResultPage, ClientError>>;

    /// Settles results the reader holds durably (see the contract).
    /// Default: results stay where they are, nothing to do.
    fn confirm(
        &self,
        taken: Vec<ReadResult>,
        foreign: Vec<ReadResult>,
    ) -> BoxFuture<'_, Result<(), ClientError>> {
        let _ = (taken, foreign);
        Box::pin(std::future::ready(Ok(())))
    }

    /// The ids among `ids` still unsettled; `None`: cannot tell.
    fn active(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>>;

    /// Why a read found no results, when the transport can say more than
    /// that (messages still waiting, a queue name that holds nothing).
    fn why_empty(&self) -> BoxFuture<'_, Option<String>> {
        Box::pin(std::future::ready(None))
    }

    /// The transport's name, for errors.
    fn transport(&self) -> &'static str;

    /// The `Unsupported` error of this transport for `what`.
    fn unsupported(&self, what: &'static str) -> ClientError {
        ClientError::Unsupported {
            transport: self.transport(),
            what,
        }
    }
}

/// What a transport without idempotency records cannot do.
pub(crate) const NO_IDEMPOTENCY: &str =
    "record an idempotency key with its requests (use redis, embedded or sql)";

/// What a transport without marks cannot do.
pub(crate) const NO_MARKS: &str = "record an intake mark with its requests";

/// Which queue a client is for, and how to reach it: what
/// [`super::open_client`] opens.
#[derive(Debug, Clone)]
pub enum ClientTarget {
    /// An in-process queue.
    Memory(Arc<MemoryQueue>),
    /// A Redis sorted-set queue and its result list.
    Redis {
        /// `[redis]`.
        config: RedisConfig,
        /// The queue (pending sorted set).
        queue: String,
        /// The result list results are read from, and which enqueued
        /// messages name; `None`: they name none (the dispatcher's queue
        /// decides) and results are read from upstream's default list.
        result_list: Option<String>,
        /// The dispatcher's fairness attribute: each message is also
        /// filed in its tenant's lane.
        fairness_attribute: Option<String>,
    },
    /// A queue in an embedded store file.
    Embedded {
        /// The store file.
        path: PathBuf,
        /// The queue in it.
        queue: String,
        /// Create the store when it is missing (only a producer may; a
        /// reader of a mistyped path gets an error naming it).
        create: bool,
    },
    /// A Pub/Sub request topic and result subscription.
    PubSub {
        /// Project and credentials.
        config: PubSubConfig,
        /// The request topic (needed to enqueue).
        topic: Option<String>,
        /// The subscription on the result topic (needed to read results).
        subscription: Option<String>,
    },
    /// A queue of the `sql` transport and its result route.
    Sql {
        /// The database.
        url: EndpointUrl,
        /// How long connecting may take.
        connect_timeout: Duration,
        /// The queue (`async_requests.queue`).
        queue: String,
        /// The result route (`async_results.route`).
        route: String,
    },
}

impl ClientTarget {
    /// This target with `list` as the Redis result list when the queue
    /// names none (the Batch API's `serve.result_list`): its messages then
    /// name it, and its results are read from it. Other transports have
    /// no list to name.
    pub fn or_result_list(mut self, list: &str) -> Self {
        if let Self::Redis { result_list, .. } = &mut self {
            result_list.get_or_insert_with(|| list.to_owned());
        }
        self
    }
}
