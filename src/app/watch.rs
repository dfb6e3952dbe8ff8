//! What watches a running dispatcher: the exit-when-done poll, transport
//! status into readiness and metrics, and the memory transport's results
//! at exit.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::queue::{MemoryQueue, Queue};
use crate::telemetry::{Health, QueueMetrics};

use super::ResultsOutput;

/// How often `--exit-when-done` asks the queues whether anything is left.
const DONE_POLL: Duration = Duration::from_millis(50);
/// How often transport status feeds readiness and metrics.
const STATUS_EVERY: Duration = Duration::from_millis(250);

/// Starts the drain once no queue has anything left to settle (memory and
/// embedded transports; `start` refuses the others).
pub(super) async fn exit_when_done(
    queues: Vec<Arc<dyn Queue>>,
    drain: tokio_util::sync::CancellationToken,
) {
    loop {
        let mut left = 0u64;
        for queue in &queues {
            // An error or "cannot tell" counts as work left.
            left += match queue.outstanding().await {
                Ok(Some(n)) => n,
                Ok(None) | Err(_) => 1,
            };
        }
        if left == 0 {
            tracing::info!("every message settled; draining");
            drain.cancel();
            return;
        }
        tokio::select! {
            () = drain.cancelled() => return,
            () = tokio::time::sleep(DONE_POLL) => {}
        }
    }
}

pub(super) fn all_reachable(queues: &[(Arc<dyn Queue>, QueueMetrics)]) -> bool {
    queues
        .iter()
        .all(|(q, _)| q.status().is_none_or(|s| s.reachable))
}

/// Readiness follows the transports' reachability (not ready while a
/// backend is down); their counters become metrics. Stops at shutdown,
/// which owns readiness from then on.
pub(super) async fn watch_transports(
    queues: Vec<(Arc<dyn Queue>, QueueMetrics)>,
    health: Arc<Health>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut seen: Vec<(u64, u64)> = vec![(0, 0); queues.len()];
    let mut was_ready = health.is_ready();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(STATUS_EVERY) => {}
        }
        for ((queue, m), seen) in queues.iter().zip(seen.iter_mut()) {
            let Some(status) = queue.status() else {
                continue;
            };
            if let Some(backlog) = status.backlog {
                m.backlog.set(i64::try_from(backlog).unwrap_or(i64::MAX));
            }
            m.claims_held
                .set(i64::try_from(status.claims_held).unwrap_or(i64::MAX));
            m.reclaims
                .inc_by(status.reclaims_total.saturating_sub(seen.0));
            m.dead_letters
                .inc_by(status.dead_letters_total.saturating_sub(seen.1));
            *seen = (
                seen.0.max(status.reclaims_total),
                seen.1.max(status.dead_letters_total),
            );
        }
        let ready = all_reachable(&queues);
        if shutdown.is_cancelled() {
            return;
        }
        if ready != was_ready {
            if ready {
                tracing::info!("queue backends reachable; ready");
            } else {
                tracing::warn!("a queue backend is unreachable; not ready");
            }
            was_ready = ready;
        }
        health.set_ready(ready);
    }
}

/// Writes the memory queues' results as JSON lines, and hands on what is
/// still unsettled (the memory transport keeps nothing after exit).
pub(super) fn write_memory_results(
    queues: &[Arc<MemoryQueue>],
    output: &ResultsOutput,
) -> std::io::Result<()> {
    let mut results = String::new();
    let mut unsettled = String::new();
    let mut unsettled_count = 0usize;
    for queue in queues {
        for result in queue.results() {
            // A result is plain strings and numbers: serialising cannot fail.
            results.push_str(&serde_json::to_string(&result).unwrap_or_default());
            results.push('\n');
        }
        for dead in queue.dead_letters() {
            // Not `eprintln!` here or below: it panics on a closed stderr,
            // and the results must still be written.
            let _ = writeln!(
                std::io::stderr(),
                "dead letter: {}",
                serde_json::to_string(&dead.last_error).unwrap_or_default()
            );
        }
        for body in queue.unsettled() {
            unsettled.push_str(&String::from_utf8_lossy(&body));
            unsettled.push('\n');
            unsettled_count += 1;
        }
    }
    match output {
        ResultsOutput::File(path) => {
            std::fs::write(path, &results)?;
            if unsettled_count == 0 {
                return Ok(());
            }
            let mut rest = path.clone().into_os_string();
            rest.push(".unsettled.jsonl");
            let rest = PathBuf::from(rest);
            std::fs::write(&rest, &unsettled)?;
            let _ = writeln!(
                std::io::stderr(),
                "{unsettled_count} messages were not settled; written to {}",
                rest.display()
            );
            Ok(())
        }
        ResultsOutput::Stdout => {
            if unsettled_count > 0 {
                let _ = writeln!(
                    std::io::stderr(),
                    "{unsettled_count} messages were not settled:\n{unsettled}"
                );
            }
            std::io::stdout().write_all(results.as_bytes())
        }
    }
}
