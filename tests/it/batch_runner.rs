//! `sluicegate batch` end to end against the pool simulator over HTTP:
//! every line gets exactly one output line, invalid lines are answered
//! with their line number, and a run killed with SIGKILL resumes without
//! sending again what already has a result.

use crate::support;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluicegate::queue::embedded::EmbeddedQueue;
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

fn openai_line(i: usize, max_tokens: u32) -> String {
    serde_json::json!({
        "custom_id": format!("line-{i}"),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "sim-model", "messages": [{"role": "user", "content": "Summarise."}], "max_tokens": max_tokens}
    })
    .to_string()
}

fn batch_cmd(input: &Path, output: &Path, gateway: &str, max_in_flight: u32) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["batch", "--input"])
        .arg(input)
        .arg("--output")
        .arg(output)
        .args(["--gateway", gateway, "--gate", "constant", "--quiet"])
        .args(["--max-in-flight", &max_in_flight.to_string()])
        .stdin(Stdio::null());
    cmd
}

fn read_output(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("output exists")
        .lines()
        .map(|l| serde_json::from_str(l).expect("output line is JSON"))
        .collect()
}

async fn completed_requests(base: &str) -> f64 {
    let names = ["vllm:request_success_total"];
    support::sim::metric_sum(&reqwest::Client::new(), base, &names).await
}

#[tokio::test(flavor = "multi_thread")]
async fn every_line_gets_one_result_and_invalid_lines_name_their_line() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-all");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    let mut lines: Vec<String> = (0..30).map(|i| openai_line(i, 8)).collect();
    lines.insert(4, "this is not json".into());
    lines.insert(
        9,
        r#"{"custom_id":"bad-method","method":"GET","url":"/v1/models","body":{}}"#.into(),
    );
    lines.push(r#"{"id":"own-format","payload":{"model":"m","prompt":"hi","max_tokens":4},"endpoint":"/v1/completions"}"#.into());
    std::fs::write(&input, lines.join("\n")).expect("input");
    let status = batch_cmd(&input, &output, &sim.base_url(), 8)
        .status()
        .expect("runs");
    assert!(status.success(), "{status:?}");
    let out = read_output(&output);
    assert_eq!(out.len(), 33, "one output line per input line");
    let ok = out
        .iter()
        .filter(|v| v["response"]["status_code"] == 200)
        .count();
    assert_eq!(ok, 31);
    let errors: Vec<&Value> = out.iter().filter(|v| !v["error"].is_null()).collect();
    assert_eq!(errors.len(), 2);
    assert_eq!(errors[0]["error"]["line"], 5);
    assert!(
        errors[0]["error"]["message"]
            .as_str()
            .expect("message")
            .starts_with("line 5:")
    );
    assert_eq!(errors[1]["error"]["line"], 10);
    assert_eq!(errors[1]["custom_id"], "bad-method");
    assert_eq!(out[0]["custom_id"], "line-0");
    assert_eq!(out[32]["custom_id"], "own-format");
    assert!(out[0]["response"]["body"]["usage"]["completion_tokens"].as_u64() > Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_run_resumes_and_every_custom_id_appears_exactly_once() {
    // Slow enough that SIGKILL lands mid-run.
    let sim = spawn_http(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-resume");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    let n = 120;
    let lines: Vec<String> = (0..n).map(|i| openai_line(i, 64)).collect();
    std::fs::write(&input, lines.join("\n")).expect("input");
    let mut child = batch_cmd(&input, &output, &sim.base_url(), 8)
        .spawn()
        .expect("spawn");
    let db = dir.join("out.jsonl.state").join("queue.db");
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let done = if db.exists() {
            EmbeddedQueue::open(&db, "batch")
                .and_then(|q| q.result_count())
                .unwrap_or(0)
        } else {
            0
        };
        if done >= 10 {
            break;
        }
        assert!(Instant::now() < give_up, "no progress before the kill");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let settled_before = EmbeddedQueue::open(&db, "batch")
        .and_then(|q| q.result_count())
        .expect("store readable after kill");
    assert!(settled_before < n as u64, "the kill landed mid-run");

    let status = batch_cmd(&input, &output, &sim.base_url(), 32)
        .status()
        .expect("resumes");
    assert!(status.success(), "{status:?}");
    let out = read_output(&output);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for v in &out {
        *seen
            .entry(v["custom_id"].as_str().expect("id").to_owned())
            .or_default() += 1;
        assert_eq!(v["response"]["status_code"], 200, "{v}");
    }
    assert_eq!(seen.len(), n);
    assert!(seen.values().all(|c| *c == 1));
    // Lines settled before the kill were not sent again: the pool served at
    // most the batch plus what was in flight at the kill (8).
    let served = completed_requests(&sim.base_url()).await;
    assert!(served <= (n + 8) as f64, "served {served}");
}

#[tokio::test(flavor = "multi_thread")]
async fn second_runner_on_one_state_dir_and_changed_input_are_refused() {
    let tmp = support::TempDir::new("batch-locked");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    std::fs::write(&input, openai_line(0, 4)).expect("input");
    let state = dir.join("out.jsonl.state");
    std::fs::create_dir_all(&state).expect("state");
    let lock = sluicegate::queue::embedded::OwnerLock::acquire(&state.join("queue.db"))
        .expect("first owner");
    let out = batch_cmd(&input, &output, "http://127.0.0.1:9", 1)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("in use by another sluicegate process"),
        "{stderr}"
    );
    drop(lock);

    // First run against a dead gateway, interrupted by nothing: it imports,
    // then we change the input and the resume is refused.
    let store = EmbeddedQueue::open(state.join("queue.db"), "batch").expect("open");
    store
        .enqueue_with_deadlines(&[], &[("batch.input_fingerprint", "0:0")])
        .expect("mark");
    let out = batch_cmd(&input, &output, "http://127.0.0.1:9", 1)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("belongs to a different input file"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ctrl_c_writes_partial_output_exits_130_and_the_rerun_completes() {
    let sim = spawn_http(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-sigint");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    let n = 100;
    let lines: Vec<String> = (0..n).map(|i| openai_line(i, 64)).collect();
    std::fs::write(&input, lines.join("\n")).expect("input");
    let child = batch_cmd(&input, &output, &sim.base_url(), 4)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let db = dir.join("out.jsonl.state").join("queue.db");
    let give_up = Instant::now() + Duration::from_secs(30);
    while !db.exists()
        || EmbeddedQueue::open(&db, "batch")
            .and_then(|q| q.result_count())
            .unwrap_or(0)
            < 5
    {
        assert!(Instant::now() < give_up, "no progress before Ctrl-C");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().expect("exits");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("re-run the same command to resume"),
        "{stderr}"
    );
    let partial = read_output(&output);
    assert!(
        !partial.is_empty() && partial.len() < n,
        "{}",
        partial.len()
    );

    let status = batch_cmd(&input, &output, &sim.base_url(), 32)
        .status()
        .expect("resumes");
    assert!(status.success());
    let out = read_output(&output);
    let mut ids: Vec<&str> = out
        .iter()
        .map(|v| v["custom_id"].as_str().expect("id"))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!((out.len(), ids.len()), (n, n));
}

/// vLLM's typed reader of batch output wants a string `custom_id` and a
/// string `request_id`; OpenAI's error codes stand where one exists.
#[tokio::test(flavor = "multi_thread")]
async fn output_lines_are_readable_by_openai_and_vllm_readers() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-compat");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    let lines = [
        openai_line(0, 4),
        "this is not json".to_owned(),
        // A deadline long past: it expires before it can be sent.
        r#"{"id":"expired","deadline":1,"payload":{"model":"m","prompt":"hi","max_tokens":4},"endpoint":"/v1/completions"}"#.to_owned(),
        openai_line(1, 4),
    ];
    std::fs::write(&input, lines.join("\n")).expect("input");
    let status = batch_cmd(&input, &output, &sim.base_url(), 4)
        .status()
        .expect("runs");
    assert!(status.success(), "{status:?}");
    let out = read_output(&output);
    assert_eq!(out.len(), 4);
    for v in &out {
        assert!(v["custom_id"].is_string(), "{v}");
        assert!(v["id"].is_string(), "{v}");
        if !v["response"].is_null() {
            let custom_id = v["custom_id"].as_str().expect("custom_id");
            let request_id = v["response"]["request_id"].as_str().expect("request_id");
            assert!(request_id.starts_with(&format!("{custom_id}#")), "{v}");
        }
    }
    // The unparsable line: the line-number form, and its message says so.
    assert_eq!(out[1]["custom_id"], "invalid-line-2");
    let message = out[1]["error"]["message"].as_str().expect("message");
    assert!(message.contains("invalid-line-2"), "{message}");
    // The expired line: OpenAI's code, the llm-d code kept beside it.
    assert_eq!(out[2]["custom_id"], "expired");
    assert_eq!(out[2]["error"]["code"], "batch_expired", "{}", out[2]);
    assert_eq!(out[2]["error"]["llm_d_code"], "DEADLINE_EXCEEDED");
}

/// A `local-max-concurrency` batch at its limit is running as fast as it
/// may: its status says "window full", never "gate closed" (issue 16).
#[tokio::test(flavor = "multi_thread")]
async fn local_limit_at_capacity_reports_window_full_not_gate_closed() {
    let sim = spawn_http(SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-window-full");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    // About 8 s at 4 in flight on the calibrated simulator (64 lines took
    // 4.3 s): long enough for a live progress line, which is printed every
    // 5 s when stderr is not a terminal.
    let lines: Vec<String> = (0..128).map(|i| openai_line(i, 32)).collect();
    std::fs::write(&input, lines.join("\n")).expect("input");
    let out = Command::new(BIN)
        .args(["batch", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .args(["--gateway", &sim.base_url()])
        .args(["--gate", "local-max-concurrency"])
        .args([
            "--gate-params",
            r#"{"limit": 4, "gating_mode": "blocking"}"#,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(read_output(&output).len(), 128);
    let states = stderr
        .lines()
        .find(|l| l.contains("time by state:"))
        .unwrap_or_else(|| panic!("no state line in:\n{stderr}"));
    assert!(states.contains("window full"), "{stderr}");
    assert!(!stderr.contains("gate closed"), "{stderr}");
    // The live progress line shows the window, and no D for a local limit.
    let progress = stderr
        .lines()
        .find(|l| l.starts_with("progress:"))
        .unwrap_or_else(|| panic!("no progress line in:\n{stderr}"));
    assert!(
        (progress.contains("window full") || progress.contains("sending"))
            && progress.contains(" in flight"),
        "{progress}"
    );
    assert!(!progress.contains("D="), "{progress}");
}

/// vLLM's pooling endpoints through `sluicegate batch --endpoints`: each
/// runs against the simulator and is answered in vLLM's shape; a line for
/// an endpoint not listed, or a rerank line without documents, is answered
/// `invalid_request` without being sent.
#[tokio::test(flavor = "multi_thread")]
async fn configured_endpoints_run_vllms_pooling_endpoints_and_refuse_the_rest() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("batch-endpoints");
    let input = tmp.0.join("in.jsonl");
    let output = tmp.0.join("out.jsonl");
    let line = |id: &str, url: &str, body: Value| {
        serde_json::json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string()
    };
    let lines = [
        line(
            "rerank",
            "/v1/rerank",
            serde_json::json!({"model": "sim-model", "query": "fox", "documents": ["a quick fox", "a lazy dog", "fox news"], "top_n": 2}),
        ),
        line(
            "score",
            "/v1/score",
            serde_json::json!({"model": "sim-model", "text_1": "fox", "text_2": ["a quick fox", "a dog"]}),
        ),
        line(
            "classify",
            "/classify",
            serde_json::json!({"model": "sim-model", "input": ["good", "bad", "ugly"]}),
        ),
        line(
            "pooling",
            "/pooling",
            serde_json::json!({"model": "sim-model", "input": "pool me"}),
        ),
        line(
            "not-listed",
            "/v1/completions",
            serde_json::json!({"model": "sim-model", "prompt": "hi"}),
        ),
        line(
            "no-documents",
            "/v1/rerank",
            serde_json::json!({"model": "sim-model", "query": "fox"}),
        ),
    ];
    std::fs::write(&input, lines.join("\n")).expect("input");
    let status = batch_cmd(&input, &output, &sim.base_url(), 4)
        .args(["--endpoints", "/v1/rerank,/v1/score,/classify,/pooling"])
        .status()
        .expect("runs");
    assert!(status.success(), "{status:?}");
    let out: HashMap<String, Value> = read_output(&output)
        .into_iter()
        .map(|v| (v["custom_id"].as_str().expect("id").to_owned(), v))
        .collect();
    assert_eq!(out.len(), 6);
    let body = |id: &str| {
        assert_eq!(out[id]["response"]["status_code"], 200, "{}", out[id]);
        out[id]["response"]["body"].clone()
    };
    let rerank = body("rerank");
    let results = rerank["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "top_n: {rerank}");
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    assert_eq!(body("score")["data"].as_array().map(Vec::len), Some(2));
    let classify = body("classify");
    assert_eq!(classify["data"].as_array().map(Vec::len), Some(3));
    assert_eq!(classify["data"][0]["num_classes"], 2);
    assert_eq!(body("pooling")["data"][0]["object"], "pooling");
    for (id, says) in [
        ("not-listed", "endpoint /v1/completions is not served here"),
        ("no-documents", "body.documents is required"),
    ] {
        let message = out[id]["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{id}: {}", out[id]);
        assert!(out[id]["response"].is_null(), "{id} was sent: {}", out[id]);
    }
    // Four requests reached the engine; the refused lines did not.
    assert_eq!(completed_requests(&sim.base_url()).await, 4.0);
    let bad = batch_cmd(&input, &tmp.0.join("bad.jsonl"), &sim.base_url(), 4)
        .args(["--endpoints", "v1/rerank"])
        .output()
        .expect("runs");
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--endpoints: `v1/rerank` is not a path"),
        "{err}"
    );
}
