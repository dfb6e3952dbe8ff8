//! The deployment files agree with the binary: the helm chart's default
//! configuration (and its env-only example) loads as the pod would load it,
//! the grace period outlasts the drain, and the image and the chart serve
//! telemetry on the same port. `scripts/lint-deploy.sh` lints the same files
//! with hadolint and helm; this suite renders the chart with the same helm
//! for the service-link test.

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

/// helm, as `scripts/lint-deploy.sh` (run by the test command before the
/// tests) installs it: `$LINT_TOOLS_DIR/bin/helm`, by default
/// `~/.cache/sluicegate-tools/bin/helm`.
fn helm() -> PathBuf {
    let tools = std::env::var_os("LINT_TOOLS_DIR").map_or_else(
        || {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/sluicegate-tools")
        },
        PathBuf::from,
    );
    let helm = tools.join("bin/helm");
    assert!(
        helm.exists(),
        "no helm at {} (scripts/lint-deploy.sh installs it; the test command runs it first)",
        helm.display()
    );
    helm
}

/// The chart rendered by `helm template <release>` with its default values.
fn render_chart(release: &str) -> String {
    let home =
        std::env::temp_dir().join(format!("sluicegate-helm-{release}-{}", std::process::id()));
    let out = Command::new(helm())
        .args(["template", release])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("helm/sluicegate"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .expect("helm runs");
    let _ = std::fs::remove_dir_all(&home);
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// A Service's name and its ports (name, port, protocol), read off its
/// rendered document, whose layout the chart's template fixes.
fn rendered_service(rendered: &str) -> (String, Vec<(String, u16, String)>) {
    let doc = rendered
        .split("\n---\n")
        .find(|d| d.lines().any(|l| l == "kind: Service"))
        .expect("the chart renders a Service");
    let field = |line: &str, key: &str| {
        line.trim()
            .trim_start_matches("- ")
            .strip_prefix(key)
            .map(|v| v.trim().to_string())
    };
    let mut lines = doc.lines().skip_while(|l| *l != "metadata:");
    let name = lines
        .find_map(|l| field(l, "name:"))
        .expect("metadata.name");
    let mut ports = Vec::new();
    let mut in_ports = false;
    let mut current: (Option<String>, Option<u16>, Option<String>) = (None, None, None);
    for line in doc.lines() {
        if line == "  ports:" {
            in_ports = true;
            continue;
        }
        if !in_ports || !line.starts_with("    ") {
            continue;
        }
        if line.trim_start().starts_with("- ") && current.1.is_some() {
            let (n, p, proto) = std::mem::take(&mut current);
            ports.push((
                n.unwrap_or_default(),
                p.expect("port"),
                proto.unwrap_or_else(|| "TCP".into()),
            ));
        }
        if let Some(v) = field(line, "name:") {
            current.0 = Some(v);
        } else if let Some(v) = field(line, "port:") {
            current.1 = Some(v.parse().expect("port number"));
        } else if let Some(v) = field(line, "protocol:") {
            current.2 = Some(v);
        }
    }
    if let (n, Some(p), proto) = current {
        ports.push((
            n.unwrap_or_default(),
            p,
            proto.unwrap_or_else(|| "TCP".into()),
        ));
    }
    assert!(!ports.is_empty(), "the Service has no ports:\n{doc}");
    (name, ports)
}

/// The variables Kubernetes injects into every pod of the namespace for a
/// Service (`enableServiceLinks`), as the kubelet names them: the Service
/// name upper-cased with `-` as `_`, the first port as `_PORT`.
fn service_link_env(
    service: &str,
    ip: &str,
    ports: &[(String, u16, String)],
) -> BTreeMap<String, String> {
    let svc = service.to_uppercase().replace('-', "_");
    let mut env = BTreeMap::from([(format!("{svc}_SERVICE_HOST"), ip.to_string())]);
    for (i, (name, port, proto)) in ports.iter().enumerate() {
        let url = format!("{}://{ip}:{port}", proto.to_lowercase());
        if i == 0 {
            env.insert(format!("{svc}_SERVICE_PORT"), port.to_string());
            env.insert(format!("{svc}_PORT"), url.clone());
        }
        if !name.is_empty() {
            env.insert(
                format!(
                    "{svc}_SERVICE_PORT_{}",
                    name.to_uppercase().replace('-', "_")
                ),
                port.to_string(),
            );
        }
        let base = format!("{svc}_PORT_{port}_{proto}");
        env.insert(base.clone(), url);
        env.insert(format!("{base}_PROTO"), proto.to_lowercase());
        env.insert(format!("{base}_PORT"), port.to_string());
        env.insert(format!("{base}_ADDR"), ip.to_string());
    }
    env
}

/// Starts `sluicegate <command>` with `env` and waits until `health_port`
/// answers `/healthz` 200; fails with its stderr if it exits first.
fn starts_and_is_healthy(command: &str, env: &BTreeMap<String, String>, health_port: u16) {
    use std::io::{Read, Write};
    let mut child = Command::new(BIN)
        .arg(command)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sluicegate starts");
    let give_up = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            panic!("`sluicegate {command}` exited ({status}) in a pod's environment:\n{err}");
        }
        let answer = std::net::TcpStream::connect(("127.0.0.1", health_port))
            .ok()
            .and_then(|mut s| {
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .ok()?;
                let mut text = String::new();
                s.read_to_string(&mut text).ok()?;
                Some(text)
            });
        if answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")) {
            break;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "`sluicegate {command}` never answered /healthz"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Kubernetes gives every pod of a namespace variables named after each
/// Service; the chart's own Service for a release `sluicegate` is named
/// `sluicegate`, so they start with `SLUICEGATE_`. `run` and `serve` start
/// with them (they once stopped on "unknown environment variable"), and
/// the chart turns them off for its own pods.
#[test]
fn run_and_serve_start_beside_the_service_links_kubernetes_injects() {
    let rendered = render_chart("sluicegate");
    assert!(
        rendered
            .lines()
            .any(|l| l.trim() == "enableServiceLinks: false"),
        "the chart's pod spec does not set enableServiceLinks: false"
    );
    let (service, ports) = rendered_service(&rendered);
    assert_eq!(
        service, "sluicegate",
        "release `sluicegate` names its Service `sluicegate`"
    );
    let mut links = service_link_env(&service, "10.96.0.10", &ports);
    // A second Service whose name starts the same way, with a named port.
    let api_ports = [("http-api".to_string(), 8080, "TCP".to_string())];
    links.extend(service_link_env(
        "sluicegate-batch",
        "10.96.0.11",
        &api_ports,
    ));
    assert!(links.contains_key("SLUICEGATE_SERVICE_HOST") && links.contains_key("SLUICEGATE_PORT"));

    let metrics = crate::support::free_port();
    let mut run_env = links.clone();
    run_env.extend([
        ("SLUICEGATE_TRANSPORT".to_string(), "memory".to_string()),
        (
            "SLUICEGATE_GATEWAY_URL".to_string(),
            "http://127.0.0.1:9".to_string(),
        ),
        ("SLUICEGATE_GATE_TYPE".to_string(), "constant".to_string()),
        (
            "SLUICEGATE_LISTEN".to_string(),
            format!("127.0.0.1:{metrics}"),
        ),
    ]);
    starts_and_is_healthy("run", &run_env, metrics);

    let data = std::env::temp_dir().join(format!("sluicegate-links-serve-{}", std::process::id()));
    let (api, metrics) = (crate::support::free_port(), crate::support::free_port());
    let mut serve_env = run_env;
    serve_env.remove("SLUICEGATE_TRANSPORT");
    serve_env.extend([
        (
            "SLUICEGATE_LISTEN".to_string(),
            format!("127.0.0.1:{metrics}"),
        ),
        (
            "SLUICEGATE_SERVE_LISTEN".to_string(),
            format!("127.0.0.1:{api}"),
        ),
        (
            "SLUICEGATE_SERVE_DATA_DIR".to_string(),
            data.display().to_string(),
        ),
        (
            "SLUICEGATE_SERVE_API_KEYS".to_string(),
            "acme:sk-acme".to_string(),
        ),
    ]);
    starts_and_is_healthy("serve", &serve_env, metrics);
    let _ = std::fs::remove_dir_all(&data);

    // A typo beside the links still stops startup, naming the variable.
    let mut typo = links;
    typo.insert("SLUICEGATE_GATE_TPYE".to_string(), "constant".to_string());
    let out = Command::new(BIN)
        .arg("check-config")
        .env_clear()
        .envs(&typo)
        .output()
        .expect("sluicegate runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a typo was accepted");
    assert!(
        err.contains("SLUICEGATE_GATE_TPYE: unknown environment variable"),
        "{err}"
    );
    assert!(
        !err.contains("SERVICE_HOST") && !err.contains("SLUICEGATE_PORT"),
        "{err}"
    );
}
