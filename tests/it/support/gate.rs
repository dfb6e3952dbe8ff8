//! A gate a test opens and closes: the `/metrics` page an endpoint-scrape
//! gate reads (`ServeSpec::gate_url`), for the flex and fairness suites.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A `/metrics` page for an endpoint-scrape gate (`m` of 4 per pod):
/// `m 4` (saturated: the gate is closed) until opened, then `m 0`.
pub struct Gate {
    /// Its `/metrics` URL (`ServeSpec::gate_url`).
    pub url: String,
    open: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Gate {
    /// A page serving a closed gate.
    pub async fn closed() -> Self {
        let open = Arc::new(AtomicBool::new(false));
        let page = open.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let open = page.load(Ordering::SeqCst);
                async move { if open { "m 0\n" } else { "m 4\n" } }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, open, task }
    }

    /// Opens (`m 0`) or closes (`m 4`) the gate.
    pub fn set_open(&self, open: bool) {
        self.open.store(open, Ordering::SeqCst);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
    }
}
