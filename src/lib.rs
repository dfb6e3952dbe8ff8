//! sluicegate
pub mod sim;
