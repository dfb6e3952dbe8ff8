//! `sluicegate bench hold`: one `sluicegate run` process holding N
//! concurrent slow requests (a gateway that answers after a delay, whole or
//! streamed); prints the dispatcher's peak RSS, its CPU and the errors
//! (docs/benchmarks.md). The gateway runs in this process, the dispatcher in
//! a child, so the figures are the dispatcher's alone.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;

use crate::config::parse_duration;

#[derive(Debug, Args)]
pub(crate) struct HoldArgs {
    /// Concurrent requests (the window is opened this wide).
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// How long the gateway takes to answer each request.
    #[arg(long, default_value = "30s")]
    delay: String,
    /// Answer as a server-sent event stream, one chunk every `delay / 10`,
    /// instead of one body at the end.
    #[arg(long)]
    stream: bool,
    /// Talk HTTP/2 to the gateway (`gateway.http2_prior_knowledge`):
    /// streams on shared connections instead of one connection each.
    #[arg(long)]
    http2: bool,
}

/// What the gateway saw.
#[derive(Debug, Default)]
struct GatewayCounts {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    answered: AtomicUsize,
}

pub(super) async fn hold(args: HoldArgs) -> Result<(), String> {
    let delay = parse_duration(&args.delay).map_err(|e| format!("--delay: {e}"))?;
    let counts = Arc::new(GatewayCounts::default());
    let gateway = slow_gateway(delay, args.stream, args.http2, counts.clone())
        .await
        .map_err(|e| format!("gateway: {e}"))?;
    let dir = std::env::temp_dir().join(format!("sluicegate-bench-hold-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_requests(&input, args.requests, args.stream)?;

    let exe = std::env::current_exe().map_err(|e| format!("current executable: {e}"))?;
    let started = Instant::now();
    let mut child = Command::new(exe)
        .arg("run")
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .arg("--exit-when-done")
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_GATEWAY_URL", &gateway)
        .env("SLUICEGATE_GATE_TYPE", "constant")
        .env("SLUICEGATE_QUEUE_MAX_SYS", args.requests.to_string())
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_LOG_LEVEL", "warn")
        .env(
            "SLUICEGATE_GATEWAY_HTTP2_PRIOR_KNOWLEDGE",
            args.http2.to_string(),
        )
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("sluicegate run: {e}"))?;
    let pid = child.id().to_string();
    // The child's figures are read while it runs: /proc/<pid> is gone once
    // it has been waited for.
    let (mut peak_rss, mut cpu, mut rss_at_peak_hold) = (0.0f64, 0.0f64, 0.0f64);
    let status = loop {
        if let Some(rss) = super::measure::peak_rss_mib(&pid) {
            peak_rss = peak_rss.max(rss);
        }
        if let Some(c) = super::measure::cpu_seconds(&pid) {
            cpu = c;
        }
        if counts.in_flight.load(Ordering::Relaxed) == args.requests {
            rss_at_peak_hold = rss_at_peak_hold.max(current_rss_mib(&pid).unwrap_or(0.0));
        }
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(format!("sluicegate run: {e}")),
        }
    };
    let secs = started.elapsed().as_secs_f64();
    let text =
        std::fs::read_to_string(&output).map_err(|e| format!("{}: {e}", output.display()))?;
    let (mut ok, mut errors) = (0usize, 0usize);
    for line in text.lines() {
        let record: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        if record["status_code"] == 200 {
            ok += 1;
        } else {
            errors += 1;
        }
    }
    let missing = args.requests.saturating_sub(ok + errors);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "hold benchmark: {} concurrent requests, gateway answers after {} ({}, {})",
        args.requests,
        args.delay,
        if args.stream {
            "streamed, 10 chunks"
        } else {
            "one body"
        },
        if args.http2 {
            "HTTP/2 prior knowledge"
        } else {
            "HTTP/1.1, one connection per request"
        }
    );
    println!(
        "  gateway: peak {} in flight at once, {} answered",
        counts.peak.load(Ordering::Relaxed),
        counts.answered.load(Ordering::Relaxed)
    );
    println!("  dispatcher exit: {status}, wall {secs:.1}s");
    println!("  results: {ok} ok, {errors} errors, {missing} missing");
    println!(
        "  dispatcher peak RSS: {peak_rss:.1} MiB (RSS with all {} held: {rss_at_peak_hold:.1} MiB)",
        args.requests
    );
    println!(
        "  dispatcher CPU: {cpu:.2}s total, {:.3}s per 1000 requests",
        cpu / args.requests as f64 * 1000.0
    );
    Ok(())
}

fn write_requests(path: &Path, n: usize, stream: bool) -> Result<(), String> {
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3600;
    let mut text = String::with_capacity(n * 120);
    for i in 0..n {
        text.push_str(&format!(
            r#"{{"id":"hold-{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hello","max_tokens":16,"stream":{stream}}}}}"#
        ));
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Resident set size now, in MiB.
fn current_rss_mib(pid: &str) -> Option<f64> {
    super::measure::status_kib(pid, "VmRSS:").map(|kib| kib / 1024.0)
}

/// A gateway that holds every request for `delay`, then answers 200 (in
/// ten server-sent events over the delay when `stream`); HTTP/1.1, or
/// HTTP/2 with prior knowledge when `http2`.
async fn slow_gateway(
    delay: Duration,
    stream: bool,
    http2: bool,
    counts: Arc<GatewayCounts>,
) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    if http2 {
        tokio::spawn(serve_http2(listener, delay, stream, counts));
    } else {
        let app = axum::Router::new().fallback(axum::routing::post(move || {
            slow_answer(delay, stream, counts.clone())
        }));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    Ok(format!("http://{addr}"))
}

/// Serves [`slow_answer`] as HTTP/2 with prior knowledge and no stream
/// limit per connection: hyper's default of 200 would queue the rest in the
/// client, and the benchmark is about holding every request at the gateway.
async fn serve_http2(
    listener: tokio::net::TcpListener,
    delay: Duration,
    stream: bool,
    counts: Arc<GatewayCounts>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        let counts = counts.clone();
        let service = hyper::service::service_fn(move |_request| {
            let answer = slow_answer(delay, stream, counts.clone());
            async move { Ok::<_, std::convert::Infallible>(answer.await) }
        });
        tokio::spawn(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(u32::MAX)
                .serve_connection(TokioIo::new(socket), service),
        );
    }
}

/// Counts a request in flight from arrival until its answer is done or
/// dropped.
struct InFlight(Arc<GatewayCounts>);

impl InFlight {
    fn new(counts: Arc<GatewayCounts>) -> Self {
        let now = counts.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        counts.peak.fetch_max(now, Ordering::Relaxed);
        Self(counts)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.answered.fetch_add(1, Ordering::Relaxed);
    }
}

/// One completion after `delay`: a JSON body, or ten events spread over it.
async fn slow_answer(
    delay: Duration,
    stream: bool,
    counts: Arc<GatewayCounts>,
) -> axum::response::Response {
    use axum::body::Body;
    let guard = InFlight::new(counts);
    if !stream {
        tokio::time::sleep(delay).await;
        drop(guard);
        return axum::response::Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#,
            ))
            .unwrap_or_default();
    }
    let chunks = futures_util::stream::unfold((0u32, Some(guard)), move |(i, guard)| async move {
        if i > 10 {
            return None;
        }
        tokio::time::sleep(delay / 10).await;
        if i == 10 {
            drop(guard);
            return Some((
                Ok::<_, std::io::Error>("data: [DONE]\n\n".to_owned()),
                (i + 1, None),
            ));
        }
        let event = format!(
            "data: {{\"id\":\"cmpl\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n"
        );
        Some((Ok(event), (i + 1, guard)))
    });
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(chunks))
        .unwrap_or_default()
}
