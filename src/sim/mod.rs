//! The pool simulator: vLLM replicas behind an inference gateway, in virtual
//! or real time.
//!
//! # Layout
//! - [`config`]: the `sim.toml` shape, defaults and validation.
//! - [`engine`]: one replica's V1-style scheduler, KV blocks, preemption and
//!   step-time model (pure, deterministic).
//!   Its prefix cache (vLLM's automatic prefix caching, block identities
//!   from `crate::prompt`) is `prefix.rs`.
//! - [`pool`]: replicas plus gateway routing, 429/503 admission and flow control.
//! - [`load`]: seeded arrival processes and CSV trace replay.
//! - [`metrics`]: vLLM and endpoint-picker metrics with real names, text
//!   exposition, lagged views with blackouts.
//! - [`runner`]: the virtual-time runner that evaluates batch policies.
//! - [`sweep`]: a closed-loop concurrency sweep against published figures
//!   (`sluicegate sim sweep`), or against a real engine's; [`fit`] fits
//!   the step-time model to a real engine's sweep.
//! - [`http`]: the real-time OpenAI-compatible front (`sluicegate sim serve`);
//!   `endpoints.rs` reads `/v1/embeddings` and `/v1/responses` bodies and
//!   shapes their answers; `bad_request.rs` is the 400 every parser returns.
//! - [`error`]: the error type, [`SimError`]; [`time`]: the clock type,
//!   [`time::SimTime`].

mod bad_request;
pub mod config;
mod endpoints;
pub mod engine;
pub mod error;
pub mod fit;
pub mod http;
pub mod load;
pub mod metrics;
pub mod pool;
mod prefix;
pub mod runner;
mod scoring;
pub mod sweep;
pub mod time;

pub use config::SimConfig;
pub use error::SimError;
pub use http::{InteractiveTiming, SimHandle, spawn_http};
