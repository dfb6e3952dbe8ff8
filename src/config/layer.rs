//! Sources and layering: the file, the `SLUICEGATE_*` environment and
//! command-line flags are applied in that order onto one loose tree (the
//! file's shape as JSON values), each overridden key remembering which
//! variable or flag set it; `check` then turns the tree into a `Config`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::{Map, Value};

use super::check::{build, did_you_mean};
use super::values::{Ctx, kind};
use super::{Config, QueueConfig, SECTIONS};
use crate::telemetry::traces::TRACE_ENV_VARS;
use crate::values::{ConfigError, ConfigErrors};

/// The loose tree: top-level keys, section tables and the `queue` array.
type Tree = Map<String, Value>;

/// Upstream's variable for the `sql` transport's database: one more name
/// of `sql.url` (`SLUICEGATE_SQL_URL`); when both are set they must agree.
pub(crate) const UPSTREAM_SQL_URL: &str = "SQL_URL";

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
    /// `SLUICEGATE_*` variables and the OTEL trace variables
    /// ([`TRACE_ENV_VARS`]), and the other flags. A variable whose value
    /// is not UTF-8 is kept lossily converted, so it fails validation
    /// rather than being silently ignored.
    pub fn from_process(file_flag: Option<PathBuf>, overrides: Overrides) -> Self {
        let env = std::env::vars_os()
            .filter_map(|(k, v)| {
                let k = k.to_string_lossy().into_owned();
                (k.starts_with(ENV_PREFIX)
                    || TRACE_ENV_VARS.contains(&k.as_str())
                    || k == UPSTREAM_SQL_URL)
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
    /// Upstream's merge-policy JSON file (`type`, `parameters`), mapped
    /// onto `dispatch.merge_*` and `gateway.fairness_attribute`.
    MergePolicyFile,
}

/// Variables whose empty value is meaningful (it disables something);
/// every other variable set to "" counts as unset.
const EMPTY_MEANS_SOMETHING: &[&str] = &[
    "SLUICEGATE_GATEWAY_FAIRNESS_ATTRIBUTE",
    "SLUICEGATE_QUEUE_INFERENCE_OBJECTIVE",
    "SLUICEGATE_DISPATCH_MERGE_PRIORITY_HEADER",
];

/// Every variable and its target: the short contract names, then
/// `SLUICEGATE_<SECTION>_<KEY>` for every declared key.
fn env_table() -> Vec<(String, Target)> {
    let short = [
        ("CONFIG", Target::ConfigFile),
        ("TRANSPORT", Target::Transport),
        ("QUEUE", Target::Queue("queue_name")),
        ("GATE_TYPE", Target::Queue("gate_type")),
        ("GATE_PARAMS", Target::Queue("gate_params")),
        ("QUEUES_JSON", Target::QueuesJson),
        ("MERGE_POLICY_FILE", Target::MergePolicyFile),
        ("REQUEST_PATH", Target::Section("gateway", "request_path")),
        ("LISTEN", Target::Section("telemetry", "listen")),
        ("LOG_FORMAT", Target::Section("telemetry", "log_format")),
        ("LOG_LEVEL", Target::Section("telemetry", "log_level")),
    ];
    let queue = [("queue", QueueConfig::FIELD_KEYS)];
    let all = SECTIONS.iter().chain(&queue);
    let declared = all.flat_map(|&(section, keys)| {
        keys.iter().map(move |&key| {
            let name = format!("{ENV_PREFIX}{section}_{key}").to_uppercase();
            match section {
                "queue" => (name, Target::Queue(key)),
                _ => (name, Target::Section(section, key)),
            }
        })
    });
    let short = short.map(|(n, t)| (format!("{ENV_PREFIX}{n}"), t));
    short.into_iter().chain(declared).collect()
}

/// Every environment variable sluicegate reads, sorted.
pub fn known_env_vars() -> Vec<String> {
    let names: BTreeSet<String> = env_table().into_iter().map(|(n, _)| n).collect();
    names.into_iter().collect()
}

/// The key path a target writes, for errors and origins.
fn target_key(t: Target) -> String {
    match t {
        Target::ConfigFile => "config".to_owned(),
        Target::Transport => "transport".to_owned(),
        Target::Section(s, k) => format!("{s}.{k}"),
        Target::Queue(k) => format!("queue[0].{k}"),
        Target::QueuesJson => "queue".to_owned(),
        Target::MergePolicyFile => "merge_policy_file".to_owned(),
    }
}

impl super::ServeConfig {
    /// `[serve]` from the same file, environment and flags as
    /// [`Config::load`] (which accepts the section and leaves it alone).
    pub fn load(sources: &ConfigSources) -> Result<Self, ConfigErrors> {
        let mut ctx = Ctx::default();
        let mut tree = match source_text(sources)? {
            None => Tree::new(),
            Some((text, name)) => parse_file(&text, &name, &mut ctx)
                .ok_or_else(|| ConfigErrors(std::mem::take(&mut ctx.errors)))?,
        };
        apply_env(&mut tree, &sources.env, &mut ctx);
        apply_overrides(&mut tree, &sources.overrides, &mut ctx);
        let serve = super::check::read_section::<Self>(&mut tree, &mut ctx);
        // Errors elsewhere in the tree are `Config::load`'s to report.
        let mine: Vec<ConfigError> = (ctx.errors.into_iter())
            .filter(|e| e.key.starts_with("serve.") || e.key.starts_with("SLUICEGATE_SERVE_"))
            .collect();
        match mine.is_empty() {
            true => Ok(serve),
            false => Err(ConfigErrors(mine)),
        }
    }
}

/// The config file's text and name, if one is named (flag, then
/// `SLUICEGATE_CONFIG`).
fn source_text(sources: &ConfigSources) -> Result<Option<(String, String)>, ConfigErrors> {
    let named = sources
        .env
        .get("SLUICEGATE_CONFIG")
        .filter(|p| !p.is_empty());
    let Some(path) = sources.file.clone().or_else(|| named.map(PathBuf::from)) else {
        return Ok(None);
    };
    let name = path.display().to_string();
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some((text, name))),
        Err(e) => {
            let e = ConfigError::new(name, format!("cannot read config file: {e}"));
            Err(ConfigErrors(vec![e]))
        }
    }
}

impl Config {
    /// Loads the configuration from a file (if any), the environment map
    /// and flags, with precedence flag > environment > file > default.
    /// Returns every problem found, not just the first.
    pub fn load(sources: &ConfigSources) -> Result<Config, ConfigErrors> {
        match source_text(sources)? {
            Some((text, name)) => load_text(Some((&text, &name)), &sources.env, &sources.overrides),
            None => load_text(None, &sources.env, &sources.overrides),
        }
    }

    /// Loads from TOML text instead of a file, with an environment map and
    /// no flags (for tests and tools).
    pub fn from_toml_str(
        text: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigErrors> {
        load_text(Some((text, "<string>")), env, &Overrides::default())
    }
}

/// Loads from TOML text (named `name` in errors), an environment map and flags.
fn load_text(
    file: Option<(&str, &str)>,
    env: &BTreeMap<String, String>,
    overrides: &Overrides,
) -> Result<Config, ConfigErrors> {
    let mut ctx = Ctx::default();
    let mut tree = match file {
        None => Tree::new(),
        Some((text, name)) => parse_file(text, name, &mut ctx)
            .ok_or_else(|| ConfigErrors(std::mem::take(&mut ctx.errors)))?,
    };
    apply_env(&mut tree, env, &mut ctx);
    apply_overrides(&mut tree, overrides, &mut ctx);
    let mut config = build(tree, &mut ctx);
    // The one place the OTEL variables are read, from the same map.
    match crate::telemetry::TraceSettings::from_env(env) {
        Ok(traces) => config.traces = traces,
        Err(error) => ctx.push(ConfigError::new(error.var, error.message)),
    }
    match ctx.errors.is_empty() {
        true => Ok(config),
        false => Err(ConfigErrors(ctx.errors)),
    }
}

/// Parses the file into the loose tree; a section that is not a table or a
/// `queue` that is not an array is reported and dropped, so that the layers
/// above can fill them in. Unknown keys are left to `check`.
fn parse_file(text: &str, name: &str, ctx: &mut Ctx) -> Option<Tree> {
    let mut tree: Tree = match toml::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            let e: toml::de::Error = e;
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].lines().count());
            let at = line
                .map(|l| format!(" (line {})", l.max(1)))
                .unwrap_or_default();
            ctx.err(
                name,
                format!("invalid TOML{at}: {}", e.message().trim_end()),
            );
            return None;
        }
    };
    for key in SECTIONS.iter().map(|(s, _)| *s).chain(["queue"]) {
        let (what, fits): (_, fn(&Value) -> bool) = match key {
            "queue" => (
                "[[queue]] tables (an array of tables)".to_owned(),
                Value::is_array,
            ),
            s => (format!("a table [{s}]"), Value::is_object),
        };
        if let Some(got) = tree.get(key).filter(|v| !fits(v)).map(kind) {
            ctx.err(key, format!("expected {what}, got {got}"));
            tree.remove(key);
        }
    }
    Some(tree)
}

/// One value from the environment or a flag.
struct Setting {
    origin: String,
    target: Target,
    value: String,
}

fn apply_env(tree: &mut Tree, env: &BTreeMap<String, String>, ctx: &mut Ctx) {
    let table = env_table();
    let names: Vec<&str> = table.iter().map(|(n, _)| n.as_str()).collect();
    let mut settings = Vec::new();
    for (name, value) in env.iter().filter(|(n, _)| n.starts_with(ENV_PREFIX)) {
        let Some(&(_, target)) = table.iter().find(|(n, _)| n == name) else {
            if !is_service_link(name) {
                ctx.err(name.clone(), unknown_var_message(name, &names));
            }
            continue;
        };
        if !value.is_empty() || EMPTY_MEANS_SOMETHING.contains(&name.as_str()) {
            let (origin, value) = (name.clone(), value.clone());
            settings.push(Setting {
                origin,
                target,
                value,
            });
        }
    }
    // Upstream's name for `sql.url`, in the same layer as ours.
    if let Some(value) = env.get(UPSTREAM_SQL_URL).filter(|v| !v.is_empty()) {
        settings.insert(
            0,
            Setting {
                origin: UPSTREAM_SQL_URL.to_owned(),
                target: Target::Section("sql", "url"),
                value: value.clone(),
            },
        );
    }
    apply_layer(tree, settings, ctx);
}

/// Whether `name` has the shape of a variable Kubernetes injects for a
/// Service (`enableServiceLinks`, on by default): a Service named
/// `sluicegate` or `sluicegate-<anything>` gives every pod of its namespace
/// `<SVC>_SERVICE_HOST`, `<SVC>_SERVICE_PORT`, `<SVC>_SERVICE_PORT_<NAME>`,
/// `<SVC>_PORT` and `<SVC>_PORT_<port>_<PROTO>` with `_PROTO`, `_PORT` and
/// `_ADDR` after it. They are never configuration, so they are ignored
/// rather than reported as unknown (which stopped the pod from starting);
/// every other unknown `SLUICEGATE_*` variable still stops startup, so a
/// typo in a setting is never silently dropped. A declared variable always
/// wins: this is asked only of names the table does not know.
pub(crate) fn is_service_link(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(ENV_PREFIX.trim_end_matches('_')) else {
        return false;
    };
    if !rest.starts_with('_') {
        return false;
    }
    let parts: Vec<&str> = rest.split('_').collect();
    // `rest` starts with "_" or is empty; the service name's own tail (a
    // Service `sluicegate-api` gives `SLUICEGATE_API_...`) may be any words,
    // so the shape is matched from the end.
    let is_port = |p: &str| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit());
    let is_proto = |p: &str| matches!(p, "TCP" | "UDP" | "SCTP");
    let n = parts.len();
    let ends = |tail: &[&str]| n > tail.len() && parts[n - tail.len()..] == *tail;
    if ends(&["SERVICE", "HOST"]) || ends(&["SERVICE", "PORT"]) || ends(&["PORT"]) {
        return true;
    }
    // `<SVC>_SERVICE_PORT_<NAME>`: a named port; names are lowercase
    // letters, digits and dashes, upper-cased with dashes as `_`.
    if let Some(i) = (0..n.saturating_sub(2))
        .rev()
        .find(|&i| parts[i..i + 2] == ["SERVICE", "PORT"])
    {
        return i > 0 && i + 2 < n && parts[i + 2..].iter().all(|p| !p.is_empty());
    }
    // `<SVC>_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]`.
    let tail = match parts.last() {
        Some(&("PROTO" | "PORT" | "ADDR")) if n >= 4 && is_proto(parts[n - 2]) => &parts[..n - 1],
        _ => &parts[..],
    };
    let m = tail.len();
    m >= 4 && is_proto(tail[m - 1]) && is_port(tail[m - 2]) && tail[m - 3] == "PORT"
}

fn unknown_var_message(name: &str, names: &[&str]) -> String {
    let hint = did_you_mean(name, names, "");
    // List the variables of the same section when the section is known,
    // else the sidecar contract.
    let section = (SECTIONS.iter().map(|(s, _)| *s).chain(["queue"]))
        .map(|s| format!("{ENV_PREFIX}{}_", s.to_uppercase()))
        .find(|prefix| name.starts_with(prefix.as_str()));
    let listed: Vec<&str> = match &section {
        Some(prefix) => (names.iter().copied())
            .filter(|n| n.starts_with(prefix.as_str()) && *n != "SLUICEGATE_QUEUES_JSON")
            .collect(),
        None => (CONTRACT_ENV_VARS.iter().copied())
            .chain(["SLUICEGATE_QUEUES_JSON", "SLUICEGATE_LOG_LEVEL"])
            .collect(),
    };
    let which = section.map_or(" include", |_| " in this section");
    format!(
        "unknown environment variable{hint}; allowed{which}: {} (every variable is listed in docs/configuration.md)",
        listed.join(", ")
    )
}

/// Each flag sets what its environment variable (`SLUICEGATE_` + the
/// second name) sets.
fn apply_overrides(tree: &mut Tree, o: &Overrides, ctx: &mut Ctx) {
    let table = env_table();
    let flags = [
        ("--transport", "TRANSPORT", &o.transport),
        ("--gateway-url", "GATEWAY_URL", &o.gateway_url),
        ("--request-path", "REQUEST_PATH", &o.request_path),
        ("--queue", "QUEUE", &o.queue),
        ("--listen", "LISTEN", &o.listen),
        ("--log-format", "LOG_FORMAT", &o.log_format),
        ("--log-level", "LOG_LEVEL", &o.log_level),
    ];
    let settings = flags
        .into_iter()
        .filter_map(|(flag, var, value)| {
            let var = format!("{ENV_PREFIX}{var}");
            let &(_, target) = table.iter().find(|(n, _)| *n == var)?;
            let (origin, value) = (flag.to_owned(), value.clone()?);
            Some(Setting {
                origin,
                target,
                value,
            })
        })
        .collect();
    apply_layer(tree, settings, ctx);
}

/// Applies one layer (environment or flags) onto `tree`.
fn apply_layer(tree: &mut Tree, settings: Vec<Setting>, ctx: &mut Ctx) {
    // Two names for one key in the same layer must agree.
    let mut by_key: BTreeMap<String, &Setting> = BTreeMap::new();
    for s in &settings {
        let first = *by_key.entry(target_key(s.target)).or_insert(s);
        if first.value != s.value {
            let (a, b) = (&first.origin, &s.origin);
            let msg = format!("set by both {a} and {b} with different values; set only one");
            ctx.push(ConfigError::new(target_key(s.target), msg).with_origin(b.clone()));
        }
    }
    let string = |s: &Setting| Value::String(s.value.clone());
    // 1. The queue list as upstream JSON replaces the file's queues.
    for s in settings.iter().filter(|s| s.target == Target::QueuesJson) {
        match parse_queues_json(&s.value) {
            Ok(queues) => {
                tree.insert("queue".to_owned(), Value::Array(queues));
                ctx.set_origin("queue", s.origin.clone());
            }
            Err(e) => ctx.push(ConfigError::new("queue", e).with_origin(s.origin.clone())),
        }
    }
    // 1b. Upstream's merge-policy file sets section keys; a key the same
    //     layer also names directly (step 2) wins over it.
    for s in settings
        .iter()
        .filter(|s| s.target == Target::MergePolicyFile)
    {
        let mapped = std::fs::read_to_string(&s.value)
            .map_err(|e| format!("cannot read the merge-policy file {}: {e}", s.value))
            .and_then(|text| merge_policy_file(&text));
        match mapped {
            Ok(keys) => {
                for (section, key, value) in keys {
                    let t = tree
                        .entry(section)
                        .or_insert_with(|| Value::Object(Tree::new()));
                    if let Some(t) = t.as_object_mut() {
                        t.insert(key.to_owned(), Value::String(value));
                    }
                    ctx.set_origin(format!("{section}.{key}"), s.origin.clone());
                }
            }
            Err(e) => {
                ctx.push(ConfigError::new("merge_policy_file", e).with_origin(s.origin.clone()))
            }
        }
    }
    // 2. Top-level and section keys.
    for s in &settings {
        match s.target {
            Target::Transport => drop(tree.insert("transport".to_owned(), string(s))),
            Target::Section(section, key) => {
                let t = tree
                    .entry(section)
                    .or_insert_with(|| Value::Object(Tree::new()));
                // Sections in the tree are tables (the file reader prunes the rest).
                if let Some(t) = t.as_object_mut() {
                    t.insert(key.to_owned(), string(s));
                }
            }
            Target::ConfigFile
            | Target::Queue(_)
            | Target::QueuesJson
            | Target::MergePolicyFile => continue,
        }
        ctx.set_origin(target_key(s.target), s.origin.clone());
    }
    // The file reader and the JSON reader only store arrays here.
    let Value::Array(queues) = tree
        .entry("queue")
        .or_insert_with(|| Value::Array(Vec::new()))
    else {
        return;
    };
    // 3. With exactly one queue, the gateway URL and request path also
    // override that queue's own values (a sidecar's environment wins over
    // its file). With several queues they are only the defaults.
    if let [Value::Object(q)] = queues.as_mut_slice() {
        let pairs = [
            ("url", "igw_base_url"),
            ("request_path", "request_path_url"),
        ];
        for (section_key, queue_key) in pairs {
            let target = Target::Section("gateway", section_key);
            if let Some(s) = settings.iter().find(|s| s.target == target)
                && q.contains_key(queue_key)
            {
                q.insert(queue_key.to_owned(), string(s));
                ctx.set_origin(format!("queue[0].{queue_key}"), s.origin.clone());
            }
        }
    }
    // 4. Queue-level settings: create the queue when there is none,
    // override it when there is one, refuse when there are several.
    let on_queue: Vec<(&str, &Setting)> = (settings.iter())
        .filter_map(|s| match s.target {
            Target::Queue(key) => Some((key, s)),
            _ => None,
        })
        .collect();
    if on_queue.is_empty() {
        return;
    }
    if queues.len() > 1 {
        let name = |q: &Value| match q.get("queue_name").or_else(|| q.get("subscriber_id")) {
            Some(Value::String(s)) => s.clone(),
            other => other.map_or("<unnamed>".to_owned(), Value::to_string),
        };
        let names: Vec<String> = queues.iter().map(name).collect();
        for (_, s) in on_queue {
            let msg = format!(
                "queue-level setting needs exactly one queue, but {} are configured ({}); set it in each [[queue]] of the file instead",
                queues.len(),
                names.join(", ")
            );
            ctx.push(ConfigError::new("queue", msg).with_origin(s.origin.clone()));
        }
        return;
    }
    if queues.is_empty() {
        queues.push(Value::Object(Tree::new()));
    }
    let Some(q) = queues[0].as_object_mut() else {
        return;
    };
    // A new gate type invalidates the parameters of the old one.
    if let Some((_, ty)) = on_queue.iter().find(|(key, _)| *key == "gate_type")
        && q.get("gate_type").and_then(Value::as_str) != Some(ty.value.as_str())
    {
        q.remove("gate_params");
    }
    for (key, s) in on_queue {
        if key == "queue_name" {
            q.remove("subscriber_id");
        }
        q.insert(key.to_owned(), string(s));
        ctx.set_origin(target_key(s.target), s.origin.clone());
    }
}

/// The fairness header upstream stamps by default, and ours always.
const UPSTREAM_FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";

/// Upstream's merge-policy file (`--request-merge-policy-config-file`,
/// `SLUICEGATE_MERGE_POLICY_FILE`): `{"type": ..., "parameters": {...}}`,
/// as the `(section, key, value)` settings it stands for. Strict where
/// upstream is: unknown top-level keys; stricter: an unknown parameter, a
/// type other than `random-robin` / `tier-priority`, and a fairness
/// header other than upstream's default name (ours is fixed) are errors.
/// Upstream's empty `priority_header` / `tier_label` mean their defaults,
/// and an empty `fairness_header` turns stamping off, which here is
/// `gateway.fairness_attribute = ""` (also one tenant for fair shares).
fn merge_policy_file(text: &str) -> Result<Vec<(&'static str, &'static str, String)>, String> {
    let doc: Value =
        serde_json::from_str(text).map_err(|e| format!("invalid merge-policy JSON: {e}"))?;
    let Value::Object(mut doc) = doc else {
        return Err("a merge-policy file is a JSON object with `type` and `parameters`".to_owned());
    };
    let kind = match doc.remove("type") {
        Some(Value::String(t)) if t == "random-robin" || t == "tier-priority" => t,
        Some(other) => {
            return Err(format!(
                "unknown merge policy type {other}; allowed: random-robin, tier-priority"
            ));
        }
        None => return Err("`type` is required; allowed: random-robin, tier-priority".to_owned()),
    };
    let params = match doc.remove("parameters") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(p)) => p,
        Some(_) => return Err("`parameters` must be a JSON object".to_owned()),
    };
    if let Some(key) = doc.keys().next() {
        return Err(format!(
            "unknown key `{key}` in the merge-policy file; allowed: type, parameters"
        ));
    }
    let allowed: &[&str] = match kind.as_str() {
        "tier-priority" => &[
            "priority_header",
            "tier_label",
            "fairness_header",
            "fairness_attribute",
        ],
        _ => &["fairness_header", "fairness_attribute"],
    };
    let mut out = vec![("dispatch", "merge_policy", kind.clone())];
    for (key, value) in params {
        if !allowed.contains(&key.as_str()) {
            return Err(format!(
                "unknown {kind} parameter `{key}`; allowed: {}",
                allowed.join(", ")
            ));
        }
        let Value::String(value) = value else {
            return Err(format!("parameter `{key}` must be a string"));
        };
        match key.as_str() {
            "priority_header" if !value.is_empty() => {
                out.push(("dispatch", "merge_priority_header", value));
            }
            "tier_label" if !value.is_empty() => out.push(("dispatch", "merge_tier_label", value)),
            "fairness_header" if value.is_empty() => {
                out.push(("gateway", "fairness_attribute", String::new()));
            }
            "fairness_header" if !value.eq_ignore_ascii_case(UPSTREAM_FAIRNESS_HEADER) => {
                return Err(format!(
                    "fairness_header {value:?}: the fairness header is always {UPSTREAM_FAIRNESS_HEADER} here; \"\" turns it off"
                ));
            }
            "fairness_attribute" if !value.is_empty() => {
                out.push(("gateway", "fairness_attribute", value));
            }
            _ => {}
        }
    }
    // `fairness_header: ""` wins over an attribute: stamping is off.
    if out
        .iter()
        .any(|(s, k, v)| *s == "gateway" && *k == "fairness_attribute" && v.is_empty())
    {
        out.retain(|(s, k, v)| !(*s == "gateway" && *k == "fairness_attribute" && !v.is_empty()));
    }
    Ok(out)
}

/// `SLUICEGATE_QUEUES_JSON`: an array of upstream queue objects (or one
/// object); `check` checks each like the file's `[[queue]]` tables.
fn parse_queues_json(text: &str) -> Result<Vec<Value>, String> {
    let what = "expected a JSON array of queue objects";
    match serde_json::from_str(text) {
        Ok(Value::Array(items)) => Ok(items),
        Ok(obj @ Value::Object(_)) => Ok(vec![obj]),
        Ok(_) => Err(what.to_owned()),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_links_of_a_sluicegate_service_are_recognised() {
        for name in [
            "SLUICEGATE_SERVICE_HOST",
            "SLUICEGATE_SERVICE_PORT",
            "SLUICEGATE_SERVICE_PORT_METRICS",
            "SLUICEGATE_SERVICE_PORT_HTTP_API",
            "SLUICEGATE_PORT",
            "SLUICEGATE_PORT_9090_TCP",
            "SLUICEGATE_PORT_9090_TCP_PROTO",
            "SLUICEGATE_PORT_9090_TCP_PORT",
            "SLUICEGATE_PORT_9090_TCP_ADDR",
            "SLUICEGATE_PORT_53_UDP",
            "SLUICEGATE_API_SERVICE_HOST",
            "SLUICEGATE_API_PORT_8080_TCP_ADDR",
            "SLUICEGATE_BATCH_API_SERVICE_PORT_HTTP",
        ] {
            assert!(is_service_link(name), "{name}");
        }
    }

    #[test]
    fn other_names_are_not_service_links() {
        for name in [
            "SLUICEGATE_",
            "SLUICEGATE_SERVICE",
            "SLUICEGATE_GATE_TYPE",
            "SLUICEGATE_BIN",
            "SLUICEGATE_PORT_TCP",
            "SLUICEGATE_PORT_9090",
            "SLUICEGATE_PORT_9090_HTTP",
            "SLUICEGATE_PORT_909090_TCP",
            "SLUICEGATE_PORT_9090_TCP_HOST",
            "SLUICEGATE_SERVICE_PORT_",
            "OTHER_SERVICE_HOST",
            "SLUICEGATEX_SERVICE_HOST",
        ] {
            assert!(!is_service_link(name), "{name}");
        }
    }

    #[test]
    fn a_pod_with_service_links_loads_and_a_typo_beside_them_is_still_reported() {
        let env = |extra: &[(&str, &str)]| {
            let base = [
                ("SLUICEGATE_TRANSPORT", "memory"),
                ("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:9"),
                ("SLUICEGATE_GATE_TYPE", "constant"),
                ("SLUICEGATE_SERVICE_HOST", "10.0.0.1"),
                ("SLUICEGATE_SERVICE_PORT", "9090"),
                ("SLUICEGATE_PORT", "tcp://10.0.0.1:9090"),
                ("SLUICEGATE_PORT_9090_TCP", "tcp://10.0.0.1:9090"),
                ("SLUICEGATE_PORT_9090_TCP_ADDR", "10.0.0.1"),
            ];
            let all = base.iter().chain(extra);
            ConfigSources {
                env: all.map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ..Default::default()
            }
        };
        Config::load(&env(&[])).expect("service links are not configuration");
        let err = Config::load(&env(&[("SLUICEGATE_GATE_TPYE", "constant")]))
            .expect_err("a typo is still reported");
        let text = err.to_string();
        assert!(
            text.contains("SLUICEGATE_GATE_TPYE: unknown environment variable"),
            "{text}"
        );
        assert!(!text.contains("SERVICE_HOST"), "{text}");
    }

    #[test]
    fn every_declared_key_is_documented() {
        let docs = include_str!("../../docs/configuration.md");
        let queue = [("queue", QueueConfig::KEYS)];
        for &(section, keys) in SECTIONS.iter().chain(&queue) {
            for key in keys {
                assert!(docs.contains(&format!("`{key}`")), "{section}.{key}");
            }
        }
    }
}
