//! Cancel in flight: a submitter's cancel reaches a request the gateway is
//! already working on.
//!
//! Without it a cancelled message that was already sent runs to the end:
//! the engine spends its slot on an answer nobody wants, in exactly the
//! moments (a batch cancelled because the pool is needed) when capacity is
//! scarcest. vLLM aborts a request whose connection closes, so dropping
//! the attempt frees the engine at once.
//!
//! Each attempt registers in [`Running`] while it is at the gateway; the
//! *cancel watcher* asks the queue, every `dispatch.cancel_check_interval`,
//! which of them were cancelled (`Queue::cancelled`, the same marker the
//! transports check at claim), and fires their tokens. The worker then
//! drops the request (closing the connection) and answers the message
//! `CANCELLED`, unless the answer arrived first, which is kept. Only
//! transports that record cancels (`Queue::records_cancels`) get a
//! watcher.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::state::Shared;
use crate::queue::DeliveryTag;

/// The attempts at the gateway, by registration number.
#[derive(Debug, Default)]
pub(super) struct Running {
    next: AtomicU64,
    attempts: Mutex<HashMap<u64, (DeliveryTag, CancellationToken)>>,
}

impl Running {
    fn attempts(&self) -> MutexGuard<'_, HashMap<u64, (DeliveryTag, CancellationToken)>> {
        self.attempts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers an attempt of the message `tag` until the guard drops;
    /// the guard's token fires when the message is cancelled.
    pub(super) fn register(&self, tag: &DeliveryTag) -> RunningAttempt<'_> {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        self.attempts().insert(key, (tag.clone(), cancel.clone()));
        RunningAttempt {
            running: self,
            key,
            cancel,
        }
    }

    /// The attempts now at the gateway.
    fn snapshot(&self) -> Vec<(DeliveryTag, CancellationToken)> {
        self.attempts().values().cloned().collect()
    }

    /// How many attempts are registered (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.attempts().len()
    }
}

/// One attempt's registration; unregisters on drop.
#[derive(Debug)]
pub(super) struct RunningAttempt<'a> {
    running: &'a Running,
    key: u64,
    cancel: CancellationToken,
}

impl RunningAttempt<'_> {
    /// Fires when the message was cancelled while this attempt ran.
    pub(super) fn cancelled(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }
}

impl Drop for RunningAttempt<'_> {
    fn drop(&mut self) {
        self.running.attempts().remove(&self.key);
    }
}

/// Every `interval`, asks the queue which running attempts' messages were
/// cancelled and fires their tokens, until `stop`.
pub(super) async fn cancel_watcher(
    shared: Arc<Shared>,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (tag, cancel) in shared.running.snapshot() {
            // One round trip per running attempt and tick: the window bounds
            // them, and a transport's check is a key lookup or an indexed row.
            if !cancel.is_cancelled() && shared.queue().cancelled(&tag).await {
                cancel.cancel();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_is_registered_until_its_guard_drops() {
        let running = Running::default();
        let a = running.register(&DeliveryTag("a".into()));
        let b = running.register(&DeliveryTag("a".into()));
        assert_eq!(
            running.len(),
            2,
            "two attempts of one message are two entries"
        );
        drop(a);
        assert_eq!(running.len(), 1);
        drop(b);
        assert_eq!(running.len(), 0);
    }

    #[test]
    fn firing_a_snapshot_token_cancels_the_attempt() {
        let running = Running::default();
        let attempt = running.register(&DeliveryTag("a".into()));
        for (tag, token) in running.snapshot() {
            assert_eq!(tag.0, "a");
            token.cancel();
        }
        assert!(attempt.cancel.is_cancelled());
    }
}
