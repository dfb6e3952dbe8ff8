//! Wrappers every gate runs behind: a staleness limit and fail-closed
//! conversion of errors into budget zero. They wrap a gate instead of being
//! a flag in each gate, so no gate can forget them.

use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{Admission, AdmissionRequest, DispatchGate, GateError, Observation};

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
}

impl DispatchGate for Box<dyn DispatchGate> {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        (**self).observe()
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        (**self).admit(request)
    }

    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn explain(&self) -> BoxFuture<'_, super::Explanation> {
        (**self).explain()
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
    async fn errors_become_budget_zero() {
        let gate = FailClosed::new(Box::new(Broken), Duration::from_secs(10));
        let o = gate.observe().await;
        assert_eq!(o.budget, Budget::ZERO);
        assert!(!o.source_available);
    }
}
