//! Round trips: a typed config survives `to_redacted_toml` → load, duration
//! text survives format → parse, and arbitrary gate parameters never panic
//! the loader.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Map, Value};
use sluicegate::config::{
    Config, DispatchConfig, EmbeddedConfig, EndpointUrl, GATE_TYPES, GateSpec, GatewayConfig,
    GatingMode, MergePolicyKind, MissingBudget, ObjectiveHeader, PaceKind, PrometheusConfig,
    PubSubConfig, QueueConfig, QuotaMode, Rounding, SharedWindowKind, SqlConfig, TelemetryConfig,
    TransportKind, Unit, allowed_params,
};
use sluicegate::config::{format_duration, parse_duration};
use sluicegate::gate::{
    CompositeParams, ConstantDecisionParams, ConstantParams, DeadlineDropParams, Decision,
    EndpointScrapeParams, LoadSource, LocalMaxConcurrencyParams, LocalRateLimitParams,
    MissingAttribute, PrometheusBudgetParams, PrometheusQueryParams, PrometheusSaturationParams,
    RedisLeasedRateParams, RedisParams, RedisQuotaParams, TierPriorityAdmissionParams, VllmParams,
    WaitOnRefuseParams,
};
use sluicegate::telemetry::LogFormat;
use url::Url;

fn name() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9-]{0,10}"
}

fn fraction() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), Just(1.0), 0.0..=1.0f64]
}

fn positive() -> impl Strategy<Value = f64> {
    prop_oneof![Just(100.0), 1e-3..1e9f64]
}

fn http_url() -> impl Strategy<Value = String> {
    // No hyphen in the host: a name like `xn--a` is an invalid IDNA label
    // and does not parse as a URL (a generated case failed that way).
    ("[a-z][a-z0-9]{0,10}", 1u16..65535, "(/[a-z0-9]{1,6}){0,2}")
        .prop_map(|(h, p, path)| format!("http://{h}:{p}{path}"))
}

fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    proptest::collection::btree_map(name(), "[a-zA-Z0-9_.-]{1,8}", 0..3)
}

fn duration_ms(lo: u64, hi: u64) -> impl Strategy<Value = Duration> {
    (lo..hi).prop_map(Duration::from_millis)
}

fn gating_mode() -> impl Strategy<Value = GatingMode> {
    prop_oneof![Just(GatingMode::Blocking), Just(GatingMode::Classifying)]
}

fn leaf_gate() -> impl Strategy<Value = GateSpec> {
    prop_oneof![
        Just(GateSpec::Constant(ConstantParams {})),
        (1u32..10_000, gating_mode()).prop_map(|(limit, gating_mode)| {
            GateSpec::LocalMaxConcurrency(LocalMaxConcurrencyParams { limit, gating_mode })
        }),
        (
            name(),
            name(),
            prop_oneof![
                Just(MissingBudget::Closed),
                fraction().prop_map(MissingBudget::Fallback)
            ]
        )
            .prop_map(|(h, budget_key, missing)| GateSpec::Redis(RedisParams {
                address: format!("{h}:6379"),
                budget_key,
                missing
            })),
        (
            name(),
            proptest::option::of(name()),
            fraction(),
            proptest::option::of(fraction())
        )
            .prop_map(|(pool, namespace, threshold, fallback)| {
                GateSpec::PrometheusSaturation(PrometheusSaturationParams {
                    pool,
                    namespace,
                    threshold,
                    fallback,
                })
            }),
        (
            name(),
            proptest::option::of(name()),
            positive(),
            fraction(),
            proptest::option::of(fraction())
        )
            .prop_map(|(pool, namespace, max_concurrency, baseline, fallback)| {
                GateSpec::PrometheusBudget(PrometheusBudgetParams {
                    pool,
                    namespace,
                    max_concurrency,
                    baseline,
                    fallback,
                })
            }),
        (
            "[a-z_:]{1,12}",
            proptest::option::of(fraction()),
            proptest::option::of(name())
        )
            .prop_map(|(query, fallback, pool)| GateSpec::PrometheusQuery(
                PrometheusQueryParams {
                    query,
                    fallback,
                    pool
                }
            )),
        (
            http_url(),
            name(),
            labels(),
            prop_oneof![Just(0.0), positive()],
            fraction(),
            proptest::option::of(fraction()),
            proptest::option::of(http_url()),
            proptest::option::of(name()),
            labels()
        )
            .prop_map(
                |(
                    url,
                    metric,
                    labels,
                    max_count_per_pod,
                    baseline,
                    fallback,
                    pods_url,
                    pods_metric,
                    pods_labels,
                )| {
                    let sees_own_load = metric.len() % 2 == 0;
                    GateSpec::EndpointScrape(EndpointScrapeParams {
                        url,
                        metric,
                        labels,
                        max_count_per_pod,
                        baseline,
                        fallback,
                        pods_url,
                        pods_metric,
                        sees_own_load,
                        pods_labels,
                        ..Default::default()
                    })
                }
            ),
        (
            name(),
            name(),
            prop_oneof![Just(QuotaMode::RateLimit), Just(QuotaMode::Concurrency)],
            1u32..100_000,
            duration_ms(1, 10_000_000),
            "[a-z:]{1,8}",
            gating_mode(),
            prop_oneof![
                Just(MissingAttribute::Refuse),
                Just(MissingAttribute::Allow)
            ],
            any::<bool>(),
            duration_ms(1000, 600_000),
        )
            .prop_map(
                |(
                    h,
                    attribute,
                    mode,
                    limit,
                    window,
                    prefix,
                    gating_mode,
                    missing_attribute,
                    admit_overflow,
                    lease,
                )| {
                    GateSpec::RedisQuota(RedisQuotaParams {
                        address: format!("{h}:6379"),
                        attribute,
                        mode,
                        limit,
                        window,
                        prefix,
                        gating_mode,
                        missing_attribute,
                        admit_overflow,
                        lease,
                    })
                }
            ),
        (
            proptest::collection::vec(http_url(), 1..3),
            (0.001..=1.0f64),
            positive(),
            proptest::option::of(1u32..1024),
            fraction()
        )
            .prop_map(
                |(urls, kv_ceiling, queue_threshold, max_num_seqs, baseline)| GateSpec::Vllm(
                    VllmParams {
                        urls,
                        kv_ceiling,
                        queue_threshold,
                        max_num_seqs,
                        baseline
                    }
                )
            ),
        (positive(), 1.0..1e6f64).prop_map(|(requests_per_minute, burst)| {
            GateSpec::LocalRateLimit(LocalRateLimitParams {
                requests_per_minute,
                burst,
            })
        }),
        prop_oneof![
            Just(Decision::Continue),
            Just(Decision::Drop),
            Just(Decision::Refuse)
        ]
        .prop_map(|decision| GateSpec::ConstantDecision(ConstantDecisionParams { decision })),
        duration_ms(0, 600_000)
            .prop_map(|min_remaining| GateSpec::DeadlineDrop(DeadlineDropParams { min_remaining })),
        (
            name(),
            "[a-z:]{1,12}",
            proptest::option::of(name()),
            positive(),
            proptest::option::of("[a-z:]{1,12}")
        )
            .prop_map(|(h, control_key, pool_id, burst_seconds, state_key)| {
                GateSpec::RedisLeasedRate(RedisLeasedRateParams {
                    address: format!("{h}:6379"),
                    control_key,
                    pool_id,
                    burst_seconds,
                    state_key,
                })
            }),
        (name(), 1u32..100_000, proptest::option::of(0u32..1000)).prop_map(|(bucket, ttl, cap)| {
            GateSpec::TierPriorityAdmission(TierPriorityAdmissionParams {
                source: Some(LoadSource::RedisCounter),
                bucket: Some(bucket),
                ttl_seconds: Some(ttl),
                fallback_cap: cap,
                fail_fast_status: Some(503),
                ..Default::default()
            })
        }),
    ]
}

fn gate() -> impl Strategy<Value = GateSpec> {
    leaf_gate().prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 1..3)
                .prop_map(|gates| GateSpec::Composite(CompositeParams { gates })),
            inner
                .clone()
                .prop_map(|g| GateSpec::WaitOnRefuse(WaitOnRefuseParams { gate: Box::new(g) })),
            (inner, name()).prop_map(|(g, tier_label)| GateSpec::TierPriorityAdmission(
                TierPriorityAdmissionParams {
                    saturation_gate: Some(Box::new(g)),
                    tier_label,
                    ..Default::default()
                }
            )),
        ]
    })
}

fn endpoint(s: &str) -> EndpointUrl {
    EndpointUrl::new(Url::parse(s).expect("generated URL parses"))
}

fn queue() -> impl Strategy<Value = QueueConfig> {
    (
        (
            name(),
            http_url(),
            "(/[a-z0-9]{1,6}){1,3}",
            proptest::option::of(name()),
            name(),
            labels(),
        ),
        (
            name(),
            0u64..1_000_000,
            positive(),
            proptest::option::of(-100i64..100),
        ),
        (
            prop_oneof![Just(Unit::Requests), Just(Unit::Tokens), Just(Unit::Bytes)],
            prop_oneof![
                Just(Rounding::Floor),
                Just(Rounding::Ceil),
                Just(Rounding::AtLeastOne)
            ],
            gate(),
        ),
    )
        .prop_map(
            |(
                (queue_name, url, request_path_url, inference_objective, worker_pool_id, labels),
                (result_queue_name, result_ttl_seconds, max_sys, engine_priority),
                (unit, rounding, gate),
            )| QueueConfig {
                queue_name,
                igw_base_url: endpoint(&url),
                request_path_url,
                inference_objective: inference_objective.clone(),
                engine_priority,
                // A pool named like the result list: any valid name.
                pool: Some(result_queue_name.clone()),
                worker_pool_id,
                // Any optional name: the objective's will do.
                id: inference_objective.clone(),
                labels,
                result_queue_name: Some(result_queue_name),
                result_ttl_seconds,
                max_sys,
                unit,
                rounding,
                gate,
            },
        )
}

fn dispatch() -> impl Strategy<Value = DispatchConfig> {
    (
        (
            duration_ms(1, 10_000),
            duration_ms(0, 100_000),
            duration_ms(1000, 10_000_000),
            duration_ms(0, 60_000),
        ),
        (
            proptest::option::of(1u32..100),
            duration_ms(1, 10_000),
            duration_ms(0, 100_000),
        ),
        (
            // Zero congestion and wait delays are config errors (a refused
            // message could be re-claimed in a loop).
            duration_ms(1, 60_000),
            duration_ms(1, 60_000),
            duration_ms(0, 600_000),
            duration_ms(1, 100_000_000),
        ),
        duration_ms(0, 600_000),
        (
            0usize..=4096,
            proptest::collection::btree_map("[a-z][a-z0-9-]{0,6}", 1u32..100, 0..3),
            1u64..=i64::MAX as u64,
        ),
    )
        .prop_map(
            |(
                (poll_interval, extra_staleness, lease, receive_wait),
                (max_attempts, retry_initial_backoff, extra_backoff),
                (congestion_backoff, wait_requeue_delay, shutdown_grace, default_deadline),
                extra_congestion,
                (tenant_lookahead, tenant_weights, max_buffered_bytes),
            )| DispatchConfig {
                tenant_lookahead,
                tenant_weights,
                max_buffered_bytes,
                poll_interval,
                max_staleness: poll_interval + extra_staleness,
                lease,
                receive_wait,
                max_attempts,
                retry_initial_backoff,
                retry_max_backoff: retry_initial_backoff + extra_backoff,
                congestion_backoff,
                congestion_max_backoff: congestion_backoff + extra_congestion,
                wait_requeue_delay,
                shutdown_grace,
                default_deadline,
                // `redis` needs a [redis] section, which these transports
                // do not have: the lease and chunk still round-trip.
                shared_window: SharedWindowKind::Off,
                shared_window_lease: lease.max(std::time::Duration::from_secs(1)),
                shared_window_chunk: 1 + lease.as_secs() % 64,
                pace: [PaceKind::Off, PaceKind::Requests, PaceKind::Tokens]
                    [(lease.as_millis() % 3) as usize],
                pace_rate: 0.5 + (poll_interval.as_millis() % 5000) as f64,
                pace_burst: 0.25 + (lease.as_secs() % 64) as f64,
                inert_after: default_deadline,
                cancel_check_interval: lease.max(std::time::Duration::from_millis(100)),
                // `tier-priority` would refuse the random `tier` labels of
                // the queues; its keys round-trip under any policy.
                merge_policy: [MergePolicyKind::FirstCome, MergePolicyKind::RandomRobin]
                    [(lease.as_millis() % 2) as usize],
                merge_tier_label: "tier".to_owned(),
                merge_priority_header: (poll_interval.as_millis() % 2 == 0)
                    .then(|| "x-gateway-priority".to_owned()),
                merge_min_share: (lease.as_secs() % 11) as f64 * 0.05,
                merge_share_window: 10 + lease.as_secs() % 1000,
            },
        )
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop_oneof![
            Just(TransportKind::Memory),
            Just(TransportKind::Embedded),
            Just(TransportKind::PubSub),
            Just(TransportKind::Sql)
        ],
        (
            proptest::option::of(http_url()),
            "(/[a-z0-9]{1,6}){1,2}",
            duration_ms(1, 1_000_000),
            1u64..1 << 40,
            1usize..1000,
        ),
        (
            prop_oneof![Just(ObjectiveHeader::Gateway), Just(ObjectiveHeader::LlmD)],
            proptest::option::of(name()),
        ),
        proptest::option::of(http_url()),
        dispatch(),
        (
            1u16..65535,
            prop_oneof![Just(LogFormat::Text), Just(LogFormat::Json)],
            prop_oneof![Just("info"), Just("warn,sluicegate=debug")],
        ),
        proptest::collection::vec(queue(), 1..3),
    )
        .prop_map(
            |(
                transport,
                (url, request_path, attempt_timeout, max_response_bytes, max_conn),
                (objective_header, fairness_attribute),
                prom,
                dispatch,
                (port, log_format, log_level),
                mut queues,
            )| {
                // Names must be unique.
                for (i, q) in queues.iter_mut().enumerate() {
                    q.queue_name = format!("{}-{i}", q.queue_name);
                }
                Config {
                    transport,
                    gateway: GatewayConfig {
                        url: url.as_deref().map(endpoint),
                        request_path,
                        attempt_timeout,
                        max_response_bytes,
                        max_connections_per_host: max_conn,
                        objective_header,
                        fairness_attribute,
                        ..GatewayConfig::default()
                    },
                    redis: None,
                    // From OTEL variables, not the file: not rendered.
                    traces: None,
                    prometheus: prom.map(|u| PrometheusConfig {
                        url: endpoint(&u),
                        bearer_token: None,
                        bearer_token_file: None,
                        basic_user: None,
                        basic_password: None,
                        basic_password_file: None,
                    }),
                    pubsub: (transport == TransportKind::PubSub).then(|| PubSubConfig {
                        project_id: "proj".into(),
                        result_topic_id: Some("results".into()),
                        emulator_host: Some("127.0.0.1:8085".into()),
                        credentials_file: None,
                        ..PubSubConfig::default()
                    }),
                    embedded: (transport == TransportKind::Embedded).then(|| EmbeddedConfig {
                        path: PathBuf::from("data/s.db"),
                    }),
                    sql: (transport == TransportKind::Sql).then(|| SqlConfig {
                        url: Some(endpoint("postgres://postgres@127.0.0.1:5432/postgres")),
                        result_queue_name: "results".into(),
                        batch_size: 25,
                        ..SqlConfig::default()
                    }),
                    dispatch,
                    telemetry: TelemetryConfig {
                        listen: SocketAddr::from(([127, 0, 0, 1], port)),
                        log_format,
                        log_level: log_level.to_owned(),
                    },
                    queues,
                }
            },
        )
}

fn uses_prometheus(c: &Config) -> bool {
    let mut found = false;
    for q in &c.queues {
        q.gate.visit(&mut |g| {
            found |= matches!(
                g,
                GateSpec::PrometheusBudget { .. }
                    | GateSpec::PrometheusSaturation { .. }
                    | GateSpec::PrometheusQuery { .. }
            );
        });
    }
    found
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,12}".prop_map(Value::from),
        prop_oneof![
            Just("0.5"),
            Just("-1"),
            Just("1e400"),
            Just("NaN"),
            Just("[]"),
            Just("{}"),
            Just("5m"),
            Just("closed")
        ]
        .prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("gate_type".to_owned()),
                    Just("gate_params".to_owned()),
                    ".{0,6}"
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn gate_params() -> impl Strategy<Value = Map<String, Value>> {
    let known: Vec<&'static str> = GATE_TYPES
        .iter()
        .flat_map(|t| allowed_params(t).unwrap_or(&[]).iter().copied())
        .collect();
    proptest::collection::vec(
        (
            prop_oneof![proptest::sample::select(known), Just("bogus")],
            json_value(),
        ),
        0..6,
    )
    .prop_map(|pairs| pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn typed_config_round_trips_through_redacted_toml(mut c in config()) {
        if uses_prometheus(&c) && c.prometheus.is_none() {
            c.prometheus = Some(PrometheusConfig {
                url: endpoint("http://prom:9090"),
                bearer_token: None,
                bearer_token_file: None,
                basic_user: None,
                basic_password: None,
                basic_password_file: None,
            });
        }
        if c.gateway.url.is_none() {
            // Queues all carry their own URL, so a missing default is fine.
        }
        let text = c.to_redacted_toml();
        let again = Config::from_toml_str(&text, &BTreeMap::new());
        prop_assert!(again.is_ok(), "{}\n---\n{}", again.err().map(|e| e.to_string()).unwrap_or_default(), text);
        prop_assert_eq!(again.ok(), Some(c), "{}", text);
    }

    #[test]
    fn random_gate_params_never_panic_the_loader(
        gate_type in prop_oneof![proptest::sample::select(GATE_TYPES.to_vec()).prop_map(str::to_owned), ".{0,8}"],
        params in gate_params(),
        as_env in any::<bool>(),
    ) {
        let params_json = Value::Object(params.clone()).to_string();
        let mut env: BTreeMap<String, String> = [
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:8000"),
            ("SLUICEGATE_PROMETHEUS_URL", "http://127.0.0.1:9090"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        env.insert("SLUICEGATE_GATE_TYPE".into(), gate_type.clone());
        if as_env {
            env.insert("SLUICEGATE_GATE_PARAMS".into(), params_json);
        } else {
            env.insert(
                "SLUICEGATE_QUEUES_JSON".into(),
                serde_json::json!([{"gate_type": gate_type, "gate_params": params}]).to_string(),
            );
        }
        match Config::from_toml_str("", &env) {
            Ok(c) => {
                // Whatever loads must render and load back the same.
                let again = Config::from_toml_str(&c.to_redacted_toml(), &BTreeMap::new());
                prop_assert_eq!(again.ok(), Some(c));
            }
            Err(e) => {
                prop_assert!(!e.is_empty());
                for err in e.errors() {
                    prop_assert!(err.key.starts_with("queue") || err.key.starts_with("prometheus"), "{}", err);
                }
            }
        }
    }
}

#[test]
fn durations_parse_units_and_plain_seconds_and_plain_seconds() {
    let cases = [
        ("250ms", Duration::from_millis(250)),
        ("30s", Duration::from_secs(30)),
        ("5m", Duration::from_secs(300)),
        ("1h", Duration::from_secs(3600)),
        ("24h", Duration::from_secs(86_400)),
        ("1h30m", Duration::from_secs(5400)),
        ("1.5s", Duration::from_millis(1500)),
        ("30", Duration::from_secs(30)),
        ("0", Duration::ZERO),
        ("0.25", Duration::from_millis(250)),
        ("100us", Duration::from_micros(100)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_duration(text), Ok(want), "{text}");
    }
}

#[test]
fn durations_reject_garbage_naming_units() {
    for bad in [
        "",
        "s",
        "5 minutes",
        "-1s",
        "-3",
        "1x",
        "1.2.3s",
        "NaN",
        "inf",
    ] {
        let err = parse_duration(bad).expect_err(bad);
        assert!(err.contains("duration"), "{bad}: {err}");
    }
    assert!(
        parse_duration("5x")
            .expect_err("unit")
            .contains("ms, s, m, h")
    );
}

#[test]
fn durations_format_in_largest_exact_unit() {
    assert_eq!(format_duration(Duration::from_secs(86_400)), "1d");
    assert_eq!(format_duration(Duration::from_secs(7200)), "2h");
    assert_eq!(format_duration(Duration::from_secs(90)), "90s");
    assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
    assert_eq!(format_duration(Duration::ZERO), "0s");
    assert_eq!(format_duration(Duration::from_nanos(7)), "7ns");
}

proptest! {
    #[test]
    fn duration_format_then_parse_round_trips(nanos in 0u64..10_000_000_000_000) {
        let d = Duration::from_nanos(nanos);
        prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
    }

    #[test]
    fn duration_parse_never_panics_on_arbitrary_text(s in ".{0,20}") {
        let _ = parse_duration(&s);
    }
}
