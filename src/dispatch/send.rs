//! The worker of one released message: sends it and decides its fate
//! (result, requeue with backoff, or dead letter).

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::congestion::{AfterCongestion, after_congestion};
use super::receive::{Release, settle_unreleased};
use super::retry::RetryDecision;
use super::settle::settle;
use super::state::{Ready, Results, SendKind, Shared};
use crate::gate::{Classification, DispatchEvent, Ticket};
use crate::gateway::{AttemptFailure, AttemptOutcome, deadline_instant};
use crate::queue::{DeliveryTag, NackReason};
use crate::relay::Outlet;
use crate::request::{AttemptRecord, LastAnswer, Message, log_id};
use crate::result::{ErrorCode, ResultRecord};
use crate::telemetry::traces::{self as trace_attr, MessageTrace};

/// How long a message must have waited since it was received before the
/// queue is asked again whether it was cancelled (keeps the hot path free
/// of an extra round trip per message).
pub(super) const CANCEL_RECHECK_AFTER: Duration = Duration::from_millis(500);

/// Sends one released request and decides its fate, in four steps: a
/// message cancelled while it waited is answered `CANCELLED`; otherwise it
/// is sent ([`attempt`]); the pool's room and the gate's reservation are
/// given back and the congestion hold updated ([`release`]); and the
/// outcome becomes a result, a requeue, a wait for the deadline or a dead
/// letter ([`decide`]).
pub(super) async fn send_and_settle(
    shared: Arc<Shared>,
    mut ready: Ready,
    mut ticket: Ticket,
    mut send: SendKind,
    shutdown: CancellationToken,
    abandon: CancellationToken,
    results: Results,
) {
    // `tier-priority` sends upstream's priority index: the queue's tier,
    // and whether a quota gate classified the message `reserved`.
    if let Some(header) = &shared.settings().merge.priority_header {
        let reserved = ticket.classification() == Some(Classification::Reserved);
        let index = shared.settings().merge.tier.priority_index(reserved);
        ready.prepared.set_header(
            header.clone(),
            reqwest::header::HeaderValue::from(u16::from(index)),
        );
    }
    // A message that waited (parked at a gate) may have been cancelled
    // meanwhile; fresh ones were checked when the transport handed them out.
    if ready.received_at.elapsed() >= CANCEL_RECHECK_AFTER
        && shared.queue().cancelled(&ready.delivery.tag).await
    {
        let tag = take_tag(&mut ready);
        settle_cancelled(&shared, &results, &ready, tag, ticket, send).await;
        return;
    }
    // Last check before it goes: the shared window's lease behind the
    // room it was released with may have lapsed since (the process paused,
    // or the cancel check waited on the queue). Then its units may be
    // another replica's: the room goes back and it is released again,
    // under a lease this replica holds then. No await between this check
    // and the request's first write on a kept-alive connection.
    while !shared.window().lease_holds(Instant::now()) {
        give_back(&shared, &ready, ticket, send);
        tracing::info!(
            id = log_id(&ready.message.request.id),
            "shared-window lease lapsed before the send; released again"
        );
        match super::receive::release(&shared, &ready, &shutdown).await {
            Release::Go(again, kind) => (ticket, send) = (again, kind),
            unreleased => {
                settle_unreleased(&shared, &mut ready, unreleased, &results).await;
                return;
            }
        }
    }
    let deadline = deadline_instant(ready.message.request.deadline);
    let mut outlet = shared.config.relay.open(&ready.message.request);
    let (started, end) = attempt(&shared, &ready, deadline, &abandon, outlet.as_mut()).await;
    let end = match outlet {
        Some(outlet) => end_stream(outlet, end),
        None => end,
    };
    let now = Instant::now();
    let cancelled = matches!(end, AttemptEnd::Cancelled);
    let outcome = match end {
        AttemptEnd::Answered(outcome) => Some(outcome),
        AttemptEnd::Abandoned | AttemptEnd::Cancelled => None,
    };
    let congestion_hold = release(&shared, &ready, send, started, now, outcome.as_ref());
    // The pool no longer holds this request: free the gate's reservation
    // and wake anyone waiting for room or for a slot.
    drop(ticket);
    shared.changed.notify_waiters();
    shared.finished.notify_waiters();
    let Some(outcome) = outcome else {
        let tag = take_tag(&mut ready);
        if cancelled {
            shared.metrics().attempt("cancelled");
            let result = error_result(
                &ready.message,
                ErrorCode::Cancelled,
                "cancelled by the submitter while in flight; the request was aborted",
            );
            settle(&shared, &results, tag, result, ready.trace.as_ref()).await;
        } else {
            shared.nack(tag, Duration::ZERO, NackReason::Shutdown).await;
        }
        return;
    };
    let metrics = shared.metrics();
    metrics
        .attempt_latency
        .observe(now.duration_since(started).as_secs_f64());
    metrics.attempt(outcome.label());
    let sent = Sent {
        now,
        deadline,
        congestion_hold,
    };
    let tag = take_tag(&mut ready);
    decide(&shared, &results, &ready, tag, outcome, &sent, &shutdown).await;
}

/// The delivery's tag, moved out for the settle that consumes it. The
/// steps borrow the rest of `ready` rather than take it: a step taking
/// `Ready` by value puts a second copy of it in the worker's future (the
/// caller's moved-from slot is not reused), which cost about 1 KiB of
/// peak RSS per drained message in `bench drain-memory`.
fn take_tag(ready: &mut Ready) -> DeliveryTag {
    std::mem::replace(&mut ready.delivery.tag, DeliveryTag(String::new()))
}

/// Gives back a release that is not sent after all: the pool's room, the
/// gate's reservation and, for the probe, the probe.
fn give_back(shared: &Shared, ready: &Ready, ticket: Ticket, send: SendKind) {
    let now = Instant::now();
    {
        let mut window = shared.window();
        window.finished(now, ready.cost);
        shared.export_window(&window, now);
    }
    ticket.refund();
    if send == SendKind::Probe {
        shared.config.congestion.lock().probe_abandoned();
    }
    shared.changed.notify_waiters();
    shared.finished.notify_waiters();
}

/// Answers a message cancelled while it waited, giving back the room it
/// was released with.
async fn settle_cancelled(
    shared: &Shared,
    results: &Results,
    ready: &Ready,
    tag: DeliveryTag,
    ticket: Ticket,
    send: SendKind,
) {
    let now = Instant::now();
    {
        let mut window = shared.window();
        window.finished(now, ready.cost);
        shared.export_window(&window, now);
    }
    drop(ticket);
    if send == SendKind::Probe {
        shared.config.congestion.lock().probe_abandoned();
    }
    shared.changed.notify_waiters();
    shared.finished.notify_waiters();
    let result = error_result(
        &ready.message,
        ErrorCode::Cancelled,
        "cancelled by the submitter",
    );
    settle(shared, results, tag, result, ready.trace.as_ref()).await;
}

/// How an attempt ended.
enum AttemptEnd {
    /// The gateway answered, or the attempt failed on its own.
    Answered(AttemptOutcome),
    /// Dropped at shutdown (the grace period ran out): the message goes
    /// back to the queue.
    Abandoned,
    /// Dropped because the submitter cancelled the message meanwhile
    /// (`cancel.rs`): closing the connection aborts it at the engine.
    Cancelled,
}

impl AttemptEnd {
    fn label(&self) -> &'static str {
        match self {
            Self::Answered(outcome) => outcome.label(),
            Self::Abandoned => "abandoned",
            Self::Cancelled => "cancelled",
        }
    }

    fn outcome(&self) -> Option<&AttemptOutcome> {
        match self {
            Self::Answered(outcome) => Some(outcome),
            Self::Abandoned | Self::Cancelled => None,
        }
    }
}

/// The retry rule of a streamed answer, and the end of its relay: once
/// any piece of it reached the client (the relay started), no other
/// attempt may follow, since a second answer would be spliced after the
/// first's beginning. So what would be retried (a body that broke, the
/// attempt timeout, a shutdown's requeue) is final instead, and the
/// relay's end tells the holder, which ends the client's stream with an
/// error event. Before any piece nothing changes: a 429, a reset or a
/// timeout is retried as ever, and the retry's pieces are the stream.
fn end_stream(outlet: Outlet, end: AttemptEnd) -> AttemptEnd {
    if !outlet.started() {
        return end;
    }
    let end = match end {
        AttemptEnd::Answered(AttemptOutcome::Retryable { failure, .. }) => {
            AttemptEnd::Answered(AttemptOutcome::Failed { failure })
        }
        AttemptEnd::Abandoned => AttemptEnd::Answered(AttemptOutcome::Failed {
            failure: AttemptFailure::Reset(
                "the dispatcher shut down while the answer was streaming".into(),
            ),
        }),
        other => other,
    };
    let error = match &end {
        AttemptEnd::Answered(AttemptOutcome::Success { .. }) => None,
        AttemptEnd::Answered(AttemptOutcome::Failed { failure }) => Some(failure.to_string()),
        AttemptEnd::Answered(AttemptOutcome::DeadlineExceeded) => {
            Some("the request's deadline passed while its answer was streaming".into())
        }
        other => Some(format!("the answer's stream ended: {}", other.label())),
    };
    outlet.end(error);
    end
}

/// Sends the request (traced when tracing is on) and returns when it
/// started and how it ended. An answer that arrives before a cancel is
/// noticed is kept. A streamed flex request's body goes to its `outlet`
/// as it arrives; a holder in this process that goes away (its client
/// left) aborts the attempt at once, as a cancel does.
async fn attempt(
    shared: &Shared,
    ready: &Ready,
    deadline: Instant,
    abandon: &CancellationToken,
    outlet: Option<&mut Outlet>,
) -> (Instant, AttemptEnd) {
    let metrics = shared.metrics();
    metrics
        .dispatch_delay
        .observe(ready.received_at.elapsed().as_secs_f64());
    metrics.sent.inc();
    let started = Instant::now();
    shared.config.gate.on_event(DispatchEvent::Sent {
        at: started,
        cost: ready.cost,
    });
    let span = ready.trace.as_ref().map(|t| {
        let mut span = t.start(trace_attr::SEND, SpanKind::Client);
        let attempt = ready
            .message
            .previous_attempts(ready.delivery.retry_count)
            .saturating_add(1);
        span.set([KeyValue::new(trace_attr::ATTR_ATTEMPT, i64::from(attempt))]);
        span
    });
    let running = shared.running.register(&ready.delivery.tag);
    let holder_gone = outlet.as_ref().map(|o| o.holder_gone());
    let gateway = &shared.config.gateway;
    let send = async {
        match outlet {
            Some(outlet) => gateway.send_tapped(&ready.prepared, deadline, outlet).await,
            None => gateway.send(&ready.prepared, deadline).await,
        }
    };
    let end = tokio::select! {
        // Biased: an answer that is ready wins over a cancel seen at the
        // same moment (the work is done; the answer is kept).
        biased;
        o = send => AttemptEnd::Answered(o),
        () = abandon.cancelled() => AttemptEnd::Abandoned,
        () = running.cancelled() => AttemptEnd::Cancelled,
        () = async {
            match holder_gone {
                Some(gone) => gone.await,
                None => std::future::pending().await,
            }
        } => AttemptEnd::Cancelled,
    };
    drop(running);
    if let Some(mut span) = span {
        let label = end.label();
        span.set([KeyValue::new(trace_attr::ATTR_ATTEMPT_OUTCOME, label)]);
        if let Some(status) = end.outcome().and_then(AttemptOutcome::status) {
            span.set([KeyValue::new(
                trace_attr::ATTR_HTTP_STATUS,
                i64::from(status),
            )]);
        }
        if !matches!(end, AttemptEnd::Answered(AttemptOutcome::Success { .. })) {
            span.fail(label);
        }
        span.end();
    }
    (started, end)
}

/// Tells the gate how the attempt ended, gives its room back to the
/// window and updates the congestion hold; returns the hold a 429/503 or
/// a transport failure started.
fn release(
    shared: &Shared,
    ready: &Ready,
    send: SendKind,
    started: Instant,
    now: Instant,
    outcome: Option<&AttemptOutcome>,
) -> Option<Duration> {
    // Whether the pool itself answered (anything but 429/503 and transport
    // failures): only such an answer to a request sent after the latest
    // congestion signal ends the gateway's hold.
    let answered_by_pool = match outcome {
        Some(AttemptOutcome::Success { .. } | AttemptOutcome::Final { .. }) => true,
        Some(AttemptOutcome::Retryable { failure, .. } | AttemptOutcome::Failed { failure }) => {
            failure.http_answer().is_some()
        }
        _ => false,
    };
    let gate = &shared.config.gate;
    if let Some(outcome) = outcome {
        gate.on_event(dispatch_event(outcome, started, now, ready.cost));
    } else {
        // Abandoned at shutdown or cancelled: for the gate's in-flight
        // count it ended.
        gate.on_event(DispatchEvent::Failed {
            at: now,
            sent_at: started,
            cost: ready.cost,
        });
    }
    let mut window = shared.window();
    window.finished(now, ready.cost);
    let mut congestion = shared.config.congestion.lock();
    let hold = match outcome {
        Some(signal) if signal.is_congestion_signal() => {
            // A 429/503 also shuts the window until a newer reading (a
            // spike the metrics have not shown yet); a refused, reset
            // or timed-out attempt holds the gateway only (`congestion`).
            if matches!(signal, AttemptOutcome::Congested { .. }) {
                window.congested(now);
            }
            let before = congestion.consecutive();
            let hold = congestion.signal(now, started, signal.retry_after(), rand::random::<f64>());
            if congestion.consecutive() != before {
                // A new signal, not an answer to a request that was
                // already out: the other replicas hold too.
                shared.config.pool.publish_hold(hold);
            }
            Some(hold)
        }
        _ if answered_by_pool => {
            congestion.answered(started);
            None
        }
        _ => {
            if send == SendKind::Probe {
                congestion.probe_abandoned();
            }
            None
        }
    };
    drop(congestion);
    shared.export_window(&window, now);
    hold
}

/// When an attempt ended, the message's deadline, and the hold the
/// attempt started.
struct Sent {
    now: Instant,
    deadline: Instant,
    congestion_hold: Option<Duration>,
}

/// What an attempt's outcome makes of the message: a result, a requeue
/// after backoff, a wait for the deadline, or a dead letter.
async fn decide(
    shared: &Shared,
    results: &Results,
    ready: &Ready,
    tag: DeliveryTag,
    outcome: AttemptOutcome,
    sent: &Sent,
    shutdown: &CancellationToken,
) {
    let metrics = shared.metrics();
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
    let trace = ready.trace.as_ref();
    let (id, token) = (&message.request.id, message.token());
    let (now, deadline) = (sent.now, sent.deadline);
    match outcome {
        AttemptOutcome::Success { status, body } | AttemptOutcome::Final { status, body } => {
            let result = ResultRecord::http(id, token, status, body, attempts);
            settle(shared, results, tag, result, trace).await;
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
            // The gateway-wide hold: Retry-After, but never shorter than the
            // jittered backoff of this many consecutive signals.
            let delay = sent
                .congestion_hold
                .unwrap_or(shared.settings().congestion_backoff);
            let record = AttemptRecord {
                attempts,
                last_answer: last_answer(Some((status, &body))),
            };
            match after_congestion(delay, now, deadline) {
                AfterCongestion::Requeue { delay } => {
                    shared
                        .requeue(tag, delay, NackReason::Congested, Some(record))
                        .await;
                }
                AfterCongestion::AwaitDeadline => {
                    // The 429/503 is the answer if the deadline comes first.
                    let waiting = Waiting {
                        tag,
                        deadline,
                        not_before: now,
                        result: ResultRecord::http(id, token, status, body, attempts),
                        record,
                        reason: NackReason::Congested,
                    };
                    await_deadline(shared, results, waiting, trace, shutdown).await;
                }
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
                let record = AttemptRecord {
                    attempts,
                    last_answer: last_answer(failure.http_answer()),
                };
                // A refused, reset or timed-out attempt also held the
                // gateway: the message waits for the longer of the two.
                let wait = delay.max(sent.congestion_hold.unwrap_or(Duration::ZERO));
                match after_congestion(wait, now, deadline) {
                    AfterCongestion::Requeue { delay } => {
                        shared
                            .requeue(tag, delay, NackReason::Failed, Some(record))
                            .await;
                    }
                    AfterCongestion::AwaitDeadline => {
                        let waiting = Waiting {
                            tag,
                            deadline,
                            not_before: now + delay,
                            result: give_up_result(message, &failure, attempts),
                            record,
                            reason: NackReason::Failed,
                        };
                        await_deadline(shared, results, waiting, trace, shutdown).await;
                    }
                }
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
                // Its own backoff leaves no attempt before the deadline.
                let result = give_up_result(message, &failure, attempts);
                settle(shared, results, tag, result, trace).await;
            }
        },
        AttemptOutcome::Failed { failure } => {
            let result = failure_result(message, &failure, attempts);
            settle(shared, results, tag, result, trace).await;
        }
        AttemptOutcome::DeadlineExceeded => {
            let result = deadline_result(message, attempts);
            settle(shared, results, tag, result, trace).await;
        }
    }
}

/// A message kept until its deadline because no attempt can start before
/// it (`congestion::after_congestion`).
struct Waiting {
    tag: DeliveryTag,
    deadline: Instant,
    /// Its own backoff: should the hold lift, it is due again from then.
    not_before: Instant,
    /// The answer written at the deadline.
    result: ResultRecord,
    /// What the attempt learned, kept with the message if it is requeued.
    record: AttemptRecord,
    reason: NackReason,
}

/// Longest a message awaiting its deadline goes without looking at the
/// hold again, should no request finish to wake it.
const AWAIT_RECHECK: Duration = Duration::from_secs(1);

/// Keeps a message until its deadline, then writes its last answer; or,
/// should the gateway's hold lift first (another request's answer clears
/// it), requeues it to be tried again. The message stays leased meanwhile
/// (its lease is renewed like any held message) and uses no window room.
/// At shutdown it goes back to the queue due at its deadline, so the next
/// holder answers it then with the answer kept in `record` (where the
/// transport carries it).
async fn await_deadline(
    shared: &Shared,
    results: &Results,
    waiting: Waiting,
    trace: Option<&MessageTrace>,
    shutdown: &CancellationToken,
) {
    shared.metrics().awaiting_deadline.inc();
    loop {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        if now >= waiting.deadline {
            shared.metrics().awaiting_deadline.dec();
            settle(shared, results, waiting.tag, waiting.result, trace).await;
            return;
        }
        if !shared.congestion_held(now) {
            shared.metrics().awaiting_deadline.dec();
            let delay = waiting.not_before.saturating_duration_since(now);
            shared
                .requeue(waiting.tag, delay, waiting.reason, Some(waiting.record))
                .await;
            return;
        }
        tokio::select! {
            () = shutdown.cancelled() => {
                shared.metrics().awaiting_deadline.dec();
                let delay = waiting.deadline.saturating_duration_since(now);
                shared
                    .requeue(waiting.tag, delay, waiting.reason, Some(waiting.record))
                    .await;
                return;
            }
            () = &mut changed => {}
            () = tokio::time::sleep_until(waiting.deadline.min(now + AWAIT_RECHECK)) => {}
        }
    }
}

/// The result of a retryable failure with no attempt left before the
/// deadline: an earlier HTTP answer beats a transport error.
fn give_up_result(message: &Message, failure: &AttemptFailure, attempts: u32) -> ResultRecord {
    if failure.http_answer().is_none() && message.last_answer().is_some() {
        deadline_result(message, attempts)
    } else {
        failure_result(message, failure, attempts)
    }
}

/// What the gate learns of one attempt's outcome.
fn dispatch_event(
    outcome: &AttemptOutcome,
    sent_at: Instant,
    at: Instant,
    cost: u64,
) -> DispatchEvent {
    match outcome.status() {
        Some(status) => DispatchEvent::Answered {
            at,
            sent_at,
            status,
            cost,
        },
        None => DispatchEvent::Failed { at, sent_at, cost },
    }
}

/// The result for a failure with no more attempts: the last HTTP answer if
/// there was one, else `INFERENCE_ERROR`.
pub(super) fn failure_result(
    message: &Message,
    failure: &AttemptFailure,
    attempts: u32,
) -> ResultRecord {
    let (id, token) = (&message.request.id, message.token());
    match failure.http_answer() {
        Some((status, body)) => ResultRecord::http(id, token, status, body.to_owned(), attempts),
        None => {
            let result =
                ResultRecord::error(id, token, ErrorCode::InferenceError, &failure.to_string())
                    .with_attempts(attempts);
            match failure {
                AttemptFailure::Timeout => result.timed_out(),
                _ => result,
            }
        }
    }
}

/// The result of a message its deadline ended: the last HTTP answer, else
/// `DEADLINE_EXCEEDED`.
pub(super) fn deadline_result(message: &Message, attempts: u32) -> ResultRecord {
    let last = message.last_answer();
    ResultRecord::ended_by_deadline(&message.request.id, message.token(), last, attempts)
}

pub(super) fn error_result(message: &Message, code: ErrorCode, text: &str) -> ResultRecord {
    ResultRecord::error(&message.request.id, message.token(), code, text)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gateway::BodyTap;
    use crate::relay::local::LocalRelay;
    use crate::relay::{Event, Relay};

    /// A held streamed flex request and the outlet of one attempt of it.
    fn held(
        stream: bool,
    ) -> (
        Arc<LocalRelay>,
        crate::relay::local::Subscription,
        Option<Outlet>,
    ) {
        let local = Arc::new(LocalRelay::default());
        let subscription = local.subscribe("flex_1");
        let message = crate::request::parse_message(
            serde_json::json!({"id": "flex_1", "deadline": crate::clock::unix_secs() + 60,
                "payload": {"model": "m", "stream": stream}})
            .to_string()
            .as_bytes(),
        )
        .expect("a message");
        let outlet = Relay::default()
            .with_local(local.clone())
            .open(&message.request);
        (local, subscription, outlet)
    }

    fn broken() -> AttemptEnd {
        AttemptEnd::Answered(AttemptOutcome::Retryable {
            failure: AttemptFailure::Body("reset".into()),
            retry_after: None,
        })
    }

    #[test]
    fn only_streamed_flex_requests_get_an_outlet() {
        assert!(held(true).2.is_some());
        assert!(held(false).2.is_none(), "not streamed");
    }

    #[test]
    fn before_any_piece_a_failure_is_retried_as_ever() {
        let (_local, _sub, outlet) = held(true);
        let end = end_stream(outlet.expect("outlet"), broken());
        assert!(matches!(
            end,
            AttemptEnd::Answered(AttemptOutcome::Retryable { .. })
        ));
    }

    #[tokio::test]
    async fn after_a_piece_a_failure_is_final_and_ends_the_relay_with_it() {
        let (_local, mut sub, outlet) = held(true);
        let mut outlet = outlet.expect("outlet");
        outlet.bytes(b"data: a\n\ndata: b");
        assert!(outlet.started());
        let end = end_stream(outlet, broken());
        assert!(matches!(
            end,
            AttemptEnd::Answered(AttemptOutcome::Failed { .. })
        ));
        assert!(matches!(sub.next().await, Event::Chunk { seq: 0, .. }));
        match sub.next().await {
            Event::End { chunks, error, .. } => {
                assert_eq!(chunks, 1);
                assert!(error.is_some_and(|e| e.contains("reset")));
            }
            other => panic!("expected the end, got {other:?}"),
        }
        // A shutdown's requeue is final too once streaming began.
        let (_local, _sub, outlet) = held(true);
        let mut outlet = outlet.expect("outlet");
        outlet.bytes(b"data: a\n\n");
        assert!(matches!(
            end_stream(outlet, AttemptEnd::Abandoned),
            AttemptEnd::Answered(AttemptOutcome::Failed { .. })
        ));
    }

    #[tokio::test]
    async fn a_holder_that_goes_away_is_seen_at_once() {
        let (_local, sub, outlet) = held(true);
        let gone = outlet.expect("outlet").holder_gone();
        drop(sub);
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .expect("the outlet saw its holder go");
    }
}
