//! The observer: reads the gate every poll interval (and on demand when
//! the window is used up) and applies each reading to the window.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::dispatcher::{Shared, saturating_i64};
use super::window::{Applied, headroom_units};
use crate::config::Rounding;
use crate::gate::Capacity;

/// Reads the gate and applies each reading to the window.
pub(super) async fn observe_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let settings = shared.settings().clone();
    let at_least_one = settings.rounding == Rounding::AtLeastOne;
    let mut was_open: Option<bool> = None;
    let mut was_available: Option<bool> = None;
    let mut next_backlog = Instant::now();
    loop {
        let observation = shared.config.gate.observe().await;
        let now = Instant::now();
        // A gate's live max_SYS counts requests (ready endpoints ×
        // concurrency); in tokens or bytes only the queue's own applies.
        let max_sys = Capacity {
            max_sys: settings.max_sys,
            unit: settings.unit,
        }
        .effective(observation.max_sys);
        let n = headroom_units(max_sys, observation.headroom(), settings.rounding);
        let (applied, held) = {
            let mut window = shared.window();
            let applied = window.observe(
                observation.taken_at,
                n,
                at_least_one,
                observation.sees_own_load,
            );
            shared.export_window(&window, now);
            (applied, window.is_held() || shared.congestion_held(now))
        };
        let m = shared.metrics();
        m.budget.set(observation.budget.get());
        m.baseline.set(observation.baseline.get());
        m.source_available
            .set(i64::from(observation.source_available));
        let open = observation.is_open() && !held;
        m.gate_open.set(i64::from(open));
        m.observation_age.set(
            now.saturating_duration_since(observation.taken_at)
                .as_secs_f64(),
        );
        if was_available != Some(observation.source_available) {
            if observation.source_available {
                tracing::info!(queue = shared.queue().name(), "gate source available");
            } else {
                tracing::warn!(
                    queue = shared.queue().name(),
                    reason = observation.reason,
                    "gate source unavailable; gate closed"
                );
            }
            was_available = Some(observation.source_available);
        }
        if was_open != Some(open) {
            tracing::info!(
                queue = shared.queue().name(),
                open,
                budget = observation.budget.get(),
                baseline = observation.baseline.get(),
                n,
                reason = observation.reason,
                "gate {}",
                if open { "opened" } else { "closed" }
            );
            was_open = Some(open);
        }
        if applied == Applied::Fresh {
            shared.changed.notify_waiters();
        }
        // On-demand readings can come fast; the backlog is worth one queue
        // call per poll interval at most.
        if now >= next_backlog {
            next_backlog = now + settings.poll_interval;
            if let Ok(Some(backlog)) = shared.queue().backlog().await {
                m.backlog.set(saturating_i64(backlog));
            }
        }
        // A fresh reading that opened the window may be refilled as soon as
        // it is used up (a constant gate would otherwise cap throughput at N
        // per poll). A closed or not-newer reading waits for the next poll:
        // asking again at once would spin without learning anything.
        let refill_on_demand = applied == Applied::Fresh && n > 0;
        let next_poll = tokio::time::sleep(settings.poll_interval);
        if refill_on_demand {
            tokio::select! {
                () = stop.cancelled() => return,
                () = next_poll => {}
                () = shared.refresh.notified() => {}
            }
        } else {
            tokio::select! {
                () = stop.cancelled() => return,
                () = next_poll => {}
            }
        }
    }
}
