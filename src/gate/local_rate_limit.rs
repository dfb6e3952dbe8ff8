//! `local-rate-limit`: a token bucket in this process, one per queue (each
//! queue builds its own gate), as upstream PR #186: `requests_per_minute`
//! tokens a minute, at most `burst` saved up, one per admitted message.
//! Upstream blocks the worker until a token refills; here a message
//! without a token waits (parked, holding no window room) and asks again.
//! A token taken for a message that is not sent after all (a later gate
//! or the window said no) is given back. The budget is open: the bucket
//! decides per message.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::param::{GateParams, ParseCx, loose};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, DispatchGate, Explanation, GateContext,
    GateError, Observation, Ticket,
};

/// Parameters of `local-rate-limit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalRateLimitParams {
    /// Tokens added per minute, > 0 (required).
    #[serde(deserialize_with = "loose::f64")]
    pub requests_per_minute: f64,
    /// Most tokens the bucket holds, >= 1 (default 1: no burst).
    #[serde(deserialize_with = "loose::f64")]
    pub burst: f64,
}

impl Default for LocalRateLimitParams {
    fn default() -> Self {
        Self {
            requests_per_minute: 0.0,
            burst: 1.0,
        }
    }
}

impl GateParams for LocalRateLimitParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        // Upstream turns a zero or negative rate into 1 a minute and a
        // burst below one into 1; a typo must not become a rate, so both
        // are errors here.
        if cx.require("requests_per_minute", "tokens per minute, > 0") {
            cx.positive("requests_per_minute", self.requests_per_minute);
        }
        if self.burst < 1.0 {
            cx.error(
                "burst",
                format!(
                    "must be >= 1 (a bucket smaller than one token never admits), got {}",
                    self.burst
                ),
            );
        }
    }

    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(LocalRateLimitGate::new(
            self.requests_per_minute,
            self.burst,
        )))
    }
}

/// A token bucket on an explicit clock: the caller says what time it is,
/// so tests drive it with made-up instants.
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    /// Most tokens held.
    capacity: f64,
    /// Tokens added per second.
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub(crate) fn new(capacity: f64, rate_per_second: f64, now: Instant) -> Self {
        Self {
            capacity,
            rate: rate_per_second,
            tokens: capacity,
            last: now,
        }
    }

    /// Adds what accrued since the last call. An instant before the last
    /// one (callers racing) adds nothing rather than taking away.
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.last = self.last.max(now);
    }

    /// Takes one token at `now` if there is one.
    pub(crate) fn try_take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Gives a taken token back (its message was not sent).
    pub(crate) fn give_back(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.capacity);
    }

    /// Tokens held at `now`.
    pub(crate) fn tokens(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.tokens
    }

    /// How long from `now` until a token is there (zero if one is).
    pub(crate) fn next_token_in(&mut self, now: Instant) -> Duration {
        let missing = 1.0 - self.tokens(now);
        if missing <= 0.0 {
            Duration::ZERO
        } else {
            Duration::try_from_secs_f64(missing / self.rate).unwrap_or(Duration::MAX)
        }
    }
}

/// The `local-rate-limit` gate.
#[derive(Debug)]
pub struct LocalRateLimitGate {
    per_minute: f64,
    burst: f64,
    bucket: Arc<Mutex<TokenBucket>>,
}

impl LocalRateLimitGate {
    /// `per_minute` (> 0) tokens a minute, at most `burst` (>= 1) held;
    /// the bucket starts full.
    pub fn new(per_minute: f64, burst: f64) -> Self {
        let bucket = TokenBucket::new(burst, per_minute / 60.0, Instant::now());
        Self {
            per_minute,
            burst,
            bucket: Arc::new(Mutex::new(bucket)),
        }
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, TokenBucket> {
        self.bucket.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl DispatchGate for LocalRateLimitGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        // The bucket decides per message; the budget says nothing about the
        // pool: a fresh, open reading each time (as `constant`).
        let tokens = self.bucket().tokens(Instant::now());
        let mut reading = Observation::open(Budget::FULL, Instant::now());
        reading.reason = format!(
            "rate limit {} / min: {tokens:.2} of {} tokens",
            self.per_minute, self.burst
        );
        Box::pin(std::future::ready(Ok(reading)))
    }

    fn admit<'a>(&'a self, _request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        let taken = self.bucket().try_take(Instant::now());
        let verdict = if taken {
            let bucket = self.bucket.clone();
            Admission::Continue(Ticket::none().refundable(move || {
                bucket.lock().unwrap_or_else(|p| p.into_inner()).give_back();
            }))
        } else {
            Admission::Wait {
                reason: "rate_limited",
            }
        };
        Box::pin(std::future::ready(verdict))
    }

    fn kind(&self) -> &'static str {
        "local-rate-limit"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let now = Instant::now();
            let (tokens, next) = {
                let mut bucket = self.bucket();
                (bucket.tokens(now), bucket.next_token_in(now))
            };
            let mut notes = vec![format!(
                "token bucket of this process and queue: {} requests / min, burst {}; \
                 {tokens:.2} tokens now",
                self.per_minute, self.burst
            )];
            notes.push(if next.is_zero() {
                "the next message is admitted".to_owned()
            } else {
                format!(
                    "a message now waits (parked) about {} ms for the next token",
                    next.as_millis()
                )
            });
            Explanation::sourceless(self.observe().await, notes)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gate::param::parse_errors as errors;

    #[test]
    fn bucket_spends_its_burst_then_refills_at_the_rate() {
        let t0 = Instant::now();
        // 120 / min = 2 / s, burst 3.
        let mut b = TokenBucket::new(3.0, 2.0, t0);
        assert!(b.try_take(t0));
        assert!(b.try_take(t0));
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0));
        assert_eq!(b.next_token_in(t0), Duration::from_millis(500));
        let t1 = t0 + Duration::from_millis(499);
        assert!(!b.try_take(t1));
        let t2 = t0 + Duration::from_millis(500);
        assert!(b.try_take(t2));
        assert!(!b.try_take(t2));
        // A long pause refills only up to the burst.
        let t3 = t2 + Duration::from_secs(3600);
        assert!((b.tokens(t3) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn given_back_tokens_count_and_stay_under_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1.0, 1.0 / 60.0, t0);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0));
        b.give_back();
        assert!(b.try_take(t0));
        b.give_back();
        b.give_back();
        assert!((b.tokens(t0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn an_earlier_instant_adds_nothing() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1.0, 1.0, t0);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0 - Duration::from_secs(5)));
        assert!(b.try_take(t0 + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn gate_waits_without_a_token_and_refunds_unsent_ones() {
        let empty = BTreeMap::new();
        let req = AdmissionRequest::new("r", &empty, &empty);
        // 60 / min = one a second, burst 2.
        let gate = LocalRateLimitGate::new(60.0, 2.0);
        let Admission::Continue(first) = gate.admit(req).await else {
            panic!("the bucket starts full");
        };
        assert!(matches!(gate.admit(req).await, Admission::Continue(_)));
        assert!(matches!(
            gate.admit(req).await,
            Admission::Wait {
                reason: "rate_limited"
            }
        ));
        // The first message was not sent after all: its token comes back.
        first.refund();
        assert!(matches!(gate.admit(req).await, Admission::Continue(_)));
        assert!(matches!(gate.admit(req).await, Admission::Wait { .. }));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(matches!(gate.admit(req).await, Admission::Continue(_)));
        assert!(matches!(gate.admit(req).await, Admission::Wait { .. }));
        assert!(gate.observe().await.expect("open").is_open());
    }

    #[test]
    fn config_requires_a_positive_rate_and_a_burst_of_at_least_one() {
        use crate::gate::GateSpec;
        use serde_json::json;
        let spec = GateSpec::parse(
            "local-rate-limit",
            &json!({"requests_per_minute": "90"}),
            "q",
        )
        .expect("valid");
        assert_eq!(
            spec,
            GateSpec::LocalRateLimit(LocalRateLimitParams {
                requests_per_minute: 90.0,
                burst: 1.0
            })
        );
        let e = errors("local-rate-limit", json!({}));
        assert_eq!(e[0].0, "q.gate_params.requests_per_minute");
        assert!(e[0].1.contains("required"), "{e:?}");
        let e = errors(
            "local-rate-limit",
            json!({"requests_per_minute": 0, "burst": 0.5}),
        );
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            ["q.gate_params.requests_per_minute", "q.gate_params.burst"],
            "{e:?}"
        );
        let e = errors("local-rate-limit", json!({"rpm": 5}));
        assert!(
            e[0].1.contains("allowed: requests_per_minute, burst"),
            "{e:?}"
        );
    }
}
