//! Tunables of one queue's dispatcher, resolved from config.

use std::time::Duration;

use crate::config::{Rounding, Unit};

/// How one queue is dispatched.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Unit of the window (requests, tokens, bytes).
    pub unit: Unit,
    /// How `N` is rounded to whole units.
    pub rounding: Rounding,
    /// Static capacity `max_SYS`, used when the gate does not supply one.
    pub max_sys: f64,
    /// How often the gate is observed (also on demand when the window is
    /// used up).
    pub poll_interval: Duration,
    /// Observations older than this are no observation.
    pub max_staleness: Duration,
    /// Lease taken on each message; renewed while the message is held.
    pub lease: Duration,
    /// Long-poll wait of one receive on an empty queue.
    pub receive_wait: Duration,
    /// Most messages pulled in one receive.
    pub receive_batch: usize,
    /// Requeue delay after a 429/503 without `Retry-After`.
    pub congestion_backoff: Duration,
    /// Requeue delay when a gate refuses, or a parked message gives up.
    pub wait_requeue_delay: Duration,
    /// Longest a message stays parked at a gate (verdict wait) before it
    /// goes back to the queue.
    pub max_park: Duration,
    /// Most messages parked at once; beyond it a wait verdict requeues.
    pub max_parked: usize,
    /// Time in-flight requests get to finish at shutdown before they are
    /// abandoned and requeued.
    pub shutdown_grace: Duration,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        Self {
            unit: Unit::Requests,
            rounding: Rounding::Floor,
            max_sys: 100.0,
            poll_interval: Duration::from_secs(1),
            max_staleness: Duration::from_secs(30),
            lease: Duration::from_secs(300),
            receive_wait: Duration::from_secs(1),
            receive_batch: 256,
            congestion_backoff: Duration::from_secs(2),
            wait_requeue_delay: Duration::from_secs(1),
            max_park: Duration::from_secs(30),
            max_parked: 256,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}
