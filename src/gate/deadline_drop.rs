//! `deadline-drop`: ends a message whose deadline has passed before it
//! takes anything from the gates after it (upstream PR #186). Upstream
//! acks such a message without a result ("drop semantics are
//! ack-and-discard"); here it ends as the deadline sweep would end it, with
//! the last HTTP answer an attempt got, else `DEADLINE_EXCEEDED`, because
//! every message ends with exactly one result. `min_remaining` (ours;
//! upstream has no parameters) also ends a message with less time left
//! than that, whose deadline cannot be met.
//!
//! Put it first in a `composite`, so an expired message is answered before
//! it spends a quota unit, a concurrency slot or a rate token.

use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::param::{GateParams, loose};
use super::{
    Admission, AdmissionRequest, Budget, BuildError, DispatchGate, DropAnswer, Explanation,
    GateContext, GateError, Observation, Ticket,
};

/// Parameters of `deadline-drop`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeadlineDropParams {
    /// Also end a message with less than this left before its deadline
    /// (default 0: only a deadline that has passed, as upstream).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub min_remaining: Duration,
}

impl GateParams for DeadlineDropParams {
    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Ok(Box::new(DeadlineDropGate::new(self.min_remaining)))
    }
}

/// Why a message is dropped for its deadline, if it is: `deadline` in Unix
/// seconds, `now_ms` in Unix milliseconds. A deadline at or before now has
/// passed (as the dispatcher's own check, `deadline <= now`); one less than
/// `min_remaining` ahead cannot be met.
pub(crate) fn deadline_verdict(
    deadline: i64,
    now_ms: i64,
    min_remaining: Duration,
) -> Option<&'static str> {
    let deadline_ms = deadline.saturating_mul(1000);
    let left_ms = deadline_ms.saturating_sub(now_ms);
    let need_ms = i64::try_from(min_remaining.as_millis()).unwrap_or(i64::MAX);
    if left_ms <= 0 {
        Some("deadline_passed")
    } else if left_ms < need_ms {
        Some("deadline_unreachable")
    } else {
        None
    }
}

/// The `deadline-drop` gate.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineDropGate {
    min_remaining: Duration,
}

impl DeadlineDropGate {
    /// Drops messages with less than `min_remaining` left (zero: only those
    /// whose deadline has passed).
    pub fn new(min_remaining: Duration) -> Self {
        Self { min_remaining }
    }
}

impl DispatchGate for DeadlineDropGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        // A per-message filter says nothing about the pool: a fresh, open
        // reading (as `constant`), so the window is the other gates'.
        let mut reading = Observation::open(Budget::FULL, Instant::now());
        reading.reason = "deadline filter: judged per message".into();
        Box::pin(std::future::ready(Ok(reading)))
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        let verdict = match request
            .deadline
            .and_then(|d| deadline_verdict(d, crate::clock::unix_millis(), self.min_remaining))
        {
            Some(reason) => Admission::Drop {
                reason,
                answer: DropAnswer::DeadlineExceeded,
            },
            // No deadline known (nothing to judge) or time enough.
            None => Admission::Continue(Ticket::none()),
        };
        Box::pin(std::future::ready(verdict))
    }

    fn kind(&self) -> &'static str {
        "deadline-drop"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let mut notes = vec![
                "a message whose deadline has passed ends at once with its deadline result \
                 (the last HTTP answer, else DEADLINE_EXCEEDED)"
                    .to_owned(),
            ];
            if !self.min_remaining.is_zero() {
                notes.push(format!(
                    "so does one with less than {} left (min_remaining)",
                    crate::values::format_duration(self.min_remaining)
                ));
            }
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
    fn passed_unreachable_and_in_time() {
        let now_ms = 1_000_000_500; // 1_000_000.5 s
        let zero = Duration::ZERO;
        assert_eq!(
            deadline_verdict(1_000_000, now_ms, zero),
            Some("deadline_passed")
        );
        assert_eq!(deadline_verdict(1_000_001, now_ms, zero), None);
        // Exactly at the deadline counts as passed, as the dispatcher's own check.
        assert_eq!(
            deadline_verdict(1_000_001, 1_000_001_000, zero),
            Some("deadline_passed")
        );
        let thirty = Duration::from_secs(30);
        assert_eq!(
            deadline_verdict(1_000_020, now_ms, thirty),
            Some("deadline_unreachable")
        );
        assert_eq!(deadline_verdict(1_000_031, now_ms, thirty), None);
        // Absurd values saturate instead of overflowing.
        assert_eq!(deadline_verdict(i64::MAX, now_ms, thirty), None);
        assert_eq!(
            deadline_verdict(i64::MIN, now_ms, zero),
            Some("deadline_passed")
        );
    }

    #[tokio::test]
    async fn drops_with_the_deadline_answer_and_admits_the_rest() {
        let empty = BTreeMap::new();
        let gate = DeadlineDropGate::new(Duration::ZERO);
        let past = AdmissionRequest::new("r", &empty, &empty).with_deadline(1);
        match gate.admit(past).await {
            Admission::Drop { reason, answer } => {
                assert_eq!(reason, "deadline_passed");
                assert_eq!(answer, DropAnswer::DeadlineExceeded);
            }
            other => panic!("expected a drop, got {other:?}"),
        }
        let future = AdmissionRequest::new("r", &empty, &empty).with_deadline(i64::MAX / 1000);
        assert!(matches!(gate.admit(future).await, Admission::Continue(_)));
        let unknown = AdmissionRequest::new("r", &empty, &empty);
        assert!(matches!(gate.admit(unknown).await, Admission::Continue(_)));
    }

    #[test]
    fn config_takes_only_min_remaining() {
        use crate::gate::GateSpec;
        use serde_json::json;
        let spec = GateSpec::parse("deadline-drop", &json!({}), "q").expect("no parameters");
        assert_eq!(spec.to_upstream()["gate_params"]["min_remaining"], "0s");
        let spec =
            GateSpec::parse("deadline-drop", &json!({"min_remaining": "30s"}), "q").expect("ok");
        assert_eq!(
            spec,
            crate::gate::GateSpec::DeadlineDrop(DeadlineDropParams {
                min_remaining: Duration::from_secs(30)
            })
        );
        let e = errors("deadline-drop", json!({"min_remaining": "soon"}));
        assert_eq!(e[0].0, "q.gate_params.min_remaining");
        let e = errors("deadline-drop", json!({"grace": 1}));
        assert!(e[0].1.contains("allowed: min_remaining"), "{e:?}");
    }
}
