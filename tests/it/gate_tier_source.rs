//! `tier-priority-admission` in upstream PR #186's `source` shape against a
//! real `redis-server`: `source = redis-counter` counts in-flight requests
//! in `<key_prefix>:inflight:<bucket>` against `<key_prefix>:cap:<bucket>`
//! (else `fallback_cap`), gives a slot back when its request ends, and
//! counts an unreachable Redis as saturated; a dropped message's result
//! carries `fail_fast_body`. `source = prometheus` against a stand-in
//! Prometheus HTTP API (wiremock): saturated at or above `threshold`, and
//! on an error or no sample (fail closed). Also the other PR #186 gate whose verdict
//! ends a message, `deadline-drop`, end to end: a deadline that cannot be
//! met is answered `DEADLINE_EXCEEDED` without reaching the gateway.

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

const INFLIGHT: &str = "rmp:inflight:pool:groq";
const CAP: &str = "rmp:cap:pool:groq";

fn build(params: serde_json::Value) -> Box<dyn DispatchGate> {
    let spec = GateSpec::parse("tier-priority-admission", &params, "q").expect("valid params");
    let ctx = GateContext::new(None, None, Duration::ZERO, Duration::from_secs(2));
    build_gate(&spec, &ctx).expect("builds")
}

fn counter(server: &RedisServer) -> Box<dyn DispatchGate> {
    build(json!({
        "source": "redis-counter",
        "address": format!("127.0.0.1:{}", server.port),
        "bucket": "pool:groq",
        "ttl_seconds": 600,
    }))
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn admit(gate: &dyn DispatchGate, l: &[(&str, &str)]) -> Admission {
    let empty = BTreeMap::new();
    let l = labels(l);
    gate.admit(AdmissionRequest::new("r", &empty, &l)).await
}

fn shape(a: &Admission) -> (&'static str, &'static str) {
    (a.verdict_label(), a.reason_label())
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_counter_caps_in_flight_and_gives_slots_back() {
    let server = RedisServer::start();
    let gate = counter(&server);
    // No cap key and fallback_cap 0: saturated from the start.
    let cases = [
        (
            &[("tier", "batch"), ("class", "reserved")][..],
            ("wait", "saturated_reserved"),
        ),
        (
            &[("tier", "interactive")][..],
            ("drop", "saturated_interactive_overflow"),
        ),
        (
            &[("tier", "batch"), ("class", "overflow")][..],
            ("refuse", "saturated_overflow"),
        ),
    ];
    for (l, want) in &cases {
        assert_eq!(shape(&admit(gate.as_ref(), l).await), *want, "{l:?}");
    }
    // Refused attempts take nothing.
    assert_eq!(server.int(&["GET", INFLIGHT]), 0);

    server.cli(&["SET", CAP, "2"]);
    let a = admit(gate.as_ref(), &[("tier", "batch")]).await;
    let b = admit(gate.as_ref(), &[("tier", "interactive")]).await;
    assert_eq!(shape(&a), ("continue", "admitted"));
    assert_eq!(shape(&b), ("continue", "admitted"));
    assert_eq!(server.int(&["GET", INFLIGHT]), 2);
    let ttl = server.int(&["TTL", INFLIGHT]);
    assert!(ttl > 0 && ttl <= 600, "the counter expires: {ttl}");
    for (l, want) in &cases {
        assert_eq!(
            shape(&admit(gate.as_ref(), l).await),
            *want,
            "at the cap, {l:?}"
        );
    }
    assert_eq!(server.int(&["GET", INFLIGHT]), 2);

    // A request ends: its slot comes back, and the next message goes.
    drop(a);
    support::wait_until(Duration::from_secs(10), "slot given back", || {
        server.int(&["GET", INFLIGHT]) == 1
    })
    .await;
    let c = admit(gate.as_ref(), &[("tier", "batch")]).await;
    assert_eq!(shape(&c), ("continue", "admitted"));
    assert_eq!(server.int(&["GET", INFLIGHT]), 2);
    drop((b, c));
    support::wait_until(Duration::from_secs(10), "all slots given back", || {
        server.int(&["GET", INFLIGHT]) == 0
    })
    .await;

    // The probe reads the counter without taking a slot.
    let e = gate.explain().await;
    assert_eq!(
        e.sources[0].values,
        vec![("in flight".to_owned(), 0.0), ("cap".to_owned(), 2.0)]
    );
    assert_eq!(server.int(&["GET", INFLIGHT]), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn fallback_cap_prefix_and_an_unreachable_redis() {
    let server = RedisServer::start();
    let gate = build(json!({
        "source": "redis-counter",
        "address": format!("127.0.0.1:{}", server.port),
        "bucket": "b1",
        "key_prefix": "lanes",
        "fallback_cap": 1,
    }));
    let held = admit(gate.as_ref(), &[("tier", "batch")]).await;
    assert_eq!(shape(&held), ("continue", "admitted"));
    assert_eq!(server.int(&["GET", "lanes:inflight:b1"]), 1);
    // Upstream's default TTL: a day.
    let ttl = server.int(&["TTL", "lanes:inflight:b1"]);
    assert!(ttl > 86_000 && ttl <= 86_400, "{ttl}");
    assert_eq!(
        shape(&admit(gate.as_ref(), &[("tier", "batch")]).await),
        ("refuse", "saturated_overflow")
    );
    // The cap key wins over the fallback.
    server.cli(&["SET", "lanes:cap:b1", "2"]);
    assert_eq!(
        shape(&admit(gate.as_ref(), &[("tier", "batch")]).await),
        ("continue", "admitted")
    );

    // Nothing listening: saturated (upstream admits), never an open gate.
    let (_refusing, port) = support::refused_port();
    let down = build(json!({
        "source": "redis-counter",
        "address": format!("127.0.0.1:{port}"),
        "bucket": "b1",
        "fallback_cap": 100,
    }));
    assert_eq!(
        shape(&admit(down.as_ref(), &[("tier", "interactive")]).await),
        ("drop", "saturated_interactive_overflow")
    );
    assert_eq!(
        shape(&admit(down.as_ref(), &[("tier", "batch")]).await),
        ("refuse", "saturated_overflow")
    );
}

/// End to end: a message dropped at saturation ends with a `GATE_DROPPED`
/// result whose payload is `fail_fast_body`, and never reaches the gateway.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_message_carries_the_fail_fast_body() {
    let server = RedisServer::start();
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
source = "redis-counter"
address = "127.0.0.1:{}"
bucket = "pool:full"
fail_fast_status = 503
fail_fast_body = '{{"error":"try later"}}'"#,
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
    assert_eq!(r["payload"], r#"{"error":"try later"}"#);
    assert!(seen(&arrivals).is_empty(), "never sent");
}

/// End to end: `deadline-drop` first in a composite answers a message whose
/// deadline is less than `min_remaining` away with `DEADLINE_EXCEEDED` (as
/// the deadline sweep would), never sent; a message with time enough goes.
#[tokio::test(flavor = "multi_thread")]
async fn deadline_drop_answers_an_unreachable_deadline() {
    let server = RedisServer::start();
    let (gateway, arrivals) = recording_gateway(Duration::ZERO).await;
    let toml = support::redis::fast_app_toml(
        &gateway.uri(),
        "",
        r#"queue_name = "dlq"
result_queue_name = "dlq-results"
gate_type = "composite"
gate_params = { gates = [
  { gate_type = "deadline-drop", gate_params = { min_remaining = "1h" } },
  { gate_type = "local-rate-limit", gate_params = { requests_per_minute = 6000, burst = 10 } },
] }"#,
    );
    let mut config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    config.redis = Some(redis_config(&server));
    let app = support::start_app(&config).await;
    submit(
        &server,
        "dlq",
        &[
            tenant_line("too-late", "erin", unix_secs() + 600),
            tenant_line("in-time", "erin", unix_secs() + 7200),
        ],
    )
    .await;
    let results = server.wait_for_len("dlq-results", 2).await;
    app.stop().await;
    let by_id = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}: {results:?}"))
            .clone()
    };
    let late = by_id("too-late");
    assert_eq!(late["error_code"], "DEADLINE_EXCEEDED", "{late}");
    assert!(
        late.get("status_code").is_none_or(|s| s.is_null()),
        "{late}"
    );
    let sent = by_id("in-time");
    assert_eq!(sent["status_code"], 200, "{sent}");
    assert_eq!(
        seen(&arrivals).len(),
        1,
        "only the message with time enough was sent"
    );
}

/// A Prometheus instant-query answer with one sample per value.
fn vector(values: &[&str]) -> wiremock::ResponseTemplate {
    wiremock::ResponseTemplate::new(200).set_body_json(json!({"status": "success", "data": {
        "resultType": "vector",
        "result": values.iter().enumerate()
            .map(|(i, v)| json!({"metric": {"i": i.to_string()}, "value": [1.7e9, v]}))
            .collect::<Vec<_>>()
    }}))
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_source_compares_the_largest_value_with_the_threshold() {
    use wiremock::matchers::{method, path, query_param};
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let prom = MockServer::start().await;
    for (query, answer) in [
        ("low", vector(&["0.2", "0.4"])),
        ("high", vector(&["0.2", "0.8"])),
        ("at", vector(&["0.5"])),
        ("none", vector(&[])),
        ("broken", ResponseTemplate::new(500)),
    ] {
        Mock::given(method("GET"))
            .and(path("/api/v1/query"))
            .and(query_param("query", query))
            .respond_with(answer)
            .mount(&prom)
            .await;
    }
    let gate = |query: &str| {
        // `url` given: no `[prometheus]` needed.
        build(json!({
            "source": "prometheus", "url": prom.uri(), "query": query,
            "threshold": 0.5, "refresh_interval_ms": 1, "stale_after_ms": 5000,
        }))
    };
    let low = gate("low");
    assert_eq!(
        shape(&admit(low.as_ref(), &[("tier", "interactive")]).await),
        ("continue", "admitted")
    );
    for q in ["high", "at", "none", "broken"] {
        let g = gate(q);
        assert_eq!(
            shape(&admit(g.as_ref(), &[("tier", "interactive")]).await),
            ("drop", "saturated_interactive_overflow"),
            "{q}"
        );
        assert_eq!(
            shape(&admit(g.as_ref(), &[("tier", "batch"), ("class", "reserved")]).await),
            ("wait", "saturated_reserved"),
            "{q}"
        );
    }
    let e = gate("high").explain().await;
    assert_eq!(e.sources[0].target, "high");
    assert_eq!(e.sources[0].values.len(), 2);
    assert!(
        e.sources[0].outcome.contains("saturated"),
        "{:?}",
        e.sources
    );
    assert!(
        e.notes.iter().any(|n| n.contains("saturated")),
        "{:?}",
        e.notes
    );
}
