//! Loose tree → typed config: each section read over its defaults through
//! its key declarations, secret files, and the rules that span keys
//! (required sections, secrets given twice, queue defaults from
//! `[gateway]`, Prometheus needed by a gate). Every problem is recorded in
//! the context; the returned `Config` is only used when no error was
//! recorded, so placeholders for failed fields never escape.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::{Map, Value};

use super::values::{Ctx, as_nonempty_string, choice, constant_url, kind};
use super::{
    Config, DEFAULT_QUEUE_NAME, DispatchConfig, EmbeddedConfig, GateSpec, GatewayConfig,
    MergePolicyKind, PrometheusConfig, PubSubConfig, QueueConfig, RedisConfig, RedisMode, SECTIONS,
    Section, SharedWindowKind, SqlConfig, TelemetryConfig, TransportKind, format_duration,
};
use crate::gate::parse_gate_spec;
use crate::secret::{Secret, read_secret_file};

/// The loose tree of one section or of the whole file.
type Tree = Map<String, Value>;

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

/// Reports and drops every key of `map` that is not `allowed` (with a close
/// name when there is one), so that the remaining problems are reported too.
/// `[redis]`'s shape: `mode` and the older `cluster` agree (either alone
/// says it), and a sentinel master has its sentinels and its name.
/// `mode_given`: `mode` was set, not defaulted.
fn redis_topology(r: &mut RedisConfig, mode_given: bool, ctx: &mut Ctx) {
    match (r.mode, r.cluster) {
        (RedisMode::Cluster, _) => r.cluster = true,
        (RedisMode::Standalone, true) if !mode_given => r.mode = RedisMode::Cluster,
        (mode, true) => ctx.err(
            "redis.cluster",
            format!(
                "cluster = true contradicts redis.mode = \"{}\"; for a Redis Cluster set mode = \"cluster\" (or leave mode out)",
                mode.as_str()
            ),
        ),
        (_, false) => {}
    }
    if r.mode != RedisMode::Sentinel {
        let sentinel_only = [
            ("master_name", r.master_name.is_some()),
            ("sentinel_username", r.sentinel_username.is_some()),
            ("sentinel_password", r.sentinel_password.is_some()),
        ];
        for (key, _) in sentinel_only.iter().filter(|(_, set)| *set) {
            ctx.err(
                format!("redis.{key}"),
                format!(
                    "only used with redis.mode = \"sentinel\"; got mode = \"{}\"",
                    r.mode.as_str()
                ),
            );
        }
        if r.mode == RedisMode::Standalone && !r.addrs.is_empty() {
            ctx.err(
                "redis.addrs",
                "only used with redis.mode = \"sentinel\" (the sentinels) or \"cluster\" (more seed nodes); a single server is redis.url",
            );
        }
        return;
    }
    if r.master_name.is_none() {
        ctx.err(
            "redis.master_name",
            "required with redis.mode = \"sentinel\" (the name the sentinels monitor the master under, e.g. \"mymaster\"); set [redis] master_name or SLUICEGATE_REDIS_MASTER_NAME",
        );
    }
    if r.addrs.is_empty() {
        ctx.err(
            "redis.addrs",
            "required with redis.mode = \"sentinel\": the sentinels, e.g. [\"10.0.0.1:26379\", \"10.0.0.2:26379\", \"10.0.0.3:26379\"]; set [redis] addrs or SLUICEGATE_REDIS_ADDRS (comma-separated)",
        );
    }
}

fn prune(map: &mut Tree, path: &str, allowed: &[&str], ctx: &mut Ctx) {
    map.retain(|k, _| {
        if allowed.contains(&k.as_str()) {
            return true;
        }
        let hint = did_you_mean(k, allowed, "`");
        let (key, where_) = match path {
            "" => (k.clone(), "at the top level".to_owned()),
            p if p.starts_with("queue[") => (format!("{p}.{k}"), "in a queue".to_owned()),
            p => (format!("{p}.{k}"), format!("in {p}")),
        };
        let msg = format!(
            "unknown key {where_}{hint}; allowed: {}",
            allowed.join(", ")
        );
        ctx.err(key, msg);
        false
    });
}

/// ` (did you mean <name>?)` for the closest allowed name (quoted by
/// `quote`) when it is close (edit distance <= 2), else nothing.
pub(crate) fn did_you_mean(name: &str, allowed: &[&str], quote: &str) -> String {
    let close = allowed.iter().map(|a| (edit_distance(name, a), a));
    let best = close.filter(|(d, _)| *d <= 2).min_by_key(|(d, _)| *d);
    best.map_or_else(String::new, |(_, a)| {
        format!(" (did you mean {quote}{a}{quote}?)")
    })
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Reads a section present in the tree (or required anyway) over its
/// defaults; also returns its table, to check for required keys.
fn read<T: Section>(root: &mut Tree, required: bool, ctx: &mut Ctx) -> Option<(T, Tree)> {
    let mut map = match root.remove(T::NAME) {
        Some(Value::Object(m)) => m,
        // The layer only ever stores tables here.
        Some(_) | None if required => Tree::new(),
        Some(_) | None => return None,
    };
    prune(&mut map, T::NAME, T::KEYS, ctx);
    let mut t = T::default();
    t.merge(&map, T::NAME, ctx);
    Some((t, map))
}

/// One optional section read on its own, with its defaults when absent
/// (`[serve]`, which only `sluicegate serve` reads).
pub(super) fn read_section<T: Section>(root: &mut Tree, ctx: &mut Ctx) -> T {
    read::<T>(root, true, ctx).map(|t| t.0).unwrap_or_default()
}

/// The loose tree (file, environment and flags already layered) as a
/// typed config.
pub(crate) fn build(mut root: Tree, ctx: &mut Ctx) -> Config {
    let sections = SECTIONS.iter().map(|(s, _)| *s);
    let top: Vec<&str> = ["transport"]
        .into_iter()
        .chain(sections)
        .chain(["queue"])
        .collect();
    prune(&mut root, "", &top, ctx);
    let transport = match root.get("transport") {
        None => {
            ctx.err(
                "transport",
                "transport is required; allowed: memory, redis (alias redis-sortedset), pubsub (alias gcp-pubsub), embedded, sql; set `transport` in the file or SLUICEGATE_TRANSPORT",
            );
            None
        }
        v => ctx.conv("transport", v, choice(TransportKind::CHOICES)),
    };
    use TransportKind::{Embedded, PubSub, Redis, Sql};
    let is = |t| transport == Some(t);

    let (mut gateway, _) = read::<GatewayConfig>(&mut root, true, ctx).unwrap_or_default();
    secret(
        ctx,
        "gateway.token",
        &mut gateway.token,
        &gateway.token_file,
    );

    let redis = read::<RedisConfig>(&mut root, is(Redis), ctx).map(|(mut r, map)| {
        secret(ctx, "redis.password", &mut r.password, &r.password_file);
        secret(
            ctx,
            "redis.sentinel_password",
            &mut r.sentinel_password,
            &r.sentinel_password_file,
        );
        if r.password.is_some() && r.url.has_password() {
            ctx.err(
                "redis.password",
                "the password is also in redis.url; give it once",
            );
        }
        redis_topology(&mut r, map.contains_key("mode"), ctx);
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
        // Results must go somewhere: no topic would ack work unanswered.
        if is(PubSub) && p.result_topic_id.is_none() {
            ctx.err(
                "pubsub.result_topic_id",
                "required for the pubsub transport (the topic results are published to); set [pubsub] result_topic_id or SLUICEGATE_PUBSUB_RESULT_TOPIC_ID",
            );
        }
        p
    });
    let embedded = read::<EmbeddedConfig>(&mut root, is(Embedded), ctx).map(|e| e.0);
    let sql = read::<SqlConfig>(&mut root, is(Sql), ctx).map(|(s, _)| s);

    let (dispatch, _) = read::<DispatchConfig>(&mut root, true, ctx).unwrap_or_default();
    // A ceiling below its floor would make the floor meaningless.
    macro_rules! at_least {
        ($key:ident, $floor:ident, $why:literal) => {
            if dispatch.$key < dispatch.$floor {
                let (min, got) = (
                    format_duration(dispatch.$floor),
                    format_duration(dispatch.$key),
                );
                let floor = stringify!($floor);
                let msg = format!(
                    "must be at least dispatch.{floor} ({min}){}; got {got}",
                    $why
                );
                ctx.err(concat!("dispatch.", stringify!($key)), msg);
            }
        };
    }
    at_least!(
        max_staleness,
        poll_interval,
        ", or every observation would be stale"
    );
    at_least!(retry_max_backoff, retry_initial_backoff, "");
    at_least!(congestion_max_backoff, congestion_backoff, "");
    if dispatch.shared_window == SharedWindowKind::Redis && redis.is_none() {
        ctx.err(
            "redis.url",
            "required by dispatch.shared_window = \"redis\" (the semaphore lives there); set [redis] url or SLUICEGATE_REDIS_URL",
        );
    }
    if let Some(sql) = &sql {
        // The keys against the URL's `sslmode` / `sslrootcert`, now rather
        // than at the first connection.
        if let Some(url) = &sql.url
            && let Err(crate::postgres::SqlError::TlsConfig { key, message }) =
                sql.tls_keys().resolve(url.expose())
        {
            ctx.err(key, message);
        }
        if is(Sql) && sql.url.is_none() {
            ctx.err(
                "sql.url",
                "required for the sql transport (a postgres:// or postgresql:// URL); set [sql] url, SLUICEGATE_SQL_URL or SQL_URL",
            );
        }
        // A lease shorter than the dispatcher's would lapse between its
        // renewals.
        if let Some(ttl) = sql.lease_ttl.filter(|ttl| *ttl < dispatch.lease) {
            let msg = format!(
                "must be at least dispatch.lease ({}), or leases lapse between renewals; got {}",
                format_duration(dispatch.lease),
                format_duration(ttl)
            );
            ctx.err("sql.lease_ttl", msg);
        }
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
    for (i, q) in raw_queues.into_iter().enumerate() {
        let Value::Object(map) = q else {
            ctx.err(
                format!("queue[{i}]"),
                format!("expected a queue table, got {}", kind(&q)),
            );
            continue;
        };
        let Some(q) = queue(map, i, transport, &gateway, ctx) else {
            continue;
        };
        if !seen.insert(q.queue_name.clone()) {
            let msg = format!(
                "duplicate queue name {:?}; queue names must be unique",
                q.queue_name
            );
            ctx.err(format!("queue[{i}].queue_name"), msg);
        }
        queues.push(q);
    }
    // `tier-priority` orders queues by their tier label: a value it does
    // not know would silently make the queue `batch`.
    if dispatch.merge_policy == MergePolicyKind::TierPriority {
        let label = &dispatch.merge_tier_label;
        for (i, q) in queues.iter().enumerate() {
            if let Some(value) = q.labels.get(label)
                && super::Tier::parse(value).is_none()
            {
                ctx.err(
                    format!("queue[{i}].labels.{label}"),
                    format!(
                        "unknown tier {value:?} for dispatch.merge_policy = \"tier-priority\"; allowed: interactive, async, batch (no label: batch)"
                    ),
                );
            }
        }
    }
    // Gates that query Prometheus need somewhere to send the query.
    for (i, q) in queues.iter().enumerate().filter(|_| prometheus.is_none()) {
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

    // `sql-quota` counts in the `[sql]` database.
    let has_sql_url = sql.as_ref().is_some_and(|s| s.url.is_some());
    for (i, q) in queues.iter().enumerate().filter(|_| !has_sql_url) {
        let mut needs = false;
        q.gate
            .visit(&mut |g| needs |= matches!(g, GateSpec::SqlQuota { .. }));
        if needs {
            ctx.err(
                "sql.url",
                format!(
                    "required by queue[{i}] (gate `sql-quota` counts in PostgreSQL); set [sql] url, SLUICEGATE_SQL_URL or SQL_URL"
                ),
            );
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
        sql,
        dispatch,
        telemetry,
        queues,
        // Set by the loader from the environment map.
        traces: None,
    }
}

/// One queue entry; `None` when any of its keys had an error.
fn queue(
    mut map: Tree,
    i: usize,
    transport: Option<TransportKind>,
    gateway: &GatewayConfig,
    ctx: &mut Ctx,
) -> Option<QueueConfig> {
    let path = format!("queue[{i}]");
    let errors_before = ctx.errors.len();
    prune(&mut map, &path, QueueConfig::KEYS, ctx);
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
    let gate = parse_gate_spec(map.get("gate_type"), map.get("gate_params"), &path)
        .map_err(|errors| errors.into_iter().for_each(|e| ctx.push(e)))
        .ok();
    // Placeholders below are only kept when no error was recorded, and
    // then neither is used (the URL and the gate are both set).
    let url = (gateway.url.clone()).unwrap_or_else(|| constant_url("http://127.0.0.1/"));
    let placeholder = GateSpec::Constant(Default::default());
    let name = queue_name.unwrap_or_default();
    let mut q = QueueConfig::with_defaults(name, gate.clone().unwrap_or(placeholder), url, gateway);
    q.merge(&map, &path, ctx);
    (ctx.errors.len() == errors_before && gate.is_some()).then_some(q)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "ab"), 2);
        assert_eq!(edit_distance("url", "url"), 0);
    }
}
