//! The simulator's error type: configuration, trace files, and the HTTP front.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Everything that can go wrong while building or running the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration value is out of range or inconsistent with another.
    #[error("invalid simulator config: {key}: {message}")]
    Config {
        /// Dotted key of the offending value, e.g. `engine.block_size`.
        key: String,
        /// What is allowed.
        message: String,
    },
    /// Token-length means and spreads that no log-normal distribution has.
    #[error("invalid simulator config: {key}: {source}")]
    Distribution {
        /// Key of the mean whose distribution was asked for.
        key: String,
        /// What rand_distr refused.
        #[source]
        source: rand_distr::NormalError,
    },
    /// The TOML config file could not be read.
    #[error("cannot read simulator config {path}")]
    ConfigRead {
        /// The file that was requested.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The TOML config file does not parse (unknown keys included).
    #[error("cannot parse simulator config {path}")]
    ConfigParse {
        /// The file that was requested.
        path: PathBuf,
        /// The parse failure, which names the key.
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A CSV trace could not be read.
    #[error("cannot read trace {path}")]
    TraceRead {
        /// The trace file.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// A CSV trace line is malformed.
    #[error("trace line {line}: {message}")]
    TraceParse {
        /// 1-based line number in the file.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The HTTP front could not bind its listening address.
    #[error("cannot bind simulator front to {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The socket failure.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed while running.
    #[error("simulator front failed")]
    Serve(#[source] std::io::Error),
}

impl SimError {
    /// Shorthand for a [`SimError::Config`].
    pub(crate) fn config(key: &str, message: impl Into<String>) -> Self {
        Self::Config {
            key: key.to_owned(),
            message: message.into(),
        }
    }
}
