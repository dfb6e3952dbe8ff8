//! Google Cloud Pub/Sub transport: one subscription per queue, results
//! published to one result topic (`docs/transports.md`, "Pub/Sub").
//!
//! Flow control is unary `Pull` with `max_messages` = the free dispatch
//! permits the receiver asks for: nothing is pulled that the window cannot
//! send, and a budget change only changes the next Pull's size. There is no
//! long-lived StreamingPull that a budget change could tear down
//! (upstream's sawtooth).
//!
//! Waiting never goes through the broker (`hold.rs`): a delivery the
//! dispatcher hands back for congestion or a gate stays leased, its ack
//! deadline extended by this transport's keeper task, and the next
//! `receive` hands it out again once its delay ends. Pub/Sub would count
//! each redelivery as a delivery attempt, and the emulator stopped
//! redelivering messages nacked with short ack deadlines (issue 22). What
//! does go back to the broker goes with `ModifyAckDeadline 0`, and a
//! message on its last delivery before the broker would dead-letter it is
//! answered (and dead-lettered) by the transport instead.
//!
//! Files: `message` (pure conversions: attribute merge, retry count,
//! deadlines, result attributes), `hold` (the held deliveries and what a
//! hand-back does to each), `connect` (credentials and emulator), `setup`
//! (`sluicegate pubsub setup`).

mod client;
mod connect;
mod hold;
mod message;
mod seen;
mod setup;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use gcloud_gax::grpc::{Code, Status};
use gcloud_gax::retry::RetrySetting;
use gcloud_googleapis::pubsub::v1::{
    ModifyAckDeadlineRequest, PubsubMessage, PullRequest, ReceivedMessage,
};
use gcloud_pubsub::client::Client;
use gcloud_pubsub::publisher::{Publisher, PublisherConfig};
use gcloud_pubsub::subscription::Subscription;
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{
    AckReport, Completion, Delivery, DeliveryTag, Look, NackReason, Queue, QueueError,
    TransportStatus, long_poll,
};
use crate::config::PubSubConfig;
use crate::request::{AttemptRecord, parse_message, source_result_id};
use crate::result::{ErrorCode, ResultRecord};
use crate::tasks::Tasks;
use crate::telemetry::metrics::PubSubMetrics;
use hold::{Held, Leases, Plan, Taken};

pub use client::PubSubClient;
pub use connect::{EMULATOR_ENV, Target, connect, connect_to, target};
pub use message::{MAX_PULL, result_message};
pub use setup::{DEFAULT_MAX_DELIVERY_ATTEMPTS, SetupPlan, setup};

/// Why the Pub/Sub transport could not start or an operation failed.
#[derive(Debug, thiserror::Error)]
pub enum PubSubError {
    /// Credentials could not be found or read.
    #[error("pubsub credentials: {0}")]
    Auth(#[source] gcloud_pubsub::client::google_cloud_auth::error::Error),
    /// The gRPC client could not be built or connect (emulator not
    /// running, bad address, TLS).
    #[error("pubsub client for {target}: {source}")]
    Client {
        /// Where it tried to connect.
        target: String,
        /// The client's error.
        #[source]
        source: gcloud_pubsub::client::Error,
    },
    /// An RPC failed.
    #[error("pubsub {op} {name}: {source}")]
    Rpc {
        /// What was attempted.
        op: &'static str,
        /// The topic or subscription.
        name: String,
        /// The gRPC status.
        #[source]
        source: Status,
    },
    /// A topic or subscription the configuration names does not exist.
    #[error(
        "{key}: {what} `{name}` does not exist in project `{project}`; create it with `sluicegate pubsub setup`"
    )]
    Missing {
        /// The config key naming it.
        key: &'static str,
        /// `topic` or `subscription`.
        what: &'static str,
        /// Its id.
        name: String,
        /// The project.
        project: String,
    },
}

/// Polling an empty subscription within `receive_wait`: the first pause,
/// doubling up to the last.
const POLL_MIN: Duration = Duration::from_millis(10);
const POLL_MAX: Duration = Duration::from_millis(100);
/// Ack ids per Acknowledge / ModifyAckDeadline request (the request limit
/// is 512 KiB; ack ids are a few hundred bytes).
const IDS_PER_REQUEST: usize = 1000;
/// Result publish batching: a batch goes out at this size or after the
/// flush interval, whichever comes first. Settles of many requests share
/// a batch; one settle waits at most the interval.
const PUBLISH_BUNDLE: usize = 500;
const PUBLISH_FLUSH: Duration = Duration::from_millis(5);
/// Parallel publish streams.
const PUBLISH_WORKERS: usize = 4;

/// How long the transport may keep deliveries leased while the pool makes
/// them wait (`[pubsub] max_hold`, `max_hold_bytes`; `hold.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldBudget {
    /// Longest a delivery is kept leased by ack-deadline extensions,
    /// counted from its Pull.
    pub max_hold: Duration,
    /// Most message bytes on hold at once.
    pub max_bytes: u64,
}

impl From<&PubSubConfig> for HoldBudget {
    fn from(c: &PubSubConfig) -> Self {
        Self {
            max_hold: c.max_hold,
            max_bytes: c.max_hold_bytes,
        }
    }
}

/// One subscription as a [`Queue`]. Dropping it stops its keeper task.
#[derive(Debug)]
pub struct PubSubQueue {
    inner: Arc<Inner>,
    _keeper: DropGuard,
}

#[derive(Debug)]
struct Inner {
    name: String,
    subscription: Subscription,
    results: Publisher,
    /// The subscription's dead-letter topic, when it has one: a message
    /// the dispatcher gives up on goes there too, as the broker would.
    dead_letters: Option<Publisher>,
    /// The subscription's `max_delivery_attempts`, read at open: a
    /// delivery at this attempt is the last before the broker dead-letters.
    max_delivery_attempts: Option<i32>,
    /// The subscription's own ack deadline: a lease of the same length
    /// needs no ModifyAckDeadline after the Pull.
    ack_deadline_secs: i32,
    budget: hold::Budget,
    /// The dispatcher's lease (from its last `receive`), in milliseconds:
    /// what the keeper extends holds by.
    lease_ms: AtomicU64,
    leases: Mutex<Leases>,
    /// Wakes the keeper when a hold starts (it may end before the keeper's
    /// next planned look).
    keeper_wake: Notify,
    /// Stops the keeper: at `close`, so no extension re-leases what close
    /// handed back, and when the queue is dropped.
    keeper_stop: CancellationToken,
    /// Acked by an `ack` call that then failed for other completions; the
    /// retry of that call counts them as acked.
    settled: Mutex<HashSet<String>>,
    reachable: AtomicBool,
    pull_failed: AtomicBool,
    dead_letters_total: AtomicU64,
    metrics: PubSubMetrics,
}

/// Pull failures go straight to the receiver, which backs off and counts
/// them; the client's own retries would hide an outage.
fn no_retry() -> RetrySetting {
    RetrySetting {
        take: 0,
        ..RetrySetting::default()
    }
}

fn queue_error(op: &'static str) -> impl FnOnce(Status) -> QueueError {
    move |source| QueueError::PubSub { op, source }
}

/// Whether an ack or deadline change failed for good for these ids (their
/// lease expired: exactly-once subscriptions answer so), rather than for
/// now.
fn ids_expired(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::InvalidArgument | Code::FailedPrecondition
    )
}

/// The result topic's publisher, batching for throughput.
pub fn result_publisher(client: &Client, topic: &str) -> Publisher {
    client.topic(topic).new_publisher(Some(PublisherConfig {
        workers: PUBLISH_WORKERS,
        flush_interval: PUBLISH_FLUSH,
        bundle_size: PUBLISH_BUNDLE,
        retry_setting: None,
    }))
}

/// Publishes `messages` and waits for each confirmation, in order.
pub async fn publish_confirmed(
    publisher: &Publisher,
    messages: Vec<PubsubMessage>,
) -> Vec<Result<String, Status>> {
    let awaiters = publisher.publish_bulk(messages).await;
    let mut out = Vec::with_capacity(awaiters.len());
    for a in awaiters {
        out.push(a.get().await);
    }
    out
}

/// A Pub/Sub message from bytes and attributes.
pub fn pubsub_message(data: Vec<u8>, attributes: HashMap<String, String>) -> PubsubMessage {
    PubsubMessage {
        data,
        attributes,
        ..PubsubMessage::default()
    }
}

impl PubSubQueue {
    /// Opens the queue on `subscription_id`, checking it exists and reading
    /// its ack deadline and dead-letter policy; results go to `results`.
    /// Starts the keeper task that extends and ends holds (`budget`) on
    /// `tasks`, so a panic there fails the run instead of letting every
    /// held delivery's ack deadline run out; it stops with the tree or when
    /// the queue is dropped.
    pub async fn open(
        client: &Client,
        subscription_id: &str,
        results: Publisher,
        project: &str,
        budget: HoldBudget,
        metrics: PubSubMetrics,
        tasks: &Tasks,
    ) -> Result<Self, PubSubError> {
        let subscription = client.subscription(subscription_id);
        let missing = || PubSubError::Missing {
            key: "queue.subscriber_id",
            what: "subscription",
            name: subscription_id.to_owned(),
            project: project.to_owned(),
        };
        let (_, config) = subscription.config(None).await.map_err(|source| {
            if source.code() == Code::NotFound {
                missing()
            } else {
                PubSubError::Rpc {
                    op: "get subscription",
                    name: subscription_id.to_owned(),
                    source,
                }
            }
        })?;
        let policy = config
            .dead_letter_policy
            .as_ref()
            .filter(|p| !p.dead_letter_topic.is_empty());
        let dead_letters = policy.map(|p| client.topic(&p.dead_letter_topic).new_publisher(None));
        // The service applies 5 when a policy leaves it 0.
        let max_delivery_attempts = policy.map(|p| {
            if p.max_delivery_attempts > 0 {
                p.max_delivery_attempts
            } else {
                5
            }
        });
        // 0 means the service default of 10 s.
        let ack_deadline_secs = if config.ack_deadline_seconds > 0 {
            config.ack_deadline_seconds
        } else {
            10
        };
        let inner = Arc::new(Inner {
            name: subscription_id.to_owned(),
            subscription,
            results,
            dead_letters,
            max_delivery_attempts,
            ack_deadline_secs,
            budget: hold::Budget {
                max_hold: budget.max_hold,
                max_bytes: budget.max_bytes,
            },
            lease_ms: AtomicU64::new(u64::try_from(ack_deadline_secs).unwrap_or(10) * 1000),
            leases: Mutex::new(Leases::default()),
            keeper_wake: Notify::new(),
            keeper_stop: tasks.root_token().child_token(),
            settled: Mutex::new(HashSet::new()),
            reachable: AtomicBool::new(true),
            pull_failed: AtomicBool::new(false),
            dead_letters_total: AtomicU64::new(0),
            metrics,
        });
        let stop = inner.keeper_stop.clone();
        tasks.spawn(
            format!("queue `{subscription_id}`: pubsub hold keeper"),
            keep_holds(inner.clone(), stop.clone()),
        );
        Ok(Self {
            inner,
            _keeper: stop.drop_guard(),
        })
    }
}

/// The keeper of holds: extends their ack deadlines every third of the
/// dispatcher's lease, hands failed attempts back to the broker when their
/// backoff ends, and ends holds past `max_hold`. Runs until `close` or
/// until the queue is dropped. RPC failures are logged and retried at the next look: a hold
/// whose extension keeps failing expires and the broker redelivers it
/// (at-least-once, nothing lost).
async fn keep_holds(inner: Arc<Inner>, stop: CancellationToken) {
    loop {
        let now = Instant::now();
        let every = inner.extend_every();
        let (hand_back, extend, next) = {
            let mut leases = inner.leases();
            let extend = leases.take_extensions(now, every);
            (
                leases.due_hand_backs(now, inner.budget.max_hold),
                leases.ack_ids(&extend),
                leases.next_wake(every, inner.budget.max_hold),
            )
        };
        for id in hand_back {
            inner.end_hold(id).await;
        }
        if !extend.is_empty() {
            let n = extend.len() as u64;
            let secs = message::deadline_secs(inner.lease()).max(1);
            match inner.modack(extend, secs).await {
                Ok(()) => {
                    inner.metrics.deadline_extensions.inc_by(n);
                }
                Err(error) => {
                    tracing::warn!(%error, queue = %inner.name, "extending held deliveries failed");
                }
            }
        }
        // At least a short pause between looks, so a failing RPC cannot spin.
        let wake = next
            .unwrap_or(now + every)
            .max(Instant::now() + Duration::from_millis(20));
        tokio::select! {
            () = stop.cancelled() => return,
            () = inner.keeper_wake.notified() => {}
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
        }
    }
}

impl Inner {
    fn leases(&self) -> MutexGuard<'_, Leases> {
        // A panic while holding the map cannot leave it half-updated:
        // every update is one insert, remove or field change.
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn settled(&self) -> MutexGuard<'_, HashSet<String>> {
        self.settled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms.load(Ordering::Relaxed))
    }

    /// Holds are extended every third of the lease, as the dispatcher
    /// extends what it holds.
    fn extend_every(&self) -> Duration {
        (self.lease() / 3).max(Duration::from_millis(100))
    }

    fn update_in_flight(&self, leases: &Leases) {
        self.metrics
            .in_flight
            .set(i64::try_from(leases.len()).unwrap_or(i64::MAX));
    }

    fn release(&self, ids: &[String]) {
        let mut leases = self.leases();
        for id in ids {
            leases.remove(id);
        }
        self.update_in_flight(&leases);
    }

    /// Sets the ack deadline of the ack ids `ack_ids` to `secs` (0 =
    /// redeliver now).
    async fn modack(&self, ack_ids: Vec<String>, secs: i32) -> Result<(), Status> {
        tracing::debug!(queue = %self.name, secs, ack_ids = ?ack_ids, "modack");
        let client = self.subscription.get_client();
        for chunk in ack_ids.chunks(IDS_PER_REQUEST) {
            let request = ModifyAckDeadlineRequest {
                subscription: self.subscription.fully_qualified_name().to_owned(),
                ack_ids: chunk.to_vec(),
                ack_deadline_seconds: secs,
            };
            client.modify_ack_deadline(request, None).await?;
        }
        Ok(())
    }

    /// Hands deliveries back to the broker: ack deadline 0, the nack form
    /// both the emulator and the service redeliver at once (subject to the
    /// subscription's retry policy). Issue 22: with a retry policy the
    /// emulator stopped redelivering messages nacked with a 2 s deadline.
    ///
    /// The leases are released before the RPC: the broker redelivers at
    /// once, and a Pull that met the message still held would take the
    /// new delivery for a duplicate of it and join it to a lease about to
    /// end (found in testing: a hand-back lost that way waited out a whole
    /// ack deadline). If the RPC fails, the leases run out and the broker
    /// redelivers them.
    async fn hand_back(&self, tags: Vec<String>) -> Result<(), QueueError> {
        let ack_ids = self.leases().ack_ids(&tags);
        self.release(&tags);
        let n = ack_ids.len() as u64;
        if n > 0 {
            match self.modack(ack_ids, 0).await {
                Ok(()) => {
                    self.metrics.nacks.inc_by(n);
                }
                // Already expired: the broker redelivers it anyway.
                Err(status) if ids_expired(&status) => {}
                Err(source) => return Err(QueueError::PubSub { op: "nack", source }),
            }
        }
        Ok(())
    }

    /// Ends a hold the keeper found due for the broker: a failed attempt
    /// whose backoff ended, or any hold past `max_hold`. A last delivery is
    /// answered instead (the broker would dead-letter it without a result).
    async fn end_hold(&self, id: String) {
        let last = {
            let mut leases = self.leases();
            if !leases.take_hold(&id) {
                return;
            }
            leases.get(&id).is_some_and(|h| {
                hold::last_delivery(h.delivery_attempt, self.max_delivery_attempts)
            })
        };
        let outcome = if last {
            self.answer_last_delivery(&DeliveryTag(id.clone()), None, "held past pubsub.max_hold")
                .await
        } else {
            self.hand_back(vec![id.clone()]).await
        };
        if let Err(error) = outcome {
            // Not lost: its lease runs out and the broker redelivers it.
            tracing::warn!(%error, queue = %self.name, "ending a hold failed; the lease will expire");
            self.release(&[id]);
        }
    }

    async fn pull(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> Result<Vec<Delivery>, QueueError> {
        self.lease_ms.store(
            u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let request = PullRequest {
            subscription: self.subscription.fully_qualified_name().to_owned(),
            // A Pull that waits for messages cannot be abandoned safely: the
            // server may hand messages to a call the client already dropped
            // (found in testing: the emulator then counted a delivery attempt
            // and kept the message for its whole ack deadline). Pulls that
            // answer at once are never abandoned; `wait` is spent polling.
            #[allow(deprecated)]
            return_immediately: true,
            max_messages: i32::try_from(max.min(MAX_PULL)).unwrap_or(1),
        };
        // An empty pull is tried again after a pause that doubles up to
        // `POLL_MAX`.
        let mut pause = POLL_MIN;
        long_poll(wait, None, || {
            let this_pause = pause;
            pause = (pause * 2).min(POLL_MAX);
            let request = request.clone();
            async move {
                let got = self.pull_once(request, max, lease).await?;
                Ok(Look::again_after(got, this_pause))
            }
        })
        .await
    }

    /// One look: held deliveries whose wait is over, else one Pull.
    async fn pull_once(
        &self,
        request: PullRequest,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Delivery>, QueueError> {
        // Held deliveries whose wait is over go first: they were pulled
        // before anything still on the broker.
        let again = self.redeliveries(max);
        if !again.is_empty() {
            return Ok(again);
        }
        let pulled = self
            .subscription
            .get_client()
            .pull(request, Some(no_retry()))
            .await
            .map(|r| r.into_inner().received_messages);
        let pulled = match pulled {
            Ok(pulled) => pulled,
            Err(source) => {
                self.reachable.store(false, Ordering::Relaxed);
                self.pull_failed.store(true, Ordering::Relaxed);
                return Err(QueueError::PubSub { op: "pull", source });
            }
        };
        self.reachable.store(true, Ordering::Relaxed);
        if self.pull_failed.swap(false, Ordering::Relaxed) {
            self.metrics.pull_restarts.inc();
        }
        if pulled.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = pulled.iter().map(|m| m.ack_id.clone()).collect();
        tracing::debug!(
            queue = %self.name,
            n = pulled.len(),
            message_ids = ?pulled.iter().filter_map(|m| m.message.as_ref().map(|p| p.message_id.as_str())).collect::<Vec<_>>(),
            ack_ids = ?ids,
            attempts = ?pulled.iter().map(|m| m.delivery_attempt).collect::<Vec<_>>(),
            "pulled"
        );
        let secs = message::deadline_secs(lease).max(1);
        if secs != self.ack_deadline_secs {
            // Best effort: if this fails, the subscription's deadline
            // applies and extensions keep the lease.
            if let Err(error) = self.modack(ids, secs).await {
                tracing::warn!(%error, queue = %self.name, "setting the lease after pull failed");
            }
        }
        let (deliveries, answered) = self.take_pulled(pulled);
        self.ack_answered_again(answered).await;
        Ok(deliveries)
    }

    /// Records pulled messages as held: the new ones become deliveries for
    /// the dispatcher; a delivery of a message already held joins its
    /// lease; the ack ids of messages already answered are returned, to
    /// be acked.
    fn take_pulled(&self, pulled: Vec<ReceivedMessage>) -> (Vec<Delivery>, Vec<String>) {
        let now = Instant::now();
        let mut answered = Vec::new();
        let mut joined = 0u64;
        let mut leases = self.leases();
        let deliveries: Vec<Delivery> = pulled
            .into_iter()
            .filter_map(|m| {
                let (data, attributes, message_id) = m
                    .message
                    .map(|p| (p.data, p.attributes, p.message_id))
                    .unwrap_or_default();
                let info = message::received(&data, &attributes);
                let body = Bytes::from(info.body.clone());
                let attempt = usize::try_from(m.delivery_attempt).ok().filter(|a| *a > 0);
                let retry_count = message::retry_count(attempt);
                let source_id = Some(message_id.clone());
                let taken = leases.insert(Held {
                    ack_id: Some(m.ack_id.clone()),
                    info,
                    message_id,
                    joined: Vec::new(),
                    published: false,
                    pulled_at: now,
                    extended_at: now,
                    retry_count,
                    delivery_attempt: (m.delivery_attempt > 0).then_some(m.delivery_attempt),
                    hold: None,
                });
                match taken {
                    Taken::New(tag) => Some(Delivery {
                        tag: DeliveryTag(tag),
                        body,
                        retry_count,
                        source_id,
                    }),
                    Taken::Joined(_) => {
                        joined += 1;
                        None
                    }
                    Taken::Answered => {
                        answered.push(m.ack_id);
                        None
                    }
                }
            })
            .collect();
        self.update_in_flight(&leases);
        self.metrics.duplicates_joined.inc_by(joined);
        (deliveries, answered)
    }

    /// Acks deliveries of messages this process already answered: their
    /// results are on the topic, so nothing is sent twice. A failed ack
    /// only means the broker delivers them once more, and they are acked
    /// then.
    async fn ack_answered_again(&self, ack_ids: Vec<String>) {
        if ack_ids.is_empty() {
            return;
        }
        let n = ack_ids.len() as u64;
        tracing::debug!(queue = %self.name, n, "acking deliveries of messages already answered");
        match self.subscription.ack(ack_ids).await {
            Ok(()) => {
                self.metrics.duplicates_answered.inc_by(n);
            }
            Err(error) => {
                tracing::warn!(%error, queue = %self.name, "acking deliveries of messages already answered failed");
            }
        }
    }

    /// Up to `max` held deliveries whose hold ended, as deliveries again
    /// (same tag and ack id: this process still holds the lease).
    fn redeliveries(&self, max: usize) -> Vec<Delivery> {
        let mut leases = self.leases();
        leases
            .take_redeliveries(Instant::now(), max)
            .into_iter()
            .map(|(id, h)| Delivery {
                tag: DeliveryTag(id),
                body: Bytes::from(h.info.body.clone()),
                retry_count: h.retry_count,
                source_id: Some(h.message_id.clone()),
            })
            .collect()
    }

    /// A hand-back from the dispatcher (`nack`, `requeue_after_attempt`):
    /// held, handed back to the broker, or answered (`hold::plan`).
    async fn hand_back_from_dispatcher(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: Option<AttemptRecord>,
    ) -> Result<(), QueueError> {
        let now = Instant::now();
        let plan = {
            let mut leases = self.leases();
            let Some(h) = leases.get(&tag.0) else {
                return Ok(());
            };
            let facts = hold::Facts {
                reason,
                delay,
                now,
                pulled_at: h.pulled_at,
                deadline_in: hold::time_left(h.info.deadline, crate::clock::unix_secs()),
                last_delivery: hold::last_delivery(h.delivery_attempt, self.max_delivery_attempts),
                size: h.info.body.len() as u64,
                held_bytes: leases.hold_bytes(),
            };
            let plan = hold::plan(&facts, &self.budget);
            if let Plan::Hold { until, then } = plan {
                leases.start_hold(&tag.0, until, then);
            }
            plan
        };
        match plan {
            Plan::Hold { .. } => {
                self.keeper_wake.notify_one();
                Ok(())
            }
            Plan::HandBack => self.hand_back(vec![tag.0]).await,
            Plan::Answer => {
                let why = match reason {
                    NackReason::Failed => "its last attempt failed",
                    NackReason::Shutdown => "the dispatcher shut down",
                    NackReason::Congested | NackReason::NotAdmitted => {
                        "no hold budget left (pubsub.max_hold, pubsub.max_hold_bytes)"
                    }
                };
                self.answer_last_delivery(&tag, record, why).await
            }
        }
    }

    /// Answers a delivery the broker would dead-letter if it came back
    /// (its delivery attempt reached the subscription's
    /// `max_delivery_attempts`): an `INFERENCE_ERROR` result (keeping the
    /// last HTTP answer when an attempt got one) and a copy on the
    /// dead-letter topic, as the dispatcher's own dead-lettering does.
    async fn answer_last_delivery(
        &self,
        tag: &DeliveryTag,
        record: Option<AttemptRecord>,
        why: &str,
    ) -> Result<(), QueueError> {
        let Some((body, message_id, attempt)) = self.leases().get(&tag.0).map(|h| {
            (
                h.info.body.clone(),
                h.message_id.clone(),
                h.delivery_attempt,
            )
        }) else {
            return Ok(());
        };
        let (id, token) = match parse_message(&body) {
            Ok(m) => (m.request.id.clone(), m.token().map(str::to_owned)),
            Err(f) if f.is_anonymous() => (source_result_id(&message_id), f.token),
            Err(f) => (f.result_id, f.token),
        };
        let attempts = record.as_ref().map_or(0, |r| r.attempts);
        let last = match record.and_then(|r| r.last_answer) {
            Some(answer) => ResultRecord::http(
                &id,
                token.as_deref(),
                answer.status_code,
                answer.body,
                attempts,
            ),
            None => ResultRecord::error(
                &id,
                token.as_deref(),
                ErrorCode::InferenceError,
                &format!(
                    "Pub/Sub delivery {} of the subscription's max_delivery_attempts {} and {why}",
                    attempt.unwrap_or(0),
                    self.max_delivery_attempts.unwrap_or(0)
                ),
            )
            .with_attempts(attempts),
        };
        tracing::warn!(id = %crate::request::log_id(&id), why, "last Pub/Sub delivery: answering before the broker dead-letters it");
        self.dead_letter_with(tag, ResultRecord::dead_lettered(&last))
            .await
    }

    async fn ack_completions(&self, completions: Vec<Completion>) -> Result<AckReport, QueueError> {
        let mut report = AckReport::default();
        let mut to_publish = Vec::new();
        let mut to_ack = Vec::new();
        {
            let leases = self.leases();
            let mut settled = self.settled();
            for c in completions {
                let id = c.tag.0;
                if settled.remove(&id) {
                    report.acked += 1;
                    continue;
                }
                match leases.get(&id) {
                    None => report.lease_lost += 1,
                    Some(h) if h.published => to_ack.push(id),
                    Some(h) => {
                        let (data, attributes) =
                            result_message(&c.result, h.info.result_route.as_deref());
                        to_publish.push((id, pubsub_message(data, attributes)));
                    }
                }
            }
        }
        let mut publish_error = None;
        if !to_publish.is_empty() {
            let started = Instant::now();
            let (ids, messages): (Vec<_>, Vec<_>) = to_publish.into_iter().unzip();
            let confirmed = publish_confirmed(&self.results, messages).await;
            self.metrics
                .publish_latency
                .observe(started.elapsed().as_secs_f64());
            let mut leases = self.leases();
            for (id, outcome) in ids.into_iter().zip(confirmed) {
                match outcome {
                    Ok(_) => {
                        if let Some(h) = leases.get_mut(&id) {
                            h.published = true;
                        }
                        to_ack.push(id);
                    }
                    Err(source) => publish_error = Some(source),
                }
            }
        }
        // A void lease (its ack id handed to another delivery) is not acked:
        // that would ack the other message. Its result is on the topic.
        let ack_ids = {
            let mut leases = self.leases();
            let before = to_ack.len();
            to_ack.retain(|tag| {
                let live = leases.get(tag).is_some_and(|h| h.ack_id.is_some());
                if !live {
                    leases.remove(tag);
                }
                live
            });
            report.lease_lost += before - to_ack.len();
            self.update_in_flight(&leases);
            leases.ack_ids(&to_ack)
        };
        if !to_ack.is_empty() {
            tracing::debug!(queue = %self.name, ack_ids = ?ack_ids, "ack");
            match self.subscription.ack(ack_ids).await {
                Ok(()) => {
                    report.acked += to_ack.len();
                    self.metrics.acks.inc_by(to_ack.len() as u64);
                    self.release(&to_ack);
                }
                Err(status) if ids_expired(&status) => {
                    // The leases ran out: the broker redelivers these and
                    // their results are already on the topic (a reader sees
                    // the id twice; docs/transports.md).
                    tracing::warn!(%status, n = to_ack.len(), queue = %self.name, "ack refused: leases expired");
                    report.lease_lost += to_ack.len();
                    self.release(&to_ack);
                }
                Err(source) => return Err(QueueError::PubSub { op: "ack", source }),
            }
        }
        if let Some(source) = publish_error {
            // The retry of this call must count what was acked now.
            self.settled().extend(to_ack);
            return Err(QueueError::PubSub {
                op: "publish result",
                source,
            });
        }
        Ok(report)
    }

    /// Dead-letters a delivery with `result` as its one result: the request
    /// to the dead-letter topic (when the subscription has one), the result
    /// to the result topic, both confirmed, then the ack.
    async fn dead_letter_with(
        &self,
        tag: &DeliveryTag,
        result: ResultRecord,
    ) -> Result<(), QueueError> {
        let Some((info, published)) = self
            .leases()
            .get(&tag.0)
            .map(|h| (h.info.clone(), h.published))
        else {
            return Ok(());
        };
        if !published {
            if let Some(topic) = &self.dead_letters {
                let mut attributes = HashMap::from([
                    ("id".to_owned(), result.id.clone()),
                    ("sluicegate_queue".to_owned(), self.name.clone()),
                ]);
                if let Some(message) = &result.error_message {
                    attributes.insert("sluicegate_last_error".to_owned(), message.clone());
                }
                let message = pubsub_message(info.body.clone(), attributes);
                for outcome in publish_confirmed(topic, vec![message]).await {
                    outcome.map_err(queue_error("publish dead letter"))?;
                }
            }
            let (data, attributes) = result_message(&result, info.result_route.as_deref());
            for outcome in
                publish_confirmed(&self.results, vec![pubsub_message(data, attributes)]).await
            {
                outcome.map_err(queue_error("publish result"))?;
            }
            if let Some(h) = self.leases().get_mut(&tag.0) {
                h.published = true;
            }
        }
        let tags = vec![tag.0.clone()];
        let ack_ids = self.leases().ack_ids(&tags);
        if !ack_ids.is_empty() {
            match self.subscription.ack(ack_ids).await {
                Ok(()) => {
                    self.metrics.acks.inc();
                }
                Err(status) if ids_expired(&status) => {
                    tracing::warn!(%status, queue = %self.name, "dead-letter ack refused: lease expired");
                }
                Err(source) => return Err(QueueError::PubSub { op: "ack", source }),
            }
        }
        self.release(&tags);
        self.dead_letters_total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Hands back every held delivery not yet answered: ack deadline 0,
    /// redelivered at once to another worker; a last delivery is answered
    /// instead.
    async fn close(&self) -> Result<usize, QueueError> {
        // An extension the keeper has already sent may still land after
        // the hand-back below; that only delays the redelivery by one lease.
        self.keeper_stop.cancel();
        let (mut last, mut rest) = (Vec::new(), Vec::new());
        for (id, h) in self.leases().ids().filter(|(_, h)| !h.published) {
            if hold::last_delivery(h.delivery_attempt, self.max_delivery_attempts) {
                last.push(id.clone());
            } else {
                rest.push(id.clone());
            }
        }
        let n = last.len() + rest.len();
        for id in last {
            let tag = DeliveryTag(id);
            if let Err(error) = self
                .answer_last_delivery(&tag, None, "the dispatcher shut down")
                .await
            {
                // Its lease runs out and the broker dead-letters it: the
                // dead-letter subscription still has it.
                tracing::warn!(%error, %tag, queue = %self.name, "could not answer a last delivery at shutdown");
            }
        }
        if !rest.is_empty() {
            let ack_ids = self.leases().ack_ids(&rest);
            let handed_back = ack_ids.len() as u64;
            if handed_back > 0 {
                self.modack(ack_ids, 0)
                    .await
                    .map_err(queue_error("close"))?;
            }
            self.metrics.nacks.inc_by(handed_back);
            self.release(&rest);
        }
        Ok(n)
    }
}

impl Queue for PubSubQueue {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(self.inner.pull(max, lease, wait))
    }

    /// Held deliveries (waiting out congestion, a gate or a failure's
    /// backoff) whose request deadline has passed; what is still on the
    /// broker cannot be asked for by deadline and is answered when pulled.
    fn receive_expired(
        &self,
        max: usize,
        _lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        let mut leases = self.inner.leases();
        let expired = leases
            .take_expired(now_unix, max)
            .into_iter()
            .map(|(tag, h)| Delivery {
                tag: DeliveryTag(tag),
                body: Bytes::from(h.info.body.clone()),
                retry_count: h.retry_count,
                source_id: Some(h.message_id.clone()),
            })
            .collect();
        Box::pin(std::future::ready(Ok(expired)))
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        Box::pin(self.inner.ack_completions(completions))
    }

    /// Congestion and gate waits stay leased for `delay` and come back from
    /// this process's next receive (no delivery attempt used); a failed
    /// attempt waits out `delay` leased, then goes back to the broker with
    /// ack deadline 0; shutdown hands back at once. Bounded by the request's
    /// deadline and `[pubsub] max_hold` / `max_hold_bytes`; a last delivery
    /// is answered rather than handed back (`hold.rs`).
    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(
            self.inner
                .hand_back_from_dispatcher(tag, delay, reason, None),
        )
    }

    /// [`Queue::nack`], keeping the attempt's last answer for the result
    /// of a last delivery.
    fn requeue_after_attempt(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: AttemptRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(
            self.inner
                .hand_back_from_dispatcher(tag, delay, reason, Some(record)),
        )
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        let inner = &self.inner;
        Box::pin(async move {
            // The keeper extends every lease itself when it falls due; a
            // renewal skips what it extended within half a period, so the
            // two do not send the same extension twice.
            let ids = {
                let mut leases = inner.leases();
                let now = Instant::now();
                let tags = leases.not_extended_within(
                    tags.iter().map(|t| &t.0),
                    now,
                    inner.extend_every() / 2,
                );
                leases.mark_extended(&tags, now);
                leases.ack_ids(&tags)
            };
            if ids.is_empty() {
                return Ok(());
            }
            let n = ids.len() as u64;
            inner
                .modack(ids, message::deadline_secs(lease).max(1))
                .await
                .map_err(queue_error("extend lease"))?;
            inner.metrics.deadline_extensions.inc_by(n);
            Ok(())
        })
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            self.inner
                .dead_letter_with(&tag, ResultRecord::dead_lettered(&last_error))
                .await
        })
    }

    /// Pub/Sub reports backlog only through Cloud Monitoring
    /// (`subscription/num_undelivered_messages`), not through its API.
    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    fn status(&self) -> Option<TransportStatus> {
        Some(TransportStatus {
            reachable: self.inner.reachable.load(Ordering::Relaxed),
            backlog: None,
            claims_held: self.inner.leases().len() as u64,
            reclaims_total: 0,
            dead_letters_total: self.inner.dead_letters_total.load(Ordering::Relaxed),
        })
    }

    fn close(&self) -> BoxFuture<'_, Result<usize, QueueError>> {
        Box::pin(self.inner.close())
    }
}
