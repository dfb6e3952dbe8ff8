//! Why a run could not start or failed, and the process exit codes.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::gate::BuildError;
use crate::gateway::{GatewayBuildError, TargetError};
use crate::queue::OpenError;
use crate::telemetry::traces::TraceStartError;

/// Exit code of a run that could not start (configuration, as
/// `check-config` documents).
pub const EXIT_CONFIG: u8 = 2;
/// Exit code of a run that failed while running (a task panicked, results
/// could not be written).
pub const EXIT_FAILURE: u8 = 1;

/// Why the application could not start, or failed while running.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The run options do not fit the configured transport.
    #[error("{0}")]
    Options(&'static str),
    /// `--input` could not be read.
    #[error("--input: cannot read {path}: {source}")]
    Input {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The transport could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The telemetry address could not be bound.
    #[error("telemetry.listen: cannot listen on {addr}: {source}")]
    Listen {
        /// The configured address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP client could not be built.
    #[error("gateway: {0}")]
    Gateway(#[from] GatewayBuildError),
    /// A queue's gateway URL or path is unusable.
    #[error("queue `{queue}`: {source}")]
    Target {
        /// The queue name.
        queue: String,
        /// What is wrong.
        #[source]
        source: TargetError,
    },
    /// A queue's gate cannot be built.
    #[error("queue `{queue}`: {source}")]
    Gate {
        /// The queue name.
        queue: String,
        /// What is wrong.
        #[source]
        source: BuildError,
    },
    /// Tasks panicked; the run drained and stopped.
    #[error("task panicked: {}", .0.join(", "))]
    Panicked(Vec<String>),
    /// The memory transport's results could not be written.
    #[error("cannot write results: {0}")]
    Output(#[source] std::io::Error),
    /// The OTLP trace exporter could not be built.
    #[error(transparent)]
    Traces(#[from] TraceStartError),
    /// The shared window's Redis client could not be built.
    #[error("dispatch.shared_window: {0}")]
    SharedWindow(#[source] crate::redis::ConnectError),
    /// The stream relay's Redis client could not be built.
    #[error("redis (stream relay): {0}")]
    Relay(#[source] crate::redis::ConnectError),
}

impl AppError {
    /// The process exit code for this error: [`EXIT_CONFIG`] when the run
    /// could not start, [`EXIT_FAILURE`] when it failed while running.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Panicked(_) | Self::Output(_) => EXIT_FAILURE,
            Self::Options(_)
            | Self::Input { .. }
            | Self::Open(_)
            | Self::Listen { .. }
            | Self::Gateway(_)
            | Self::Target { .. }
            | Self::Gate { .. }
            | Self::Traces(_)
            | Self::SharedWindow(_)
            | Self::Relay(_) => EXIT_CONFIG,
        }
    }
}
