//! The simulator's clock type, apart so the engine and the metrics it
//! feeds (which stamp their readings with it) stand on it side by side.

/// Simulated time in seconds since the scenario started.
pub type SimTime = f64;
