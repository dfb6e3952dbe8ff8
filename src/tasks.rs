//! The application's task tree: one [`TaskTracker`] owns every long-lived
//! task, and a task that panics is logged by name, recorded, and stops the
//! run (so the process never stays ready with one queue dead).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A cloneable handle to the task tree: spawn supervised tasks, and the
/// token that asks the whole run to drain.
#[derive(Debug, Clone)]
pub struct Tasks {
    /// Owns every task spawned here, so the run can wait for all of them.
    tracker: TaskTracker,
    /// Cancelled to start the drain (shutdown, exit-when-done, a panic).
    drain: CancellationToken,
    /// Cancelled last, after the drain: stops what must outlive it
    /// (telemetry, the dispatchers' background loops).
    root: CancellationToken,
    /// Names of the tasks that panicked.
    panicked: Arc<Mutex<Vec<String>>>,
}

impl Default for Tasks {
    fn default() -> Self {
        Self::new()
    }
}

impl Tasks {
    /// An empty task tree.
    pub fn new() -> Self {
        let root = CancellationToken::new();
        Self {
            tracker: TaskTracker::new(),
            drain: root.child_token(),
            root,
            panicked: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Spawns `task` under the tracker. If it panics, the panic is logged
    /// with `name`, recorded (see [`Self::panicked`]) and the drain starts.
    pub fn spawn<F, T>(&self, name: impl Into<String>, task: F) -> JoinHandle<Option<T>>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let name = name.into();
        let panicked = self.panicked.clone();
        let drain = self.drain.clone();
        self.tracker.spawn(async move {
            match AssertUnwindSafe(task).catch_unwind().await {
                Ok(value) => Some(value),
                Err(payload) => {
                    let what = payload
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(task = %name, panic = %what, "task panicked; stopping the run");
                    panicked
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(name);
                    drain.cancel();
                    None
                }
            }
        })
    }

    /// Cancelled when the run starts draining.
    pub fn drain_token(&self) -> &CancellationToken {
        &self.drain
    }

    /// Cancelled when everything stops, after the drain.
    pub fn root_token(&self) -> &CancellationToken {
        &self.root
    }

    /// Names of the tasks that panicked so far.
    pub fn panicked(&self) -> Vec<String> {
        self.panicked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops everything still running and waits for every task.
    pub async fn stop(&self) {
        self.drain.cancel();
        self.root.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Sleeps for `period` unless `stop` is cancelled first: every background
/// loop waits through this (or its own `select!` on a token), so a drain
/// never waits out a loop's sleep. False when `stop` was cancelled.
pub async fn sleep_unless(stop: &CancellationToken, period: Duration) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = tokio::time::sleep(period) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_named_and_starts_the_drain() {
        let tasks = Tasks::new();
        let handle = tasks.spawn("queue q: observer", async { panic!("boom") });
        assert_eq!(handle.await.expect("joined"), None::<()>);
        assert!(tasks.drain_token().is_cancelled());
        assert_eq!(tasks.panicked(), vec!["queue q: observer".to_owned()]);
        tasks.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_sleep_ends_at_cancellation() {
        let stop = CancellationToken::new();
        let canceller = stop.clone();
        let started = tokio::time::Instant::now();
        let cancel = async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            canceller.cancel();
        };
        let (slept, ()) = tokio::join!(sleep_unless(&stop, Duration::from_secs(3600)), cancel);
        assert!(!slept);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        assert!(sleep_unless(&CancellationToken::new(), Duration::from_secs(2)).await);
    }
}
