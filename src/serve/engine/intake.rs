//! Intake: check the input file line by line (first pass; any bad line
//! fails the batch with its line number, as OpenAI does), then enqueue its
//! requests in chunks (second pass), recording progress so a restart
//! resumes without sending a line twice.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;
use tokio::io::BufReader;

use crate::batch::input::openai_request;
use crate::clock::unix_secs;
use crate::endpoint::Endpoint;
use crate::request::{MAX_ID_LEN, Message, parse_message};
use crate::serve::files::{Line, read_line};
use crate::serve::model::{BatchRecord, BatchStatus, LineError, Stop};
use crate::serve::sink::Progress;

use super::{BOM, Engine, EngineError, enqueuing, line_error};

/// Validation errors listed in a batch; further ones are only counted.
const MAX_LISTED_ERRORS: usize = 100;

impl Engine {
    /// Starts checking and enqueuing a new batch.
    pub fn start_intake(self: &Arc<Self>, id: &str) {
        let (engine, batch) = (self.clone(), id.to_owned());
        self.spawn_step(id, "validation", async move { engine.intake(&batch).await });
    }

    /// Checks one input line and makes it the queue message of its
    /// request; `Ok(None)` for a blank line. `seen` holds the custom_ids
    /// of earlier lines.
    pub(super) fn check_line(
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

    pub(super) async fn open_input(
        &self,
        batch: &BatchRecord,
    ) -> std::io::Result<BufReader<tokio::fs::File>> {
        let file = tokio::fs::File::open(self.bodies.path(&batch.input_file_id)).await?;
        Ok(BufReader::new(file))
    }

    /// Validation (pass 1) then enqueuing (pass 2); see the module docs.
    /// A batch whose enqueuing a dead server left unfinished (`in_progress`,
    /// not `enqueued`) resumes at pass 2.
    pub(super) async fn intake(&self, id: &str) -> Result<(), EngineError> {
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

    pub(super) async fn refuse(
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
    /// Lines go in the batch's order (`lines.rs`), and each chunk with
    /// the number of positions of that order read through it
    /// (`Sink::enqueue`), so an intake resumed after its server died
    /// skips what is already enqueued and no request is sent twice.
    pub(super) async fn enqueue_all(&self, batch: &BatchRecord) -> Result<(), EngineError> {
        let done_lines = self.sink.progress(&batch.id).await?;
        let mut lines = self.input_lines(batch, done_lines).await?;
        let (mut n, mut enqueued) = (done_lines, 0u64);
        let mut seen = HashSet::new();
        let size = self.limits.intake_chunk.max(1);
        let mut chunk = Vec::with_capacity(size);
        let mut stopped: Option<Stop> = None;
        loop {
            let line = lines.next().await?;
            let end = line.is_none();
            if let Some((number, line)) = line {
                n += 1;
                if let Ok(Some(message)) = self.check_line(batch, number, &line, &mut seen) {
                    chunk.push(message);
                }
            }
            if chunk.len() < size && !end {
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
}
