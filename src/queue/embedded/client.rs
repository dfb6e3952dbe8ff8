//! The embedded store's client face ([`crate::queue::Client`]): requests
//! and marks in one transaction, cancels that answer waiting messages at
//! once, results read by write position (they stay in the store).

use std::time::Duration;

use futures_util::future::BoxFuture;

use super::{EmbeddedCancel, EmbeddedError, EmbeddedQueue};
use crate::queue::QueueError;
use crate::queue::client::{
    CancelOutcome, Client, ClientError, Cursor, Description, Mark, Outgoing, ReadResult,
    ResultPage, SubmissionRecord, Submitted,
};
use crate::queue::idempotency;

/// A producer and result reader on one queue of an embedded store.
#[derive(Debug, Clone)]
pub struct EmbeddedClient {
    queue: EmbeddedQueue,
}

impl EmbeddedClient {
    /// A client of `queue`.
    pub fn new(queue: EmbeddedQueue) -> Self {
        Self { queue }
    }

    /// Runs a store operation off the async runtime (SQLite blocks).
    async fn off_thread<T, F>(&self, f: F) -> Result<T, ClientError>
    where
        T: Send + 'static,
        F: FnOnce(&EmbeddedQueue) -> Result<T, EmbeddedError> + Send + 'static,
    {
        let queue = self.queue.clone();
        match tokio::task::spawn_blocking(move || f(&queue)).await {
            Ok(done) => done.map_err(|e| ClientError::Queue(e.into())),
            Err(e) => Err(QueueError::Task(e).into()),
        }
    }

    /// Why the queue has no results: messages still waiting, or none at
    /// all here (most often another queue name, so the store's queues are
    /// named).
    fn explain_empty(queue: &EmbeddedQueue) -> String {
        let name = queue.inner.queue.as_str();
        let path = queue.path().display();
        let waiting = queue.unsettled_count().unwrap_or(0);
        let dead = queue.dead_letter_count().unwrap_or(0);
        if waiting > 0 || dead > 0 {
            return format!(
                "queue `{name}` in {path}: no results yet; {waiting} messages waiting, {dead} dead letters"
            );
        }
        let others: Vec<String> = (queue.queue_names().unwrap_or_default().into_iter())
            .filter(|q| q != name)
            .map(|q| format!("`{q}`"))
            .collect();
        match others.is_empty() {
            true => format!(
                "queue `{name}` in {path} has no messages and no results; the store is empty"
            ),
            false => format!(
                "queue `{name}` in {path} has no messages and no results; the store holds queues {} (pick one with --queue)",
                others.join(", ")
            ),
        }
    }
}

impl Client for EmbeddedClient {
    fn describe(&self) -> Description {
        let place = format!(
            "queue `{}` ({})",
            self.queue.inner.queue,
            self.queue.path().display()
        );
        Description {
            results: place.clone(),
            place,
            items: "messages",
            active: "waiting in this queue",
        }
    }

    fn transport(&self) -> &'static str {
        "embedded"
    }

    fn enqueue(
        &self,
        requests: Vec<Outgoing>,
        mark: Option<Mark>,
    ) -> BoxFuture<'_, Result<u64, ClientError>> {
        Box::pin(async move {
            let n = requests.len() as u64;
            let items = Outgoing::rows(requests);
            self.off_thread(move |queue| {
                let meta: Vec<(&str, &str)> = (mark.iter())
                    .map(|m| (m.key.as_str(), m.value.as_str()))
                    .collect();
                queue.enqueue_with_deadlines(&items, &meta)
            })
            .await?;
            Ok(n)
        })
    }

    fn enqueue_idempotent(
        &self,
        key: String,
        requests: Vec<Outgoing>,
        keep: Duration,
    ) -> BoxFuture<'_, Result<Submitted, ClientError>> {
        Box::pin(async move {
            let queue = self.queue.inner.queue.clone();
            let record = idempotency::prepare(&key, &requests, &queue, &queue, keep)?.record;
            let items = Outgoing::rows(requests);
            let (text, expires_at) = (idempotency::encode(&record), record.expires_at);
            let store_key = key.clone();
            let found = self
                .off_thread(move |q| q.enqueue_idempotent(&items, &store_key, &text, expires_at))
                .await?;
            idempotency::settle(record, found)
        })
    }

    fn lookup(&self, key: String) -> BoxFuture<'_, Result<Option<SubmissionRecord>, ClientError>> {
        Box::pin(async move {
            let store_key = key.clone();
            let text = (self.off_thread(move |q| q.idempotency_record(&store_key))).await?;
            idempotency::read(&key, text)
        })
    }

    fn mark(&self, key: String) -> BoxFuture<'_, Result<Option<String>, ClientError>> {
        Box::pin(self.off_thread(move |queue| queue.meta(&key)))
    }

    fn forget_mark(&self, key: String) -> BoxFuture<'_, Result<(), ClientError>> {
        Box::pin(self.off_thread(move |queue| queue.remove_meta(&key)))
    }

    fn cancel(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(async move {
            let each = self.off_thread(move |queue| queue.cancel_ids(&ids)).await?;
            Ok(each.into_iter().map(outcome).collect())
        })
    }

    fn expire(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<CancelOutcome>, ClientError>> {
        Box::pin(async move {
            let each = self.off_thread(move |queue| queue.expire_ids(&ids)).await?;
            Ok(each.into_iter().map(outcome).collect())
        })
    }

    fn withdraw(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<bool>, ClientError>> {
        Box::pin(self.off_thread(move |queue| queue.withdraw_ids(&ids)))
    }

    fn leased(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Vec<bool>, ClientError>> {
        Box::pin(self.off_thread(move |queue| queue.leased_ids(&ids)))
    }

    fn results(
        &self,
        cursor: Cursor,
        max: usize,
    ) -> BoxFuture<'_, Result<ResultPage, ClientError>> {
        Box::pin(async move {
            let rows = self
                .off_thread(move |queue| queue.results_after(cursor.0, max))
                .await?;
            let cursor = rows.last().map_or(cursor, |(seq, _)| Cursor(*seq));
            let results = (rows.into_iter())
                // A result is plain strings and numbers: serialising cannot
                // fail, and gives back the text the store holds.
                .map(|(_, record)| {
                    ReadResult::kept(serde_json::to_string(&record).unwrap_or_default())
                })
                .collect();
            Ok(ResultPage { results, cursor })
        })
    }

    /// The ids still waiting, delayed or leased in this queue.
    fn active(&self, ids: Vec<String>) -> BoxFuture<'_, Result<Option<Vec<String>>, ClientError>> {
        Box::pin(async move {
            let pending = self.off_thread(EmbeddedQueue::pending_ids).await?;
            Ok(Some(
                (ids.into_iter())
                    .filter(|id| pending.binary_search(id).is_ok())
                    .collect(),
            ))
        })
    }

    fn why_empty(&self) -> BoxFuture<'_, Option<String>> {
        Box::pin(async move {
            (self
                .off_thread(|queue| Ok(Self::explain_empty(queue)))
                .await)
                .ok()
        })
    }
}

/// A stop's outcome for one id, as the client contract names it.
fn outcome(done: EmbeddedCancel) -> CancelOutcome {
    match done {
        EmbeddedCancel::Cancelled(_) => CancelOutcome::Cancelled,
        EmbeddedCancel::InFlight => CancelOutcome::InFlight,
        EmbeddedCancel::NotPending => CancelOutcome::NotActive,
    }
}
