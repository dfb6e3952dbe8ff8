//! `sluicegate gate probe` against a real Prometheus scraping the simulator,
//! configured by the environment alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::prometheus::{Prometheus, PrometheusSpec};
use serde_json::Value;
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

fn probe(prom: &Prometheus, params: &str, extra: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(["gate", "probe"])
        .args(extra)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env("SLUICEGATE_GATE_PARAMS", params)
        .env("SLUICEGATE_PROMETHEUS_URL", prom.url())
        .output()
        .expect("run sluicegate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_explains_the_budget_from_the_environment_alone() {
    let sim = spawn_http(SimConfig {
        pool_name: "p".into(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    prom.wait_for_sample("llm_d_epp_ready_endpoints", Duration::from_secs(20))
        .await;

    let (code, out, err) = probe(&prom, r#"{"pool":"p","max_concurrency":10}"#, &["--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["d"], 1.0, "{v}");
    assert_eq!(v["baseline"], 0.05);
    assert_eq!(v["max_sys"], 20.0);
    assert_eq!(v["n"], 19);
    assert_eq!(v["open"], true);
    assert_eq!(v["source_available"], true);
    assert!((v["budget"].as_f64().unwrap() - 0.95).abs() < 1e-9);
    assert_eq!(
        v["sources"][0]["target"],
        "max(llm_d_epp_ready_endpoints{name=\"p\"})"
    );

    let (code, text, err) = probe(&prom, r#"{"pool":"p","max_concurrency":10}"#, &[]);
    assert_eq!(code, 0, "{err}");
    eprintln!("{text}");
    for needle in [
        "gate prometheus-budget",
        "flow-control queue (current name)",
        "sum(llm_d_epp_flow_control_queue_size{inference_pool=\"p\"})",
        "D (budget):       1.0000",
        "B (baseline):     0.0500",
        "max_SYS:          20 requests (live from the gate)",
        "N:                19 requests",
        "OPEN",
        "closes when the load per ready pod reaches 9.500",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }

    let (code, out, _) = probe(&prom, r#"{"pool":"typo"}"#, &["--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["open"], false);
    assert_eq!(v["source_available"], false);
    assert_eq!(v["d"], 0.0);
    assert_eq!(v["n"], 0);
    let (_, text, _) = probe(&prom, r#"{"pool":"typo"}"#, &[]);
    eprintln!("{text}");
    assert!(text.contains("CLOSED: source unavailable"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_watch_prints_a_line_per_interval() {
    let sim = spawn_http(SimConfig {
        pool_name: "p".into(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    prom.wait_for_sample("llm_d_epp_ready_endpoints", Duration::from_secs(20))
        .await;
    let mut child = Command::new(BIN)
        .args(["gate", "probe", "--watch", "--interval", "200ms"])
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env("SLUICEGATE_GATE_PARAMS", r#"{"pool":"p"}"#)
        .env("SLUICEGATE_PROMETHEUS_URL", prom.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .take(3)
            .map(Result::unwrap)
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let _ = child.wait();
    assert_eq!(lines.len(), 3);
    for line in &lines {
        assert!(line.contains("D=1.0000 B=0.0500"), "{line}");
        assert!(line.contains("open=true source_available=true"), "{line}");
    }
}

#[test]
fn probe_reports_config_errors_with_exit_code_2() {
    let out = Command::new(BIN)
        .args(["gate", "probe", "--json"])
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env("SLUICEGATE_GATE_PARAMS", r#"{"pool":"p"}"#)
        .env_remove("SLUICEGATE_PROMETHEUS_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prometheus.url"), "{err}");
}

#[test]
fn probe_reports_only_what_it_needs() {
    // One missing gate parameter: the probe names it, and not the transport
    // or gateway URL it never uses (check-config reports those).
    let out = Command::new(BIN)
        .args(["gate", "probe"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_GATE_TYPE", "prometheus-budget")
        .env("SLUICEGATE_GATE_PARAMS", "{}")
        .env("SLUICEGATE_PROMETHEUS_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gate_params.pool"), "{err}");
    assert!(!err.contains("transport"), "{err}");
    assert!(!err.contains("igw_base_url"), "{err}");
}
