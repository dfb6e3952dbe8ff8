//! sluicegate: lets LLM batch work use the idle capacity of an inference
//! pool without hurting its interactive users.

pub mod config;
pub mod dispatch;
pub mod gate;
pub mod queue;
pub mod telemetry;
pub mod request;
pub mod result;
