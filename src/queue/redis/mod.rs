//! Redis sorted-set transport, wire-compatible with llm-d-async's
//! `redis-sortedset` (docs/transports.md), with durable claims and
//! exactly-once results. Keys, guarantees and differences from upstream:
//! `docs/transports.md`.
//!
//! - `receive` claims a batch atomically (one Lua call): pending → claimed,
//!   with owner and lease expiry, then drops cancelled messages with a
//!   `CANCELLED` result.
//! - `ack` pushes every result and drops its claim in one Lua call, fenced
//!   by owner: a delivery whose lease was lost writes nothing.
//! - A background task per queue returns expired claims to pending with
//!   their original score, moves due retries back to their origin queue at
//!   their deadline score, and watches reachability for readiness.

mod client;
mod idempotent;
mod producer;
mod scripts;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde::Deserialize;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{
    AckReport, Completion, Delivery, DeliveryTag, Look, NackReason, Queue, QueueError,
    TransportStatus, long_poll,
};
use crate::request::{AttemptRecord, parse_message};
use crate::result::{ErrorCode, ResultRecord};
use crate::tasks::Tasks;

use super::due::{DueProfile, HORIZONS};
use crate::redis::{RedisConnection, hash_tag};
pub use client::RedisClient;
pub use producer::{CancelOutcome, Mark, Submission, cancel, enqueue, enqueue_marked, queue_score};

/// Upstream's retry set, shared by every queue.
pub const RETRY_SET: &str = "retry-sortedset";
/// Upstream's default result list.
pub const DEFAULT_RESULT_LIST: &str = "result-list";
/// How long a cancel marker lives (upstream: 7 days).
pub const CANCEL_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Most expired claims returned, or due retries moved, per pass.
const HOUSEKEEPING_BATCH: usize = 1000;
/// How often housekeeping (reclaim, retry mover, reachability) runs.
const HOUSEKEEPING_EVERY: Duration = Duration::from_millis(250);
/// Pause between claim attempts while the queue is empty.
const EMPTY_POLL: Duration = Duration::from_millis(20);
/// Length of an owner token in hex characters (prefix of every tag).
const OWNER_LEN: usize = 16;

/// The Redis keys of one queue (upstream layout, standalone mode).
#[derive(Debug, Clone)]
pub struct Keys {
    /// Pending ZSET, scored by deadline plus the FIFO fraction.
    pub pending: String,
    /// HASH claim key → member.
    pub claimed: String,
    /// HASH claim key → owner token.
    pub owners: String,
    /// ZSET claim key → lease expiry (Unix s).
    pub idx: String,
    /// HASH claim key → original queue score (sluicegate addition).
    pub scores: String,
    /// LIST of dead letters (sluicegate addition).
    pub dead: String,
    /// ZSET of delayed retries: upstream's shared `retry-sortedset`, or on
    /// a cluster the queue's own `{queue}:retry-sortedset`, since a script
    /// moving a retry must find its origin queue in the same slot.
    pub retry: String,
    /// SET of the tenants with a lane (sluicegate addition, used when the
    /// dispatcher has a fairness attribute).
    pub lanes: String,
    /// Prefix of a tenant's lane: a ZSET beside pending holding the same
    /// members and scores as pending, for that tenant only, so its head
    /// is found however deep it sits in pending.
    pub lane_prefix: String,
    /// STRING: where the claims' filing of members written without a
    /// lane (a plain `ZADD`) goes on in pending (a `ZSCAN` cursor;
    /// sluicegate addition, see `scripts::CLAIM`).
    pub lane_cursor: String,
    /// HASH claim key → how often the message's lease expired on a holder
    /// (sluicegate addition: each reclaim counts as an attempt).
    pub reclaims: String,
}

impl Keys {
    /// Adds the keys of the claim state (claimed, owners, idx, scores),
    /// which every script that claims, settles or reclaims takes together
    /// and in this order.
    fn claim_state<'i, 's>(
        &self,
        invocation: &'i mut redis::ScriptInvocation<'s>,
    ) -> &'i mut redis::ScriptInvocation<'s> {
        invocation
            .key(&self.claimed)
            .key(&self.owners)
            .key(&self.idx)
            .key(&self.scores)
    }

    /// The keys of queue `name`. With `cluster`, bookkeeping keys carry the
    /// `{name}` hash tag so they share the pending key's slot.
    pub fn new(name: &str, cluster: bool) -> Self {
        let base = if cluster && hash_tag(name).is_none() {
            format!("{{{name}}}")
        } else {
            name.to_owned()
        };
        Self {
            pending: name.to_owned(),
            claimed: format!("{base}:claimed"),
            owners: format!("{base}:claim-owners"),
            idx: format!("{base}:claims-idx"),
            scores: format!("{base}:claim-scores"),
            dead: format!("{base}:dead-letters"),
            retry: if cluster {
                format!("{base}:{RETRY_SET}")
            } else {
                RETRY_SET.to_owned()
            },
            lanes: format!("{base}:tenant-lanes"),
            lane_prefix: format!("{base}:tenant-lane:"),
            lane_cursor: format!("{base}:tenant-index"),
            reclaims: format!("{base}:claim-reclaims"),
        }
    }

    /// The lane of `tenant` (`""`: messages without the attribute).
    pub fn lane(&self, tenant: &str) -> String {
        format!("{}{tenant}", self.lane_prefix)
    }
}

/// Settings of one Redis queue.
#[derive(Debug, Clone)]
pub struct RedisQueueSettings {
    /// Queue name (the pending key).
    pub name: String,
    /// Result list set on the queue itself; wins over the message's.
    pub result_list: Option<String>,
    /// Result list when neither queue nor message names one.
    pub default_result_list: String,
    /// TTL applied to the result list after each push (0 = none), unless
    /// the message asks for its own.
    pub result_ttl_seconds: u64,
    /// Use Redis Cluster hash tags for bookkeeping keys.
    pub cluster: bool,
    /// The `[gateway] fairness_attribute`: when set, claims take the head of
    /// every tenant lane (`Keys::lanes`) and messages returned to pending
    /// are filed into their lane (docs/transports.md).
    pub fairness_attribute: Option<String>,
    /// `dispatch.tenant_weights`: a claim takes this many members of a
    /// tenant's lane per round (1 when not named).
    pub tenant_weights: std::collections::BTreeMap<String, u32>,
}

impl RedisQueueSettings {
    /// Defaults for queue `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            result_list: None,
            default_result_list: DEFAULT_RESULT_LIST.to_owned(),
            result_ttl_seconds: 0,
            cluster: false,
            fairness_attribute: None,
            tenant_weights: std::collections::BTreeMap::new(),
        }
    }
}

/// What this process holds for one delivery.
#[derive(Debug, Clone)]
struct Held {
    claim_key: String,
    owner: String,
    member: Bytes,
    score: f64,
    result_list: Option<String>,
    result_ttl: Option<u64>,
    /// Leases of this message that expired on earlier holders
    /// (`Keys::reclaims`), counted in its retry count.
    reclaims: u32,
}

/// Counters shared with the housekeeping task.
#[derive(Debug, Default)]
struct Stats {
    reachable: AtomicBool,
    claims_held: AtomicU64,
    backlog: AtomicU64,
    reclaims: AtomicU64,
    dead_letters: AtomicU64,
    cancelled: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    settings: RedisQueueSettings,
    keys: Keys,
    conn: RedisConnection,
    held: Mutex<HashMap<String, Held>>,
    stats: Stats,
}

/// A queue in Redis. Cloning shares the connection and bookkeeping.
#[derive(Debug)]
pub struct RedisQueue {
    inner: Arc<Inner>,
    _housekeeping: DropGuard,
}

impl RedisQueue {
    /// A queue on `conn`; starts its housekeeping (reclaimer of expired
    /// claims, mover of due retries) on `tasks`, so a panic there fails the
    /// run instead of silently stopping reclaims; it stops with the tree or
    /// when the queue is dropped. Does not wait for Redis: while it is
    /// unreachable, operations fail with [`QueueError::Redis`] and
    /// [`Queue::status`] says so.
    pub fn start(conn: RedisConnection, settings: RedisQueueSettings, tasks: &Tasks) -> Self {
        let keys = Keys::new(&settings.name, settings.cluster);
        let inner = Arc::new(Inner {
            settings,
            keys,
            conn,
            held: Mutex::new(HashMap::new()),
            stats: Stats::default(),
        });
        let stop = tasks.root_token().child_token();
        tasks.spawn(
            format!("queue `{}`: redis housekeeping", inner.settings.name),
            housekeeping(inner.clone(), stop.clone()),
        );
        if !inner.lane_attribute().is_empty() {
            tasks.spawn(
                format!("queue `{}`: redis lane filer", inner.settings.name),
                lane_filer(inner.clone(), stop.clone()),
            );
        }
        Self {
            inner,
            _housekeeping: stop.drop_guard(),
        }
    }

    /// The queue's keys.
    pub fn keys(&self) -> &Keys {
        &self.inner.keys
    }

    /// Messages cancelled at claim so far.
    pub fn cancelled_total(&self) -> u64 {
        self.inner.stats.cancelled.load(Ordering::Relaxed)
    }

    /// Whether the last round trip reached Redis.
    pub fn is_reachable(&self) -> bool {
        self.inner.stats.reachable.load(Ordering::Relaxed)
    }
}

fn random_hex() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The envelope fields the transport needs, read without building the
/// whole message.
#[derive(Debug, Default, Deserialize)]
struct Peek {
    #[serde(default)]
    internal: Option<PeekInternal>,
    /// The request of an envelope.
    #[serde(default)]
    data: Option<PeekData>,
    /// `result_queue_name` of a bare request (no envelope).
    #[serde(default)]
    result_queue_name: Option<String>,
}

/// The request fields the transport needs.
#[derive(Debug, Default, Deserialize)]
struct PeekData {
    #[serde(default)]
    result_queue_name: Option<String>,
}

impl Peek {
    /// The message's own result list: the envelope's
    /// `internal.result_queue_name`, else the request's
    /// `result_queue_name` (upstream producers write either). The queue's
    /// own setting wins over both (see [`Inner::result_list`]).
    fn result_list(&self) -> Option<String> {
        let internal = self
            .internal
            .as_ref()
            .and_then(|i| i.result_queue_name.clone());
        let request = match &self.data {
            Some(data) => data.result_queue_name.clone(),
            None => self.result_queue_name.clone(),
        };
        [internal, request]
            .into_iter()
            .flatten()
            .find(|l| !l.is_empty())
    }
}

#[derive(Debug, Default, Deserialize)]
struct PeekInternal {
    #[serde(default)]
    retry_count: Option<u32>,
    #[serde(default)]
    result_queue_name: Option<String>,
    #[serde(default)]
    result_ttl_seconds: Option<u64>,
}

/// Splits a claim key into id and token (`None` for undecodable messages).
fn split_claim_key(key: &str) -> Option<(&str, Option<&str>)> {
    if key.starts_with("invalid\0") {
        return None;
    }
    Some(match key.split_once('\0') {
        Some((id, token)) => (id, Some(token)),
        None => (key, None),
    })
}

impl Inner {
    /// Where the result of `h` goes and its list TTL. Precedence: the
    /// queue's `result_queue_name`, the envelope's, the request's, the
    /// default (`docs/transports.md`).
    fn result_list(&self, h: &Held) -> (String, u64) {
        let list = self
            .settings
            .result_list
            .clone()
            .or_else(|| h.result_list.clone())
            .unwrap_or_else(|| self.settings.default_result_list.clone());
        let ttl = h.result_ttl.unwrap_or(self.settings.result_ttl_seconds);
        (list, ttl)
    }

    fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        // The map is consistent between statements; a panic elsewhere
        // while holding it leaves nothing half-done.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records whether Redis was reachable and names the failed `op`.
    fn observed<T>(
        &self,
        op: &'static str,
        result: redis::RedisResult<T>,
    ) -> Result<T, QueueError> {
        match result {
            Ok(v) => {
                self.stats.reachable.store(true, Ordering::Relaxed);
                Ok(v)
            }
            Err(error) => {
                if error.is_io_error()
                    || error.is_connection_dropped()
                    || error.is_connection_refusal()
                    || error.is_timeout()
                {
                    self.stats.reachable.store(false, Ordering::Relaxed);
                }
                Err(QueueError::Redis { op, source: error })
            }
        }
    }

    /// The fairness attribute the lane scripts file by ("" = no lanes).
    fn lane_attribute(&self) -> &str {
        self.settings.fairness_attribute.as_deref().unwrap_or("")
    }

    /// Claims up to `max` of the earliest-due messages (the heads of the
    /// tenant lanes, with a fairness attribute); with `expired_by` (Unix
    /// s), only those whose deadline is at or before it, whatever tenant.
    async fn claim(
        &self,
        max: usize,
        lease: Duration,
        expired_by: Option<i64>,
    ) -> Result<Vec<Delivery>, QueueError> {
        let owner = random_hex();
        let expiry = crate::clock::unix_secs_f64() + lease.as_secs_f64();
        let mut conn = self.conn.clone();
        let k = &self.keys;
        let mut claim = scripts::CLAIM.prepare_invoke();
        claim.key(&k.pending);
        k.claim_state(&mut claim)
            .key(&k.reclaims)
            .key(&k.lanes)
            .key(&k.lane_cursor)
            .arg(max)
            .arg(expiry)
            .arg(&owner)
            .arg(self.lane_attribute())
            .arg(&k.lane_prefix);
        match expired_by {
            // Scores are the deadline plus a fraction below 1 (upstream
            // writes the bare deadline).
            Some(by) => claim.arg(by.saturating_add(1)),
            None => claim.arg(""),
        };
        for (tenant, weight) in &self.settings.tenant_weights {
            claim.arg(tenant).arg(*weight);
        }
        let raw = claim
            .invoke_async::<Vec<(String, Vec<u8>, f64, u32)>>(&mut conn)
            .await;
        let raw = self.observed("claim", raw)?;
        if raw.is_empty() {
            return Ok(Vec::new());
        }
        let mut deliveries = Vec::with_capacity(raw.len());
        {
            let mut held = self.lock_held();
            for (claim_key, member, score, reclaims) in raw {
                let peek: Peek = serde_json::from_slice(&member).unwrap_or_default();
                let result_list = peek.result_list();
                let internal = peek.internal.unwrap_or_default();
                let member = Bytes::from(member);
                let tag = format!("{owner}{claim_key}");
                deliveries.push(Delivery {
                    tag: DeliveryTag(tag.clone()),
                    body: member.clone(),
                    // A holder that lost the lease (killed mid-request, say)
                    // may have sent it: each reclaim is an attempt.
                    retry_count: internal.retry_count.unwrap_or(0).saturating_add(reclaims),
                    source_id: None,
                });
                held.insert(
                    tag,
                    Held {
                        claim_key,
                        owner: owner.clone(),
                        member,
                        score,
                        result_list,
                        result_ttl: internal.result_ttl_seconds,
                        reclaims,
                    },
                );
            }
        }
        self.drop_cancelled(deliveries).await
    }

    /// Answers cancelled messages with `CANCELLED` and returns the rest.
    async fn drop_cancelled(&self, deliveries: Vec<Delivery>) -> Result<Vec<Delivery>, QueueError> {
        let ids: Vec<(usize, String, Option<String>)> = deliveries
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                let key = &d.tag.0[OWNER_LEN..];
                split_claim_key(key).map(|(id, token)| (i, id.to_owned(), token.map(str::to_owned)))
            })
            .collect();
        if ids.is_empty() {
            return Ok(deliveries);
        }
        let mut cmd = redis::cmd("MGET");
        for (_, id, _) in &ids {
            cmd.arg(format!("request-cancel:{id}"));
        }
        let mut conn = self.conn.clone();
        let markers: Vec<Option<String>> = match self.observed(
            "cancel check",
            cmd.query_async::<Vec<Option<String>>>(&mut conn).await,
        ) {
            Ok(m) => m,
            // The claims are ours; the dispatcher will still see them
            // and the cancel check simply did not happen this time.
            Err(error) => {
                tracing::warn!(%error, "cancel check failed; delivering anyway");
                return Ok(deliveries);
            }
        };
        let mut cancelled = vec![false; deliveries.len()];
        let mut completions = Vec::new();
        for ((i, id, token), marker) in ids.iter().zip(markers) {
            let Some(marker) = marker else { continue };
            let matches = match token {
                Some(t) => *t == marker,
                None => true,
            };
            if matches {
                cancelled[*i] = true;
                completions.push(Completion {
                    tag: deliveries[*i].tag.clone(),
                    result: ResultRecord::error(
                        id,
                        token.as_deref(),
                        ErrorCode::Cancelled,
                        "cancelled by the submitter",
                    ),
                });
            }
        }
        if completions.is_empty() {
            return Ok(deliveries);
        }
        let n = completions.len() as u64;
        if let Err(error) = self.ack(completions).await {
            // Deliver them all rather than strand claims nobody handles: a
            // cancelled one is then sent, and if its CANCELLED result did
            // land after all, its later ack is fenced out.
            tracing::warn!(%error, "cancelled results not written; delivering anyway");
            return Ok(deliveries);
        }
        self.stats.cancelled.fetch_add(n, Ordering::Relaxed);
        Ok(deliveries
            .into_iter()
            .zip(cancelled)
            .filter_map(|(d, c)| (!c).then_some(d))
            .collect())
    }

    async fn ack(&self, completions: Vec<Completion>) -> Result<AckReport, QueueError> {
        let mut report = AckReport::default();
        let mut invocation = scripts::ACK.prepare_invoke();
        let k = &self.keys;
        k.claim_state(&mut invocation).key(&k.reclaims);
        let mut settled = Vec::with_capacity(completions.len());
        let mut forget = Vec::new();
        let mut args: Vec<Vec<u8>> = Vec::with_capacity(completions.len() * 7);
        {
            let held = self.lock_held();
            for Completion { tag, result } in &completions {
                let Some(h) = held.get(&tag.0) else {
                    report.lease_lost += 1;
                    continue;
                };
                let (list, ttl) = self.result_list(h);
                // A result is strings and numbers: serialising cannot fail.
                let json = serde_json::to_vec(result).unwrap_or_default();
                args.push(h.claim_key.clone().into_bytes());
                args.push(h.owner.clone().into_bytes());
                args.push(list.into_bytes());
                args.push(json);
                args.push(ttl.to_string().into_bytes());
                args.push(result.id.clone().into_bytes());
                let token = result.request_token.clone().unwrap_or_default();
                if self.settings.cluster {
                    // The producer's keys live in other slots: cleaned
                    // after the script, not inside it.
                    args.push(Vec::new());
                    if !token.is_empty() {
                        forget.push((result.id.clone(), token));
                    }
                } else {
                    args.push(token.into_bytes());
                }
                settled.push(tag.0.clone());
            }
        }
        if settled.is_empty() {
            return Ok(report);
        }
        invocation.arg(settled.len());
        for a in args {
            invocation.arg(a);
        }
        let mut conn = self.conn.clone();
        let (acked, lost): (usize, usize) =
            self.observed("ack", invocation.invoke_async(&mut conn).await)?;
        report.acked += acked;
        report.lease_lost += lost;
        {
            let mut held = self.lock_held();
            for tag in settled {
                held.remove(&tag);
            }
        }
        self.forget_submissions(forget).await;
        Ok(report)
    }

    async fn release(
        &self,
        tag: &DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: Option<AttemptRecord>,
    ) -> Result<(), QueueError> {
        let Some(h) = self.lock_held().get(&tag.0).cloned() else {
            return Ok(());
        };
        // Whether the member is rewritten with its reclaims folded into its
        // retry count (then `Keys::reclaims` forgets them).
        let mut rewritten = false;
        let (target, score, member) =
            if delay.is_zero() && !reason.counts_as_failure() && record.is_none() {
                (self.keys.pending.clone(), h.score, h.member.to_vec())
            } else {
                // Through the retry set: the envelope must name its origin, a
                // failed attempt is counted in it, and what an attempt learned
                // travels with it (so a deadline that passes while it waits
                // still answers with the last HTTP answer).
                let member = match parse_message(&h.member) {
                    Ok(mut message) => {
                        rewritten = true;
                        message.internal.retry_count =
                            message.internal.retry_count.saturating_add(h.reclaims);
                        if reason.counts_as_failure() {
                            message.internal.retry_count =
                                message.internal.retry_count.saturating_add(1);
                        }
                        if let Some(record) = record {
                            message.internal.attempts = Some(record.attempts);
                            if record.last_answer.is_some() {
                                message.internal.last_answer = record.last_answer;
                            }
                        }
                        message.internal.request_queue_name = Some(self.settings.name.clone());
                        if message.kind == "plain" {
                            message.kind = "redis".to_owned();
                        }
                        message.to_envelope_json().into_bytes()
                    }
                    Err(_) => h.member.to_vec(),
                };
                if delay.is_zero() {
                    (self.keys.pending.clone(), h.score, member)
                } else {
                    (
                        self.keys.retry.clone(),
                        crate::clock::unix_secs_f64() + delay.as_secs_f64(),
                        member,
                    )
                }
            };
        let k = &self.keys;
        let mut conn = self.conn.clone();
        let _: i64 = self.observed(
            "release",
            self.settle(&scripts::RELEASE, &h, &target)
                .arg(score)
                .arg(member)
                // Back in pending, into its lane; the retry set has none
                // (the mover files it when it comes back).
                .arg(match target == k.pending {
                    true => self.lane_attribute(),
                    false => "",
                })
                .arg(&k.lane_prefix)
                .arg(&k.lanes)
                .arg(if rewritten { "1" } else { "0" })
                .invoke_async(&mut conn)
                .await,
        )?;
        self.lock_held().remove(&tag.0);
        Ok(())
    }

    /// Starts `script`, one of those that settle the claim `h` holds and
    /// move its member to `target` (RELEASE, DEAD): KEYS the claim state,
    /// `target`, reclaims; ARGV the claim key and owner, then the caller's.
    fn settle(
        &self,
        script: &'static redis::Script,
        h: &Held,
        target: &str,
    ) -> redis::ScriptInvocation<'static> {
        let mut invocation = script.prepare_invoke();
        self.keys
            .claim_state(&mut invocation)
            .key(target)
            .key(&self.keys.reclaims)
            .arg(&h.claim_key)
            .arg(&h.owner);
        invocation
    }

    async fn dead_letter(
        &self,
        tag: &DeliveryTag,
        last_error: ResultRecord,
    ) -> Result<(), QueueError> {
        let Some(h) = self.lock_held().get(&tag.0).cloned() else {
            return Ok(());
        };
        let result = ResultRecord::dead_lettered(&last_error);
        let (list, ttl) = self.result_list(&h);
        // A result is strings and numbers: serialising cannot fail.
        let result_json = serde_json::to_vec(&result).unwrap_or_default();
        let record = serde_json::json!({
            "queue": self.settings.name,
            "message": String::from_utf8_lossy(&h.member),
            "last_error": last_error,
            "dead_at_ms": (crate::clock::unix_secs_f64() * 1000.0) as i64,
        })
        .to_string();
        let token = result.request_token.clone().unwrap_or_default();
        // On a cluster the producer's keys are cleaned after the script.
        let (script_token, forget) = if self.settings.cluster && !token.is_empty() {
            (String::new(), vec![(result.id.clone(), token)])
        } else {
            (token, Vec::new())
        };
        let k = &self.keys;
        let mut conn = self.conn.clone();
        let done: i64 = self.observed(
            "dead letter",
            self.settle(&scripts::DEAD, &h, &k.dead)
                .arg(record)
                .arg(list)
                .arg(result_json)
                .arg(ttl)
                .arg(&result.id)
                .arg(script_token)
                .invoke_async(&mut conn)
                .await,
        )?;
        if done == 1 {
            self.stats.dead_letters.fetch_add(1, Ordering::Relaxed);
            self.forget_submissions(forget).await;
        }
        self.lock_held().remove(&tag.0);
        Ok(())
    }

    /// Deletes `request-active:<id>` and `request-cancel:<id>` where they
    /// still hold the settled submission's token (cluster mode; standalone
    /// does it inside the settling script). Best effort: both keys expire,
    /// and a stale active key only makes `submit` warn about a resubmission.
    async fn forget_submissions(&self, settled: Vec<(String, String)>) {
        if settled.is_empty() {
            return;
        }
        let conn = self.conn.clone();
        let deletes = settled.iter().flat_map(|(id, token)| {
            ["request-active:", "request-cancel:"].map(|prefix| {
                let mut conn = conn.clone();
                let key = format!("{prefix}{id}");
                async move {
                    scripts::FORGET
                        .key(key)
                        .arg(token)
                        .invoke_async::<i64>(&mut conn)
                        .await
                }
            })
        });
        let failed = futures_util::future::join_all(deletes)
            .await
            .into_iter()
            .filter(Result::is_err)
            .count();
        if failed > 0 {
            tracing::warn!(
                failed,
                "redis: producer keys of settled requests not deleted; they expire"
            );
        }
    }

    async fn extend(&self, tags: Vec<DeliveryTag>, lease: Duration) -> Result<(), QueueError> {
        let pairs: Vec<(String, String)> = {
            let held = self.lock_held();
            tags.iter()
                .filter_map(|t| held.get(&t.0))
                .map(|h| (h.claim_key.clone(), h.owner.clone()))
                .collect()
        };
        if pairs.is_empty() {
            return Ok(());
        }
        let mut invocation = scripts::EXTEND.prepare_invoke();
        invocation
            .key(&self.keys.owners)
            .key(&self.keys.idx)
            .arg(crate::clock::unix_secs_f64() + lease.as_secs_f64());
        for (ck, owner) in pairs {
            invocation.arg(ck).arg(owner);
        }
        let mut conn = self.conn.clone();
        let _: i64 = self.observed("extend", invocation.invoke_async(&mut conn).await)?;
        Ok(())
    }

    /// One housekeeping pass: reclaim expired claims, move due retries,
    /// refresh the claims gauge.
    async fn housekeep(&self) -> Result<(), QueueError> {
        let k = &self.keys;
        let mut conn = self.conn.clone();
        let mut reclaim = scripts::RECLAIM.prepare_invoke();
        reclaim.key(&k.pending);
        k.claim_state(&mut reclaim)
            .key(&k.reclaims)
            .arg(crate::clock::unix_secs_f64())
            .arg(HOUSEKEEPING_BATCH)
            .arg(self.lane_attribute())
            .arg(&k.lane_prefix)
            .arg(&k.lanes);
        let reclaimed: u64 = self.observed("reclaim", reclaim.invoke_async(&mut conn).await)?;
        if reclaimed > 0 {
            tracing::info!(queue = %self.settings.name, reclaimed, "expired claims returned to the queue");
            self.stats.reclaims.fetch_add(reclaimed, Ordering::Relaxed);
        }
        self.move_due_retries().await?;
        if self.lane_attribute().is_empty() {
            let dropped: u64 = self.observed(
                "drop lanes",
                scripts::DROP_LANES
                    .key(&k.lanes)
                    .key(&k.lane_cursor)
                    .arg(&k.lane_prefix)
                    .invoke_async(&mut conn)
                    .await,
            )?;
            if dropped > 0 {
                tracing::info!(queue = %self.settings.name, dropped, "tenant lanes dropped: this dispatcher has no fairness attribute");
            }
        }
        let claims: u64 = self.observed(
            "count claims",
            redis::cmd("ZCARD").arg(&k.idx).query_async(&mut conn).await,
        )?;
        self.stats.claims_held.store(claims, Ordering::Relaxed);
        let backlog: u64 = self.observed(
            "backlog",
            redis::cmd("ZCARD")
                .arg(&k.pending)
                .query_async(&mut conn)
                .await,
        )?;
        self.stats.backlog.store(backlog, Ordering::Relaxed);
        Ok(())
    }

    /// Moves due entries of the retry set back to their origin queue at
    /// their deadline score (so a retry never jumps ahead of earlier-due
    /// work). Entries of every origin are moved, so a queue without a
    /// running dispatcher still gets its retries back.
    async fn move_due_retries(&self) -> Result<(), QueueError> {
        let mut conn = self.conn.clone();
        let due: Vec<Vec<u8>> = self.observed(
            "scan retries",
            redis::cmd("ZRANGEBYSCORE")
                .arg(&self.keys.retry)
                .arg("-inf")
                .arg(crate::clock::unix_secs_f64())
                .arg("LIMIT")
                .arg(0)
                .arg(HOUSEKEEPING_BATCH)
                .query_async(&mut conn)
                .await,
        )?;
        if due.is_empty() {
            return Ok(());
        }
        let mut invocation = scripts::MOVE.prepare_invoke();
        invocation.key(&self.keys.retry).arg(self.lane_attribute());
        for member in due {
            let (origin, score) = match parse_message(&member) {
                Ok(m) => (
                    m.internal
                        .request_queue_name
                        .clone()
                        // On a cluster the retry set is this queue's own.
                        .filter(|q| !q.is_empty() && !self.settings.cluster)
                        .unwrap_or_else(|| self.settings.name.clone()),
                    queue_score(m.request.deadline, m.internal.enqueued_at_ms.unwrap_or(0)),
                ),
                Err(_) => (self.settings.name.clone(), 0.0),
            };
            // Only this queue's own lanes: another origin's dispatcher may
            // not read lanes, and nothing would ever empty them.
            let (prefix, lanes) = match origin == self.settings.name {
                true => (self.keys.lane_prefix.as_str(), self.keys.lanes.as_str()),
                false => ("", ""),
            };
            invocation
                .arg(member)
                .arg(origin)
                .arg(score)
                .arg(prefix)
                .arg(lanes);
        }
        let _: i64 = self.observed("move retries", invocation.invoke_async(&mut conn).await)?;
        Ok(())
    }
}

/// Files members written without a lane (a plain `ZADD` by another
/// producer) into their tenants' lanes, so a tenant deep in a queue
/// nobody filed is seen from the start. Steps of `scripts::INDEX` follow
/// each other while a pass has more to go (each step is short, so Redis
/// serves others in between); when nothing needs filing, or a pass
/// ended, it looks again after `HOUSEKEEPING_EVERY`. Claims take a step
/// too (`scripts::CLAIM`); replicas share the cursor.
async fn lane_filer(inner: Arc<Inner>, stop: CancellationToken) {
    let k = &inner.keys;
    loop {
        let mut conn = inner.conn.clone();
        let step: Result<i64, _> = inner.observed(
            "file lanes",
            scripts::INDEX
                .key(&k.pending)
                .key(&k.lanes)
                .key(&k.lane_cursor)
                .arg(inner.lane_attribute())
                .arg(&k.lane_prefix)
                .invoke_async(&mut conn)
                .await,
        );
        let pause = match step {
            Ok(1) => Duration::ZERO,
            Ok(_) => HOUSEKEEPING_EVERY,
            Err(error) => {
                tracing::debug!(%error, queue = %inner.settings.name, "filing tenant lanes failed");
                HOUSEKEEPING_EVERY
            }
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

async fn housekeeping(inner: Arc<Inner>, stop: CancellationToken) {
    loop {
        if let Err(error) = inner.housekeep().await {
            tracing::debug!(%error, queue = %inner.settings.name, "redis housekeeping failed");
            let mut conn = inner.conn.clone();
            let ping = redis::cmd("PING").query_async::<String>(&mut conn).await;
            if inner.observed("ping", ping).is_err()
                && inner.stats.reachable.load(Ordering::Relaxed)
            {
                inner.stats.reachable.store(false, Ordering::Relaxed);
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(HOUSEKEEPING_EVERY) => {}
        }
    }
}

impl Queue for RedisQueue {
    fn name(&self) -> &str {
        &self.inner.settings.name
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        // Producers are other processes: an empty queue is looked at again
        // every `EMPTY_POLL`.
        Box::pin(long_poll(wait, None, move || async move {
            let got = self.inner.claim(max.max(1), lease, None).await?;
            Ok(Look::again_after(got, EMPTY_POLL))
        }))
    }

    fn receive_expired(
        &self,
        max: usize,
        lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            self.inner.claim(max, lease, Some(now_unix)).await
        })
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        Box::pin(self.inner.ack(completions))
    }

    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move { self.inner.release(&tag, delay, reason, None).await })
    }

    fn requeue_after_attempt(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: AttemptRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move { self.inner.release(&tag, delay, reason, Some(record)).await })
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(self.inner.extend(tags, lease))
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move { self.inner.dead_letter(&tag, last_error).await })
    }

    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(async move {
            let mut conn = self.inner.conn.clone();
            let n: u64 = self.inner.observed(
                "backlog",
                redis::cmd("ZCARD")
                    .arg(&self.inner.keys.pending)
                    .query_async(&mut conn)
                    .await,
            )?;
            Ok(Some(n))
        })
    }

    fn due(&self) -> BoxFuture<'_, Result<Option<DueProfile>, QueueError>> {
        Box::pin(async move {
            // Scores are deadline + a fraction below 1 (`queue_score`), so
            // "deadline <= now + h" is "score < now + h + 1".
            let now = crate::clock::unix_secs();
            let pending = &self.inner.keys.pending;
            let mut pipe = redis::pipe();
            for horizon in HORIZONS {
                pipe.cmd("ZCOUNT").arg(pending).arg("-inf").arg(format!(
                    "({}",
                    now.saturating_add(horizon).saturating_add(1)
                ));
            }
            pipe.cmd("ZRANGE")
                .arg(pending)
                .arg(0)
                .arg(0)
                .arg("WITHSCORES");
            let mut conn = self.inner.conn.clone();
            type Replies = (u64, u64, u64, u64, u64, u64, Vec<(String, f64)>);
            let (m1, m5, m15, h1, h4, d1, first): Replies = self
                .inner
                .observed("due", pipe.query_async(&mut conn).await)?;
            let within = [m1, m5, m15, h1, h4, d1];
            let earliest = first.first().map(|(_, score)| score.floor() as i64);
            Ok(Some(DueProfile::from_counts(within, earliest)))
        })
    }

    fn records_cancels(&self) -> bool {
        true
    }

    fn cancelled(&self, tag: &DeliveryTag) -> BoxFuture<'_, bool> {
        let claim_key = self
            .inner
            .lock_held()
            .get(&tag.0)
            .map(|h| h.claim_key.clone());
        Box::pin(async move {
            let Some(claim_key) = claim_key else {
                return false;
            };
            let Some((id, token)) = split_claim_key(&claim_key) else {
                return false;
            };
            let mut conn = self.inner.conn.clone();
            let marker: Option<String> = match self.inner.observed(
                "cancel check",
                redis::cmd("GET")
                    .arg(format!("request-cancel:{id}"))
                    .query_async(&mut conn)
                    .await,
            ) {
                Ok(m) => m,
                Err(_) => return false,
            };
            match (marker, token) {
                (Some(marker), Some(token)) => marker == token,
                (Some(_), None) => true,
                (None, _) => false,
            }
        })
    }

    fn status(&self) -> Option<TransportStatus> {
        let s = &self.inner.stats;
        Some(TransportStatus {
            reachable: s.reachable.load(Ordering::Relaxed),
            backlog: Some(s.backlog.load(Ordering::Relaxed)),
            claims_held: s.claims_held.load(Ordering::Relaxed),
            reclaims_total: s.reclaims.load(Ordering::Relaxed),
            dead_letters_total: s.dead_letters.load(Ordering::Relaxed),
        })
    }

    /// Hands every claim this process still holds back to pending at once,
    /// so another worker need not wait for the leases to expire.
    fn close(&self) -> BoxFuture<'_, Result<usize, QueueError>> {
        Box::pin(async move {
            let tags: Vec<String> = self.inner.lock_held().keys().cloned().collect();
            let mut released = 0;
            for tag in tags {
                self.inner
                    .release(
                        &DeliveryTag(tag),
                        Duration::ZERO,
                        NackReason::Shutdown,
                        None,
                    )
                    .await?;
                released += 1;
            }
            Ok(released)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookkeeping_keys_follow_upstream_layout() {
        let k = Keys::new("request-sortedset", false);
        assert_eq!(k.claimed, "request-sortedset:claimed");
        assert_eq!(k.owners, "request-sortedset:claim-owners");
        assert_eq!(k.idx, "request-sortedset:claims-idx");
        assert_eq!(k.reclaims, "request-sortedset:claim-reclaims");
        assert_eq!(k.lane("alice"), "request-sortedset:tenant-lane:alice");
        assert_eq!(k.lane_cursor, "request-sortedset:tenant-index");
        let c = Keys::new("q", true);
        assert_eq!(c.pending, "q");
        assert_eq!(c.idx, "{q}:claims-idx");
        assert_eq!(c.lanes, "{q}:tenant-lanes");
        let tagged = Keys::new("{t}q", true);
        assert_eq!(tagged.idx, "{t}q:claims-idx");
    }

    #[test]
    fn claim_keys_split_into_id_and_token() {
        assert_eq!(split_claim_key("a\0t"), Some(("a", Some("t"))));
        assert_eq!(split_claim_key("a"), Some(("a", None)));
        assert_eq!(split_claim_key("invalid\0abc"), None);
    }
}
