//! Gate configuration: every example config in `config/` builds its gates
//! (the loader test parses them), and `GateSpec::parse` reads the upstream
//! shape, collecting every error under its full key.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use serde_json::{Map, Value, json};
use sluicegate::config::{
    Config, ConfigErrors, ConfigSources, GATE_TYPES, GateSpec, GatingMode, MissingBudget,
    allowed_params,
};
use sluicegate::gate::{
    CompositeParams, GateContext, LocalMaxConcurrencyParams, PrometheusBudgetParams, RedisParams,
    build_gate,
};

#[tokio::test]
async fn every_example_gate_builds() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut kinds = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let config = Config::load(&ConfigSources {
            file: Some(path.clone()),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let ctx = GateContext::from_config(&config);
        for q in &config.queues {
            let gate =
                build_gate(&q.gate, &ctx).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            kinds.push(gate.kind());
        }
    }
    for kind in [
        "prometheus-budget",
        "prometheus-saturation",
        "prometheus-query",
        "endpoint-scrape",
        "redis",
        "vllm",
        "feedback",
        "slo-headroom",
    ] {
        assert!(kinds.contains(&kind), "no example config for {kind}");
    }
}

fn params_map(spec: &GateSpec) -> Map<String, Value> {
    match spec.to_upstream().get("gate_params") {
        Some(Value::Object(p)) => p.clone(),
        _ => Map::new(),
    }
}

fn parse(t: &str, p: Value) -> Result<GateSpec, ConfigErrors> {
    GateSpec::parse(t, &p, "queue[0]")
}

fn sample_params(t: &str) -> Value {
    match t {
        "constant" => json!({}),
        "composite" => json!({"gates": [{"gate_type": "constant", "gate_params": {}}]}),
        "local-max-concurrency" => json!({"limit": 4}),
        "wait-on-refuse" => json!({"gate": {"gate_type": "constant"}}),
        "redis" => json!({"address": "127.0.0.1:6379"}),
        "prometheus-saturation" | "prometheus-budget" => json!({"pool": "p"}),
        "prometheus-query" => json!({"query": "1 - up"}),
        "endpoint-scrape" => json!({"url": "http://127.0.0.1:9000/metrics", "metric": "m"}),
        "redis-quota" => json!({"address": "127.0.0.1:6379", "limit": "10"}),
        "sql-quota" => json!({"limit": "10", "mode": "concurrency"}),
        "tier-priority-admission" => {
            json!({"saturation_gate": "prometheus-saturation", "saturation_gate_params": {"pool": "p"}})
        }
        "vllm" => json!({"urls": ["http://127.0.0.1:8000/metrics"]}),
        "feedback" => json!({
            "urls": ["http://127.0.0.1:8000/metrics"],
            "labels": {"model_name": "chat"},
            "setpoint": {"horizon": "20s"}
        }),
        "slo-headroom" => json!({"urls": "http://127.0.0.1:8000/metrics", "horizon": "5s"}),
        "redis-leased-rate" => json!({"address": "127.0.0.1:6379", "control_key": "drain"}),
        "local-rate-limit" => json!({"requests_per_minute": "600", "burst": 10}),
        "deadline-drop" => json!({}),
        "constant-decision" => json!({"decision": "refuse"}),
        other => panic!("no sample for {other}"),
    }
}

#[test]
fn every_gate_type_builds_and_round_trips() {
    for t in GATE_TYPES {
        let spec = parse(t, sample_params(t)).unwrap_or_else(|e| panic!("{t}: {e}"));
        assert_eq!(spec.upstream_name(), *t);
        let again =
            parse(t, params_map(&spec).into()).unwrap_or_else(|e| panic!("{t} round trip: {e}"));
        assert_eq!(spec, again, "{t}");
        let via_serde: GateSpec = serde_json::from_value(spec.to_upstream())
            .unwrap_or_else(|e| panic!("{t} serde round trip: {e}"));
        assert_eq!(spec, via_serde, "{t}");
        let allowed = allowed_params(t).unwrap_or_else(|| panic!("{t}"));
        for k in params_map(&spec).keys() {
            assert!(allowed.contains(&k.as_str()), "{t} renders unlisted {k}");
        }
    }
}

#[test]
fn prometheus_budget_accepts_strings_and_numbers_with_defaults() {
    let spec = parse(
        "prometheus-budget",
        json!({"pool": "p", "baseline": "0.1", "max_concurrency": 10}),
    )
    .expect("valid");
    assert_eq!(
        spec,
        GateSpec::PrometheusBudget(PrometheusBudgetParams {
            pool: "p".into(),
            namespace: None,
            max_concurrency: 10.0,
            baseline: 0.1,
            fallback: None,
        })
    );
}

#[test]
fn unknown_gate_type_lists_allowed_types() {
    let err = parse("prometheus-budgt", json!({}))
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("queue[0].gate_type"), "{err}");
    assert!(err.contains("prometheus-budget, prometheus-query"), "{err}");
}

#[test]
fn unknown_param_lists_allowed_params() {
    let err = parse("prometheus-budget", json!({"pool": "p", "basline": 0.1}))
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("queue[0].gate_params.basline"), "{err}");
    assert!(
        err.contains("pool, namespace, max_concurrency, baseline, fallback"),
        "{err}"
    );
}

#[test]
fn collects_all_parameter_errors() {
    let errs = parse(
        "prometheus-budget",
        json!({"baseline": 1.5, "max_concurrency": 0, "fallback": "x"}),
    )
    .expect_err("invalid");
    let text = errs.to_string();
    assert_eq!(errs.len(), 4, "{text}");
    assert!(
        text.contains("gate_params.pool: required parameter"),
        "{text}"
    );
    assert!(
        text.contains("gate_params.baseline: must be in [0, 1], got 1.5"),
        "{text}"
    );
    assert!(
        text.contains("gate_params.max_concurrency: must be greater than 0"),
        "{text}"
    );
    assert!(
        text.contains("gate_params.fallback: expected a number"),
        "{text}"
    );
}

#[test]
fn composite_accepts_upstream_json_text_with_string_params() {
    let gates = r#"[{"gate_type":"prometheus-budget","gate_params":{"pool":"p","baseline":"0.2"}},
                    {"gate_type":"local-max-concurrency","gate_params":{"limit":"3","gating_mode":"classifying"}}]"#;
    let spec = parse("composite", json!({ "gates": gates })).expect("valid");
    let GateSpec::Composite(CompositeParams { gates }) = spec else {
        panic!("not composite")
    };
    assert_eq!(gates.len(), 2);
    assert_eq!(
        gates[1],
        GateSpec::LocalMaxConcurrency(LocalMaxConcurrencyParams {
            limit: 3,
            gating_mode: GatingMode::Classifying
        })
    );
}

#[test]
fn nested_errors_name_the_full_path() {
    let err = parse(
        "wait-on-refuse",
        json!({"gate": {"gate_type": "composite", "gate_params": {"gates": [
            {"gate_type": "constant"},
            {"gate_type": "prometheus-budget", "gate_params": {"pool": "p", "baseline": 2}}
        ]}}}),
    )
    .expect_err("invalid")
    .to_string();
    assert!(
        err.contains("queue[0].gate_params.gate.gate_params.gates[1].gate_params.baseline"),
        "{err}"
    );
}

#[test]
fn tier_priority_admission_reports_split_params_by_name() {
    let err = parse(
        "tier-priority-admission",
        json!({"saturation_gate": "prometheus-saturation", "saturation_gate_params": {"threshold": 3}}),
    )
    .expect_err("invalid")
    .to_string();
    assert!(
        err.contains("queue[0].gate_params.saturation_gate_params.pool"),
        "{err}"
    );
    assert!(
        err.contains("queue[0].gate_params.saturation_gate_params.threshold"),
        "{err}"
    );
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let mut g = json!({"gate_type": "constant"});
    for _ in 0..50 {
        g = json!({"gate_type": "wait-on-refuse", "gate_params": {"gate": g}});
    }
    let err = parse("wait-on-refuse", g["gate_params"].clone())
        .expect_err("too deep")
        .to_string();
    assert!(err.contains("nest deeper"), "{err}");
}

#[test]
fn redis_gate_fails_closed_unless_told() {
    let spec = parse("redis", json!({"address": "r:6379"})).expect("valid");
    assert!(matches!(
        spec,
        GateSpec::Redis(RedisParams {
            missing: MissingBudget::Closed,
            ..
        })
    ));
    let spec = parse("redis", json!({"address": "r:6379", "missing": "open"})).expect("valid");
    assert!(matches!(
        spec,
        GateSpec::Redis(RedisParams {
            missing: MissingBudget::Fallback(x),
            ..
        }) if x == 1.0
    ));
}

#[test]
fn credentials_in_gate_urls_are_rejected() {
    let err = parse("redis", json!({"address": "redis://:pw@r:6379"}))
        .expect_err("password")
        .to_string();
    assert!(err.contains("credentials"), "{err}");
    assert!(!err.contains("pw@"), "{err}");
}

#[test]
fn local_max_concurrency_accepts_newer_upstream_name() {
    let spec = parse("local-max-concurrency", json!({"max_concurrency": "8"})).expect("valid");
    assert_eq!(
        spec,
        GateSpec::LocalMaxConcurrency(LocalMaxConcurrencyParams {
            limit: 8,
            gating_mode: GatingMode::Blocking
        })
    );
    let err = parse("local-max-concurrency", json!({"limit": 0}))
        .expect_err("zero")
        .to_string();
    assert!(err.contains(">= 1"), "{err}");
}

#[test]
fn every_error_is_collected_across_nested_gates_and_unknown_keys() {
    let errs = parse(
        "composite",
        json!({"gates": [
            {"gate_type": "endpoint-scrape", "gate_params": {"bogus": 1, "baseline": "x"}},
            {"gate_type": "redis-quota", "gate_params": {"window": "0s"}},
            {"gate_type": "nope"}
        ]}),
    )
    .expect_err("invalid");
    let text = errs.to_string();
    for needle in [
        "gates[0].gate_params.bogus: unknown parameter for gate `endpoint-scrape`; allowed: url, metric",
        "gates[0].gate_params.baseline: expected a number",
        "gates[0].gate_params.url: required parameter",
        "gates[0].gate_params.metric: required parameter",
        "gates[1].gate_params.address: required parameter",
        "gates[1].gate_params.limit: required parameter",
        "gates[1].gate_params.window: must be greater than 0",
        "gates[2].gate_type: unknown gate type \"nope\"",
    ] {
        assert!(text.contains(needle), "{needle} not in\n{text}");
    }
    assert_eq!(errs.len(), 8, "{text}");
}

#[test]
fn display_is_compact_and_says_when_there_is_no_fallback() {
    let spec = parse(
        "wait-on-refuse",
        json!({"gate": {"gate_type": "composite", "gate_params": {"gates": [
            {"gate_type": "constant"},
            {"gate_type": "prometheus-query", "gate_params": {"query": "up"}}
        ]}}}),
    )
    .expect("valid");
    assert_eq!(
        spec.to_string(),
        "wait-on-refuse[composite[constant, prometheus-query(query=up, fallback=none)]]"
    );
}

#[test]
fn every_catalogued_gate_is_available() {
    let available = GateSpec::available_types();
    assert!(available.contains(&"redis-quota"));
    assert!(available.contains(&"sql-quota"));
    assert!(available.contains(&"tier-priority-admission"));
    assert_eq!(available.len(), GATE_TYPES.len());
}

#[test]
fn feedback_gates_collect_every_error_under_their_keys() {
    let err = parse(
        "feedback",
        json!({"urls": ["ftp://x"], "decrease": 1.5, "jitter": 1, "target": 0,
               "setpoint": {"urls": ["http://a/metrics"], "margin": 2, "regression_window": 2}}),
    )
    .expect_err("invalid")
    .to_string();
    for key in [
        "queue[0].gate_params.urls[0]",
        "queue[0].gate_params.decrease",
        "queue[0].gate_params.jitter",
        "queue[0].gate_params.target",
        "queue[0].gate_params.setpoint.urls",
        "queue[0].gate_params.setpoint.margin",
        "queue[0].gate_params.setpoint.regression_window",
    ] {
        assert!(err.contains(key), "{key} missing from {err}");
    }
    let err = parse("slo-headroom", json!({"horizon": "0s", "bogus": 1}))
        .expect_err("invalid")
        .to_string();
    for key in ["queue[0].gate_params.urls", "queue[0].gate_params.bogus"] {
        assert!(err.contains(key), "{key} missing from {err}");
    }
}
