//! The dispatch loop of one queue: observe the gate, pull only what the
//! window allows, admit, send, settle.
//!
//! Tasks, all owned by [`QueueDispatcher::run`]:
//! - the *observer* reads the gate every poll interval (and on demand when
//!   the window is used up) and applies each reading to the window;
//! - the *receiver* (the `run` future itself) takes permits before it pulls:
//!   it asks the queue for at most as many messages as the window has room
//!   for, then parses, checks deadlines, admits and releases each;
//! - one *worker* task per released message sends it and decides its fate;
//! - the *result writer* batches results and acknowledges only after they
//!   are written;
//! - the *lease keeper* renews the leases of every message still held.
//!
//! Shutdown: stop receiving, hand back staged and parked messages, give
//! in-flight requests the grace period, requeue what is still running,
//! flush results, exit.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::cost::request_cost;
use super::settings::DispatchSettings;
use super::window::{Applied, Window, headroom_units};
use crate::config::Rounding;
use crate::gate::{Admission, AdmissionRequest, FailClosed, Ticket};
use crate::gateway::{
    AttemptFailure, AttemptOutcome, GatewayClient, PreparedRequest, RetryDecision, RetryPolicy,
    Target, deadline_instant,
};
use crate::queue::{Completion, Delivery, DeliveryTag, NackReason, Queue};
use crate::request::{AttemptRecord, LastAnswer, Message, log_id, parse_message};
use crate::result::{ErrorCode, ResultRecord};
use crate::telemetry::QueueMetrics;

/// Results buffered between workers and the writer; a full buffer slows
/// workers down instead of growing memory.
const RESULT_BUFFER: usize = 4096;
/// Most results written in one queue call.
const RESULT_BATCH: usize = 512;
/// Longest pause between result-write retries while the queue is down.
const RESULT_RETRY_MAX: Duration = Duration::from_secs(5);
/// How often a parked message asks its gate again when nothing else wakes it.
const PARK_RECHECK: Duration = Duration::from_millis(250);

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
    /// Tunables.
    pub settings: DispatchSettings,
    /// Metric handles of this queue.
    pub metrics: QueueMetrics,
    /// Queue labels (e.g. `tier`), merged under each message's own labels
    /// for admission.
    pub labels: BTreeMap<String, String>,
}

/// State shared by the dispatcher's tasks.
#[derive(Debug)]
struct Shared {
    config: QueueDispatcher,
    window: Mutex<Window>,
    /// Fired when the window may have room again (fresh observation,
    /// finished request).
    changed: Notify,
    /// Asks the observer for a fresh reading now.
    refresh: Notify,
    /// Fired when a sent request ends, so parked messages ask their gate
    /// again (a concurrency slot may be free).
    finished: Notify,
    /// Deliveries not yet settled, whose leases the keeper renews.
    held: Mutex<HashSet<DeliveryTag>>,
    parked: AtomicUsize,
}

impl Shared {
    fn window(&self) -> MutexGuard<'_, Window> {
        // Window methods do not panic; a poisoned lock still holds a
        // consistent window.
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn held(&self) -> MutexGuard<'_, HashSet<DeliveryTag>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn metrics(&self) -> &QueueMetrics {
        &self.config.metrics
    }

    fn settings(&self) -> &DispatchSettings {
        &self.config.settings
    }

    fn queue(&self) -> &dyn Queue {
        self.config.queue.as_ref()
    }

    /// Publishes the window's numbers to metrics.
    fn export_window(&self, window: &Window, now: Instant) {
        let m = self.metrics();
        let (n, limit) = window.grant().unwrap_or((0, 0));
        m.headroom.set(saturating_i64(n));
        m.window.set(saturating_i64(limit));
        m.available.set(saturating_i64(window.available(now)));
        m.in_flight.set(saturating_i64(window.in_flight()));
    }

    /// Hands a delivery back to the queue and stops renewing its lease.
    async fn nack(&self, tag: DeliveryTag, delay: Duration, reason: NackReason) {
        self.requeue(tag, delay, reason, None).await;
    }

    /// [`Self::nack`], keeping what a sent attempt learned with the message.
    async fn requeue(
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

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Whole seconds since the Unix epoch, for deadline checks.
fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A message that passed parsing, deadline and request checks.
#[derive(Debug)]
struct Ready {
    delivery: Delivery,
    message: Message,
    prepared: PreparedRequest,
    cost: u64,
    received_at: Instant,
}

/// Channel to the result writer.
type Results = mpsc::Sender<Completion>;

impl QueueDispatcher {
    /// Runs until `shutdown` is cancelled, then drains (see module docs).
    pub async fn run(self, shutdown: CancellationToken) {
        let window = Window::new(Instant::now(), self.settings.max_staleness * 2);
        let shared = Arc::new(Shared {
            config: self,
            window: Mutex::new(window),
            changed: Notify::new(),
            refresh: Notify::new(),
            finished: Notify::new(),
            held: Mutex::new(HashSet::new()),
            parked: AtomicUsize::new(0),
        });
        let background = CancellationToken::new();
        let abandon = CancellationToken::new();
        let abandon_writes = CancellationToken::new();
        let (results, results_rx) = mpsc::channel(RESULT_BUFFER);
        let observer = tokio::spawn(observe_loop(shared.clone(), background.clone()));
        let keeper = tokio::spawn(lease_keeper(shared.clone(), background.clone()));
        let writer = tokio::spawn(result_writer(
            shared.clone(),
            results_rx,
            abandon_writes.clone(),
        ));
        let tracker = TaskTracker::new();

        receive_loop(&shared, &shutdown, &abandon, &tracker, &results).await;

        tracker.close();
        let grace = shared.settings().shutdown_grace;
        tracing::info!(
            queue = shared.queue().name(),
            in_flight = tracker.len(),
            "draining"
        );
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                queue = shared.queue().name(),
                "grace period over; requeueing requests still in flight"
            );
            abandon.cancel();
            tracker.wait().await;
        }
        drop(results);
        // The writer ends once every buffered result is written (or, if the
        // queue stays down past a second grace period, abandons them: their
        // messages were never acknowledged and will be redelivered).
        let give_up = abandon_writes.clone();
        let writer_deadline = tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            give_up.cancel();
        });
        let _ = writer.await;
        writer_deadline.abort();
        background.cancel();
        let _ = tokio::join!(observer, keeper);
        tracing::info!(queue = shared.queue().name(), "stopped");
    }
}

/// Pulls messages while the window has room.
async fn receive_loop(
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
    abandon: &CancellationToken,
    tracker: &TaskTracker,
    results: &Results,
) {
    let settings = shared.settings().clone();
    let mut receive_errors = 0u32;
    while !shutdown.is_cancelled() {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let available = shared.window().available(Instant::now());
        if available == 0 {
            shared.refresh.notify_one();
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = &mut changed => {}
                () = tokio::time::sleep(settings.poll_interval) => {}
            }
            continue;
        }
        // Permits before pull: never lease more than the window can send.
        let max = match settings.unit {
            crate::config::Unit::Requests => usize::try_from(available)
                .unwrap_or(usize::MAX)
                .min(settings.receive_batch),
            // Costs are known only after parsing: take one at a time.
            crate::config::Unit::Tokens | crate::config::Unit::Bytes => 1,
        };
        let received = tokio::select! {
            () = shutdown.cancelled() => break,
            r = shared.queue().receive(max, settings.lease, settings.receive_wait) => r,
        };
        let deliveries = match received {
            Ok(d) => {
                receive_errors = 0;
                d
            }
            Err(error) => {
                receive_errors = receive_errors.saturating_add(1);
                let pause = Duration::from_millis(100)
                    .saturating_mul(1 << receive_errors.min(6))
                    .min(settings.poll_interval.max(Duration::from_secs(5)));
                tracing::warn!(%error, queue = shared.queue().name(), "receive failed");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(pause) => {}
                }
                continue;
            }
        };
        for delivery in deliveries {
            shared.metrics().received.inc();
            shared.held().insert(delivery.tag.clone());
            if shutdown.is_cancelled() {
                shared
                    .nack(delivery.tag, Duration::ZERO, NackReason::Shutdown)
                    .await;
                continue;
            }
            handle(shared, delivery, shutdown, abandon, tracker, results).await;
        }
    }
}

/// Takes one delivery from bytes to a released request (or a settled,
/// requeued or parked message).
async fn handle(
    shared: &Arc<Shared>,
    delivery: Delivery,
    shutdown: &CancellationToken,
    abandon: &CancellationToken,
    tracker: &TaskTracker,
    results: &Results,
) {
    let Some(ready) = check(shared, delivery, results).await else {
        return;
    };
    match release(shared, &ready, shutdown).await {
        Release::Go(ticket) => {
            let worker = send_and_settle(
                shared.clone(),
                ready,
                ticket,
                abandon.clone(),
                results.clone(),
            );
            tracker.spawn(worker);
        }
        Release::Shutdown => {
            shared
                .nack(ready.delivery.tag, Duration::ZERO, NackReason::Shutdown)
                .await;
        }
        Release::NotAdmitted(Admission::Wait { .. }) => {
            park(shared, ready, shutdown, abandon, tracker, results);
        }
        Release::NotAdmitted(Admission::Drop { reason }) => {
            let result = error_result(&ready.message, ErrorCode::GateDropped, reason);
            settle(shared, results, ready.delivery.tag, result).await;
        }
        Release::NotAdmitted(Admission::Refuse { .. } | Admission::Continue(_)) => {
            let delay = shared.settings().wait_requeue_delay;
            shared
                .nack(ready.delivery.tag, delay, NackReason::NotAdmitted)
                .await;
        }
    }
}

/// What came of trying to release one message.
enum Release {
    /// Window and gate agree: send it, holding the ticket until it ends.
    Go(Ticket),
    /// The gate said wait, refuse or drop (never `Continue`).
    NotAdmitted(Admission),
    /// Shutdown came first.
    Shutdown,
}

/// Waits for window room, then asks the gate, and records the send only
/// when both agree. It never holds an admission ticket while waiting for
/// the window: a concurrency gate whose slots were held by waiting messages
/// would read zero budget, and the window would never reopen.
async fn release(shared: &Shared, ready: &Ready, shutdown: &CancellationToken) -> Release {
    loop {
        if !wait_for_room(shared, ready.cost, shutdown).await {
            return Release::Shutdown;
        }
        match admit(shared, ready).await {
            Admission::Continue(ticket) => {
                let now = Instant::now();
                let mut window = shared.window();
                if window.allows(now, ready.cost) {
                    window.sent(now, ready.cost);
                    shared.export_window(&window, now);
                    return Release::Go(ticket);
                }
                // The room went while the gate was asked (a 429, say):
                // give the reservation back and wait again.
            }
            verdict => return Release::NotAdmitted(verdict),
        }
    }
}

/// Parses and validates a delivery. Anything unusable is answered here
/// with a typed result, never dropped.
async fn check(shared: &Arc<Shared>, delivery: Delivery, results: &Results) -> Option<Ready> {
    let received_at = Instant::now();
    let message = match parse_message(&delivery.body) {
        Ok(message) => message,
        Err(failure) => {
            let id = failure.result_id.clone();
            tracing::info!(id = log_id(&id), reason = failure.reason, "invalid message");
            let result = ResultRecord::error(
                &id,
                failure.token.as_deref(),
                ErrorCode::InvalidRequest,
                &failure.reason,
            );
            settle(shared, results, delivery.tag, result).await;
            return None;
        }
    };
    if message.request.deadline <= unix_now() {
        let attempts = message.previous_attempts(delivery.retry_count);
        let result = deadline_result(&message, attempts);
        settle(shared, results, delivery.tag, result).await;
        return None;
    }
    let prepared = match shared
        .config
        .gateway
        .prepare(&shared.config.target, &message.request)
    {
        Ok(prepared) => prepared,
        Err(error) => {
            let result = error_result(&message, ErrorCode::InvalidRequest, &error.to_string());
            settle(shared, results, delivery.tag, result).await;
            return None;
        }
    };
    let cost = request_cost(shared.settings().unit, &message.request.payload);
    Some(Ready {
        delivery,
        message,
        prepared,
        cost,
        received_at,
    })
}

/// Asks the gate about one message and counts the verdict.
async fn admit(shared: &Shared, ready: &Ready) -> Admission {
    let mut labels = shared.config.labels.clone();
    labels.extend(
        ready
            .message
            .internal
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    let verdict = shared
        .config
        .gate
        .admit(AdmissionRequest {
            id: &ready.message.request.id,
            metadata: &ready.message.request.metadata,
            labels: &labels,
        })
        .await;
    shared
        .metrics()
        .decision(verdict.verdict_label(), verdict.reason_label());
    verdict
}

/// Waits until the window has room for a request of `cost`. Returns false
/// if shutdown came first.
async fn wait_for_room(shared: &Shared, cost: u64, shutdown: &CancellationToken) -> bool {
    loop {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if shared.window().allows(Instant::now(), cost) {
            return true;
        }
        shared.refresh.notify_one();
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = &mut changed => {}
            () = tokio::time::sleep(shared.settings().poll_interval) => {}
        }
    }
}

/// Holds a message the gate told to wait, asking again until it is admitted,
/// its park time or deadline ends, or shutdown. Parked messages do not use
/// the window, so a waiting tenant cannot block the others.
fn park(
    shared: &Arc<Shared>,
    ready: Ready,
    shutdown: &CancellationToken,
    abandon: &CancellationToken,
    tracker: &TaskTracker,
    results: &Results,
) {
    let settings = shared.settings();
    let parked_now = shared.parked.fetch_add(1, Ordering::AcqRel);
    if parked_now >= settings.max_parked {
        shared.parked.fetch_sub(1, Ordering::AcqRel);
        let shared = shared.clone();
        tracker.spawn(async move {
            let delay = shared.settings().wait_requeue_delay;
            shared
                .nack(ready.delivery.tag, delay, NackReason::NotAdmitted)
                .await;
        });
        return;
    }
    shared.metrics().parked.inc();
    let shared = shared.clone();
    let shutdown = shutdown.clone();
    let abandon = abandon.clone();
    let results = results.clone();
    tracker.spawn(async move {
        let give_up = Instant::now() + shared.settings().max_park;
        let outcome = loop {
            let finished = shared.finished.notified();
            tokio::select! {
                () = shutdown.cancelled() => break Release::Shutdown,
                () = finished => {}
                () = tokio::time::sleep(PARK_RECHECK) => {}
            }
            if Instant::now() >= give_up || ready.message.request.deadline <= unix_now() {
                break Release::NotAdmitted(Admission::Refuse {
                    reason: "park_expired",
                });
            }
            match release(&shared, &ready, &shutdown).await {
                Release::NotAdmitted(Admission::Wait { .. } | Admission::Refuse { .. }) => {}
                decided => break decided,
            }
        };
        shared.parked.fetch_sub(1, Ordering::AcqRel);
        shared.metrics().parked.dec();
        match outcome {
            Release::Go(ticket) => {
                send_and_settle(shared, ready, ticket, abandon, results).await;
            }
            Release::NotAdmitted(Admission::Drop { reason }) => {
                let result = error_result(&ready.message, ErrorCode::GateDropped, reason);
                settle(&shared, &results, ready.delivery.tag, result).await;
            }
            Release::Shutdown => {
                shared
                    .nack(ready.delivery.tag, Duration::ZERO, NackReason::Shutdown)
                    .await;
            }
            Release::NotAdmitted(_) => {
                // Back to the queue without using an attempt; an expired
                // deadline is answered when it is next received.
                let delay = shared.settings().wait_requeue_delay;
                shared
                    .nack(ready.delivery.tag, delay, NackReason::NotAdmitted)
                    .await;
            }
        }
    });
}

/// How long a message must have waited since it was received before the
/// queue is asked again whether it was cancelled (keeps the hot path free
/// of an extra round trip per message).
const CANCEL_RECHECK_AFTER: Duration = Duration::from_millis(500);

/// Sends one released request and decides its fate.
async fn send_and_settle(
    shared: Arc<Shared>,
    ready: Ready,
    ticket: Ticket,
    abandon: CancellationToken,
    results: Results,
) {
    let metrics = shared.metrics();
    // A message that waited (parked at a gate) may have been cancelled
    // meanwhile; fresh ones were checked when the transport handed them out.
    if ready.received_at.elapsed() >= CANCEL_RECHECK_AFTER
        && shared.queue().cancelled(&ready.delivery.tag).await
    {
        let now = Instant::now();
        {
            let mut window = shared.window();
            window.finished(now, ready.cost);
            shared.export_window(&window, now);
        }
        drop(ticket);
        shared.changed.notify_waiters();
        shared.finished.notify_waiters();
        let result = error_result(
            &ready.message,
            ErrorCode::Cancelled,
            "cancelled by the submitter",
        );
        settle(&shared, &results, ready.delivery.tag, result).await;
        return;
    }
    metrics
        .dispatch_delay
        .observe(ready.received_at.elapsed().as_secs_f64());
    metrics.sent.inc();
    let deadline = deadline_instant(ready.message.request.deadline);
    let started = Instant::now();
    let outcome = tokio::select! {
        o = shared.config.gateway.send(&ready.prepared, deadline) => Some(o),
        () = abandon.cancelled() => None,
    };
    let now = Instant::now();
    {
        let mut window = shared.window();
        window.finished(now, ready.cost);
        if let Some(AttemptOutcome::Congested { retry_after, .. }) = &outcome {
            window.congested(now, *retry_after);
        }
        shared.export_window(&window, now);
    }
    // The pool no longer holds this request: free the gate's reservation
    // and wake anyone waiting for room or for a slot.
    drop(ticket);
    shared.changed.notify_waiters();
    shared.finished.notify_waiters();
    let Some(outcome) = outcome else {
        shared
            .nack(ready.delivery.tag, Duration::ZERO, NackReason::Shutdown)
            .await;
        return;
    };
    metrics
        .attempt_latency
        .observe(now.duration_since(started).as_secs_f64());
    metrics.attempt(outcome.label());
    // Failures bound the retries; attempts (congested ones too) are reported.
    let failures = ready.delivery.retry_count.saturating_add(1);
    let attempts = ready
        .message
        .previous_attempts(ready.delivery.retry_count)
        .saturating_add(1);
    let message = &ready.message;
    let last_answer = |answer: Option<(u16, &str)>| {
        answer
            .map(|(status_code, body)| LastAnswer {
                status_code,
                body: body.to_owned(),
            })
            .or_else(|| message.last_answer().cloned())
    };
    let tag = ready.delivery.tag;
    let (id, token) = (&message.request.id, message.token());
    match outcome {
        AttemptOutcome::Success { status, body } | AttemptOutcome::Final { status, body } => {
            let result = ResultRecord::http(id, token, status, body, attempts);
            settle(&shared, &results, tag, result).await;
        }
        AttemptOutcome::Congested {
            status,
            body,
            retry_after,
            dropped_reason,
        } => {
            metrics.congestion.inc();
            tracing::debug!(
                id = log_id(id),
                status,
                ?retry_after,
                ?dropped_reason,
                "pool congested"
            );
            let delay = retry_after.unwrap_or(shared.settings().congestion_backoff);
            if now + delay >= deadline {
                // No time left for another try: the last answer is the result.
                let result = ResultRecord::http(id, token, status, body, attempts);
                settle(&shared, &results, tag, result).await;
            } else {
                let last_answer = last_answer(Some((status, &body)));
                let record = AttemptRecord {
                    attempts,
                    last_answer,
                };
                shared
                    .requeue(tag, delay, NackReason::Congested, Some(record))
                    .await;
            }
        }
        AttemptOutcome::Retryable {
            failure,
            retry_after,
        } => match shared
            .config
            .retry
            .decide(failures, retry_after, now, deadline)
        {
            RetryDecision::Retry { delay } => {
                tracing::debug!(id = log_id(id), %failure, ?delay, attempts, "retrying");
                let last_answer = last_answer(failure.http_answer());
                let record = AttemptRecord {
                    attempts,
                    last_answer,
                };
                shared
                    .requeue(tag, delay, NackReason::Failed, Some(record))
                    .await;
            }
            RetryDecision::DeadLetter => {
                let last = failure_result(message, &failure, attempts);
                metrics.outcome("dead_letter");
                tracing::warn!(id = log_id(id), %failure, attempts, "attempts used up; dead-lettering");
                if let Err(error) = shared.queue().dead_letter(tag.clone(), last).await {
                    tracing::warn!(%error, id = log_id(id), "dead-letter write failed; message will be redelivered");
                }
                shared.held().remove(&tag);
            }
            RetryDecision::GiveUp => {
                // The deadline ends it: an earlier HTTP answer beats a
                // transport error.
                let result = if failure.http_answer().is_none() && message.last_answer().is_some() {
                    deadline_result(message, attempts)
                } else {
                    failure_result(message, &failure, attempts)
                };
                settle(&shared, &results, tag, result).await;
            }
        },
        AttemptOutcome::Failed { failure } => {
            let result = failure_result(message, &failure, attempts);
            settle(&shared, &results, tag, result).await;
        }
        AttemptOutcome::DeadlineExceeded => {
            let result = deadline_result(message, attempts);
            settle(&shared, &results, tag, result).await;
        }
    }
}

/// The result for a failure with no more attempts: the last HTTP answer if
/// there was one, else `INFERENCE_ERROR`.
fn failure_result(message: &Message, failure: &AttemptFailure, attempts: u32) -> ResultRecord {
    let (id, token) = (&message.request.id, message.token());
    match failure.http_answer() {
        Some((status, body)) => ResultRecord::http(id, token, status, body.to_owned(), attempts),
        None => ResultRecord::error(id, token, ErrorCode::InferenceError, &failure.to_string())
            .with_attempts(attempts),
    }
}

/// The result of a message its deadline ended: the last HTTP answer, else
/// `DEADLINE_EXCEEDED`.
fn deadline_result(message: &Message, attempts: u32) -> ResultRecord {
    let last = message.last_answer();
    ResultRecord::ended_by_deadline(&message.request.id, message.token(), last, attempts)
}

fn error_result(message: &Message, code: ErrorCode, text: &str) -> ResultRecord {
    ResultRecord::error(&message.request.id, message.token(), code, text)
}

/// Hands a final result to the writer.
async fn settle(shared: &Shared, results: &Results, tag: DeliveryTag, result: ResultRecord) {
    shared.metrics().outcome(result.outcome_label());
    if results.send(Completion { tag, result }).await.is_err() {
        // Only possible once the writer has stopped, after the drain; the
        // message stays unacknowledged and will be redelivered.
        tracing::warn!("result writer gone; message will be redelivered");
    }
}

/// Writes results in batches; acknowledges only what was written.
async fn result_writer(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Completion>,
    abandon: CancellationToken,
) {
    let mut batch = Vec::with_capacity(RESULT_BATCH);
    while rx.recv_many(&mut batch, RESULT_BATCH).await > 0 {
        let mut pause = Duration::from_millis(50);
        loop {
            match shared.queue().ack(batch.clone()).await {
                Ok(report) => {
                    if report.lease_lost > 0 {
                        shared
                            .metrics()
                            .leases_lost
                            .inc_by(report.lease_lost as u64);
                    }
                    break;
                }
                Err(error) => {
                    shared.metrics().result_write_errors.inc();
                    tracing::warn!(%error, results = batch.len(), "result write failed; retrying");
                    tokio::select! {
                        () = abandon.cancelled() => {
                            tracing::error!(results = batch.len(), "giving up on result writes; messages will be redelivered");
                            break;
                        }
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(RESULT_RETRY_MAX);
                }
            }
        }
        {
            let mut held = shared.held();
            for completion in &batch {
                held.remove(&completion.tag);
            }
        }
        batch.clear();
    }
}

/// Renews the leases of held messages every third of the lease.
async fn lease_keeper(shared: Arc<Shared>, stop: CancellationToken) {
    let lease = shared.settings().lease;
    let every = (lease / 3).max(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let tags: Vec<DeliveryTag> = shared.held().iter().cloned().collect();
        if tags.is_empty() {
            continue;
        }
        if let Err(error) = shared.queue().extend_lease(tags, lease).await {
            tracing::warn!(%error, "lease renewal failed");
        }
    }
}

/// Reads the gate and applies each reading to the window.
async fn observe_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let settings = shared.settings().clone();
    let at_least_one = settings.rounding == Rounding::AtLeastOne;
    let mut was_open: Option<bool> = None;
    let mut was_available: Option<bool> = None;
    let mut next_backlog = Instant::now();
    loop {
        let observation = shared.config.gate.observe().await;
        let now = Instant::now();
        let max_sys = observation.max_sys.unwrap_or(settings.max_sys);
        let n = headroom_units(max_sys, observation.headroom(), settings.rounding);
        let (applied, held) = {
            let mut window = shared.window();
            let applied = window.observe(
                observation.taken_at,
                n,
                at_least_one,
                observation.sees_own_load,
            );
            shared.export_window(&window, now);
            (applied, window.is_held(now))
        };
        let m = shared.metrics();
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
        if was_available != Some(observation.source_available) {
            if observation.source_available {
                tracing::info!(queue = shared.queue().name(), "gate source available");
            } else {
                tracing::warn!(
                    queue = shared.queue().name(),
                    reason = observation.reason,
                    "gate source unavailable; gate closed"
                );
            }
            was_available = Some(observation.source_available);
        }
        if was_open != Some(open) {
            tracing::info!(
                queue = shared.queue().name(),
                open,
                budget = observation.budget.get(),
                baseline = observation.baseline.get(),
                n,
                reason = observation.reason,
                "gate {}",
                if open { "opened" } else { "closed" }
            );
            was_open = Some(open);
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
