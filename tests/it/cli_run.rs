//! The `sluicegate` binary end to end: configured by the environment alone,
//! dispatching into the pool simulator over real HTTP, stopped by SIGTERM;
//! and the configuration commands' exit codes and redaction.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::support::TempDir;
use sluicegate::clock::unix_secs;
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

fn write_requests(path: &Path, n: usize, max_tokens: u32) {
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({
                "id": format!("req-{i}"),
                "deadline": deadline,
                "payload": {"model": "sim-model", "prompt": "Summarise the report.", "max_tokens": max_tokens}
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).expect("write input");
}

/// The sidecar contract: a process configured by `SLUICEGATE_*` alone.
fn sidecar(gateway: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_QUEUE", "batch")
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_REQUEST_PATH", "/v1/completions")
        .env("SLUICEGATE_GATE_TYPE", "local-max-concurrency")
        .env(
            "SLUICEGATE_GATE_PARAMS",
            r#"{"limit":"8","gating_mode":"blocking"}"#,
        )
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_LOG_FORMAT", "json")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms");
    cmd
}

fn read_results(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("result line is JSON"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn env_configured_sidecar_drains_a_batch_through_the_simulator() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator starts");
    let tmp = TempDir::new("drain");
    let dir = &tmp.0;
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_requests(&input, 40, 16);
    let mut cmd = sidecar(&sim.base_url());
    cmd.args(["run", "--exit-when-done", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output);
    let done: Output = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("binary runs");
    assert!(
        done.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let results = read_results(&output);
    assert_eq!(results.len(), 40);
    for r in &results {
        assert_eq!(r["status_code"], 200, "{r}");
        let body: serde_json::Value =
            serde_json::from_str(r["payload"].as_str().expect("payload string"))
                .expect("OpenAI body");
        assert!(
            body["usage"]["completion_tokens"].as_u64().is_some(),
            "{body}"
        );
    }
    // JSON logs on stderr, one object per line.
    let stderr = String::from_utf8_lossy(&done.stderr);
    let first = stderr.lines().next().expect("logs");
    assert!(
        serde_json::from_str::<serde_json::Value>(first).is_ok(),
        "{first}"
    );
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_and_hands_back_everything_unsettled() {
    // A slow pool: each request takes a couple of seconds.
    let sim = spawn_http(SimConfig::default())
        .await
        .expect("simulator starts");
    let tmp = TempDir::new("sigterm");
    let dir = &tmp.0;
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_requests(&input, 60, 200);
    let mut cmd = sidecar(&sim.base_url());
    cmd.args(["run", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("binary starts");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let done = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("exits");
    assert!(
        done.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let results = read_results(&output);
    let mut rest = output.clone().into_os_string();
    rest.push(".unsettled.jsonl");
    let unsettled = std::fs::read_to_string(PathBuf::from(rest)).unwrap_or_default();
    let unsettled = unsettled.lines().filter(|l| !l.is_empty()).count();
    assert!(
        !results.is_empty(),
        "in-flight requests finished within the grace period"
    );
    assert!(
        unsettled > 0,
        "a 60-request batch cannot finish in 1.5 s at 8 in flight"
    );
    assert_eq!(
        results.len() + unsettled,
        60,
        "every message is a result or handed back"
    );
    sim.shutdown().await.expect("simulator stops");
}

fn run(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.env_clear().args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("binary runs")
}

#[test]
fn check_config_exits_0_with_a_summary_or_2_naming_the_key() {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/config/constant.toml");
    let ok = run(&["check-config", "--config", examples], &[]);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(!ok.stdout.is_empty());

    let tmp = TempDir::new("check");
    let dir = &tmp.0;
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "transport = \"memory\"\n[[queue]]\nqueue_name = \"q\"\nigw_base_url = \"http://127.0.0.1:1\"\ngate_type = \"prometheus-bugdet\"\n",
    )
    .expect("write");
    let out = run(
        &[
            "check-config",
            "--config",
            bad.to_str().expect("utf-8 path"),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gate_type"), "{err}");
    assert!(
        err.contains("prometheus-budget"),
        "allowed values listed: {err}"
    );
}

#[test]
fn config_show_redacts_secrets() {
    let out = run(
        &["config", "show"],
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
            ("SLUICEGATE_GATE_TYPE", "constant"),
            ("SLUICEGATE_GATEWAY_TOKEN", "s3cr3t-token-value"),
            (
                "SLUICEGATE_REDIS_URL",
                "redis://user:hunter2pass@127.0.0.1:6379/0",
            ),
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(!shown.contains("s3cr3t-token-value"), "{shown}");
    assert!(!shown.contains("hunter2pass"), "{shown}");
    assert!(
        shown.contains("redacted") || shown.contains("****"),
        "{shown}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sim_serve_command_answers_completions_and_serves_metrics() {
    let port = support::free_port();
    let mut child = Command::new(BIN)
        .args([
            "sim",
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--pool-name",
            "p1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("binary starts");
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let mut healthy = false;
    for _ in 0..100 {
        if client
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            healthy = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(healthy, "sim serve came up");
    let answer = client
        .post(format!("{base}/v1/completions"))
        .body(r#"{"model":"sim-model","prompt":"hello","max_tokens":4}"#)
        .header("content-type", "application/json")
        .send()
        .await
        .expect("completion");
    assert_eq!(answer.status(), 200);
    let body: serde_json::Value =
        serde_json::from_str(&answer.text().await.expect("body")).expect("json");
    assert!(body["usage"]["total_tokens"].as_u64().is_some(), "{body}");
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds_bucket",
        "inference_pool_ready_pods",
        "inference_pool_per_pod_queue_size",
    ] {
        assert!(metrics.contains(name), "{name} missing");
    }
    assert!(metrics.contains(r#"name="p1""#), "pool name label");
    let pid = child.id().to_string();
    Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("exits");
    assert!(status.success(), "clean exit on SIGTERM");
}
