//! The producer side, as upstream producers write it: envelope into the
//! pending sorted set, `request-active:<id>` holding the submission token
//! until the deadline, and cancellation through `request-cancel:<id>`.

use redis::aio::ConnectionLike;

use super::{CANCEL_TTL, Keys};
use crate::redis::{RedisConnection, key_slot};
use crate::request::Message;

/// Score of a message in its queue: the deadline plus a fraction encoding
/// the enqueue time in 62.5 ms steps over a 2^17 s horizon, so equal
/// deadlines are served first in, first out.
pub fn queue_score(deadline: i64, enqueued_at_ms: i64) -> f64 {
    const STEPS: i64 = 1 << 21; // 2^17 s / 62.5 ms
    let step = (enqueued_at_ms.max(0) * 2 / 125).rem_euclid(STEPS);
    deadline as f64 + step as f64 / STEPS as f64
}

/// One message ready to enqueue.
#[derive(Debug, Clone)]
pub struct Submission {
    /// Its deadline (Unix s).
    deadline: i64,
    /// Its enqueue time (Unix ms).
    enqueued_at_ms: i64,
    /// The envelope JSON.
    pub member: String,
    /// Its queue score.
    pub score: f64,
    /// The request id.
    pub id: String,
    /// The submission token.
    pub token: String,
    /// Seconds until the deadline (TTL of `request-active:<id>`).
    pub active_ttl: u64,
    /// The tenant lane it is also filed in (`Keys::lane`), for a queue
    /// whose dispatcher has a fairness attribute.
    pub lane: Option<String>,
}

impl Submission {
    /// Wraps `message` for `queue`: fresh token, enqueue time, routing.
    pub fn new(mut message: Message, queue: &str, now_ms: i64) -> Self {
        let token = format!("{:032x}", rand::random::<u128>());
        message.internal.request_token = Some(token.clone());
        message.internal.request_queue_name = Some(queue.to_owned());
        message
            .internal
            .queue_id
            .get_or_insert_with(|| queue.to_owned());
        message.internal.enqueued_at_ms = Some(now_ms);
        message.kind = "redis".to_owned();
        let score = queue_score(message.request.deadline, now_ms);
        let active_ttl = u64::try_from(message.request.deadline - now_ms / 1000)
            .unwrap_or(0)
            .max(1);
        Self {
            deadline: message.request.deadline,
            enqueued_at_ms: now_ms,
            member: message.to_envelope_json(),
            score,
            id: message.request.id.clone(),
            token,
            active_ttl,
            lane: None,
        }
    }

    /// Files it also into `tenant`'s lane (its `metadata` value of the
    /// dispatcher's `fairness_attribute`, "" without one), so the
    /// dispatcher finds it however deep it sits in the queue. `None`: the
    /// queue has no lanes.
    pub fn in_lane(mut self, tenant: Option<String>) -> Self {
        self.lane = tenant;
        self
    }
}

impl Submission {
    /// Orders this message as the `n`th of one submission among equal
    /// deadlines: its score moves `n` FIFO steps (62.5 ms each) past the
    /// enqueue time, so a file submitted within one step keeps its order
    /// (Redis orders equal scores by member bytes, not arrival).
    pub fn in_sequence(self, n: u64) -> Self {
        let enqueued_at_ms = self.enqueued_at_ms;
        self.in_sequence_from(enqueued_at_ms, n)
    }

    /// [`Submission::in_sequence`] counting the steps from `base_ms`
    /// instead of the enqueue time: a producer that enqueues in several
    /// round trips keeps one order across them (`RedisClient`).
    pub fn in_sequence_from(mut self, base_ms: i64, n: u64) -> Self {
        self.score = queue_score(self.deadline, base_ms.saturating_add(fifo_steps_ms(n) + 1));
        self
    }
}

/// The span of `n` FIFO steps (62.5 ms each) in milliseconds.
pub(super) fn fifo_steps_ms(n: u64) -> i64 {
    i64::try_from(n)
        .unwrap_or(i64::MAX / 128)
        .saturating_mul(125)
        / 2
}

/// Enqueues `batch` into `queue`: in one pipelined round trip on a single
/// server; on a cluster, where a pipeline must stay in one slot, the
/// `request-active:<id>` keys first (concurrently, each in its own slot),
/// then one `ZADD` of the whole batch, so no message is claimable before
/// its active key exists.
pub async fn enqueue(
    conn: &mut RedisConnection,
    queue: &str,
    batch: &[Submission],
) -> redis::RedisResult<()> {
    enqueue_marked(conn, queue, batch, None).await
}

/// A key set to a value together with an enqueue ([`enqueue_marked`]),
/// with a TTL in seconds.
#[derive(Debug, Clone)]
pub struct Mark {
    /// The key.
    pub key: String,
    /// Its value.
    pub value: String,
    /// Its TTL in seconds.
    pub ttl_secs: u64,
}

/// [`enqueue`], also setting `mark` in the same `MULTI`/`EXEC` on a
/// single server, so a crash leaves either both or neither: a producer
/// that records its progress in the mark never enqueues a message twice
/// (the Batch API's intake). On a cluster the same holds when the mark
/// shares the queue's hash slot (the Batch API tags it so): the `ZADD`,
/// the lanes and the mark are one `MULTI` there; a mark in another slot
/// is set after the messages (a transaction cannot span slots).
pub async fn enqueue_marked(
    conn: &mut RedisConnection,
    queue: &str,
    batch: &[Submission],
    mark: Option<&Mark>,
) -> redis::RedisResult<()> {
    let set_mark = |pipe: &mut redis::Pipeline| {
        if let Some(m) = mark {
            pipe.cmd("SET")
                .arg(&m.key)
                .arg(&m.value)
                .arg("EX")
                .arg(m.ttl_secs.max(1))
                .ignore();
        }
    };
    let active = |s: &Submission| {
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("request-active:{}", s.id))
            .arg(&s.token)
            .arg("EX")
            .arg(s.active_ttl);
        cmd
    };
    let keys = Keys::new(queue, conn.is_cluster());
    // Lane entries follow the queue's: a claim that finds a lane entry
    // whose member is not pending (yet) drops it.
    let add_lanes = |pipe: &mut redis::Pipeline| {
        for s in batch {
            if let Some(tenant) = &s.lane {
                pipe.cmd("ZADD")
                    .arg(keys.lane(tenant))
                    .arg(s.score)
                    .arg(&s.member)
                    .ignore();
                pipe.cmd("SADD").arg(&keys.lanes).arg(tenant).ignore();
            }
        }
    };
    if conn.is_cluster() {
        let sets = batch.iter().map(|s| {
            let mut conn = conn.clone();
            let cmd = active(s);
            async move { cmd.query_async::<()>(&mut conn).await }
        });
        for set in futures_util::future::join_all(sets).await {
            set?;
        }
        if batch.is_empty() && mark.is_none() {
            return Ok(());
        }
        // A mark in the queue's slot goes in one `MULTI` with the `ZADD`
        // and the lanes: both or neither, as on a single server.
        if mark.is_some_and(|m| key_slot(&m.key) == key_slot(queue)) {
            let mut pipe = redis::pipe();
            pipe.atomic();
            if !batch.is_empty() {
                let zadd = pipe.cmd("ZADD").arg(queue);
                for s in batch {
                    zadd.arg(s.score).arg(&s.member);
                }
                zadd.ignore();
            }
            add_lanes(&mut pipe);
            set_mark(&mut pipe);
            return pipe.query_async::<()>(conn).await;
        }
        if !batch.is_empty() {
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(queue);
            for s in batch {
                zadd.arg(s.score).arg(&s.member);
            }
            zadd.query_async::<()>(conn).await?;
        }
        // The lanes share the queue's slot.
        if batch.iter().any(|s| s.lane.is_some()) {
            let mut pipe = redis::pipe();
            add_lanes(&mut pipe);
            pipe.query_async::<()>(conn).await?;
        }
        if mark.is_some() {
            let mut pipe = redis::pipe();
            set_mark(&mut pipe);
            pipe.query_async::<()>(conn).await?;
        }
        return Ok(());
    }
    let mut pipe = redis::pipe();
    if mark.is_some() {
        pipe.atomic();
    }
    for s in batch {
        pipe.cmd("ZADD")
            .arg(queue)
            .arg(s.score)
            .arg(&s.member)
            .ignore();
        pipe.add_command(active(s)).ignore();
    }
    add_lanes(&mut pipe);
    set_mark(&mut pipe);
    pipe.query_async::<()>(conn).await
}

/// What `cancel` did for one id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The active submission's token was copied to `request-cancel:<id>`.
    Cancelled,
    /// No active submission (finished, expired or unknown).
    NotActive,
}

/// Cancels the active submission of `id` (upstream protocol: copy the token
/// from `request-active:<id>` to `request-cancel:<id>`, TTL 7 days).
pub async fn cancel<C: ConnectionLike>(
    conn: &mut C,
    id: &str,
) -> redis::RedisResult<CancelOutcome> {
    let token: Option<String> = redis::cmd("GET")
        .arg(format!("request-active:{id}"))
        .query_async(conn)
        .await?;
    let Some(token) = token else {
        return Ok(CancelOutcome::NotActive);
    };
    redis::cmd("SET")
        .arg(format!("request-cancel:{id}"))
        .arg(token)
        .arg("EX")
        .arg(CANCEL_TTL.as_secs())
        .query_async::<()>(conn)
        .await?;
    Ok(CancelOutcome::Cancelled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_deadlines_keep_enqueue_order_and_deadline_dominates() {
        let a = queue_score(1_000, 1_700_000_000_000);
        let b = queue_score(1_000, 1_700_000_000_063);
        assert!(a < b);
        assert!(b < queue_score(1_001, 1_700_000_000_000));
        assert!(b - 1_000.0 < 1.0);
    }

    #[test]
    fn sequence_keeps_file_order_among_equal_deadlines() {
        let message = |id: &str| {
            crate::request::parse_message(
                format!(r#"{{"id":"{id}","deadline":5000,"payload":{{}}}}"#).as_bytes(),
            )
            .expect("valid")
        };
        let now = 1_700_000_000_000;
        let scores: Vec<f64> = ["z", "a", "m"]
            .iter()
            .enumerate()
            .map(|(i, id)| {
                Submission::new(message(id), "q", now)
                    .in_sequence(i as u64)
                    .score
            })
            .collect();
        assert!(scores[0] < scores[1] && scores[1] < scores[2], "{scores:?}");
        assert!(scores.iter().all(|s| (5000.0..5001.0).contains(s)));
    }
}
