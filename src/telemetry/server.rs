//! The telemetry HTTP server: `/metrics` (Prometheus text), `/healthz`
//! (the process is alive) and `/readyz` (it can do its job).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use super::Metrics;

/// Readiness shared between components and the server. Not ready until the
/// dispatcher says so, and again not ready while it drains at shutdown.
///
/// Besides the dispatcher's flag, components can hold readiness down with a
/// named *blocker* (the shared window while Redis is unreachable); `/readyz`
/// lists them, so it says why.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    blockers: Mutex<BTreeMap<String, String>>,
}

impl Health {
    /// Marks the process ready or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Whether the process is ready: marked ready and nothing blocks it.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && self.blockers().is_empty()
    }

    /// Holds readiness down under `key` (one reason per key) with `why`.
    pub fn set_blocker(&self, key: &str, why: String) {
        self.blockers().insert(key.to_owned(), why);
    }

    /// Lifts the blocker under `key`, if any.
    pub fn clear_blocker(&self, key: &str) {
        self.blockers().remove(key);
    }

    /// Why the process is not ready, one line per blocker.
    pub fn reasons(&self) -> String {
        self.blockers()
            .iter()
            .map(|(key, why)| format!("{key}: {why}\n"))
            .collect()
    }

    fn blockers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        // Plain map operations do not panic; a poisoned map is consistent.
        self.blockers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// Serves telemetry on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.is_ready() {
        (StatusCode::OK, "ready\n".to_owned())
    } else {
        let reasons = state.health.reasons();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{reasons}"),
        )
    }
}
