//! `tier-priority-admission` verdicts, built from config against a real
//! `redis-server` whose budget key is the saturation signal: admitted when
//! not saturated; when saturated reserved waits, interactive overflow is
//! dropped, other overflow refused; an unreadable signal counts as
//! saturated; a `redis-quota` before it in a composite classifies; and the
//! drop ends the message with a typed `GATE_DROPPED` result.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::redis::RedisServer;
use crate::support::redis::{redis_config, submit};
use crate::support::tenants::{recording_gateway, seen, tenant_line};
use serde_json::json;
use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, GateSpec};
use sluicegate::gate::{Admission, AdmissionRequest, DispatchGate, GateContext, build_gate};

/// The saturation gate: the `redis` budget key `budget` (budget 0 =
/// saturated), read fresh on every call.
fn saturation(server: &RedisServer) -> serde_json::Value {
    json!({"gate_type": "redis", "gate_params": {
        "address": format!("127.0.0.1:{}", server.port), "budget_key": "budget"}})
}

fn build(gate_type: &str, params: serde_json::Value) -> Box<dyn DispatchGate> {
    let spec = GateSpec::parse(gate_type, &params, "q").expect("valid params");
    // No caching: each admission reads the key again.
    let ctx = GateContext::new(None, None, Duration::ZERO, Duration::from_secs(10));
    build_gate(&spec, &ctx).expect("builds")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn verdict(
    gate: &dyn DispatchGate,
    user: &str,
    labels: &BTreeMap<String, String>,
) -> Admission {
    let metadata = BTreeMap::from([("userid".to_owned(), user.to_owned())]);
    gate.admit(AdmissionRequest::new("r", &metadata, labels))
        .await
}

/// Sets the budget key and lets the gate see it: the cache serves the
/// previous reading while it refreshes, so one read is made and awaited.
async fn set_budget(server: &RedisServer, gate: &dyn DispatchGate, value: &str) {
    server.cli(&["SET", "budget", value]);
    let _ = verdict(gate, "probe", &BTreeMap::new()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// Message labels and the verdict and reason expected at saturation.
type Case = (
    &'static [(&'static str, &'static str)],
    (&'static str, &'static str),
);

fn shape(a: &Admission) -> (&'static str, &'static str) {
    (a.verdict_label(), a.reason_label())
}

#[tokio::test(flavor = "multi_thread")]
async fn verdicts_by_saturation_tier_and_classification() {
    let server = RedisServer::start();
    let gate = build(
        "tier-priority-admission",
        json!({"saturation_gate": saturation(&server), "tier_label": "tier"}),
    );
    let cases: [Case; 6] = [
        (
            &[("tier", "batch"), ("classification", "reserved")],
            ("wait", "saturated_reserved"),
        ),
        (
            &[("tier", "interactive"), ("classification", "reserved")],
            ("wait", "saturated_reserved"),
        ),
        (
            &[("tier", "interactive"), ("classification", "overflow")],
            ("drop", "saturated_interactive_overflow"),
        ),
        // No classification holds no reservation: overflow.
        (
            &[("tier", "interactive")],
            ("drop", "saturated_interactive_overflow"),
        ),
        (
            &[("tier", "batch"), ("classification", "overflow")],
            ("refuse", "saturated_overflow"),
        ),
        (&[], ("refuse", "saturated_overflow")),
    ];
    // Unreadable (no key yet) counts as saturated: fail closed.
    for (l, want) in &cases {
        let v = verdict(gate.as_ref(), "u", &labels(l)).await;
        assert_eq!(shape(&v), *want, "unreadable, labels {l:?}");
    }
    set_budget(&server, gate.as_ref(), "0").await;
    for (l, want) in &cases {
        let v = verdict(gate.as_ref(), "u", &labels(l)).await;
        assert_eq!(shape(&v), *want, "saturated, labels {l:?}");
    }
    // Not saturated: everyone goes.
    set_budget(&server, gate.as_ref(), "0.5").await;
    for (l, _) in &cases {
        let v = verdict(gate.as_ref(), "u", &labels(l)).await;
        assert_eq!(shape(&v), ("continue", "admitted"), "open, labels {l:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quota_gate_before_it_classifies_the_message() {
    let server = RedisServer::start();
    let gate = build(
        "composite",
        json!({"gates": [
            {"gate_type": "redis-quota", "gate_params": {
                "address": format!("127.0.0.1:{}", server.port),
                "limit": 1, "admit_overflow": true}},
            {"gate_type": "tier-priority-admission", "gate_params": {
                "saturation_gate": saturation(&server)}},
        ]}),
    );
    set_budget(&server, gate.as_ref(), "0").await;
    let interactive = labels(&[("tier", "interactive")]);
    // Within quota: reserved, so it waits for room even at saturation,
    // and asking again does not spend the quota (the admission was given
    // back with the wait).
    for _ in 0..3 {
        let first = verdict(gate.as_ref(), "dana", &interactive).await;
        assert_eq!(shape(&first), ("wait", "saturated_reserved"));
        support::wait_until(Duration::from_secs(5), "admission given back", || {
            server.int(&["ZCARD", "quota:userid:dana"]) == 0
        })
        .await;
    }
    // Sent once (the pool had room), the admission counts: dana is then
    // over quota.
    set_budget(&server, gate.as_ref(), "1").await;
    let sent = verdict(gate.as_ref(), "dana", &interactive).await;
    assert_eq!(shape(&sent), ("continue", "admitted"));
    drop(sent);
    assert_eq!(server.int(&["ZCARD", "quota:userid:dana"]), 1);
    set_budget(&server, gate.as_ref(), "0").await;
    let second = verdict(gate.as_ref(), "dana", &interactive).await;
    assert_eq!(shape(&second), ("drop", "saturated_interactive_overflow"));
    let batch = verdict(gate.as_ref(), "dana", &labels(&[("tier", "batch")])).await;
    assert_eq!(shape(&batch), ("refuse", "saturated_overflow"));
    // Spare capacity: overflow goes too.
    set_budget(&server, gate.as_ref(), "1").await;
    let spare = verdict(gate.as_ref(), "dana", &interactive).await;
    assert_eq!(shape(&spare), ("continue", "admitted"));
}

/// End to end: an interactive message dropped at saturation is answered
/// with a `GATE_DROPPED` result (no `status_code`: the gateway was never
/// asked) and never reaches the gateway.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_message_gets_a_typed_gate_dropped_result() {
    let server = RedisServer::start();
    server.cli(&["SET", "budget", "0"]);
    let (gateway, arrivals) = recording_gateway(Duration::ZERO).await;
    let toml = support::redis::fast_app_toml(
        &gateway.uri(),
        "",
        &format!(
            r#"queue_name = "tierq"
result_queue_name = "tierq-results"
labels = {{ tier = "interactive" }}
gate_type = "tier-priority-admission"
[queue.gate_params]
saturation_gate = "redis"
saturation_gate_params = {{ address = "127.0.0.1:{}", budget_key = "budget" }}"#,
            server.port
        ),
    );
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis_config(&server));
    let app = support::start_app(&config).await;
    submit(
        &server,
        "tierq",
        &[tenant_line("drop-me", "erin", unix_secs() + 600)],
    )
    .await;
    let results = server.wait_for_len("tierq-results", 1).await;
    app.stop().await;
    let r = &results[0];
    assert_eq!(r["id"], "drop-me");
    assert_eq!(r["error_code"], "GATE_DROPPED");
    assert_eq!(r["error_message"], "saturated_interactive_overflow");
    assert!(r.get("status_code").is_none_or(|s| s.is_null()), "{r}");
    let payload: serde_json::Value =
        serde_json::from_str(r["payload"].as_str().expect("payload string")).expect("JSON");
    assert_eq!(payload["error"], "saturated_interactive_overflow");
    assert!(seen(&arrivals).is_empty());
}
