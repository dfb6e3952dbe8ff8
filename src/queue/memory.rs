//! In-memory queue: the reference implementation of the [`Queue`]
//! contract, with real leases and redelivery. Used by tests and examples;
//! it keeps nothing across restarts.
//!
//! With tenant lanes (a dispatcher with a fairness attribute, issue 22)
//! every waiting message is also indexed under its tenant, and a receive
//! takes the heads of all lanes round robin, a tenant's weight in messages
//! per round, as the embedded and Redis lanes do: a small tenant behind
//! another's deep backlog is received from the start. Messages without
//! the attribute share the lane `""`. There is no producer outside this
//! process, so unlike Redis no message sits outside a lane.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::client::{
    CancelOutcome, Client, ClientError, Cursor, Description, Mark, Outgoing, ReadResult, ResultPage,
};
use super::due::DueProfile;
use super::lanes::{TenantLanes, interleave, tenant_of};
use super::{
    AckReport, Completion, Delivery, DeliveryTag, Look, NackReason, Queue, QueueError, long_poll,
};
use crate::request::parse_message;
use crate::result::ResultRecord;

/// Queue order: deadline, then enqueue sequence (FIFO among equals).
type OrderKey = (i64, u64);

#[derive(Debug, Clone)]
struct Item {
    body: Bytes,
    retry_count: u32,
    visible_at: Instant,
    /// Its lane (`""` without lanes or without the attribute).
    tenant: String,
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
    /// Every waiting message; only [`State::wait`] and [`State::unwait`]
    /// change it, so the lanes stay in step.
    pending: BTreeMap<OrderKey, Item>,
    /// Whether waiting messages are filed in `lanes`.
    laned: bool,
    /// With lanes: each tenant's waiting messages, in queue order (a
    /// tenant leaves when it has none).
    lanes: BTreeMap<String, BTreeSet<OrderKey>>,
    leased: HashMap<DeliveryTag, Leased>,
    results: Vec<ResultRecord>,
    answered: HashSet<(String, Option<String>)>,
    dead: Vec<DeadLetter>,
}

impl State {
    /// Puts a message among the waiting (and in its lane).
    fn wait(&mut self, key: OrderKey, item: Item) {
        if self.laned {
            self.lanes
                .entry(item.tenant.clone())
                .or_default()
                .insert(key);
        }
        self.pending.insert(key, item);
    }

    /// Takes a message from the waiting (and from its lane).
    fn unwait(&mut self, key: &OrderKey) -> Option<Item> {
        let item = self.pending.remove(key)?;
        if let Some(lane) = self.lanes.get_mut(&item.tenant) {
            lane.remove(key);
            if lane.is_empty() {
                self.lanes.remove(&item.tenant);
            }
        }
        Some(item)
    }

    /// Up to `max` visible waiting messages, in queue order; with `lanes`,
    /// the heads of every lane round robin by weight. Also the earliest
    /// instant a delayed message it passed becomes visible (every delayed
    /// one when it found nothing).
    fn visible(
        &self,
        max: usize,
        now: Instant,
        lanes: Option<&TenantLanes>,
    ) -> (Vec<OrderKey>, Option<Instant>) {
        let mut next_visible: Option<Instant> = None;
        let mut heads = |keys: &mut dyn Iterator<Item = &OrderKey>, n: usize| {
            let mut chosen = Vec::new();
            for key in keys {
                if chosen.len() >= n {
                    break;
                }
                let at = self.pending[key].visible_at;
                if at <= now {
                    chosen.push(*key);
                } else {
                    next_visible = Some(next_visible.map_or(at, |v| v.min(at)));
                }
            }
            chosen
        };
        let chosen = match lanes {
            None => heads(&mut self.pending.keys(), max),
            Some(lanes) => {
                let sources = (self.lanes.iter())
                    .map(|(tenant, keys)| {
                        let weight = lanes.weight(tenant);
                        let n = max.saturating_mul(weight as usize);
                        (weight, heads(&mut keys.iter(), n))
                    })
                    .collect();
                interleave(sources, max, |key| *key)
            }
        };
        (chosen, next_visible)
    }
}

/// A queue in process memory.
#[derive(Debug)]
pub struct MemoryQueue {
    name: String,
    lanes: Option<TenantLanes>,
    state: Mutex<State>,
    arrived: Notify,
}

impl MemoryQueue {
    /// An empty queue without tenant lanes (queue order only).
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_lanes(name, None)
    }

    /// An empty queue; with `lanes`, receives take the heads of the
    /// tenants' lanes round robin by weight (see the module docs).
    pub fn with_lanes(name: impl Into<String>, lanes: Option<TenantLanes>) -> Self {
        Self {
            name: name.into(),
            state: Mutex::new(State {
                laned: lanes.is_some(),
                ..State::default()
            }),
            lanes,
            arrived: Notify::new(),
        }
    }

    /// Enqueues raw message bytes ordered by `deadline` (Unix seconds).
    pub fn push(&self, body: impl Into<Bytes>, deadline: i64) {
        let body = body.into();
        let tenant =
            (self.lanes.as_ref()).map_or_else(String::new, |l| tenant_of(&body, &l.attribute));
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        state.wait(
            (deadline, seq),
            Item {
                body,
                retry_count: 0,
                visible_at: Instant::now(),
                tenant,
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

    /// Leases up to `max` visible messages (with lanes, the heads of every
    /// lane round robin by weight; with `expired_by`, only those whose
    /// deadline is at or before it, visible or not, whatever tenant);
    /// returns the earliest instant a delayed message becomes visible, for
    /// the caller to wait on.
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
                state.wait(l.key, l.item);
            }
        }
        let (chosen, next_visible) = match expired_by {
            // Ordered by deadline: nothing further has expired.
            Some(by) => (
                (state.pending.keys())
                    .take_while(|key| key.0 <= by)
                    .take(max)
                    .copied()
                    .collect(),
                None,
            ),
            None => state.visible(max, now, self.lanes.as_ref()),
        };
        let mut deliveries = Vec::with_capacity(chosen.len());
        for key in chosen {
            let Some(item) = state.unwait(&key) else {
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
        Box::pin(long_poll(wait, Some(&self.arrived), move || {
            // Woken by a push, or when the next delayed message is due.
            let (got, again_at) = self.take(max.max(1), lease, None);
            std::future::ready(Ok(Look { got, again_at }))
        }))
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
            state.wait(leased.key, leased.item);
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

    fn due(&self) -> BoxFuture<'_, Result<Option<DueProfile>, QueueError>> {
        let now = crate::clock::unix_secs();
        let profile = DueProfile::of(
            now,
            self.lock().pending.keys().map(|(deadline, _)| *deadline),
        );
        Box::pin(std::future::ready(Ok(Some(profile))))
    }

    fn outstanding(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        let state = self.lock();
        let n = (state.pending.len() + state.leased.len()) as u64;
        drop(state);
        Box::pin(std::future::ready(Ok(Some(n))))
    }
}

/// The memory queue's client face: requests pushed in order, results read
/// by their write position (1 for the first). There is no producer
/// outside this process, so no cancel and no marks.
impl Client for MemoryQueue {
    fn describe(&self) -> Description {
        let place = format!("`{}`", self.name);
        Description {
            results: place.clone(),
            place,
            items: "requests",
            active: "waiting in this queue",
        }
    }

    fn transport(&self) -> &'static str {
        "memory"
    }

    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>> {
        if let Err(e) = self.refuse_mark(mark.as_ref()) {
            return Box::pin(std::future::ready(Err(e)));
        }
        let n = requests.len() as u64;
        for request in requests {
            self.push(request.body, request.deadline);
        }
        Box::pin(std::future::ready(Ok(n)))
    }

    fn cancel(&self, _ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(std::future::ready(Err(self.unsupported("cancel requests"))))
    }

    fn results(
        &self,
        cursor: Cursor,
        max: usize,
    ) -> BoxFuture<'_, Result<ResultPage, ClientError>> {
        let state = self.lock();
        let from = usize::try_from(cursor.0)
            .unwrap_or(0)
            .min(state.results.len());
        let page: Vec<ReadResult> = (state.results[from..].iter().take(max))
            // A result is plain strings and numbers: serialising cannot fail.
            .map(|r| ReadResult::kept(serde_json::to_string(r).unwrap_or_default()))
            .collect();
        let cursor = Cursor(i64::try_from(from + page.len()).unwrap_or(i64::MAX));
        Box::pin(std::future::ready(Ok(ResultPage {
            results: page,
            cursor,
        })))
    }

    fn active(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>> {
        let waiting: HashSet<String> = (self.unsettled().iter())
            .filter_map(|b| parse_message(b).ok().map(|m| m.request.id))
            .collect();
        let active = ids.into_iter().filter(|id| waiting.contains(id)).collect();
        Box::pin(std::future::ready(Ok(Some(active))))
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

    fn tenant(id: &str, tenant: Option<&str>) -> String {
        let metadata = tenant.map_or(serde_json::json!({}), |t| serde_json::json!({"userid": t}));
        serde_json::json!({"id": id, "metadata": metadata}).to_string()
    }

    fn ids(deliveries: &[Delivery]) -> Vec<String> {
        deliveries
            .iter()
            .map(|d| {
                let v: serde_json::Value = serde_json::from_slice(&d.body).expect("json");
                v["id"].as_str().expect("id").to_owned()
            })
            .collect()
    }

    fn laned(weights: &[(&str, u32)]) -> MemoryQueue {
        MemoryQueue::with_lanes(
            "q",
            Some(TenantLanes {
                attribute: "userid".into(),
                weights: weights.iter().map(|(t, w)| ((*t).to_owned(), *w)).collect(),
            }),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn lanes_take_every_tenants_head_round_robin_by_weight() {
        let q = laned(&[("big", 2)]);
        for i in 0..10 {
            q.push(tenant(&format!("b{i}"), Some("big")), i);
        }
        for i in 0..3 {
            q.push(tenant(&format!("s{i}"), Some("small")), 100 + i);
        }
        // Messages without the attribute share the lane "".
        q.push(tenant("a0", None), 50);
        q.push(tenant("a1", None), 51);
        let got = q.receive(8, LEASE, NO_WAIT).await.expect("ok");
        // Lanes in tenant order: "" (1 per round), big (2), small (1).
        assert_eq!(ids(&got), ["a0", "b0", "b1", "s0", "a1", "b2", "b3", "s1"]);
        // Without lanes the same queue is served by deadline alone.
        let plain = MemoryQueue::new("q");
        for i in 0..10 {
            plain.push(tenant(&format!("b{i}"), Some("big")), i);
        }
        plain.push(tenant("s0", Some("small")), 100);
        let got = plain.receive(8, LEASE, NO_WAIT).await.expect("ok");
        assert!(ids(&got).iter().all(|id| id.starts_with('b')));
    }

    #[tokio::test(start_paused = true)]
    async fn messages_back_from_a_lease_are_back_in_their_lane() {
        let q = laned(&[]);
        for i in 0..4 {
            q.push(tenant(&format!("b{i}"), Some("big")), i);
        }
        q.push(tenant("s0", Some("small")), 100);
        let first = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(ids(&first), ["b0", "s0"]);
        // Handed back with a delay: not visible until it ends, then in
        // its lane again, at its place.
        q.nack(
            first[1].tag.clone(),
            Duration::from_secs(5),
            NackReason::Failed,
        )
        .await
        .expect("ok");
        assert_eq!(
            ids(&q.receive(1, LEASE, NO_WAIT).await.expect("ok")),
            ["b1"]
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        let again = q.receive(2, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(ids(&again), ["b2", "s0"]);
        assert_eq!(again[1].retry_count, 1);
        // A lapsed lease comes back into its lane too.
        tokio::time::advance(LEASE + Duration::from_secs(1)).await;
        let after = q.receive(10, LEASE, NO_WAIT).await.expect("ok");
        assert_eq!(ids(&after), ["b0", "s0", "b1", "b2", "b3"]);
        assert!(q.lock().lanes.is_empty(), "no lane outlives its messages");
    }

    #[tokio::test(start_paused = true)]
    async fn the_expired_sweep_takes_passed_deadlines_whatever_the_lane() {
        let q = laned(&[]);
        q.push(tenant("b0", Some("big")), 100);
        q.push(tenant("b1", Some("big")), 110);
        q.push(tenant("s0", Some("small")), 300);
        let got = q.receive_expired(10, LEASE, 200).await.expect("ok");
        assert_eq!(ids(&got), ["b0", "b1"]);
        assert_eq!(
            ids(&q.receive(10, LEASE, NO_WAIT).await.expect("ok")),
            ["s0"]
        );
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
