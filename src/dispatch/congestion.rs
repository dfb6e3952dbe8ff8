//! Congestion hold: what a 429/503 from the gateway (or an attempt that
//! was refused, reset or timed out) does to dispatch. Pure:
//! no I/O, no clock, no randomness; callers pass instants and a uniform
//! jitter sample in.
//!
//! The rule (docs/architecture.md, "When the budget is zero"):
//! - a 429 or 503 means the pool is saturated despite the budget (a spike
//!   arrived before the metrics showed it), so nothing more is sent to that
//!   gateway, from any queue, for a hold;
//! - the hold is `Retry-After` when the gateway gives one, but never shorter
//!   than an exponential, jittered backoff that grows with consecutive
//!   signals, so `Retry-After: 0`, a date in the past or a missing header
//!   cannot turn the hold into a storm;
//! - when the hold ends, exactly one probe request goes; its answer decides:
//!   any other HTTP answer clears the congestion (and resets the backoff),
//!   another 429/503 holds again, longer;
//! - answers to requests sent *before* the latest signal say nothing about
//!   the pool now: they neither clear the hold nor count as a new
//!   consecutive signal (a window of 30 requests all answered 429 is one
//!   signal, not 30), though a longer `Retry-After` among them is honoured.
//!
//! Congestion signals are the 429/503 answers and the failures below HTTP
//! that say the same (connection refused, reset or broken, attempt timed
//! out: `AttemptFailure::is_congestion_signal`). Only 429/503 also shut the
//! window until a newer observation (a spike the metrics have not shown
//! yet); a reset is no evidence that the metrics lag, and the hold alone
//! bounds what the gateway sees.
//!
//! What a message turned away this way does next ([`after_congestion`]):
//! back to the queue while its next attempt can start before its
//! deadline, else it waits for the deadline (or for the hold to lift) and
//! is not answered before.
//!
//! The window's own rule (budget zero until an observation newer than the
//! rejection, `dispatch::window`) still applies; for blind gates, whose
//! observations are always new, this hold is what keeps the gateway quiet.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// How long holds last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CongestionPolicy {
    /// Hold after the first signal (before jitter); > 0.
    pub initial_backoff: Duration,
    /// Ceiling of the hold computed from the backoff; > 0. A longer
    /// `Retry-After` is still honoured.
    pub max_backoff: Duration,
}

/// The holds configured in `[dispatch]`.
impl From<&crate::config::DispatchConfig> for CongestionPolicy {
    fn from(d: &crate::config::DispatchConfig) -> Self {
        Self {
            initial_backoff: d.congestion_backoff,
            max_backoff: d.congestion_max_backoff,
        }
    }
}

impl CongestionPolicy {
    /// The backoff after `consecutive` (≥ 1) signals, with "equal jitter":
    /// half the exponential step is fixed, half is spread by `jitter` in
    /// [0, 1), so holds never collapse to zero and replicas that saw the
    /// same 429 do not all probe at the same instant.
    pub fn backoff(&self, consecutive: u32, jitter: f64) -> Duration {
        let exponent = consecutive.saturating_sub(1).min(30);
        let step = self
            .initial_backoff
            .saturating_mul(1u32 << exponent)
            .min(self.max_backoff);
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        step / 2 + step.mul_f64(0.5 * jitter)
    }
}

/// What the congestion state allows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clearance {
    /// No congestion: the window alone decides.
    Open,
    /// The hold is over: one probe request may go (call
    /// [`Congestion::probe_started`] when it does).
    Probe,
    /// Nothing may go. `until` is when the hold ends, or `None` while the
    /// probe's answer is awaited.
    Held {
        /// End of the hold, if it is timed.
        until: Option<Instant>,
    },
}

/// Congestion state shared by every queue that sends to one gateway.
#[derive(Debug, Clone)]
pub struct Congestion {
    policy: CongestionPolicy,
    /// Signals since the last clearing answer, counting only those from
    /// requests sent after the previous signal.
    consecutive: u32,
    /// When the latest counted signal arrived; `None` when clear.
    signalled_at: Option<Instant>,
    /// No request (not even the probe) before this.
    hold_until: Option<Instant>,
    /// The probe is out and its answer not yet known.
    probe_out: bool,
}

impl Congestion {
    /// A clear state.
    pub fn new(policy: CongestionPolicy) -> Self {
        Self {
            policy,
            consecutive: 0,
            signalled_at: None,
            hold_until: None,
            probe_out: false,
        }
    }

    /// What may be sent at `now`.
    pub fn clearance(&self, now: Instant) -> Clearance {
        if self.signalled_at.is_none() {
            return Clearance::Open;
        }
        match self.hold_until {
            Some(until) if now < until => Clearance::Held { until: Some(until) },
            _ if self.probe_out => Clearance::Held { until: None },
            _ => Clearance::Probe,
        }
    }

    /// The probe request was sent.
    pub fn probe_started(&mut self) {
        self.probe_out = true;
    }

    /// The probe ended without an HTTP answer (transport error, timeout,
    /// or it was never sent): another probe may go.
    pub fn probe_abandoned(&mut self) {
        self.probe_out = false;
    }

    /// Consecutive counted signals (0 when clear), for metrics and logs.
    pub fn consecutive(&self) -> u32 {
        self.consecutive
    }

    /// A congestion signal (a 429/503, or a refused, reset or timed-out
    /// attempt) arrived at `now` for a request sent at `sent_at`, with the
    /// gateway's `Retry-After` if any. Returns how long the hold lasts from
    /// `now` (the delay to give the rejected message).
    pub fn signal(
        &mut self,
        now: Instant,
        sent_at: Instant,
        retry_after: Option<Duration>,
        jitter: f64,
    ) -> Duration {
        let asked = retry_after.unwrap_or(Duration::ZERO);
        if self.signalled_at.is_some_and(|s| sent_at < s) {
            // An answer to a request that was already out when the pool
            // said no: the same congestion, not a new one.
            self.extend_hold(now + asked);
            return self.remaining(now);
        }
        self.consecutive = self.consecutive.saturating_add(1);
        self.signalled_at = Some(now);
        self.probe_out = false;
        let backoff = self.policy.backoff(self.consecutive, jitter);
        self.extend_hold(now + asked.max(backoff));
        self.remaining(now)
    }

    /// A request sent at `sent_at` got an HTTP answer other than 429/503:
    /// if it was sent after the latest signal (the probe), the pool takes
    /// work again.
    pub fn answered(&mut self, sent_at: Instant) {
        if self.signalled_at.is_none_or(|s| sent_at >= s) {
            self.consecutive = 0;
            self.signalled_at = None;
            self.hold_until = None;
            self.probe_out = false;
        }
    }

    fn extend_hold(&mut self, until: Instant) {
        self.hold_until = Some(self.hold_until.map_or(until, |h| h.max(until)));
    }

    fn remaining(&self, now: Instant) -> Duration {
        self.hold_until
            .map_or(Duration::ZERO, |h| h.saturating_duration_since(now))
    }
}

/// What a message whose attempt met congestion does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCongestion {
    /// Back to the queue, due after `delay` (the hold, or the message's own
    /// backoff when longer); its next attempt can start before the deadline.
    Requeue {
        /// How long until the message is due again.
        delay: Duration,
    },
    /// No attempt can start before the deadline: keep the message and
    /// answer it with its last answer *at* the deadline, or requeue it as
    /// soon as the hold lifts (another request's answer can clear it early).
    AwaitDeadline,
}

/// The rule for a message turned away by congestion (429/503, or a
/// refused, reset or timed-out attempt) that must wait `wait` before it may
/// be tried again, at `now`, due by `deadline`:
/// - the wait ends before the deadline: requeue it with that delay;
/// - otherwise it is not answered yet: the deadline, or attempts used up,
///   are what make a congestion answer final. Answering at once, as before
///   issue 22, gave a 429 as the final answer 48.5 s before its deadline
///   whenever the hold (up to `congestion_max_backoff`, or a long
///   `Retry-After`) outlasted the time left, though the hold could still
///   lift and leave time for another attempt.
pub fn after_congestion(wait: Duration, now: Instant, deadline: Instant) -> AfterCongestion {
    match now.checked_add(wait) {
        Some(due) if due < deadline => AfterCongestion::Requeue { delay: wait },
        _ => AfterCongestion::AwaitDeadline,
    }
}

/// The congestion state of one gateway, shared by every queue (and every
/// dispatcher task) that sends to it, so a 429 seen by one queue holds
/// them all.
#[derive(Debug)]
pub struct CongestionHold {
    state: Mutex<Congestion>,
}

/// A hold with the configuration's default policy.
impl Default for CongestionHold {
    fn default() -> Self {
        Self::new((&crate::config::DispatchConfig::default()).into())
    }
}

impl CongestionHold {
    /// A clear hold following `policy`.
    pub fn new(policy: CongestionPolicy) -> Self {
        Self {
            state: Mutex::new(Congestion::new(policy)),
        }
    }

    /// The state, for a check-and-update that must be atomic (starting the
    /// one probe, recording a signal).
    pub fn lock(&self) -> MutexGuard<'_, Congestion> {
        // Congestion methods do not panic; a poisoned lock still holds a
        // consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What may be sent at `now`.
    pub fn clearance(&self, now: Instant) -> Clearance {
        self.lock().clearance(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> CongestionPolicy {
        CongestionPolicy {
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        }
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn backoff_grows_exponentially_within_jitter_and_cap() {
        let p = policy();
        assert_eq!(p.backoff(1, 0.0), secs(0.5));
        assert_eq!(p.backoff(1, 1.0), secs(1.0));
        assert_eq!(p.backoff(3, 0.0), secs(2.0));
        let near_top = p.backoff(3, 0.999_999);
        assert!(
            near_top > secs(3.99) && near_top <= secs(4.0),
            "{near_top:?}"
        );
        assert_eq!(p.backoff(10, 1.0), secs(30.0));
        assert_eq!(p.backoff(u32::MAX, 1.0), secs(30.0));
        assert_eq!(p.backoff(2, f64::NAN), secs(1.0));
    }

    #[test]
    fn retry_after_zero_still_holds_for_the_backoff() {
        let t0 = Instant::now();
        let mut c = Congestion::new(policy());
        let hold = c.signal(t0, t0, Some(Duration::ZERO), 0.0);
        assert_eq!(hold, secs(0.5));
        assert_eq!(
            c.clearance(t0 + secs(0.4)),
            Clearance::Held {
                until: Some(t0 + secs(0.5))
            }
        );
        assert_eq!(c.clearance(t0 + secs(0.5)), Clearance::Probe);
    }

    #[test]
    fn longer_retry_after_is_honoured() {
        let t0 = Instant::now();
        let mut c = Congestion::new(policy());
        assert_eq!(c.signal(t0, t0, Some(secs(7.0)), 1.0), secs(7.0));
        assert!(matches!(
            c.clearance(t0 + secs(6.9)),
            Clearance::Held { .. }
        ));
        assert_eq!(c.clearance(t0 + secs(7.0)), Clearance::Probe);
    }

    #[test]
    fn one_probe_after_the_hold_then_its_answer_decides() {
        let t0 = Instant::now();
        let mut c = Congestion::new(policy());
        c.signal(t0, t0, None, 0.0);
        let t1 = t0 + secs(1.0);
        assert_eq!(c.clearance(t1), Clearance::Probe);
        c.probe_started();
        assert_eq!(c.clearance(t1), Clearance::Held { until: None });
        // The probe is rejected too: a longer hold.
        let hold = c.signal(t1 + secs(0.1), t1, None, 0.0);
        assert_eq!(hold, secs(1.0));
        assert_eq!(c.consecutive(), 2);
        let t2 = t1 + secs(1.1);
        assert_eq!(c.clearance(t2), Clearance::Probe);
        c.probe_started();
        c.answered(t2);
        assert_eq!(c.clearance(t2), Clearance::Open);
        assert_eq!(c.consecutive(), 0);
        // After a clear answer the next signal starts from the first step.
        assert_eq!(c.signal(t2, t2, None, 0.0), secs(0.5));
    }

    #[test]
    fn answers_to_requests_sent_before_the_signal_change_nothing() {
        let t0 = Instant::now();
        let mut c = Congestion::new(policy());
        let before = t0 - secs(1.0);
        c.signal(t0, before, None, 0.0);
        // 29 more 429s for requests that were already out: one signal.
        for i in 0..29 {
            c.signal(t0 + secs(0.01 * f64::from(i)), before, None, 0.0);
        }
        assert_eq!(c.consecutive(), 1);
        // A success of an old request does not clear the hold.
        c.answered(before);
        assert!(matches!(c.clearance(t0), Clearance::Held { .. }));
        // But an old request's longer Retry-After extends it.
        c.signal(t0, before, Some(secs(5.0)), 0.0);
        assert!(matches!(
            c.clearance(t0 + secs(4.9)),
            Clearance::Held { .. }
        ));
    }

    #[test]
    fn a_wait_that_ends_before_the_deadline_requeues_else_the_deadline_decides() {
        let t0 = Instant::now();
        let deadline = t0 + secs(10.0);
        assert_eq!(
            after_congestion(secs(2.0), t0, deadline),
            AfterCongestion::Requeue { delay: secs(2.0) }
        );
        assert_eq!(
            after_congestion(secs(9.999), t0, deadline),
            AfterCongestion::Requeue { delay: secs(9.999) }
        );
        // Due exactly at the deadline is too late to try again.
        assert_eq!(
            after_congestion(secs(10.0), t0, deadline),
            AfterCongestion::AwaitDeadline
        );
        // The case: a 60 s hold with 48.5 s left is no final answer yet.
        assert_eq!(
            after_congestion(secs(60.0), t0, t0 + secs(48.5)),
            AfterCongestion::AwaitDeadline
        );
        assert_eq!(
            after_congestion(Duration::MAX, t0, deadline),
            AfterCongestion::AwaitDeadline
        );
        // A deadline already passed never requeues.
        assert_eq!(
            after_congestion(Duration::ZERO, t0, t0),
            AfterCongestion::AwaitDeadline
        );
    }

    #[test]
    fn an_abandoned_probe_lets_another_go() {
        let t0 = Instant::now();
        let mut c = Congestion::new(policy());
        c.signal(t0, t0, None, 0.0);
        c.probe_started();
        c.probe_abandoned();
        assert_eq!(c.clearance(t0 + secs(1.0)), Clearance::Probe);
    }
}
