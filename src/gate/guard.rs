//! Wrappers around gates: a staleness limit and fail-closed conversion of
//! errors into budget zero (every gate runs behind them), and the opt-in
//! fallback budget of the metric gates. They wrap a gate instead of being a
//! flag in each gate, so no gate can forget them or do them differently.

use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::reading::with_fallback;
use super::{
    Admission, AdmissionRequest, DispatchEvent, DispatchGate, Explanation, GateError, Observation,
};

/// The opt-in `fallback` parameter: when the wrapped gate cannot read its
/// source, it reads `budget` as its headroom instead of failing closed,
/// marked unavailable and blind (so the window caps own in-flight at N).
#[derive(Debug)]
pub struct Fallback {
    inner: Box<dyn DispatchGate>,
    budget: f64,
}

impl Fallback {
    /// Wraps `inner` when `fallback` is set; otherwise returns it as is
    /// (errors stay errors: budget 0).
    pub fn wrap(inner: Box<dyn DispatchGate>, fallback: Option<f64>) -> Box<dyn DispatchGate> {
        match fallback {
            None => inner,
            Some(budget) => Box::new(Self { inner, budget }),
        }
    }
}

impl DispatchGate for Fallback {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move { with_fallback(self.inner.observe().await, Some(self.budget)) })
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        self.inner.admit(request)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn on_event(&self, event: DispatchEvent) {
        self.inner.on_event(event);
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let mut explanation = self.inner.explain().await;
            explanation.observation = with_fallback(explanation.observation, Some(self.budget));
            explanation
        })
    }
}

/// Rejects observations whose data is older than `limit`: an old reading
/// is no reading.
#[derive(Debug)]
pub struct StalenessLimit<G> {
    inner: G,
    limit: Duration,
}

impl<G: DispatchGate> StalenessLimit<G> {
    /// Wraps `inner` with a staleness limit.
    pub fn new(inner: G, limit: Duration) -> Self {
        Self { inner, limit }
    }
}

impl<G: DispatchGate> DispatchGate for StalenessLimit<G> {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            let observation = self.inner.observe().await?;
            let age = Instant::now().saturating_duration_since(observation.taken_at);
            if age > self.limit {
                return Err(GateError::Stale {
                    age_ms: age.as_millis(),
                    limit_ms: self.limit.as_millis(),
                });
            }
            Ok(observation)
        })
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        self.inner.admit(request)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn on_event(&self, event: DispatchEvent) {
        self.inner.on_event(event);
    }
}

/// The gate as the dispatcher sees it: observing cannot fail, because
/// every error is a closed gate with `source_available = false`.
#[derive(Debug)]
pub struct FailClosed {
    inner: Box<dyn DispatchGate>,
}

impl FailClosed {
    /// Wraps `inner` behind a staleness limit and fail-closed conversion.
    pub fn new(inner: Box<dyn DispatchGate>, max_staleness: Duration) -> Self {
        Self {
            inner: Box::new(StalenessLimit::new(inner, max_staleness)),
        }
    }

    /// Reads the gate; errors become a closed observation taken now, so the
    /// window closes at once rather than at the next successful read.
    pub async fn observe(&self) -> Observation {
        match self.inner.observe().await {
            Ok(observation) => observation,
            Err(error) => Observation::unavailable(Instant::now(), error.to_string()),
        }
    }

    /// Per-message admission of the wrapped gate.
    pub fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        self.inner.admit(request)
    }

    /// Catalogue name of the wrapped gate.
    pub fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    /// Tells the wrapped gate what happened to a request.
    pub fn on_event(&self, event: DispatchEvent) {
        self.inner.on_event(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::Budget;

    /// A gate whose data is always `lag` old.
    #[derive(Debug)]
    struct Lagging {
        lag: Duration,
    }

    impl DispatchGate for Lagging {
        fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
            let taken_at = Instant::now() - self.lag;
            Box::pin(async move { Ok(Observation::open(Budget::FULL, taken_at)) })
        }
        fn kind(&self) -> &'static str {
            "lagging"
        }
    }

    #[derive(Debug)]
    struct Broken;

    impl DispatchGate for Broken {
        fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
            Box::pin(async { Err(GateError::SourceUnavailable("no sample".into())) })
        }
        fn kind(&self) -> &'static str {
            "broken"
        }
    }

    #[tokio::test(start_paused = true)]
    async fn stale_data_closes_the_gate() {
        tokio::time::advance(Duration::from_secs(120)).await;
        let fresh = FailClosed::new(
            Box::new(Lagging {
                lag: Duration::from_secs(5),
            }),
            Duration::from_secs(10),
        );
        assert!(fresh.observe().await.is_open());
        let stale = FailClosed::new(
            Box::new(Lagging {
                lag: Duration::from_secs(11),
            }),
            Duration::from_secs(10),
        );
        let o = stale.observe().await;
        assert!(!o.is_open());
        assert!(!o.source_available);
        assert!(o.reason.contains("old"), "{}", o.reason);
    }

    #[tokio::test]
    async fn fallback_wrapper_reads_its_budget_only_on_errors() {
        let gate = Fallback::wrap(Box::new(Broken), Some(0.2));
        let o = gate.observe().await.expect("fallback reads");
        assert_eq!(o.budget.get(), 0.2);
        assert!(!o.source_available);
        assert!(o.reason.contains("fallback 0.2 because"), "{}", o.reason);
        let e = gate.explain().await;
        assert!(e.observation.is_ok());
        let open = Fallback::wrap(
            Box::new(Lagging {
                lag: Duration::ZERO,
            }),
            Some(0.2),
        );
        assert_eq!(open.observe().await.expect("open").budget, Budget::FULL);
        assert!(
            Fallback::wrap(Box::new(Broken), None)
                .observe()
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn errors_become_budget_zero() {
        let gate = FailClosed::new(Box::new(Broken), Duration::from_secs(10));
        let o = gate.observe().await;
        assert_eq!(o.budget, Budget::ZERO);
        assert!(!o.source_available);
    }
}
