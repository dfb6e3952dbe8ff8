//! sluicegate: lets LLM batch work use the idle capacity of an inference
//! pool without hurting its interactive users.

pub mod gateway;
pub mod request;
pub mod result;
