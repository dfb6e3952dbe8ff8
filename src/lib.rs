//! sluicegate

pub mod config;
