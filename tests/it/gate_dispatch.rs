//! The dispatcher paced by a metric gate end to end: the `sluicegate`
//! binary, configured by the environment alone, drains a batch into the
//! simulator while a real Prometheus scrapes it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::TempDir;
use crate::support::prometheus::{Prometheus, PrometheusSpec};
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_budget_gate_paces_a_batch_through_the_simulator() {
    let sim = spawn_http(SimConfig {
        pool_name: "p".into(),
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: vec![".*flow_control.*".into()],
    })
    .await;
    prom.wait_for_sample("llm_d_epp_per_endpoint_queue_size", Duration::from_secs(20))
        .await;

    let dir = TempDir::new("gate-dispatch");
    let input = dir.0.join("requests.jsonl");
    let output = dir.0.join("results.jsonl");
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let lines: Vec<String> = (0..30)
        .map(|i| {
            serde_json::json!({"id": format!("req-{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "Summarise.", "max_tokens": 32}})
            .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();

    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_GATEWAY_URL", sim.base_url())
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env(
            "SLUICEGATE_GATE_PARAMS",
            r#"{"pool":"p","max_concurrency":"4","baseline":"0.25"}"#,
        )
        .env("SLUICEGATE_PROMETHEUS_URL", prom.url())
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_LOG_FORMAT", "json")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "200ms")
        .env("SLUICEGATE_DISPATCH_MAX_STALENESS", "10s")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .args(["run", "--exit-when-done", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output);
    let done = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "stderr: {stderr}");
    let results: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), 30);
    assert!(
        results.iter().all(|r| r["status_code"] == 200),
        "{results:?}"
    );
    // The gate said at startup at which load it closes: 4 × (1 − 0.25).
    assert!(
        stderr.contains(r#""closes_at_load_per_ready_pod":3.0"#),
        "stderr: {stderr}"
    );
}
