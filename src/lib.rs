//! sluicegate
