//! How close waiting work is to its deadline: the numbers an autoscaler
//! needs besides the backlog (upstream's deadline proximity, llm-d-async
//! #400). A backlog of a thousand messages due tomorrow asks for no pool
//! now; ten messages due in five minutes do.
//!
//! Transports that order waiting work by deadline (Redis, the embedded
//! store, `sql`, in memory) answer [`crate::queue::Queue::due`] with
//! counts at fixed horizons and the earliest deadline, read at the
//! backlog's cadence.

/// The horizons (seconds from now) waiting work is counted within:
/// a minute, five, fifteen, an hour, four hours, a day. Fixed, so a
/// dashboard or a KEDA trigger can name one (`within_seconds="900"`).
pub const HORIZONS: [i64; 6] = [60, 300, 900, 3600, 14_400, 86_400];

/// Waiting work by time to deadline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DueProfile {
    /// Messages whose deadline is at most `HORIZONS[i]` seconds away
    /// (already overdue ones included), cumulative.
    pub within: [u64; HORIZONS.len()],
    /// The earliest deadline among waiting messages (Unix seconds); `None`
    /// when nothing waits.
    pub earliest: Option<i64>,
}

impl DueProfile {
    /// The profile of waiting deadlines (Unix seconds, any order) at `now`.
    pub fn of(now: i64, deadlines: impl IntoIterator<Item = i64>) -> Self {
        let mut profile = Self::default();
        for deadline in deadlines {
            profile.add(now, deadline, 1);
        }
        profile
    }

    /// Counts `n` messages due at `deadline`.
    fn add(&mut self, now: i64, deadline: i64, n: u64) {
        let left = deadline.saturating_sub(now);
        for (count, horizon) in self.within.iter_mut().zip(HORIZONS) {
            if left <= horizon {
                *count += n;
            }
        }
        self.earliest = Some(self.earliest.map_or(deadline, |e| e.min(deadline)));
    }

    /// The profile from counts a store took itself (`within[i]` = waiting
    /// with deadline <= now + `HORIZONS[i]`) and its earliest deadline.
    pub fn from_counts(within: [u64; HORIZONS.len()], earliest: Option<i64>) -> Self {
        Self { within, earliest }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_cumulative_and_overdue_work_counts_everywhere() {
        let now = 1_000_000;
        let p = DueProfile::of(now, [now - 5, now + 60, now + 61, now + 3600, now + 90_000]);
        assert_eq!(p.within, [2, 3, 3, 4, 4, 4]);
        assert_eq!(p.earliest, Some(now - 5));
    }

    #[test]
    fn nothing_waiting_is_all_zero_and_no_earliest() {
        let p = DueProfile::of(5, []);
        assert_eq!(p, DueProfile::default());
        assert_eq!(p.earliest, None);
    }
}
