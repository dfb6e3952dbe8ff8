//! Collect: results the dispatcher wrote to the queue become output lines
//! of their batch (first result per request wins, so re-reading a result
//! is harmless).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::batch::output::openai_line;
use crate::queue::{Cursor, ReadResult, ResultPage};
use crate::result::{ErrorCode, ResultRecord};
use crate::serve::flex::is_flex_id;
use crate::serve::model::{BatchRecord, BatchStatus, Stop, new_id, split_message_id};
use crate::serve::responses::is_response_id;
use crate::serve::store::Recorded;
use crate::tasks::sleep_unless;

use super::{Engine, EngineError};

/// How often an idle collector looks for new results.
const COLLECT_IDLE: Duration = Duration::from_millis(200);
/// Results per collector read.
const COLLECT_PAGE: usize = 500;

/// Whether this server reads the result: a batch line's, a flex
/// request's or a background response's.
fn is_ours(id: &str) -> bool {
    split_message_id(id).is_some() || is_flex_id(id) || is_response_id(id)
}

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

    /// Flex results to their held connections (one whose client left
    /// is dropped: nobody waits for it), background responses' into
    /// their records.
    async fn route(&self, results: Vec<ResultRecord>) -> Result<(), EngineError> {
        let Some(flex) = self.flex.get() else {
            return Ok(());
        };
        let (responses, flexes): (Vec<ResultRecord>, Vec<ResultRecord>) =
            results.into_iter().partition(|r| is_response_id(&r.id));
        for result in flexes {
            flex.deliver(&self.store, result).await?;
        }
        crate::serve::responses::apply(&self.store, flex, responses).await?;
        Ok(())
    }

    /// Applies the queue's results from the saved position on, until
    /// `stop`. A page is confirmed only after it is recorded (re-reading
    /// is harmless: the first result per request wins); results of other
    /// producers are handed back to the client as foreign (a Redis list
    /// keeps them in `<list>-unclaimed`, never dropped).
    pub async fn collect(self: Arc<Self>, stop: CancellationToken) {
        let client = self.sink.client().clone();
        let mut cursor = Cursor(self.store.collected_up_to().await.unwrap_or(0));
        while !stop.is_cancelled() {
            let page = match client.results(cursor, COLLECT_PAGE).await {
                Ok(page) => page,
                Err(error) => {
                    tracing::warn!(%error, "cannot read results; retrying");
                    ResultPage::default()
                }
            };
            if page.results.is_empty() {
                if sleep_unless(&stop, COLLECT_IDLE).await {
                    continue;
                }
                return;
            }
            let (ours, foreign): (Vec<ReadResult>, Vec<ReadResult>) = (page.results.into_iter())
                .partition(|r| (r.record.as_ref()).is_some_and(|r| is_ours(&r.id)));
            let (routed, records): (Vec<ResultRecord>, Vec<ResultRecord>) =
                (ours.iter().filter_map(|r| r.record.clone()))
                    .partition(|r| split_message_id(&r.id).is_none());
            let applied = match self.route(routed).await {
                Ok(()) => self.apply(records).await,
                Err(error) => Err(error),
            };
            let settled = match applied {
                Ok(()) => client
                    .confirm(ours, foreign)
                    .await
                    .map_err(EngineError::from),
                Err(error) => Err(error),
            };
            if let Err(error) = settled {
                tracing::warn!(%error, "cannot record results; retrying");
                if !sleep_unless(&stop, COLLECT_IDLE).await {
                    return;
                }
                continue;
            }
            if page.cursor != cursor {
                cursor = page.cursor;
                if let Err(error) = self.store.set_collected_up_to(cursor.0).await {
                    tracing::warn!(%error, "cannot save the collector position");
                }
            }
        }
    }
}
