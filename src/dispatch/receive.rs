//! The receiver: takes permits before it pulls (plus a bounded lookahead),
//! then parses and checks each message, buffers it by tenant, and releases
//! from the buffer fairly (`fair.rs`): admits and sends, parks it at its
//! gate, or requeues it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::congestion::Clearance;
use super::cost::request_cost;
use super::fair::FairQueue;
use super::send::{deadline_result, error_result, send_and_settle};
use super::settle::settle;
use super::state::{Ready, Results, SendKind, Shared};
use crate::clock::unix_secs;
use crate::gate::{Admission, AdmissionRequest, DropAnswer, Ticket};
use crate::queue::{Delivery, DeliveryTag, NackReason, QueueError};
use crate::request::{log_id, parse_message, source_result_id};
use crate::result::{ErrorCode, ResultRecord};
use crate::tasks::sleep_unless;
use crate::telemetry::traces as trace_attr;

/// How often a parked message asks its gate again when nothing else wakes it.
const PARK_RECHECK: Duration = Duration::from_millis(250);

/// While the receiver pulls nothing (the window is shut, full or held),
/// it asks the queue for messages whose deadline has passed once in every
/// period of this length, just after the period starts. Deadlines are
/// whole Unix seconds, so the sweep just after a second starts answers
/// them at once; the one half a second later catches what reached the
/// queue late (Redis's retry mover runs every 250 ms). Issue 22 asks for
/// answers within 1 s of the deadline; this costs two cheap round trips a
/// second.
const DEADLINE_SWEEP: Duration = Duration::from_millis(500);

/// How long after a sweep period starts the sweep runs, so a clock read a
/// hair early does not miss the second.
const DEADLINE_SWEEP_LAG: Duration = Duration::from_millis(5);

/// Pulls messages while the window has room, into a bounded lookahead
/// buffer that releases them fairly among tenants (`fair.rs`).
pub(super) async fn receive_loop(
    shared: &Arc<Shared>,
    shutdown: &CancellationToken,
    abandon: &CancellationToken,
    tracker: &TaskTracker,
    results: &Results,
) {
    let settings = shared.settings().clone();
    // Requests are charged one unit each; token and byte costs vary, so
    // a visit credits a typical request's worth (dearer ones still go).
    let quantum = match settings.unit {
        crate::config::Unit::Requests => 1,
        crate::config::Unit::Tokens | crate::config::Unit::Bytes => 1024,
    };
    let mut fair = FairQueue::new(settings.tenant_weights.clone(), quantum);
    let mut receive_errors = 0u32;
    let mut asked_at = None;
    // The sweep period (`sweep_period`) of the last deadline sweep of the
    // queue, and the Unix second of the last one of the buffer.
    let mut swept_period = u128::MAX;
    let mut buffer_swept = i64::MIN;
    // A pull running beside the releases, and one that came back while the
    // receiver slept (taken in at the top of the next turn).
    let mut prefetch: Option<Prefetch> = None;
    let mut came_back: Option<Pulled> = None;
    while !shutdown.is_cancelled() {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        let available = shared.room(now);
        // Whether this turn pulled or long-polled: then the queue is asked
        // again at once instead of sleeping.
        let mut pulled = false;
        // How many this turn asked the queue for (0: the window takes none).
        let want;
        // Permits before pull: never lease more than the window can send
        // now plus the bounded lookahead, and nothing while the window is
        // shut (`pull_size`).
        {
            // A pull that ran beside the releases and came back.
            if let Some(p) = prefetch.as_mut() {
                came_back = came_back.or_else(|| (&mut p.pull).now_or_never());
                if came_back.is_some() {
                    prefetch = None;
                }
            }
            if let Some(received) = came_back.take() {
                match take_pulled(shared, &mut fair, received, results, &mut receive_errors).await {
                    Ok(got) => pulled = got,
                    Err(pause) => {
                        if fair.is_empty() && !sleep_unless(shutdown, pause).await {
                            break;
                        }
                    }
                }
            }
            // What a running pull asked for counts as buffered: the
            // lookahead bound holds with it.
            let outstanding = prefetch.as_ref().map_or(0, |p| p.want);
            let open = shared.is_open(now);
            let room = usize::try_from(available).unwrap_or(usize::MAX);
            let room = match settings.unit {
                crate::config::Unit::Requests => room,
                // Costs are known only after parsing: one at a time, and
                // the lookahead sees past it.
                crate::config::Unit::Tokens | crate::config::Unit::Bytes => room.min(1),
            };
            // Bodies held (lookahead, parked, in flight, settling) stay
            // within the byte budget, whatever the window allows.
            let within_bytes = shared.held().messages_within(settings.max_buffered_bytes);
            want = pull_size(
                room,
                open,
                fair.len() + outstanding,
                settings.tenant_lookahead,
                settings.receive_batch,
            )
            .min(within_bytes.saturating_sub(outstanding));
            if want > 0 && prefetch.is_none() && !fair.is_empty() {
                // Something to release meanwhile: the pull runs beside the
                // releases instead of stalling them for the queue's round
                // trip (issue 21: a Redis claim script and the sends it
                // feeds had taken turns, each waiting for the other).
                match Prefetch::start(shared, tracker, want, settings.lease) {
                    // A queue that answers at once (memory) is taken in
                    // now; after an error the buffer goes on and the next
                    // turn pulls again.
                    Pull::Answered(received) => {
                        pulled =
                            take_pulled(shared, &mut fair, received, results, &mut receive_errors)
                                .await
                                .unwrap_or(false);
                    }
                    Pull::Running(p) => prefetch = Some(p),
                }
            } else if want > 0 && prefetch.is_none() {
                // Nothing to release meanwhile: wait for the pull,
                // long-polling, and hold no turn of the pool while it
                // waits (merge policies).
                let wait = settings.receive_wait;
                if !wait.is_zero() {
                    shared.contending(false);
                }
                let received = tokio::select! {
                    () = shutdown.cancelled() => break,
                    r = shared.queue().receive(want, settings.lease, wait) => r,
                };
                match take_pulled(shared, &mut fair, received, results, &mut receive_errors).await {
                    Ok(got) => pulled = got || !wait.is_zero(),
                    Err(pause) => {
                        if !sleep_unless(shutdown, pause).await {
                            break;
                        }
                        continue;
                    }
                }
            }
        }
        fair.expire_blocks(Instant::now());
        // Deadlines do not wait for room (issue 22): what expired in the
        // buffer is answered now, and while nothing else is pulled the
        // queue is asked for what expired there (requeue delays end by the
        // deadline, `until_deadline`, so delayed retries are due by then).
        // Deadlines are whole seconds, and what arrives expired is answered
        // on arrival (`check`): the buffer need be looked at only once a
        // second, not on every turn (with thousands of tenants a look
        // costs one step per tenant).
        if unix_secs() != buffer_swept {
            buffer_swept = unix_secs();
            answer_expired(shared, &mut fair, results).await;
        }
        if want == 0 && sweep_period() != swept_period {
            swept_period = sweep_period();
            sweep_expired(shared, &mut fair, results).await;
        }
        // Release only into room: a message popped without it would hold
        // the receiver in `wait_for_room`, and everything behind it (in the
        // buffer and the queue) would wait unseen past its deadline.
        // (Read without `Shared::room`, which also asks a shared window's
        // keeper for units: the turn's `room` call above already did.)
        let has_room = {
            let now = Instant::now();
            shared.window().available(now) > 0 && !shared.congestion_held(now)
        };
        // With a merge policy, the pool's queues take turns at the room
        // (`merge.rs`): this queue contends while it holds a releasable
        // message, and releases one when the policy picks it.
        let now = Instant::now();
        let turns = shared.takes_turns();
        let go = if turns {
            shared.take_turn(now, fair.has_ready(now), has_room)
        } else {
            has_room
        };
        if let Some((tenant, ready)) = go.then(|| fair.pop(now)).flatten() {
            if turns {
                // Stop contending while this receiver cannot take another
                // turn soon: its last releasable message went, or this one
                // must first wait for room (a request dearer than the room,
                // in tokens or bytes), so the other queues are not held for
                // its turn meanwhile. Otherwise it stays marked, and a busy
                // higher tier keeps its priority between two of its turns.
                let can_go = shared.may_send(&shared.window(), now, ready.cost).is_some();
                shared.contending(can_go && fair.has_ready(now));
            }
            if shutdown.is_cancelled() {
                shared
                    .nack(ready.delivery.tag, Duration::ZERO, NackReason::Shutdown)
                    .await;
                break;
            }
            if let Some(refused) = handle(shared, ready, shutdown, abandon, tracker, results).await
            {
                // The gate refused this tenant: the others go first until
                // its requeue delay ends.
                let until = refused + settings.wait_requeue_delay;
                for ready in fair.block(&tenant, until) {
                    let delay =
                        until_deadline(ready.message.request.deadline, settings.wait_requeue_delay);
                    shared
                        .nack(ready.delivery.tag, delay, NackReason::NotAdmitted)
                        .await;
                }
            }
            continue;
        }
        if pulled {
            continue;
        }
        // Nothing to release: no room, or every buffered tenant blocked.
        ask_for_reading(shared, &mut asked_at);
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = &mut changed => {}
            received = Prefetch::wait(&mut prefetch) => {
                prefetch = None;
                came_back = Some(received);
            }
            () = tokio::time::sleep_until(
                shared.next_look(Instant::now()).min(Instant::now() + until_next_sweep())
            ) => {}
        }
    }
    // No longer contending for the pool's turns.
    shared.take_turn(Instant::now(), false, false);
    // A pull still running is let finish (one round trip) so its leases
    // go back at once rather than expiring, but for no longer than the
    // grace: a pull that never answers is stopped, not waited for (the
    // `abandon` token alone comes only after every dispatcher returned).
    if let Some(p) = prefetch.take() {
        tokio::select! {
            () = abandon.cancelled() => p.stop.abort(),
            () = tokio::time::sleep(settings.shutdown_grace) => p.stop.abort(),
            received = p.pull => came_back = Some(received),
        }
    }
    if let Some(Ok(deliveries)) = came_back.take() {
        for delivery in deliveries {
            shared
                .nack(delivery.tag, Duration::ZERO, NackReason::Shutdown)
                .await;
        }
    }
    // Buffered leases go back at once rather than expiring.
    for ready in fair.drain() {
        shared
            .nack(ready.delivery.tag, Duration::ZERO, NackReason::Shutdown)
            .await;
    }
}

/// What one pull of the queue brought.
type Pulled = Result<Vec<Delivery>, QueueError>;

/// A pull that runs beside the releases: at most one at a time, started
/// only while the buffer holds something to release (an empty buffer
/// waits for its pull, or long-polls, as before).
///
/// A pull the queue does not answer at once is a task of its own, not a
/// future the receiver polls: the receiver also waits on the queue (the
/// deadline sweep, nacks), and a transport behind one connection lock
/// (the `sql` transport while it reconnects) would otherwise wait for a
/// lock its own unpolled pull held, forever (found in CI after a
/// PostgreSQL restart).
struct Prefetch {
    /// How many it asked for (counted as buffered until it comes back).
    want: usize,
    pull: BoxFuture<'static, Pulled>,
    /// Stops the pull's task (what it leased then waits out its lease).
    stop: AbortHandle,
}

/// What starting a pull beside the releases gave.
enum Pull {
    /// The queue answered at once (memory).
    Answered(Pulled),
    /// The pull runs on.
    Running(Prefetch),
}

impl Prefetch {
    /// Asks the queue for `want` messages without waiting: its answer when
    /// it has one at once, else the pull, moved to a task of its own.
    fn start(shared: &Arc<Shared>, tracker: &TaskTracker, want: usize, lease: Duration) -> Pull {
        let shared = Arc::clone(shared);
        let mut pull: BoxFuture<'static, Pulled> =
            Box::pin(async move { shared.queue().receive(want, lease, Duration::ZERO).await });
        if let Some(received) = pull.as_mut().now_or_never() {
            return Pull::Answered(received);
        }
        let task = tracker.spawn(pull);
        let stop = task.abort_handle();
        Pull::Running(Self {
            want,
            pull: Box::pin(task.map(|joined| joined.unwrap_or_else(|e| Err(QueueError::Task(e))))),
            stop,
        })
    }

    /// The running pull's answer; never, without one.
    async fn wait(prefetch: &mut Option<Self>) -> Pulled {
        match prefetch {
            Some(p) => (&mut p.pull).await,
            None => std::future::pending().await,
        }
    }
}

/// Takes a pull's deliveries into the buffer: whether it brought any. On
/// an error, counts it, logs it and returns the pause before the next try
/// (doubling with consecutive errors).
async fn take_pulled(
    shared: &Arc<Shared>,
    fair: &mut FairQueue<Ready>,
    received: Pulled,
    results: &Results,
    receive_errors: &mut u32,
) -> Result<bool, Duration> {
    match received {
        Ok(deliveries) => {
            *receive_errors = 0;
            let got = !deliveries.is_empty();
            for delivery in deliveries {
                take_in(shared, fair, delivery, results).await;
            }
            Ok(got)
        }
        Err(error) => {
            *receive_errors = receive_errors.saturating_add(1);
            let settings = shared.settings();
            let pause = Duration::from_millis(100)
                .saturating_mul(1 << (*receive_errors).min(6))
                .min(settings.poll_interval.max(Duration::from_secs(5)));
            tracing::warn!(%error, queue = shared.queue().name(), "receive failed");
            Err(pause)
        }
    }
}

/// How many messages to pull now, with `room` messages the window can send,
/// whether it is `open` at all (`Shared::is_open`: a full window is open,
/// a closed or held one is not), `buffered` already held and the
/// `lookahead` allowed beyond the room.
///
/// The rule (issue 21: the lookahead had turned every send into a queue
/// round trip of its own, and leased messages while the window was shut):
/// - nothing while the window is shut: a message pulled then could not go
///   soon, and another replica could have sent it;
/// - when the buffer holds less than the room, fill room and lookahead;
/// - otherwise top the lookahead up only once it has fallen by half, so
///   the queue is asked for messages in batches rather than one per send
///   (while both halves keep the tenants' mix for fair shares);
/// - never more than `batch` in one receive.
pub(super) fn pull_size(
    room: usize,
    open: bool,
    buffered: usize,
    lookahead: usize,
    batch: usize,
) -> usize {
    if !open {
        return 0;
    }
    let target = room.saturating_add(lookahead);
    let deficit = target.saturating_sub(buffered);
    let refill = buffered < room || deficit >= (lookahead / 2).max(1);
    if refill { deficit.min(batch) } else { 0 }
}

/// Which `DEADLINE_SWEEP` period of the wall clock this is (periods start
/// at whole seconds).
fn sweep_period() -> u128 {
    crate::clock::since_epoch()
        .saturating_sub(DEADLINE_SWEEP_LAG)
        .as_millis()
        / DEADLINE_SWEEP.as_millis()
}

/// Time until just after the next sweep period starts.
fn until_next_sweep() -> Duration {
    let period = DEADLINE_SWEEP.as_nanos();
    let into = crate::clock::since_epoch()
        .saturating_sub(DEADLINE_SWEEP_LAG)
        .as_nanos()
        % period;
    Duration::from_nanos(u64::try_from(period - into).unwrap_or(0))
}

/// Answers every buffered message whose deadline has passed.
async fn answer_expired(shared: &Arc<Shared>, fair: &mut FairQueue<Ready>, results: &Results) {
    for mut ready in fair.take_expired(unix_secs()) {
        settle_unreleased(shared, &mut ready, Release::DeadlinePassed, results).await;
    }
}

/// Leases the queue's messages whose deadline has passed and answers them
/// (through `take_in`, whose checks answer an expired message). Errors are
/// left to the next sweep: the regular receive reports them.
async fn sweep_expired(shared: &Arc<Shared>, fair: &mut FairQueue<Ready>, results: &Results) {
    let settings = shared.settings();
    let expired = shared
        .queue()
        .receive_expired(settings.receive_batch, settings.lease, unix_secs())
        .await;
    match expired {
        Ok(deliveries) => {
            for delivery in deliveries {
                take_in(shared, fair, delivery, results).await;
            }
        }
        Err(error) => {
            tracing::debug!(%error, queue = shared.queue().name(), "deadline sweep failed");
        }
    }
}

/// Takes one delivery into the buffer: parsed and checked (anything
/// unusable is answered here), then buffered under its tenant, or returned
/// unasked while its tenant is blocked.
async fn take_in(
    shared: &Arc<Shared>,
    fair: &mut FairQueue<Ready>,
    delivery: Delivery,
    results: &Results,
) {
    shared.metrics().received.inc();
    let bytes = delivery.body.len() as u64;
    let fits = {
        let mut held = shared.held();
        let fits = held.fits(bytes, shared.settings().max_buffered_bytes);
        // Held either way: the pull estimate learns its size, and the
        // hand-back below releases it.
        held.insert(delivery.tag.clone(), bytes);
        fits
    };
    if !fits {
        // Larger than the pull estimated: back to the queue untouched
        // (not an attempt), to be taken again when the bodies held leave
        // room (`dispatch.max_buffered_bytes`).
        shared
            .nack(delivery.tag, Duration::ZERO, NackReason::NotAdmitted)
            .await;
        return;
    }
    let Some(ready) = check(shared, delivery, results).await else {
        return;
    };
    let tenant = tenant_of(shared, &ready).to_owned();
    if let Some(left) = fair.blocked(&tenant, Instant::now()) {
        let delay = until_deadline(ready.message.request.deadline, left);
        shared
            .nack(ready.delivery.tag, delay, NackReason::NotAdmitted)
            .await;
        return;
    }
    let (deadline, cost) = (ready.message.request.deadline, ready.cost);
    fair.push(&tenant, deadline, cost, ready);
}

/// The tenant of a message: its `[gateway] fairness_attribute` value;
/// messages without one share the tenant "".
fn tenant_of<'a>(shared: &Shared, ready: &'a Ready) -> &'a str {
    shared
        .config
        .gateway
        .fairness_attribute()
        .and_then(|a| ready.message.request.metadata.get(a))
        .map_or("", String::as_str)
}

/// Takes a checked message to a released request (or a settled, requeued
/// or parked message). Returns when the gate refused it, so the receiver
/// can let the message's tenant wait.
pub(super) async fn handle(
    shared: &Arc<Shared>,
    ready: Ready,
    shutdown: &CancellationToken,
    abandon: &CancellationToken,
    tracker: &TaskTracker,
    results: &Results,
) -> Option<Instant> {
    match release(shared, &ready, shutdown).await {
        Release::Go(ticket, send) => {
            let worker = send_and_settle(
                shared.clone(),
                ready,
                ticket,
                send,
                shutdown.clone(),
                abandon.clone(),
                results.clone(),
            );
            tracker.spawn(worker);
            None
        }
        Release::NotAdmitted(Admission::Wait { .. }) => {
            park(shared, ready, shutdown, abandon, tracker, results);
            None
        }
        unreleased => {
            let refused = matches!(unreleased, Release::NotAdmitted(Admission::Refuse { .. }))
                .then(Instant::now);
            let mut ready = ready;
            settle_unreleased(shared, &mut ready, unreleased, results).await;
            refused
        }
    }
}

/// Ends a message that was not released: a result, or back to the queue
/// without using an attempt.
pub(super) async fn settle_unreleased(
    shared: &Shared,
    ready: &mut Ready,
    release: Release,
    results: &Results,
) {
    let deadline = ready.message.request.deadline;
    let tag = std::mem::replace(&mut ready.delivery.tag, DeliveryTag(String::new()));
    match release {
        Release::Go(..) => {
            debug_assert!(false, "a released message is sent, not settled here");
        }
        Release::Shutdown => {
            shared.nack(tag, Duration::ZERO, NackReason::Shutdown).await;
        }
        Release::DeadlinePassed => {
            let attempts = ready.message.previous_attempts(ready.delivery.retry_count);
            let result = deadline_result(&ready.message, attempts);
            settle(shared, results, tag, result, ready.trace.as_ref()).await;
        }
        Release::Congested(delay) => {
            let delay = until_deadline(deadline, delay);
            shared.nack(tag, delay, NackReason::Congested).await;
        }
        Release::NotAdmitted(Admission::Drop { reason, answer }) => {
            let result = match answer {
                DropAnswer::GateDropped => {
                    error_result(&ready.message, ErrorCode::GateDropped, reason)
                }
                DropAnswer::GateDroppedWith(body) => {
                    let mut result = error_result(&ready.message, ErrorCode::GateDropped, reason);
                    result.payload = body.to_string();
                    result
                }
                // As the deadline sweep would answer it, a little earlier.
                DropAnswer::DeadlineExceeded => {
                    let attempts = ready.message.previous_attempts(ready.delivery.retry_count);
                    deadline_result(&ready.message, attempts)
                }
            };
            settle(shared, results, tag, result, ready.trace.as_ref()).await;
        }
        Release::NotAdmitted(_) => {
            // Back to the queue without using an attempt; a deadline that
            // passes meanwhile is answered by the deadline sweep.
            let delay = until_deadline(deadline, shared.settings().wait_requeue_delay);
            shared.nack(tag, delay, NackReason::NotAdmitted).await;
        }
    }
}

/// `delay`, cut so a requeued message is due again by its deadline: the
/// deadline sweep can then answer it on time wherever the transport keeps
/// delayed messages (Redis's retry set is not part of the queue until
/// due).
fn until_deadline(deadline: i64, delay: Duration) -> Duration {
    let left = crate::gateway::deadline_instant(deadline).saturating_duration_since(Instant::now());
    delay.min(left)
}

/// What came of trying to release one message.
pub(super) enum Release {
    /// Window, congestion hold and gate agree: send it (perhaps as the
    /// probe), holding the ticket until it ends.
    Go(Ticket, SendKind),
    /// The gate said wait, refuse or drop (never `Continue`).
    NotAdmitted(Admission),
    /// The deadline passed while the message waited for room.
    DeadlinePassed,
    /// The gateway's congestion hold lasts longer than a message may wait
    /// claimed: back to the queue until it ends.
    Congested(Duration),
    /// Shutdown came first.
    Shutdown,
}

/// Waits for window room, then asks the gate, and records the send only
/// when both agree. It never holds an admission ticket while waiting for
/// the window: a concurrency gate whose slots were held by waiting messages
/// would read zero budget, and the window would never reopen.
pub(super) async fn release(
    shared: &Shared,
    ready: &Ready,
    shutdown: &CancellationToken,
) -> Release {
    loop {
        if let Some(unreleased) = wait_for_room(shared, ready, shutdown).await {
            return unreleased;
        }
        match admit(shared, ready).await {
            Admission::Continue(ticket) => {
                let now = Instant::now();
                let mut window = shared.window();
                if let Some(send) =
                    shared.record_send(&mut window, now, ready.cost, ready.pace_cost)
                {
                    return Release::Go(ticket, send);
                }
                drop(window);
                // The room went while the gate was asked (a 429, say):
                // give the reservation back and wait again.
                ticket.refund();
            }
            verdict => return Release::NotAdmitted(verdict),
        }
    }
}

/// Parses and validates a delivery. Anything unusable is answered here
/// with a typed result, never dropped.
pub(super) async fn check(
    shared: &Arc<Shared>,
    delivery: Delivery,
    results: &Results,
) -> Option<Ready> {
    let received_at = Instant::now();
    let message = match parse_message(&delivery.body) {
        Ok(message) => message,
        Err(failure) => {
            // No id in the body: the transport's own id for the message
            // (Pub/Sub's message id) keeps equal bodies apart.
            let id = match &delivery.source_id {
                Some(source) if failure.is_anonymous() => source_result_id(source),
                _ => failure.result_id.clone(),
            };
            tracing::info!(id = log_id(&id), reason = failure.reason, "invalid message");
            let result = ResultRecord::error(
                &id,
                failure.token.as_deref(),
                ErrorCode::InvalidRequest,
                &failure.reason,
            );
            settle(shared, results, delivery.tag, result, None).await;
            return None;
        }
    };
    // Only when traces are on: the `traceparent` is read here and nowhere
    // on the hot path otherwise.
    let trace = shared.config.traces.as_ref().map(|traces| {
        let now = std::time::SystemTime::now();
        let received = now.checked_sub(received_at.elapsed()).unwrap_or(now);
        traces.receive(
            &message.request.metadata,
            received,
            vec![
                KeyValue::new(trace_attr::ATTR_QUEUE, shared.queue().name().to_owned()),
                KeyValue::new(trace_attr::ATTR_REQUEST_ID, message.request.id.clone()),
                KeyValue::new(
                    trace_attr::ATTR_RETRY_COUNT,
                    i64::from(delivery.retry_count),
                ),
            ],
        )
    });
    if message.request.deadline <= unix_secs() {
        let attempts = message.previous_attempts(delivery.retry_count);
        let result = deadline_result(&message, attempts);
        settle(shared, results, delivery.tag, result, trace.as_ref()).await;
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
            settle(shared, results, delivery.tag, result, trace.as_ref()).await;
            return None;
        }
    };
    let cost = request_cost(
        shared.settings().unit,
        &message.request.payload,
        message.request.endpoint.as_deref(),
    );
    let pace_cost = shared.settings().pace.map_or(1, |pace| {
        pace.cost(super::cost::prompt_tokens(&message.request.payload))
    });
    Some(Ready {
        delivery,
        message,
        prepared,
        cost,
        pace_cost,
        received_at,
        trace,
    })
}

/// Asks the gate about one message and counts the verdict.
pub(super) async fn admit(shared: &Shared, ready: &Ready) -> Admission {
    let mut labels = shared.config.labels.clone();
    labels.extend(
        ready
            .message
            .internal
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    let span = ready
        .trace
        .as_ref()
        .map(|t| t.start(trace_attr::ADMIT, SpanKind::Internal));
    let verdict = shared
        .config
        .gate
        .admit(
            AdmissionRequest::new(
                &ready.message.request.id,
                &ready.message.request.metadata,
                &labels,
            )
            .with_deadline(ready.message.request.deadline),
        )
        .await;
    shared
        .metrics()
        .decision(verdict.verdict_label(), verdict.reason_label());
    if let Some(mut span) = span {
        let (available, in_flight) = {
            let window = shared.window();
            (window.available(Instant::now()), window.in_flight())
        };
        let m = shared.metrics();
        span.set([
            KeyValue::new(trace_attr::ATTR_VERDICT, verdict.verdict_label()),
            KeyValue::new(trace_attr::ATTR_REASON, verdict.reason_label()),
            KeyValue::new(trace_attr::ATTR_BUDGET, m.budget.get()),
            KeyValue::new(trace_attr::ATTR_BASELINE, m.baseline.get()),
            KeyValue::new(
                trace_attr::ATTR_WINDOW_AVAILABLE,
                i64::try_from(available).unwrap_or(i64::MAX),
            ),
            KeyValue::new(
                trace_attr::ATTR_WINDOW_IN_FLIGHT,
                i64::try_from(in_flight).unwrap_or(i64::MAX),
            ),
        ]);
        span.end();
    }
    verdict
}

/// Waits until the window has room for a request of `cost`. Returns false
/// if shutdown came first.
/// `None` once there is room; otherwise why the message will not wait any
/// longer: shutdown, its deadline, or a congestion hold longer than a
/// message may sit claimed (`max_park`).
pub(super) async fn wait_for_room(
    shared: &Shared,
    ready: &Ready,
    shutdown: &CancellationToken,
) -> Option<Release> {
    let mut asked_at = None;
    loop {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        if shared.may_send(&shared.window(), now, ready.cost).is_some() {
            return None;
        }
        if ready.message.request.deadline <= unix_secs() {
            return Some(Release::DeadlinePassed);
        }
        if let Clearance::Held { until: Some(until) } = shared.config.congestion.clearance(now) {
            let hold = until.saturating_duration_since(now);
            if hold > shared.settings().max_park {
                return Some(Release::Congested(hold));
            }
        }
        ask_for_reading(shared, &mut asked_at);
        let deadline = crate::gateway::deadline_instant(ready.message.request.deadline);
        let wake = deadline.min(now + shared.settings().poll_interval);
        tokio::select! {
            () = shutdown.cancelled() => return Some(Release::Shutdown),
            () = &mut changed => {}
            () = tokio::time::sleep_until(shared.next_look(now).min(wake)) => {}
        }
    }
}

/// Asks the observer for a reading on demand, but only when this
/// dispatcher's own work moved (sent or finished) since the last ask
/// (`asked_at`). With nothing moved, a new reading of a gate that is always
/// fresh (constant, local) opens no room, and asking again each time the
/// reading wakes the caller would spin the caller and the observer against
/// each other for as long as the window stays full (found with `bench
/// hold`: 33 000 readings a second). The poll interval still reads the pool.
fn ask_for_reading(shared: &Shared, asked_at: &mut Option<(u64, u64)>) {
    let progress = shared.window().progress();
    if *asked_at != Some(progress) {
        *asked_at = Some(progress);
        shared.refresh.notify_one();
    }
}

/// Holds a message the gate told to wait, asking again until it is admitted,
/// its park time or deadline ends, or shutdown. Parked messages do not use
/// the window, so a waiting tenant cannot block the others.
pub(super) fn park(
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
            let delay = until_deadline(
                ready.message.request.deadline,
                shared.settings().wait_requeue_delay,
            );
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
            if ready.message.request.deadline <= unix_secs() {
                break Release::DeadlinePassed;
            }
            if Instant::now() >= give_up {
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
            Release::Go(ticket, send) => {
                send_and_settle(shared, ready, ticket, send, shutdown, abandon, results).await;
            }
            unreleased => {
                let mut ready = ready;
                settle_unreleased(&shared, &mut ready, unreleased, &results).await;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::{DEADLINE_SWEEP, DEADLINE_SWEEP_LAG, pull_size, sweep_period, until_next_sweep};

    #[test]
    fn the_next_deadline_sweep_is_at_most_one_period_away_and_starts_a_new_period() {
        let before = sweep_period();
        let wait = until_next_sweep();
        assert!(wait > std::time::Duration::ZERO, "{wait:?}");
        assert!(wait <= DEADLINE_SWEEP, "{wait:?}");
        // Periods start at whole and half seconds (plus the lag): two per
        // second, so a whole-second deadline is swept right after it.
        assert_eq!(1000 / DEADLINE_SWEEP.as_millis(), 2);
        assert!(DEADLINE_SWEEP_LAG < DEADLINE_SWEEP / 10);
        std::thread::sleep(wait + std::time::Duration::from_millis(1));
        assert!(sweep_period() > before);
    }

    #[test]
    fn a_shut_window_leases_nothing_however_empty_the_buffer() {
        assert_eq!(pull_size(0, false, 0, 64, 256), 0);
        assert_eq!(pull_size(0, false, 10, 64, 256), 0);
        assert_eq!(
            pull_size(5, false, 0, 64, 256),
            0,
            "room while the window is not open"
        );
    }

    #[test]
    fn a_full_open_window_keeps_its_lookahead() {
        assert_eq!(pull_size(0, true, 0, 64, 256), 64);
        assert_eq!(pull_size(0, true, 32, 64, 256), 32);
        assert_eq!(pull_size(0, true, 40, 64, 256), 0);
        assert_eq!(pull_size(0, true, 0, 0, 256), 0, "no lookahead, no room");
    }

    #[test]
    fn room_beyond_the_buffer_fills_room_and_lookahead_within_one_batch() {
        assert_eq!(pull_size(8, true, 0, 64, 256), 72);
        assert_eq!(pull_size(512, true, 0, 64, 256), 256);
        assert_eq!(pull_size(512, true, 256, 64, 256), 256);
        assert_eq!(
            pull_size(8, true, 4, 0, 256),
            4,
            "no lookahead: just the room"
        );
    }

    #[test]
    fn a_nearly_full_lookahead_waits_until_half_of_it_has_gone() {
        // One send at a time with the buffer full: no receive per send.
        for buffered in 41..=72 {
            assert_eq!(pull_size(8, true, buffered, 64, 256), 0, "{buffered}");
        }
        // Fallen by half: one batch tops it up.
        assert_eq!(pull_size(8, true, 40, 64, 256), 32);
        assert_eq!(pull_size(1, true, 30, 64, 256), 35);
    }

    #[test]
    fn pulls_never_exceed_room_plus_lookahead() {
        for room in 0..20 {
            for buffered in 0..100 {
                let want = pull_size(room, true, buffered, 16, 256);
                assert!(
                    buffered + want <= (room + 16).max(buffered),
                    "{room} {buffered} {want}"
                );
            }
        }
    }
}
