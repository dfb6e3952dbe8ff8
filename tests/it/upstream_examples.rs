//! Every example configuration upstream ships (`tests/fixtures/upstream/`,
//! extracted from llm-d-async's Helm values) loads here unchanged through
//! `SLUICEGATE_QUEUES_JSON`, and every gate in it builds: a user moving
//! from llm-d-async keeps their queue configuration.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;
use sluicegate::config::{Config, ConfigSources};
use sluicegate::gate::{GateContext, build_gate};

/// One extracted example.
struct Example {
    name: String,
    fixture: Value,
}

fn examples() -> Vec<Example> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/upstream");
    let mut out: Vec<Example> = std::fs::read_dir(&dir)
        .expect("fixtures")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("json"))
        .map(|p| Example {
            name: p.file_name().expect("name").to_string_lossy().into_owned(),
            fixture: serde_json::from_str(&std::fs::read_to_string(&p).expect("read"))
                .expect("fixture JSON"),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Loads `queues` (upstream's queue or topic objects) on `transport` with
/// the example's gateway and Prometheus, as a user would: the objects in
/// `SLUICEGATE_QUEUES_JSON`, the rest in the file.
fn load(example: &Example, transport: &str, queues: &Value) -> Result<Config, String> {
    let f = &example.fixture;
    let mut toml = format!("transport = \"{transport}\"\n");
    match transport {
        "redis" => toml.push_str("[redis]\nurl = \"redis://127.0.0.1:6379\"\n"),
        _ => {
            toml.push_str("[pubsub]\nproject_id = \"my-project\"\nresult_topic_id = \"results\"\n")
        }
    }
    let gateway = f["igw_base_url"].as_str().filter(|u| !u.is_empty());
    toml.push_str(&format!(
        "[gateway]\nurl = \"{}\"\n",
        gateway.unwrap_or("http://igw:80")
    ));
    // The chart's commented examples leave `ap.prometheusURL` to the user;
    // upstream refuses a Prometheus gate without it too.
    let prometheus = f["prometheus_url"].as_str().filter(|u| !u.is_empty());
    toml.push_str(&format!(
        "[prometheus]\nurl = \"{}\"\n",
        prometheus.unwrap_or("http://prometheus:9090")
    ));
    let dir = std::env::temp_dir().join(format!(
        "sluicegate-upstream-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("config.toml");
    std::fs::write(&file, toml).expect("write config");
    let env: BTreeMap<String, String> =
        [("SLUICEGATE_QUEUES_JSON".to_owned(), queues.to_string())].into();
    let loaded = Config::load(&ConfigSources {
        file: Some(file),
        env,
        ..Default::default()
    })
    .map_err(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&dir);
    loaded
}

/// Every queue object of every example, loaded alone: one with a gate
/// loads and its gate builds as the type upstream names; one without a
/// `gate_type` is refused with a message that says so, where upstream
/// would run it behind an always-open gate (or a worker pool's gate,
/// `ap.workerPools`, which we do not have: `docs/compatibility.md`).
#[test]
fn every_upstream_example_configuration_loads_and_its_gates_build() {
    let all = examples();
    assert!(all.len() >= 15, "the extracted examples are missing");
    let (mut built, mut refused) = (Vec::new(), 0);
    for example in &all {
        for (transport, key) in [("redis", "redis_queues"), ("pubsub", "pubsub_topics")] {
            for upstream in example.fixture[key].as_array().into_iter().flatten() {
                let one = Value::Array(vec![upstream.clone()]);
                let loaded = load(example, transport, &one);
                let Some(gate_type) = upstream["gate_type"].as_str() else {
                    let err = loaded.err().unwrap_or_default();
                    assert!(
                        err.contains("gate_type is required (fail closed: no default gate)"),
                        "{} ({transport}): a queue without gate_type: {err}",
                        example.name
                    );
                    refused += 1;
                    continue;
                };
                let config =
                    loaded.unwrap_or_else(|e| panic!("{} ({transport}): {e}", example.name));
                let q = &config.queues[0];
                let ctx = GateContext::from_config(&config).for_queue(q);
                let gate = build_gate(&q.gate, &ctx)
                    .unwrap_or_else(|e| panic!("{} queue {}: {e}", example.name, q.queue_name));
                assert_eq!(
                    gate.kind(),
                    gate_type,
                    "{}: the gate upstream names",
                    example.name
                );
                built.push(gate_type.to_owned());
            }
        }
    }
    assert_eq!(refused, 6, "the examples' queues without a gate_type");
    assert_eq!(
        built.len(),
        16,
        "the examples' queues with a gate: {built:?}"
    );
    for t in [
        "composite",
        "endpoint-scrape",
        "prometheus-budget",
        "prometheus-query",
        "prometheus-saturation",
        "redis",
        "redis-quota",
    ] {
        assert!(
            built.iter().any(|g| g == t),
            "no example uses {t}: {built:?}"
        );
    }
}
