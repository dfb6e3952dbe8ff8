//! The sweep: finalizing (output and error files), expiry and the
//! take-over of a step whose server died; and the gauges it refreshes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufWriter};
use tokio_util::sync::CancellationToken;

use crate::clock::unix_secs;
use crate::result::ErrorCode;
use crate::serve::model::{BatchRecord, BatchStatus, FileRecord, Stop};
use crate::serve::quota::Estimate;
use crate::tasks::sleep_unless;

use super::{Engine, EngineError, enqueuing, stop_cut};

/// Output lines per store read while writing the files.
const FILE_PAGE: usize = 1000;
/// How often the sweep runs.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

impl Engine {
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
        // A step (validation, enqueuing, finalizing) untouched this long is
        // taken over by another server: its server died.
        let after = self.limits.takeover_after;
        let after = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        let stale_secs = i64::try_from(after).unwrap_or(i64::MAX);
        let active = self.store.active_batches().await?;
        self.report_holdings(&active).await?;
        for batch in active {
            let mine = self.lock_running().contains(&batch.id);
            let stale = at - batch.touched_at >= stale_secs;
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
    pub(super) async fn report_holdings(&self, active: &[BatchRecord]) -> Result<(), EngineError> {
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

    /// Writes the output and error files of a batch whose requests all
    /// have results, then ends it `completed`, `expired` or `cancelled`.
    /// Re-entrant: a server taking over rewrites the same file ids.
    pub(super) async fn finalize(&self, id: &str) -> Result<(), EngineError> {
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
    pub(super) async fn keep_file(
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
