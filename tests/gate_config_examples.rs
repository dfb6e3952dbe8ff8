//! Every example config in `config/` builds its gates (the loader test
//! parses them; this builds the sources and gates from them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use sluicegate::config::{Config, ConfigSources};
use sluicegate::gate::{GateContext, build_gate};

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
    ] {
        assert!(kinds.contains(&kind), "no example config for {kind}");
    }
}
