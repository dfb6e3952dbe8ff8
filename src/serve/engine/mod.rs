//! The batch lifecycle, run by every server on the same store:
//!
//! - intake: check the input file line by line (first pass; any bad
//!   line fails the batch with its line number, as OpenAI does), then
//!   enqueue its requests in chunks (second pass), each with the batch's
//!   deadline and the tenant as its fairness attribute;
//! - collect: results the dispatcher wrote to the queue become output
//!   lines of their batch (first result per request wins, so re-reading
//!   a result is harmless);
//! - sweep: expiry, cancel, finalizing (output and error files) and the
//!   take-over of a step whose server died.
//!
//! Why two passes: a batch is refused whole when a line is bad, so no
//! request may be sent before the last line is checked, and holding the
//! file in memory is not allowed (`serve.max_file_bytes` may be large).
//!
//! One file per step: `intake.rs` (its lines in the batch's order from
//! `lines.rs`), `collect.rs`, `stop.rs`, `sweep.rs`;
//! this file holds the engine, creation and the step runner.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::BufReader;

use crate::serve::files::{Bodies, Line, read_line};
use crate::serve::model::{BatchRecord, BatchStatus, LineError, Stop};
use crate::serve::quota::{Estimate, Exceeded, TenantLimits};
use crate::serve::retention::Retention;
use crate::serve::sink::{Sink, SinkError};
use crate::serve::store::{Store, StoreError};
use crate::tasks::Tasks;
use crate::telemetry::BatchApiMetrics;

mod collect;
mod intake;
mod lines;
mod stop;
mod sweep;

/// The UTF-8 byte-order mark a file may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";
/// Requests per round trip when a stop answers or removes a batch's
/// requests (the intake's chunk is [`Limits::intake_chunk`]).
const CHUNK: usize = 500;
/// Added to [`Limits::in_flight_grace`] before a stopped batch's missing
/// results are answered by the server itself: the time a result takes
/// from the dispatcher to the collector.
const COLLECT_SLACK_SECS: i64 = 10;

/// The configured limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a request in flight when its batch stops (cancel or
    /// expiry) may still take: the gateway's attempt timeout
    /// (`gateway.attempt_timeout`), the longest one attempt runs. Its real
    /// answer is kept if it comes within it; one still missing then (say,
    /// retried after the stop) is answered by the server ([`stop_cut`]).
    pub in_flight_grace: Duration,
    /// Largest upload.
    pub max_file_bytes: u64,
    /// Largest input line.
    pub max_line_bytes: u64,
    /// Most requests per batch.
    pub max_lines: u64,
    /// How long files are kept when they name no expiry.
    pub retention: Retention,
    /// Requests per enqueue round trip of an intake (`serve.intake_chunk`).
    pub intake_chunk: usize,
    /// A step untouched this long is taken over by another server: its
    /// server died (`serve.takeover_after`).
    pub takeover_after: Duration,
}

/// A lifecycle step that failed (logged; the sweep tries again).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The queue failed.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A file body could not be read or written.
    #[error("file body: {0}")]
    Io(#[from] std::io::Error),
}

/// Why a batch could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// It would pass its tenant's limit on enqueued work.
    #[error("the batch would pass its tenant's limit ({:?} {} of {})", .0.kind, .0.held.saturating_add(.0.asked), .0.limit)]
    Limit(Exceeded),
    /// The store or the input file failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl From<StoreError> for CreateError {
    fn from(e: StoreError) -> Self {
        Self::Engine(e.into())
    }
}

/// The lifecycle runner of one server.
#[derive(Debug)]
pub struct Engine {
    /// Records.
    pub store: Store,
    /// File bodies.
    pub bodies: Bodies,
    /// The queue.
    sink: Sink,
    /// Size limits.
    pub limits: Limits,
    /// The request metadata key the tenant is written under.
    fairness: Option<String>,
    metrics: BatchApiMetrics,
    /// Batches with a step running in this process.
    running: Mutex<HashSet<String>>,
    /// `serve.tenant_limits`: checked at creation (`Engine::create`).
    tenant_limits: TenantLimits,
    /// Tenants whose enqueued-work gauges are non-zero, to zero them
    /// when their batches end.
    reported: Mutex<HashSet<String>>,
    /// The server's task tree: each batch step runs on it, named.
    tasks: Tasks,
    /// The flex and background front, set once at start: the collector
    /// hands it their results.
    pub flex: std::sync::OnceLock<Arc<crate::serve::flex::Flex>>,
}

/// Takes a batch off [`Engine`]'s `running` set when its step ends, also
/// by a panic.
struct RunningGuard {
    engine: Arc<Engine>,
    id: String,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.engine.lock_running().remove(&self.id);
    }
}

/// When the server answers a stopped batch's missing results itself, and
/// with which stop: its requests in flight had `grace_secs` (plus the
/// collector's slack) to answer, counted from the cancel or from the end
/// of the completion window. `None` while it runs unstopped.
fn stop_cut(b: &BatchRecord, grace_secs: i64) -> Option<(Stop, i64)> {
    let from = match b.stop? {
        Stop::Cancel => b.cancelling_at.unwrap_or(b.touched_at),
        Stop::Expire => b.expires_at,
    };
    let cut = from
        .saturating_add(grace_secs)
        .saturating_add(COLLECT_SLACK_SECS);
    b.stop.map(|stop| (stop, cut))
}

/// Whether `b` is `in_progress` with requests still to enqueue and no stop
/// asked: pass 2 goes on only then.
fn enqueuing(b: &BatchRecord) -> bool {
    b.status == BatchStatus::InProgress && !b.enqueued && b.stop.is_none()
}

fn line_error(code: &str, message: String, param: Option<&str>, line: Option<u64>) -> LineError {
    LineError {
        code: code.to_owned(),
        message,
        param: param.map(str::to_owned),
        line,
    }
}

impl Engine {
    /// An engine on `store`, `bodies` and `sink`.
    pub fn new(
        store: Store,
        bodies: Bodies,
        sink: Sink,
        limits: Limits,
        fairness: Option<String>,
        metrics: BatchApiMetrics,
        tasks: Tasks,
    ) -> Self {
        Self {
            tasks,
            store,
            bodies,
            sink,
            limits,
            fairness,
            metrics,
            running: Mutex::new(HashSet::new()),
            tenant_limits: TenantLimits::default(),
            reported: Mutex::new(HashSet::new()),
            flex: std::sync::OnceLock::new(),
        }
    }

    /// This engine with `serve.tenant_limits` enforced at creation.
    pub fn with_tenant_limits(mut self, limits: TenantLimits) -> Self {
        self.tenant_limits = limits;
        self
    }

    /// Saves a new batch and starts its intake, unless it would pass its
    /// tenant's limits on enqueued work: then nothing is saved. The input
    /// file is read once here to count its requests and estimate their
    /// tokens (validation reads it again), and the reservation is a
    /// compare-and-set on the tenant's version ([`Store::insert_batch_if`]),
    /// so creations racing on any server cannot overshoot the limit.
    pub async fn create(
        self: &Arc<Self>,
        mut batch: BatchRecord,
    ) -> Result<BatchRecord, CreateError> {
        let limit = self.tenant_limits.of(&batch.tenant);
        if limit.is_unlimited() {
            self.store.insert_batch(&batch).await?;
        } else {
            let asked = self.estimate(&batch.input_file_id, &batch.endpoint).await?;
            batch.held = Some(asked);
            loop {
                let version = self.store.tenant_version(&batch.tenant).await?;
                let held = self.held_by(&batch.tenant).await?;
                limit.admit(held, asked).map_err(CreateError::Limit)?;
                if self.store.insert_batch_if(&batch, version).await? {
                    break;
                }
            }
        }
        self.start_intake(&batch.id);
        Ok(batch)
    }

    /// The requests of an input file and their estimated tokens, counted
    /// as validation counts them (blank lines skipped, a leading
    /// byte-order mark ignored). A file that cannot be read holds nothing:
    /// validation refuses it.
    async fn estimate(&self, file_id: &str, endpoint: &str) -> Result<Estimate, EngineError> {
        /// The one field of a batch line the estimate reads.
        #[derive(serde::Deserialize)]
        struct Body<'a> {
            #[serde(borrow)]
            body: Option<&'a serde_json::value::RawValue>,
        }
        let mut estimate = Estimate::default();
        let Ok(file) = tokio::fs::File::open(self.bodies.path(file_id)).await else {
            return Ok(estimate);
        };
        let mut reader = BufReader::new(file);
        let mut n = 0u64;
        while let Some(line) = read_line(&mut reader, self.limits.max_line_bytes).await? {
            n += 1;
            let Line::Text(bytes) = line else {
                estimate.add_line(None, endpoint);
                continue;
            };
            let bytes: &[u8] = &bytes;
            let bytes = match n {
                1 => bytes.strip_prefix(BOM).unwrap_or(bytes),
                _ => bytes,
            };
            if bytes.trim_ascii().is_empty() {
                continue;
            }
            let body = serde_json::from_slice::<Body<'_>>(bytes).ok();
            estimate.add_line(body.and_then(|b| b.body), endpoint);
        }
        Ok(estimate)
    }

    /// What `tenant`'s unfinished batches hold against its limits now.
    async fn held_by(&self, tenant: &str) -> Result<Estimate, EngineError> {
        let mut sum = Estimate::default();
        for batch in self.store.active_batches().await? {
            let Some(held) = batch.held.filter(|_| batch.tenant == tenant) else {
                continue;
            };
            let (ok, failed) = self.store.counts(&batch.id).await?;
            sum = sum.plus(held.remaining(ok + failed));
        }
        Ok(sum)
    }

    /// Applies `change` to the stored batch with compare-and-set, reading
    /// again when another server changed it first. `change` returns
    /// `false` to leave it alone; `None` then (or when it is gone).
    pub async fn update(
        &self,
        id: &str,
        change: impl Fn(&mut BatchRecord) -> bool,
    ) -> Result<Option<BatchRecord>, StoreError> {
        loop {
            let Some(old) = self.store.batch(id).await? else {
                return Ok(None);
            };
            let mut new = old.clone();
            if !change(&mut new) {
                return Ok(None);
            }
            if self.store.replace_batch(&old, &new).await? {
                return Ok(Some(new));
            }
        }
    }

    /// Runs `step` for `id` in the background unless this process already
    /// runs one for it.
    fn spawn_step<F>(self: &Arc<Self>, id: &str, what: &'static str, step: F)
    where
        F: Future<Output = Result<(), EngineError>> + Send + 'static,
    {
        if !self.lock_running().insert(id.to_owned()) {
            return;
        }
        // Removed from `running` even if the step panics (the guard drops
        // while the panic unwinds), so a later sweep can run it again; the
        // panic itself is named by the task tree and stops the server.
        let running = RunningGuard {
            engine: self.clone(),
            id: id.to_owned(),
        };
        // A step stops where it is when the server drains: each one
        // resumes from its recorded progress (a killed server's steps are
        // taken over the same way), so shutdown never waits out an intake.
        let drain = self.tasks.drain_token().clone();
        self.tasks.spawn(format!("serve: {what} of {id}"), async move {
            tokio::select! {
                () = drain.cancelled() => {}
                done = step => if let Err(error) = done {
                    tracing::warn!(batch = %running.id, %error, "{what} failed; the sweep retries it");
                }
            }
            drop(running);
        });
    }

    /// [`Limits::in_flight_grace`] in whole seconds, rounded up.
    fn grace_secs(&self) -> i64 {
        let grace = self.limits.in_flight_grace;
        let secs = grace.as_secs() + u64::from(grace.subsec_nanos() > 0);
        i64::try_from(secs).unwrap_or(i64::MAX)
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::clock::unix_secs;
    use crate::queue::embedded::{EmbeddedClient, EmbeddedQueue};
    use crate::serve::store::SqliteStore;

    pub(super) fn engine(dir: &std::path::Path) -> Engine {
        let queue = EmbeddedQueue::open(dir.join("queue.db"), "q").expect("queue");
        Engine::new(
            Store::Sqlite(SqliteStore::open(&dir.join("batches.db")).expect("store")),
            Bodies::open(dir).expect("bodies"),
            Sink::new(Arc::new(EmbeddedClient::new(queue)), "serve.intake.".into()),
            Limits {
                in_flight_grace: Duration::from_secs(120),
                max_file_bytes: 1 << 20,
                max_line_bytes: 1 << 10,
                max_lines: 10,
                retention: Retention::new(Duration::ZERO),
                intake_chunk: CHUNK,
                takeover_after: Duration::from_secs(60),
            },
            Some("userid".into()),
            crate::telemetry::Metrics::new().batch_api("q"),
            Tasks::new(),
        )
    }

    pub(super) fn record(status: BatchStatus) -> BatchRecord {
        let mut batch = BatchRecord::new(crate::serve::model::NewBatch {
            tenant: "t".into(),
            endpoint: "/v1/completions".into(),
            input_file_id: "file-x".into(),
            completion_window: "1h".into(),
            window_secs: 3600,
            metadata: Default::default(),
            output_expires_after: None,
        });
        batch.status = status;
        batch
    }

    #[test]
    fn stopped_batches_wait_for_requests_in_flight_for_the_grace() {
        let mut b = record(BatchStatus::InProgress);
        assert_eq!(stop_cut(&b, 120), None, "a running batch is never cut");
        b.stop = Some(Stop::Expire);
        assert_eq!(
            stop_cut(&b, 120),
            Some((Stop::Expire, b.expires_at + 120 + COLLECT_SLACK_SECS))
        );
        b.status = BatchStatus::Cancelling;
        b.stop = Some(Stop::Cancel);
        b.cancelling_at = Some(b.created_at + 5);
        // From the cancel, as long as an attempt may take: not a fixed 30 s.
        assert_eq!(
            stop_cut(&b, 600),
            Some((Stop::Cancel, b.created_at + 5 + 600 + COLLECT_SLACK_SECS))
        );
    }

    /// A batch record written by an older build lacks fields added since
    /// (`enqueued`, `output_expires_after`): read back, it re-encodes with
    /// their defaults, so a compare-and-set by text never matched it and
    /// every update of that batch lost the race forever.
    #[tokio::test]
    async fn a_record_written_before_a_field_was_added_can_still_be_replaced() {
        let dir =
            std::env::temp_dir().join(format!("sluicegate-engine-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("dir");
        let db = dir.join("batches.db");
        let store = Store::Sqlite(SqliteStore::open(&db).expect("store"));
        let batch = record(BatchStatus::InProgress);
        store.insert_batch(&batch).await.expect("insert");
        // Rewrite the stored text the way the older build wrote it.
        let stored: String = {
            let c = rusqlite::Connection::open(&db).expect("open");
            let text: String = c
                .query_row(
                    "SELECT record FROM batches WHERE id = ?1",
                    [&batch.id],
                    |r| r.get(0),
                )
                .expect("row");
            let mut old: serde_json::Map<String, Value> =
                serde_json::from_str(&text).expect("json");
            old.remove("enqueued");
            old.remove("output_expires_after");
            let old = serde_json::to_string(&old).expect("text");
            c.execute(
                "UPDATE batches SET record = ?1 WHERE id = ?2",
                [&old, &batch.id],
            )
            .expect("rewrite");
            old
        };
        let read = store.batch(&batch.id).await.expect("read").expect("there");
        assert_ne!(serde_json::to_string(&read).expect("text"), stored);
        let mut next = read.clone();
        next.total = 7;
        assert!(store.replace_batch(&read, &next).await.expect("replace"));
        let after = store.batch(&batch.id).await.expect("read").expect("there");
        assert_eq!(after.total, 7);
        // A record someone else changed still loses.
        let mut stale = read.clone();
        stale.total = 9;
        assert!(!store.replace_batch(&read, &stale).await.expect("replace"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A cancel that lands while validation is refusing the file must
    /// still let the batch end (`cancelled`, nothing enqueued), not leave
    /// it `cancelling` forever.
    #[tokio::test]
    async fn a_cancel_during_a_refused_validation_still_ends() {
        let dir =
            std::env::temp_dir().join(format!("sluicegate-engine-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("dir");
        let engine = Arc::new(engine(&dir));
        let mut batch = record(BatchStatus::Cancelling);
        batch.stop = Some(Stop::Cancel);
        batch.cancelling_at = Some(unix_secs());
        engine.store.insert_batch(&batch).await.expect("insert");
        let error = line_error("invalid_json_line", "line 1: bad".into(), None, Some(1));
        engine
            .refuse(&batch.id, vec![error], 0)
            .await
            .expect("refuse");
        let after = engine
            .store
            .batch(&batch.id)
            .await
            .expect("read")
            .expect("kept");
        assert!(after.enqueued, "{after:?}");
        assert_eq!(after.total, 0);
        engine.sweep().await.expect("sweep");
        // The sweep runs the finalizing step in the background.
        let mut status = after.status;
        for _ in 0..100 {
            status = engine
                .store
                .batch(&batch.id)
                .await
                .expect("read")
                .expect("kept")
                .status;
            if status.is_terminal() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(status, BatchStatus::Cancelled);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
