//! The crate's Prometheus (`sluicegate::servers::prometheus`: the Debian
//! `prometheus` binary on a free loopback port, stopped by PID) with the
//! tests' defaults (scrape every second) and their failures as panics.

use std::time::Duration;

pub use sluicegate::servers::prometheus::{PrometheusSpec, RecordingRule};

/// A running Prometheus; everything else of the crate's through `Deref`.
#[derive(Debug)]
pub struct Prometheus(sluicegate::servers::Prometheus);

impl Prometheus {
    /// Starts Prometheus scraping every second; returns once it is ready.
    pub async fn start(spec: &PrometheusSpec) -> Self {
        Self::start_scraping_every(spec, Duration::from_secs(1)).await
    }

    /// Like [`Self::start`] with another scrape interval: real deployments
    /// scrape every 15 to 60 s, which is what the lag tests reproduce.
    pub async fn start_scraping_every(spec: &PrometheusSpec, interval: Duration) -> Self {
        Self::start_with(spec, interval, &[], &[]).await
    }

    /// Like [`Self::start`], with `labels` added to every scraped series
    /// and recording `rules` evaluated every second (e.g. a ready-endpoint
    /// count where no endpoint picker exports one).
    pub async fn start_labelled(
        spec: &PrometheusSpec,
        labels: &[(&str, &str)],
        rules: &[RecordingRule],
    ) -> Self {
        Self::start_with(spec, Duration::from_secs(1), labels, rules).await
    }

    async fn start_with(
        spec: &PrometheusSpec,
        interval: Duration,
        labels: &[(&str, &str)],
        rules: &[RecordingRule],
    ) -> Self {
        Self(
            sluicegate::servers::Prometheus::start(spec, interval, labels, rules)
                .await
                .expect("prometheus starts"),
        )
    }

    /// Starts it again on the same port and data directory.
    pub async fn restart(&mut self) {
        self.0.restart().await.expect("prometheus restarts");
    }

    /// Waits (up to `limit`) until `query` returns at least one sample.
    pub async fn wait_for_sample(&self, query: &str, limit: Duration) {
        self.0
            .wait_for_sample(query, limit)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

impl std::ops::Deref for Prometheus {
    type Target = sluicegate::servers::Prometheus;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Prometheus {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}
