//! Test support: real servers spawned on free loopback ports and stopped by
//! PID. A module of the one test binary (`tests/it/main.rs`); each suite
//! uses what it needs through `crate::support`.
#![allow(dead_code, unreachable_pub)]

pub mod cli;
pub mod failing;
pub mod gate;
pub mod otlp;
pub mod postgres;
pub mod prometheus;
pub mod pubsub;
pub mod pytest;
pub mod redis;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod serve;
pub mod sim;
pub mod tenants;
pub mod vllm;

/// A free TCP port on 127.0.0.1 (bound, then released for the server).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// A loopback port that refuses every connection for as long as the
/// returned socket lives: bound but never listening, so no server of a
/// test running beside can take it. (A port found by [`free_port`] is
/// free only at that moment: the full suite once had another test's
/// server answer 404 on the port a test meant as refused.)
pub fn refused_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind a free port");
    let port = socket.local_addr().expect("local address").port();
    (socket, port)
}

/// A gateway on a free loopback port that answers `POST /v1/completions`
/// with `{}` after `delay` and counts how many requests it holds at once;
/// returns its URL and the peak.
pub async fn counting_gateway(
    delay: std::time::Duration,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let now = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (n, p) = (now.clone(), peak.clone());
    let app = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(move || {
            let (n, p) = (n.clone(), p.clone());
            async move {
                let current = n.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(current, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                n.fetch_sub(1, Ordering::SeqCst);
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), peak)
}

/// A fresh directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    /// Creates `sluicegate-<tag>-<pid>-<n>`.
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluicegate-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `done` every 20 ms until it holds; fails the test with `what`
/// after `within`.
pub async fn wait_until(within: std::time::Duration, what: &str, mut done: impl FnMut() -> bool) {
    let give_up = std::time::Instant::now() + within;
    while !done() {
        assert!(
            std::time::Instant::now() < give_up,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The application started in process, with a shutdown the test controls.
#[derive(Debug)]
pub struct App {
    /// The running application (telemetry address, metrics, queues).
    pub running: sluicegate::app::Running,
    /// Cancel to start the drain.
    pub shutdown: tokio_util::sync::CancellationToken,
}

impl App {
    /// Starts the drain and waits for it; fails the test if the run failed.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.running.wait().await.expect("the run drains cleanly");
    }
}

/// Starts the application for `config` exactly as `sluicegate run` does
/// (no `--input`, results kept in the queues), stopped by [`App::stop`].
pub async fn start_app(config: &sluicegate::config::Config) -> App {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = sluicegate::app::start(
        config,
        sluicegate::app::RunOptions::default(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .expect("the application starts");
    App { running, shutdown }
}
