//! The dispatch loop of one queue: observe the gate, pull only what the
//! window allows, admit, send, settle.
//!
//! Files by task: this one holds [`QueueDispatcher::run`] (start and
//! drain); `state.rs` what the dispatcher is built from and the state its
//! tasks share; `receive.rs` the receiver and parking; `send.rs` the
//! per-message worker; `settle.rs` the result writer and lease keeper;
//! `observe.rs` the observer.
//!
//! Tasks, the long-lived ones spawned on the application's task tree
//! ([`Tasks`]) so a panic in any of them is named and stops the run:
//! - the *observer* reads the gate every poll interval (and on demand when
//!   the window is used up) and applies each reading to the window;
//! - the *receiver* (the `run` future itself) takes permits before it pulls:
//!   it asks the queue for at most as many messages as the window has room
//!   for, then parses, checks deadlines, admits and releases each; while
//!   it pulls nothing it still answers expired messages, in its buffer and
//!   in the queue (`Queue::receive_expired`), within a second of their
//!   deadline;
//! - one *worker* task per released message sends it and decides its fate;
//! - the *result writer* batches results and acknowledges only after they
//!   are written;
//! - the *lease keeper* renews the leases of every message still held;
//! - the *cancel watcher* (transports that record cancels) aborts requests
//!   in flight whose messages were cancelled (`cancel.rs`).
//!
//! Shutdown: stop receiving, hand back staged and parked messages, give
//! in-flight requests the grace period, requeue what is still running,
//! flush results, exit.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::cancel::cancel_watcher;
use super::observe::observe_loop;
use super::receive::receive_loop;
use super::settle::{lease_keeper, result_writer};
use super::state::{QueueDispatcher, Shared};
use crate::tasks::Tasks;

/// Results buffered between workers and the writer; a full buffer slows
/// workers down instead of growing memory.
const RESULT_BUFFER: usize = 4096;

impl QueueDispatcher {
    /// Runs until `shutdown` is cancelled, then drains (see module docs).
    /// The observer, lease keeper and result writer run on `tasks`, under
    /// one token of this dispatcher that is a child of the task tree's root.
    pub async fn run(self, shutdown: CancellationToken, tasks: Tasks) {
        let name = self.queue.name().to_owned();
        let shared = Arc::new(Shared::new(self));
        // Not children of `shutdown`: the keeper must renew leases and the
        // writer must write results through the drain that follows it.
        let lifetime = tasks.root_token().child_token();
        let background = lifetime.child_token();
        let abandon = lifetime.child_token();
        let abandon_writes = lifetime.child_token();
        let (results, results_rx) = mpsc::channel(RESULT_BUFFER);
        let observer = tasks.spawn(
            format!("queue `{name}`: observer"),
            observe_loop(shared.clone(), background.clone()),
        );
        let keeper = tasks.spawn(
            format!("queue `{name}`: lease keeper"),
            lease_keeper(shared.clone(), background.clone()),
        );
        let writer = tasks.spawn(
            format!("queue `{name}`: result writer"),
            result_writer(shared.clone(), results_rx, abandon_writes.clone()),
        );
        let watcher = shared.queue().records_cancels().then(|| {
            tasks.spawn(
                format!("queue `{name}`: cancel watcher"),
                cancel_watcher(
                    shared.clone(),
                    shared.settings().cancel_check_interval,
                    background.clone(),
                ),
            )
        });
        // In-flight requests, counted and awaited for the grace period.
        let tracker = TaskTracker::new();

        receive_loop(&shared, &shutdown, &abandon, &tracker, &results).await;

        tracker.close();
        let grace = shared.settings().shutdown_grace;
        tracing::info!(queue = %name, in_flight = tracker.len(), "draining");
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                queue = %name,
                "grace period over; requeueing requests still in flight"
            );
            abandon.cancel();
            tracker.wait().await;
        }
        drop(results);
        // The writer ends once every buffered result is written (or, if the
        // queue stays down past a second grace period, abandons them: their
        // messages were never acknowledged and will be redelivered).
        let mut writer = writer;
        tokio::select! {
            _ = &mut writer => {}
            () = tokio::time::sleep(grace) => {
                abandon_writes.cancel();
                let _ = writer.await;
            }
        }
        background.cancel();
        let _ = tokio::join!(observer, keeper);
        if let Some(watcher) = watcher {
            let _ = watcher.await;
        }
        lifetime.cancel();
        tracing::info!(queue = %name, "stopped");
    }
}
