//! Settling: results go to the writer, which acknowledges only what it
//! wrote; the lease keeper renews what is still held.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::dispatcher::{Results, Shared};
use crate::queue::{Completion, DeliveryTag};
use crate::result::ResultRecord;

/// Most results written in one queue call.
const RESULT_BATCH: usize = 512;
/// Longest pause between result-write retries while the queue is down.
const RESULT_RETRY_MAX: Duration = Duration::from_secs(5);

/// Hands a final result to the writer.
pub(super) async fn settle(
    shared: &Shared,
    results: &Results,
    tag: DeliveryTag,
    result: ResultRecord,
) {
    shared.metrics().outcome(result.outcome_label());
    if results.send(Completion { tag, result }).await.is_err() {
        // Only possible once the writer has stopped, after the drain; the
        // message stays unacknowledged and will be redelivered.
        tracing::warn!("result writer gone; message will be redelivered");
    }
}

/// Writes results in batches; acknowledges only what was written.
pub(super) async fn result_writer(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Completion>,
    abandon: CancellationToken,
) {
    let mut batch = Vec::with_capacity(RESULT_BATCH);
    while rx.recv_many(&mut batch, RESULT_BATCH).await > 0 {
        let mut pause = Duration::from_millis(50);
        loop {
            match shared.queue().ack(batch.clone()).await {
                Ok(report) => {
                    if report.lease_lost > 0 {
                        shared
                            .metrics()
                            .leases_lost
                            .inc_by(report.lease_lost as u64);
                    }
                    break;
                }
                Err(error) => {
                    shared.metrics().result_write_errors.inc();
                    tracing::warn!(%error, results = batch.len(), "result write failed; retrying");
                    tokio::select! {
                        () = abandon.cancelled() => {
                            tracing::error!(results = batch.len(), "giving up on result writes; messages will be redelivered");
                            break;
                        }
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(RESULT_RETRY_MAX);
                }
            }
        }
        {
            let mut held = shared.held();
            for completion in &batch {
                held.remove(&completion.tag);
            }
        }
        batch.clear();
    }
}

/// Renews the leases of held messages every third of the lease.
pub(super) async fn lease_keeper(shared: Arc<Shared>, stop: CancellationToken) {
    let lease = shared.settings().lease;
    let every = (lease / 3).max(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let tags: Vec<DeliveryTag> = shared.held().iter().cloned().collect();
        if tags.is_empty() {
            continue;
        }
        if let Err(error) = shared.queue().extend_lease(tags, lease).await {
            tracing::warn!(%error, "lease renewal failed");
        }
    }
}
