//! The wall clock as Unix time: the one place that reads `SystemTime` for
//! timestamps that leave the process (result records, leases shared
//! through Redis or a file, deadlines written by producers, API objects).
//! Durations inside the process use `tokio::time::Instant` instead.
//!
//! A clock before 1970 reads as 0 and one past `i64::MAX` as `i64::MAX`:
//! neither happens on a working machine, and neither may panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Time since the Unix epoch (zero if the clock is set before it).
pub fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

/// Whole seconds since the Unix epoch.
pub fn unix_secs() -> i64 {
    i64::try_from(since_epoch().as_secs()).unwrap_or(i64::MAX)
}

/// Milliseconds since the Unix epoch.
pub fn unix_millis() -> i64 {
    i64::try_from(since_epoch().as_millis()).unwrap_or(i64::MAX)
}

/// Seconds since the Unix epoch with a fraction (Redis scores).
pub fn unix_secs_f64() -> f64 {
    since_epoch().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_units_agree() {
        let (s, ms, f) = (unix_secs(), unix_millis(), unix_secs_f64());
        assert!(s > 1_700_000_000, "{s}");
        assert!((ms / 1000 - s).abs() <= 1, "{ms} {s}");
        assert!((f - s as f64).abs() <= 1.0, "{f} {s}");
    }
}
