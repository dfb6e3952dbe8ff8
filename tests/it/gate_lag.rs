//! The gate's promise under the metric lag users have: a real Prometheus
//! scraping far less often than sluicegate polls, and batch requests that
//! outlive a scrape. Batch in flight at the pool must never exceed
//! `max_SYS × (1 − B)`, whichever cascade source the gate reads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::TempDir;
use crate::support::prometheus::{Prometheus, PrometheusSpec};
use sluicegate::sim::{SimConfig, SimHandle, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

/// 2 ready endpoints × `max_concurrency` 16, baseline 0.1.
const MAX_CONCURRENCY: f64 = 16.0;
const BASELINE: f64 = 0.1;
const READY: f64 = 2.0;

/// A pool that runs every request it gets (no vLLM queueing), so what is
/// in flight at the pool is exactly the batch work sluicegate sent.
async fn roomy_pool() -> SimHandle {
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        replicas: READY as usize,
        ..SimConfig::default()
    };
    cfg.engine.max_num_seqs = 256;
    cfg.http.max_output_tokens = 8000;
    spawn_http(cfg).await.unwrap()
}

/// Batch requests that each last several seconds (longer than a scrape).
fn write_batch(dir: &TempDir, n: usize, max_tokens: u32) -> std::path::PathBuf {
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({"id": format!("req-{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "Summarise.", "max_tokens": max_tokens}})
            .to_string()
        })
        .collect();
    let input = dir.0.join("requests.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    input
}

fn start_dispatcher(
    sim: &SimHandle,
    prom: &Prometheus,
    input: &std::path::Path,
    scrape: Duration,
) -> Child {
    // Data may be up to a scrape (plus the query) old: allow two.
    let staleness = format!("{}s", (scrape * 2).as_secs().max(20));
    Command::new(BIN)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_GATEWAY_URL", sim.base_url())
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env(
            "SLUICEGATE_GATE_PARAMS",
            format!(r#"{{"pool":"p","max_concurrency":{MAX_CONCURRENCY},"baseline":{BASELINE}}}"#),
        )
        .env("SLUICEGATE_PROMETHEUS_URL", prom.url())
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "200ms")
        .env("SLUICEGATE_DISPATCH_MAX_STALENESS", staleness)
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .args(["run", "--exit-when-done", "--input"])
        .arg(input)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The sum of the pool's samples whose line starts with one of `series`,
/// read from its own `/metrics` (not through Prometheus: this is the truth
/// the gate must respect).
async fn pool_sum(client: &reqwest::Client, sim: &SimHandle, series: &[&str]) -> f64 {
    let text = client
        .get(format!("{}/metrics", sim.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| series.iter().any(|s| l.starts_with(s)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests running or waiting at the pool.
async fn pool_in_flight(client: &reqwest::Client, sim: &SimHandle) -> f64 {
    pool_sum(
        client,
        sim,
        &["vllm:num_requests_running{", "vllm:num_requests_waiting{"],
    )
    .await
}

/// Runs a batch through the gate for `watch` and returns the largest batch
/// in-flight seen at the pool, sampled every 50 ms.
async fn max_in_flight(drop_metrics: Vec<String>, scrape: Duration, watch: Duration) -> f64 {
    // ~6 s per request at the simulator's default step time.
    run(drop_metrics, scrape, watch, 600).await.max_in_flight
}

/// What one lag run measured.
struct Run {
    /// Largest batch in flight at the pool.
    max_in_flight: f64,
    /// Batch requests completed per second over the run.
    throughput: f64,
}

/// Completed requests so far, from the pool's own counter.
async fn pool_successes(client: &reqwest::Client, sim: &SimHandle) -> f64 {
    pool_sum(client, sim, &["vllm:request_success_total{"]).await
}

async fn run(drop_metrics: Vec<String>, scrape: Duration, watch: Duration, max_tokens: u32) -> Run {
    let sim = roomy_pool().await;
    let prom = Prometheus::start_scraping_every(
        &PrometheusSpec {
            targets: vec![sim.addr().to_string()],
            drop_metrics,
        },
        scrape,
    )
    .await;
    prom.wait_for_sample(
        "llm_d_epp_ready_endpoints",
        (scrape * 4).max(Duration::from_secs(20)),
    )
    .await;
    let dir = TempDir::new("gate-lag");
    let input = write_batch(&dir, 2000, max_tokens);
    let mut child = start_dispatcher(&sim, &prom, &input, scrape);
    let client = reqwest::Client::new();
    let start = std::time::Instant::now();
    let done_before = pool_successes(&client, &sim).await;
    let mut max = 0.0f64;
    while start.elapsed() < watch {
        max = max.max(pool_in_flight(&client, &sim).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = pool_successes(&client, &sim).await - done_before;
    let _ = child.kill();
    let _ = child.wait();
    Run {
        max_in_flight: max,
        throughput: done / start.elapsed().as_secs_f64(),
    }
}

fn ceiling() -> f64 {
    READY * MAX_CONCURRENCY * (1.0 - BASELINE)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_queue_source_never_lets_in_flight_exceed_the_budget() {
    // The endpoint picker's flow-control queue counts queued requests only:
    // batch work that runs never lowers it, so the window must be N itself.
    let max = max_in_flight(Vec::new(), Duration::from_secs(5), Duration::from_secs(20)).await;
    println!("max batch in flight {max} (ceiling {})", ceiling());
    assert!(max > 0.0, "nothing was dispatched");
    assert!(
        max <= ceiling(),
        "max batch in flight {max} > {}",
        ceiling()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_requests_source_dated_by_scrape_never_lets_in_flight_exceed_the_budget() {
    // Without the endpoint picker's queue metrics the cascade reads vLLM's
    // running requests, which see our load: the window is in-flight at the
    // scrape + N, so the reading must be dated by the scrape, not the query.
    let max = max_in_flight(
        vec![
            ".*flow_control.*".into(),
            ".*per_endpoint_queue.*".into(),
            ".*per_pod_queue.*".into(),
        ],
        Duration::from_secs(5),
        Duration::from_secs(20),
    )
    .await;
    println!("max batch in flight {max} (ceiling {})", ceiling());
    assert!(max > 0.0, "nothing was dispatched");
    assert!(
        max <= ceiling(),
        "max batch in flight {max} > {}",
        ceiling()
    );
}

/// The lag table of `docs/benchmarks.md`: scrape interval × request
/// duration (a third of a scrape, and one and a half scrapes), the
/// running-requests source (which sees our load and must be dated by the
/// scrape). Prints one row per cell; asserts nothing about speed.
/// `cargo test --test gate_lag -- --ignored --nocapture lag_table`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: about ten minutes"]
async fn lag_table() {
    println!("| scrape | request | max batch in flight | max_SYS × (1 − B) | batch requests/s |");
    println!("|---|---|---|---|---|");
    for scrape_s in [1u64, 5, 15, 30] {
        let scrape = Duration::from_secs(scrape_s);
        // The simulator decodes a token about every 10 ms.
        for (label, seconds) in [
            ("shorter", scrape_s as f64 / 3.0),
            ("longer", scrape_s as f64 * 1.5),
        ] {
            let tokens = (seconds * 100.0).round().max(10.0) as u32;
            let watch = (scrape * 4).max(Duration::from_secs(20));
            let r = run(
                vec![
                    ".*flow_control.*".into(),
                    ".*per_endpoint_queue.*".into(),
                    ".*per_pod_queue.*".into(),
                ],
                scrape,
                watch,
                tokens,
            )
            .await;
            println!(
                "| {scrape_s} s | {label} (~{seconds:.1} s) | {:.0} | {:.1} | {:.2} |",
                r.max_in_flight,
                ceiling(),
                r.throughput
            );
        }
    }
}
