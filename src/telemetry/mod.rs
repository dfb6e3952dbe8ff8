//! Telemetry: the metrics registry (`metrics.rs`), the `/metrics`,
//! `/healthz` and `/readyz` server (`server.rs`), log setup
//! (`logging.rs`) and OTLP trace export, off by default (`traces.rs`).

pub mod logging;
pub mod metrics;
pub mod server;
pub mod traces;

pub use logging::LogFormat;
pub use metrics::{
    BatchApiMetrics, FlexMetrics, INERT_REASONS, METRIC_NAMES, Metrics, PoolMetrics, QueueMetrics,
};
pub use server::{Health, serve};
pub use traces::{TraceExport, TraceSettings, Traces};
