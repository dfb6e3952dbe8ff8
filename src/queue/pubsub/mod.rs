//! Google Cloud Pub/Sub transport: one subscription per queue, results
//! published to one result topic (`docs/transports.md`, "Pub/Sub").
//!
//! Flow control is unary `Pull` with `max_messages` = the free dispatch
//! permits the receiver asks for: nothing is pulled that the window cannot
//! send, so nothing has to be held back or handed back, and a budget change
//! only changes the next Pull's size. There is no long-lived StreamingPull
//! that a budget change could tear down (upstream's sawtooth).
//!
//! Files: `message` (pure conversions: attribute merge, retry count,
//! deadlines, result attributes), `connect` (credentials and emulator),
//! `setup` (`sluicegate pubsub setup`).

mod connect;
mod message;
mod setup;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use gcloud_gax::grpc::{Code, Status};
use gcloud_gax::retry::RetrySetting;
use gcloud_googleapis::pubsub::v1::{ModifyAckDeadlineRequest, PubsubMessage, PullRequest};
use gcloud_pubsub::client::Client;
use gcloud_pubsub::publisher::{Publisher, PublisherConfig};
use gcloud_pubsub::subscription::Subscription;

use super::{
    AckReport, Completion, Delivery, DeliveryTag, NackReason, Queue, QueueError, TransportStatus,
};
use crate::result::ResultRecord;
use crate::telemetry::metrics::PubSubMetrics;

pub use connect::{EMULATOR_ENV, Target, connect, connect_to, target};
pub use message::{MAX_PULL, result_message};
pub use setup::{SetupPlan, setup};

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

/// One delivery this process holds.
#[derive(Debug)]
struct Held {
    info: message::Received,
    /// Its result is confirmed on the topic; only the ack is left (an
    /// ack retried after a failure must not publish a second result).
    published: bool,
}

/// One subscription as a [`Queue`].
#[derive(Debug)]
pub struct PubSubQueue {
    name: String,
    subscription: Subscription,
    results: Publisher,
    /// The subscription's dead-letter topic, when it has one: a message
    /// the dispatcher gives up on goes there too, as the broker would.
    dead_letters: Option<Publisher>,
    /// The subscription's own ack deadline: a lease of the same length
    /// needs no ModifyAckDeadline after the Pull.
    ack_deadline_secs: i32,
    held: Mutex<HashMap<String, Held>>,
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
    /// its ack deadline and dead-letter topic; results go to `results`.
    pub async fn open(
        client: &Client,
        subscription_id: &str,
        results: Publisher,
        project: &str,
        metrics: PubSubMetrics,
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
        let dead_letters = config
            .dead_letter_policy
            .as_ref()
            .filter(|p| !p.dead_letter_topic.is_empty())
            .map(|p| client.topic(&p.dead_letter_topic).new_publisher(None));
        Ok(Self {
            name: subscription_id.to_owned(),
            subscription,
            results,
            dead_letters,
            // 0 means the service default of 10 s.
            ack_deadline_secs: if config.ack_deadline_seconds > 0 {
                config.ack_deadline_seconds
            } else {
                10
            },
            held: Mutex::new(HashMap::new()),
            settled: Mutex::new(HashSet::new()),
            reachable: AtomicBool::new(true),
            pull_failed: AtomicBool::new(false),
            dead_letters_total: AtomicU64::new(0),
            metrics,
        })
    }

    fn held(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        // A panic while holding the map cannot leave it half-updated:
        // every update is a single insert or remove.
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn settled(&self) -> MutexGuard<'_, HashSet<String>> {
        self.settled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn update_in_flight(&self, held: &HashMap<String, Held>) {
        self.metrics
            .in_flight
            .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
    }

    fn release(&self, ids: &[String]) {
        let mut held = self.held();
        for id in ids {
            held.remove(id);
        }
        self.update_in_flight(&held);
    }

    /// Sets the ack deadline of `ids` to `secs` (0 = redeliver now).
    async fn modack(&self, ids: Vec<String>, secs: i32) -> Result<(), Status> {
        let client = self.subscription.get_client();
        for chunk in ids.chunks(IDS_PER_REQUEST) {
            let request = ModifyAckDeadlineRequest {
                subscription: self.subscription.fully_qualified_name().to_owned(),
                ack_ids: chunk.to_vec(),
                ack_deadline_seconds: secs,
            };
            client.modify_ack_deadline(request, None).await?;
        }
        Ok(())
    }

    async fn pull(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> Result<Vec<Delivery>, QueueError> {
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
        let give_up = Instant::now() + wait;
        let mut pause = POLL_MIN;
        loop {
            let pulled = self
                .subscription
                .get_client()
                .pull(request.clone(), Some(no_retry()))
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
                let left = give_up.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Vec::new());
                }
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(POLL_MAX);
                continue;
            }
            let ids: Vec<String> = pulled.iter().map(|m| m.ack_id.clone()).collect();
            let secs = message::deadline_secs(lease).max(1);
            if secs != self.ack_deadline_secs {
                // Best effort: if this fails, the subscription's deadline
                // applies and extensions keep the lease.
                if let Err(error) = self.modack(ids, secs).await {
                    tracing::warn!(%error, queue = %self.name, "setting the lease after pull failed");
                }
            }
            let mut held = self.held();
            let deliveries = pulled
                .into_iter()
                .map(|m| {
                    let (data, attributes) = m
                        .message
                        .map(|p| (p.data, p.attributes))
                        .unwrap_or_default();
                    let info = message::received(&data, &attributes);
                    let body = Bytes::from(info.body.clone());
                    held.insert(
                        m.ack_id.clone(),
                        Held {
                            info,
                            published: false,
                        },
                    );
                    let attempt = usize::try_from(m.delivery_attempt).ok().filter(|a| *a > 0);
                    Delivery {
                        tag: DeliveryTag(m.ack_id),
                        body,
                        retry_count: message::retry_count(attempt),
                    }
                })
                .collect();
            self.update_in_flight(&held);
            return Ok(deliveries);
        }
    }

    async fn ack_completions(&self, completions: Vec<Completion>) -> Result<AckReport, QueueError> {
        let mut report = AckReport::default();
        let mut to_publish = Vec::new();
        let mut to_ack = Vec::new();
        {
            let held = self.held();
            let mut settled = self.settled();
            for c in completions {
                let id = c.tag.0;
                if settled.remove(&id) {
                    report.acked += 1;
                    continue;
                }
                match held.get(&id) {
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
            let mut held = self.held();
            for (id, outcome) in ids.into_iter().zip(confirmed) {
                match outcome {
                    Ok(_) => {
                        if let Some(h) = held.get_mut(&id) {
                            h.published = true;
                        }
                        to_ack.push(id);
                    }
                    Err(source) => publish_error = Some(source),
                }
            }
        }
        if !to_ack.is_empty() {
            match self.subscription.ack(to_ack.clone()).await {
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

    async fn dead_letter_one(
        &self,
        tag: &DeliveryTag,
        last_error: ResultRecord,
    ) -> Result<(), QueueError> {
        let Some((info, published)) = self
            .held()
            .get(&tag.0)
            .map(|h| (h.info.clone(), h.published))
        else {
            return Ok(());
        };
        if !published {
            let result = ResultRecord::dead_lettered(&last_error);
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
            if let Some(h) = self.held().get_mut(&tag.0) {
                h.published = true;
            }
        }
        let ids = vec![tag.0.clone()];
        match self.subscription.ack(ids.clone()).await {
            Ok(()) => {
                self.metrics.acks.inc();
            }
            Err(status) if ids_expired(&status) => {
                tracing::warn!(%status, queue = %self.name, "dead-letter ack refused: lease expired");
            }
            Err(source) => return Err(QueueError::PubSub { op: "ack", source }),
        }
        self.release(&ids);
        self.dead_letters_total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Queue for PubSubQueue {
    fn name(&self) -> &str {
        &self.name
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(self.pull(max, lease, wait))
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        Box::pin(self.ack_completions(completions))
    }

    /// The delay is the ack deadline the message gets (whole seconds,
    /// rounded up, at most 600 s); 0 hands it back at once. Pub/Sub counts
    /// the redelivery as a delivery attempt whatever the reason.
    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        _reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            if !self.held().contains_key(&tag.0) {
                return Ok(());
            }
            let ids = vec![tag.0];
            let outcome = self
                .modack(ids.clone(), message::deadline_secs(delay))
                .await;
            match outcome {
                Ok(()) => {
                    self.metrics.nacks.inc();
                }
                Err(status) if ids_expired(&status) => {}
                Err(source) => return Err(QueueError::PubSub { op: "nack", source }),
            }
            self.release(&ids);
            Ok(())
        })
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            let ids: Vec<String> = {
                let held = self.held();
                tags.into_iter()
                    .map(|t| t.0)
                    .filter(|id| held.contains_key(id))
                    .collect()
            };
            if ids.is_empty() {
                return Ok(());
            }
            let n = ids.len() as u64;
            self.modack(ids, message::deadline_secs(lease).max(1))
                .await
                .map_err(queue_error("extend lease"))?;
            self.metrics.deadline_extensions.inc_by(n);
            Ok(())
        })
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move { self.dead_letter_one(&tag, last_error).await })
    }

    /// Pub/Sub reports backlog only through Cloud Monitoring
    /// (`subscription/num_undelivered_messages`), not through its API.
    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    fn status(&self) -> Option<TransportStatus> {
        Some(TransportStatus {
            reachable: self.reachable.load(Ordering::Relaxed),
            backlog: None,
            claims_held: self.held().len() as u64,
            reclaims_total: 0,
            dead_letters_total: self.dead_letters_total.load(Ordering::Relaxed),
        })
    }

    /// Sets every held delivery's ack deadline to 0: redelivered at once.
    fn close(&self) -> BoxFuture<'_, Result<usize, QueueError>> {
        Box::pin(async move {
            let ids: Vec<String> = self
                .held()
                .iter()
                .filter(|(_, h)| !h.published)
                .map(|(id, _)| id.clone())
                .collect();
            if ids.is_empty() {
                return Ok(0);
            }
            let n = ids.len();
            self.modack(ids.clone(), 0)
                .await
                .map_err(queue_error("close"))?;
            self.metrics.nacks.inc_by(n as u64);
            self.release(&ids);
            Ok(n)
        })
    }
}
