//! Log setup: `tracing` with text or JSON lines to stderr.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. `directive` is an `EnvFilter` string
/// (e.g. `info` or `sluicegate=debug`); `RUST_LOG` wins when set. Calling
/// it twice keeps the first subscriber (tests call it freely).
pub fn init(format: LogFormat, directive: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(directive))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
