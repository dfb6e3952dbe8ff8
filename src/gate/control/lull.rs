//! Lulls of the interactive load: the readings at which `feedback` may start
//! new batch requests.
//!
//! Why: a batch request costs the interactive requests decoding beside it
//! mostly at its start. Its prefill is one long engine step (on the CPU test
//! engine a 250-token prefill takes about as long as the 50 ms ITL bound),
//! and every request decoding at that step waits for it; its own decode
//! steps cost each of them a fraction of a millisecond. So the harm of a
//! start grows with the foreign (interactive) requests in the batch at that
//! moment, and the same number of starts harms least where that number is
//! low. A static cap starts a request whenever one finishes, wherever the
//! interactive load happens to be; starting only at lulls moves the starts
//! into the troughs.
//!
//! A lull is relative, not absolute: a reading whose foreign load per
//! engine is at or below the `quantile` of the last `readings` readings
//! (this one included). On a lightly used engine that is "no interactive
//! request running"; on a busy GPU pool, whose interactive load never
//! reaches zero, the lower part of its own range, so batch still starts
//! there instead of never.

use std::collections::VecDeque;

/// The recent foreign load and the lull rule over it.
#[derive(Debug, Clone)]
pub struct Lulls {
    quantile: f64,
    capacity: usize,
    recent: VecDeque<f64>,
}

/// What one reading is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lull {
    /// Whether new batch requests may start.
    pub is_lull: bool,
    /// The foreign load of this reading (requests per engine).
    pub foreign: f64,
    /// The level at or below which a reading is a lull.
    pub level: f64,
}

impl Lulls {
    /// A lull is a reading at or below the `quantile` (in [0, 1)) of the
    /// last `readings` (at least 1) readings.
    pub fn new(quantile: f64, readings: usize) -> Self {
        let capacity = readings.max(1);
        Self {
            quantile: quantile.clamp(0.0, 1.0),
            capacity,
            recent: VecDeque::with_capacity(capacity),
        }
    }

    /// The quantile a lull is at or below.
    pub fn quantile(&self) -> f64 {
        self.quantile
    }

    /// How many readings the level is taken over.
    pub fn readings(&self) -> usize {
        self.capacity
    }

    /// Records the foreign load of a new reading (requests per engine, not
    /// ours: running and waiting less our own in flight) and says whether
    /// it is a lull. A value that is not a finite number counts as no lull
    /// and is not recorded (fail closed: no start on a reading we cannot
    /// read).
    pub fn on_reading(&mut self, foreign: f64) -> Lull {
        if !foreign.is_finite() {
            return Lull {
                is_lull: false,
                foreign,
                level: self.level(),
            };
        }
        let foreign = foreign.max(0.0);
        if self.recent.len() == self.capacity {
            self.recent.pop_front();
        }
        self.recent.push_back(foreign);
        let level = self.level();
        Lull {
            is_lull: foreign <= level,
            foreign,
            level,
        }
    }

    /// The `quantile` of the recent readings (the lower one where it falls
    /// between two: a lull is never above what was seen), 0 before any.
    fn level(&self) -> f64 {
        let mut sorted: Vec<f64> = self.recent.iter().copied().collect();
        if sorted.is_empty() {
            return 0.0;
        }
        sorted.sort_by(f64::total_cmp);
        // Truncation is the lower neighbour; the index is below len.
        let index = (self.quantile * (sorted.len() - 1) as f64).floor() as usize;
        sorted[index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_a_lightly_used_engine_a_lull_is_no_foreign_request() {
        // A third of the readings see no interactive request: the lower
        // fifth is zero, so only those are lulls.
        let mut lulls = Lulls::new(0.2, 120);
        let pattern = [0.0, 1.0, 2.0, 0.0, 1.0, 3.0];
        let mut seen = Vec::new();
        for _ in 0..20 {
            for &f in &pattern {
                seen.push(lulls.on_reading(f));
            }
        }
        let last: Vec<_> = seen[seen.len() - pattern.len()..].to_vec();
        let is_lull: Vec<bool> = last.iter().map(|l| l.is_lull).collect();
        assert_eq!(is_lull, [true, false, false, true, false, false]);
        assert!(last.iter().all(|l| l.level == 0.0));
    }

    #[test]
    fn on_a_busy_pool_the_lower_part_of_its_range_is_a_lull() {
        // Never below 20 requests per engine: a fixed rule of "no foreign
        // request" would never start; the quantile starts in the troughs.
        let mut lulls = Lulls::new(0.25, 8);
        let mut last = None;
        for f in [20.0, 30.0, 25.0, 40.0, 22.0, 35.0, 28.0, 33.0] {
            last = Some(lulls.on_reading(f));
        }
        // Sorted: 20 22 25 28 30 33 35 40; index floor(0.25 × 7) = 1.
        assert_eq!(last.map(|l| l.level), Some(22.0));
        assert!(!last.is_some_and(|l| l.is_lull));
        assert!(lulls.on_reading(21.0).is_lull);
        assert!(!lulls.on_reading(29.0).is_lull);
    }

    #[test]
    fn the_history_is_bounded_and_forgets_old_load() {
        let mut lulls = Lulls::new(0.0, 3);
        for f in [0.0, 0.0, 0.0, 5.0, 6.0, 7.0] {
            lulls.on_reading(f);
        }
        // Only 5, 6, 7 remain: 5 is the new floor.
        assert!(lulls.on_reading(5.0).is_lull);
        assert!(!lulls.on_reading(6.0).is_lull);
    }

    #[test]
    fn an_idle_pool_is_always_a_lull_and_a_bad_value_never() {
        let mut lulls = Lulls::new(0.2, 10);
        assert!((0..30).all(|_| lulls.on_reading(0.0).is_lull));
        assert!(!lulls.on_reading(f64::NAN).is_lull);
        // The bad value was not recorded: the level is still 0.
        assert_eq!(lulls.on_reading(0.0).level, 0.0);
        // Our own requests counted twice would give a negative foreign
        // load: it counts as none.
        assert_eq!(lulls.on_reading(-2.0).foreign, 0.0);
    }
}
