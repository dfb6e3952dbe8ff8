//! Showing a configuration: the `check-config` summary and the redacted
//! TOML of `config show`. Secrets print as `<redacted>`, URL passwords as
//! `****`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use toml::{Table, Value as T};

use super::secret::{REDACTED, Secret};
use super::{Config, format_duration};

fn dur(d: Duration) -> T {
    T::String(format_duration(d))
}

fn s(v: &str) -> T {
    T::String(v.to_owned())
}

fn path(p: &Path) -> T {
    T::String(p.display().to_string())
}

fn int(n: u64) -> T {
    // TOML integers are i64; values beyond that cannot come from a TOML
    // file, so saturating only affects programmatic configs.
    T::Integer(i64::try_from(n).unwrap_or(i64::MAX))
}

/// Inline secret or its file: the file path is shown (it is not secret),
/// an inline value never is.
fn put_secret(
    t: &mut Table,
    key: &str,
    file_key: &str,
    value: &Option<Secret>,
    file: &Option<std::path::PathBuf>,
) {
    match (value, file) {
        (_, Some(p)) => {
            t.insert(file_key.to_owned(), path(p));
        }
        (Some(_), None) => {
            t.insert(key.to_owned(), s(REDACTED));
        }
        (None, None) => {}
    }
}

/// JSON parameters as TOML (`null` has no TOML form and is dropped).
fn json_to_toml(v: &Value) -> Option<T> {
    Some(match v {
        Value::Null => return None,
        Value::Bool(b) => T::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => T::Integer(i),
            None => T::Float(n.as_f64()?),
        },
        Value::String(x) => T::String(x.clone()),
        Value::Array(a) => T::Array(a.iter().filter_map(json_to_toml).collect()),
        Value::Object(m) => T::Table(
            m.iter()
                .filter_map(|(k, v)| json_to_toml(v).map(|t| (k.clone(), t)))
                .collect(),
        ),
    })
}

pub(crate) fn to_redacted_toml(c: &Config) -> String {
    let mut root = Table::new();
    root.insert("transport".into(), s(c.transport.as_str()));

    let g = &c.gateway;
    let mut t = Table::new();
    if let Some(u) = &g.url {
        t.insert("url".into(), s(&u.masked()));
    }
    t.insert("request_path".into(), s(&g.request_path));
    t.insert("attempt_timeout".into(), dur(g.attempt_timeout));
    t.insert("connect_timeout".into(), dur(g.connect_timeout));
    t.insert("max_response_bytes".into(), int(g.max_response_bytes));
    t.insert(
        "max_connections_per_host".into(),
        int(u64::try_from(g.max_connections_per_host).unwrap_or(u64::MAX)),
    );
    put_secret(&mut t, "token", "token_file", &g.token, &g.token_file);
    t.insert(
        "objective_header".into(),
        s(g.objective_header.header_name()),
    );
    t.insert(
        "fairness_attribute".into(),
        s(g.fairness_attribute.as_deref().unwrap_or("")),
    );
    root.insert("gateway".into(), T::Table(t));

    if let Some(r) = &c.redis {
        let mut t = Table::new();
        t.insert("url".into(), s(&r.url.masked()));
        if let Some(u) = &r.username {
            t.insert("username".into(), s(u));
        }
        put_secret(
            &mut t,
            "password",
            "password_file",
            &r.password,
            &r.password_file,
        );
        root.insert("redis".into(), T::Table(t));
    }
    if let Some(p) = &c.prometheus {
        let mut t = Table::new();
        t.insert("url".into(), s(&p.url.masked()));
        put_secret(
            &mut t,
            "bearer_token",
            "bearer_token_file",
            &p.bearer_token,
            &p.bearer_token_file,
        );
        if let Some(u) = &p.basic_user {
            t.insert("basic_user".into(), s(u));
        }
        put_secret(
            &mut t,
            "basic_password",
            "basic_password_file",
            &p.basic_password,
            &p.basic_password_file,
        );
        root.insert("prometheus".into(), T::Table(t));
    }
    if let Some(p) = &c.pubsub {
        let mut t = Table::new();
        t.insert("project_id".into(), s(&p.project_id));
        if let Some(x) = &p.result_topic_id {
            t.insert("result_topic_id".into(), s(x));
        }
        if let Some(x) = &p.emulator_host {
            t.insert("emulator_host".into(), s(x));
        }
        root.insert("pubsub".into(), T::Table(t));
    }
    if let Some(e) = &c.embedded {
        let mut t = Table::new();
        t.insert("path".into(), path(&e.path));
        root.insert("embedded".into(), T::Table(t));
    }

    let d = &c.dispatch;
    let mut t = Table::new();
    t.insert("poll_interval".into(), dur(d.poll_interval));
    t.insert("max_staleness".into(), dur(d.max_staleness));
    t.insert("lease".into(), dur(d.lease));
    t.insert("receive_wait".into(), dur(d.receive_wait));
    t.insert(
        "max_attempts".into(),
        int(u64::from(d.max_attempts.unwrap_or(0))),
    );
    t.insert("retry_initial_backoff".into(), dur(d.retry_initial_backoff));
    t.insert("retry_max_backoff".into(), dur(d.retry_max_backoff));
    t.insert("congestion_backoff".into(), dur(d.congestion_backoff));
    t.insert("wait_requeue_delay".into(), dur(d.wait_requeue_delay));
    t.insert("shutdown_grace".into(), dur(d.shutdown_grace));
    t.insert("default_deadline".into(), dur(d.default_deadline));
    root.insert("dispatch".into(), T::Table(t));

    let tl = &c.telemetry;
    let mut t = Table::new();
    t.insert("listen".into(), s(&tl.listen.to_string()));
    t.insert("log_format".into(), s(tl.log_format.as_str()));
    t.insert("log_level".into(), s(&tl.log_level));
    root.insert("telemetry".into(), T::Table(t));

    let queues = c
        .queues
        .iter()
        .map(|q| {
            let mut t = Table::new();
            t.insert("queue_name".into(), s(&q.queue_name));
            t.insert("igw_base_url".into(), s(&q.igw_base_url.masked()));
            t.insert("request_path_url".into(), s(&q.request_path_url));
            if let Some(o) = &q.inference_objective {
                t.insert("inference_objective".into(), s(o));
            }
            t.insert("worker_pool_id".into(), s(&q.worker_pool_id));
            t.insert(
                "labels".into(),
                T::Table(q.labels.iter().map(|(k, v)| (k.clone(), s(v))).collect()),
            );
            if let Some(list) = &q.result_queue_name {
                t.insert("result_queue_name".into(), s(list));
            }
            t.insert("result_ttl_seconds".into(), int(q.result_ttl_seconds));
            t.insert("max_sys".into(), T::Float(q.max_sys));
            t.insert("unit".into(), s(q.unit.as_str()));
            t.insert("rounding".into(), s(q.rounding.as_str()));
            t.insert("gate_type".into(), s(q.gate.upstream_name()));
            let params = json_to_toml(&q.gate.to_upstream()["gate_params"])
                .unwrap_or_else(|| T::Table(Table::new()));
            t.insert("gate_params".into(), params);
            T::Table(t)
        })
        .collect();
    root.insert("queue".into(), T::Array(queues));

    // Serialising a table built from strings, numbers, booleans, arrays and
    // tables cannot fail; an error would be a bug in this function.
    toml::to_string(&root).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
}

pub(crate) fn summary(c: &Config) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_summary(&mut out, c);
    out
}

fn write_summary(o: &mut String, c: &Config) -> std::fmt::Result {
    writeln!(o, "transport: {}", c.transport.as_str())?;
    let g = &c.gateway;
    writeln!(
        o,
        "gateway: {} (default path {}, attempt timeout {}, connect timeout {}, token {}, objective header {}, fairness attribute {})",
        g.url
            .as_ref()
            .map_or_else(|| "<per queue>".to_owned(), |u| u.masked()),
        g.request_path,
        format_duration(g.attempt_timeout),
        format_duration(g.connect_timeout),
        if g.token.is_some() { "set" } else { "none" },
        g.objective_header.header_name(),
        g.fairness_attribute.as_deref().unwrap_or("<disabled>"),
    )?;
    if let Some(r) = &c.redis {
        writeln!(
            o,
            "redis: {} (password {})",
            r.url.masked(),
            if r.password.is_some() || r.url.has_password() {
                "set"
            } else {
                "none"
            }
        )?;
    }
    if let Some(p) = &c.prometheus {
        let auth = if p.bearer_token.is_some() {
            "bearer token"
        } else if p.basic_user.is_some() {
            "basic auth"
        } else {
            "none"
        };
        writeln!(o, "prometheus: {} (auth {auth})", p.url.masked())?;
    }
    if let Some(p) = &c.pubsub {
        writeln!(
            o,
            "pubsub: project {} result topic {}{}",
            p.project_id,
            p.result_topic_id.as_deref().unwrap_or("<none>"),
            p.emulator_host
                .as_deref()
                .map(|h| format!(" (emulator {h})"))
                .unwrap_or_default()
        )?;
    }
    if let Some(e) = &c.embedded {
        writeln!(o, "embedded: {}", e.path.display())?;
    }
    let d = &c.dispatch;
    writeln!(
        o,
        "dispatch: poll {} max staleness {} lease {} max attempts {} retry backoff {}..{} congestion backoff {} shutdown grace {}",
        format_duration(d.poll_interval),
        format_duration(d.max_staleness),
        format_duration(d.lease),
        d.max_attempts
            .map_or_else(|| "unlimited".to_owned(), |n| n.to_string()),
        format_duration(d.retry_initial_backoff),
        format_duration(d.retry_max_backoff),
        format_duration(d.congestion_backoff),
        format_duration(d.shutdown_grace),
    )?;
    let t = &c.telemetry;
    writeln!(
        o,
        "telemetry: listen {} log {} {}",
        t.listen,
        t.log_format.as_str(),
        t.log_level
    )?;
    writeln!(o, "queues: {}", c.queues.len())?;
    for q in &c.queues {
        writeln!(
            o,
            "  {} -> {}{} max_sys {} {} ({}) gate {}",
            q.queue_name,
            q.igw_base_url.masked().trim_end_matches('/'),
            q.request_path_url,
            q.max_sys,
            q.unit.as_str(),
            q.rounding.as_str(),
            q.gate
        )?;
    }
    Ok(())
}
