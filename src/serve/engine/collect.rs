//! Collect: results the dispatcher wrote to the queue become output lines
//! of their batch (first result per request wins, so re-reading a result
//! is harmless).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::batch::output::openai_line;
use crate::queue::embedded::EmbeddedQueue;
use crate::result::{ErrorCode, ResultRecord};
use crate::serve::model::{BatchRecord, BatchStatus, Stop, new_id, split_message_id};
use crate::serve::store::{Recorded, StoreError};
use crate::tasks::sleep_unless;

use super::{Engine, EngineError};

/// How often an idle collector looks for new results.
const COLLECT_IDLE: Duration = Duration::from_millis(200);
/// Results per collector read.
const COLLECT_PAGE: usize = 500;

impl Engine {
    /// The output line of a result, and its outcome label.
    pub(super) fn output_line(
        &self,
        custom_id: &str,
        result: ResultRecord,
    ) -> (Recorded, &'static str) {
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
    pub(super) async fn record(
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
    pub(super) async fn apply(&self, results: Vec<ResultRecord>) -> Result<(), EngineError> {
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
        position: crate::serve::store::SqliteStore,
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
}
