//! The operations files agree with what sluicegate exports and with the
//! docs: the Grafana dashboard (deploy/grafana/sluicegate.json) queries only
//! metrics in docs/metrics.md and real vLLM names (the simulator's
//! `/metrics`), the alert rules (deploy/prometheus/sluicegate-rules.yaml)
//! pass `promtool check rules` and their unit tests, each alert has a test,
//! a runbook section and its annotations, and the helm chart ships the same
//! files. `scripts/lint-deploy.sh` renders the chart with both on and off.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sluicegate::sim::metrics::{
    ExpositionLabels, MetricsSnapshot, PoolObservation, ReplicaGauges, ReplicaHistograms, render,
};

const DASHBOARD: &str = "deploy/grafana/sluicegate.json";
const CHART_DASHBOARD: &str = "helm/sluicegate/files/sluicegate.json";
const RULES: &str = "deploy/prometheus/sluicegate-rules.yaml";
const RULES_TEST: &str = "deploy/prometheus/sluicegate-rules.test.yaml";
const CHART_RULES: &str = "helm/sluicegate/files/sluicegate-rules.yaml";

fn repo_path(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn repo_file(path: &str) -> String {
    let full = repo_path(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// Every `sluicegate_*` / `vllm:*` token in `text` (PromQL, legends,
/// descriptions): maximal runs of metric-name characters.
fn metric_tokens(text: &str, prefix: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with(prefix) && t.len() > prefix.len())
        .map(str::to_string)
        .collect()
}

/// A histogram's series name (`_bucket`, `_sum`, `_count`) as its family.
fn family(name: &str, histograms: &BTreeSet<String>) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && histograms.contains(base)
        {
            return base.to_string();
        }
    }
    name.to_string()
}

/// The metric names of docs/metrics.md's table, and which are histograms.
fn documented_metrics() -> (BTreeSet<String>, BTreeSet<String>) {
    let doc = repo_file("docs/metrics.md");
    let mut names = BTreeSet::new();
    let mut histograms = BTreeSet::new();
    for line in doc.lines() {
        let Some(rest) = line.strip_prefix("| `sluicegate_") else {
            continue;
        };
        let name = format!("sluicegate_{}", rest.split('`').next().unwrap_or(""));
        if line.contains("| histogram |") {
            histograms.insert(name.clone());
        }
        names.insert(name);
    }
    assert!(names.len() > 20, "docs/metrics.md lists only {names:?}");
    (names, histograms)
}

/// The vLLM metric families the simulator's `/metrics` exposes (current
/// names, as vLLM v1 does), and which are histograms.
fn vllm_metrics() -> (BTreeSet<String>, BTreeSet<String>, String) {
    let snapshot = MetricsSnapshot {
        obs: PoolObservation {
            replicas: vec![ReplicaGauges::default()],
            ..Default::default()
        },
        hist: vec![ReplicaHistograms::default()],
    };
    let labels = ExpositionLabels {
        pool: "pool".into(),
        model: "model".into(),
        block_size: 16,
        num_gpu_blocks: 1000,
        legacy_vllm_names: false,
    };
    let text = render(&snapshot, &labels);
    let mut names = BTreeSet::new();
    let mut histograms = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let name = parts.next().unwrap_or("").to_string();
            if parts.next() == Some("histogram") {
                histograms.insert(name.clone());
            }
            names.insert(name);
        }
    }
    (names, histograms, text)
}

/// Every string in a JSON value.
fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
        Value::Object(o) => o.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

fn dashboard() -> Value {
    serde_json::from_str(&repo_file(DASHBOARD)).expect("the dashboard is JSON")
}

/// The PromQL of every panel target.
fn exprs(dash: &Value) -> Vec<String> {
    let panels = dash["panels"].as_array().expect("panels");
    panels
        .iter()
        .filter_map(|p| p["targets"].as_array())
        .flatten()
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("every target has an expr")
                .to_string()
        })
        .collect()
}

#[test]
fn dashboard_queries_only_documented_sluicegate_metrics_and_covers_them_all() {
    let dash = dashboard();
    let (documented, histograms) = documented_metrics();
    let mut all = Vec::new();
    strings(&dash, &mut all);
    let used: BTreeSet<String> = metric_tokens(&all.join("\n"), "sluicegate_")
        .iter()
        .map(|n| family(n, &histograms))
        .collect();
    let unknown: Vec<_> = used.difference(&documented).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard uses metrics docs/metrics.md does not list: {unknown:?}"
    );
    let unshown: Vec<_> = documented.difference(&used).collect();
    assert!(
        unshown.is_empty(),
        "documented metrics no dashboard panel shows: {unshown:?}"
    );
    // And the docs' table is the list /metrics is tested against.
    let exported: BTreeSet<String> = sluicegate::telemetry::metrics::METRIC_NAMES
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(documented, exported, "docs/metrics.md vs METRIC_NAMES");
}

#[test]
fn dashboard_queries_only_real_vllm_metrics_by_the_pool_label_the_gates_use() {
    let dash = dashboard();
    let (vllm, histograms, text) = vllm_metrics();
    let mut all = Vec::new();
    strings(&dash, &mut all);
    let used: BTreeSet<String> = metric_tokens(&all.join("\n"), "vllm:")
        .iter()
        .map(|n| family(n, &histograms))
        .collect();
    for required in [
        "vllm:time_to_first_token_seconds",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(used.contains(required), "the pool row lacks {required}");
    }
    let unknown: Vec<_> = used.difference(&vllm).collect();
    assert!(
        unknown.is_empty(),
        "not vLLM metrics (simulator /metrics): {unknown:?}"
    );
    assert!(text.contains("inference_pool=\"pool\""), "{text}");
    let exprs = exprs(&dash);
    assert!(
        exprs
            .iter()
            .filter(|e| e.contains("vllm:"))
            .all(|e| e.contains("inference_pool=~\"$pool\"")),
        "every vLLM query selects the pool variable: {exprs:#?}"
    );
}

#[test]
fn dashboard_panels_are_well_formed() {
    let dash = dashboard();
    let panels = dash["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut rows = Vec::new();
    for p in panels {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let grid = &p["gridPos"];
        let (x, w) = (
            grid["x"].as_u64().expect("x"),
            grid["w"].as_u64().expect("w"),
        );
        assert!(x + w <= 24, "panel {id} wider than the grid");
        let title = p["title"].as_str().expect("title");
        if p["type"] == "row" {
            rows.push(title.to_string());
            continue;
        }
        assert!(
            p["description"].as_str().is_some_and(|d| !d.is_empty()),
            "panel {title:?} has no description"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title:?} queries nothing");
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert!(
                expr.contains("$queue") || expr.contains("$pool"),
                "{title:?}: {expr} ignores the queue/pool variables"
            );
        }
    }
    // docs/operations.md describes each row.
    let ops = repo_file("docs/operations.md");
    for row in &rows {
        assert!(
            ops.contains(&format!("- **{row}**")),
            "docs/operations.md (\"Dashboard\") does not describe the row {row:?}"
        );
    }
    assert!(rows.len() >= 7, "{rows:?}");
}

#[test]
fn chart_ships_the_same_dashboard_and_rules() {
    assert_eq!(
        repo_file(DASHBOARD),
        repo_file(CHART_DASHBOARD),
        "{CHART_DASHBOARD} differs from {DASHBOARD}: copy it"
    );
    assert_eq!(
        repo_file(RULES),
        repo_file(CHART_RULES),
        "{CHART_RULES} differs from {RULES}: copy it"
    );
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!("run promtool ({e}): install Debian's prometheus package (scripts/test.sh does)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn rules_pass_promtool_check_and_their_unit_tests() {
    let alerts = alert_names();
    let checked = promtool(&["check", "rules", RULES]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "{checked}"
    );
    let tested = promtool(&["test", "rules", RULES_TEST]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// `- alert: Name` lines of the rules file.
fn alert_names() -> Vec<String> {
    repo_file(RULES)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn every_alert_fires_in_a_unit_test_and_has_its_annotations_and_runbook_section() {
    let rules = repo_file(RULES);
    let tests = repo_file(RULES_TEST);
    let ops = repo_file("docs/operations.md");
    let (documented, histograms) = documented_metrics();
    let alerts = alert_names();
    assert!(alerts.len() >= 8, "{alerts:?}");
    for key in ["summary: ", "description: ", "runbook_url: "] {
        assert_eq!(
            rules.matches(key).count(),
            alerts.len(),
            "every alert has one {key}"
        );
    }
    for alert in &alerts {
        // A test that expects it to fire (a non-empty exp_alerts).
        let fires = format!("alertname: {alert}\n        exp_alerts:\n          - exp_labels:");
        assert!(tests.contains(&fires), "no unit test fires {alert}");
        let anchor = alert.to_lowercase();
        assert!(
            rules.contains(&format!("/docs/operations.md#{anchor}\"")),
            "{alert}'s runbook_url is not docs/operations.md#{anchor}"
        );
        assert!(
            ops.lines().any(|l| l == format!("### {alert}")),
            "docs/operations.md has no runbook section `### {alert}`"
        );
    }
    let used: BTreeSet<String> = metric_tokens(&rules, "sluicegate_")
        .iter()
        .map(|n| family(n, &histograms))
        .collect();
    let unknown: Vec<_> = used.difference(&documented).collect();
    assert!(
        unknown.is_empty(),
        "rules use undocumented metrics: {unknown:?}"
    );
}
