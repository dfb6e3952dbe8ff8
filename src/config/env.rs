//! Sources and layering: the file, the `SLUICEGATE_*` environment and
//! command-line flags are applied in that order onto the raw config, each
//! overridden key remembering which variable or flag set it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use super::Config;
use super::error::{ConfigError, ConfigErrors};
use super::raw::{QUEUE_ENV_KEYS, RawConfig, RawQueue, SECTIONS};
use super::validate::validate;
use super::values::Ctx;

/// Prefix of every environment variable sluicegate reads.
pub const ENV_PREFIX: &str = "SLUICEGATE_";

/// The sidecar contract: the variables that alone configure a complete
/// sidecar. Documented in `docs/configuration.md`.
pub const CONTRACT_ENV_VARS: &[&str] = &[
    "SLUICEGATE_CONFIG",
    "SLUICEGATE_TRANSPORT",
    "SLUICEGATE_QUEUE",
    "SLUICEGATE_GATEWAY_URL",
    "SLUICEGATE_REQUEST_PATH",
    "SLUICEGATE_GATE_TYPE",
    "SLUICEGATE_GATE_PARAMS",
    "SLUICEGATE_PROMETHEUS_URL",
    "SLUICEGATE_REDIS_URL",
    "SLUICEGATE_LISTEN",
    "SLUICEGATE_LOG_FORMAT",
];

/// Command-line flags that override the environment and the file. Values
/// are the flags' text; errors name the flag (`--listen`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--transport`.
    pub transport: Option<String>,
    /// `--gateway-url`: `gateway.url`, and the single queue's `igw_base_url`.
    pub gateway_url: Option<String>,
    /// `--request-path`: `gateway.request_path`, and the single queue's path.
    pub request_path: Option<String>,
    /// `--queue`: the single queue's name (creates it when none is configured).
    pub queue: Option<String>,
    /// `--listen`: metrics and health address.
    pub listen: Option<String>,
    /// `--log-format`.
    pub log_format: Option<String>,
    /// `--log-level`.
    pub log_level: Option<String>,
}

/// Everything a configuration is loaded from. `Debug` shows the variable
/// names but not their values, which may be secrets.
#[derive(Clone, Default)]
pub struct ConfigSources {
    /// Config file (the `--config` flag); when `None`, `SLUICEGATE_CONFIG`
    /// in `env` names it; with neither, no file is read.
    pub file: Option<PathBuf>,
    /// The `SLUICEGATE_*` environment, as a map so tests never touch the
    /// process environment. Other variables are ignored.
    pub env: BTreeMap<String, String>,
    /// Command-line flags.
    pub overrides: Overrides,
}

impl std::fmt::Debug for ConfigSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSources")
            .field("file", &self.file)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("overrides", &self.overrides)
            .finish()
    }
}

impl ConfigSources {
    /// Sources for the binary: the `--config` flag, the process's
    /// `SLUICEGATE_*` variables and the other flags. A variable whose value
    /// is not UTF-8 is kept lossily converted, so it fails validation
    /// rather than being silently ignored.
    pub fn from_process(file_flag: Option<PathBuf>, overrides: Overrides) -> Self {
        let env = std::env::vars_os()
            .filter_map(|(k, v)| {
                let k = k.to_string_lossy().into_owned();
                k.starts_with(ENV_PREFIX)
                    .then(|| (k, v.to_string_lossy().into_owned()))
            })
            .collect();
        Self {
            file: file_flag,
            env,
            overrides,
        }
    }
}

/// Where a variable or flag writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Names the file; handled before layering.
    ConfigFile,
    /// The top-level `transport`.
    Transport,
    /// `[section] key`.
    Section(&'static str, &'static str),
    /// A key of the single queue.
    Queue(&'static str),
    /// The whole queue list as upstream JSON.
    QueuesJson,
}

/// Variables whose empty value is meaningful (it disables something);
/// every other variable set to "" counts as unset.
const EMPTY_MEANS_SOMETHING: &[&str] = &[
    "SLUICEGATE_GATEWAY_FAIRNESS_ATTRIBUTE",
    "SLUICEGATE_QUEUE_INFERENCE_OBJECTIVE",
];

/// Every variable and its target. Short contract names come first; the
/// generic `SLUICEGATE_<SECTION>_<KEY>` names follow.
fn env_table() -> Vec<(String, Target)> {
    let mut t: Vec<(String, Target)> = vec![
        ("SLUICEGATE_CONFIG".into(), Target::ConfigFile),
        ("SLUICEGATE_TRANSPORT".into(), Target::Transport),
        ("SLUICEGATE_QUEUE".into(), Target::Queue("queue_name")),
        ("SLUICEGATE_GATE_TYPE".into(), Target::Queue("gate_type")),
        (
            "SLUICEGATE_GATE_PARAMS".into(),
            Target::Queue("gate_params"),
        ),
        ("SLUICEGATE_QUEUES_JSON".into(), Target::QueuesJson),
        (
            "SLUICEGATE_REQUEST_PATH".into(),
            Target::Section("gateway", "request_path"),
        ),
        (
            "SLUICEGATE_LISTEN".into(),
            Target::Section("telemetry", "listen"),
        ),
        (
            "SLUICEGATE_LOG_FORMAT".into(),
            Target::Section("telemetry", "log_format"),
        ),
        (
            "SLUICEGATE_LOG_LEVEL".into(),
            Target::Section("telemetry", "log_level"),
        ),
    ];
    for &(section, keys) in SECTIONS {
        for key in keys {
            t.push((env_name(section, key), Target::Section(section, key)));
        }
    }
    for key in QUEUE_ENV_KEYS {
        t.push((env_name("queue", key), Target::Queue(key)));
    }
    t
}

fn env_name(section: &str, key: &str) -> String {
    format!("{ENV_PREFIX}{}_{}", section, key).to_uppercase()
}

/// Every environment variable sluicegate reads, sorted.
pub fn known_env_vars() -> Vec<String> {
    let mut v: Vec<String> = env_table().into_iter().map(|(n, _)| n).collect();
    v.sort();
    v.dedup();
    v
}

/// The key path a target writes, for errors and origins.
fn target_key(t: Target) -> String {
    match t {
        Target::ConfigFile => "config".to_owned(),
        Target::Transport => "transport".to_owned(),
        Target::Section(s, k) => format!("{s}.{k}"),
        Target::Queue(k) => format!("queue[0].{k}"),
        Target::QueuesJson => "queue".to_owned(),
    }
}

/// Loads from `sources` (see [`Config::load`]).
pub(crate) fn load(sources: &ConfigSources) -> Result<Config, ConfigErrors> {
    let file = sources.file.clone().or_else(|| {
        sources
            .env
            .get("SLUICEGATE_CONFIG")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
    });
    match file {
        None => load_text(None, &sources.env, &sources.overrides),
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(text) => load_text(
                Some((&text, &path.display().to_string())),
                &sources.env,
                &sources.overrides,
            ),
            Err(e) => Err(ConfigErrors(vec![ConfigError::new(
                path.display().to_string(),
                format!("cannot read config file: {e}"),
            )])),
        },
    }
}

/// Loads from TOML text (named `name` in errors), an environment map and flags.
pub(crate) fn load_text(
    file: Option<(&str, &str)>,
    env: &BTreeMap<String, String>,
    overrides: &Overrides,
) -> Result<Config, ConfigErrors> {
    let mut ctx = Ctx::default();
    let mut raw = match file {
        None => RawConfig::default(),
        Some((text, name)) => match parse_file(text, name, &mut ctx) {
            Some(raw) => raw,
            None => return Err(ConfigErrors(ctx.errors)),
        },
    };
    apply_env(&mut raw, env, &mut ctx);
    apply_overrides(&mut raw, overrides, &mut ctx);
    let config = validate(raw, &mut ctx);
    if ctx.errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(ctx.errors))
    }
}

const TOP_KEYS: &[&str] = &[
    "transport",
    "gateway",
    "redis",
    "prometheus",
    "pubsub",
    "embedded",
    "dispatch",
    "telemetry",
    "queue",
];

/// Every key of a queue entry (file or upstream JSON).
pub(crate) const QUEUE_KEYS: &[&str] = &[
    "queue_name",
    "subscriber_id",
    "igw_base_url",
    "request_path_url",
    "inference_objective",
    "worker_pool_id",
    "labels",
    "result_queue_name",
    "result_ttl_seconds",
    "max_sys",
    "unit",
    "rounding",
    "gate_type",
    "gate_params",
];

/// Parses the file, reporting every unknown key (with the allowed ones)
/// rather than only the first. Unknown keys are dropped so that validation
/// can report the remaining problems too.
fn parse_file(text: &str, name: &str, ctx: &mut Ctx) -> Option<RawConfig> {
    let mut table: toml::Table = match text.parse() {
        Ok(t) => t,
        Err(e) => {
            let e: toml::de::Error = e;
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            let at = line.map(|l| format!(" (line {l})")).unwrap_or_default();
            ctx.err(
                name,
                format!("invalid TOML{at}: {}", e.message().trim_end()),
            );
            return None;
        }
    };
    prune_unknown(&mut table, "", TOP_KEYS, ctx);
    for &(section, keys) in SECTIONS {
        match table.get_mut(section) {
            None => {}
            Some(toml::Value::Table(t)) => prune_unknown(t, section, keys, ctx),
            Some(other) => {
                ctx.err(
                    section,
                    format!("expected a table [{section}], got a {}", other.type_str()),
                );
                table.remove(section);
            }
        }
    }
    match table.get_mut("queue") {
        None => {}
        Some(toml::Value::Array(items)) => {
            let mut bad = false;
            for (i, item) in items.iter_mut().enumerate() {
                match item {
                    toml::Value::Table(t) => {
                        prune_unknown(t, &format!("queue[{i}]"), QUEUE_KEYS, ctx)
                    }
                    other => {
                        bad = true;
                        ctx.err(
                            format!("queue[{i}]"),
                            format!("expected a [[queue]] table, got a {}", other.type_str()),
                        );
                    }
                }
            }
            if bad {
                table.remove("queue");
            }
        }
        Some(other) => {
            ctx.err(
                "queue",
                format!(
                    "expected [[queue]] tables (an array of tables), got a {}",
                    other.type_str()
                ),
            );
            table.remove("queue");
        }
    }
    match toml::Value::Table(table).try_into::<RawConfig>() {
        Ok(raw) => Some(raw),
        Err(e) => {
            // Unreachable after pruning (every field accepts any value);
            // kept as a backstop that still names the file.
            ctx.err(name, e.message().to_owned());
            None
        }
    }
}

fn prune_unknown(table: &mut toml::Table, path: &str, allowed: &[&str], ctx: &mut Ctx) {
    let unknown: Vec<String> = table
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .cloned()
        .collect();
    for k in unknown {
        let key = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        let hint = suggest(&k, allowed)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        let where_ = if path.is_empty() {
            "at the top level".to_owned()
        } else {
            format!("in {}", path.split('[').next().unwrap_or(path))
        };
        ctx.err(
            key,
            format!(
                "unknown key {where_}{hint}; allowed: {}",
                allowed.join(", ")
            ),
        );
        table.remove(&k);
    }
}

/// The closest allowed name, if it is close (edit distance <= 2).
fn suggest<'a>(name: &str, allowed: &[&'a str]) -> Option<&'a str> {
    allowed
        .iter()
        .map(|a| (edit_distance(name, a), *a))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a)
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

/// One value from the environment or a flag.
struct Setting {
    origin: String,
    target: Target,
    value: String,
}

fn apply_env(raw: &mut RawConfig, env: &BTreeMap<String, String>, ctx: &mut Ctx) {
    let table = env_table();
    let names: Vec<&str> = table.iter().map(|(n, _)| n.as_str()).collect();
    let mut settings = Vec::new();
    for (name, value) in env {
        if !name.starts_with(ENV_PREFIX) {
            continue;
        }
        let Some((_, target)) = table.iter().find(|(n, _)| n == name) else {
            ctx.push(ConfigError::new(
                name.clone(),
                unknown_var_message(name, &names),
            ));
            continue;
        };
        if value.is_empty() && !EMPTY_MEANS_SOMETHING.contains(&name.as_str()) {
            continue;
        }
        settings.push(Setting {
            origin: name.clone(),
            target: *target,
            value: value.clone(),
        });
    }
    apply_layer(raw, settings, ctx);
}

fn unknown_var_message(name: &str, names: &[&str]) -> String {
    let hint = suggest(name, names)
        .map(|s| format!(" (did you mean {s}?)"))
        .unwrap_or_default();
    // List the variables of the same section when the section is known,
    // else the sidecar contract.
    let rest = &name[ENV_PREFIX.len()..];
    let section = [
        "GATEWAY",
        "REDIS",
        "PROMETHEUS",
        "PUBSUB",
        "EMBEDDED",
        "DISPATCH",
        "TELEMETRY",
        "QUEUE",
    ]
    .into_iter()
    .find(|s| rest.starts_with(&format!("{s}_")));
    let listed: Vec<&str> = match section {
        Some(s) => {
            let prefix = format!("{ENV_PREFIX}{s}_");
            names
                .iter()
                .copied()
                .filter(|n| n.starts_with(&prefix) && *n != "SLUICEGATE_QUEUES_JSON")
                .collect()
        }
        None => CONTRACT_ENV_VARS
            .iter()
            .copied()
            .chain(["SLUICEGATE_QUEUES_JSON", "SLUICEGATE_LOG_LEVEL"])
            .collect(),
    };
    format!(
        "unknown environment variable{hint}; allowed{}: {} (every variable is listed in docs/configuration.md)",
        if section.is_some() {
            " in this section"
        } else {
            " include"
        },
        listed.join(", ")
    )
}

fn apply_overrides(raw: &mut RawConfig, o: &Overrides, ctx: &mut Ctx) {
    let flags: [(&str, &Option<String>, Target); 7] = [
        ("--transport", &o.transport, Target::Transport),
        (
            "--gateway-url",
            &o.gateway_url,
            Target::Section("gateway", "url"),
        ),
        (
            "--request-path",
            &o.request_path,
            Target::Section("gateway", "request_path"),
        ),
        ("--queue", &o.queue, Target::Queue("queue_name")),
        (
            "--listen",
            &o.listen,
            Target::Section("telemetry", "listen"),
        ),
        (
            "--log-format",
            &o.log_format,
            Target::Section("telemetry", "log_format"),
        ),
        (
            "--log-level",
            &o.log_level,
            Target::Section("telemetry", "log_level"),
        ),
    ];
    let settings = flags
        .into_iter()
        .filter_map(|(flag, v, target)| {
            v.as_ref().map(|value| Setting {
                origin: flag.to_owned(),
                target,
                value: value.clone(),
            })
        })
        .collect();
    apply_layer(raw, settings, ctx);
}

/// Applies one layer (environment or flags) onto `raw`.
fn apply_layer(raw: &mut RawConfig, settings: Vec<Setting>, ctx: &mut Ctx) {
    // Two names for one key in the same layer must agree.
    let mut by_key: BTreeMap<String, &Setting> = BTreeMap::new();
    let mut conflicting = Vec::new();
    for s in &settings {
        if let Some(first) = by_key.get(&target_key(s.target)) {
            if first.value != s.value {
                conflicting.push(
                    ConfigError::new(
                        target_key(s.target),
                        format!(
                            "set by both {} and {} with different values; set only one",
                            first.origin, s.origin
                        ),
                    )
                    .with_origin(s.origin.clone()),
                );
            }
        } else {
            by_key.insert(target_key(s.target), s);
        }
    }
    conflicting.into_iter().for_each(|e| ctx.push(e));

    // 1. The queue list as upstream JSON replaces the file's queues.
    for s in settings.iter().filter(|s| s.target == Target::QueuesJson) {
        if let Some(queues) = parse_queues_json(&s.value, &s.origin, ctx) {
            raw.queue = Some(queues);
            ctx.set_origin("queue", s.origin.clone());
        }
    }
    // 2. Top-level and section keys.
    for s in &settings {
        match s.target {
            Target::Transport => {
                raw.transport = Some(Value::String(s.value.clone()));
                ctx.set_origin("transport", s.origin.clone());
            }
            Target::Section(section, key) => {
                if let Some(slot) = raw.slot(section, key) {
                    *slot = Some(Value::String(s.value.clone()));
                    ctx.set_origin(format!("{section}.{key}"), s.origin.clone());
                }
            }
            Target::ConfigFile | Target::Queue(_) | Target::QueuesJson => {}
        }
    }
    // 3. With exactly one queue, the gateway URL and request path also
    // override that queue's own values (a sidecar's environment wins over
    // its file). With several queues they are only the defaults.
    let queues = raw.queue.get_or_insert_with(Vec::new);
    if queues.len() == 1 {
        for (section_key, queue_key) in [
            ("url", "igw_base_url"),
            ("request_path", "request_path_url"),
        ] {
            if let Some(s) = settings
                .iter()
                .find(|s| s.target == Target::Section("gateway", section_key))
                && let Some(slot) = queues[0].slot(queue_key)
                && slot.is_some()
            {
                *slot = Some(Value::String(s.value.clone()));
                ctx.set_origin(format!("queue[0].{queue_key}"), s.origin.clone());
            }
        }
    }
    // 4. Queue-level settings: create the queue when there is none,
    // override it when there is one, refuse when there are several.
    let queue_settings: Vec<&Setting> = settings
        .iter()
        .filter(|s| matches!(s.target, Target::Queue(_)))
        .collect();
    if queue_settings.is_empty() {
        return;
    }
    match queues.len() {
        0 => queues.push(RawQueue::default()),
        1 => {}
        n => {
            let names: Vec<String> = queues
                .iter()
                .map(|q| {
                    q.queue_name
                        .as_ref()
                        .or(q.subscriber_id.as_ref())
                        .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                        .unwrap_or_else(|| "<unnamed>".to_owned())
                })
                .collect();
            for s in queue_settings {
                ctx.push(
                    ConfigError::new(
                        "queue",
                        format!(
                            "queue-level setting needs exactly one queue, but {n} are configured ({}); set it in each [[queue]] of the file instead",
                            names.join(", ")
                        ),
                    )
                    .with_origin(s.origin.clone()),
                );
            }
            return;
        }
    }
    let q = &mut queues[0];
    // A new gate type invalidates the parameters of the old one.
    if let Some(ty) = queue_settings
        .iter()
        .find(|s| s.target == Target::Queue("gate_type"))
    {
        let same_type = q.gate_type.as_ref().and_then(Value::as_str) == Some(ty.value.as_str());
        if !same_type {
            q.gate_params = None;
        }
    }
    for s in queue_settings {
        let Target::Queue(key) = s.target else {
            continue;
        };
        if key == "queue_name" {
            q.subscriber_id = None;
        }
        if let Some(slot) = q.slot(key) {
            *slot = Some(Value::String(s.value.clone()));
            ctx.set_origin(format!("queue[0].{key}"), s.origin.clone());
        }
    }
}

/// `SLUICEGATE_QUEUES_JSON`: an array of upstream queue objects (or one object).
fn parse_queues_json(text: &str, origin: &str, ctx: &mut Ctx) -> Option<Vec<RawQueue>> {
    let fail = |ctx: &mut Ctx, key: String, msg: String| {
        ctx.push(ConfigError::new(key, msg).with_origin(origin.to_owned()));
    };
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            fail(
                ctx,
                "queue".into(),
                format!("expected a JSON array of queue objects: {e}"),
            );
            return None;
        }
    };
    let items = match value {
        Value::Array(a) => a,
        obj @ Value::Object(_) => vec![obj],
        _ => {
            fail(
                ctx,
                "queue".into(),
                "expected a JSON array of queue objects".into(),
            );
            return None;
        }
    };
    let mut out = Vec::new();
    let mut ok = true;
    for (i, item) in items.into_iter().enumerate() {
        let Value::Object(mut obj) = item else {
            fail(ctx, format!("queue[{i}]"), "expected a queue object".into());
            ok = false;
            continue;
        };
        let unknown: Vec<String> = obj
            .keys()
            .filter(|k| !QUEUE_KEYS.contains(&k.as_str()))
            .cloned()
            .collect();
        for k in unknown {
            fail(
                ctx,
                format!("queue[{i}].{k}"),
                format!("unknown key in a queue; allowed: {}", QUEUE_KEYS.join(", ")),
            );
            obj.remove(&k);
        }
        match serde_json::from_value::<RawQueue>(Value::Object(obj)) {
            Ok(q) => out.push(q),
            Err(e) => {
                fail(ctx, format!("queue[{i}]"), e.to_string());
                ok = false;
            }
        }
    }
    ok.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let names: Vec<String> = known_env_vars();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let msg = unknown_var_message("SLUICEGATE_DISPATCH_POLL_INTERVALL", &refs);
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
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "ab"), 2);
        assert_eq!(edit_distance("url", "url"), 0);
    }
}
