//! Telemetry: the metrics registry (`metrics.rs`), the `/metrics`,
//! `/healthz` and `/readyz` server (`server.rs`) and log setup
//! (`logging.rs`).

pub mod logging;
pub mod metrics;
pub mod server;

pub use metrics::{METRIC_NAMES, Metrics, QueueMetrics};
pub use server::{Health, serve};
