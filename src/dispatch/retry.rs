//! Retry policy: how long a retryable failure waits before the message is
//! tried again, and whether it is tried at all.
//!
//! A pure calculator. The dispatch loop requeues the message with the
//! delay, so a retry passes the gate again and never jumps ahead of work
//! due earlier; nothing here sleeps or loops.
//!
//! The base delay is `initial × 2^(failures − 1)` capped at `max`: the
//! sequence of backon's `ExponentialBuilder` with factor 2 and no jitter
//! (a test checks the two agree). It is computed directly rather than by
//! iterating a backon backoff because the failure count arrives with the
//! message (possibly after a restart) and can be large, and because
//! backon's jitter adds up to another full delay on top, exceeding `max`.
//! Jitter here is "equal jitter": a uniform draw in `[base / 2, base]`, so
//! synchronised failures spread out while a retry never comes sooner than
//! half the base delay and never later than `max`.

use std::time::Duration;

use rand::RngExt;
use tokio::time::Instant;

use crate::config::DispatchConfig;

/// Backoff parameters for retryable failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Base delay after the first failure.
    pub initial: Duration,
    /// Largest delay the backoff produces (a server's `Retry-After` may ask
    /// for more and is honoured).
    pub max: Duration,
    /// Attempts after which the message is dead-lettered; `None` leaves the
    /// deadline as the only bound. `Some(0)` and `Some(1)` both mean a
    /// single attempt.
    pub max_attempts: Option<u32>,
    /// Spread delays with equal jitter (see the module docs).
    pub jitter: bool,
}

/// The `[dispatch]` retry keys, with jitter.
impl From<&DispatchConfig> for RetryPolicy {
    fn from(config: &DispatchConfig) -> Self {
        Self {
            initial: config.retry_initial_backoff,
            max: config.retry_max_backoff,
            max_attempts: config.max_attempts,
            jitter: true,
        }
    }
}

/// The config's defaults (one place for them).
impl Default for RetryPolicy {
    fn default() -> Self {
        Self::from(&DispatchConfig::default())
    }
}

/// What to do with a message after a retryable failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Requeue the message, due after `delay`.
    Retry {
        /// How long to wait before the next attempt.
        delay: Duration,
    },
    /// The attempt count is exhausted: dead-letter the message.
    DeadLetter,
    /// The deadline does not allow another attempt: the last HTTP answer,
    /// or `DEADLINE_EXCEEDED` without one, is the result.
    GiveUp,
}

impl RetryPolicy {
    /// The delay without jitter after `failures` failures (0 is treated as
    /// 1): `initial × 2^(failures − 1)`, capped at `max`, never panicking.
    pub fn base_delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1);
        let grown = 1u32
            .checked_shl(doublings)
            .and_then(|factor| self.initial.checked_mul(factor))
            .unwrap_or(Duration::MAX);
        grown.min(self.max)
    }

    /// Delay before the next attempt after `failures` failures so far
    /// (1-based): the exponential base delay, with equal jitter when
    /// enabled, and at least `retry_after` when the server asked for it.
    pub fn delay(&self, failures: u32, retry_after: Option<Duration>) -> Duration {
        let sample = if self.jitter {
            rand::rng().random::<f64>()
        } else {
            1.0
        };
        self.delay_with_sample(failures, retry_after, sample)
    }

    /// Decides after a retryable failure, `failures` counting every failed
    /// attempt so far including this one: [`RetryDecision::DeadLetter`] when
    /// `max_attempts` is reached, else [`RetryDecision::Retry`] when the
    /// next attempt would start before the deadline, else
    /// [`RetryDecision::GiveUp`].
    pub fn decide(
        &self,
        failures: u32,
        retry_after: Option<Duration>,
        now: Instant,
        deadline: Instant,
    ) -> RetryDecision {
        let delay = self.delay(failures, retry_after);
        self.decide_with_delay(failures, delay, now, deadline)
    }

    fn decide_with_delay(
        &self,
        failures: u32,
        delay: Duration,
        now: Instant,
        deadline: Instant,
    ) -> RetryDecision {
        if self.max_attempts.is_some_and(|max| failures >= max) {
            return RetryDecision::DeadLetter;
        }
        match now.checked_add(delay) {
            Some(next) if next < deadline => RetryDecision::Retry { delay },
            _ => RetryDecision::GiveUp,
        }
    }

    /// [`Self::delay`] with the jitter draw supplied (`sample` in [0, 1]; 1
    /// is the full base delay), so tests are deterministic.
    fn delay_with_sample(
        &self,
        failures: u32,
        retry_after: Option<Duration>,
        sample: f64,
    ) -> Duration {
        let base = self.base_delay(failures);
        let delay = if self.jitter {
            let floor = base / 2;
            let span = base - floor;
            let sample = if sample.is_finite() {
                sample.clamp(0.0, 1.0)
            } else {
                1.0
            };
            // The float product can exceed `span` by rounding, or not fit a
            // Duration for spans near Duration::MAX: fall back to `span`.
            let extra = Duration::try_from_secs_f64(span.as_secs_f64() * sample)
                .unwrap_or(span)
                .min(span);
            floor + extra
        } else {
            base
        };
        retry_after.map_or(delay, |asked| delay.max(asked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backon::{BackoffBuilder, ExponentialBuilder};
    use proptest::prelude::*;

    fn policy(jitter: bool) -> RetryPolicy {
        RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            max_attempts: None,
            jitter,
        }
    }

    #[test]
    fn grows_exponentially_up_to_max() {
        let p = policy(false);
        let delays: Vec<_> = (1..=12).map(|n| p.delay(n, None)).collect();
        assert_eq!(delays[0], Duration::from_millis(100));
        assert_eq!(delays[1], Duration::from_millis(200));
        assert_eq!(delays[2], Duration::from_millis(400));
        assert!(delays.windows(2).all(|w| w[0] <= w[1]), "{delays:?}");
        assert_eq!(delays[11], Duration::from_secs(10));
        assert_eq!(p.delay(u32::MAX, None), Duration::from_secs(10));
        assert_eq!(p.delay(0, None), Duration::from_millis(100));
    }

    #[test]
    fn matches_backon_exponential_without_jitter() {
        let p = policy(false);
        let backon = ExponentialBuilder::default()
            .with_min_delay(p.initial)
            .with_max_delay(p.max)
            .with_factor(2.0)
            .without_max_times()
            .build();
        for (failures, theirs) in (1..=20).zip(backon) {
            let ours = p.delay(failures, None);
            let diff = ours.abs_diff(theirs);
            assert!(
                diff < Duration::from_millis(1),
                "{failures}: {ours:?} vs {theirs:?}"
            );
        }
    }

    #[test]
    fn jitter_stays_between_half_and_full_base() {
        let p = policy(true);
        for failures in 1..=10 {
            let base = p.base_delay(failures);
            assert_eq!(p.delay_with_sample(failures, None, 0.0), base / 2);
            assert_eq!(p.delay_with_sample(failures, None, 1.0), base);
            for _ in 0..50 {
                let d = p.delay(failures, None);
                assert!(d >= base / 2 && d <= base, "{failures}: {d:?} vs {base:?}");
            }
        }
    }

    #[test]
    fn retry_after_raises_the_delay_but_never_lowers_it() {
        let p = policy(false);
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(30))),
            Duration::from_secs(30)
        );
        assert_eq!(
            p.delay(3, Some(Duration::from_millis(1))),
            Duration::from_millis(400)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dead_letters_when_attempts_are_exhausted() {
        let p = RetryPolicy {
            max_attempts: Some(3),
            ..policy(false)
        };
        let now = Instant::now();
        let deadline = now + Duration::from_secs(3600);
        assert_eq!(
            p.decide(1, None, now, deadline),
            RetryDecision::Retry {
                delay: Duration::from_millis(100)
            }
        );
        assert!(matches!(
            p.decide(2, None, now, deadline),
            RetryDecision::Retry { .. }
        ));
        assert_eq!(p.decide(3, None, now, deadline), RetryDecision::DeadLetter);
        assert_eq!(p.decide(9, None, now, deadline), RetryDecision::DeadLetter);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_when_the_deadline_does_not_allow_another_attempt() {
        let p = policy(false);
        let now = Instant::now();
        let deadline = now + Duration::from_millis(350);
        // 100 ms and 200 ms fit before the deadline; 400 ms does not.
        assert!(matches!(
            p.decide(2, None, now, deadline),
            RetryDecision::Retry { .. }
        ));
        assert_eq!(p.decide(3, None, now, deadline), RetryDecision::GiveUp);
        // A server asking for longer than the deadline allows ends it too.
        assert_eq!(
            p.decide(1, Some(Duration::from_secs(1)), now, deadline),
            RetryDecision::GiveUp
        );
        // Exactly at the deadline is too late.
        let tight = now + Duration::from_millis(100);
        assert_eq!(p.decide(1, None, now, tight), RetryDecision::GiveUp);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            p.decide(1, None, Instant::now(), deadline),
            RetryDecision::GiveUp
        );
    }

    fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            (0u64..10_000_000_000).prop_map(Duration::from_nanos),
            (0u64..u64::MAX, 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
            Just(Duration::MAX),
            Just(Duration::ZERO),
        ]
    }

    proptest! {
        #[test]
        fn delay_never_exceeds_max_unless_the_server_asked(
            initial in any_duration(),
            max in any_duration(),
            jitter in any::<bool>(),
            failures in any::<u32>(),
            retry_after in proptest::option::of(any_duration()),
            sample in any::<f64>(),
        ) {
            let p = RetryPolicy { initial, max, max_attempts: None, jitter };
            let d = p.delay_with_sample(failures, retry_after, sample);
            prop_assert!(d <= max.max(retry_after.unwrap_or_default()));
            if let Some(asked) = retry_after {
                prop_assert!(d >= asked);
            }
            let random = p.delay(failures, retry_after);
            prop_assert!(random <= max.max(retry_after.unwrap_or_default()));
        }

        #[test]
        fn base_delay_is_monotone(initial in any_duration(), max in any_duration(), failures in 0u32..u32::MAX) {
            let p = RetryPolicy { initial, max, max_attempts: None, jitter: false };
            prop_assert!(p.base_delay(failures) <= p.base_delay(failures + 1));
        }

        #[test]
        fn decide_never_panics(
            failures in any::<u32>(),
            max_attempts in proptest::option::of(any::<u32>()),
            retry_after in proptest::option::of(any_duration()),
            ahead_ms in 0u64..10_000_000,
        ) {
            let p = RetryPolicy { max_attempts, ..policy(true) };
            let now = Instant::now();
            let deadline = now + Duration::from_millis(ahead_ms);
            match p.decide(failures, retry_after, now, deadline) {
                RetryDecision::Retry { delay } => prop_assert!(now + delay < deadline),
                RetryDecision::DeadLetter => prop_assert!(max_attempts.is_some_and(|m| failures >= m)),
                RetryDecision::GiveUp => {}
            }
        }
    }
}
