//! Drain benchmark for the dispatch core: N messages from the in-memory
//! queue through the constant gate into a gateway that answers at once.
//! Prints messages/s, CPU seconds per 1000 messages and peak RSS.
//!
//! `cargo run --release --example drain_memory -- [MESSAGES] [MAX_SYS]`
//!
//! The gateway runs in the same process (and on the same cores), so the CPU
//! figure includes serving the HTTP answers.

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::post;
use sluicegate::app::Tasks;
use sluicegate::dispatch::{DispatchSettings, QueueDispatcher, RetryPolicy};
use sluicegate::gate::{ConstantGate, FailClosed};
use sluicegate::gateway::{GatewayClient, GatewaySettings, Target};
use sluicegate::queue::MemoryQueue;
use sluicegate::telemetry::Metrics;
use tokio_util::sync::CancellationToken;

/// CPU seconds (user + system) of this process, from /proc.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name: utime and stime are the 12th and 13th.
    let after = stat.rsplit(')').next().unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

/// Peak resident set size in MiB, from /proc.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let messages: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let max_sys: f64 = args.next().and_then(|v| v.parse().ok()).unwrap_or(256.0);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_addr = listener.local_addr().unwrap();
    let app = Router::new().route(
        "/v1/completions",
        post(|| async { r#"{"choices":[{"text":"ok"}],"usage":{"completion_tokens":1}}"# }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });

    let queue = Arc::new(MemoryQueue::new("bench"));
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    for i in 0..messages {
        queue.push_message(format!(
            r#"{{"id":"m{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hi","max_tokens":1}}}}"#
        ));
    }
    let metrics = Metrics::new();
    let settings = DispatchSettings {
        max_sys,
        receive_wait: Duration::from_millis(20),
        ..DispatchSettings::default()
    };
    let dispatcher = QueueDispatcher {
        queue: queue.clone(),
        gate: Arc::new(FailClosed::new(
            Box::new(ConstantGate::default()),
            settings.max_staleness,
        )),
        gateway: GatewayClient::new(GatewaySettings {
            max_idle_per_host: 512,
            ..GatewaySettings::default()
        })
        .unwrap(),
        target: Target::new(&format!("http://{gateway_addr}"), "/v1/completions", None).unwrap(),
        retry: RetryPolicy::default(),
        congestion: Default::default(),
        pool: Default::default(),
        settings,
        metrics: metrics.queue("bench"),
        labels: BTreeMap::new(),
        traces: None,
    };
    let shutdown = CancellationToken::new();
    let cpu_start = cpu_seconds();
    let start = Instant::now();
    let tasks = Tasks::new();
    let run = tokio::spawn(dispatcher.run(shutdown.clone(), tasks.clone()));
    while queue.result_count() < messages {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    shutdown.cancel();
    run.await.unwrap();
    tasks.stop().await;
    let ok = queue
        .results()
        .iter()
        .filter(|r| r.status_code == Some(200))
        .count();
    println!(
        "drain_memory: {messages} messages ({ok} ok), max_sys {max_sys}: {:.0} msg/s, {:.3} CPU s per 1000 msgs, peak RSS {:.1} MiB, {:.2} s",
        messages as f64 / elapsed,
        cpu / messages as f64 * 1000.0,
        peak_rss_mib(),
        elapsed
    );
}
