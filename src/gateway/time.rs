//! Unix-seconds deadlines (wall clock, as submitters write them) mapped onto
//! tokio's monotonic clock, so timeouts and tests on a paused clock agree.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// Furthest a deadline is placed in the future. Far beyond any useful
/// deadline, and small enough that adding it to an `Instant` cannot
/// overflow on supported platforms.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// The tokio instant at which the Unix-seconds deadline `unix_secs` falls,
/// reading the wall clock and tokio's clock now. Never panics: past, zero
/// or negative deadlines become an instant that has already passed, huge
/// ones about 30 years ahead.
pub fn deadline_instant(unix_secs: i64) -> Instant {
    deadline_instant_at(unix_secs, SystemTime::now(), Instant::now())
}

/// [`deadline_instant`] with both clocks supplied, for tests.
pub fn deadline_instant_at(unix_secs: i64, now_wall: SystemTime, now: Instant) -> Instant {
    // Negative seconds are before the epoch: as passed as the epoch itself.
    let secs = u64::try_from(unix_secs).unwrap_or(0);
    let Some(deadline_wall) = UNIX_EPOCH.checked_add(Duration::from_secs(secs)) else {
        // Beyond SystemTime's range: as good as never.
        return far_future(now);
    };
    match deadline_wall.duration_since(now_wall) {
        Ok(ahead) if ahead > FAR_FUTURE => far_future(now),
        // `now + ahead` cannot overflow: ahead <= FAR_FUTURE (see there).
        Ok(ahead) => now.checked_add(ahead).unwrap_or_else(|| far_future(now)),
        // Already passed: any instant at or before `now` means "expired";
        // `now` itself stands in should the monotonic clock not reach back
        // that far.
        Err(behind) => now
            .checked_sub(behind.duration().min(FAR_FUTURE))
            .unwrap_or(now),
    }
}

fn far_future(now: Instant) -> Instant {
    // One day is the fallback horizon should 30 years not fit; `now` is the
    // last resort and only reachable on a clock near its end of range.
    now.checked_add(FAR_FUTURE)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW_SECS: u64 = 1_800_000_000;

    fn wall() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW_SECS)
    }

    #[tokio::test(start_paused = true)]
    async fn future_deadline_maps_to_the_same_distance_ahead() {
        let now = Instant::now();
        let at = deadline_instant_at((NOW_SECS + 90) as i64, wall(), now);
        assert_eq!(at - now, Duration::from_secs(90));
    }

    #[tokio::test(start_paused = true)]
    async fn past_and_non_positive_deadlines_have_passed() {
        let now = Instant::now();
        for secs in [(NOW_SECS - 10) as i64, 1, 0, -1, i64::MIN] {
            assert!(deadline_instant_at(secs, wall(), now) <= now, "{secs}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn huge_deadline_saturates_far_ahead() {
        let now = Instant::now();
        let at = deadline_instant_at(i64::MAX, wall(), now);
        assert!(at - now >= Duration::from_secs(365 * 24 * 3600));
    }

    proptest! {
        #[test]
        fn never_panics_and_orders_like_the_wall_clock(secs in any::<i64>(), other in any::<i64>()) {
            let now = std::time::Instant::now().into();
            let a = deadline_instant_at(secs, wall(), now);
            let b = deadline_instant_at(other, wall(), now);
            if secs <= other {
                prop_assert!(a <= b);
            }
        }
    }
}
