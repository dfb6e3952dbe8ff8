//! The gates' build context from a loaded configuration: `config/` knows
//! both sides, so the gates need not know the config.

use super::{Config, QueueConfig};
use crate::gate::{Capacity, GateContext};

impl GateContext {
    /// The context of a loaded configuration: cache TTL = poll interval,
    /// source timeout = the smaller of max_staleness and 10 s.
    pub fn from_config(config: &Config) -> Self {
        let d = &config.dispatch;
        let mut ctx = Self::new(
            config.prometheus.clone(),
            config.redis.clone(),
            d.poll_interval,
            d.max_staleness,
        );
        ctx.sql.clone_from(&config.sql);
        ctx
    }

    /// This context for the gate of `queue` (its static capacity).
    #[must_use]
    pub fn for_queue(mut self, queue: &QueueConfig) -> Self {
        self.capacity = Capacity {
            max_sys: queue.max_sys,
            unit: queue.unit,
        };
        self.worker_pool_id.clone_from(&queue.worker_pool_id);
        self
    }
}
