//! Showing a configuration: the `check-config` summary and the redacted
//! TOML of `config show`, which is the derived `Serialize` of [`Config`]
//! (secrets print as `<redacted>`, URL passwords as `****`) plus the
//! `serialize_with` helpers the key declarations name.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Serialize, Serializer};
use serde_json::Value;

use super::{Config, GateSpec, format_duration};

/// A duration as text (`30s`), which loads back exactly.
pub(crate) fn duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

/// `max_attempts`: unlimited is spelled 0, as in the file.
pub(crate) fn attempts<S: Serializer>(n: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(n.unwrap_or(0))
}

/// An optional string whose "none" is spelled empty (an absent key would
/// mean the default instead).
pub(crate) fn or_empty<S: Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_deref().unwrap_or(""))
}

/// A gate as its `gate_type` and `gate_params` keys (flattened into the queue).
pub(crate) fn gate<S: Serializer>(g: &GateSpec, s: S) -> Result<S::Ok, S::Error> {
    let mut v = g.to_upstream();
    drop_nulls(&mut v);
    v.serialize(s)
}

/// TOML has no null; a null parameter means "not set" anyway.
fn drop_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(drop_nulls);
        }
        Value::Array(a) => {
            a.retain(|x| !x.is_null());
            a.iter_mut().for_each(drop_nulls);
        }
        _ => {}
    }
}

pub(crate) fn to_redacted_toml(c: &Config) -> String {
    let rendered = toml::Table::try_from(c).and_then(|mut root| {
        // A secret read from a file is shown by its path only (the path is
        // not secret), so the output also loads back.
        for (_, section) in root.iter_mut() {
            if let toml::Value::Table(t) = section {
                let inline: Vec<String> = t
                    .keys()
                    .filter_map(|k| k.strip_suffix("_file"))
                    .filter(|k| t.contains_key(*k))
                    .map(str::to_owned)
                    .collect();
                inline.iter().for_each(|k| {
                    t.remove(k);
                });
            }
        }
        toml::to_string(&root)
    });
    // Serialising strings, numbers, tables and arrays cannot fail short of
    // an integer beyond i64; the text then says so rather than panicking.
    rendered.unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
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
