//! sluicegate: lets LLM batch work use the idle capacity of an inference
//! pool without hurting its interactive users.
//!
//! Batch requests wait in a queue; sluicegate pulls them only as fast as a
//! [`gate`] says the pool has slack, sends them to the inference gateway,
//! and writes exactly one result per submission before acknowledging it.
//!
//! # Layout
//!
//! The data flow, one module per step:
//!
//! - [`queue`]: the [`queue::Queue`] contract (lease, ack with result,
//!   nack with delay, extend lease, dead letter) and its transports
//!   (in-memory so far).
//! - [`request`]: parsing queue bytes into validated request messages.
//! - [`gate`]: [`gate::DispatchGate`] (budget `D`, baseline `B`, admission
//!   verdicts), the gates, and the staleness / fail-closed wrappers.
//! - [`source`]: metric sources the gates read (PromQL, `/metrics` scrape
//!   with our own text-format parser, a Redis key) and their single-flight
//!   TTL cache.
//! - [`dispatch`]: window arithmetic (pure), request costs (pure), and the
//!   dispatch loop that pulls, admits, sends and settles.
//! - [`gateway`]: the HTTP client, endpoint and header rules, response
//!   classification and the retry policy.
//! - [`result`]: result records and error codes.
//! - [`telemetry`]: the metrics registry, `/metrics` `/healthz` `/readyz`,
//!   and logging.
//! - [`config`]: file + environment + flags into a typed configuration.
//! - [`app`]: wiring and the shutdown order; [`cli`]: the subcommands.
//! - [`sim`]: the vLLM-like pool simulator (virtual time and HTTP front).

pub mod app;
pub mod cli;
pub mod config;
pub mod dispatch;
pub mod gate;
pub mod gateway;
pub mod queue;
pub mod request;
pub mod result;
pub mod sim;
pub mod source;
pub mod telemetry;
