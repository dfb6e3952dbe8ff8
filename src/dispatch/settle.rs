//! Settling: results go to the writer, which acknowledges only what it
//! wrote; the lease keeper renews what is still held.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::state::{Results, Shared};
use crate::queue::{Completion, DeliveryTag};
use crate::result::ResultRecord;
use crate::telemetry::traces::{self as trace_attr, MessageTrace};

/// Most results written in one queue call.
const RESULT_BATCH: usize = 512;
/// Longest pause between result-write retries while the queue is down.
const RESULT_RETRY_MAX: Duration = Duration::from_secs(5);

/// Hands a final result to the writer. With `trace`, a `settle` span
/// starts here and ends when the writer has acknowledged the result.
pub(super) async fn settle(
    shared: &Shared,
    results: &Results,
    tag: DeliveryTag,
    result: ResultRecord,
    trace: Option<&MessageTrace>,
) {
    shared.metrics().outcome(result.outcome_label());
    if let Some(trace) = trace {
        let mut span = trace.start(trace_attr::SETTLE, SpanKind::Producer);
        span.set([KeyValue::new(
            trace_attr::ATTR_OUTCOME,
            result.outcome_label(),
        )]);
        if let Some(status) = result.status_code {
            span.set([KeyValue::new(
                trace_attr::ATTR_HTTP_STATUS,
                i64::from(status),
            )]);
        }
        if let Some(code) = result.error_code {
            span.set([KeyValue::new(trace_attr::ATTR_ERROR_CODE, code.as_str())]);
        }
        shared.settling().insert(tag.clone(), span);
    }
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
    let traced = shared.config.traces.is_some();
    while rx.recv_many(&mut batch, RESULT_BATCH).await > 0 {
        let mut pause = Duration::from_millis(50);
        let mut written = true;
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
                            written = false;
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
        if traced {
            end_settle_spans(&shared, &batch, written);
        }
        batch.clear();
    }
}

/// Ends the `settle` spans of a written (or given-up) batch.
fn end_settle_spans(shared: &Shared, batch: &[Completion], written: bool) {
    let ack = if written { "written" } else { "not_written" };
    let mut settling = shared.settling();
    for completion in batch {
        if let Some(mut span) = settling.remove(&completion.tag) {
            span.set([KeyValue::new(trace_attr::ATTR_ACK, ack)]);
            if !written {
                span.fail("result not written");
            }
            span.end();
        }
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
