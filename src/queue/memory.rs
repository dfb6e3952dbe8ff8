//! In-memory queue: the reference implementation of the [`Queue`]
//! contract, with real leases and redelivery. Used by tests and examples;
//! it keeps nothing across restarts.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{AckReport, Completion, Delivery, DeliveryTag, NackReason, Queue, QueueError};
use crate::request::parse_message;
use crate::result::ResultRecord;

/// Queue order: deadline, then enqueue sequence (FIFO among equals).
type OrderKey = (i64, u64);

#[derive(Debug, Clone)]
struct Item {
    body: Bytes,
    retry_count: u32,
    visible_at: Instant,
}

#[derive(Debug)]
struct Leased {
    key: OrderKey,
    item: Item,
    expires: Instant,
}

/// A message that used up its attempts, with its last error.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The original message bytes.
    pub body: Bytes,
    /// The last error seen.
    pub last_error: ResultRecord,
}

#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    next_tag: u64,
    pending: BTreeMap<OrderKey, Item>,
    leased: HashMap<DeliveryTag, Leased>,
    results: Vec<ResultRecord>,
    answered: HashSet<(String, Option<String>)>,
    dead: Vec<DeadLetter>,
}

/// A queue in process memory.
#[derive(Debug)]
pub struct MemoryQueue {
    name: String,
    state: Mutex<State>,
    arrived: Notify,
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            state: Mutex::new(State::default()),
            arrived: Notify::new(),
        }
    }

    /// Enqueues raw message bytes ordered by `deadline` (Unix seconds).
    pub fn push(&self, body: impl Into<Bytes>, deadline: i64) {
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        state.pending.insert(
            (deadline, seq),
            Item {
                body: body.into(),
                retry_count: 0,
                visible_at: Instant::now(),
            },
        );
        drop(state);
        self.arrived.notify_waiters();
    }

    /// Enqueues a message, reading its deadline from the bytes (unparsable
    /// messages go first, deadline 0, so they are answered promptly).
    pub fn push_message(&self, body: impl Into<Bytes>) {
        let body = body.into();
        let deadline = parse_message(&body).map_or(0, |m| m.request.deadline);
        self.push(body, deadline);
    }

    /// Results written so far, in write order.
    pub fn results(&self) -> Vec<ResultRecord> {
        self.lock().results.clone()
    }

    /// How many results were written (cheaper than [`Self::results`]).
    pub fn result_count(&self) -> usize {
        self.lock().results.len()
    }

    /// Dead letters so far.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        self.lock().dead.clone()
    }

    /// Messages waiting (visible or delayed).
    pub fn pending_len(&self) -> usize {
        self.lock().pending.len()
    }

    /// The bytes of every message not yet settled (waiting or leased), in
    /// queue order: what a process using this queue must hand on at exit,
    /// since memory keeps nothing.
    pub fn unsettled(&self) -> Vec<Bytes> {
        let state = self.lock();
        let mut keyed: Vec<(OrderKey, Bytes)> = state
            .pending
            .iter()
            .map(|(k, i)| (*k, i.body.clone()))
            .chain(state.leased.values().map(|l| (l.key, l.item.body.clone())))
            .collect();
        keyed.sort_by_key(|(k, _)| *k);
        keyed.into_iter().map(|(_, b)| b).collect()
    }

    /// Messages currently leased.
    pub fn leased_len(&self) -> usize {
        self.lock().leased.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock would be a bug in this file; the
        // state stays consistent between statements, so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases up to `max` visible messages (with `expired_by`, only those
    /// whose deadline is at or before it, visible or not); returns the
    /// earliest instant a delayed message becomes visible, for the caller
    /// to wait on.
    fn take(
        &self,
        max: usize,
        lease: Duration,
        expired_by: Option<i64>,
    ) -> (Vec<Delivery>, Option<Instant>) {
        let now = Instant::now();
        let mut state = self.lock();
        // Expired leases go back in their original order.
        let expired: Vec<DeliveryTag> = state
            .leased
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(t, _)| t.clone())
            .collect();
        for tag in expired {
            if let Some(l) = state.leased.remove(&tag) {
                state.pending.insert(l.key, l.item);
            }
        }
        let mut chosen = Vec::new();
        let mut next_visible: Option<Instant> = None;
        for (key, item) in &state.pending {
            if chosen.len() >= max {
                break;
            }
            if let Some(by) = expired_by {
                // Ordered by deadline: nothing further has expired.
                if key.0 > by {
                    break;
                }
                chosen.push(*key);
            } else if item.visible_at <= now {
                chosen.push(*key);
            } else {
                next_visible =
                    Some(next_visible.map_or(item.visible_at, |n| n.min(item.visible_at)));
            }
        }
        let mut deliveries = Vec::with_capacity(chosen.len());
        for key in chosen {
            let Some(item) = state.pending.remove(&key) else {
                continue;
            };
            let tag = DeliveryTag(format!("{}#{}", key.1, state.next_tag));
            state.next_tag += 1;
            deliveries.push(Delivery {
                tag: tag.clone(),
                body: item.body.clone(),
                retry_count: item.retry_count,
                source_id: None,
            });
            state.leased.insert(
                tag,
                Leased {
                    key,
                    item,
                    expires: now + lease,
                },
            );
        }
        let earliest_lease = state.leased.values().map(|l| l.expires).min();
        let wake = match (next_visible, earliest_lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        (deliveries, wake)
    }
}

impl Queue for MemoryQueue {
    fn name(&self) -> &str {
        &self.name
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(async move {
            let give_up = Instant::now() + wait;
            loop {
                // Register interest before looking, so a push between the
                // look and the wait is not missed.
                let arrived = self.arrived.notified();
                let (deliveries, wake) = self.take(max.max(1), lease, None);
                if !deliveries.is_empty() || Instant::now() >= give_up {
                    return Ok(deliveries);
                }
                let until = wake.map_or(give_up, |w| w.min(give_up));
                tokio::select! {
                    () = arrived => {}
                    () = tokio::time::sleep_until(until) => {}
                }
            }
        })
    }

    fn receive_expired(
        &self,
        max: usize,
        lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        let (deliveries, _) = self.take(max, lease, Some(now_unix));
        Box::pin(std::future::ready(Ok(deliveries)))
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        let mut report = AckReport::default();
        let mut state = self.lock();
        for Completion { tag, result } in completions {
            if state.leased.remove(&tag).is_none() {
                report.lease_lost += 1;
                continue;
            }
            let key = (result.id.clone(), result.request_token.clone());
            if state.answered.insert(key) {
                state.results.push(result);
                report.acked += 1;
            } else {
                report.duplicates += 1;
            }
        }
        Box::pin(std::future::ready(Ok(report)))
    }

    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        let mut state = self.lock();
        if let Some(mut leased) = state.leased.remove(&tag) {
            if reason.counts_as_failure() {
                leased.item.retry_count += 1;
            }
            leased.item.visible_at = Instant::now() + delay;
            state.pending.insert(leased.key, leased.item);
        }
        drop(state);
        self.arrived.notify_waiters();
        Box::pin(std::future::ready(Ok(())))
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        let expires = Instant::now() + lease;
        let mut state = self.lock();
        for tag in tags {
            if let Some(leased) = state.leased.get_mut(&tag) {
                leased.expires = expires;
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        let mut state = self.lock();
        if let Some(leased) = state.leased.remove(&tag) {
            state.dead.push(DeadLetter {
                body: leased.item.body,
                last_error,
            });
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        let n = self.lock().pending.len() as u64;
        Box::pin(std::future::ready(Ok(Some(n))))
    }

    fn outstanding(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        let state = self.lock();
        let n = (state.pending.len() + state.leased.len()) as u64;
        drop(state);
        Box::pin(std::future::ready(Ok(Some(n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::ErrorCode;

    const LEASE: Duration = Duration::from_secs(30);
    const NO_WAIT: Duration = Duration::ZERO;

    fn ok(id: &str) -> ResultRecord {
        ResultRecord::http(id, None, 200, "{}".into(), 1)
    }

    #[tokio::test(start_paused = true)]
    async fn delivers_earliest_deadline_first_then_fifo() {
        let q = MemoryQueue::new("q");
        q.push("late", 300);
        q.push("early-a", 100);
        q.push("early-b", 100);
        let got = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
        let bodies: Vec<&[u8]> = got.iter().map(|d| d.body.as_ref()).collect();
        assert_eq!(bodies, vec![&b"early-a"[..], b"early-b", b"late"]);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_lease_is_redelivered_and_stale_ack_is_refused() {
        let q = MemoryQueue::new("q");
        q.push("m", 1);
        let first = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(first.len(), 1);
        assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
        tokio::time::advance(LEASE + Duration::from_secs(1)).await;
        let second = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(second.len(), 1);
        assert_ne!(first[0].tag, second[0].tag);
        // The first holder lost its lease: its ack writes nothing.
        let stale = q
            .ack(vec![Completion {
                tag: first[0].tag.clone(),
                result: ok("m"),
            }])
            .await
            .expect("ok");
        assert_eq!(stale.lease_lost, 1);
        assert!(q.results().is_empty());
        let fresh = q
            .ack(vec![Completion {
                tag: second[0].tag.clone(),
                result: ok("m"),
            }])
            .await
            .expect("ok");
        assert_eq!(fresh.acked, 1);
        assert_eq!(q.results().len(), 1);
        assert_eq!(q.pending_len() + q.leased_len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn extended_lease_is_not_redelivered() {
        let q = MemoryQueue::new("q");
        q.push("m", 1);
        let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        tokio::time::advance(LEASE / 2).await;
        q.extend_lease(vec![d[0].tag.clone()], LEASE)
            .await
            .expect("ok");
        tokio::time::advance(LEASE / 2 + Duration::from_secs(1)).await;
        assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn second_result_for_same_submission_is_dropped() {
        let q = MemoryQueue::new("q");
        q.push("a", 1);
        q.push("b", 1);
        let d = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
        let report = q
            .ack(
                d.iter()
                    .map(|d| Completion {
                        tag: d.tag.clone(),
                        result: ok("same"),
                    })
                    .collect(),
            )
            .await
            .expect("ok");
        assert_eq!((report.acked, report.duplicates), (1, 1));
        assert_eq!(q.results().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn nack_delays_and_counts_only_failures() {
        let q = MemoryQueue::new("q");
        q.push("m", 1);
        let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        q.nack(d[0].tag.clone(), Duration::from_secs(5), NackReason::Failed)
            .await
            .expect("ok");
        assert!(q.receive(1, LEASE, NO_WAIT).await.expect("ok").is_empty());
        // A waiting receive wakes when the delay ends.
        let d = q
            .receive(1, LEASE, Duration::from_secs(10))
            .await
            .expect("ok");
        assert_eq!(d[0].retry_count, 1);
        q.nack(d[0].tag.clone(), Duration::ZERO, NackReason::Congested)
            .await
            .expect("ok");
        let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(d[0].retry_count, 1);
        q.dead_letter(
            d[0].tag.clone(),
            ResultRecord::error("m", None, ErrorCode::InferenceError, "boom"),
        )
        .await
        .expect("ok");
        assert_eq!(q.dead_letters().len(), 1);
        assert_eq!(q.pending_len() + q.leased_len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_receive_wakes_on_push() {
        let q = std::sync::Arc::new(MemoryQueue::new("q"));
        let producer = q.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            producer.push("m", 1);
        });
        let d = q
            .receive(1, LEASE, Duration::from_secs(60))
            .await
            .expect("ok");
        assert_eq!(d.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_receive_takes_only_passed_deadlines_delayed_or_not() {
        let q = MemoryQueue::new("q");
        q.push("expired-delayed", 100);
        q.push("expired-leased", 150);
        q.push("expired-visible", 190);
        q.push("due-later", 300);
        let first = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
        // Back with a long delay: still due for its deadline answer.
        q.nack(
            first[0].tag.clone(),
            Duration::from_secs(3600),
            NackReason::Congested,
        )
        .await
        .expect("ok");
        let got = q.receive_expired(10, LEASE, 200).await.expect("ok");
        let bodies: Vec<&[u8]> = got.iter().map(|d| d.body.as_ref()).collect();
        assert_eq!(bodies, [&b"expired-delayed"[..], b"expired-visible"]);
        assert!(
            q.receive_expired(10, LEASE, 200)
                .await
                .expect("ok")
                .is_empty()
        );
        assert_eq!(q.pending_len(), 1, "the unexpired one stays");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_keeps_its_deadline_place() {
        let q = MemoryQueue::new("q");
        q.push("due-first", 100);
        let d = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        q.push("due-later", 200);
        q.nack(d[0].tag.clone(), Duration::ZERO, NackReason::Failed)
            .await
            .expect("ok");
        let next = q.receive(1, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(next[0].body.as_ref(), b"due-first");
    }
}
