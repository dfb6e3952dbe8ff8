//! Paced release: spreads the window's grants over time. Pure: no I/O, no
//! clock; callers pass instants in.
//!
//! A window that opens releases everything it allows at once, and a burst
//! of batch prompts lands in the engines' same few steps: their chunked
//! prefill lengthens the steps that carry interactive decodes and breaks
//! ITL long before the pool is busy (docs/gate-quality.md). Pacing bounds
//! the rate at which batch work *starts*, in requests or in prompt tokens
//! per second, on top of the window, which still bounds what is in flight:
//! a paced send is always one the window allows too.
//!
//! The rule (`dispatch.pace`, `pace_rate`, `pace_burst`):
//! - a credit in the pace unit grows at `rate` per second up to `burst`;
//! - a request may go once the credit holds one unit (or all of `burst`,
//!   if that is less), and is charged its whole cost (1 request, or its
//!   prompt tokens), which may leave the credit below zero: a long prompt
//!   goes whole, then the next waits until its cost has been earned back;
//! - so over any span `T` at most `burst + rate × T` units start, plus one
//!   request's cost (exactly `burst + rate × T` requests for a `requests`
//!   pace).
//!
//! The credit starts full. Nothing accrues beyond `burst` while nothing
//! waits, so a window that opens after a quiet spell still starts at most
//! `burst` at once.

use std::time::Duration;

use tokio::time::Instant;

/// Credit within this of the threshold counts as reaching it.
const CREDIT_TOLERANCE: f64 = 1e-9;

/// What paced release counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaceUnit {
    /// Requests started per second.
    Requests,
    /// Prompt tokens started per second (the prefill work that enters the
    /// engines).
    Tokens,
}

/// A validated pace: `rate` units per second, credit capped at `burst`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace {
    /// What is counted.
    pub unit: PaceUnit,
    /// Units per second, finite and > 0.
    pub rate: f64,
    /// Most credit held, finite and > 0 (units that may start at once).
    pub burst: f64,
}

/// A pace that is not one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PaceError {
    /// The rate is not a finite number above zero.
    #[error("dispatch.pace_rate must be a finite number > 0, got {0}")]
    Rate(f64),
    /// The burst is not a finite number above zero.
    #[error("dispatch.pace_burst must be a finite number > 0, got {0}")]
    Burst(f64),
}

impl Pace {
    /// A pace of `rate` units per second with credit up to `burst`.
    pub fn new(unit: PaceUnit, rate: f64, burst: f64) -> Result<Self, PaceError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(PaceError::Rate(rate));
        }
        if !(burst.is_finite() && burst > 0.0) {
            return Err(PaceError::Burst(burst));
        }
        Ok(Self { unit, rate, burst })
    }

    /// What one request costs in the pace unit, given its prompt tokens
    /// (estimated in `run`, exact in `eval`); never 0.
    pub fn cost(&self, prompt_tokens: u64) -> u64 {
        match self.unit {
            PaceUnit::Requests => 1,
            PaceUnit::Tokens => prompt_tokens.max(1),
        }
    }
}

/// The credit of one pool's paced release.
#[derive(Debug, Clone)]
pub struct Pacer {
    pace: Pace,
    /// Credit at `at`, in units; below zero after a dear request.
    credit: f64,
    at: Instant,
}

impl Pacer {
    /// A pacer with full credit at `now`.
    pub fn new(pace: Pace, now: Instant) -> Self {
        Self {
            pace,
            credit: pace.burst,
            at: now,
        }
    }

    /// The pace it keeps.
    pub fn pace(&self) -> Pace {
        self.pace
    }

    /// Credit at `now` (never earlier than the last charge).
    fn credit(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        (self.credit + self.pace.rate * dt).min(self.pace.burst)
    }

    /// The credit a request needs to start: one unit, or the whole burst
    /// if that is less.
    fn threshold(&self) -> f64 {
        self.pace.burst.min(1.0)
    }

    /// Whether a request may start now.
    pub fn allows(&self, now: Instant) -> bool {
        // A hair of tolerance: credit earned in float steps must not miss
        // the instant it reaches the threshold.
        self.credit(now) >= self.threshold() - CREDIT_TOLERANCE
    }

    /// Requests of one unit each that may start now (for a `requests`
    /// pace: how many the window's room may use at once); 0 or 1 for a
    /// `tokens` pace, whose costs are known one request at a time.
    pub fn room(&self, now: Instant) -> u64 {
        if !self.allows(now) {
            return 0;
        }
        match self.pace.unit {
            // `as` saturates; credit is at most `burst`.
            PaceUnit::Requests => ((self.credit(now) + CREDIT_TOLERANCE).floor() as u64).max(1),
            PaceUnit::Tokens => 1,
        }
    }

    /// Charges a request of `cost` units started at `now`.
    pub fn spend(&mut self, now: Instant, cost: u64) {
        let credit = self.credit(now);
        self.credit = credit - cost as f64;
        self.at = self.at.max(now);
    }

    /// When the next request may start: `now` if it may already, else the
    /// instant the credit climbs above zero.
    pub fn ready_at(&self, now: Instant) -> Instant {
        if self.allows(now) {
            return now;
        }
        let missing = self.threshold() - self.credit(now);
        let wait = missing / self.pace.rate;
        now + Duration::from_secs_f64(wait.min(3600.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pace(unit: PaceUnit, rate: f64, burst: f64) -> Pace {
        Pace::new(unit, rate, burst).expect("valid pace")
    }

    #[test]
    fn rejects_rates_and_bursts_that_are_not_positive_numbers() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                Pace::new(PaceUnit::Requests, bad, 1.0),
                Err(PaceError::Rate(_))
            ));
            assert!(matches!(
                Pace::new(PaceUnit::Requests, 1.0, bad),
                Err(PaceError::Burst(_))
            ));
        }
        assert!(Pace::new(PaceUnit::Tokens, 4000.0, 256.0).is_ok());
    }

    #[test]
    fn requests_are_spread_at_the_rate() {
        // 10 requests/s, one at a time: a window of 30 opening at t0 starts
        // one request now and one every 100 ms.
        let t0 = Instant::now();
        let mut p = Pacer::new(pace(PaceUnit::Requests, 10.0, 1.0), t0);
        let mut started = Vec::new();
        for ms in (0..1000).step_by(10) {
            let now = t0 + Duration::from_millis(ms);
            while p.allows(now) && started.len() < 30 {
                p.spend(now, 1);
                started.push(ms);
            }
        }
        assert_eq!(started.len(), 10, "{started:?}");
        assert_eq!(started[..4], [0, 100, 200, 300]);
    }

    #[test]
    fn burst_lets_that_many_go_at_once_then_the_rate() {
        let t0 = Instant::now();
        let mut p = Pacer::new(pace(PaceUnit::Requests, 10.0, 4.0), t0);
        assert_eq!(p.room(t0), 4);
        for _ in 0..4 {
            assert!(p.allows(t0));
            p.spend(t0, 1);
        }
        assert!(!p.allows(t0));
        assert_eq!(p.room(t0), 0);
        let due = p.ready_at(t0).duration_since(t0);
        assert!(due.abs_diff(Duration::from_millis(100)) < Duration::from_micros(1));
        assert!(p.allows(p.ready_at(t0)));
        // A quiet spell does not store more than the burst.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(p.room(later), 4);
    }

    #[test]
    fn a_dear_prompt_goes_whole_and_the_next_waits_until_it_is_paid() {
        // 1000 prompt tokens/s: a 2000-token prompt goes at once, the next
        // one once 2000 tokens are earned back and one more is held.
        let t0 = Instant::now();
        let pace = pace(PaceUnit::Tokens, 1000.0, 100.0);
        let mut p = Pacer::new(pace, t0);
        assert_eq!(pace.cost(2000), 2000);
        assert_eq!(pace.cost(0), 1);
        assert!(p.allows(t0));
        p.spend(t0, pace.cost(2000));
        let due = p.ready_at(t0);
        let wait = due.duration_since(t0);
        assert!(wait.abs_diff(Duration::from_millis(1901)) < Duration::from_micros(1));
        assert!(!p.allows(t0 + Duration::from_millis(1900)));
        assert!(p.allows(due));
        assert_eq!(p.room(due), 1, "tokens: one request at a time");
    }

    proptest! {
        /// Over any run, what starts is at most burst + rate × elapsed +
        /// one request's cost, and a request only starts when allowed.
        #[test]
        fn never_faster_than_the_pace(
            rate in 0.5f64..5000.0,
            burst in 1.0f64..500.0,
            tokens in proptest::bool::ANY,
            steps in proptest::collection::vec((0u64..300, 1u64..2000), 1..200),
        ) {
            let unit = if tokens { PaceUnit::Tokens } else { PaceUnit::Requests };
            let pace = pace(unit, rate, burst);
            let t0 = Instant::now();
            let mut now = t0;
            let mut p = Pacer::new(pace, t0);
            let mut spent = 0u64;
            let mut dearest = 0u64;
            for (advance_ms, prompt) in steps {
                now += Duration::from_millis(advance_ms);
                if p.allows(now) {
                    let cost = pace.cost(prompt);
                    p.spend(now, cost);
                    spent += cost;
                    dearest = dearest.max(cost);
                } else {
                    prop_assert!(p.ready_at(now) > now);
                }
                let elapsed = now.duration_since(t0).as_secs_f64();
                prop_assert!(
                    spent as f64 <= burst + rate * elapsed + dearest as f64 + 1e-6,
                    "{spent} started in {elapsed} s at {rate}/s, burst {burst}"
                );
            }
        }
    }
}
