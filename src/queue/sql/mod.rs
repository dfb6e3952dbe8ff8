//! The `sql` transport: the [`Queue`] contract on PostgreSQL, on
//! upstream's tables (`schema.rs` says which columns and tables are ours).
//!
//! - A claim is one statement: `SELECT … FOR UPDATE SKIP LOCKED` picks the
//!   earliest-deadline visible rows of the queue, and the `UPDATE` around
//!   it stamps each with a fresh lease tag, this process as its owner and
//!   an expiry on the database clock. Concurrent dispatchers never take
//!   the same row.
//! - A lease that expires (its holder was killed) is returned by the next
//!   claim of any dispatcher, counting an attempt, and handed out again
//!   with a new tag; the dead holder's tag matches no row any more.
//! - An ack is one statement: it deletes the rows still carrying the
//!   given tags and inserts a result for exactly the rows it deleted. A
//!   row exists once, so it is answered once, across kills and restarts
//!   of the dispatcher or of PostgreSQL.
//! - A nack clears the lease and sets `visible_at_ms`; a dead letter moves
//!   the row to `sluicegate_dead_letters` and writes its last error as the
//!   result, in one statement.
//! - Cancellation is upstream's `cancelled` flag: a waiting row is
//!   answered `CANCELLED` by the producer's cancel at once; a leased one is
//!   flagged and [`Queue::cancelled`] says so before it is sent; a flagged
//!   row a claim finds (flagged by upstream's producer) is answered
//!   `CANCELLED` without being handed out.
//!
//! Files: `client.rs` (the producer's side: enqueue, cancel, read
//! results); the reconnecting connection and the tables are the ground
//! floor's [`crate::postgres`], shared with the `sql-quota` gate.

mod client;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::due::{DueProfile, HORIZONS};
use super::lanes::TenantLanes;
use super::{
    AckReport, Completion, Delivery, DeliveryTag, Look, NackReason, Queue, QueueError,
    TransportStatus, long_poll,
};
use crate::request::{AttemptRecord, parse_message};
use crate::result::{ErrorCode, ResultRecord};

pub use crate::postgres::{Db, SqlError};
pub use client::{SqlCancel, SqlClient, SqlQueueClient, StoredResult};

/// Result route (upstream's `result_queue_name` default) when neither the
/// queue nor `[sql]` names one.
pub const DEFAULT_RESULT_ROUTE: &str = "result-sql";

/// Settings of one SQL queue.
#[derive(Debug, Clone)]
pub struct SqlQueueSettings {
    /// The `queue` column value this queue drains.
    pub queue: String,
    /// The `route` its results are written under.
    pub route: String,
    /// Results expire this long after they are written (`expires_at`);
    /// `None`: never.
    pub result_ttl_seconds: Option<u64>,
    /// How often an empty receive looks again.
    pub poll_interval: Duration,
    /// Most rows one claim statement takes.
    pub batch_size: usize,
    /// Lease taken and renewed instead of the dispatcher's, when set.
    pub lease_ttl: Option<Duration>,
    /// The dispatcher's fairness settings: when set, claims file rows into
    /// tenant lanes and take the lanes' heads round robin (`lanes.rs`).
    pub lanes: Option<TenantLanes>,
}

impl SqlQueueSettings {
    /// Upstream's defaults for `queue`.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            route: DEFAULT_RESULT_ROUTE.to_owned(),
            result_ttl_seconds: None,
            poll_interval: Duration::from_secs(1),
            batch_size: 10,
            lease_ttl: None,
            lanes: None,
        }
    }
}

/// One queue in a PostgreSQL database.
#[derive(Debug)]
pub struct SqlQueue {
    db: Arc<Db>,
    settings: SqlQueueSettings,
    /// This process, as `lease_owner`: `close` hands back only its rows.
    owner: String,
    reclaims: AtomicU64,
    dead_letters: AtomicU64,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn sql_err(op: &'static str) -> impl FnOnce(tokio_postgres::Error) -> QueueError {
    move |source| QueueError::Sql { op, source }
}

/// The token column as the result records spell it (`""` = none).
fn token(column: &str) -> Option<&str> {
    (!column.is_empty()).then_some(column)
}

/// Returns lapsed leases of a queue to waiting, counting the attempt the
/// dead holder may have sent.
const RECLAIM: &str = concat!(
    "UPDATE async_requests SET dispatch_epoch = 0, lease_owner = NULL, lease_tag = NULL,
         lease_expires_ms = 0, retry_count = retry_count + 1
     WHERE queue = $1 AND lease_tag IS NOT NULL AND lease_expires_ms <= ",
    now_ms!()
);

/// The end both claims share: leases the rows `picked` to owner $3 for $4
/// ms (a fresh tag each) and returns them. A macro, as `concat!` takes
/// only literals.
macro_rules! lease_picked {
    () => {
        concat!(
            "
     UPDATE async_requests r SET dispatch_epoch = 1, lease_owner = $3,
         lease_tag = gen_random_uuid()::text, lease_expires_ms = ",
            now_ms!(),
            " + $4
     FROM picked p WHERE r.id = p.id AND r.request_token = p.request_token
     RETURNING r.id, r.request_token, r.payload, r.retry_count, r.lease_tag, r.cancelled,
         r.deadline, r.created_at"
        )
    };
}

// After `lease_picked!`, which its claim ends with.
mod lanes;

/// Leases up to $2 visible rows of queue $1 for $4 ms, owner $3.
const CLAIM: &str = concat!(
    "WITH picked AS MATERIALIZED (
         SELECT id, request_token FROM async_requests
         WHERE queue = $1 AND dispatch_epoch = 0 AND visible_at_ms <= ",
    now_ms!(),
    " AND not_before <= ",
    now_ms!(),
    " / 1000
         ORDER BY deadline, created_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
    lease_picked!()
);

/// [`CLAIM`] for rows whose deadline is at or before $5, delayed or not.
const CLAIM_EXPIRED: &str = concat!(
    "WITH picked AS MATERIALIZED (
         SELECT id, request_token FROM async_requests
         WHERE queue = $1 AND dispatch_epoch = 0 AND deadline <= $5
         ORDER BY deadline, created_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
    lease_picked!()
);

/// Deletes the rows still leased under the tags $1 and writes one result
/// each ($2 route, $3 record, $4 expiry), in one statement.
const ACK: &str = concat!(
    "WITH input AS (
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
             AS t(tag, route, payload, expires_at)),
     done AS (
         DELETE FROM async_requests r USING input i WHERE r.lease_tag = i.tag
         RETURNING r.id, r.request_token, r.lease_tag)
     INSERT INTO async_results (route, id, request_token, payload, expires_at, created_at)
     SELECT i.route, d.id, d.request_token, i.payload, i.expires_at, ",
    now_ms!(),
    " FROM done d JOIN input i ON i.tag = d.lease_tag
     RETURNING seq"
);

const NACK: &str = concat!(
    "UPDATE async_requests SET dispatch_epoch = 0, lease_owner = NULL, lease_tag = NULL,
         lease_expires_ms = 0, visible_at_ms = ",
    now_ms!(),
    " + $2, retry_count = retry_count + $3
     WHERE lease_tag = $1"
);

const REQUEUE: &str = concat!(
    "UPDATE async_requests SET dispatch_epoch = 0, lease_owner = NULL, lease_tag = NULL,
         lease_expires_ms = 0, visible_at_ms = ",
    now_ms!(),
    " + $2, retry_count = retry_count + $3, payload = $4
     WHERE lease_tag = $1"
);

const PAYLOAD: &str = "SELECT payload FROM async_requests WHERE lease_tag = $1";

const EXTEND: &str = concat!(
    "UPDATE async_requests SET lease_expires_ms = ",
    now_ms!(),
    " + $2 WHERE lease_tag = ANY($1::text[])"
);

/// Moves the row leased under $1 to the dead letters ($2 its last error)
/// and writes $3 as its result under route $4 (expiry $5).
const DEAD_LETTER: &str = concat!(
    "WITH gone AS (
         DELETE FROM async_requests WHERE lease_tag = $1
         RETURNING queue, id, request_token, payload),
     kept AS (
         INSERT INTO sluicegate_dead_letters (queue, id, request_token, payload, last_error, at_ms)
         SELECT queue, id, request_token, payload, $2, ",
    now_ms!(),
    " FROM gone)
     INSERT INTO async_results (route, id, request_token, payload, expires_at, created_at)
     SELECT $4, id, request_token, $3, $5, ",
    now_ms!(),
    " FROM gone"
);

const BACKLOG: &str = "SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND dispatch_epoch = 0";
/// The waiting rows by time to deadline, on the pending partial index.
const DUE: &str = "SELECT MIN(deadline), COUNT(*) FILTER (WHERE deadline <= $2),
       COUNT(*) FILTER (WHERE deadline <= $3), COUNT(*) FILTER (WHERE deadline <= $4),
       COUNT(*) FILTER (WHERE deadline <= $5), COUNT(*) FILTER (WHERE deadline <= $6),
       COUNT(*) FILTER (WHERE deadline <= $7)
     FROM async_requests WHERE queue = $1 AND dispatch_epoch = 0";
/// Two counts, each on a partial index (upstream's pending and in-flight
/// indexes): `queue` alone has no index, so one count would scan the table.
const OUTSTANDING: &str = "SELECT
         (SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND dispatch_epoch = 0)
       + (SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND dispatch_epoch > 0)";
const LEASED: &str =
    "SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND lease_tag IS NOT NULL";
const CANCELLED: &str = "SELECT cancelled FROM async_requests WHERE lease_tag = $1";
const CLOSE: &str = "UPDATE async_requests SET dispatch_epoch = 0, lease_owner = NULL,
         lease_tag = NULL, lease_expires_ms = 0
     WHERE queue = $1 AND lease_owner = $2 AND lease_tag IS NOT NULL";

/// One claimed row.
struct Claimed {
    id: String,
    token: String,
    payload: String,
    retry_count: i32,
    tag: String,
    cancelled: bool,
    deadline: i64,
    created_at: i64,
}

impl SqlQueue {
    /// The queue `settings.queue` in the database behind `db`.
    pub fn new(db: Arc<Db>, settings: SqlQueueSettings) -> Self {
        let owner = format!(
            "{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        Self {
            db,
            settings,
            owner,
            reclaims: AtomicU64::new(0),
            dead_letters: AtomicU64::new(0),
        }
    }

    /// The shared connection.
    pub fn db(&self) -> &Arc<Db> {
        &self.db
    }

    fn lease(&self, asked: Duration) -> Duration {
        self.settings.lease_ttl.unwrap_or(asked)
    }

    fn expires_at(&self) -> i64 {
        self.settings.result_ttl_seconds.map_or(0, |ttl| {
            crate::clock::unix_secs().saturating_add(i64::try_from(ttl).unwrap_or(i64::MAX))
        })
    }

    /// Files waiting rows no producer filed into their tenant lanes
    /// (bounded per claim), then says whether the queue's waiting rows
    /// need the lane claim (`lanes::FILE_AND_PROBE`).
    async fn file_lanes(&self, lanes: &TenantLanes) -> Result<bool, QueueError> {
        let rows = (self.db)
            .query(
                lanes::FILE_AND_PROBE,
                &[
                    &self.settings.queue,
                    &lanes.attribute,
                    &lanes::FILE_PER_CLAIM,
                ],
            )
            .await
            .map_err(sql_err("file lanes"))?;
        let Some(row) = rows.first() else {
            return Ok(true);
        };
        let filed: i64 = row.get(0);
        if filed > 0 {
            tracing::debug!(queue = %self.settings.queue, filed, "rows filed into tenant lanes");
        }
        Ok(row.get::<_, Option<bool>>(1).unwrap_or(true))
    }

    async fn take(
        &self,
        max: usize,
        lease: Duration,
        expired_by: Option<i64>,
    ) -> Result<Vec<Delivery>, QueueError> {
        let reclaimed = (self.db.execute(RECLAIM, &[&self.settings.queue]).await)
            .map_err(sql_err("reclaim"))?;
        if reclaimed > 0 {
            self.reclaims.fetch_add(reclaimed, Ordering::Relaxed);
            tracing::info!(queue = %self.settings.queue, reclaimed, "expired sql leases returned to the queue");
        }
        let limit = i64::try_from(max.clamp(1, self.settings.batch_size.max(1))).unwrap_or(1);
        let lease_ms = ms(self.lease(lease));
        // The lane claim only where it takes other rows than the plain one.
        let lanes = match (expired_by, &self.settings.lanes) {
            (None, Some(lanes)) => self.file_lanes(lanes).await?.then_some(lanes),
            _ => None,
        };
        let rows = match (expired_by, lanes) {
            (None, Some(lanes)) => {
                let (tenants, weights) = lanes::weight_arrays(lanes);
                self.db
                    .query(
                        lanes::CLAIM,
                        &[
                            &self.settings.queue,
                            &limit,
                            &self.owner,
                            &lease_ms,
                            &lanes::random_start(),
                            &tenants,
                            &weights,
                        ],
                    )
                    .await
            }
            (None, None) => {
                self.db
                    .query(
                        CLAIM,
                        &[&self.settings.queue, &limit, &self.owner, &lease_ms],
                    )
                    .await
            }
            (Some(by), _) => {
                self.db
                    .query(
                        CLAIM_EXPIRED,
                        &[&self.settings.queue, &limit, &self.owner, &lease_ms, &by],
                    )
                    .await
            }
        }
        .map_err(sql_err("claim"))?;
        let mut claimed: Vec<Claimed> = rows
            .iter()
            .map(|r| Claimed {
                id: r.get(0),
                token: r.get(1),
                payload: r.get(2),
                retry_count: r.get(3),
                tag: r.get(4),
                cancelled: r.get::<_, i16>(5) != 0,
                deadline: r.get(6),
                created_at: r.get(7),
            })
            .collect();
        // `RETURNING` keeps no order: restore the claim's.
        claimed.sort_by_key(|c| (c.deadline, c.created_at));
        // Rows flagged by a cancel (upstream's producer flags, it does not
        // delete) are answered here and never handed out.
        let (cancelled, live): (Vec<Claimed>, Vec<Claimed>) =
            claimed.into_iter().partition(|c| c.cancelled);
        if !cancelled.is_empty() {
            let completions = cancelled
                .iter()
                .map(|c| Completion {
                    tag: DeliveryTag(c.tag.clone()),
                    result: ResultRecord::error(
                        &c.id,
                        token(&c.token),
                        ErrorCode::Cancelled,
                        "cancelled before dispatch",
                    ),
                })
                .collect();
            self.write_results(completions).await?;
        }
        Ok(live
            .into_iter()
            .map(|c| Delivery {
                tag: DeliveryTag(c.tag),
                body: Bytes::from(c.payload),
                retry_count: u32::try_from(c.retry_count).unwrap_or(0),
                source_id: Some(c.id),
            })
            .collect())
    }

    async fn write_results(&self, completions: Vec<Completion>) -> Result<AckReport, QueueError> {
        let mut report = AckReport::default();
        let mut seen = std::collections::HashSet::new();
        let (mut tags, mut routes, mut payloads, mut expiries) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let expires = self.expires_at();
        for Completion { tag, result } in completions {
            if !seen.insert(tag.0.clone()) {
                // The same delivery twice: only its first result counts.
                report.duplicates += 1;
                continue;
            }
            tags.push(tag.0);
            routes.push(self.settings.route.clone());
            // A result is plain strings and numbers: serialising cannot fail.
            payloads.push(serde_json::to_string(&result).unwrap_or_default());
            expiries.push(expires);
        }
        if tags.is_empty() {
            return Ok(report);
        }
        let rows = (self
            .db
            .query(ACK, &[&tags, &routes, &payloads, &expiries])
            .await)
            .map_err(sql_err("ack"))?;
        report.acked = rows.len();
        report.lease_lost = tags.len() - rows.len();
        Ok(report)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "dispatcher".to_owned())
}

impl Queue for SqlQueue {
    fn name(&self) -> &str {
        &self.settings.queue
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        // Producers are other processes: an empty table is looked at again
        // every `poll_interval`.
        Box::pin(long_poll(wait, None, move || async move {
            let got = self.take(max, lease, None).await?;
            Ok(Look::again_after(got, self.settings.poll_interval))
        }))
    }

    fn receive_expired(
        &self,
        max: usize,
        lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        if max == 0 {
            return Box::pin(std::future::ready(Ok(Vec::new())));
        }
        Box::pin(self.take(max, lease, Some(now_unix)))
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        Box::pin(self.write_results(completions))
    }

    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            let add = i32::from(reason.counts_as_failure());
            (self.db.execute(NACK, &[&tag.0, &ms(delay), &add]).await)
                .map(drop)
                .map_err(sql_err("nack"))
        })
    }

    fn requeue_after_attempt(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: AttemptRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            let rows = (self.db.query(PAYLOAD, &[&tag.0]).await).map_err(sql_err("requeue"))?;
            let Some(row) = rows.first() else {
                // The lease was lost: its new holder answers.
                return Ok(());
            };
            let payload: String = row.get(0);
            // Keep what the attempt learned in the stored message, as the
            // other transports do; an unparsable body stays as it is.
            let payload = match parse_message(payload.as_bytes()) {
                Ok(mut message) => {
                    message.internal.attempts = Some(record.attempts);
                    if record.last_answer.is_some() {
                        message.internal.last_answer = record.last_answer;
                    }
                    message.to_envelope_json()
                }
                Err(_) => payload,
            };
            let add = i32::from(reason.counts_as_failure());
            (self
                .db
                .execute(REQUEUE, &[&tag.0, &ms(delay), &add, &payload])
                .await)
                .map(drop)
                .map_err(sql_err("requeue"))
        })
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            if tags.is_empty() {
                return Ok(());
            }
            let tags: Vec<String> = tags.into_iter().map(|t| t.0).collect();
            let lease_ms = ms(self.lease(lease));
            (self.db.execute(EXTEND, &[&tags, &lease_ms]).await)
                .map(drop)
                .map_err(sql_err("extend lease"))
        })
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(async move {
            let result = ResultRecord::dead_lettered(&last_error);
            let last = serde_json::to_string(&last_error).unwrap_or_default();
            let record = serde_json::to_string(&result).unwrap_or_default();
            let n = (self.db.execute(
                DEAD_LETTER,
                &[
                    &tag.0,
                    &last,
                    &record,
                    &self.settings.route,
                    &self.expires_at(),
                ],
            ))
            .await
            .map_err(sql_err("dead letter"))?;
            if n > 0 {
                self.dead_letters.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(async move { self.count(BACKLOG, "backlog").await.map(Some) })
    }

    fn due(&self) -> BoxFuture<'_, Result<Option<DueProfile>, QueueError>> {
        Box::pin(async move {
            let now = crate::clock::unix_secs();
            let [m1, m5, m15, h1, h4, d1] = HORIZONS.map(|h| now.saturating_add(h));
            let rows = self
                .db
                .query(DUE, &[&self.settings.queue, &m1, &m5, &m15, &h1, &h4, &d1])
                .await
                .map_err(sql_err("due"))?;
            let Some(row) = rows.first() else {
                return Ok(Some(DueProfile::default()));
            };
            let mut within = [0u64; HORIZONS.len()];
            for (i, w) in within.iter_mut().enumerate() {
                *w = u64::try_from(row.get::<_, i64>(i + 1)).unwrap_or(0);
            }
            Ok(Some(DueProfile::from_counts(
                within,
                row.get::<_, Option<i64>>(0),
            )))
        })
    }

    fn records_cancels(&self) -> bool {
        true
    }

    fn cancelled(&self, tag: &DeliveryTag) -> BoxFuture<'_, bool> {
        let tag = tag.0.clone();
        Box::pin(async move {
            match self.db.query(CANCELLED, &[&tag]).await {
                Ok(rows) => rows.first().is_some_and(|r| r.get::<_, i16>(0) != 0),
                // Unreadable: send it; a cancel is best effort for leased work.
                Err(_) => false,
            }
        })
    }

    fn status(&self) -> Option<TransportStatus> {
        Some(TransportStatus {
            reachable: self.db.reachable(),
            backlog: None,
            claims_held: 0,
            reclaims_total: self.reclaims.load(Ordering::Relaxed),
            dead_letters_total: self.dead_letters.load(Ordering::Relaxed),
        })
    }

    fn close(&self) -> BoxFuture<'_, Result<usize, QueueError>> {
        Box::pin(async move {
            let n = (self
                .db
                .execute(CLOSE, &[&self.settings.queue, &self.owner])
                .await)
                .map_err(sql_err("close"))?;
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        })
    }

    fn outstanding(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(async move { self.count(OUTSTANDING, "outstanding").await.map(Some) })
    }
}

impl SqlQueue {
    async fn count(&self, sql: &'static str, op: &'static str) -> Result<u64, QueueError> {
        let rows = (self.db.query(sql, &[&self.settings.queue]).await).map_err(sql_err(op))?;
        Ok(rows
            .first()
            .map_or(0, |r| u64::try_from(r.get::<_, i64>(0)).unwrap_or(0)))
    }

    /// Rows of this queue under a lease, all holders.
    pub async fn leased_count(&self) -> Result<u64, QueueError> {
        self.count(LEASED, "leased").await
    }
}
