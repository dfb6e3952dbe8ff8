//! The real-time front: an OpenAI-compatible server over a simulated pool.
//!
//! One driver task owns the clock: it advances the [`Pool`] to "now" (real
//! elapsed time × `time_scale`), injects background load, hands tokens to
//! waiting HTTP handlers, then sleeps until the next step ends or a request
//! arrives. Handlers only parse, submit under the lock and wait on a bounded
//! channel, so the pure engine never sees I/O.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::config::SimConfig;
use super::error::SimError;
use super::time::SimTime;

mod driver;
mod request;
mod response;
mod routes;

use driver::*;
use request::*;
use response::*;
use routes::*;

/// One request of the built-in interactive load generator, as recorded
/// by [`SimHandle::record_interactive`]: enough for its TTFT.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InteractiveTiming {
    /// Position among the generator's arrivals (0 = first). Two fronts
    /// with the same seed and load draw the same arrivals, so equal
    /// indexes are the same request in both (pairing a pool with its twin).
    pub index: u64,
    /// Arrival at the gateway, simulated seconds since the front started.
    pub arrival: SimTime,
    /// First token, if one was produced yet.
    pub first_token_at: Option<SimTime>,
    /// Refused by the gateway (429/503): it has no TTFT.
    pub rejected: bool,
}

/// A running simulator front; dropping it stops the server.
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<(), SimError>>>,
    /// Read by [`Self::interactive_arrivals`] (the demo charts the load).
    shared: Arc<Shared>,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests the built-in interactive load generator has submitted so
    /// far (requests sent over HTTP are not counted), as of the last time
    /// the simulator advanced.
    pub fn interactive_arrivals(&self) -> u64 {
        self.shared.lock().background_arrivals
    }

    /// Simulated seconds since the front started.
    pub fn sim_time(&self) -> SimTime {
        self.shared.now()
    }

    /// From now on, records every arrival of the built-in interactive
    /// load generator and its first token ([`Self::interactive_timings`]).
    /// Off by default: a long-running `sim serve` would keep them all.
    pub fn record_interactive(&self) {
        let mut live = self.shared.lock();
        if live.interactive_log.is_none() {
            live.interactive_log = Some(InteractiveLog::default());
        }
    }

    /// The current simulated time and the interactive requests recorded
    /// since [`Self::record_interactive`], in arrival order.
    pub fn interactive_timings(&self) -> (SimTime, Vec<InteractiveTiming>) {
        let mut live = self.shared.lock();
        let now = self.shared.now();
        // Bring the pool to `now` so first tokens emitted until now count.
        live.advance(now);
        let timings = live
            .interactive_log
            .as_ref()
            .map(|l| l.timings.clone())
            .unwrap_or_default();
        (now, timings)
    }

    /// Stops the server and waits for it (in-flight requests end with 503 or a
    /// truncated stream).
    pub async fn shutdown(mut self) -> Result<(), SimError> {
        self.cancel.cancel();
        match self.task.take() {
            Some(task) => task.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts the front on `config.listen` (default 127.0.0.1 on a free port).
pub async fn spawn_http(config: SimConfig) -> Result<SimHandle, SimError> {
    config.validate()?;
    let addr = config
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Bind { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| SimError::Bind { addr, source })?;
    let shared = Arc::new(Shared::new(config)?);
    let cancel = CancellationToken::new();

    let driver = tokio::spawn(drive(shared.clone(), cancel.clone()));
    let app = router(shared.clone());
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .map_err(SimError::Serve);
        // The driver ends on the same token; a panic there is already logged.
        let _ = driver.await;
        served
    });
    Ok(SimHandle {
        addr,
        cancel,
        task: Some(task),
        shared,
    })
}
