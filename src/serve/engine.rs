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

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio_util::sync::CancellationToken;

use super::files::{Bodies, Line, read_line};
use super::model::{
    BatchRecord, BatchStatus, FileRecord, LineError, Stop, new_id, split_message_id,
};
use super::quota::{Estimate, Exceeded, TenantLimits};
use super::retention::Retention;
use super::sink::{Progress, Sink, SinkError};
use super::store::{Recorded, Store, StoreError};
use crate::batch::endpoint::Endpoint;
use crate::batch::input::openai_request;
use crate::batch::output::openai_line;
use crate::clock::unix_secs;
use crate::queue::embedded::EmbeddedQueue;
use crate::request::{MAX_ID_LEN, Message, parse_message};
use crate::result::{ErrorCode, ResultRecord};
use crate::tasks::{Tasks, sleep_unless};
use crate::telemetry::BatchApiMetrics;

/// The UTF-8 byte-order mark a file may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";
/// Validation errors listed in a batch; further ones are only counted.
const MAX_LISTED_ERRORS: usize = 100;
/// Requests per enqueue round trip.
const CHUNK: usize = 500;
/// A step (validation, finalizing) untouched this long is taken over by
/// another server: its server died.
const STALE_SECS: i64 = 60;
/// Added to [`Limits::in_flight_grace`] before a stopped batch's missing
/// results are answered by the server itself: the time a result takes
/// from the dispatcher to the collector.
const COLLECT_SLACK_SECS: i64 = 10;
/// How often the sweep runs.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
/// How often an idle collector looks for new results.
const COLLECT_IDLE: Duration = Duration::from_millis(200);
/// Results per collector read.
const COLLECT_PAGE: usize = 500;
/// Output lines per store read while writing the files.
const FILE_PAGE: usize = 1000;

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

/// The error message of a request answered by the server itself.
fn stop_message(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::DeadlineExceeded => {
            "the batch's completion window ended before this request ran"
        }
        _ => "the batch was cancelled before this request ran",
    }
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
            let asked = self.estimate(&batch.input_file_id).await?;
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
    async fn estimate(&self, file_id: &str) -> Result<Estimate, EngineError> {
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
                estimate.add_line(None);
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
            estimate.add_line(body.and_then(|b| b.body));
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

    /// Starts checking and enqueuing a new batch.
    pub fn start_intake(self: &Arc<Self>, id: &str) {
        let (engine, batch) = (self.clone(), id.to_owned());
        self.spawn_step(id, "validation", async move { engine.intake(&batch).await });
    }

    /// Checks one input line and makes it the queue message of its
    /// request; `Ok(None)` for a blank line. `seen` holds the custom_ids
    /// of earlier lines.
    fn check_line(
        &self,
        batch: &BatchRecord,
        n: u64,
        line: &Line,
        seen: &mut HashSet<String>,
    ) -> Result<Option<Message>, LineError> {
        let Line::Text(bytes) = line else {
            let max = self.limits.max_line_bytes;
            return Err(line_error(
                "line_too_long",
                format!("line {n} is longer than {max} bytes (serve.max_line_bytes)"),
                None,
                Some(n),
            ));
        };
        let invalid_json = |why: String| {
            line_error(
                "invalid_json_line",
                format!("line {n}: {why}"),
                None,
                Some(n),
            )
        };
        // Editors on Windows start files with a UTF-8 byte-order mark;
        // OpenAI accepts such a file, so it is skipped on line 1.
        let bytes: &[u8] = bytes;
        let bytes = match n {
            1 => bytes.strip_prefix(BOM).unwrap_or(bytes),
            _ => bytes,
        };
        let text =
            std::str::from_utf8(bytes).map_err(|e| invalid_json(format!("not UTF-8: {e}")))?;
        if text.trim().is_empty() {
            return Ok(None);
        }
        let object = match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(object)) => object,
            Ok(_) => return Err(invalid_json("not a JSON object".into())),
            Err(e) => return Err(invalid_json(format!("not valid JSON: {e}"))),
        };
        let invalid = |why: String, param: Option<&str>| {
            line_error(
                "invalid_request",
                format!("line {n}: {why}"),
                param,
                Some(n),
            )
        };
        // The deadline leaves room for a request sent just before expiry
        // to get its answer; the server itself stops unsent requests at
        // `expires_at` (`Engine::expire`).
        let deadline = batch.expires_at.saturating_add(self.grace_secs());
        let body = openai_request(text, deadline).map_err(|(_, why)| invalid(why, None))?;
        let mut message = parse_message(&body).map_err(|f| invalid(f.reason, None))?;
        if message.request.endpoint.as_deref() != Some(batch.endpoint.as_str()) {
            return Err(line_error(
                "mismatched_endpoint",
                format!(
                    "line {n}: url {} differs from the batch's endpoint {}",
                    message.request.endpoint.as_deref().unwrap_or_default(),
                    batch.endpoint
                ),
                Some("url"),
                Some(n),
            ));
        }
        // `openai_request` took only lines whose body is an object.
        if let (Some(endpoint), Some(Value::Object(body))) =
            (Endpoint::parse(&batch.endpoint), object.get("body"))
        {
            endpoint.check_body(body).map_err(|e| {
                line_error(
                    "invalid_request",
                    format!("line {n}: {}", e.message),
                    Some(e.param),
                    Some(n),
                )
            })?;
        }
        let custom_id = message.request.id.clone();
        if batch.message_id(&custom_id).len() > MAX_ID_LEN {
            let max = MAX_ID_LEN - batch.message_id("").len();
            return Err(invalid(
                format!("custom_id is longer than {max} bytes"),
                Some("custom_id"),
            ));
        }
        if !seen.insert(custom_id.clone()) {
            return Err(line_error(
                "duplicate_custom_id",
                format!("line {n}: custom_id `{custom_id}` is used by an earlier line"),
                Some("custom_id"),
                Some(n),
            ));
        }
        message.request.id = batch.message_id(&custom_id);
        // A batch line has no headers of its own (OpenAI's format): the
        // ones passed from the creation are all it carries.
        message.request.headers.clone_from(&batch.headers);
        if let Some(key) = &self.fairness {
            message
                .request
                .metadata
                .insert(key.clone(), batch.tenant.clone());
        }
        Ok(Some(message))
    }

    async fn open_input(&self, batch: &BatchRecord) -> std::io::Result<BufReader<tokio::fs::File>> {
        let file = tokio::fs::File::open(self.bodies.path(&batch.input_file_id)).await?;
        Ok(BufReader::new(file))
    }

    /// Validation (pass 1) then enqueuing (pass 2); see the module docs.
    /// A batch whose enqueuing a dead server left unfinished (`in_progress`,
    /// not `enqueued`) resumes at pass 2.
    async fn intake(&self, id: &str) -> Result<(), EngineError> {
        let Some(batch) = self
            .update(id, |b| {
                b.touched_at = unix_secs();
                b.status == BatchStatus::Validating || enqueuing(b)
            })
            .await?
        else {
            return Ok(());
        };
        if batch.status == BatchStatus::InProgress {
            return self.enqueue_all(&batch).await;
        }
        let (mut errors, mut omitted) = (Vec::new(), 0u64);
        let mut push = |e: LineError| {
            if errors.len() < MAX_LISTED_ERRORS {
                errors.push(e);
            } else {
                omitted += 1;
            }
        };
        let mut reader = match self.open_input(&batch).await {
            Ok(r) => r,
            Err(e) => {
                push(line_error(
                    "invalid_input_file",
                    format!("the input file cannot be read: {e}"),
                    Some("input_file_id"),
                    None,
                ));
                return self.refuse(id, errors, omitted).await;
            }
        };
        let (mut n, mut count) = (0u64, 0u64);
        let mut seen = HashSet::new();
        while let Some(line) = read_line(&mut reader, self.limits.max_line_bytes).await? {
            n += 1;
            match self.check_line(&batch, n, &line, &mut seen) {
                Ok(None) => continue,
                Ok(Some(_)) => {}
                Err(e) => push(e),
            }
            count += 1;
            if count > self.limits.max_lines {
                push(line_error(
                    "too_many_lines",
                    format!(
                        "line {n}: the batch has more than {} requests (serve.max_lines_per_batch)",
                        self.limits.max_lines
                    ),
                    None,
                    Some(n),
                ));
                break;
            }
        }
        if count == 0 {
            push(line_error(
                "empty_file",
                "the input file has no requests".into(),
                Some("input_file_id"),
                None,
            ));
        }
        if !errors.is_empty() {
            return self.refuse(id, errors, omitted).await;
        }
        // Every line is valid: the batch leaves `validating` with its
        // total known before the first request is enqueued, so no result
        // is ever counted against a total of 0 (issue 26: `completed 100,
        // total 0` was read while the first chunks ran during pass 2).
        let at = unix_secs();
        let started = self
            .update(id, |b| {
                match b.status {
                    BatchStatus::Validating => {
                        b.status = BatchStatus::InProgress;
                        b.in_progress_at = Some(at);
                        b.total = count;
                    }
                    // Cancelled during validation: nothing was enqueued, so
                    // it ends `cancelled` with no requests (the sweep
                    // finalizes it).
                    BatchStatus::Cancelling if !b.enqueued => {
                        b.total = 0;
                        b.enqueued = true;
                    }
                    _ => return false,
                }
                b.touched_at = at;
                true
            })
            .await?;
        match started {
            Some(batch) if batch.status == BatchStatus::InProgress => {
                self.enqueue_all(&batch).await
            }
            _ => Ok(()),
        }
    }

    async fn refuse(
        &self,
        id: &str,
        errors: Vec<LineError>,
        omitted: u64,
    ) -> Result<(), EngineError> {
        tracing::info!(batch = %id, errors = errors.len() as u64 + omitted, "batch input refused");
        self.update(id, |b| {
            match b.status {
                BatchStatus::Validating => {
                    b.status = BatchStatus::Failed;
                    b.failed_at = Some(unix_secs());
                    b.errors = errors.clone();
                    b.errors_omitted = omitted;
                }
                // Cancelled meanwhile: nothing was enqueued, so it may end
                // `cancelled` at once (the sweep finalizes it).
                BatchStatus::Cancelling => {
                    b.total = 0;
                    b.enqueued = true;
                }
                _ => return false,
            }
            true
        })
        .await?;
        Ok(())
    }

    /// Pass 2: every line (all valid now) into the queue, a chunk at a
    /// time, while the batch is `in_progress` with its total known. A
    /// cancel or expiry that arrives meanwhile stops it between chunks:
    /// the requests never enqueued are answered at once with the stop's
    /// code (`batch_cancelled`, `batch_expired`), so the counts still
    /// reach the total.
    ///
    /// Each chunk goes in with the number of lines read through it
    /// (`Sink::enqueue`), so an intake resumed after its server died
    /// skips what is already enqueued and no request is sent twice.
    async fn enqueue_all(&self, batch: &BatchRecord) -> Result<(), EngineError> {
        let mut reader = self.open_input(batch).await?;
        let done_lines = self.sink.progress(&batch.id).await?;
        let (mut n, mut enqueued) = (0u64, 0u64);
        let mut seen = HashSet::new();
        let mut chunk = Vec::with_capacity(CHUNK);
        let mut stopped: Option<Stop> = None;
        loop {
            let line = read_line(&mut reader, self.limits.max_line_bytes).await?;
            let end = line.is_none();
            if let Some(line) = line {
                n += 1;
                if n <= done_lines {
                    continue;
                }
                if let Ok(Some(message)) = self.check_line(batch, n, &line, &mut seen) {
                    chunk.push(message);
                }
            }
            if chunk.len() < CHUNK && !end {
                continue;
            }
            if stopped.is_none() {
                let now_record = self
                    .update(&batch.id, |b| {
                        b.touched_at = unix_secs();
                        enqueuing(b)
                    })
                    .await?;
                if now_record.is_none() {
                    let current = self.store.batch(&batch.id).await?;
                    stopped = Some(current.and_then(|b| b.stop).unwrap_or(Stop::Cancel));
                }
            }
            match stopped {
                None => {
                    enqueued += chunk.len() as u64;
                    let progress = Progress {
                        batch: &batch.id,
                        lines: n,
                    };
                    self.sink
                        .enqueue(std::mem::take(&mut chunk), progress)
                        .await?;
                }
                Some(stop) => {
                    let unsent = std::mem::take(&mut chunk);
                    self.answer_unsent(batch, stop, unsent).await?;
                }
            }
            if end {
                break;
            }
        }
        let done = self
            .update(&batch.id, |b| {
                if b.enqueued
                    || !matches!(b.status, BatchStatus::InProgress | BatchStatus::Cancelling)
                {
                    return false;
                }
                b.enqueued = true;
                b.touched_at = unix_secs();
                true
            })
            .await?;
        // A stop that arrived while the last chunk went in found nothing
        // enqueued to stop: stop it here.
        if stopped.is_some() || done.is_some_and(|b| b.stop.is_some()) {
            self.stop_requests(batch).await?;
        }
        // `enqueued` is set: no intake resumes, the progress has served.
        self.sink.forget_progress(&batch.id).await?;
        tracing::info!(batch = %batch.id, requests = enqueued, resumed_after = done_lines, "batch enqueued");
        Ok(())
    }

    /// Answers requests that were never enqueued because the batch stopped
    /// first.
    async fn answer_unsent(
        &self,
        batch: &BatchRecord,
        stop: Stop,
        unsent: Vec<Message>,
    ) -> Result<(), EngineError> {
        let code = match stop {
            Stop::Cancel => ErrorCode::Cancelled,
            Stop::Expire => ErrorCode::DeadlineExceeded,
        };
        let items = unsent
            .iter()
            .filter_map(|m| split_message_id(&m.request.id))
            .map(|(_, custom_id)| {
                let result = ResultRecord::error(
                    &batch.message_id(custom_id),
                    None,
                    code,
                    stop_message(code),
                );
                self.output_line(custom_id, result)
            })
            .collect();
        self.record(&batch.id, items).await
    }

    /// Asks the queue to stop the batch's requests not yet sent.
    async fn stop_requests(&self, batch: &BatchRecord) -> Result<(), EngineError> {
        let ids = match self.sink.needs_ids() {
            true => self.message_ids(batch).await?,
            false => Vec::new(),
        };
        self.sink.cancel(&batch.id, ids).await?;
        Ok(())
    }

    /// The message ids of the batch's requests (read from its input file).
    async fn message_ids(&self, batch: &BatchRecord) -> Result<Vec<String>, EngineError> {
        Ok(self
            .custom_ids(batch)
            .await?
            .iter()
            .map(|c| batch.message_id(c))
            .collect())
    }

    async fn custom_ids(&self, batch: &BatchRecord) -> Result<Vec<String>, EngineError> {
        let mut reader = self.open_input(batch).await?;
        let (mut n, mut seen, mut ids) = (0u64, HashSet::new(), Vec::new());
        while let Some(line) = read_line(&mut reader, self.limits.max_line_bytes).await? {
            n += 1;
            if let Ok(Some(m)) = self.check_line(batch, n, &line, &mut seen) {
                ids.push(
                    m.request
                        .id
                        .split_once(':')
                        .map_or(String::new(), |(_, c)| c.to_owned()),
                );
            }
        }
        Ok(ids)
    }

    /// `POST /v1/batches/{id}/cancel`: `cancelling` at once; requests not
    /// yet sent are stopped, those in flight finish, and the sweep
    /// finalizes it `cancelled` with the results so far.
    pub async fn cancel(&self, id: &str) -> Result<Option<BatchRecord>, EngineError> {
        let at = unix_secs();
        let Some(batch) = self
            .update(id, |b| {
                if !matches!(b.status, BatchStatus::Validating | BatchStatus::InProgress)
                    || b.stop.is_some()
                {
                    return false;
                }
                b.status = BatchStatus::Cancelling;
                b.stop = Some(Stop::Cancel);
                b.cancelling_at = Some(at);
                true
            })
            .await?
        else {
            return Ok(self.store.batch(id).await?);
        };
        if batch.enqueued {
            self.stop_requests(&batch).await?;
        }
        Ok(Some(batch))
    }

    /// Answers every request of the batch without a result yet with
    /// `code` (expired or cancelled), so it can be finalized.
    async fn fill_missing(&self, batch: &BatchRecord, code: ErrorCode) -> Result<(), EngineError> {
        let message = stop_message(code);
        let ids = self.custom_ids(batch).await?;
        for chunk in ids.chunks(CHUNK) {
            let items = chunk
                .iter()
                .map(|custom_id| {
                    let id = batch.message_id(custom_id);
                    let result = ResultRecord::error(&id, None, code, message);
                    self.output_line(custom_id, result)
                })
                .collect();
            self.record(&batch.id, items).await?;
        }
        Ok(())
    }

    /// The output line of a result, and its outcome label.
    fn output_line(&self, custom_id: &str, result: ResultRecord) -> (Recorded, &'static str) {
        let outcome = match (result.status_code, result.error_code) {
            (Some(s), _) if (200..300).contains(&s) => "completed",
            (_, Some(ErrorCode::DeadlineExceeded)) => "expired",
            (_, Some(ErrorCode::Cancelled)) => "cancelled",
            _ => "failed",
        };
        let line = openai_line(&new_id("batch_req_"), custom_id, &result).to_string();
        let recorded = Recorded {
            custom_id: custom_id.to_owned(),
            ok: outcome == "completed",
            line,
        };
        (recorded, outcome)
    }

    /// Records a batch's output lines (first per request wins) and counts
    /// the new ones by outcome.
    async fn record(
        &self,
        batch: &str,
        items: Vec<(Recorded, &'static str)>,
    ) -> Result<(), EngineError> {
        let (lines, outcomes): (Vec<Recorded>, Vec<&'static str>) = items.into_iter().unzip();
        let new = self.store.record_results(batch, &lines).await?;
        for (added, outcome) in new.into_iter().zip(outcomes) {
            if added {
                self.metrics.request(outcome);
            }
        }
        Ok(())
    }

    /// Results from the queue into their batches' output lines; other
    /// results (not a batch request, a finished batch) are ignored. One
    /// store write per batch.
    async fn apply(&self, results: Vec<ResultRecord>) -> Result<(), EngineError> {
        let mut batches: HashMap<String, Option<BatchRecord>> = HashMap::new();
        let mut items: HashMap<String, Vec<(Recorded, &'static str)>> = HashMap::new();
        for mut result in results {
            let Some((batch_id, custom_id)) = split_message_id(&result.id) else {
                continue;
            };
            let (batch_id, custom_id) = (batch_id.to_owned(), custom_id.to_owned());
            if !batches.contains_key(&batch_id) {
                let batch = self.store.batch(&batch_id).await?;
                batches.insert(batch_id.clone(), batch);
            }
            let Some(Some(batch)) = batches.get(&batch_id) else {
                continue;
            };
            if batch.status.is_terminal() || batch.status == BatchStatus::Finalizing {
                continue;
            }
            // A request the expiry stopped reads as expired, not cancelled.
            if batch.stop == Some(Stop::Expire) && result.error_code == Some(ErrorCode::Cancelled) {
                result.error_code = Some(ErrorCode::DeadlineExceeded);
            }
            let item = self.output_line(&custom_id, result);
            items.entry(batch_id).or_default().push(item);
        }
        for (batch, items) in items {
            self.record(&batch, items).await?;
        }
        Ok(())
    }

    /// Applies results of the embedded queue from the saved position on,
    /// until `stop`.
    pub async fn collect_embedded(
        self: Arc<Self>,
        queue: EmbeddedQueue,
        position: super::store::SqliteStore,
        stop: CancellationToken,
    ) {
        let mut after = position.collected_up_to().await.unwrap_or(0);
        while !stop.is_cancelled() {
            let q = queue.clone();
            let page =
                tokio::task::spawn_blocking(move || q.results_after(after, COLLECT_PAGE)).await;
            let rows = match page {
                Ok(Ok(rows)) => rows,
                Ok(Err(error)) => {
                    tracing::warn!(%error, "cannot read results; retrying");
                    Vec::new()
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot read results; retrying");
                    Vec::new()
                }
            };
            if rows.is_empty() {
                if sleep_unless(&stop, COLLECT_IDLE).await {
                    continue;
                }
                return;
            }
            let last = rows.last().map_or(after, |r| r.0);
            let applied = match self.apply(rows.into_iter().map(|r| r.1).collect()).await {
                Ok(()) => last,
                Err(error) => {
                    tracing::warn!(%error, "cannot record results; retrying");
                    after
                }
            };
            if applied != after {
                after = applied;
                if let Err(error) = position.set_collected_up_to(after).await {
                    tracing::warn!(%error, "cannot save the collector position");
                }
            } else if !sleep_unless(&stop, COLLECT_IDLE).await {
                return;
            }
        }
    }

    /// Applies results from the Redis result `list`, oldest first, until
    /// `stop`. An entry is removed only after it is recorded; results of
    /// other producers are moved to `<list>-unclaimed`, never dropped.
    pub async fn collect_redis(
        self: Arc<Self>,
        conn: crate::redis::RedisConnection,
        list: String,
        stop: CancellationToken,
    ) {
        let unclaimed = format!("{list}-unclaimed");
        let mut conn = conn;
        while !stop.is_cancelled() {
            let items: Result<Vec<String>, _> = redis::cmd("LRANGE")
                .arg(&list)
                .arg(-(COLLECT_PAGE as i64))
                .arg(-1)
                .query_async(&mut conn)
                .await;
            let items = match items {
                Ok(items) => items,
                Err(error) => {
                    tracing::warn!(%error, "cannot read results from redis; retrying");
                    Vec::new()
                }
            };
            if items.is_empty() {
                if sleep_unless(&stop, COLLECT_IDLE).await {
                    continue;
                }
                return;
            }
            // LPUSH puts the newest first: the tail is the oldest.
            for item in items.iter().rev() {
                let result: Option<ResultRecord> = serde_json::from_str(item).ok();
                let ours = result
                    .as_ref()
                    .is_some_and(|r| split_message_id(&r.id).is_some());
                let step = async {
                    match result {
                        Some(r) if ours => self.apply(vec![r]).await?,
                        _ => {
                            redis::cmd("LPUSH")
                                .arg(&unclaimed)
                                .arg(item)
                                .query_async::<()>(&mut conn)
                                .await
                                .map_err(StoreError::from)?;
                        }
                    }
                    redis::cmd("LREM")
                        .arg(&list)
                        .arg(-1)
                        .arg(item)
                        .query_async::<()>(&mut conn)
                        .await
                        .map_err(StoreError::from)?;
                    Ok::<(), EngineError>(())
                };
                if let Err(error) = step.await {
                    tracing::warn!(%error, "cannot record a result; retrying");
                    if !sleep_unless(&stop, COLLECT_IDLE).await {
                        return;
                    }
                    break;
                }
            }
        }
    }

    /// Runs [`Engine::sweep`] until `stop`.
    pub async fn run_sweeps(self: Arc<Self>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            if let Err(error) = self.sweep().await {
                tracing::warn!(%error, "batch sweep failed; retrying");
            }
            if !sleep_unless(&stop, SWEEP_EVERY).await {
                return;
            }
        }
    }

    /// One pass over the active batches: take-overs, expiry, and
    /// finalizing those whose every request has a result. Also refreshes
    /// the `batches` gauge.
    pub async fn sweep(self: &Arc<Self>) -> Result<(), EngineError> {
        let at = unix_secs();
        let active = self.store.active_batches().await?;
        self.report_holdings(&active).await?;
        for batch in active {
            let mine = self.lock_running().contains(&batch.id);
            let stale = at - batch.touched_at >= STALE_SECS;
            match batch.status {
                BatchStatus::Validating if !mine && stale => self.start_intake(&batch.id),
                BatchStatus::InProgress
                    if at >= batch.expires_at && batch.stop.is_none() && !mine =>
                {
                    let (engine, id) = (self.clone(), batch.id.clone());
                    self.spawn_step(&batch.id, "expiry", async move { engine.expire(&id).await });
                }
                // Its server died while enqueuing: resume pass 2.
                BatchStatus::InProgress if enqueuing(&batch) && !mine && stale => {
                    self.start_intake(&batch.id);
                }
                // Cancelled while its validating server died: take over.
                BatchStatus::Cancelling if !batch.enqueued && !mine && stale => {
                    let (engine, b) = (self.clone(), batch.clone());
                    self.spawn_step(&batch.id, "cancel", async move {
                        engine.adopt_cancelled(&b).await
                    });
                }
                BatchStatus::InProgress | BatchStatus::Cancelling
                    if (batch.enqueued || batch.stop == Some(Stop::Expire)) && !mine =>
                {
                    let (ok, failed) = self.store.counts(&batch.id).await?;
                    let (engine, b) = (self.clone(), batch.clone());
                    if batch.enqueued && ok + failed >= batch.total {
                        self.spawn_step(&batch.id, "finalizing", async move {
                            engine.finalize(&b.id).await
                        });
                    } else if let Some((stop, cut)) = stop_cut(&batch, self.grace_secs())
                        && at >= cut
                    {
                        let code = match stop {
                            Stop::Cancel => ErrorCode::Cancelled,
                            Stop::Expire => ErrorCode::DeadlineExceeded,
                        };
                        self.spawn_step(&batch.id, "stop", async move {
                            engine.fill_missing(&b, code).await?;
                            engine.finalize(&b.id).await
                        });
                    }
                }
                BatchStatus::Finalizing if !mine && stale => {
                    let (engine, id) = (self.clone(), batch.id.clone());
                    self.spawn_step(&batch.id, "finalizing", async move {
                        engine.finalize(&id).await
                    });
                }
                _ => {}
            }
        }
        for (status, n) in self.store.status_counts().await? {
            self.metrics.set_batches(status.as_str(), n);
        }
        Ok(())
    }

    /// Sets the enqueued-work gauges of every tenant whose batches hold
    /// a reservation (`serve.tenant_limits`), and 0 for those reported
    /// before whose batches have all ended.
    async fn report_holdings(&self, active: &[BatchRecord]) -> Result<(), EngineError> {
        let mut held: HashMap<String, Estimate> = HashMap::new();
        for batch in active {
            let Some(reserved) = batch.held else {
                continue;
            };
            let (ok, failed) = self.store.counts(&batch.id).await?;
            let sum = held.entry(batch.tenant.clone()).or_default();
            *sum = sum.plus(reserved.remaining(ok + failed));
        }
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        for tenant in reported.iter().filter(|t| !held.contains_key(*t)) {
            self.metrics.set_tenant_enqueued(tenant, 0, 0);
        }
        for (tenant, e) in &held {
            self.metrics
                .set_tenant_enqueued(tenant, e.requests, e.tokens);
        }
        *reported = held.into_keys().collect();
        Ok(())
    }

    /// A batch cancelled while its validating server died: whatever that
    /// server enqueued is stopped, and every valid line counts, so the
    /// cancel grace answers the rest and finalizes it.
    async fn adopt_cancelled(&self, batch: &BatchRecord) -> Result<(), EngineError> {
        let total = self.custom_ids(batch).await?.len() as u64;
        self.stop_requests(batch).await?;
        self.update(&batch.id, |b| {
            if b.status != BatchStatus::Cancelling || b.enqueued {
                return false;
            }
            b.total = total;
            b.enqueued = true;
            b.touched_at = unix_secs();
            true
        })
        .await?;
        // No intake resumes now: drop the dead one's progress.
        self.sink.forget_progress(&batch.id).await?;
        Ok(())
    }

    /// The completion window ended: requests not yet sent are stopped
    /// (answered `batch_expired`); those in flight keep their real answer
    /// if it comes within the grace. The sweep finalizes the batch
    /// `expired` once every request has a result, or at the grace's end
    /// answering the rest `batch_expired` ([`stop_cut`]).
    async fn expire(&self, id: &str) -> Result<(), EngineError> {
        let Some(batch) = self
            .update(id, |b| {
                if b.status != BatchStatus::InProgress || b.stop.is_some() {
                    return false;
                }
                b.stop = Some(Stop::Expire);
                b.touched_at = unix_secs();
                true
            })
            .await?
        else {
            return Ok(());
        };
        // Also when not all enqueued: a server whose intake died may have
        // enqueued some; a live intake stops at its next chunk.
        self.stop_requests(&batch).await?;
        Ok(())
    }

    /// Writes the output and error files of a batch whose requests all
    /// have results, then ends it `completed`, `expired` or `cancelled`.
    /// Re-entrant: a server taking over rewrites the same file ids.
    async fn finalize(&self, id: &str) -> Result<(), EngineError> {
        let Some(batch) = self
            .update(id, |b| {
                if !matches!(
                    b.status,
                    BatchStatus::InProgress | BatchStatus::Cancelling | BatchStatus::Finalizing
                ) {
                    return false;
                }
                if b.status != BatchStatus::Finalizing {
                    b.finalizing_at = Some(unix_secs());
                }
                b.status = BatchStatus::Finalizing;
                b.touched_at = unix_secs();
                true
            })
            .await?
        else {
            return Ok(());
        };
        let hex = batch.id.trim_start_matches("batch_");
        let (out_id, err_id) = (format!("file-out-{hex}"), format!("file-err-{hex}"));
        let (out_tmp, err_tmp) = (self.bodies.temp(), self.bodies.temp());
        let mut out = BufWriter::new(tokio::fs::File::create(&out_tmp).await?);
        let mut err = BufWriter::new(tokio::fs::File::create(&err_tmp).await?);
        let (mut out_bytes, mut err_bytes) = (0u64, 0u64);
        let mut cursor = Some(0u64);
        while let Some(from) = cursor {
            let (page, next) = self.store.result_page(&batch.id, from, FILE_PAGE).await?;
            for (ok, line) in page {
                let (file, bytes) = match ok {
                    true => (&mut out, &mut out_bytes),
                    false => (&mut err, &mut err_bytes),
                };
                file.write_all(line.as_bytes()).await?;
                file.write_all(b"\n").await?;
                *bytes += line.len() as u64 + 1;
            }
            cursor = next;
        }
        for file in [&mut out, &mut err] {
            file.flush().await?;
            file.get_ref().sync_all().await?;
        }
        let output = self
            .keep_file(&batch, &out_tmp, out_id, out_bytes, "output")
            .await?;
        let errors = self
            .keep_file(&batch, &err_tmp, err_id, err_bytes, "error")
            .await?;
        let at = unix_secs();
        let done = self
            .update(id, |b| {
                if b.status != BatchStatus::Finalizing {
                    return false;
                }
                b.output_file_id = output.clone();
                b.error_file_id = errors.clone();
                match b.stop {
                    None => {
                        b.status = BatchStatus::Completed;
                        b.completed_at = Some(at);
                    }
                    Some(Stop::Cancel) => {
                        b.status = BatchStatus::Cancelled;
                        b.cancelled_at = Some(at);
                    }
                    Some(Stop::Expire) => {
                        b.status = BatchStatus::Expired;
                        b.expired_at = Some(at);
                    }
                }
                true
            })
            .await?;
        if let Some(done) = done {
            tracing::info!(batch = %id, status = done.status.as_str(), "batch finished");
            self.store.drop_results(id).await?;
        }
        Ok(())
    }

    /// Makes a written output file a stored file of the batch's tenant;
    /// an empty one is discarded (its id stays `null`, as OpenAI does).
    async fn keep_file(
        &self,
        batch: &BatchRecord,
        temp: &std::path::Path,
        id: String,
        bytes: u64,
        name: &str,
    ) -> Result<Option<String>, EngineError> {
        if bytes == 0 {
            let _ = tokio::fs::remove_file(temp).await;
            return Ok(None);
        }
        self.bodies.commit(temp, &id).await?;
        // Anchored at the file's creation, not the batch's (as OpenAI
        // anchors `output_expires_after`).
        let created_at = unix_secs();
        let file = FileRecord {
            id: id.clone(),
            tenant: batch.tenant.clone(),
            bytes,
            created_at,
            filename: format!("{}_{name}.jsonl", batch.id),
            purpose: "batch_output".into(),
            expires_at: (self.limits.retention).expires_at(created_at, batch.output_expires_after),
        };
        self.store.put_file(&file).await?;
        Ok(Some(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::store::SqliteStore;

    fn engine(dir: &std::path::Path) -> Engine {
        let queue = EmbeddedQueue::open(dir.join("queue.db"), "q").expect("queue");
        Engine::new(
            Store::Sqlite(SqliteStore::open(&dir.join("batches.db")).expect("store")),
            Bodies::open(dir).expect("bodies"),
            Sink::Embedded(queue),
            Limits {
                in_flight_grace: Duration::from_secs(120),
                max_file_bytes: 1 << 20,
                max_line_bytes: 1 << 10,
                max_lines: 10,
                retention: Retention::new(Duration::ZERO),
            },
            Some("userid".into()),
            crate::telemetry::Metrics::new().batch_api("q"),
            Tasks::new(),
        )
    }

    fn record(status: BatchStatus) -> BatchRecord {
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
