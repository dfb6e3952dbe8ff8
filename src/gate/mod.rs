//! Dispatch gates: how much batch work the pool can take now, and whether
//! one message may go.
//!
//! A [`DispatchGate`] answers two questions:
//! - [`DispatchGate::observe`]: the budget `D` in [0, 1] (estimated remaining
//!   capacity), the baseline `B` held back for interactive traffic, and the
//!   time the observation describes. The dispatch window turns it into a
//!   number of requests, tokens or bytes (see `dispatch::window`).
//! - [`DispatchGate::admit`]: a per-message verdict (quotas, tiers, local
//!   concurrency).
//!
//! Files: `constant.rs`, `composite.rs`, `local_concurrency.rs`,
//! `wait_on_refuse.rs`, `prometheus_budget.rs`, `prometheus_saturation.rs`,
//! `prometheus_query.rs`, `endpoint_scrape.rs`, `redis_budget.rs`,
//! `redis_quota.rs`, `sql_quota.rs` (what both share in `quota.rs`),
//! `redis_leased_rate.rs`, `local_rate_limit.rs`,
//! `deadline_drop.rs`, `constant_decision.rs`, `tier_priority.rs` (with
//! its pool-load sources in `pool_load.rs`), `vllm.rs`, `feedback.rs` and
//! `slo_headroom.rs` are gates, each file
//! holding the gate's parameters (serde shape, defaults, validation), its
//! constructor and the gate; `param.rs` holds what parameters share (the
//! [`GateParams`] trait, loose upstream value adapters, error collection);
//! `reading.rs` holds what the metric gates share (one observe / explain
//! for all of them, value checks, explicit aggregation); `guard.rs` holds
//! the wrappers: staleness and fail-closed (every gate runs behind them)
//! and the opt-in fallback; `build.rs` holds the build context and errors;
//! `control.rs` holds the pure controllers of the feedback gates (AIMD
//! window, Kalman trend, non-negative regression, histogram deltas) and
//! `engine_signals.rs` what those gates read from vLLM pages.
//! `catalogue.rs` names every gate once ([`GateSpec`], parsed from the
//! upstream shape); `unit.rs` holds the [`Unit`] budgets are counted in.

mod build;
mod catalogue;
mod composite;
mod constant;
mod constant_decision;
pub mod control;
mod counted;
mod deadline_drop;
mod endpoint_scrape;
mod engine_signals;
mod feedback;
mod guard;
mod local_concurrency;
mod local_rate_limit;
pub(crate) mod param;
mod pool_load;
mod prometheus_budget;
mod prometheus_query;
mod prometheus_saturation;
mod quota;
mod reading;
mod redis_budget;
mod redis_leased_rate;
mod redis_quota;
mod slo_headroom;
mod sql_quota;
mod tier_priority;
mod unit;
mod vllm;
mod wait_on_refuse;

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::source::{RecordError, SourceError};

pub use build::{BuildError, Capacity, GateContext, build_gate};
pub(crate) use catalogue::parse_gate_spec;
pub use catalogue::{GATE_TYPES, GateSpec, MAX_GATE_DEPTH, allowed_params};
pub use composite::{CompositeGate, CompositeParams};
pub use constant::{ConstantGate, ConstantParams};
pub use constant_decision::{ConstantDecisionGate, ConstantDecisionParams, Decision};
pub use deadline_drop::{DeadlineDropGate, DeadlineDropParams};
pub use endpoint_scrape::{EndpointScrapeGate, EndpointScrapeParams, PodsSource};
pub use feedback::{FeedbackGate, FeedbackParams};
pub use guard::{FailClosed, Fallback, StalenessLimit};
pub use local_concurrency::{GatingMode, LocalMaxConcurrencyGate, LocalMaxConcurrencyParams};
pub use local_rate_limit::{LocalRateLimitGate, LocalRateLimitParams};
pub use param::{GateParams, ParseCx};
pub use prometheus_budget::{PrometheusBudgetGate, PrometheusBudgetParams};
pub use prometheus_query::{PrometheusQueryGate, PrometheusQueryParams};
pub use prometheus_saturation::{PrometheusSaturationGate, PrometheusSaturationParams};
pub use quota::{MissingAttribute, QuotaMode};
pub use reading::{Explanation, SourceReport};
pub use redis_budget::{MissingBudget, RedisBudgetGate, RedisParams};
pub use redis_leased_rate::{
    LEASE_API_VERSION, Lease, LeaseError, RedisLeasedRateGate, RedisLeasedRateParams, parse_lease,
};
pub use redis_quota::{RedisQuotaGate, RedisQuotaParams};
pub use slo_headroom::{SloHeadroomGate, SloHeadroomParams};
pub use sql_quota::{SqlQuotaGate, SqlQuotaParams};
pub use tier_priority::{LoadSource, TierPriorityAdmissionParams, TierPriorityGate};
pub use unit::Unit;
pub use vllm::{EngineReading, Roofline, VllmGate, VllmParams, read_engines};
pub use wait_on_refuse::{WaitOnRefuseGate, WaitOnRefuseParams};

/// A fraction of pool capacity in [0, 1]. Cannot hold NaN or leave the
/// range, so arithmetic on budgets needs no defensive checks.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Default)]
pub struct Budget(f64);

impl Budget {
    /// No capacity: the gate is closed.
    pub const ZERO: Self = Self(0.0);
    /// All capacity.
    pub const FULL: Self = Self(1.0);

    /// A budget from a value that must already be in [0, 1].
    pub fn new(value: f64) -> Result<Self, BudgetError> {
        if value.is_nan() {
            Err(BudgetError::NotANumber)
        } else if !(0.0..=1.0).contains(&value) {
            Err(BudgetError::OutOfRange(value))
        } else {
            Ok(Self(value))
        }
    }

    /// A budget from any value: clamped into [0, 1]; NaN becomes zero
    /// (fail closed).
    pub fn saturating(value: f64) -> Self {
        if value.is_nan() {
            Self::ZERO
        } else {
            Self(value.clamp(0.0, 1.0))
        }
    }

    /// The fraction.
    pub const fn get(self) -> f64 {
        self.0
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.4}", self.0)
    }
}

/// A value that cannot be a [`Budget`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// NaN is never a budget.
    #[error("budget is NaN")]
    NotANumber,
    /// Outside [0, 1].
    #[error("budget {0} is outside [0, 1]")]
    OutOfRange(f64),
}

/// One reading of the pool by a gate.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Estimated remaining capacity `D`.
    pub budget: Budget,
    /// Capacity held back for interactive traffic `B`; the gate is closed
    /// when `D <= B`.
    pub baseline: Budget,
    /// The time the underlying data describes (not when it was fetched):
    /// the dispatch window counts sends after this instant against the
    /// budget, because the pool's metrics do not show them yet.
    pub taken_at: Instant,
    /// Live capacity `max_SYS` in the queue's unit, when the gate knows it
    /// (e.g. ready endpoints × max_concurrency); otherwise the queue's
    /// static `max_sys` applies.
    pub max_sys: Option<f64>,
    /// Whether the reading already counts this dispatcher's own work in
    /// flight, a property of the source (`docs/gates.md`, "Whether a reading
    /// sees our own load"): vLLM's running requests and KV use, and the
    /// local concurrency gate's slots, do; queue sizes, `constant` and
    /// fallbacks do not. When false the window caps own in-flight at `N`
    /// instead of adding `N` to what was in flight, which would grow
    /// without bound.
    pub sees_own_load: bool,
    /// Whether, on top of seeing our load, the reading charges each request
    /// of ours in flight as (at least) one request of its live `max_SYS`:
    /// `D` counts running requests against a request capacity (vLLM's
    /// running against `max_num_seqs`, the endpoint picker's running
    /// against ready × max_concurrency, local slots). Only then is
    /// `own_in_flight_at(taken_at) + N` bounded by `max_SYS × (1 − B)`, and
    /// only then does the window give the room of our requests that finish
    /// after `taken_at` back before the next reading (`dispatch::window`,
    /// "Refill on own finishes"). A KV or saturation signal sees our load
    /// but moves by a fraction of a request per request of ours: refilling
    /// on it ratchets the window up by `N` per reading.
    pub counts_own_requests: bool,
    /// Whether `N` is the most of our own work to have in flight, counted
    /// by the gate itself from its dispatch events (`feedback`'s window `W`,
    /// `slo-headroom`'s admitted amount), not a reading of the pool's room.
    /// Blind (`sees_own_load` false), so the window is `N` itself; a
    /// request of ours that finishes frees its room at once instead of
    /// waiting for the next fresh reading (`dispatch::window`, "Caps on
    /// own in-flight"). Without it, at most `N` went out per fresh reading:
    /// in-flight drained between readings and refilled in one burst, a
    /// cohort that finished together and came back as the next burst.
    pub caps_own_in_flight: bool,
    /// Whether the gate's data source answered usably.
    pub source_available: bool,
    /// Whether `D` is only this process's free share of a local limit
    /// (`local-max-concurrency`), not a reading of the pool: closed then
    /// means our own window is full, and status lines say "window full"
    /// rather than "gate closed" and show no `D`.
    pub local_limit: bool,
    /// Why the gate reads what it reads, for logs and `gate probe`.
    pub reason: String,
}

impl Observation {
    /// A fresh, available observation of a blind gate (one that does not
    /// see the pool's load) with budget `budget` and no baseline.
    pub fn open(budget: Budget, taken_at: Instant) -> Self {
        Self {
            budget,
            baseline: Budget::ZERO,
            taken_at,
            max_sys: None,
            sees_own_load: false,
            counts_own_requests: false,
            caps_own_in_flight: false,
            source_available: true,
            local_limit: false,
            reason: String::new(),
        }
    }

    /// A closed observation because the source could not be read.
    pub fn unavailable(taken_at: Instant, reason: impl Into<String>) -> Self {
        Self {
            source_available: false,
            reason: reason.into(),
            ..Self::open(Budget::ZERO, taken_at)
        }
    }

    /// `max(0, D − B)`: the fraction of capacity batch work may use.
    pub fn headroom(&self) -> f64 {
        (self.budget.get() - self.baseline.get()).max(0.0)
    }

    /// Whether the gate is open (`D > B`).
    pub fn is_open(&self) -> bool {
        self.budget.get() > self.baseline.get()
    }
}

/// Why a gate could not produce an observation. The fail-closed wrapper
/// turns every variant into budget zero.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// The metric source failed or returned nothing usable.
    #[error("source unavailable: {0}")]
    SourceUnavailable(String),
    /// A metric source could not be read.
    #[error("source unavailable: {what}: {source}")]
    Source {
        /// Which source (its role, target or key).
        what: String,
        /// The source's error.
        #[source]
        source: SourceError,
    },
    /// The budget key holds a value that is not a budget.
    #[error("source unavailable: budget key: {0}")]
    Record(#[source] RecordError),
    /// The data is older than the staleness limit.
    #[error("observation is {age_ms} ms old, limit {limit_ms} ms")]
    Stale {
        /// Age of the data.
        age_ms: u128,
        /// Configured limit.
        limit_ms: u128,
    },
    /// The source returned a value that is not a budget.
    #[error("invalid value: {0}")]
    InvalidValue(#[from] BudgetError),
}

impl GateError {
    /// Wraps the error of the source named `what`.
    pub fn source(what: impl Into<String>, source: SourceError) -> Self {
        Self::Source {
            what: what.into(),
            source,
        }
    }
}

/// The facts about a message that admission gates may look at.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionRequest<'a> {
    /// Request id.
    pub id: &'a str,
    /// The request's metadata (tenant attribute, trace context).
    pub metadata: &'a BTreeMap<String, String>,
    /// Envelope and queue labels (e.g. `tier`).
    pub labels: &'a BTreeMap<String, String>,
    /// The quota classification an earlier gate of the same composite gave
    /// the message (`redis-quota`), read by `tier-priority-admission`;
    /// `None` when no quota gate ran before it.
    pub classification: Option<Classification>,
    /// The message's deadline (Unix seconds), read by `deadline-drop`;
    /// `None` when the caller has no message (the evaluator's releases).
    pub deadline: Option<i64>,
}

impl<'a> AdmissionRequest<'a> {
    /// A request as the dispatcher first asks about it: no quota
    /// classification yet.
    pub fn new(
        id: &'a str,
        metadata: &'a BTreeMap<String, String>,
        labels: &'a BTreeMap<String, String>,
    ) -> Self {
        Self {
            id,
            metadata,
            labels,
            classification: None,
            deadline: None,
        }
    }

    /// This request, with the message's deadline (Unix seconds).
    #[must_use]
    pub fn with_deadline(mut self, deadline: i64) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Whether a message is within its tenant's quota, in upstream's words:
/// `reserved` (within quota) or `overflow` (over quota, admitted only to
/// use spare capacity). Written by `redis-quota`, read by
/// `tier-priority-admission`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classification {
    /// Within the tenant's quota.
    Reserved,
    /// Over the tenant's quota.
    Overflow,
}

impl Classification {
    /// Upstream's spelling (also the value of the envelope label
    /// `classification`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Overflow => "overflow",
        }
    }

    /// Reads upstream's spelling; anything else is no classification.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "reserved" => Some(Self::Reserved),
            "overflow" => Some(Self::Overflow),
            _ => None,
        }
    }
}

/// Held while an admitted request is in flight; dropping it releases
/// whatever the admitting gates reserved (e.g. a local concurrency slot).
/// [`Ticket::refund`] also takes back what is otherwise kept once taken
/// (a rate-limit admission), for a ticket whose message was not sent.
#[derive(Default)]
pub struct Ticket {
    guards: Vec<Box<dyn Any + Send + Sync>>,
    refunds: Vec<Box<dyn FnOnce() + Send + Sync>>,
}

impl Ticket {
    /// A ticket that reserves nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// A ticket holding one reservation guard.
    pub fn holding(guard: impl Any + Send + Sync) -> Self {
        Self {
            guards: vec![Box::new(guard)],
            refunds: Vec::new(),
        }
    }

    /// This ticket, with `refund` to run if its message is not sent after
    /// all (a later gate or the window said no).
    #[must_use]
    pub fn refundable(mut self, refund: impl FnOnce() + Send + Sync + 'static) -> Self {
        self.refunds.push(Box::new(refund));
        self
    }

    /// Merges another ticket's reservations into this one.
    pub fn join(&mut self, other: Ticket) {
        self.guards.extend(other.guards);
        self.refunds.extend(other.refunds);
    }

    /// Gives everything back: the message was admitted but not sent.
    pub fn refund(self) {
        let Self { guards, refunds } = self;
        for refund in refunds {
            refund();
        }
        drop(guards);
    }

    /// The quota classification a gate put on this ticket (the latest one
    /// when several did).
    pub fn classification(&self) -> Option<Classification> {
        self.guards
            .iter()
            .rev()
            .find_map(|g| g.downcast_ref::<Classification>().copied())
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Ticket({} reservations, {} refundable)",
            self.guards.len(),
            self.refunds.len()
        )
    }
}

/// A per-message admission verdict.
#[derive(Debug)]
pub enum Admission {
    /// Send it; keep the ticket until the request finishes.
    Continue(Ticket),
    /// Not now, but soon: the message stays queued (parked or requeued
    /// without using an attempt) and is never sent while the verdict holds.
    Wait {
        /// Bounded label for metrics.
        reason: &'static str,
    },
    /// Not this message now: back to the queue with a delay, without
    /// blocking the messages behind it.
    Refuse {
        /// Bounded label for metrics.
        reason: &'static str,
    },
    /// Never: the message ends now, with the result `answer` says
    /// (`GATE_DROPPED` unless the gate says otherwise).
    Drop {
        /// Bounded label for metrics.
        reason: &'static str,
        /// Which result ends the message.
        answer: DropAnswer,
    },
}

/// The result a dropped message ends with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DropAnswer {
    /// `GATE_DROPPED`, payload `{"error": "<reason>"}`.
    #[default]
    GateDropped,
    /// `GATE_DROPPED` whose payload is this body (upstream's
    /// `fail_fast_body` of `tier-priority-admission`).
    GateDroppedWith(std::sync::Arc<str>),
    /// What the deadline sweep answers: the last HTTP answer an attempt
    /// got, else `DEADLINE_EXCEEDED` (`deadline-drop`).
    DeadlineExceeded,
}

impl Admission {
    /// A drop with the plain `GATE_DROPPED` result.
    pub fn dropped(reason: &'static str) -> Self {
        Self::Drop {
            reason,
            answer: DropAnswer::GateDropped,
        }
    }

    /// Bounded label of the verdict for metrics.
    pub fn verdict_label(&self) -> &'static str {
        match self {
            Self::Continue(_) => "continue",
            Self::Wait { .. } => "wait",
            Self::Refuse { .. } => "refuse",
            Self::Drop { .. } => "drop",
        }
    }

    /// Bounded reason label (`admitted` for Continue).
    pub fn reason_label(&self) -> &'static str {
        match self {
            Self::Continue(_) => "admitted",
            Self::Wait { reason } | Self::Refuse { reason } | Self::Drop { reason, .. } => reason,
        }
    }
}

/// What happened to one batch request, as the dispatcher tells its gate
/// ([`DispatchGate::on_event`]). `cost` is the request's cost in the
/// queue's unit (requests, tokens or bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DispatchEvent {
    /// The request was sent to the gateway at `at`.
    Sent {
        /// When it was sent.
        at: Instant,
        /// Its cost in the queue's unit.
        cost: u64,
    },
    /// The gateway answered with HTTP `status` at `at` (429 and 503 mean
    /// the pool is saturated).
    Answered {
        /// When the answer arrived.
        at: Instant,
        /// When the request had been sent.
        sent_at: Instant,
        /// The HTTP status.
        status: u16,
        /// Its cost in the queue's unit.
        cost: u64,
    },
    /// The attempt ended without an HTTP answer (timeout, reset).
    Failed {
        /// When the attempt ended.
        at: Instant,
        /// When the request had been sent.
        sent_at: Instant,
        /// Its cost in the queue's unit.
        cost: u64,
    },
}

impl DispatchEvent {
    /// Whether this is a 429 or 503 answer: the pool is saturated.
    pub fn is_congestion(&self) -> bool {
        matches!(
            self,
            Self::Answered {
                status: 429 | 503,
                ..
            }
        )
    }
}

/// A source of dispatch budget and per-message admission.
///
/// Contract:
/// - `observe` returns the pool's remaining capacity as of
///   `Observation::taken_at`. It must not return a value it could not read:
///   errors are returned as [`GateError`] and the fail-closed wrapper makes
///   them budget zero. Implementations should be cheap to call repeatedly
///   (cache slow sources) and return the same `taken_at` when their data has
///   not changed, because the dispatch window only resets on a newer
///   observation.
/// - `admit` is called once per message before it is sent; a `Continue`
///   ticket is held until the request finishes.
pub trait DispatchGate: Send + Sync + fmt::Debug {
    /// Reads the pool.
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>>;

    /// Decides whether one message may go now. The default admits all.
    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        let _ = request;
        Box::pin(std::future::ready(Admission::Continue(Ticket::none())))
    }

    /// The gate's catalogue name (`constant`, `composite`, ...), for logs
    /// and metrics labels.
    fn kind(&self) -> &'static str;

    /// Learns what happened to a batch request this queue sent (feedback
    /// gates cut their window on a 429/503 and track their own in-flight
    /// work). Called by the dispatcher's worker in order of events; must be
    /// cheap and must not block. The default ignores it.
    fn on_event(&self, event: DispatchEvent) {
        let _ = event;
    }

    /// Reads the pool once and says how: each source, its query or URL,
    /// the raw values. For `gate probe`; the default reports no sources.
    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move { Explanation::sourceless(self.observe().await, Vec::new()) })
    }
}

/// A gate behind a pointer is the gate: every method goes to the one it
/// points at, `explain` included (a default there would make `gate probe`
/// report no sources for a gate that has them).
macro_rules! pointer_gate {
    ($($impl_head:tt)*) => {
        $($impl_head)* {
            fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
                (**self).observe()
            }

            fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
                (**self).admit(request)
            }

            fn kind(&self) -> &'static str {
                (**self).kind()
            }

            fn on_event(&self, event: DispatchEvent) {
                (**self).on_event(event);
            }

            fn explain(&self) -> BoxFuture<'_, Explanation> {
                (**self).explain()
            }
        }
    };
}

pointer_gate!(impl DispatchGate for Box<dyn DispatchGate>);
pointer_gate!(impl<G: DispatchGate + ?Sized> DispatchGate for std::sync::Arc<G>);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A gate whose explanation says who gave it.
    #[derive(Debug)]
    struct Explains;

    impl DispatchGate for Explains {
        fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
            Box::pin(async { Ok(Observation::open(Budget::FULL, Instant::now())) })
        }
        fn kind(&self) -> &'static str {
            "explains"
        }
        fn explain(&self) -> BoxFuture<'_, Explanation> {
            Box::pin(async {
                Explanation::sourceless(self.observe().await, vec!["the inner gate".into()])
            })
        }
    }

    #[tokio::test]
    async fn a_gate_behind_a_pointer_explains_itself() {
        // An `Arc` once fell back to the default explanation (no sources,
        // no notes), so a shared gate showed nothing in `gate probe`.
        let shared = std::sync::Arc::new(Explains);
        assert_eq!(shared.explain().await.notes, vec!["the inner gate"]);
        let boxed: Box<dyn DispatchGate> = Box::new(Explains);
        assert_eq!(boxed.explain().await.notes, vec!["the inner gate"]);
        let boxed_shared: Box<dyn DispatchGate> = Box::new(shared);
        assert_eq!(boxed_shared.explain().await.notes, vec!["the inner gate"]);
    }

    proptest! {
        #[test]
        fn saturating_budget_is_always_in_range(v in proptest::num::f64::ANY) {
            let b = Budget::saturating(v).get();
            prop_assert!((0.0..=1.0).contains(&b));
        }

        #[test]
        fn new_accepts_exactly_the_unit_interval(v in -2.0f64..2.0) {
            prop_assert_eq!(Budget::new(v).is_ok(), (0.0..=1.0).contains(&v));
        }
    }

    #[test]
    fn nan_is_not_a_budget() {
        assert_eq!(Budget::new(f64::NAN), Err(BudgetError::NotANumber));
        assert_eq!(Budget::saturating(f64::NAN), Budget::ZERO);
    }

    #[test]
    fn headroom_is_zero_at_or_below_baseline() {
        let mut o = Observation::open(Budget::saturating(0.3), Instant::now());
        o.baseline = Budget::saturating(0.3);
        assert!(!o.is_open());
        assert_eq!(o.headroom(), 0.0);
        o.budget = Budget::saturating(0.7);
        o.baseline = Budget::saturating(0.1);
        assert!(o.is_open());
        assert!((o.headroom() - 0.6).abs() < 1e-12);
    }
}
