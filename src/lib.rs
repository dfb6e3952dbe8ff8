//! sluicegate: lets LLM batch work use the idle capacity of an inference
//! pool without hurting its interactive users.

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
pub mod telemetry;
