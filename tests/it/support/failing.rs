//! Scripted gateways that fail below HTTP, on a real loopback socket: one
//! that resets every connection once the request has arrived, one that
//! reads the request and never answers, one that resets the first few and
//! then answers 200. Each counts the attempts it saw (a request read from
//! a connection), with the instant of each, so a test can assert rates at
//! the server itself. A failing gateway can recover (answer 200 from then
//! on), and one can be started on a given port, so a test can let a port
//! that refused connections start answering.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// What the scripted gateway does with a request once it has read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Close with `SO_LINGER` 0: the client sees a connection reset.
    Reset,
    /// Keep the connection open and never answer (until the server stops).
    Hang,
    /// Reset the first `n` requests, then answer every later one 200 with
    /// a small completion.
    ResetThenOk(usize),
}

/// A gateway that fails every request the same way.
#[derive(Debug)]
pub struct FailingGateway {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    attempts: Arc<Mutex<Vec<Instant>>>,
    recovered: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl FailingGateway {
    /// Listens on a free loopback port and fails every request with `failure`.
    pub async fn start(failure: Failure) -> Self {
        Self::start_on(0, failure).await
    }

    /// Listens on loopback `port` (0: a free one) and fails every request
    /// with `failure`.
    pub async fn start_on(port: u16, failure: Failure) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let recovered = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let (seen, up, token) = (attempts.clone(), recovered.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = token.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let (seen, up, token) = (seen.clone(), up.clone(), token.clone());
                tokio::spawn(serve(stream, failure, seen, up, token));
            }
        });
        Self {
            url,
            attempts,
            recovered,
            stop,
        }
    }

    /// From now on, answers every request 200 (still counting it).
    pub fn recover(&self) {
        self.recovered.store(true, Ordering::SeqCst);
    }

    /// Requests seen so far.
    pub fn count(&self) -> usize {
        self.attempts.lock().expect("lock").len()
    }

    /// The instants of the requests seen so far.
    pub fn attempts(&self) -> Vec<Instant> {
        self.attempts.lock().expect("lock").clone()
    }
}

impl Drop for FailingGateway {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Reads requests from one connection and fails (or answers) each; a
/// kept-alive connection may carry several once requests are answered.
async fn serve(
    mut stream: TcpStream,
    failure: Failure,
    seen: Arc<Mutex<Vec<Instant>>>,
    recovered: Arc<AtomicBool>,
    stop: CancellationToken,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut got = Vec::new();
        loop {
            let n = tokio::select! {
                () = stop.cancelled() => return,
                n = stream.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
            };
            got.extend_from_slice(&buf[..n]);
            // The end of the headers: the request has arrived (its body
            // follows in the same write from our client; it is not parsed).
            if got.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        let nth = {
            let mut seen = seen.lock().expect("lock");
            seen.push(Instant::now());
            seen.len()
        };
        let answers = recovered.load(Ordering::SeqCst)
            || matches!(failure, Failure::ResetThenOk(n) if nth > n);
        let failure = match failure {
            _ if answers => {
                let body = r#"{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if stream.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
            Failure::ResetThenOk(_) => Failure::Reset,
            other => other,
        };
        fail(stream, failure, &mut buf, &stop).await;
        return;
    }
}

async fn fail(mut stream: TcpStream, failure: Failure, buf: &mut [u8], stop: &CancellationToken) {
    match failure {
        Failure::Reset => {
            let _ = stream.set_zero_linger();
            drop(stream);
        }
        Failure::Hang | Failure::ResetThenOk(_) => {
            // Drain whatever else comes until the client gives up.
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    n = stream.read(buf) => match n {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    },
                }
            }
        }
    }
}

/// Attempts per `unit` since `start`, over `span` (whole units).
pub fn per_unit(
    attempts: &[Instant],
    start: Instant,
    span: Duration,
    unit: Duration,
) -> Vec<usize> {
    let units = span.as_nanos() / unit.as_nanos().max(1);
    let mut buckets = vec![0usize; usize::try_from(units).unwrap_or(0).max(1)];
    for at in attempts {
        let i = at.saturating_duration_since(start).as_nanos() / unit.as_nanos().max(1);
        if let Some(b) = usize::try_from(i).ok().and_then(|i| buckets.get_mut(i)) {
            *b += 1;
        }
    }
    buckets
}
