//! What the benchmarks measure with: wall and CPU time, peak RSS from
//! /proc, a gateway in this process that answers at once, and the small
//! requests every drain enqueues.

use std::ops::Range;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::app::{RunOptions, Running};
use crate::config::Config;
use crate::queue::Outgoing;

/// CPU seconds (user + system) so far of process `pid` (`self` for this
/// one), from /proc.
pub(super) fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // USER_HZ is 100 on Linux.
    Some((utime + stime) / 100.0)
}

/// Wall time and this process's CPU since [`Stopwatch::start`]: what every
/// in-process drain benchmark reports.
pub(super) struct Stopwatch {
    started: Instant,
    cpu_before: f64,
}

impl Stopwatch {
    pub(super) fn start() -> Self {
        Self {
            started: Instant::now(),
            cpu_before: cpu_seconds("self").unwrap_or(0.0),
        }
    }

    /// Seconds elapsed and CPU seconds used since the start.
    pub(super) fn stop(&self) -> (f64, f64) {
        (
            self.started.elapsed().as_secs_f64(),
            cpu_seconds("self").unwrap_or(0.0) - self.cpu_before,
        )
    }
}

/// The figures every drain benchmark prints, in the form
/// `scripts/bench-compare.sh` reads: messages/s, CPU seconds per 1 000
/// messages (`counted`: whose CPU that is) and this process's peak RSS.
pub(super) fn print_drain_figures(messages: usize, secs: f64, cpu: f64, counted: &str) {
    println!(
        "  drained in {secs:.2}s: {:.0} messages/s",
        messages as f64 / secs
    );
    println!(
        "  CPU: {:.3}s per 1000 messages ({counted})",
        cpu / messages as f64 * 1000.0
    );
    println!("  peak RSS: {:.1} MiB", peak_rss_mib("self").unwrap_or(0.0));
}

/// Peak resident set size of process `pid` in MiB, from /proc.
pub(super) fn peak_rss_mib(pid: &str) -> Option<f64> {
    status_kib(pid, "VmHWM:").map(|kib| kib / 1024.0)
}

/// A `kB` line (`VmHWM:`, `VmRSS:`) of /proc/<pid>/status.
pub(super) fn status_kib(pid: &str, key: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The requests `bench-<i>` for `ids`, with `deadline` (Unix seconds),
/// each asking for `max_tokens` tokens: what every drain enqueues.
pub(super) fn bench_requests(ids: Range<usize>, deadline: i64, max_tokens: u32) -> Vec<Outgoing> {
    ids.map(|i| Outgoing {
        body: format!(
            r#"{{"id":"bench-{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hello","max_tokens":{max_tokens}}}}}"#
        )
        .into(),
        deadline,
    })
    .collect()
}

/// The configuration of a drain through a transport: `transport` (its
/// `transport = …` line and tables) to the instant gateway at `gateway`,
/// a short receive wait, telemetry on a free port with warnings only, and
/// one queue, named by the keys in `queue`, behind the constant gate at
/// `max_sys`.
pub(super) fn drain_config(
    transport: &str,
    gateway: &str,
    queue: &str,
    max_sys: f64,
) -> Result<Config, String> {
    let toml = format!(
        r#"
{transport}
[gateway]
url = "{gateway}"
[dispatch]
receive_wait = "50ms"
[telemetry]
listen = "127.0.0.1:0"
log_level = "warn"
[[queue]]
{queue}
max_sys = {max_sys}
gate_type = "constant"
"#
    );
    Config::from_toml_str(&toml, &Default::default()).map_err(|e| e.to_string())
}

/// Asks `drained` every 10 ms until it says the drain is over, sampling
/// the window's in flight of `queue` meanwhile; returns the peak: how wide
/// the window really opened, and so how many gateway connections were
/// open at once.
pub(super) async fn peak_until_drained(
    running: &Running,
    queue: &str,
    mut drained: impl AsyncFnMut() -> Result<bool, String>,
) -> Result<i64, String> {
    let window = running.metrics.queue(queue);
    let mut peak_in_flight = 0;
    loop {
        peak_in_flight = peak_in_flight.max(window.in_flight.get());
        if drained().await? {
            return Ok(peak_in_flight);
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Starts the dispatcher of `config` in this process, as every drain
/// runs it; cancelling the token stops it (then `Running::wait`).
pub(super) async fn start_dispatcher(
    config: &Config,
) -> Result<(Running, CancellationToken), String> {
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone().cancelled_owned();
    let running = (crate::app::start(config, RunOptions::default(), stop).await)
        .map_err(|e| e.to_string())?;
    Ok((running, shutdown))
}

pub(super) async fn instant_gateway() -> std::io::Result<(String, tokio::task::JoinHandle<()>)> {
    use axum::routing::post;
    let app = axum::Router::new().fallback(post(|| async {
        (
            [("content-type", "application/json")],
            r#"{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#,
        )
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("http://{addr}"), task))
}

/// A `/metrics` page at `url`.
pub(super) async fn metrics_page(http: &reqwest::Client, url: &str) -> Result<String, String> {
    http.get(url)
        .send()
        .await
        .map_err(|e| e.to_string())?
        .text()
        .await
        .map_err(|e| e.to_string())
}

/// The sum of the samples of `page` whose lines start with one of
/// `prefixes` (a family name and its `{`).
pub(super) fn metric_sum(page: &str, prefixes: &[&str]) -> f64 {
    page.lines()
        .filter(|l| prefixes.iter().any(|p| l.starts_with(p)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests running or waiting at the simulator whose `/metrics` is `url`.
pub(super) async fn pool_in_flight(http: &reqwest::Client, url: &str) -> Result<f64, String> {
    let page = metrics_page(http, url).await?;
    Ok(metric_sum(
        &page,
        &["vllm:num_requests_running{", "vllm:num_requests_waiting{"],
    ))
}

/// What a bench's `sluicegate run` replica runs against: a Redis queue with
/// the shared window (callers on another transport override the transport
/// settings; the window stays on Redis), behind a metric gate.
pub(super) struct ReplicaSpec<'a> {
    pub(super) redis_url: &'a str,
    pub(super) queue: &'a str,
    pub(super) results: &'a str,
    pub(super) gateway: &'a str,
    pub(super) gate: ReplicaGate,
    pub(super) max_count: f64,
    pub(super) shared_window: &'a str,
    pub(super) lease: String,
}

/// The gate of a bench replica, and the Prometheus it reads if any.
#[derive(Clone)]
pub(super) struct ReplicaGate {
    pub(super) gate_type: &'static str,
    pub(super) params: serde_json::Value,
    pub(super) prometheus_url: Option<String>,
}

impl ReplicaGate {
    /// `endpoint-scrape` of the simulator's running requests at
    /// `metrics_url`: `max_count` of them count as full.
    pub(super) fn endpoint_scrape(metrics_url: String, max_count: f64, baseline: f64) -> Self {
        Self {
            gate_type: "endpoint-scrape",
            params: serde_json::json!({
                "url": metrics_url,
                "metric": "vllm:num_requests_running",
                "max_count_per_pod": max_count,
                "baseline": baseline,
                "sees_own_load": true,
            }),
            prometheus_url: None,
        }
    }

    /// `prometheus-budget` of pool `pool` through the Prometheus at `url`:
    /// its running-requests source (the Prometheus must drop the queue
    /// metrics that come first in the cascade, docs/gates.md), with
    /// `per_pod` running requests per ready pod counting as full.
    pub(super) fn prometheus_budget(url: String, pool: &str, per_pod: f64, baseline: f64) -> Self {
        Self {
            gate_type: "prometheus-budget",
            params: serde_json::json!({
                "pool": pool,
                "max_concurrency": per_pod,
                "baseline": baseline,
            }),
            prometheus_url: Some(url),
        }
    }
}

/// The command both replica benches start (this executable's `run`, a clean
/// environment); the caller adds its own settings and spawns it.
pub(super) fn replica_command(spec: &ReplicaSpec) -> Result<std::process::Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "redis")
        .env("SLUICEGATE_REDIS_URL", spec.redis_url)
        .env("SLUICEGATE_QUEUE", spec.queue)
        .env("SLUICEGATE_QUEUE_RESULT_QUEUE_NAME", spec.results)
        .env("SLUICEGATE_GATEWAY_URL", spec.gateway)
        .env("SLUICEGATE_GATE_TYPE", spec.gate.gate_type)
        .env("SLUICEGATE_GATE_PARAMS", spec.gate.params.to_string())
        .env("SLUICEGATE_QUEUE_MAX_SYS", spec.max_count.to_string())
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .env("SLUICEGATE_DISPATCH_SHARED_WINDOW", spec.shared_window)
        .env("SLUICEGATE_DISPATCH_SHARED_WINDOW_LEASE", &spec.lease)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    if let Some(url) = &spec.gate.prometheus_url {
        cmd.env("SLUICEGATE_PROMETHEUS_URL", url);
    }
    Ok(cmd)
}
