//! Showing a configuration: the `check-config` summary and the redacted
//! TOML of `config show`, which is the derived `Serialize` of [`Config`]
//! (secrets print as `<redacted>`, URL passwords as `****`) plus the
//! `serialize_with` helpers the key declarations name.

use std::fmt::Write as _;

use serde::{Serialize, Serializer};

use super::{Config, GateSpec};

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
    g.to_upstream().serialize(s)
}

/// The config as a TOML table, secrets redacted and URL passwords masked.
fn redacted_table(c: &Config) -> Result<toml::Table, toml::ser::Error> {
    let mut root = toml::Table::try_from(c)?;
    // A secret read from a file is shown by its path only (the path is not
    // secret), so the output also loads back.
    for t in root.iter_mut().filter_map(|(_, v)| v.as_table_mut()) {
        let inline: Vec<String> = (t.keys().filter_map(|k| k.strip_suffix("_file")))
            .filter(|k| t.contains_key(*k))
            .map(str::to_owned)
            .collect();
        inline.iter().for_each(|k| drop(t.remove(k)));
    }
    Ok(root)
}

impl Config {
    /// The effective configuration as TOML (for `config show`): every key
    /// spelled out, secrets `<redacted>`, URL passwords masked.
    pub fn to_redacted_toml(&self) -> String {
        // Serialising strings, numbers, tables and arrays cannot fail short of
        // an integer beyond i64; the text then says so rather than panicking.
        redacted_table(self)
            .and_then(|root| toml::to_string(&root))
            .unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// A human summary for `check-config` (secrets never included): one
    /// line per section (`key=value`, redacted as in `config show`), then
    /// one per queue with its target, capacity and gate.
    pub fn summary(&self) -> String {
        let mut o = format!("transport: {}\n", self.transport.as_str());
        // Writing to a String cannot fail.
        for (name, section) in redacted_table(self).unwrap_or_default() {
            if let toml::Value::Table(t) = section {
                let fields: Vec<String> = t
                    .iter()
                    .map(|(k, v)| match v {
                        toml::Value::String(s) => format!("{k}={s}"),
                        v => format!("{k}={v}"),
                    })
                    .collect();
                let _ = writeln!(o, "{name}: {}", fields.join(", "));
            }
        }
        if let Some(traces) = &self.traces {
            // A password in the URL is masked like the others.
            let mut endpoint = url::Url::parse(&traces.endpoint).ok();
            if let Some(u) = endpoint.as_mut().filter(|u| u.password().is_some()) {
                let _ = u.set_password(Some("****"));
            }
            let _ = writeln!(
                o,
                "traces: otlp http/protobuf -> {} (service.name={})",
                endpoint.map_or_else(|| traces.endpoint.clone(), |u| u.to_string()),
                traces.service_name
            );
        }
        let _ = writeln!(o, "queues: {}", self.queues.len());
        for q in &self.queues {
            let _ = writeln!(
                o,
                "  {} -> {}{} max_sys {} {} ({}) gate {}",
                q.queue_name,
                q.igw_base_url.masked().trim_end_matches('/'),
                q.request_path_url,
                q.max_sys,
                q.unit.as_str(),
                q.rounding.as_str(),
                q.gate
            );
        }
        o
    }
}
