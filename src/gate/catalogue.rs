//! The gate catalogue: the closed set of gates a queue can use, parsed
//! from the upstream shape (`gate_type` + `gate_params`, parameter values as
//! strings or numbers). The config loader parses each queue's gate with
//! it; it lives here, beside the gates, so `gate/` stands below `config/`.
//!
//! Each gate is described once, in its own file under `src/gate/`: a
//! parameters struct implementing [`GateParams`] (serde shape, defaults,
//! validation, build). The catalogue below names each gate once; the enum,
//! [`GATE_TYPES`], [`allowed_params`], serialization and dispatch all come
//! from it.

use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::param::{ParseCx, allowed, parse_params};
use super::{BuildError, DispatchGate, GateContext, GateParams};
use crate::values::{ConfigError, ConfigErrors, kind, show};

/// How deep gates may nest (composite in wait-on-refuse in …); deeper is an
/// error, so hostile input cannot exhaust the stack.
pub const MAX_GATE_DEPTH: usize = 8;

/// Declares [`GateSpec`] and everything derived from the list of gates, so a
/// gate is named in exactly one place.
macro_rules! gate_catalogue {
    ($( $(#[$doc:meta])* $variant:ident($params:ty) = $name:literal, )+) => {
        /// A gate, fully typed: one variant per gate of the catalogue, each
        /// holding that gate's parameters (see `docs/gates.md`). Serializes
        /// to the upstream shape `{"gate_type": …, "gate_params": {…}}`.
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[serde(tag = "gate_type", content = "gate_params")]
        pub enum GateSpec {
            $( $(#[$doc])* #[serde(rename = $name)] $variant($params), )+
        }

        /// Every gate type name accepted in `gate_type`, as upstream spells them.
        pub const GATE_TYPES: &[&str] = &[$($name),+];

        /// The parameters each gate type accepts, for error messages and docs.
        pub fn allowed_params(gate_type: &str) -> Option<&'static [&'static str]> {
            match gate_type {
                $( $name => {
                    static ALLOWED: OnceLock<Vec<&'static str>> = OnceLock::new();
                    Some(ALLOWED.get_or_init(allowed::<$params>).as_slice())
                } )+
                _ => None,
            }
        }

        impl GateSpec {
            /// The gate types this build can run.
            pub fn available_types() -> Vec<&'static str> {
                let mut out = Vec::new();
                $( if <$params as GateParams>::BUILT { out.push($name); } )+
                out
            }

            /// The upstream `gate_type` name.
            pub fn upstream_name(&self) -> &'static str {
                match self { $( Self::$variant(_) => $name, )+ }
            }

            /// The gates nested directly in this one.
            pub fn children(&self) -> Vec<&GateSpec> {
                match self { $( Self::$variant(p) => p.children(), )+ }
            }

            /// Builds the gate this spec describes.
            pub fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
                match self { $( Self::$variant(p) => p.build(ctx), )+ }
            }

            /// Parses the parameters of gate `name` (a catalogue name).
            fn parse_params(name: &str, map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
                match name {
                    $( $name => parse_params::<$params>(map, cx).map(Self::$variant), )+
                    _ => None,
                }
            }
        }
    };
}

gate_catalogue! {
    /// Always open: budget 1.0.
    Constant(super::ConstantParams) = "constant",
    /// Minimum of the inner budgets; admission all-or-nothing.
    Composite(super::CompositeParams) = "composite",
    /// Pod-local in-flight limit.
    LocalMaxConcurrency(super::LocalMaxConcurrencyParams) = "local-max-concurrency",
    /// Turns the inner gate's refuse into wait.
    WaitOnRefuse(super::WaitOnRefuseParams) = "wait-on-refuse",
    /// Budget read from a Redis key written by an external controller.
    Redis(super::RedisParams) = "redis",
    /// `(1 − S) − (1 − threshold)` from the pool-saturation metric.
    PrometheusSaturation(super::PrometheusSaturationParams) = "prometheus-saturation",
    /// The EPP queue / running-requests cascade; `D − baseline`.
    PrometheusBudget(super::PrometheusBudgetParams) = "prometheus-budget",
    /// A PromQL query whose value is the budget.
    PrometheusQuery(super::PrometheusQueryParams) = "prometheus-query",
    /// Saturation scraped from a `/metrics` endpoint.
    EndpointScrape(super::EndpointScrapeParams) = "endpoint-scrape",
    /// Per-tenant quota admission in Redis.
    RedisQuota(super::RedisQuotaParams) = "redis-quota",
    /// Per-tenant quota admission in the `sql` transport's PostgreSQL.
    SqlQuota(super::SqlQuotaParams) = "sql-quota",
    /// Tier-aware admission when the saturation gate says the pool is full.
    TierPriorityAdmission(super::TierPriorityAdmissionParams) = "tier-priority-admission",
    /// Budget from vLLM servers' own `/metrics` (KV cache and queue).
    Vllm(super::VllmParams) = "vllm",
    /// AIMD window of own in-flight work from vLLM SLO attainment and 429s.
    Feedback(super::FeedbackParams) = "feedback",
    /// Own in-flight that keeps forecast interactive ITL within its SLO.
    SloHeadroom(super::SloHeadroomParams) = "slo-headroom",
    /// A token bucket at the rate a planner leases in a Redis hash.
    RedisLeasedRate(super::RedisLeasedRateParams) = "redis-leased-rate",
    /// A token bucket of this process, per queue.
    LocalRateLimit(super::LocalRateLimitParams) = "local-rate-limit",
    /// Ends messages whose deadline has passed.
    DeadlineDrop(super::DeadlineDropParams) = "deadline-drop",
    /// The same verdict for every message.
    ConstantDecision(super::ConstantDecisionParams) = "constant-decision",
}

/// Where a gate is, for errors: the gate itself (depth errors), its
/// `gate_type` and its `gate_params`.
struct GateKeys {
    at: String,
    gate_type: String,
    gate_params: String,
}

impl GateKeys {
    fn under(key: &str) -> Self {
        Self {
            at: key.to_owned(),
            gate_type: format!("{key}.gate_type"),
            gate_params: format!("{key}.gate_params"),
        }
    }
}

/// Parses one gate from its upstream shape. `key` is the gate's path for
/// errors (`queue[0]`); errors are keyed `<key>.gate_type` /
/// `<key>.gate_params.<name>`. A missing gate_type is an error.
pub(crate) fn parse_gate_spec(
    gate_type: Option<&Value>,
    gate_params: Option<&Value>,
    key: &str,
) -> Result<GateSpec, Vec<ConfigError>> {
    let (keys, mut errors) = (GateKeys::under(key), Vec::new());
    match parse_gate(gate_type, gate_params, &keys, 0, &mut errors) {
        Some(s) if errors.is_empty() => Ok(s),
        _ => Err(errors),
    }
}

impl GateSpec {
    /// Parses a gate from its upstream shape. `key` names the gate in
    /// errors (e.g. `queue[0]`); parameters are reported as
    /// `<key>.gate_params.<name>`.
    pub fn parse(
        gate_type: &str,
        gate_params: &Value,
        key: &str,
    ) -> Result<GateSpec, ConfigErrors> {
        let gate_type = Value::String(gate_type.to_owned());
        parse_gate_spec(Some(&gate_type), Some(gate_params), key).map_err(ConfigErrors)
    }

    /// A gate nested at `key` inside a gate at `depth`: an object
    /// `{gate_type, gate_params}` or JSON text of one (upstream nests gates
    /// as JSON text). Errors go to `errors`.
    pub(crate) fn parse_nested(
        value: &Value,
        key: &str,
        depth: usize,
        errors: &mut Vec<ConfigError>,
    ) -> Option<GateSpec> {
        let what = "a gate object {\"gate_type\": …, \"gate_params\": {…}} or JSON text of one";
        let obj = object(value, what)
            .map_err(|e| errors.push(ConfigError::new(key, e)))
            .ok()?;
        let unknown = obj
            .keys()
            .filter(|k| *k != "gate_type" && *k != "gate_params");
        for k in unknown {
            let msg = "unknown key in a gate; allowed: gate_type, gate_params";
            errors.push(ConfigError::new(format!("{key}.{k}"), msg));
        }
        let (ty, params) = (obj.get("gate_type"), obj.get("gate_params"));
        parse_gate(ty, params, &GateKeys::under(key), depth + 1, errors)
    }

    /// A gate given as a type name plus separate parameters (the
    /// `saturation_gate` + `saturation_gate_params` pair), nested in a gate
    /// at `depth`.
    pub(crate) fn parse_split(
        gate_type: &Value,
        gate_params: Option<&Value>,
        type_key: String,
        params_key: String,
        depth: usize,
        errors: &mut Vec<ConfigError>,
    ) -> Option<GateSpec> {
        let keys = GateKeys {
            at: type_key.clone(),
            gate_type: type_key,
            gate_params: params_key,
        };
        parse_gate(Some(gate_type), gate_params, &keys, depth + 1, errors)
    }

    /// Calls `f` on this gate and every nested gate.
    pub fn visit(&self, f: &mut dyn FnMut(&GateSpec)) {
        f(self);
        for child in self.children() {
            child.visit(f);
        }
    }

    /// `{"gate_type": …, "gate_params": {…}}`, the upstream object shape
    /// with typed values (numbers as numbers) and every default spelled
    /// out; unset optional parameters are left out (TOML has no null).
    /// Parsing it again gives an equal `GateSpec`.
    pub fn to_upstream(&self) -> Value {
        fn without_nulls(v: Value) -> Value {
            match v {
                Value::Object(m) => {
                    let set = m.into_iter().filter(|(_, v)| !v.is_null());
                    Value::Object(set.map(|(k, v)| (k, without_nulls(v))).collect())
                }
                Value::Array(a) => Value::Array(a.into_iter().map(without_nulls).collect()),
                other => other,
            }
        }
        // Every params struct serializes to a JSON object of strings,
        // numbers, lists, tables and nested gates: nothing can fail.
        without_nulls(serde_json::to_value(self).unwrap_or(Value::Null))
    }
}

/// An object, or JSON text of one (upstream writes nested tables as text).
fn object(v: &Value, what: &str) -> Result<Map<String, Value>, String> {
    let parsed = match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| format!("expected {what}: {e}"))?,
        other => other.clone(),
    };
    match parsed {
        Value::Object(m) => Ok(m),
        other => Err(format!("expected {what}, got {}", kind(&other))),
    }
}

/// Parses `gate_type` and `gate_params` at `keys`.
fn parse_gate(
    gate_type: Option<&Value>,
    gate_params: Option<&Value>,
    keys: &GateKeys,
    depth: usize,
    errors: &mut Vec<ConfigError>,
) -> Option<GateSpec> {
    let mut err = |key: &str, message: String| errors.push(ConfigError::new(key, message));
    if depth > MAX_GATE_DEPTH {
        let msg = format!("gates nest deeper than {MAX_GATE_DEPTH} levels");
        err(&keys.at, msg);
        return None;
    }
    let allowed = GATE_TYPES.join(", ");
    let name = match gate_type {
        None => {
            // A queue's gate can also come from the environment.
            let hint = match depth {
                0 => "; set gate_type on the queue or SLUICEGATE_GATE_TYPE",
                _ => "",
            };
            let msg = format!("gate_type is required (fail closed: no default gate){hint}");
            err(&keys.gate_type, format!("{msg}; allowed: {allowed}"));
            return None;
        }
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            let got = show(other);
            let msg = format!("expected a gate type name, got {got}; allowed: {allowed}");
            err(&keys.gate_type, msg);
            return None;
        }
    };
    let Some(&name) = GATE_TYPES.iter().find(|t| **t == name) else {
        let msg = format!("unknown gate type {name:?}; allowed: {allowed}");
        err(&keys.gate_type, msg);
        return None;
    };
    let mut map = match gate_params {
        None | Some(Value::Null) => Map::new(),
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        Some(v) => match object(v, "a table of parameters or JSON text of one") {
            Ok(m) => m,
            Err(e) => {
                err(&keys.gate_params, e);
                return None;
            }
        },
    };
    // Upstream configs write "" (or null) for "use the default".
    map.retain(|_, v| !v.is_null() && v.as_str().is_none_or(|s| !s.trim().is_empty()));
    let mut cx = ParseCx::new(name, keys.gate_params.clone(), depth, errors);
    GateSpec::parse_params(name, map, &mut cx)
}

impl<'de> Deserialize<'de> for GateSpec {
    /// Reads the upstream shape through the same parser and checks as the
    /// config loader (errors joined into one message).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let mut errors = Vec::new();
        match GateSpec::parse_nested(&value, "gate", 0, &mut errors) {
            Some(spec) if errors.is_empty() => Ok(spec),
            _ => Err(serde::de::Error::custom(ConfigErrors(errors))),
        }
    }
}

impl fmt::Display for GateSpec {
    /// Compact one-line form for summaries:
    /// `prometheus-budget(pool=p, …)`, `composite[a, b]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let is_gate = |v: &Value| match v {
            Value::Object(o) => o.contains_key("gate_type"),
            Value::Array(a) => !a.is_empty() && a.iter().all(|g| g.get("gate_type").is_some()),
            _ => false,
        };
        let upstream = self.to_upstream();
        let params = upstream.get("gate_params").and_then(Value::as_object);
        let mut scalars: Vec<String> = (params.into_iter().flatten())
            .filter(|(_, v)| !is_gate(v))
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect();
        // An unset fallback is worth saying: the gate closes on errors.
        let takes_fallback =
            allowed_params(self.upstream_name()).is_some_and(|a| a.contains(&"fallback"));
        if !scalars.is_empty()
            && takes_fallback
            && params.is_none_or(|p| !p.contains_key("fallback"))
        {
            scalars.push("fallback=none".to_owned());
        }
        f.write_str(self.upstream_name())?;
        if !scalars.is_empty() {
            write!(f, "({})", scalars.join(", "))?;
        }
        let children: Vec<String> = self.children().iter().map(ToString::to_string).collect();
        if !children.is_empty() {
            write!(f, "[{}]", children.join(", "))?;
        }
        Ok(())
    }
}
