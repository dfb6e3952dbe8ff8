//! The Redis transport's client face ([`crate::queue::Client`]): the
//! upstream producer protocol (`producer.rs`) on one queue, results read
//! from the queue's result list.

use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::DEFAULT_RESULT_LIST;
use super::idempotent;
use super::producer::{self, Submission, fifo_steps_ms};
use crate::queue::QueueError;
use crate::queue::client::{
    CancelOutcome, Client, ClientError, Cursor, Description, Mark, Outgoing, ReadResult, Receipt,
    ResultPage, SubmissionRecord, Submitted,
};
use crate::queue::idempotency;
use crate::redis::{RedisConnection, hash_tag};
use crate::request::Message;

/// Ids per `MGET` of the active check.
const ACTIVE_CHUNK: usize = 1000;

/// A producer and result reader on one Redis queue.
#[derive(Debug)]
pub struct RedisClient {
    conn: RedisConnection,
    /// The pending sorted set.
    queue: String,
    /// The list results are read from; enqueued messages name it when
    /// `name_list` is set.
    result_list: String,
    name_list: bool,
    /// The dispatcher's fairness attribute: messages are also filed in
    /// their tenant's lane.
    fairness_attribute: Option<String>,
    /// Where the queue's FIFO order among equal deadlines stands: the
    /// enqueue time (Unix ms) the scores count from and the next message's
    /// step after it. Kept across enqueues so a file submitted in many
    /// chunks keeps its order (the steps of one chunk can run past the
    /// next chunk's clock).
    order: Mutex<(i64, u64)>,
}

impl RedisClient {
    /// A client of `queue`; `result_list` as in
    /// [`crate::queue::ClientTarget::Redis`].
    pub fn new(
        conn: RedisConnection,
        queue: String,
        result_list: Option<String>,
        fairness_attribute: Option<String>,
    ) -> Self {
        Self {
            conn,
            queue,
            name_list: result_list.is_some(),
            result_list: result_list.unwrap_or_else(|| DEFAULT_RESULT_LIST.to_owned()),
            fairness_attribute,
            order: Mutex::new((0, 0)),
        }
    }

    /// The first FIFO step for `n` messages enqueued at `now_ms`, and the
    /// time it counts from: after every message this client enqueued
    /// before, or afresh once the clock has passed them.
    fn steps(&self, now_ms: i64, n: usize) -> (i64, u64) {
        let mut order = self
            .order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (base, next) = *order;
        let reached = fifo_steps_ms(next);
        let start = match now_ms > base.saturating_add(reached) {
            true => (now_ms, 0),
            false => (base, next),
        };
        *order = (start.0, start.1 + n as u64);
        start
    }

    /// A mark's key: on a cluster in the queue's hash slot, so it is set in
    /// the same `MULTI` as the queue's `ZADD`.
    fn mark_key(&self, key: &str) -> String {
        match self.conn.is_cluster() {
            true => format!("{{{}}}:{key}", hash_tag(&self.queue).unwrap_or(&self.queue)),
            false => key.to_owned(),
        }
    }

    /// `messages` as this queue's submissions: fresh tokens, routed to
    /// the result list when it is named, filed in their lanes, in order.
    fn submissions(&self, messages: Vec<Message>) -> Vec<Submission> {
        let now_ms = crate::clock::unix_millis();
        let (base_ms, first) = self.steps(now_ms, messages.len());
        (messages.into_iter().enumerate())
            .map(|(index, mut message)| {
                if self.name_list {
                    message.internal.result_queue_name = Some(self.result_list.clone());
                }
                let tenant = (self.fairness_attribute.as_deref())
                    .map(|a| message.request.metadata.get(a).cloned().unwrap_or_default());
                Submission::new(message, &self.queue, now_ms)
                    .in_sequence_from(base_ms, first + index as u64)
                    .in_lane(tenant)
            })
            .collect()
    }

    /// Idempotency records need one script over the queue and the active
    /// keys, which a cluster spreads over slots (`idempotent.rs`).
    fn check_single_server(&self) -> Result<(), ClientError> {
        match self.conn.is_cluster() {
            true => Err(ClientError::Unsupported {
                transport: "redis cluster",
                what: "record an idempotency key with its requests (the active keys live in other slots than the queue)",
            }),
            false => Ok(()),
        }
    }

    fn error(op: &'static str) -> impl Fn(redis::RedisError) -> ClientError {
        move |source| QueueError::Redis { op, source }.into()
    }
}

/// `text` with the glob characters of `MATCH` escaped.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Client for RedisClient {
    fn describe(&self) -> Description {
        Description {
            place: format!("`{}`", self.queue),
            results: format!("`{}`", self.result_list),
            items: "requests",
            active: "active (`request-active:<id>`)",
        }
    }

    fn transport(&self) -> &'static str {
        "redis"
    }

    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>> {
        Box::pin(async move {
            let batch = self.submissions(idempotency::parse_all(&requests)?);
            let mark = mark.map(|m| producer::Mark {
                key: self.mark_key(&m.key),
                value: m.value,
                ttl_secs: m.ttl.as_secs(),
            });
            let mut conn = self.conn.clone();
            producer::enqueue_marked(&mut conn, &self.queue, &batch, mark.as_ref())
                .await
                .map_err(Self::error("enqueue"))?;
            Ok(batch.len() as u64)
        })
    }

    /// The record's TTL runs from now to its `expires_at`.
    fn enqueue_idempotent(
        &self,
        key: String,
        requests: Vec<Outgoing>,
        keep: Duration,
    ) -> BoxFuture<'_, Result<Submitted, ClientError>> {
        Box::pin(async move {
            self.check_single_server()?;
            let prepared =
                idempotency::prepare(&key, &requests, &self.queue, &self.result_list, keep)?;
            let batch = self.submissions(prepared.messages);
            let mut record = prepared.record;
            for (entry, s) in record.requests.iter_mut().zip(&batch) {
                entry.token = Some(s.token.clone());
            }
            let ttl = u64::try_from(record.expires_at - crate::clock::unix_secs()).unwrap_or(1);
            let mut conn = self.conn.clone();
            let found = idempotent::enqueue(
                &mut conn,
                &self.queue,
                &batch,
                &idempotent::record_key(&self.queue, &key),
                &idempotency::encode(&record),
                ttl,
            )
            .await
            .map_err(Self::error("enqueue idempotently"))?;
            idempotency::settle(record, found)
        })
    }

    fn lookup(&self, key: String) -> BoxFuture<'_, Result<Option<SubmissionRecord>, ClientError>> {
        Box::pin(async move {
            self.check_single_server()?;
            let text: Option<String> = redis::cmd("GET")
                .arg(idempotent::record_key(&self.queue, &key))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(Self::error("look up an idempotency key"))?;
            idempotency::read(&key, text)
        })
    }

    fn mark(&self, key: String) -> BoxFuture<'_, Result<Option<String>, ClientError>> {
        Box::pin(async move {
            redis::cmd("GET")
                .arg(self.mark_key(&key))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(Self::error("get mark"))
        })
    }

    fn forget_mark(&self, key: String) -> BoxFuture<'_, Result<(), ClientError>> {
        Box::pin(async move {
            redis::cmd("DEL")
                .arg(self.mark_key(&key))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(Self::error("forget mark"))
        })
    }

    /// Removes each id's member from pending if it is still there (`ZREM`
    /// is atomic against a claim: a member a dispatcher claimed is not in
    /// pending any more, and is left alone), forgets its active key and
    /// answers it `CANCELLED` on the result list. Pending is searched with
    /// `ZSCAN … MATCH` on the id (members are the envelopes' text), so a
    /// withdrawal costs a pass over pending: meant for the rare flex
    /// request past `serve.flex_max_wait`. A stale lane entry is dropped
    /// by the next claim.
    /// The upstream cancel for each id no dispatcher holds; one a
    /// dispatcher has claimed (`claimed` has its claim key) is left
    /// unmarked, so its cancel watcher lets it finish. A claim that comes
    /// just after the look is sent, as one just before it would be.
    fn expire(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(async move {
            let claimed = super::Keys::new(&self.queue, self.conn.is_cluster()).claimed;
            let mut conn = self.conn.clone();
            let mut outcomes = Vec::with_capacity(ids.len());
            for id in &ids {
                let token: Option<String> = redis::cmd("GET")
                    .arg(format!("request-active:{id}"))
                    .query_async(&mut conn)
                    .await
                    .map_err(Self::error("expire"))?;
                let claim_key = match &token {
                    Some(token) => format!("{id}\0{token}"),
                    None => id.clone(),
                };
                let held: bool = redis::cmd("HEXISTS")
                    .arg(&claimed)
                    .arg(&claim_key)
                    .query_async(&mut conn)
                    .await
                    .map_err(Self::error("expire"))?;
                if held {
                    outcomes.push(CancelOutcome::InFlight);
                    continue;
                }
                outcomes.push(cancel_one(&mut conn, id).await?);
            }
            Ok(outcomes)
        })
    }

    fn withdraw(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<bool>, ClientError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut out = Vec::with_capacity(ids.len());
            for id in &ids {
                let pattern = format!("*\"id\":\"{}\"*", glob_escape(id));
                let mut members = Vec::new();
                let mut cursor = 0u64;
                loop {
                    let (next, found): (u64, Vec<String>) = redis::cmd("ZSCAN")
                        .arg(&self.queue)
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut conn)
                        .await
                        .map_err(Self::error("find a waiting request"))?;
                    members.extend(found.into_iter().step_by(2));
                    cursor = next;
                    if cursor == 0 {
                        break;
                    }
                }
                let mut withdrawn = false;
                for member in members {
                    let Ok(message) = crate::request::parse_message(member.as_bytes()) else {
                        continue;
                    };
                    if message.request.id != *id {
                        continue;
                    }
                    let removed: i64 = redis::cmd("ZREM")
                        .arg(&self.queue)
                        .arg(&member)
                        .query_async(&mut conn)
                        .await
                        .map_err(Self::error("withdraw a request"))?;
                    if removed == 0 {
                        continue;
                    }
                    withdrawn = true;
                    let result = crate::result::ResultRecord::error(
                        id,
                        message.token(),
                        crate::result::ErrorCode::Cancelled,
                        "withdrawn before dispatch",
                    );
                    redis::cmd("DEL")
                        .arg(format!("request-active:{id}"))
                        .query_async::<()>(&mut conn)
                        .await
                        .map_err(Self::error("withdraw a request"))?;
                    redis::cmd("LPUSH")
                        .arg(&self.result_list)
                        .arg(serde_json::to_string(&result).unwrap_or_default())
                        .query_async::<()>(&mut conn)
                        .await
                        .map_err(Self::error("answer a withdrawn request"))?;
                }
                out.push(withdrawn);
            }
            Ok(out)
        })
    }

    /// The ids among `ids` whose member a dispatcher holds claimed (the
    /// claimed hash holds at most a window's worth).
    fn leased(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<bool>, ClientError>> {
        Box::pin(async move {
            let keys = super::Keys::new(&self.queue, self.conn.is_cluster());
            let members: Vec<String> = redis::cmd("HVALS")
                .arg(&keys.claimed)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(Self::error("read claims"))?;
            let claimed: std::collections::HashSet<String> = (members.iter())
                .filter_map(|m| crate::request::parse_message(m.as_bytes()).ok())
                .map(|m| m.request.id)
                .collect();
            Ok(ids.iter().map(|id| claimed.contains(id)).collect())
        })
    }

    fn cancel(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut outcomes = Vec::with_capacity(ids.len());
            for id in &ids {
                outcomes.push(cancel_one(&mut conn, id).await?);
            }
            Ok(outcomes)
        })
    }

    /// The oldest `max` entries of the result list (`LPUSH` puts the
    /// newest at the head, so they are its tail), left in it until
    /// confirmed; the cursor is ignored.
    fn results(
        &self,
        _cursor: Cursor,
        max: usize,
    ) -> BoxFuture<'_, Result<ResultPage, ClientError>> {
        Box::pin(async move {
            let from = -i64::try_from(max.max(1)).unwrap_or(i64::MAX);
            let items: Vec<String> = redis::cmd("LRANGE")
                .arg(&self.result_list)
                .arg(from)
                .arg(-1)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(Self::error("read results"))?;
            let results = (items.into_iter().rev())
                .map(|raw| ReadResult::with_receipt(raw, Receipt::ListEntry))
                .collect();
            Ok(ResultPage {
                results,
                cursor: Cursor::default(),
            })
        })
    }

    /// Removes each entry by value (several readers may share the list);
    /// a foreign one is first pushed to `<list>-unclaimed`, never dropped.
    fn confirm(
        &self,
        taken: Vec<ReadResult>,
        foreign: Vec<ReadResult>,
    ) -> BoxFuture<'_, Result<(), ClientError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let unclaimed = format!("{}-unclaimed", self.result_list);
            // One command at a time: on a cluster the unclaimed list may
            // live in another slot than the result list.
            for read in &foreign {
                redis::cmd("LPUSH")
                    .arg(&unclaimed)
                    .arg(&read.raw)
                    .query_async::<()>(&mut conn)
                    .await
                    .map_err(Self::error("set a result aside"))?;
                remove(&mut conn, &self.result_list, &read.raw).await?;
            }
            if taken.is_empty() {
                return Ok(());
            }
            let mut pipe = redis::pipe();
            for read in &taken {
                pipe.cmd("LREM")
                    .arg(&self.result_list)
                    .arg(-1)
                    .arg(&read.raw)
                    .ignore();
            }
            pipe.query_async::<()>(&mut conn)
                .await
                .map_err(Self::error("remove results"))
        })
    }

    /// The ids with a `request-active:<id>` key (submitted, not finished).
    fn active(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut active = Vec::new();
            for chunk in ids.chunks(ACTIVE_CHUNK) {
                // One MGET per chunk: a cluster connection splits it by slot.
                let mut mget = redis::cmd("MGET");
                for id in chunk {
                    mget.arg(format!("request-active:{id}"));
                }
                let found: Vec<Option<String>> = mget
                    .query_async(&mut conn)
                    .await
                    .map_err(Self::error("check active ids"))?;
                active.extend(
                    (chunk.iter().zip(found))
                        .filter(|(_, token)| token.is_some())
                        .map(|(id, _)| id.clone()),
                );
            }
            Ok(Some(active))
        })
    }
}

/// Removes the oldest entry equal to `raw` from `list`.
async fn remove(conn: &mut RedisConnection, list: &str, raw: &str) -> Result<(), ClientError> {
    redis::cmd("LREM")
        .arg(list)
        .arg(-1)
        .arg(raw)
        .query_async::<()>(conn)
        .await
        .map_err(RedisClient::error("remove a result"))
}

/// The upstream cancel of one id, as the client contract names its outcome.
async fn cancel_one(conn: &mut RedisConnection, id: &str) -> Result<CancelOutcome, ClientError> {
    let done = producer::cancel(conn, id)
        .await
        .map_err(RedisClient::error("cancel"))?;
    Ok(match done {
        producer::CancelOutcome::Cancelled => CancelOutcome::Cancelled,
        producer::CancelOutcome::NotActive => CancelOutcome::NotActive,
    })
}
