//! The deployment files agree with the binary: the helm chart's default
//! configuration (and its env-only example) loads as the pod would load it,
//! the grace period outlasts the drain, and the image and the chart serve
//! telemetry on the same port. `scripts/lint-deploy.sh` lints the same files
//! with hadolint and helm; this suite needs neither.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sluicegate::config::{Config, ConfigSources, TransportKind};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

fn values() -> String {
    repo_file("helm/sluicegate/values.yaml")
}

/// The lines of the top-level block `key:` (or `key: |`) of a YAML file,
/// with the block's two-space indent removed. The chart's files keep these
/// blocks plain, so no YAML parser is needed.
fn top_level_block(yaml: &str, header: &str) -> Vec<String> {
    let mut lines = yaml.lines().skip_while(|l| *l != header);
    assert!(lines.next().is_some(), "no top-level `{header}` block");
    lines
        .take_while(|l| l.is_empty() || l.starts_with("  "))
        .map(|l| l.get(2..).unwrap_or("").to_string())
        .collect()
}

/// A top-level scalar `key: value` of a YAML file.
fn top_level_scalar(yaml: &str, key: &str) -> String {
    let prefix = format!("{key}: ");
    yaml.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no top-level `{key}`"))
        .trim()
        .to_string()
}

/// The environment the chart gives the container besides `env`.
fn pod_env(metrics_port: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(
        "SLUICEGATE_LISTEN".to_string(),
        format!("0.0.0.0:{metrics_port}"),
    )])
}

fn write_default_config(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluicegate-deploy-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("config.toml");
    let config = top_level_block(&values(), "config: |").join("\n");
    assert!(
        config.contains("[[queue]]"),
        "the chart's config has no queue:\n{config}"
    );
    std::fs::write(&path, config).expect("write config");
    path
}

fn load_default_config(name: &str) -> Config {
    let values = values();
    let sources = ConfigSources {
        file: Some(write_default_config(name)),
        env: pod_env(&top_level_scalar(&values, "metricsPort")),
        ..Default::default()
    };
    Config::load(&sources)
        .unwrap_or_else(|e| panic!("the chart's default config is rejected:\n{e}"))
}

#[test]
fn chart_default_config_passes_check_config_in_the_pod_environment() {
    let path = write_default_config("check");
    let out = Command::new(BIN)
        .env_clear()
        .env("SLUICEGATE_LISTEN", "0.0.0.0:9464")
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run check-config");
    assert!(
        out.status.success(),
        "check-config exit {:?}:\n{}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let config = load_default_config("load");
    assert_ne!(
        config.transport,
        TransportKind::Memory,
        "an in-process queue is of no use in a cluster"
    );
}

#[test]
fn chart_grace_period_outlasts_the_default_configs_shutdown_grace() {
    let grace: u64 = top_level_scalar(&values(), "terminationGracePeriodSeconds")
        .parse()
        .expect("terminationGracePeriodSeconds is an integer");
    let config = load_default_config("grace");
    // Margin for the final result writes and acks after the drain.
    assert!(
        Duration::from_secs(grace) >= config.dispatch.shutdown_grace + Duration::from_secs(10),
        "terminationGracePeriodSeconds {grace}s leaves under 10s after shutdown_grace {:?}",
        config.dispatch.shutdown_grace
    );
}

#[test]
fn chart_env_only_values_configure_a_valid_sidecar() {
    let ci = repo_file("helm/sluicegate/ci/env-only-values.yaml");
    assert_eq!(
        top_level_scalar(&ci, "config"),
        "\"\"",
        "env-only means no file"
    );
    let mut env = pod_env(&top_level_scalar(&values(), "metricsPort"));
    for line in top_level_block(&ci, "env:") {
        let (key, value) = line.split_once(": ").expect("env entries are `KEY: value`");
        let value = value.trim().trim_matches('\'').trim_matches('"');
        env.insert(key.to_string(), value.to_string());
    }
    let sources = ConfigSources {
        env,
        ..Default::default()
    };
    let config =
        Config::load(&sources).unwrap_or_else(|e| panic!("env-only values rejected:\n{e}"));
    assert_eq!(config.queues.len(), 1);
}

#[test]
fn image_and_chart_serve_telemetry_on_the_same_port() {
    let port = top_level_scalar(&values(), "metricsPort");
    let dockerfile = repo_file("docker/Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().map(str::trim).collect();
    for expected in [
        format!("EXPOSE {port}"),
        format!("ENV SLUICEGATE_LISTEN=0.0.0.0:{port}"),
    ] {
        assert!(
            lines.contains(&expected.as_str()),
            "docker/Dockerfile lacks `{expected}`"
        );
    }
    let config = load_default_config("port");
    assert_eq!(
        config.telemetry.listen.to_string(),
        format!("0.0.0.0:{port}")
    );
}
