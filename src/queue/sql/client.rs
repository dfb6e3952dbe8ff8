//! The producer's side of the `sql` transport: plain methods on
//! [`SqlClient`], one statement each, and [`SqlQueueClient`], the
//! [`crate::queue::Client`] face of one queue and its result route.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio_postgres::types::ToSql;

use crate::config::EndpointUrl;
use crate::postgres::{Db, SqlError, TlsKeys, partition_of};
use crate::queue::QueueError;
use crate::queue::client::{
    CancelOutcome, Client, ClientError, Cursor, Description, Mark, Outgoing, ReadResult,
    ResultPage, SubmissionRecord, Submitted,
};
use crate::queue::idempotency;
use crate::request::parse_message;
use crate::result::{ErrorCode, ResultRecord};

/// Rows per insert statement (upstream's enqueue chunk).
const CHUNK: usize = 1000;

/// A producer's handle on the database.
#[derive(Debug, Clone)]
pub struct SqlClient {
    db: Arc<Db>,
}

/// One stored result, with its write position.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResult {
    /// Write position (`async_results.seq`): pass the last one seen as the
    /// cursor of the next read.
    pub seq: i64,
    /// The request id (`async_results.id`).
    pub id: String,
    /// The result record; `None` when the payload is not one of ours
    /// (then `raw` holds it).
    pub record: Option<ResultRecord>,
    /// The payload column as stored.
    pub raw: String,
}

/// What [`SqlClient::cancel`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SqlCancel {
    /// Waiting rows removed and answered `CANCELLED`.
    pub cancelled: u64,
    /// Rows under a lease: flagged; the dispatcher answers them
    /// `CANCELLED` unless they were already sent.
    pub in_flight: u64,
}

/// `$8` is each row's tenant lane (`NULL`: not filed, the dispatcher's
/// claims file it, as they file upstream's producer's rows).
const INSERT: &str = "INSERT INTO async_requests (id, request_token, queue, partition_id, deadline, payload, created_at, tenant)
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::bigint[], $6::text[], $7::bigint[], $8::text[])
     ON CONFLICT (id, request_token) DO NOTHING";
/// `INSERT` guarded by an idempotency record (`$9` queue, `$10` key, `$11`
/// record, `$12` expiry): one statement, so the record and the rows are
/// written together or not at all. Returns how many records it inserted
/// (0: the key was taken, no row was inserted).
const IDEM_INSERT: &str = "WITH rec AS (
         INSERT INTO sluicegate_idempotency (queue, key, record, expires_at)
         VALUES ($9, $10, $11, $12)
         ON CONFLICT (queue, key) DO NOTHING
         RETURNING 1),
     ins AS (
         INSERT INTO async_requests (id, request_token, queue, partition_id, deadline, payload, created_at, tenant)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::bigint[], $6::text[], $7::bigint[], $8::text[])
         WHERE EXISTS (SELECT 1 FROM rec)
         ON CONFLICT (id, request_token) DO NOTHING
         RETURNING 1)
     SELECT (SELECT COUNT(*) FROM rec), (SELECT COUNT(*) FROM ins)";
const IDEM_EXPIRE: &str =
    "DELETE FROM sluicegate_idempotency WHERE queue = $1 AND expires_at <= $2";
const IDEM_LOOKUP: &str = "SELECT record FROM sluicegate_idempotency
     WHERE queue = $1 AND key = $2 AND expires_at > $3";
const FLAG: &str =
    "UPDATE async_requests SET cancelled = 1 WHERE queue = $1 AND id = ANY($2::text[])
     RETURNING id, request_token, lease_tag IS NOT NULL";
const CANCEL: &str = concat!(
    "WITH input AS (
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS t(id, request_token, payload)),
     gone AS (
         DELETE FROM async_requests r USING input i
         WHERE r.queue = $4 AND r.id = i.id AND r.request_token = i.request_token
             AND r.lease_tag IS NULL AND r.dispatch_epoch = 0
         RETURNING r.id, r.request_token)
     INSERT INTO async_results (route, id, request_token, payload, expires_at, created_at)
     SELECT $5, g.id, g.request_token, i.payload, 0, ",
    now_ms!(),
    " FROM gone g JOIN input i ON i.id = g.id AND i.request_token = g.request_token
     RETURNING seq"
);
/// Results of route $1 after seq $2 (at most $3, in seq order), up to
/// the first row of any route that follows a missing seq and was written
/// less than $4 ms ago (by the database's clock, as `created_at` was).
///
/// `seq` is taken when a row is inserted, not when its transaction
/// commits: a result written at seq 100 may commit after another at 101,
/// and a reader whose cursor had passed 101 would never see 100 (the
/// chaos soak lost sight of 3 of 50 000 results this way). A missing seq
/// right behind a fresh row may be such a result still committing; one
/// behind an older row was taken before it and is long settled (deleted,
/// rolled back, or skipped by a restart), so the reader passes it.
const RESULTS_AFTER: &str = concat!(
    "WITH page AS (
         SELECT seq, id, payload FROM async_results
         WHERE route = $1 AND seq > $2 ORDER BY seq LIMIT $3),
     span AS (
         SELECT seq, created_at, seq - lag(seq, 1, $2) OVER (ORDER BY seq) AS step
         FROM async_results WHERE seq > $2 AND seq <= (SELECT max(seq) FROM page)),
     hold AS (
         SELECT min(seq) AS seq FROM span WHERE step > 1 AND created_at > ",
    now_ms!(),
    " - $4)
     SELECT p.seq, p.id, p.payload FROM page p, hold h
     WHERE h.seq IS NULL OR p.seq < h.seq ORDER BY p.seq"
);
/// How long a missing seq holds readers back: a result's statement
/// commits within milliseconds of its insert, so a row written this long
/// ago has every lower seq that will ever commit beside it. A transaction
/// held open longer than this can still be passed over.
const RESULT_SETTLE_MS: i64 = 2_000;
const ACTIVE: &str =
    "SELECT DISTINCT id FROM async_requests WHERE queue = $1 AND id = ANY($2::text[])";
/// Each part on one of upstream's partial indexes (`queue` alone has none).
const OUTSTANDING: &str = "SELECT
         (SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND dispatch_epoch = 0)
       + (SELECT COUNT(*) FROM async_requests WHERE queue = $1 AND dispatch_epoch > 0)";
const ANY_LEFT: &str = "SELECT
         EXISTS (SELECT 1 FROM async_requests WHERE queue = $1 AND dispatch_epoch = 0)
      OR EXISTS (SELECT 1 FROM async_requests WHERE queue = $1 AND dispatch_epoch > 0)";
const RESULT_COUNT: &str = "SELECT COUNT(*) FROM async_results WHERE route = $1";
const PURGE_REQUESTS: &str = "DELETE FROM async_requests WHERE queue = $1";
const PURGE_DEAD: &str = "DELETE FROM sluicegate_dead_letters WHERE queue = $1";
const PURGE_RESULTS: &str = "DELETE FROM async_results WHERE route = $1";
const DEAD_COUNT: &str = "SELECT COUNT(*) FROM sluicegate_dead_letters WHERE queue = $1";

impl SqlClient {
    /// Connects to `url` (TLS as its `sslmode` / `sslrootcert` say) and
    /// creates the schema if it is missing.
    pub async fn open(url: &EndpointUrl, connect_timeout: Duration) -> Result<Self, SqlError> {
        Ok(Self {
            db: Db::open(url, &TlsKeys::default(), connect_timeout).await?,
        })
    }

    /// A client on an open connection.
    pub fn with_db(db: Arc<Db>) -> Self {
        Self { db }
    }

    /// Enqueues message bytes into `queue`, each with its deadline (Unix
    /// seconds), in submission order; the id and token are read from the
    /// bytes (an unparsable message is stored under a hash of its bytes).
    /// A row whose `(id, request_token)` is already queued is skipped.
    /// Returns how many rows were inserted. Files no tenant lane, as
    /// upstream's producer writes rows: [`SqlClient::enqueue_in_lanes`].
    pub async fn enqueue(
        &self,
        queue: &str,
        items: &[(Bytes, i64)],
    ) -> Result<u64, tokio_postgres::Error> {
        self.enqueue_in_lanes(queue, items, None).await
    }

    /// [`SqlClient::enqueue`], each row filed in its tenant's lane by
    /// `attribute` (the dispatcher's `[gateway] fairness_attribute`), so
    /// its claims need not file it themselves: one write per row fewer.
    pub async fn enqueue_in_lanes(
        &self,
        queue: &str,
        items: &[(Bytes, i64)],
        attribute: Option<&str>,
    ) -> Result<u64, tokio_postgres::Error> {
        let created = now_micros();
        let mut inserted = 0;
        for (c, chunk) in items.chunks(CHUNK).enumerate() {
            let rows = Rows::new(queue, chunk, created, c * CHUNK, attribute);
            inserted += self.db.execute(INSERT, &rows.params()).await?;
        }
        Ok(inserted)
    }

    /// [`SqlClient::enqueue_in_lanes`] with an idempotency record of `key`
    /// (kept until `expires_at`, Unix s), in one statement: when `queue`
    /// already records `key`, nothing is inserted and the recorded text is
    /// returned. Expired records are removed first.
    pub async fn enqueue_idempotent(
        &self,
        queue: &str,
        items: &[(Bytes, i64)],
        attribute: Option<&str>,
        key: &str,
        record: &str,
        expires_at: i64,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let now = crate::clock::unix_secs();
        self.db.execute(IDEM_EXPIRE, &[&queue, &now]).await?;
        let rows = Rows::new(queue, items, now_micros(), 0, attribute);
        let mut params = rows.params();
        params.extend([&queue as &(dyn ToSql + Sync), &key, &record, &expires_at]);
        let found = self.db.query(IDEM_INSERT, &params).await?;
        let inserted = found.first().is_some_and(|r| r.get::<_, i64>(0) > 0);
        match inserted {
            true => Ok(None),
            // Recorded by this statement's rival, or before: read it (a
            // rival's commit may postdate this statement's snapshot).
            false => self.idempotency_record(queue, key).await,
        }
    }

    /// The record `queue` keeps under `key`, unless it has expired.
    pub async fn idempotency_record(
        &self,
        queue: &str,
        key: &str,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let now = crate::clock::unix_secs();
        let rows = self.db.query(IDEM_LOOKUP, &[&queue, &key, &now]).await?;
        Ok(rows.first().map(|r| r.get(0)))
    }

    /// Cancels every unsettled row of `queue` with one of `ids`: waiting
    /// rows are removed and answered `CANCELLED` under `route`; leased
    /// rows are flagged (upstream's `cancelled` column) for their
    /// dispatcher.
    pub async fn cancel(
        &self,
        queue: &str,
        route: &str,
        ids: &[String],
    ) -> Result<SqlCancel, tokio_postgres::Error> {
        let flagged = self.db.query(FLAG, &[&queue, &ids]).await?;
        let (mut wids, mut tokens, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
        for row in flagged.iter().filter(|r| !r.get::<_, bool>(2)) {
            let id: String = row.get(0);
            let token: String = row.get(1);
            let record = ResultRecord::error(
                &id,
                (!token.is_empty()).then_some(token.as_str()),
                ErrorCode::Cancelled,
                "cancelled before dispatch",
            );
            payloads.push(serde_json::to_string(&record).unwrap_or_default());
            wids.push(id);
            tokens.push(token);
        }
        let cancelled = match wids.is_empty() {
            true => 0,
            false => {
                let rows = (self.db)
                    .query(CANCEL, &[&wids, &tokens, &payloads, &queue, &route])
                    .await?;
                rows.len() as u64
            }
        };
        Ok(SqlCancel {
            cancelled,
            in_flight: (flagged.len() as u64).saturating_sub(cancelled),
        })
    }

    /// Results of `route` written after position `after`, at most `limit`,
    /// in write order, short of a position a result may still be
    /// committing to (see `RESULT_SETTLE_MS`); they stay in the table
    /// (upstream's consumer pops them, this reader does not).
    pub async fn results_after(
        &self,
        route: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<StoredResult>, tokio_postgres::Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .db
            .query(RESULTS_AFTER, &[&route, &after, &limit, &RESULT_SETTLE_MS])
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let raw: String = r.get(2);
                StoredResult {
                    seq: r.get(0),
                    id: r.get(1),
                    record: serde_json::from_str(&raw).ok(),
                    raw,
                }
            })
            .collect())
    }

    /// The ids among `ids` that still have an unsettled row in `queue`.
    pub async fn active_ids(
        &self,
        queue: &str,
        ids: &[String],
    ) -> Result<Vec<String>, tokio_postgres::Error> {
        let rows = self.db.query(ACTIVE, &[&queue, &ids]).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Deletes every row of `queue`, its dead letters and the results of
    /// `route`, then vacuums the tables: benchmarks start from the same
    /// state each run (without the vacuum, each run's claims would skip
    /// the dead index entries of every run before it, autovacuum waking
    /// only once a minute).
    pub async fn purge(&self, queue: &str, route: &str) -> Result<(), tokio_postgres::Error> {
        self.db.execute(PURGE_REQUESTS, &[&queue]).await?;
        self.db.execute(PURGE_DEAD, &[&queue]).await?;
        self.db.execute(PURGE_RESULTS, &[&route]).await?;
        self.db
            .batch_execute("VACUUM (ANALYZE) async_requests, async_results")
            .await
    }

    /// Unsettled rows of `queue` (waiting, delayed or leased).
    pub async fn outstanding(&self, queue: &str) -> Result<u64, tokio_postgres::Error> {
        self.count(OUTSTANDING, queue).await
    }

    /// Whether `queue` has any unsettled row (one index probe each for
    /// waiting and leased rows: cheap enough to poll).
    pub async fn any_left(&self, queue: &str) -> Result<bool, tokio_postgres::Error> {
        let rows = self.db.query(ANY_LEFT, &[&queue]).await?;
        Ok(rows.first().is_some_and(|r| r.get(0)))
    }

    /// Results stored under `route`.
    pub async fn result_count(&self, route: &str) -> Result<u64, tokio_postgres::Error> {
        self.count(RESULT_COUNT, route).await
    }

    /// Dead letters of `queue`.
    pub async fn dead_letter_count(&self, queue: &str) -> Result<u64, tokio_postgres::Error> {
        self.count(DEAD_COUNT, queue).await
    }

    async fn count(&self, sql: &'static str, arg: &str) -> Result<u64, tokio_postgres::Error> {
        let rows = self.db.query(sql, &[&arg]).await?;
        Ok(rows
            .first()
            .map_or(0, |r| u64::try_from(r.get::<_, i64>(0)).unwrap_or(0)))
    }
}

/// [`SqlClient`] on one queue and its result route: the transport's
/// [`Client`]. Results stay in the table; the cursor is their write
/// position (`async_results.seq`).
#[derive(Debug, Clone)]
pub struct SqlQueueClient {
    client: SqlClient,
    queue: String,
    route: String,
    /// The dispatcher's fairness attribute: rows are filed in their
    /// tenant's lane as they are inserted.
    fairness_attribute: Option<String>,
}

impl SqlQueueClient {
    /// The client of `queue`, whose results are written under `route`; it
    /// files no lane (see [`SqlQueueClient::in_lanes`]).
    pub fn new(client: SqlClient, queue: String, route: String) -> Self {
        Self {
            client,
            queue,
            route,
            fairness_attribute: None,
        }
    }

    /// This client filing each row in its tenant's lane by `attribute`
    /// (`None`: no lane, the dispatcher's claims file the rows).
    #[must_use]
    pub fn in_lanes(mut self, attribute: Option<String>) -> Self {
        self.fairness_attribute = attribute;
        self
    }

    fn error(op: &'static str) -> impl Fn(tokio_postgres::Error) -> ClientError {
        move |source| QueueError::Sql { op, source }.into()
    }
}

impl Client for SqlQueueClient {
    fn describe(&self) -> Description {
        Description {
            place: format!("queue `{}` (sql)", self.queue),
            results: format!("route `{}`", self.route),
            items: "messages",
            active: "waiting in this queue",
        }
    }

    fn transport(&self) -> &'static str {
        "sql"
    }

    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>> {
        Box::pin(async move {
            self.refuse_mark(mark.as_ref())?;
            let items = Outgoing::rows(requests);
            let lanes = self.fairness_attribute.as_deref();
            (self
                .client
                .enqueue_in_lanes(&self.queue, &items, lanes)
                .await)
                .map_err(Self::error("enqueue"))
        })
    }

    fn enqueue_idempotent(
        &self,
        key: String,
        requests: Vec<Outgoing>,
        keep: Duration,
    ) -> BoxFuture<'_, Result<Submitted, ClientError>> {
        Box::pin(async move {
            let record =
                idempotency::prepare(&key, &requests, &self.queue, &self.route, keep)?.record;
            let items = Outgoing::rows(requests);
            let text = idempotency::encode(&record);
            let found = (self.client)
                .enqueue_idempotent(
                    &self.queue,
                    &items,
                    self.fairness_attribute.as_deref(),
                    &key,
                    &text,
                    record.expires_at,
                )
                .await
                .map_err(Self::error("enqueue idempotently"))?;
            idempotency::settle(record, found)
        })
    }

    fn lookup(&self, key: String) -> BoxFuture<'_, Result<Option<SubmissionRecord>, ClientError>> {
        Box::pin(async move {
            let text = (self.client.idempotency_record(&self.queue, &key).await)
                .map_err(Self::error("look up an idempotency key"))?;
            idempotency::read(&key, text)
        })
    }

    /// One statement per id, so each gets its own outcome.
    fn cancel(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(ids.len());
            for id in &ids {
                let done = (self.client)
                    .cancel(&self.queue, &self.route, std::slice::from_ref(id))
                    .await
                    .map_err(Self::error("cancel"))?;
                outcomes.push(match done {
                    SqlCancel { cancelled: 1.., .. } => CancelOutcome::Cancelled,
                    SqlCancel { in_flight: 1.., .. } => CancelOutcome::InFlight,
                    SqlCancel { .. } => CancelOutcome::NotActive,
                });
            }
            Ok(outcomes)
        })
    }

    fn results(
        &self,
        cursor: Cursor,
        max: usize,
    ) -> BoxFuture<'_, Result<ResultPage, ClientError>> {
        Box::pin(async move {
            let rows = (self.client.results_after(&self.route, cursor.0, max).await)
                .map_err(Self::error("read results"))?;
            let cursor = rows.last().map_or(cursor, |r| Cursor(r.seq));
            let results = (rows.into_iter())
                .map(|r| ReadResult::kept(r.raw))
                .collect();
            Ok(ResultPage { results, cursor })
        })
    }

    fn active(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>> {
        Box::pin(async move {
            let active = (self.client.active_ids(&self.queue, &ids).await)
                .map_err(Self::error("check active ids"))?;
            // In the order given (the statement's order is the table's).
            Ok(Some(
                ids.into_iter().filter(|id| active.contains(id)).collect(),
            ))
        })
    }
}

/// The columns of rows to insert, as the arrays `INSERT` unnests.
struct Rows {
    ids: Vec<String>,
    tokens: Vec<String>,
    queues: Vec<String>,
    parts: Vec<i32>,
    deadlines: Vec<i64>,
    payloads: Vec<String>,
    created: Vec<i64>,
    tenants: Vec<Option<String>>,
}

impl Rows {
    /// The rows of `items` in `queue`; the id and token are read from the
    /// bytes (an unparsable message is stored under a hash of its bytes).
    /// `created_at` counts up from `created` by position (`first` is the
    /// position of the first item), so rows keep submission order. With
    /// `attribute` each row is filed in its tenant's lane, read as the
    /// claims' `sluicegate_tenant_of` reads it.
    fn new(
        queue: &str,
        items: &[(Bytes, i64)],
        created: i64,
        first: usize,
        attribute: Option<&str>,
    ) -> Self {
        let n = items.len();
        let mut rows = Self {
            ids: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            queues: vec![queue.to_owned(); n],
            parts: Vec::with_capacity(n),
            deadlines: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            created: Vec::with_capacity(n),
            tenants: Vec::with_capacity(n),
        };
        for (i, (body, deadline)) in items.iter().enumerate() {
            let (id, token) = match parse_message(body) {
                Ok(m) => (
                    m.request.id.clone(),
                    m.token().unwrap_or_default().to_owned(),
                ),
                Err(_) => (format!("{:016x}", fxhash(body)), String::new()),
            };
            rows.parts.push(partition_of(&id));
            rows.ids.push(id);
            rows.tokens.push(token);
            rows.deadlines.push(*deadline);
            rows.payloads
                .push(String::from_utf8_lossy(body).into_owned());
            let seq = i64::try_from(first + i).unwrap_or(i64::MAX);
            rows.created.push(created.saturating_add(seq));
            rows.tenants
                .push(attribute.map(|a| crate::queue::lanes::tenant_of(body, a)));
        }
        rows
    }

    /// `$1`–`$8` of `INSERT`.
    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.ids,
            &self.tokens,
            &self.queues,
            &self.parts,
            &self.deadlines,
            &self.payloads,
            &self.created,
            &self.tenants,
        ]
    }
}

/// Now in Unix microseconds (`async_requests.created_at`).
fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// FNV-1a 64 of a body: a stable row id for a message without one.
fn fxhash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
