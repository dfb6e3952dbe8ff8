//! The simulated pool's metrics as a gate reads them in production: a
//! vLLM / endpoint-picker `/metrics` page scraped directly (no lag beyond
//! the gate's own cache), and a Prometheus that scrapes the same page on
//! its interval and answers queries after its query-cache lag. Both go
//! dark in a blackout: the page answers 503 and Prometheus' series go
//! stale (empty answers).

use std::sync::{Arc, Mutex, MutexGuard};

use super::promql::Query;
use crate::sim::metrics::{ExpositionLabels, LaggedView, ViewConfig, render};
use crate::sim::pool::Pool;
use crate::source::{Exposition, MetricsEndpoint, PromAnswer, SourceError, text};

/// The `/metrics` URL gates are configured with in `eval` (any URL reads
/// the one page of the whole pool, which labels each replica).
pub const PAGE_URL: &str = "http://pool.sim.invalid/metrics";

/// Unix seconds of simulated time 0 on the simulated Prometheus' clock.
const EPOCH: f64 = 1.7e9;

/// Pages and PromQL over a simulated pool, moved forward by the harness.
#[derive(Debug)]
pub struct SimMetrics {
    labels: ExpositionLabels,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    now: f64,
    /// The direct page's blackouts.
    direct: ViewConfig,
    /// The page as of `now`, rendered when a gate may read it.
    page: Option<String>,
    /// Prometheus' scrapes, parsed once.
    prometheus: LaggedView<Arc<Exposition>>,
}

impl SimMetrics {
    /// Metrics of a pool named by `labels`; `direct` carries the blackouts
    /// of the page, `prometheus` the scrape interval, query lag and
    /// blackouts of Prometheus' view.
    pub fn new(labels: ExpositionLabels, direct: ViewConfig, prometheus: ViewConfig) -> Self {
        Self {
            labels,
            state: Mutex::new(State {
                now: 0.0,
                direct,
                page: None,
                prometheus: LaggedView::new(prometheus),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain data: a panic elsewhere leaves it consistent.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Moves to `now`: Prometheus scrapes when its interval is due, and,
    /// when `render_page`, the direct page is rendered as of `now` (a gate
    /// is about to read it).
    pub fn advance(&self, now: f64, pool: &Pool, render_page: bool) {
        let mut s = self.lock();
        s.now = now;
        let scrape_due = s.prometheus.scrape_due(now);
        if !(scrape_due || render_page) {
            return;
        }
        // One rendering serves both views when they fall on the same tick.
        let text = render(&pool.snapshot(), &self.labels);
        if scrape_due {
            // Our own renderer's output parses; if it ever did not, the
            // scrape fails like a real one would (nothing stored).
            if let Ok(page) = text::parse(&text) {
                s.prometheus.scrape(now, Arc::new(page));
            }
        }
        if render_page {
            s.page = Some(text);
        }
    }
}

impl MetricsEndpoint for SimMetrics {
    fn page(&self, _url: &url::Url) -> Result<String, SourceError> {
        let s = self.lock();
        if s.direct.blacked_out(s.now) {
            return Err(SourceError::Status(503));
        }
        s.page.clone().ok_or(SourceError::Status(503))
    }

    fn query(&self, promql: &str) -> Result<PromAnswer, SourceError> {
        let query = Query::parse(promql)?;
        let s = self.lock();
        let scrape = s
            .prometheus
            .observe(s.now)
            .map(|(at, page)| (EPOCH + at, page.as_ref()));
        Ok(PromAnswer {
            samples: query.evaluate(scrape),
            evaluated_at: EPOCH + s.now,
        })
    }
}
