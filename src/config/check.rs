//! Loose tree → typed config: the conversions named in the key
//! declarations (`mod.rs`), secret files, and the rules that span keys
//! (required sections, secrets given twice, queue defaults from
//! `[gateway]`, Prometheus needed by a gate). Every problem is recorded in
//! the context; the returned `Config` is only used when no error was
//! recorded, so placeholders for failed fields never escape.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};
use url::Url;

use super::gate::parse_gate_spec;
use super::secret::{EndpointUrl, Secret, read_secret_file};
use super::values::{Ctx, as_choice, as_duration, as_nonempty_string, as_string, as_u64_in};
use super::{
    Config, DEFAULT_QUEUE_NAME, DispatchConfig, EmbeddedConfig, GateSpec, GatewayConfig,
    PrometheusConfig, PubSubConfig, QueueConfig, RedisConfig, Section, TelemetryConfig,
    TransportKind, format_duration,
};

/// The loose tree of one section or of the whole file.
type Tree = Map<String, Value>;

/// Smallest duration that counts as "greater than 0".
pub(crate) const NONZERO: Duration = Duration::from_nanos(1);

/// An http(s) URL with a host.
pub(crate) fn http_url(v: &Value) -> Result<EndpointUrl, String> {
    let u =
        Url::parse(as_string(v)?.trim()).map_err(|e| format!("expected an http(s) URL: {e}"))?;
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

/// A `redis://` or `rediss://` URL.
pub(crate) fn redis_url(v: &Value) -> Result<EndpointUrl, String> {
    let u = Url::parse(as_string(v)?.trim())
        .map_err(|e| format!("expected a redis:// or rediss:// URL: {e}"))?;
    if !matches!(u.scheme(), "redis" | "rediss") {
        return Err(format!(
            "expected a redis:// or rediss:// URL, got scheme {:?}",
            u.scheme()
        ));
    }
    Ok(EndpointUrl::new(u))
}

/// Parses a URL literal of the key declarations.
pub(crate) fn constant_url(text: &'static str) -> EndpointUrl {
    // Invariant: only called with the valid literal URLs of the key
    // declarations (checked by the `constant_urls_parse` test).
    #[allow(clippy::expect_used)]
    EndpointUrl::new(Url::parse(text).expect("constant URL is valid"))
}

/// A URL path starting with '/'.
pub(crate) fn url_path(v: &Value) -> Result<String, String> {
    let s = as_string(v)?;
    if s.starts_with('/') && !s.contains(char::is_whitespace) {
        Ok(s)
    } else {
        Err(format!("must be a path starting with '/', got {s:?}"))
    }
}

/// A string where empty means "none".
pub(crate) fn optional_string(v: &Value) -> Result<Option<String>, String> {
    let s = as_string(v)?;
    Ok((!s.is_empty()).then_some(s))
}

/// An inline secret; the message never echoes the value.
pub(crate) fn inline_secret(v: &Value) -> Result<Option<Secret>, String> {
    match v {
        Value::String(s) if s.is_empty() => Err("must not be empty".to_owned()),
        Value::String(s) => Ok(Some(Secret::new(s.clone()))),
        _ => Err("expected a string".to_owned()),
    }
}

/// A file path.
pub(crate) fn path(v: &Value) -> Result<PathBuf, String> {
    as_nonempty_string(v).map(PathBuf::from)
}

/// The file path of a secret.
pub(crate) fn file_path(v: &Value) -> Result<Option<PathBuf>, String> {
    path(v).map(Some)
}

/// `max_attempts`: 0 means unlimited (`None`).
pub(crate) fn attempts(v: &Value) -> Result<Option<u32>, String> {
    let n = as_u64_in(v, 0, u64::from(u32::MAX)).map_err(|e| format!("{e} (0 = unlimited)"))?;
    Ok(u32::try_from(n).ok().filter(|n| *n > 0))
}

/// `host:port`, or empty for none.
pub(crate) fn host_port(v: &Value) -> Result<Option<String>, String> {
    let s = as_string(v)?;
    match s.rsplit_once(':') {
        _ if s.is_empty() => Ok(None),
        Some((h, port)) if !h.is_empty() && port.parse::<u16>().is_ok() => Ok(Some(s)),
        _ => Err(format!("expected host:port, got {s:?}")),
    }
}

/// A socket address.
pub(crate) fn socket_addr(v: &Value) -> Result<SocketAddr, String> {
    let s = as_string(v)?;
    s.trim().parse().map_err(|_| {
        format!("expected a socket address such as 127.0.0.1:9464 or [::]:9464, got {s:?}")
    })
}

/// A `tracing` `EnvFilter` directive.
pub(crate) fn env_filter(v: &Value) -> Result<String, String> {
    let s = as_nonempty_string(v)?;
    tracing_subscriber::EnvFilter::builder()
        .parse(&s)
        .map_err(|e| {
            format!(
                "expected an EnvFilter directive such as \"info\" or \"info,sluicegate=debug\": {e}"
            )
        })?;
    Ok(s)
}

/// One of an enum's spellings (`CHOICES` of a `spelled!` enum).
pub(crate) fn choice<T: Copy>(
    choices: &'static [(&'static str, T)],
) -> impl Fn(&Value) -> Result<T, String> {
    move |v| as_choice(v, choices)
}

/// A duration of at least `min`.
pub(crate) fn duration_min(min: Duration) -> impl Fn(&Value) -> Result<Duration, String> {
    move |v| {
        let d = as_duration(v)?;
        match d {
            d if d >= min => Ok(d),
            _ if min == NONZERO => Err("must be greater than 0".to_owned()),
            _ => Err(format!("must be at least {}", format_duration(min))),
        }
    }
}

/// Resolves a secret given inline or as a file (`<key>_file`), not both,
/// reading the file now: the one place secret files are read.
fn secret(ctx: &mut Ctx, key: &str, value: &mut Option<Secret>, file: &Option<PathBuf>) {
    let file_key = format!("{key}_file");
    match (value.is_some(), file) {
        (_, None) => {}
        (true, Some(_)) => {
            ctx.err(key, format!("set either {key} or {file_key}, not both"));
            *value = None;
        }
        (false, Some(p)) => match read_secret_file(p) {
            Ok(secret) => *value = Some(secret),
            Err(e) => ctx.err(file_key, e.to_string()),
        },
    }
}

/// Reads a section present in the tree (or required anyway) over its
/// defaults; also returns its table, to check for required keys.
fn read<T: Section>(root: &mut Tree, required: bool, ctx: &mut Ctx) -> Option<(T, Tree)> {
    let map = match root.remove(T::NAME) {
        Some(Value::Object(m)) => m,
        // The layer only ever stores tables here.
        Some(_) => Tree::new(),
        None if required => Tree::new(),
        None => return None,
    };
    let mut t = T::default();
    t.merge(&map, T::NAME, ctx);
    Some((t, map))
}

/// The loose tree (file, environment and flags already layered) as a
/// typed config.
pub(crate) fn build(mut root: Tree, ctx: &mut Ctx) -> Config {
    let transport = match root.get("transport") {
        None => {
            ctx.err(
                "transport",
                "transport is required; allowed: memory, redis (alias redis-sortedset), pubsub (alias gcp-pubsub), embedded; set `transport` in the file or SLUICEGATE_TRANSPORT",
            );
            None
        }
        v => ctx.conv("transport", v, choice(TransportKind::CHOICES)),
    };
    use TransportKind::{Embedded, PubSub, Redis};
    let is = |t| transport == Some(t);

    let (mut gateway, _) = read::<GatewayConfig>(&mut root, true, ctx).unwrap_or_default();
    secret(
        ctx,
        "gateway.token",
        &mut gateway.token,
        &gateway.token_file,
    );

    let redis = read::<RedisConfig>(&mut root, is(Redis), ctx).map(|(mut r, _)| {
        secret(ctx, "redis.password", &mut r.password, &r.password_file);
        if r.password.is_some() && r.url.has_password() {
            ctx.err(
                "redis.password",
                "the password is also in redis.url; give it once",
            );
        }
        r
    });

    let prometheus = read::<PrometheusConfig>(&mut root, false, ctx).map(|(mut p, map)| {
        if !map.contains_key("url") {
            ctx.err(
                "prometheus.url",
                "required when [prometheus] is configured; an http(s) URL such as http://127.0.0.1:9090",
            );
        }
        secret(ctx, "prometheus.bearer_token", &mut p.bearer_token, &p.bearer_token_file);
        secret(ctx, "prometheus.basic_password", &mut p.basic_password, &p.basic_password_file);
        if p.bearer_token.is_some() && (p.basic_user.is_some() || p.basic_password.is_some()) {
            ctx.err(
                "prometheus.bearer_token",
                "use either a bearer token or basic auth (basic_user/basic_password), not both",
            );
        }
        if p.basic_password.is_some() && p.basic_user.is_none() {
            ctx.err("prometheus.basic_user", "required when basic_password is set");
        }
        p
    });

    let pubsub = read::<PubSubConfig>(&mut root, is(PubSub), ctx).map(|(p, map)| {
        if !map.contains_key("project_id") {
            ctx.err(
                "pubsub.project_id",
                "required for the pubsub transport (the GCP project id); set [pubsub] project_id or SLUICEGATE_PUBSUB_PROJECT_ID",
            );
        }
        p
    });
    let embedded = read::<EmbeddedConfig>(&mut root, is(Embedded), ctx).map(|e| e.0);

    let (dispatch, _) = read::<DispatchConfig>(&mut root, true, ctx).unwrap_or_default();
    let d = &dispatch;
    if d.max_staleness < d.poll_interval {
        ctx.err(
            "dispatch.max_staleness",
            format!(
                "must be at least dispatch.poll_interval ({}), or every observation would be stale; got {}",
                format_duration(d.poll_interval),
                format_duration(d.max_staleness)
            ),
        );
    }
    if d.retry_max_backoff < d.retry_initial_backoff {
        ctx.err(
            "dispatch.retry_max_backoff",
            format!(
                "must be at least dispatch.retry_initial_backoff ({})",
                format_duration(d.retry_initial_backoff)
            ),
        );
    }
    if d.congestion_max_backoff < d.congestion_backoff {
        ctx.err(
            "dispatch.congestion_max_backoff",
            format!(
                "must be at least dispatch.congestion_backoff ({})",
                format_duration(d.congestion_backoff)
            ),
        );
    }
    let (telemetry, _) = read::<TelemetryConfig>(&mut root, true, ctx).unwrap_or_default();

    let raw_queues = match root.remove("queue") {
        Some(Value::Array(items)) => items,
        _ => Vec::new(),
    };
    if raw_queues.is_empty() {
        ctx.err(
            "queue",
            "at least one queue is required; add a [[queue]] table, or set SLUICEGATE_QUEUE / SLUICEGATE_GATE_TYPE (or SLUICEGATE_QUEUES_JSON)",
        );
    }
    let mut queues = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, q) in raw_queues.iter().enumerate() {
        let empty = Map::new();
        let map = q.as_object().unwrap_or(&empty);
        if let Some(q) = queue(map, i, transport, &gateway, ctx) {
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
        // Placeholder only when an error was recorded (the config is then discarded).
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

/// One queue entry; `None` when any of its keys had an error.
fn queue(
    map: &Map<String, Value>,
    i: usize,
    transport: Option<TransportKind>,
    gateway: &GatewayConfig,
    ctx: &mut Ctx,
) -> Option<QueueConfig> {
    let path = format!("queue[{i}]");
    let errors_before = ctx.errors.len();
    let queue_name = match (map.get("queue_name"), map.get("subscriber_id")) {
        (Some(_), Some(_)) => {
            ctx.err(
                format!("{path}.subscriber_id"),
                "set either queue_name or subscriber_id (its Pub/Sub alias), not both",
            );
            None
        }
        (Some(v), None) => ctx.conv(&format!("{path}.queue_name"), Some(v), as_nonempty_string),
        (None, Some(v)) => ctx.conv(
            &format!("{path}.subscriber_id"),
            Some(v),
            as_nonempty_string,
        ),
        (None, None) if transport == Some(TransportKind::PubSub) => {
            ctx.err(
                format!("{path}.queue_name"),
                "required for the pubsub transport (the subscription id; alias subscriber_id); or SLUICEGATE_QUEUE",
            );
            None
        }
        (None, None) => Some(DEFAULT_QUEUE_NAME.to_owned()),
    };
    if !map.contains_key("igw_base_url") && gateway.url.is_none() {
        ctx.err(
            format!("{path}.igw_base_url"),
            "required: set igw_base_url on the queue, or gateway.url (SLUICEGATE_GATEWAY_URL) as the default for all queues",
        );
    }
    let gate = match parse_gate_spec(map.get("gate_type"), map.get("gate_params"), &path) {
        Ok(g) => Some(g),
        Err(errors) => {
            for mut e in errors {
                if e.origin.is_none() {
                    e.origin = ctx.origin_of(&e.key);
                }
                ctx.push(e);
            }
            None
        }
    };
    // Placeholders below are only kept when no error was recorded, and
    // then neither is used (the URL and the gate are both set).
    let url = gateway
        .url
        .clone()
        .unwrap_or_else(|| constant_url("http://127.0.0.1/"));
    let mut q = QueueConfig::with_defaults(
        queue_name.unwrap_or_default(),
        url,
        gateway,
        gate.clone()
            .unwrap_or(GateSpec::Constant(Default::default())),
    );
    q.merge(map, &path, ctx);
    (ctx.errors.len() == errors_before && gate.is_some()).then_some(q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_REDIS_URL;

    #[test]
    fn constant_urls_parse() {
        assert_eq!(
            constant_url(DEFAULT_REDIS_URL).expose().as_str(),
            DEFAULT_REDIS_URL
        );
        assert_eq!(
            constant_url("http://127.0.0.1:9090").expose().port(),
            Some(9090)
        );
        assert_eq!(constant_url("http://127.0.0.1/").expose().port(), None);
    }

    #[test]
    fn unreadable_secret_file_names_the_key_and_the_path() {
        let mut ctx = Ctx::default();
        let mut token = None;
        let path = Some(PathBuf::from("/nonexistent/sluicegate-token"));
        secret(&mut ctx, "gateway.token", &mut token, &path);
        assert!(token.is_none());
        let e = &ctx.errors[0];
        assert_eq!(e.key, "gateway.token_file");
        assert!(
            e.message
                .contains("cannot read /nonexistent/sluicegate-token"),
            "{e}"
        );
    }
}
