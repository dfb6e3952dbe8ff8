//! Traces end to end: the `sluicegate` binary, with an OTLP endpoint in its
//! environment, drains messages into the pool simulator and exports
//! `receive`, `admit`, `send` and `settle` spans to a real OTLP/HTTP
//! receiver that decodes them; without the variable it sends nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::support::TempDir;
use crate::support::otlp::{OtlpReceiver, ReceivedSpan};
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// Two messages: `traced` carries a sampled `traceparent`, `plain` none.
fn write_input(path: &Path) {
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let payload = serde_json::json!({"model": "m", "prompt": "Summarise.", "max_tokens": 8});
    let lines = [
        serde_json::json!({"id": "traced", "deadline": deadline, "payload": payload,
            "metadata": {"traceparent": format!("00-{TRACE_ID}-{PARENT_ID}-01")}}),
        serde_json::json!({"id": "plain", "deadline": deadline, "payload": payload}),
    ];
    let text: Vec<String> = lines.iter().map(ToString::to_string).collect();
    std::fs::write(path, text.join("\n")).unwrap();
}

/// `sluicegate run --exit-when-done` on the memory transport, configured by
/// the environment alone, plus `extra` variables.
async fn run(gateway: &str, dir: &Path, extra: &[(&str, &str)]) -> Output {
    let input = dir.join("requests.jsonl");
    let output = dir.join("results.jsonl");
    write_input(&input);
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_QUEUE", "batch")
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_GATE_TYPE", "local-max-concurrency")
        .env("SLUICEGATE_GATE_PARAMS", r#"{"limit":"4"}"#)
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .envs(extra.iter().copied())
        .args(["run", "--exit-when-done", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output);
    tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap()
}

fn named<'a>(spans: &'a [ReceivedSpan], trace_id: &str, name: &str) -> &'a ReceivedSpan {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.trace_id == trace_id && s.name == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one `{name}` span in trace {trace_id}: {spans:#?}"
    );
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_receive_admit_send_settle_spans_continuing_the_traceparent() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let receiver = OtlpReceiver::start().await;
    let dir = TempDir::new("traces");
    let done = run(
        &sim.base_url(),
        &dir.0,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
            ("OTEL_SERVICE_NAME", "sluicegate-test"),
        ],
    )
    .await;
    assert!(
        done.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    // Exported before exit: the process has ended, so nothing more comes.
    let spans = receiver.spans();

    let receive = named(&spans, TRACE_ID, "receive");
    assert_eq!(
        receive.parent_span_id, PARENT_ID,
        "continues the traceparent"
    );
    assert_eq!(receive.attr("sluicegate.queue"), Some("batch"));
    assert_eq!(receive.attr("sluicegate.request.id"), Some("traced"));
    assert_eq!(receive.attr("sluicegate.delivery.retry_count"), Some("0"));
    assert_eq!(receive.service_name.as_deref(), Some("sluicegate-test"));

    let admit = named(&spans, TRACE_ID, "admit");
    assert_eq!(admit.parent_span_id, receive.span_id);
    assert_eq!(admit.attr("sluicegate.gate.verdict"), Some("continue"));
    assert_eq!(admit.attr("sluicegate.gate.reason"), Some("admitted"));
    for key in [
        "sluicegate.gate.budget",
        "sluicegate.gate.baseline",
        "sluicegate.window.available",
        "sluicegate.window.in_flight",
    ] {
        let value = admit.attr(key).unwrap_or_else(|| panic!("{key} on admit"));
        assert!(value.parse::<f64>().is_ok(), "{key} = {value}");
    }

    let send = named(&spans, TRACE_ID, "send");
    assert_eq!(send.parent_span_id, receive.span_id);
    assert_eq!(send.attr("sluicegate.attempt"), Some("1"));
    assert_eq!(send.attr("http.response.status_code"), Some("200"));
    assert_eq!(send.attr("sluicegate.attempt.outcome"), Some("success"));

    let settle = named(&spans, TRACE_ID, "settle");
    assert_eq!(settle.parent_span_id, receive.span_id);
    assert_eq!(settle.attr("sluicegate.result.outcome"), Some("success"));
    assert_eq!(settle.attr("http.response.status_code"), Some("200"));
    assert_eq!(settle.attr("sluicegate.ack"), Some("written"));

    // The message without a traceparent gets a trace of its own.
    let plain: Vec<_> = spans
        .iter()
        .filter(|s| s.attr("sluicegate.request.id") == Some("plain"))
        .collect();
    let plain_receive = plain
        .iter()
        .find(|s| s.name == "receive")
        .expect("receive span of the plain message");
    assert_ne!(plain_receive.trace_id, TRACE_ID);
    assert_eq!(plain_receive.parent_span_id, "", "a new trace");
    for name in ["admit", "send", "settle"] {
        let span = named(&spans, &plain_receive.trace_id, name);
        assert_eq!(span.parent_span_id, plain_receive.span_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_nothing_without_an_otlp_endpoint() {
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let receiver = OtlpReceiver::start().await;
    let dir = TempDir::new("traces-off");
    // The receiver's address is in the environment, but under no OTEL
    // endpoint variable.
    let done = run(
        &sim.base_url(),
        &dir.0,
        &[
            ("OTEL_SERVICE_NAME", "sluicegate-test"),
            ("UNRELATED_ENDPOINT", receiver.endpoint.as_str()),
        ],
    )
    .await;
    assert!(
        done.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let results = std::fs::read_to_string(dir.0.join("results.jsonl")).unwrap();
    assert_eq!(
        results.lines().count(),
        2,
        "both messages were sent: {results}"
    );
    assert_eq!(receiver.requests(), 0);
    assert!(receiver.spans().is_empty());
}

#[tokio::test]
async fn refuses_an_otlp_protocol_other_than_http_protobuf_at_startup() {
    let receiver = OtlpReceiver::start().await;
    let dir = TempDir::new("traces-grpc");
    let done = run(
        "http://127.0.0.1:9",
        &dir.0,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
    )
    .await;
    assert_eq!(done.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && stderr.contains("http/protobuf"),
        "{stderr}"
    );
    assert_eq!(receiver.requests(), 0);
}
