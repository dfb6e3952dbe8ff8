//! Black-box tests of configuration loading: file + environment map +
//! flags, error texts, redaction and the example files.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluicegate::gate::{
    CompositeParams, ConstantParams, LocalMaxConcurrencyParams, PrometheusBudgetParams,
    PrometheusSaturationParams, RedisParams, RedisQuotaParams, WaitOnRefuseParams,
};

use sluicegate::config::{
    CONTRACT_ENV_VARS, Config, ConfigError, ConfigErrors, ConfigSources, EndpointUrl, GATE_TYPES,
    GateSpec, GatingMode, MissingBudget, ObjectiveHeader, Overrides, REDACTED, Rounding, Secret,
    TransportKind, Unit, known_env_vars,
};
use sluicegate::telemetry::LogFormat;
use url::Url;

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A file in the temp directory, unique per call, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "sluicegate-config-test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, contents).expect("write temp file");
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn load(
    file: Option<&str>,
    env_pairs: &[(&str, &str)],
    overrides: Overrides,
) -> Result<Config, ConfigErrors> {
    let tmp = file.map(|text| TempFile::new("config.toml", text));
    Config::load(&ConfigSources {
        file: tmp.as_ref().map(|t| t.0.clone()),
        env: env(env_pairs),
        overrides,
    })
}

fn load_err(file: Option<&str>, env_pairs: &[(&str, &str)]) -> String {
    match load(file, env_pairs, Overrides::default()) {
        Ok(c) => panic!("expected errors, got {c:#?}"),
        Err(e) => e.to_string(),
    }
}

const MINIMAL: &str = r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
queue_name = "q"
gate_type = "constant"
"#;

#[test]
fn environment_alone_configures_a_complete_sidecar() {
    let config = load(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://gw.example:8000"),
            ("SLUICEGATE_REQUEST_PATH", "/v1/chat/completions"),
            ("SLUICEGATE_QUEUE", "batch"),
            ("SLUICEGATE_GATE_TYPE", "prometheus-budget"),
            (
                "SLUICEGATE_GATE_PARAMS",
                r#"{"pool":"p","baseline":"0.1","max_concurrency":10,"fallback":"0"}"#,
            ),
            ("SLUICEGATE_PROMETHEUS_URL", "http://prom:9090"),
            ("SLUICEGATE_LISTEN", "0.0.0.0:9100"),
            ("SLUICEGATE_LOG_FORMAT", "json"),
        ],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));

    assert_eq!(config.transport, TransportKind::Memory);
    assert_eq!(config.telemetry.listen.to_string(), "0.0.0.0:9100");
    assert_eq!(config.telemetry.log_format, LogFormat::Json);
    assert_eq!(
        config.prometheus.as_ref().map(|p| p.url.expose().as_str()),
        Some("http://prom:9090/")
    );
    assert_eq!(config.queues.len(), 1);
    let q = &config.queues[0];
    assert_eq!(q.queue_name, "batch");
    assert_eq!(q.igw_base_url.expose().as_str(), "http://gw.example:8000/");
    assert_eq!(q.request_path_url, "/v1/chat/completions");
    assert_eq!(q.max_sys, 100.0);
    assert_eq!(q.unit, Unit::Requests);
    assert_eq!(q.rounding, Rounding::Floor);
    assert_eq!(
        q.result_queue_name, None,
        "no list unless the queue names one"
    );
    assert_eq!(q.worker_pool_id, "default");
    assert_eq!(
        q.gate,
        GateSpec::PrometheusBudget(PrometheusBudgetParams {
            pool: "p".into(),
            namespace: None,
            max_concurrency: 10.0,
            baseline: 0.1,
            fallback: Some(0.0),
        })
    );
    // Defaults elsewhere.
    assert_eq!(config.dispatch.poll_interval, Duration::from_secs(1));
    assert_eq!(config.dispatch.max_staleness, Duration::from_secs(30));
    assert_eq!(config.dispatch.max_attempts, None);
    assert_eq!(config.gateway.objective_header, ObjectiveHeader::Gateway);
    assert_eq!(config.gateway.fairness_attribute.as_deref(), Some("userid"));
    assert!(config.redis.is_none());
}

#[test]
fn config_file_can_be_named_by_sluicegate_config() {
    let file = TempFile::new("named.toml", MINIMAL);
    let path = file.0.display().to_string();
    let config = Config::load(&ConfigSources {
        env: env(&[("SLUICEGATE_CONFIG", &path)]),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.queues[0].queue_name, "q");
}

#[test]
fn precedence_is_flag_then_env_then_file_then_default() {
    let file = r#"
transport = "redis"
[gateway]
url = "http://file:8000"
[telemetry]
listen = "127.0.0.1:1111"
log_format = "json"
[dispatch]
poll_interval = "3s"
[[queue]]
queue_name = "file-queue"
igw_base_url = "http://file-queue:8000"
gate_type = "constant"
"#;
    // Default only (no file, no env, no flag) for poll_interval and log level.
    let c = load(Some(file), &[], Overrides::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.transport, TransportKind::Redis);
    assert_eq!(c.telemetry.listen.to_string(), "127.0.0.1:1111");
    assert_eq!(c.telemetry.log_format, LogFormat::Json);
    assert_eq!(c.telemetry.log_level, "info", "default");
    assert_eq!(c.dispatch.lease, Duration::from_secs(30), "default");
    assert_eq!(c.dispatch.poll_interval, Duration::from_secs(3), "file");
    assert_eq!(c.queues[0].queue_name, "file-queue");
    assert_eq!(
        c.queues[0].igw_base_url.expose().host_str(),
        Some("file-queue")
    );

    // Environment beats the file.
    let env_pairs = [
        ("SLUICEGATE_TRANSPORT", "embedded"),
        ("SLUICEGATE_LISTEN", "127.0.0.1:2222"),
        ("SLUICEGATE_LOG_FORMAT", "text"),
        ("SLUICEGATE_DISPATCH_POLL_INTERVAL", "250ms"),
        ("SLUICEGATE_QUEUE", "env-queue"),
        ("SLUICEGATE_GATEWAY_URL", "http://env:8000"),
    ];
    let c = load(Some(file), &env_pairs, Overrides::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.transport, TransportKind::Embedded);
    assert_eq!(c.telemetry.listen.to_string(), "127.0.0.1:2222");
    assert_eq!(c.telemetry.log_format, LogFormat::Text);
    assert_eq!(c.dispatch.poll_interval, Duration::from_millis(250));
    assert_eq!(c.queues[0].queue_name, "env-queue");
    // With exactly one queue, the gateway URL variable overrides its igw_base_url.
    assert_eq!(c.queues[0].igw_base_url.expose().host_str(), Some("env"));

    // Flags beat the environment.
    let flags = Overrides {
        transport: Some("memory".into()),
        listen: Some("127.0.0.1:3333".into()),
        log_format: Some("json".into()),
        queue: Some("flag-queue".into()),
        gateway_url: Some("http://flag:8000".into()),
        ..Default::default()
    };
    let c = load(Some(file), &env_pairs, flags).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.transport, TransportKind::Memory);
    assert_eq!(c.telemetry.listen.to_string(), "127.0.0.1:3333");
    assert_eq!(c.telemetry.log_format, LogFormat::Json);
    assert_eq!(c.queues[0].queue_name, "flag-queue");
    assert_eq!(c.queues[0].igw_base_url.expose().host_str(), Some("flag"));
    assert_eq!(
        c.dispatch.poll_interval,
        Duration::from_millis(250),
        "env still applies"
    );
}

#[test]
fn unknown_key_in_file_is_named_with_allowed_keys() {
    let err = load_err(
        Some(
            r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
atempt_timeout = "5s"
[[queue]]
gate_type = "constant"
gate_typo = 1
"#,
        ),
        &[],
    );
    assert!(err.contains("gateway.atempt_timeout"), "{err}");
    assert!(err.contains("did you mean `attempt_timeout`"), "{err}");
    assert!(
        err.contains("allowed: url, request_path, attempt_timeout"),
        "{err}"
    );
    assert!(err.contains("queue[0].gate_typo"), "{err}");
    assert!(err.contains("gate_type, gate_params"), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");
}

#[test]
fn unknown_gate_type_is_an_error_listing_allowed_types() {
    let err = load_err(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
            ("SLUICEGATE_GATE_TYPE", "prometheus-budgte"),
        ],
    );
    assert!(
        err.contains(
            "SLUICEGATE_GATE_TYPE (queue[0].gate_type): unknown gate type \"prometheus-budgte\""
        ),
        "{err}"
    );
    for t in GATE_TYPES {
        assert!(err.contains(t), "{t} missing from {err}");
    }
}

#[test]
fn missing_gate_type_fails_closed() {
    let err = load_err(
        Some(
            r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
queue_name = "q"
"#,
        ),
        &[],
    );
    assert!(
        err.contains("queue[0].gate_type: gate_type is required"),
        "{err}"
    );
    assert!(err.contains("SLUICEGATE_GATE_TYPE"), "{err}");
    assert!(err.contains("constant, composite"), "{err}");
}

#[test]
fn missing_required_param_is_named() {
    let err = load_err(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
            ("SLUICEGATE_PROMETHEUS_URL", "http://127.0.0.1:9090"),
            ("SLUICEGATE_GATE_TYPE", "prometheus-budget"),
            ("SLUICEGATE_GATE_PARAMS", r#"{"baseline": 0.1}"#),
        ],
    );
    assert!(
        err.contains(
            "SLUICEGATE_GATE_PARAMS (queue[0].gate_params.pool): required parameter of gate `prometheus-budget` is missing"
        ),
        "{err}"
    );
}

#[test]
fn out_of_range_values_name_key_and_range() {
    let err = load_err(
        Some(
            r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[prometheus]
url = "http://127.0.0.1:9090"
[dispatch]
poll_interval = "0s"
[[queue]]
max_sys = -1
unit = "widgets"
gate_type = "prometheus-saturation"
gate_params = { pool = "p", threshold = "1.5" }
"#,
        ),
        &[],
    );
    assert!(
        err.contains("queue[0].gate_params.threshold: must be in [0, 1], got 1.5"),
        "{err}"
    );
    assert!(
        err.contains("queue[0].max_sys: must be greater than 0, got -1"),
        "{err}"
    );
    assert!(
        err.contains("queue[0].unit: unknown value \"widgets\"; allowed: requests, tokens, bytes"),
        "{err}"
    );
    assert!(
        err.contains("dispatch.poll_interval: must be greater than 0"),
        "{err}"
    );
}

#[test]
fn bad_pace_values_name_the_key_and_what_is_allowed() {
    let err = load_err(
        Some(
            r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[dispatch]
pace = "bytes"
pace_rate = 0
pace_burst = "lots"
[[queue]]
gate_type = "constant"
"#,
        ),
        &[],
    );
    assert!(
        err.contains("dispatch.pace: unknown value \"bytes\"; allowed: off, requests, tokens"),
        "{err}"
    );
    assert!(
        err.contains("dispatch.pace_rate: must be greater than 0, got 0"),
        "{err}"
    );
    assert!(
        err.contains("dispatch.pace_burst: expected a number"),
        "{err}"
    );
    let err = load_err(Some(MINIMAL), &[("SLUICEGATE_DISPATCH_PACE_RATE", "NaN")]);
    assert!(err.contains("dispatch.pace_rate"), "{err}");
}

#[test]
fn unknown_sluicegate_variable_is_an_error() {
    let err = load_err(
        Some(MINIMAL),
        &[
            ("SLUICEGATE_DISPATCH_POLL_INTERVALL", "1s"),
            ("OTHER_VAR", "x"),
        ],
    );
    assert!(
        err.contains("SLUICEGATE_DISPATCH_POLL_INTERVALL: unknown environment variable"),
        "{err}"
    );
    assert!(
        err.contains("did you mean SLUICEGATE_DISPATCH_POLL_INTERVAL"),
        "{err}"
    );
    assert!(err.contains("SLUICEGATE_DISPATCH_MAX_STALENESS"), "{err}");
    assert!(!err.contains("OTHER_VAR"), "{err}");
}

#[test]
fn all_errors_are_reported_together() {
    let err = load_err(
        Some(
            r#"
[gateway]
url = "ftp://nope"
[telemetry]
listen = "localhost"
log_format = "xml"
[[queue]]
gate_type = "constant"
"#,
        ),
        &[("SLUICEGATE_TYPO", "1")],
    );
    for needle in [
        "SLUICEGATE_TYPO",
        "transport: transport is required; allowed: memory, redis",
        "gateway.url: expected an http(s) URL",
        "telemetry.listen: expected a socket address",
        "telemetry.log_format: unknown value \"xml\"; allowed: text, json",
    ] {
        assert!(err.contains(needle), "{needle} not in {err}");
    }
}

#[test]
fn queue_level_variables_with_several_queues_are_errors() {
    let file = r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
queue_name = "a"
gate_type = "constant"
[[queue]]
queue_name = "b"
gate_type = "constant"
"#;
    let err = load_err(Some(file), &[("SLUICEGATE_GATE_TYPE", "constant")]);
    assert!(err.contains("SLUICEGATE_GATE_TYPE (queue): queue-level setting needs exactly one queue, but 2 are configured (a, b)"), "{err}");
    // Gateway-level variables only set the default then.
    let c = load(
        Some(file),
        &[("SLUICEGATE_GATEWAY_URL", "http://other:1")],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        c.queues
            .iter()
            .all(|q| q.igw_base_url.expose().host_str() == Some("other"))
    );
}

#[test]
fn changing_the_gate_type_by_env_drops_the_file_params() {
    let file = r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
gate_type = "local-max-concurrency"
gate_params = { limit = 4 }
"#;
    let c = load(
        Some(file),
        &[("SLUICEGATE_GATE_TYPE", "constant")],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.queues[0].gate, GateSpec::Constant(ConstantParams {}));
    // Same type: the file's params stay; GATE_PARAMS replaces them whole.
    let c = load(
        Some(file),
        &[
            ("SLUICEGATE_GATE_TYPE", "local-max-concurrency"),
            (
                "SLUICEGATE_GATE_PARAMS",
                r#"{"limit":"9","gating_mode":"classifying"}"#,
            ),
        ],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.queues[0].gate,
        GateSpec::LocalMaxConcurrency(LocalMaxConcurrencyParams {
            limit: 9,
            gating_mode: GatingMode::Classifying
        })
    );
}

#[test]
fn secrets_never_appear_in_debug_summary_or_toml() {
    let token_file = TempFile::new("token", "file-token-s3cr3t\n");
    let file = format!(
        r#"
transport = "redis"
[gateway]
url = "http://127.0.0.1:8000"
token_file = "{}"
[redis]
url = "redis://alice:url-pw-s3cr3t@redis:6379/0"
[prometheus]
url = "http://prom:9090"
basic_user = "bob"
basic_password = "prom-pw-s3cr3t"
[[queue]]
gate_type = "constant"
"#,
        token_file.0.display()
    );
    let c = load(
        Some(&file),
        &[("SLUICEGATE_REDIS_USERNAME", "alice")],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.gateway.token.as_ref().map(|t| t.expose()),
        Some("file-token-s3cr3t")
    );
    assert_eq!(
        c.redis.as_ref().and_then(|r| r.url.expose().password()),
        Some("url-pw-s3cr3t")
    );
    let shown = [
        format!("{c:?}"),
        format!("{c:#?}"),
        c.summary(),
        c.to_redacted_toml(),
    ];
    for text in &shown {
        assert!(!text.contains("s3cr3t"), "secret leaked:\n{text}");
    }
    let toml = c.to_redacted_toml();
    assert!(toml.contains("basic_password = \"<redacted>\""), "{toml}");
    assert!(toml.contains("alice:****@redis"), "{toml}");

    // An inline gateway token from the environment.
    let c = load(
        Some(MINIMAL),
        &[("SLUICEGATE_GATEWAY_TOKEN", "env-token-s3cr3t")],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.gateway.token.as_ref().map(|t| t.expose()),
        Some("env-token-s3cr3t")
    );
    for text in [format!("{c:?}"), c.summary(), c.to_redacted_toml()] {
        assert!(!text.contains("s3cr3t"), "secret leaked:\n{text}");
    }
    assert!(c.to_redacted_toml().contains("token = \"<redacted>\""));
}

#[test]
fn secret_errors_do_not_echo_the_secret() {
    let err = load_err(
        Some(MINIMAL),
        &[
            ("SLUICEGATE_GATEWAY_TOKEN", "tok-s3cr3t"),
            ("SLUICEGATE_GATEWAY_TOKEN_FILE", "/nonexistent/token"),
        ],
    );
    assert!(
        err.contains("set either gateway.token or gateway.token_file"),
        "{err}"
    );
    assert!(!err.contains("s3cr3t"), "{err}");
}

#[test]
fn upstream_json_queue_config_carries_over_verbatim() {
    // The upstream shape: every gate param a string, nested gates as JSON text.
    let upstream = r#"[{
        "id": "batch-queue",
        "queue_name": "request-sortedset",
        "igw_base_url": "http://gateway:80",
        "request_path_url": "/v1/completions",
        "inference_objective": "batch",
        "worker_pool_id": "pool-a",
        "labels": {"tier": "batch"},
        "result_queue_name": "results",
        "result_ttl_seconds": 3600,
        "gate_type": "composite",
        "gate_params": {
            "gates": "[{\"gate_type\":\"prometheus-saturation\",\"gate_params\":{\"pool\":\"p\",\"threshold\":\"0.7\"}},{\"gate_type\":\"redis\",\"gate_params\":{\"address\":\"redis:6379\",\"budget_key\":\"\"}}]"
        }
    }]"#;
    let c = load(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "redis-sortedset"),
            ("SLUICEGATE_QUEUES_JSON", upstream),
            ("SLUICEGATE_PROMETHEUS_URL", "http://prom:9090"),
        ],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.transport, TransportKind::Redis);
    let q = &c.queues[0];
    assert_eq!(q.queue_name, "request-sortedset");
    assert_eq!(q.inference_objective.as_deref(), Some("batch"));
    assert_eq!(q.worker_pool_id, "pool-a");
    // Upstream's queue id (its metric label) loads and is kept, unused.
    assert_eq!(q.id.as_deref(), Some("batch-queue"));
    assert_eq!(q.labels.get("tier").map(String::as_str), Some("batch"));
    assert_eq!(q.result_ttl_seconds, 3600);
    assert_eq!(
        q.gate,
        GateSpec::Composite(CompositeParams {
            gates: vec![
                GateSpec::PrometheusSaturation(PrometheusSaturationParams {
                    pool: "p".into(),
                    namespace: None,
                    threshold: 0.7,
                    fallback: None,
                }),
                GateSpec::Redis(RedisParams {
                    address: "redis:6379".into(),
                    budget_key: "dispatch-gate-budget".into(),
                    missing: MissingBudget::Closed,
                }),
            ]
        })
    );
    // Errors inside the JSON name the variable and the path.
    let err = load_err(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "redis"),
            (
                "SLUICEGATE_QUEUES_JSON",
                r#"[{"queue_name":"q","igw_base_url":"http://g","gate_type":"constant","bogus":1}]"#,
            ),
        ],
    );
    assert!(
        err.contains("SLUICEGATE_QUEUES_JSON (queue[0].bogus): unknown key in a queue"),
        "{err}"
    );
}

#[test]
fn composite_and_wait_on_refuse_nest_in_toml() {
    let c = load(
        Some(
            r#"
transport = "memory"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
gate_type = "wait-on-refuse"
[queue.gate_params.gate]
gate_type = "composite"
[[queue.gate_params.gate.gate_params.gates]]
gate_type = "local-max-concurrency"
gate_params = { limit = 2, gating_mode = "classifying" }
[[queue.gate_params.gate.gate_params.gates]]
gate_type = "redis-quota"
gate_params = { address = "127.0.0.1:6379", limit = "5", window = "30s", mode = "concurrency" }
"#,
        ),
        &[],
        Overrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let GateSpec::WaitOnRefuse(WaitOnRefuseParams { gate }) = &c.queues[0].gate else {
        panic!("{:?}", c.queues[0].gate)
    };
    let GateSpec::Composite(CompositeParams { gates }) = gate.as_ref() else {
        panic!("{gate:?}")
    };
    assert_eq!(gates.len(), 2);
    assert!(matches!(
        &gates[1],
        GateSpec::RedisQuota(RedisQuotaParams { limit: 5, window, .. }) if *window == Duration::from_secs(30)
    ));
    // The redacted TOML of a nested gate loads back to the same config.
    let again = Config::from_toml_str(&c.to_redacted_toml(), &BTreeMap::new())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, c);
}

#[test]
fn prometheus_gates_require_a_prometheus_url() {
    let err = load_err(
        None,
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
            ("SLUICEGATE_GATE_TYPE", "prometheus-budget"),
            ("SLUICEGATE_GATE_PARAMS", r#"{"pool":"p"}"#),
        ],
    );
    assert!(
        err.contains("prometheus.url: required by queue[0]"),
        "{err}"
    );
    assert!(err.contains("SLUICEGATE_PROMETHEUS_URL"), "{err}");
}

#[test]
fn every_example_config_parses() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("config/ exists") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        seen += 1;
        let c = Config::load(&ConfigSources {
            file: Some(path.clone()),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!c.summary().is_empty());
        // What `config show` prints loads back to the same config.
        let again = Config::from_toml_str(&c.to_redacted_toml(), &BTreeMap::new())
            .unwrap_or_else(|e| panic!("{} redacted: {e}", path.display()));
        assert_eq!(again, c, "{}", path.display());
    }
    assert!(seen >= 5, "expected the example configs, found {seen}");
}

#[test]
fn sidecar_example_has_the_expected_gate() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/sidecar.toml");
    let c = Config::load(&ConfigSources {
        file: Some(path),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.queues[0].gate,
        GateSpec::PrometheusBudget(PrometheusBudgetParams {
            pool: "my-pool".into(),
            namespace: Some("llm".into()),
            max_concurrency: 10.0,
            baseline: 0.1,
            fallback: None,
        })
    );
    assert_eq!(c.queues[0].rounding, Rounding::AtLeastOne);
}

#[test]
fn docs_list_every_variable_gate_type_and_parameter() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let docs = std::fs::read_to_string(&path).expect("docs/configuration.md exists");
    for var in known_env_vars() {
        assert!(docs.contains(&var), "{var} is not documented");
    }
    for var in CONTRACT_ENV_VARS {
        assert!(docs.contains(var), "{var} is not documented");
    }
    for t in GATE_TYPES {
        assert!(
            docs.contains(&format!("`{t}`")),
            "gate {t} is not documented"
        );
        for p in sluicegate::config::allowed_params(t).unwrap_or(&[]) {
            assert!(
                docs.contains(&format!("`{p}`")),
                "param {t}.{p} is not documented"
            );
        }
    }
}

#[test]
fn summary_names_queues_and_gates() {
    let c = load(Some(MINIMAL), &[], Overrides::default()).unwrap_or_else(|e| panic!("{e}"));
    let s = c.summary();
    assert!(s.contains("transport: memory"), "{s}");
    assert!(
        s.contains("q -> http://127.0.0.1:8000/v1/completions"),
        "{s}"
    );
    assert!(s.contains("gate constant"), "{s}");
}

#[test]
fn every_contract_variable_is_known() {
    let known = known_env_vars();
    for v in CONTRACT_ENV_VARS {
        assert!(known.iter().any(|k| k == v), "{v}");
    }
    assert!(
        known
            .iter()
            .any(|k| k == "SLUICEGATE_DISPATCH_POLL_INTERVAL")
    );
    assert!(known.iter().any(|k| k == "SLUICEGATE_GATEWAY_TOKEN"));
    assert!(known.iter().any(|k| k == "SLUICEGATE_REDIS_PASSWORD"));
    assert!(known.iter().any(|k| k == "SLUICEGATE_QUEUE_MAX_SYS"));
}

#[test]
fn unknown_variable_suggests_the_close_name_and_lists_its_section() {
    let msg = load_err(None, &[("SLUICEGATE_DISPATCH_POLL_INTERVALL", "1s")]);
    assert!(
        msg.contains("did you mean SLUICEGATE_DISPATCH_POLL_INTERVAL"),
        "{msg}"
    );
    assert!(msg.contains("SLUICEGATE_DISPATCH_LEASE"), "{msg}");
}

#[test]
fn sources_debug_hides_values() {
    let sources = ConfigSources {
        env: [("SLUICEGATE_GATEWAY_TOKEN".to_owned(), "s3cr3t".to_owned())].into(),
        ..Default::default()
    };
    let shown = format!("{sources:?}");
    assert!(shown.contains("SLUICEGATE_GATEWAY_TOKEN"), "{shown}");
    assert!(!shown.contains("s3cr3t"), "{shown}");
}

#[test]
fn display_names_origin_and_key_one_error_per_line() {
    let errs = ConfigErrors(vec![
        ConfigError::new("gateway.url", "must be an http(s) URL"),
        ConfigError::new("queue[0].gate_type", "unknown gate type")
            .with_origin("SLUICEGATE_GATE_TYPE"),
    ]);
    let text = errs.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0], "gateway.url: must be an http(s) URL");
    assert_eq!(
        lines[1],
        "SLUICEGATE_GATE_TYPE (queue[0].gate_type): unknown gate type"
    );
}

#[test]
fn secret_never_prints_its_value() {
    let s = Secret::new("hunter2");
    assert_eq!(format!("{s}"), REDACTED);
    assert_eq!(format!("{s:?}"), REDACTED);
    assert_eq!(
        serde_json::to_string(&s).unwrap_or_default(),
        "\"<redacted>\""
    );
    assert_eq!(s.expose(), "hunter2");
}

#[test]
fn endpoint_url_masks_password_but_keeps_user() {
    let u = Url::parse("redis://alice:hunter2@db:6379/0").unwrap_or_else(|e| panic!("{e}"));
    let e = EndpointUrl::new(u);
    assert!(e.has_password());
    let shown = format!("{e} {e:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("alice:****@db"), "{shown}");
    assert_eq!(e.expose().password(), Some("hunter2"));
}

#[test]
fn zero_congestion_and_wait_delays_are_errors_naming_the_key() {
    // Zero would let a 429 storm through, or re-claim a refused message in
    // a loop; both used to be accepted.
    for key in [
        "congestion_backoff",
        "congestion_max_backoff",
        "wait_requeue_delay",
    ] {
        let text = format!("{MINIMAL}\n[dispatch]\n{key} = \"0s\"\n");
        let err = load_err(Some(&text), &[]);
        assert!(err.contains(&format!("dispatch.{key}")), "{key}: {err}");
        assert!(err.contains("greater than 0"), "{key}: {err}");
    }
    let err = load_err(
        Some(&format!(
            "{MINIMAL}\n[dispatch]\ncongestion_backoff = \"10s\"\ncongestion_max_backoff = \"5s\"\n"
        )),
        &[],
    );
    assert!(err.contains("dispatch.congestion_max_backoff"), "{err}");
}

#[test]
fn inert_after_is_a_positive_duration_named_in_its_errors() {
    // Default: 10 minutes, longer than a normal busy period (docs/metrics.md,
    // "Inert gates").
    let ok = |file: &str, env: &[(&str, &str)]| {
        load(Some(file), env, Overrides::default()).expect("valid config")
    };
    let config = ok(MINIMAL, &[]);
    assert_eq!(config.dispatch.inert_after, Duration::from_secs(600));
    let config = ok(
        &format!("{MINIMAL}\n[dispatch]\ninert_after = \"90s\"\n"),
        &[],
    );
    assert_eq!(config.dispatch.inert_after, Duration::from_secs(90));
    let config = ok(MINIMAL, &[("SLUICEGATE_DISPATCH_INERT_AFTER", "15m")]);
    assert_eq!(config.dispatch.inert_after, Duration::from_secs(900));
    for bad in ["0s", "soon"] {
        let text = format!("{MINIMAL}\n[dispatch]\ninert_after = \"{bad}\"\n");
        let err = load_err(Some(&text), &[]);
        assert!(err.contains("dispatch.inert_after"), "{bad}: {err}");
    }
}
