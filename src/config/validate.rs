//! Raw → typed: defaults, conversions, ranges and cross-field rules. Every
//! problem is recorded in the context; the returned `Config` is only used
//! when no error was recorded, so placeholders for failed fields never
//! escape.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use url::Url;

use super::gate::parse_gate_spec;
use super::raw::{RawConfig, RawQueue};
use super::secret::{EndpointUrl, Secret};
use super::values::{
    Ctx, as_choice, as_duration, as_nonempty_string, as_positive_f64, as_string, as_string_map,
    as_u64, as_u64_in,
};
use super::{
    Config, DispatchConfig, EmbeddedConfig, GateSpec, GatewayConfig, LogFormat, ObjectiveHeader,
    PrometheusConfig, PubSubConfig, QueueConfig, RedisConfig, Rounding, TelemetryConfig,
    TransportKind, Unit,
};

const TRANSPORTS: [(&str, TransportKind); 6] = [
    ("memory", TransportKind::Memory),
    ("redis", TransportKind::Redis),
    ("redis-sortedset", TransportKind::Redis),
    ("pubsub", TransportKind::PubSub),
    ("gcp-pubsub", TransportKind::PubSub),
    ("embedded", TransportKind::Embedded),
];
const UNITS: [(&str, Unit); 3] = [
    ("requests", Unit::Requests),
    ("tokens", Unit::Tokens),
    ("bytes", Unit::Bytes),
];
const ROUNDINGS: [(&str, Rounding); 3] = [
    ("floor", Rounding::Floor),
    ("ceil", Rounding::Ceil),
    ("at-least-one", Rounding::AtLeastOne),
];
const LOG_FORMATS: [(&str, LogFormat); 2] = [("text", LogFormat::Text), ("json", LogFormat::Json)];
const OBJECTIVE_HEADERS: [(&str, ObjectiveHeader); 2] = [
    ("x-gateway-inference-objective", ObjectiveHeader::Gateway),
    ("x-llm-d-inference-objective", ObjectiveHeader::LlmD),
];

/// Default queue name (upstream's `request-sortedset`).
const DEFAULT_QUEUE_NAME: &str = "request-sortedset";

pub(crate) fn validate(raw: RawConfig, ctx: &mut Ctx) -> Config {
    let transport = match raw.transport.as_ref() {
        None => {
            ctx.err(
                "transport",
                "transport is required; allowed: memory, redis (alias redis-sortedset), pubsub (alias gcp-pubsub), embedded; set `transport` in the file or SLUICEGATE_TRANSPORT",
            );
            None
        }
        Some(v) => ctx.conv("transport", Some(v), |v| as_choice(v, &TRANSPORTS)),
    };
    let gateway = gateway(raw.gateway.unwrap_or_default(), ctx);
    let redis = match (raw.redis, transport) {
        (Some(r), _) => Some(redis(r, ctx)),
        (None, Some(TransportKind::Redis)) => Some(redis(Default::default(), ctx)),
        (None, _) => None,
    };
    let prometheus = raw.prometheus.map(|p| prometheus(p, ctx));
    let pubsub = match (raw.pubsub, transport) {
        (Some(p), _) => Some(pubsub(p, ctx)),
        (None, Some(TransportKind::PubSub)) => Some(pubsub(Default::default(), ctx)),
        (None, _) => None,
    };
    let embedded = match (raw.embedded, transport) {
        (Some(e), _) => Some(embedded(e, ctx)),
        (None, Some(TransportKind::Embedded)) => Some(embedded(Default::default(), ctx)),
        (None, _) => None,
    };
    let dispatch = dispatch(raw.dispatch.unwrap_or_default(), ctx);
    let telemetry = telemetry(raw.telemetry.unwrap_or_default(), ctx);

    let raw_queues = raw.queue.unwrap_or_default();
    if raw_queues.is_empty() {
        ctx.err(
            "queue",
            "at least one queue is required; add a [[queue]] table, or set SLUICEGATE_QUEUE / SLUICEGATE_GATE_TYPE (or SLUICEGATE_QUEUES_JSON)",
        );
    }
    let mut queues = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, q) in raw_queues.into_iter().enumerate() {
        if let Some(q) = queue(q, i, transport, &gateway, ctx) {
            if !seen.insert(q.queue_name.clone()) {
                ctx.err(
                    format!("queue[{i}].queue_name"),
                    format!(
                        "duplicate queue name {:?}; queue names must be unique",
                        q.queue_name
                    ),
                );
            }
            queues.push(q);
        }
    }
    // Gates that query Prometheus need somewhere to send the query.
    if prometheus.is_none() {
        for (i, q) in queues.iter().enumerate() {
            let mut needs = None;
            q.gate.visit(&mut |g| {
                if matches!(
                    g,
                    GateSpec::PrometheusBudget { .. }
                        | GateSpec::PrometheusSaturation { .. }
                        | GateSpec::PrometheusQuery { .. }
                ) {
                    needs.get_or_insert(g.upstream_name());
                }
            });
            if let Some(name) = needs {
                ctx.err(
                    "prometheus.url",
                    format!(
                        "required by queue[{i}] (gate `{name}` queries Prometheus); set [prometheus] url or SLUICEGATE_PROMETHEUS_URL"
                    ),
                );
            }
        }
    }

    Config {
        transport: transport.unwrap_or(TransportKind::Memory),
        gateway,
        redis,
        prometheus,
        pubsub,
        embedded,
        dispatch,
        telemetry,
        queues,
    }
}

/// An http(s) URL.
fn http_url(v: &Value) -> Result<EndpointUrl, String> {
    let s = as_string(v)?;
    let u = Url::parse(s.trim()).map_err(|e| format!("expected an http(s) URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!(
            "expected an http(s) URL, got scheme {:?}",
            u.scheme()
        ));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err("expected an http(s) URL with a host".to_owned());
    }
    Ok(EndpointUrl::new(u))
}

/// A URL path starting with '/'.
fn url_path(v: &Value) -> Result<String, String> {
    let s = as_string(v)?;
    if s.starts_with('/') && !s.contains(char::is_whitespace) {
        Ok(s)
    } else {
        Err(format!("must be a path starting with '/', got {s:?}"))
    }
}

fn optional_string(v: &Value) -> Result<Option<String>, String> {
    let s = as_string(v)?;
    Ok((!s.is_empty()).then_some(s))
}

/// A secret given inline or as a file (not both); the file is read now so
/// that `check-config` catches an unreadable one.
fn secret(
    ctx: &mut Ctx,
    key: &str,
    inline: Option<Value>,
    file_key: &str,
    file: Option<Value>,
) -> (Option<Secret>, Option<PathBuf>) {
    let path = ctx
        .conv(file_key, file.as_ref(), as_nonempty_string)
        .map(PathBuf::from);
    let value = match &inline {
        // Never echo the value: only its type is described.
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            ctx.err(key, "expected a string");
            None
        }
        None => None,
    };
    match (value, path) {
        (Some(_), Some(_)) => {
            ctx.err(key, format!("set either {key} or {file_key}, not both"));
            (None, None)
        }
        (Some(v), None) if v.is_empty() => {
            ctx.err(key, "must not be empty");
            (None, None)
        }
        (Some(v), None) => (Some(Secret::new(v)), None),
        (None, Some(p)) => match std::fs::read_to_string(&p) {
            Ok(text) => {
                let v = text.trim_end_matches(['\r', '\n']).to_owned();
                if v.is_empty() {
                    ctx.err(file_key, format!("{} is empty", p.display()));
                    (None, Some(p))
                } else {
                    (Some(Secret::new(v)), Some(p))
                }
            }
            Err(e) => {
                ctx.err(file_key, format!("cannot read {}: {e}", p.display()));
                (None, Some(p))
            }
        },
        (None, None) => (None, None),
    }
}

fn duration_at_least(
    ctx: &mut Ctx,
    key: &str,
    v: Option<&Value>,
    default: Duration,
    min: Duration,
) -> Duration {
    ctx.conv(key, v, |v| {
        let d = as_duration(v)?;
        if d < min {
            Err(if min == Duration::from_nanos(1) {
                "must be greater than 0".to_owned()
            } else {
                format!("must be at least {}", super::format_duration(min))
            })
        } else {
            Ok(d)
        }
    })
    .unwrap_or(default)
}

const NONZERO: Duration = Duration::from_nanos(1);

fn gateway(g: super::raw::RawGateway, ctx: &mut Ctx) -> GatewayConfig {
    let d = GatewayConfig::default();
    let (token, token_file) = secret(
        ctx,
        "gateway.token",
        g.token,
        "gateway.token_file",
        g.token_file,
    );
    GatewayConfig {
        url: ctx.conv("gateway.url", g.url.as_ref(), http_url),
        request_path: ctx
            .conv("gateway.request_path", g.request_path.as_ref(), url_path)
            .unwrap_or(d.request_path),
        attempt_timeout: duration_at_least(
            ctx,
            "gateway.attempt_timeout",
            g.attempt_timeout.as_ref(),
            d.attempt_timeout,
            NONZERO,
        ),
        connect_timeout: duration_at_least(
            ctx,
            "gateway.connect_timeout",
            g.connect_timeout.as_ref(),
            d.connect_timeout,
            NONZERO,
        ),
        max_response_bytes: ctx
            .conv(
                "gateway.max_response_bytes",
                g.max_response_bytes.as_ref(),
                |v| as_u64_in(v, 1, u64::MAX),
            )
            .unwrap_or(d.max_response_bytes),
        max_connections_per_host: ctx
            .conv(
                "gateway.max_connections_per_host",
                g.max_connections_per_host.as_ref(),
                |v| {
                    let n = as_u64_in(v, 1, 1 << 20)?;
                    usize::try_from(n).map_err(|_| "too large".to_owned())
                },
            )
            .unwrap_or(d.max_connections_per_host),
        token,
        token_file,
        objective_header: ctx
            .conv(
                "gateway.objective_header",
                g.objective_header.as_ref(),
                |v| as_choice(v, &OBJECTIVE_HEADERS),
            )
            .unwrap_or(d.objective_header),
        fairness_attribute: match g.fairness_attribute {
            None => d.fairness_attribute,
            Some(v) => ctx
                .conv("gateway.fairness_attribute", Some(&v), optional_string)
                .flatten(),
        },
    }
}

fn redis(r: super::raw::RawRedis, ctx: &mut Ctx) -> RedisConfig {
    let url = ctx
        .conv("redis.url", r.url.as_ref(), |v| {
            let s = as_string(v)?;
            let u = Url::parse(s.trim())
                .map_err(|e| format!("expected a redis:// or rediss:// URL: {e}"))?;
            if !matches!(u.scheme(), "redis" | "rediss") {
                return Err(format!(
                    "expected a redis:// or rediss:// URL, got scheme {:?}",
                    u.scheme()
                ));
            }
            Ok(EndpointUrl::new(u))
        })
        .unwrap_or_else(default_redis_url);
    let (password, password_file) = secret(
        ctx,
        "redis.password",
        r.password,
        "redis.password_file",
        r.password_file,
    );
    if password.is_some() && url.has_password() {
        ctx.err(
            "redis.password",
            "the password is also in redis.url; give it once",
        );
    }
    RedisConfig {
        url,
        username: ctx
            .conv("redis.username", r.username.as_ref(), optional_string)
            .flatten(),
        password,
        password_file,
    }
}

/// Default `[redis] url`.
pub(crate) const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/0";

/// Parses a URL constant of this module.
fn constant_url(text: &'static str) -> EndpointUrl {
    // Invariant: only called with the valid literal URLs of this module
    // (checked by the `constant_urls_parse` test).
    #[allow(clippy::expect_used)]
    EndpointUrl::new(Url::parse(text).expect("constant URL is valid"))
}

fn default_redis_url() -> EndpointUrl {
    constant_url(DEFAULT_REDIS_URL)
}

fn prometheus(p: super::raw::RawPrometheus, ctx: &mut Ctx) -> PrometheusConfig {
    let url = ctx.conv("prometheus.url", p.url.as_ref(), http_url);
    if p.url.is_none() {
        ctx.err(
            "prometheus.url",
            "required when [prometheus] is configured; an http(s) URL such as http://127.0.0.1:9090",
        );
    }
    let (bearer_token, bearer_token_file) = secret(
        ctx,
        "prometheus.bearer_token",
        p.bearer_token,
        "prometheus.bearer_token_file",
        p.bearer_token_file,
    );
    let (basic_password, basic_password_file) = secret(
        ctx,
        "prometheus.basic_password",
        p.basic_password,
        "prometheus.basic_password_file",
        p.basic_password_file,
    );
    let basic_user = ctx
        .conv(
            "prometheus.basic_user",
            p.basic_user.as_ref(),
            optional_string,
        )
        .flatten();
    if bearer_token.is_some() && (basic_user.is_some() || basic_password.is_some()) {
        ctx.err(
            "prometheus.bearer_token",
            "use either a bearer token or basic auth (basic_user/basic_password), not both",
        );
    }
    if basic_password.is_some() && basic_user.is_none() {
        ctx.err(
            "prometheus.basic_user",
            "required when basic_password is set",
        );
    }
    PrometheusConfig {
        // Placeholder only when an error was recorded (the config is then discarded).
        url: url.unwrap_or_else(|| constant_url("http://127.0.0.1:9090")),
        bearer_token,
        bearer_token_file,
        basic_user,
        basic_password,
        basic_password_file,
    }
}

fn pubsub(p: super::raw::RawPubSub, ctx: &mut Ctx) -> PubSubConfig {
    if p.project_id.is_none() {
        ctx.err(
            "pubsub.project_id",
            "required for the pubsub transport (the GCP project id); set [pubsub] project_id or SLUICEGATE_PUBSUB_PROJECT_ID",
        );
    }
    PubSubConfig {
        project_id: ctx
            .conv(
                "pubsub.project_id",
                p.project_id.as_ref(),
                as_nonempty_string,
            )
            .unwrap_or_default(),
        result_topic_id: ctx
            .conv(
                "pubsub.result_topic_id",
                p.result_topic_id.as_ref(),
                optional_string,
            )
            .flatten(),
        emulator_host: ctx
            .conv("pubsub.emulator_host", p.emulator_host.as_ref(), |v| {
                let s = as_string(v)?;
                if s.is_empty() {
                    return Ok(None);
                }
                match s.rsplit_once(':') {
                    Some((h, port)) if !h.is_empty() && port.parse::<u16>().is_ok() => Ok(Some(s)),
                    _ => Err(format!("expected host:port, got {s:?}")),
                }
            })
            .flatten(),
    }
}

fn embedded(e: super::raw::RawEmbedded, ctx: &mut Ctx) -> EmbeddedConfig {
    EmbeddedConfig {
        path: ctx
            .conv("embedded.path", e.path.as_ref(), as_nonempty_string)
            .map_or_else(|| PathBuf::from("sluicegate.db"), PathBuf::from),
    }
}

fn dispatch(r: super::raw::RawDispatch, ctx: &mut Ctx) -> DispatchConfig {
    let d = DispatchConfig::default();
    let zero = Duration::ZERO;
    let poll_interval = duration_at_least(
        ctx,
        "dispatch.poll_interval",
        r.poll_interval.as_ref(),
        d.poll_interval,
        NONZERO,
    );
    let max_staleness = duration_at_least(
        ctx,
        "dispatch.max_staleness",
        r.max_staleness.as_ref(),
        d.max_staleness,
        NONZERO,
    );
    if max_staleness < poll_interval {
        ctx.err(
            "dispatch.max_staleness",
            format!(
                "must be at least dispatch.poll_interval ({}), or every observation would be stale; got {}",
                super::format_duration(poll_interval),
                super::format_duration(max_staleness)
            ),
        );
    }
    let retry_initial_backoff = duration_at_least(
        ctx,
        "dispatch.retry_initial_backoff",
        r.retry_initial_backoff.as_ref(),
        d.retry_initial_backoff,
        NONZERO,
    );
    let retry_max_backoff = duration_at_least(
        ctx,
        "dispatch.retry_max_backoff",
        r.retry_max_backoff.as_ref(),
        d.retry_max_backoff,
        NONZERO,
    );
    if retry_max_backoff < retry_initial_backoff {
        ctx.err(
            "dispatch.retry_max_backoff",
            format!(
                "must be at least dispatch.retry_initial_backoff ({})",
                super::format_duration(retry_initial_backoff)
            ),
        );
    }
    DispatchConfig {
        poll_interval,
        max_staleness,
        lease: duration_at_least(
            ctx,
            "dispatch.lease",
            r.lease.as_ref(),
            d.lease,
            Duration::from_secs(1),
        ),
        receive_wait: duration_at_least(
            ctx,
            "dispatch.receive_wait",
            r.receive_wait.as_ref(),
            d.receive_wait,
            zero,
        ),
        max_attempts: ctx
            .conv("dispatch.max_attempts", r.max_attempts.as_ref(), |v| {
                let n = as_u64_in(v, 0, u64::from(u32::MAX))
                    .map_err(|e| format!("{e} (0 = unlimited)"))?;
                Ok(u32::try_from(n).ok().filter(|n| *n > 0))
            })
            .unwrap_or(d.max_attempts),
        retry_initial_backoff,
        retry_max_backoff,
        congestion_backoff: duration_at_least(
            ctx,
            "dispatch.congestion_backoff",
            r.congestion_backoff.as_ref(),
            d.congestion_backoff,
            zero,
        ),
        wait_requeue_delay: duration_at_least(
            ctx,
            "dispatch.wait_requeue_delay",
            r.wait_requeue_delay.as_ref(),
            d.wait_requeue_delay,
            zero,
        ),
        shutdown_grace: duration_at_least(
            ctx,
            "dispatch.shutdown_grace",
            r.shutdown_grace.as_ref(),
            d.shutdown_grace,
            zero,
        ),
        default_deadline: duration_at_least(
            ctx,
            "dispatch.default_deadline",
            r.default_deadline.as_ref(),
            d.default_deadline,
            NONZERO,
        ),
    }
}

fn telemetry(t: super::raw::RawTelemetry, ctx: &mut Ctx) -> TelemetryConfig {
    let d = TelemetryConfig::default();
    TelemetryConfig {
        listen: ctx
            .conv("telemetry.listen", t.listen.as_ref(), |v| {
                let s = as_string(v)?;
                s.trim().parse::<SocketAddr>().map_err(|_| {
                    format!("expected a socket address such as 127.0.0.1:9464 or [::]:9464, got {s:?}")
                })
            })
            .unwrap_or(d.listen),
        log_format: ctx
            .conv("telemetry.log_format", t.log_format.as_ref(), |v| {
                as_choice(v, &LOG_FORMATS)
            })
            .unwrap_or(d.log_format),
        log_level: ctx
            .conv("telemetry.log_level", t.log_level.as_ref(), |v| {
                let s = as_nonempty_string(v)?;
                tracing_subscriber::EnvFilter::builder()
                    .parse(&s)
                    .map_err(|e| {
                        format!("expected an EnvFilter directive such as \"info\" or \"info,sluicegate=debug\": {e}")
                    })?;
                Ok(s)
            })
            .unwrap_or(d.log_level),
    }
}

fn queue(
    q: RawQueue,
    i: usize,
    transport: Option<TransportKind>,
    gateway: &GatewayConfig,
    ctx: &mut Ctx,
) -> Option<QueueConfig> {
    let k = |name: &str| format!("queue[{i}].{name}");
    let errors_before = ctx.errors.len();
    let name_value = match (&q.queue_name, &q.subscriber_id) {
        (Some(_), Some(_)) => {
            ctx.err(
                k("subscriber_id"),
                "set either queue_name or subscriber_id (its Pub/Sub alias), not both",
            );
            None
        }
        (Some(v), None) => Some((k("queue_name"), v)),
        (None, Some(v)) => Some((k("subscriber_id"), v)),
        (None, None) => None,
    };
    let queue_name = match name_value {
        Some((key, v)) => ctx.conv(&key, Some(v), as_nonempty_string),
        None if transport == Some(TransportKind::PubSub) => {
            ctx.err(
                k("queue_name"),
                "required for the pubsub transport (the subscription id; alias subscriber_id); or SLUICEGATE_QUEUE",
            );
            None
        }
        None => Some(DEFAULT_QUEUE_NAME.to_owned()),
    };
    let igw_base_url = match &q.igw_base_url {
        Some(v) => ctx.conv(&k("igw_base_url"), Some(v), http_url),
        None => {
            if gateway.url.is_none() {
                ctx.err(
                    k("igw_base_url"),
                    "required: set igw_base_url on the queue, or gateway.url (SLUICEGATE_GATEWAY_URL) as the default for all queues",
                );
            }
            gateway.url.clone()
        }
    };
    let request_path_url = ctx
        .conv(
            &k("request_path_url"),
            q.request_path_url.as_ref(),
            url_path,
        )
        .unwrap_or_else(|| gateway.request_path.clone());
    let inference_objective = ctx
        .conv(
            &k("inference_objective"),
            q.inference_objective.as_ref(),
            optional_string,
        )
        .flatten();
    let worker_pool_id = ctx
        .conv(
            &k("worker_pool_id"),
            q.worker_pool_id.as_ref(),
            as_nonempty_string,
        )
        .unwrap_or_else(|| "default".to_owned());
    let labels = ctx
        .conv(&k("labels"), q.labels.as_ref(), as_string_map)
        .unwrap_or_default();
    let result_queue_name = ctx.conv(
        &k("result_queue_name"),
        q.result_queue_name.as_ref(),
        as_nonempty_string,
    );
    let result_ttl_seconds = ctx
        .conv(
            &k("result_ttl_seconds"),
            q.result_ttl_seconds.as_ref(),
            as_u64,
        )
        .unwrap_or(0);
    let max_sys = ctx
        .conv(&k("max_sys"), q.max_sys.as_ref(), as_positive_f64)
        .unwrap_or(100.0);
    let unit = ctx
        .conv(&k("unit"), q.unit.as_ref(), |v| as_choice(v, &UNITS))
        .unwrap_or(Unit::Requests);
    let rounding = ctx
        .conv(&k("rounding"), q.rounding.as_ref(), |v| {
            as_choice(v, &ROUNDINGS)
        })
        .unwrap_or(Rounding::Floor);
    let gate = match parse_gate_spec(
        q.gate_type.as_ref(),
        q.gate_params.as_ref(),
        &format!("queue[{i}]"),
    ) {
        Ok(g) => Some(g),
        Err(errors) => {
            for e in errors {
                ctx.err(e.key, e.message);
            }
            None
        }
    };
    if ctx.errors.len() > errors_before {
        return None;
    }
    Some(QueueConfig {
        queue_name: queue_name?,
        igw_base_url: igw_base_url?,
        request_path_url,
        inference_objective,
        worker_pool_id,
        labels,
        result_queue_name,
        result_ttl_seconds,
        max_sys,
        unit,
        rounding,
        gate: gate?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_urls_parse() {
        assert_eq!(default_redis_url().expose().as_str(), DEFAULT_REDIS_URL);
        assert_eq!(
            constant_url("http://127.0.0.1:9090").expose().port(),
            Some(9090)
        );
    }
}
