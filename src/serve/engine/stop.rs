//! Stopping a batch: cancel and expiry, answering what was never sent and,
//! after the grace, what never came back.

use std::collections::HashSet;

use crate::clock::unix_secs;
use crate::request::Message;
use crate::result::{ErrorCode, ResultRecord};
use crate::serve::files::read_line;
use crate::serve::model::{BatchRecord, BatchStatus, Stop, split_message_id};

use super::{CHUNK, Engine, EngineError};

/// The error message of a request answered by the server itself.
fn stop_message(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::DeadlineExceeded => {
            "the batch's completion window ended before this request ran"
        }
        _ => "the batch was cancelled before this request ran",
    }
}

impl Engine {
    /// Answers requests that were never enqueued because the batch stopped
    /// first.
    pub(super) async fn answer_unsent(
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

    /// Asks the queue to stop the batch's requests not yet sent. A
    /// cancel also aborts those in flight (the dispatcher's cancel
    /// watcher); an expiry leaves every request a dispatcher holds to
    /// finish, so the answers in flight are kept within the grace.
    pub(super) async fn stop_requests(&self, batch: &BatchRecord) -> Result<(), EngineError> {
        let ids = self.message_ids(batch).await?;
        match batch.stop {
            Some(Stop::Expire) => self.sink.expire(ids).await?,
            _ => self.sink.cancel(ids).await?,
        }
        Ok(())
    }

    /// The message ids of the batch's requests (read from its input file).
    pub(super) async fn message_ids(
        &self,
        batch: &BatchRecord,
    ) -> Result<Vec<String>, EngineError> {
        Ok(self
            .custom_ids(batch)
            .await?
            .iter()
            .map(|c| batch.message_id(c))
            .collect())
    }

    pub(super) async fn custom_ids(&self, batch: &BatchRecord) -> Result<Vec<String>, EngineError> {
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
    pub(super) async fn fill_missing(
        &self,
        batch: &BatchRecord,
        code: ErrorCode,
    ) -> Result<(), EngineError> {
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

    /// A batch cancelled while its validating server died: whatever that
    /// server enqueued is stopped, and every valid line counts, so the
    /// cancel grace answers the rest and finalizes it.
    pub(super) async fn adopt_cancelled(&self, batch: &BatchRecord) -> Result<(), EngineError> {
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
    pub(super) async fn expire(&self, id: &str) -> Result<(), EngineError> {
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
}
