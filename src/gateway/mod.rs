//! The gateway client: sends one request to the inference gateway and says
//! what the answer means for the dispatch loop.
//!
//! The gateway is vLLM behind an endpoint picker, reached over HTTP through
//! one shared connection pool. This module performs single attempts only:
//! retries go back through the queue and the dispatch gate, so the retry
//! policy (in [`crate::dispatch`], beside the loop that applies it) is a
//! pure calculator, not a loop.
//!
//! Files and their roles:
//!
//! - `client.rs`: [`GatewayClient`], a bounded attempt
//!   ([`GatewayClient::send`]) and what its answer means; `reqwest` for
//!   `https://` and HTTP/2 gateways.
//! - `http1.rs`: the HTTP/1.1 client of `http://` gateways (keep-alive
//!   pool, framing, nothing buffered while a request waits).
//! - `target.rs`: [`Target`] (a queue's gateway URL and objective),
//!   endpoint resolution that cannot leave the gateway origin, and the
//!   request headers of docs/architecture.md ("Headers sent to the gateway") ([`PreparedRequest`]).
//! - `classify.rs`: [`AttemptOutcome`], [`AttemptFailure`], the status
//!   classes and `Retry-After` parsing.
//! - `time.rs`: [`deadline_instant`], Unix-seconds deadlines on tokio's
//!   clock.
//!
//! Status classes (see [`StatusClass`]): 2xx success; 429 and 503
//! congestion; 501 and 505 final (the same request gets the same answer);
//! other 5xx retryable; 3xx and other 4xx final. A 2xx body over
//! [`GatewaySettings::max_response_bytes`] is a final failure
//! ([`AttemptFailure::BodyTooLarge`]); other bodies are truncated at the
//! limit.

use std::fmt;
use std::time::Duration;

use crate::config::{Config, GatewayConfig, Unit};

mod classify;
mod client;
mod http1;
mod target;
mod time;

pub use classify::{
    AttemptFailure, AttemptOutcome, MAX_RETRY_AFTER, StatusClass, classify_status,
    parse_retry_after, parse_retry_after_at,
};
pub use client::{BodyTap, GatewayBuildError, GatewayClient, NoTap};
pub use target::{EndpointError, PrepareError, PreparedRequest, Target, TargetError};
pub use time::{deadline_instant, deadline_instant_at};

/// The objective header upstream llm-d-async sends (the default).
pub const GATEWAY_OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The objective header newer llm-d routers read.
pub const LLM_D_OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Header carrying the fairness id taken from request metadata.
pub const FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";
/// Header the endpoint picker sets on a rejection to say why it dropped it.
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";
/// Longest fairness id sent; longer values are skipped, not truncated.
pub const MAX_FAIRNESS_ID_LEN: usize = 256;

/// How the gateway client behaves; built by the application from config.
#[derive(Clone)]
pub struct GatewaySettings {
    /// Ceiling of one attempt (connect, send, whole body); each attempt is
    /// also cut at the request's deadline.
    pub attempt_timeout: Duration,
    /// Ceiling of establishing one connection (TCP and TLS).
    pub connect_timeout: Duration,
    /// Largest response body read; protects memory from a runaway answer.
    pub max_response_bytes: usize,
    /// Idle connections kept per host in the shared pool.
    pub max_idle_per_host: usize,
    /// HTTP/2 without negotiation: requests share connections as streams
    /// (spoken by reqwest; plain HTTP/1.1 by `http1.rs`).
    pub http2_prior_knowledge: bool,
    /// Sent as `Authorization: Bearer <token>`; never logged or printed.
    pub bearer_token: Option<String>,
    /// Name of the header carrying the queue's inference objective
    /// ([`GATEWAY_OBJECTIVE_HEADER`] or [`LLM_D_OBJECTIVE_HEADER`]).
    pub objective_header: String,
    /// Metadata key whose value becomes [`FAIRNESS_HEADER`]; `None` sends
    /// no fairness id. The configured default is `userid`.
    pub fairness_attribute: Option<String>,
}

impl GatewaySettings {
    /// The settings of `config` with `bearer_token` as the token.
    fn with_token(config: &GatewayConfig, bearer_token: Option<String>) -> Self {
        Self {
            attempt_timeout: config.attempt_timeout,
            connect_timeout: config.connect_timeout,
            max_response_bytes: usize::try_from(config.max_response_bytes).unwrap_or(usize::MAX),
            max_idle_per_host: config.max_connections_per_host,
            http2_prior_knowledge: config.http2_prior_knowledge,
            bearer_token,
            objective_header: config.objective_header.header_name().to_owned(),
            fairness_attribute: config.fairness_attribute.clone().filter(|a| !a.is_empty()),
        }
    }
}

impl GatewaySettings {
    /// The settings of `config`'s `[gateway]`, with an idle pool that keeps
    /// a connection for every request the queues' static windows may hold
    /// in flight ([`Self::keeping_idle_for`]).
    pub fn for_config(config: &Config) -> Self {
        let windows: f64 = config
            .queues
            .iter()
            .filter(|q| q.unit == Unit::Requests)
            .map(|q| q.max_sys.ceil())
            .sum();
        // `as` saturates: a window beyond usize is "keep them all".
        Self::from(&config.gateway).keeping_idle_for(windows as usize)
    }

    /// Keeps at least `in_flight` idle connections per host. An HTTP/1.1
    /// connection serves one request at a time, so a window of `W` uses `W`
    /// connections; with fewer kept idle, every dip of the window closes
    /// connections that its refill opens again. That churn (a TCP
    /// handshake, a socket and hyper's buffers per request) cost a
    /// 512-wide drain half its throughput with 256 kept (issue 21). Idle
    /// connections never outnumber the peak in flight and close after the
    /// client's idle timeout.
    #[must_use]
    pub fn keeping_idle_for(mut self, in_flight: usize) -> Self {
        self.max_idle_per_host = self.max_idle_per_host.max(in_flight);
        self
    }
}

/// The configured client. A `token_file` was read into `token` when the
/// config was loaded.
impl From<&GatewayConfig> for GatewaySettings {
    fn from(config: &GatewayConfig) -> Self {
        let bearer_token = config.token.as_ref().map(|t| t.expose().to_owned());
        Self::with_token(config, bearer_token)
    }
}

/// The `[gateway]` defaults of the config (one place for them).
impl Default for GatewaySettings {
    fn default() -> Self {
        Self::with_token(&GatewayConfig::default(), None)
    }
}

// Hand-written so the bearer token can never reach a log line.
impl fmt::Debug for GatewaySettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewaySettings")
            .field("attempt_timeout", &self.attempt_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("max_idle_per_host", &self.max_idle_per_host)
            .field("http2_prior_knowledge", &self.http2_prior_knowledge)
            .field(
                "bearer_token",
                &self.bearer_token.as_ref().map(|_| "<redacted>"),
            )
            .field("objective_header", &self.objective_header)
            .field("fairness_attribute", &self.fairness_attribute)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_bearer_token() {
        let settings = GatewaySettings {
            bearer_token: Some("s3cr3t-token".into()),
            ..GatewaySettings::default()
        };
        let shown = format!("{settings:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn defaults_are_the_configs() {
        let settings = GatewaySettings::default();
        let config = GatewayConfig::default();
        assert_eq!(settings.attempt_timeout, config.attempt_timeout);
        assert_eq!(settings.max_idle_per_host, config.max_connections_per_host);
        assert_eq!(settings.objective_header, GATEWAY_OBJECTIVE_HEADER);
    }

    /// Issue 21: with fewer idle connections than the window, every dip of
    /// the window closed connections its refill opened again.
    #[test]
    fn the_idle_pool_keeps_a_connection_for_every_request_of_the_windows() {
        let toml = |cap: usize| {
            format!(
                r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
max_connections_per_host = {cap}
[[queue]]
queue_name = "a"
max_sys = 300.5
gate_type = "constant"
[[queue]]
queue_name = "b"
max_sys = 200
gate_type = "constant"
[[queue]]
queue_name = "tokens"
unit = "tokens"
max_sys = 100000
gate_type = "constant"
"#
            )
        };
        let config = |cap| Config::from_toml_str(&toml(cap), &Default::default()).expect("config");
        // 301 + 200 requests; a token window says nothing about requests.
        assert_eq!(
            GatewaySettings::for_config(&config(16)).max_idle_per_host,
            501
        );
        assert_eq!(
            GatewaySettings::for_config(&config(4096)).max_idle_per_host,
            4096
        );
    }
}
