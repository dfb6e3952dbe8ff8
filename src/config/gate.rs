//! Gate specifications: the closed set of gates a queue can use, parsed
//! from the upstream shape (`gate_type` + `gate_params`, parameter values as
//! strings or numbers) with every parameter typed and range-checked.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde_json::{Map, Value};
use url::Url;

use super::duration::format_duration;
use super::error::{ConfigError, ConfigErrors};
use super::values::{
    Ctx, as_choice, as_duration, as_f64_in, as_nonempty_string, as_nonneg_f64, as_positive_f64,
    as_string, as_string_list, as_string_map, as_u32_at_least_one, kind, show,
};

/// Every gate type name accepted in `gate_type`, as upstream spells them.
pub const GATE_TYPES: &[&str] = &[
    "constant",
    "composite",
    "local-max-concurrency",
    "wait-on-refuse",
    "redis",
    "prometheus-saturation",
    "prometheus-budget",
    "prometheus-query",
    "endpoint-scrape",
    "redis-quota",
    "tier-priority-admission",
    "vllm",
];

/// How deep gates may nest (composite in wait-on-refuse in …); deeper is an
/// error, so hostile input cannot exhaust the stack.
pub const MAX_GATE_DEPTH: usize = 8;

/// The parameters each gate type accepts, for error messages and docs.
pub fn allowed_params(gate_type: &str) -> Option<&'static [&'static str]> {
    Some(match gate_type {
        "constant" => &[],
        "composite" => &["gates"],
        "local-max-concurrency" => &["limit", "max_concurrency", "gating_mode"],
        "wait-on-refuse" => &["gate"],
        "redis" => &["address", "budget_key", "missing"],
        "prometheus-saturation" => &["pool", "namespace", "threshold", "fallback"],
        "prometheus-budget" => &[
            "pool",
            "namespace",
            "max_concurrency",
            "baseline",
            "fallback",
        ],
        "prometheus-query" => &["query", "fallback", "pool"],
        "endpoint-scrape" => &[
            "url",
            "metric",
            "labels",
            "max_count_per_pod",
            "baseline",
            "fallback",
            "pods_url",
            "pods_metric",
            "pods_labels",
        ],
        "redis-quota" => &[
            "address",
            "attribute",
            "mode",
            "limit",
            "window",
            "prefix",
            "gating_mode",
        ],
        "tier-priority-admission" => &["saturation_gate", "saturation_gate_params", "tier_label"],
        "vllm" => &[
            "urls",
            "kv_ceiling",
            "queue_threshold",
            "max_num_seqs",
            "baseline",
        ],
        _ => return None,
    })
}

/// What an admission gate does when it is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatingMode {
    /// Wait (park the message locally) until there is room.
    Blocking,
    /// Refuse (requeue with delay) so messages behind it are not blocked.
    Classifying,
}

impl GatingMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Blocking => "blocking",
            Self::Classifying => "classifying",
        }
    }
    const CHOICES: [(&'static str, Self); 2] = [
        ("blocking", Self::Blocking),
        ("classifying", Self::Classifying),
    ];
}

/// How a `redis-quota` gate counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    /// At most `limit` admissions per `window` per tenant.
    RateLimit,
    /// At most `limit` requests in flight per tenant.
    Concurrency,
}

impl QuotaMode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RateLimit => "rate-limit",
            Self::Concurrency => "concurrency",
        }
    }
    const CHOICES: [(&'static str, Self); 2] = [
        ("rate-limit", Self::RateLimit),
        ("concurrency", Self::Concurrency),
    ];
}

/// What the `redis` gate does when the budget key is missing or unreadable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MissingBudget {
    /// Budget 0 (the default; upstream opens instead).
    Closed,
    /// Use this budget in [0, 1] (`"open"` means 1.0, upstream's behaviour).
    Fallback(f64),
}

/// A gate, fully typed. One variant per gate of the catalogue; see
/// `docs/configuration.md` for the parameters. `fallback: None` means an
/// unreadable metric gives budget 0 (fail closed).
#[derive(Debug, Clone, PartialEq)]
pub enum GateSpec {
    /// Always open: budget 1.0.
    Constant,
    /// Minimum of the inner budgets; admission all-or-nothing.
    Composite {
        /// The inner gates, in order.
        gates: Vec<GateSpec>,
    },
    /// Pod-local in-flight limit.
    LocalMaxConcurrency {
        /// Maximum requests in flight, >= 1.
        limit: u32,
        /// Wait or refuse when full.
        gating_mode: GatingMode,
    },
    /// Turns the inner gate's refuse into wait.
    WaitOnRefuse {
        /// The wrapped gate.
        gate: Box<GateSpec>,
    },
    /// Budget read from a Redis key written by an external controller.
    Redis {
        /// `host:port` or `redis://host:port/db` (credentials come from `[redis]`).
        address: String,
        /// The key holding the budget as a float.
        budget_key: String,
        /// Behaviour when the key is missing.
        missing: MissingBudget,
    },
    /// `(1 − S) − (1 − threshold)` from the pool-saturation metric.
    PrometheusSaturation {
        /// InferencePool name.
        pool: String,
        /// Namespace label filter, if any.
        namespace: Option<String>,
        /// Saturation at which the gate closes, in [0, 1].
        threshold: f64,
        /// Budget when the metric is unreadable; `None` = 0.
        fallback: Option<f64>,
    },
    /// The EPP queue / running-requests cascade; `D − baseline`.
    PrometheusBudget {
        /// InferencePool name.
        pool: String,
        /// Namespace label filter, if any.
        namespace: Option<String>,
        /// Concurrency per ready pod, > 0.
        max_concurrency: f64,
        /// Reserved baseline in [0, 1].
        baseline: f64,
        /// Budget when no source returns a sample; `None` = 0.
        fallback: Option<f64>,
    },
    /// A PromQL query whose value, clamped to [0, 1], is the budget.
    PrometheusQuery {
        /// The PromQL expression.
        query: String,
        /// Budget when the query fails; `None` = 0.
        fallback: Option<f64>,
        /// Pool name, used only as a label.
        pool: Option<String>,
    },
    /// Saturation scraped from a `/metrics` endpoint.
    EndpointScrape {
        /// The `/metrics` URL.
        url: String,
        /// Metric name.
        metric: String,
        /// Label matchers on the metric.
        labels: BTreeMap<String, String>,
        /// Capacity per ready pod; 0 = the value is already a saturation.
        max_count_per_pod: f64,
        /// Reserved baseline in [0, 1].
        baseline: f64,
        /// Budget when the scrape fails; `None` = 0.
        fallback: Option<f64>,
        /// Where to read the ready-pod count, if not `url`.
        pods_url: Option<String>,
        /// Ready-pod metric name.
        pods_metric: Option<String>,
        /// Label matchers on the ready-pod metric.
        pods_labels: BTreeMap<String, String>,
    },
    /// Per-tenant quota admission in Redis.
    RedisQuota {
        /// `host:port` or `redis://host:port/db`.
        address: String,
        /// Metadata attribute naming the tenant.
        attribute: String,
        /// Rate limit or concurrency limit.
        mode: QuotaMode,
        /// Limit per tenant, >= 1.
        limit: u32,
        /// Rate-limit window.
        window: Duration,
        /// Redis key prefix.
        prefix: String,
        /// Wait or refuse when over quota.
        gating_mode: GatingMode,
    },
    /// Tier-aware admission when the saturation gate says the pool is full.
    TierPriorityAdmission {
        /// The gate that measures saturation.
        saturation_gate: Box<GateSpec>,
        /// Message label holding the tier.
        tier_label: String,
    },
    /// Budget from vLLM servers' own `/metrics` (KV cache and queue).
    Vllm {
        /// The servers' `/metrics` URLs.
        urls: Vec<String>,
        /// KV-cache usage at which a server counts as full, in (0, 1].
        kv_ceiling: f64,
        /// Waiting requests at which a server counts as full, > 0.
        queue_threshold: f64,
        /// Concurrency per server; `None` = read from the server's metrics.
        max_num_seqs: Option<u32>,
        /// Reserved baseline in [0, 1].
        baseline: f64,
    },
}

impl GateSpec {
    /// The upstream `gate_type` name.
    pub fn upstream_name(&self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Composite { .. } => "composite",
            Self::LocalMaxConcurrency { .. } => "local-max-concurrency",
            Self::WaitOnRefuse { .. } => "wait-on-refuse",
            Self::Redis { .. } => "redis",
            Self::PrometheusSaturation { .. } => "prometheus-saturation",
            Self::PrometheusBudget { .. } => "prometheus-budget",
            Self::PrometheusQuery { .. } => "prometheus-query",
            Self::EndpointScrape { .. } => "endpoint-scrape",
            Self::RedisQuota { .. } => "redis-quota",
            Self::TierPriorityAdmission { .. } => "tier-priority-admission",
            Self::Vllm { .. } => "vllm",
        }
    }

    /// Parses a gate from its upstream shape. `key` names the gate in
    /// errors (e.g. `queue[0]`); parameters are reported as
    /// `<key>.gate_params.<name>`.
    pub fn parse(
        gate_type: &str,
        gate_params: &Value,
        key: &str,
    ) -> Result<GateSpec, ConfigErrors> {
        let mut ctx = Ctx::default();
        let spec = parse_gate(
            &mut ctx,
            Some(&Value::String(gate_type.to_owned())),
            Some(gate_params),
            key,
            0,
        );
        match spec {
            Some(s) if ctx.errors.is_empty() => Ok(s),
            _ => Err(ConfigErrors(ctx.errors)),
        }
    }

    /// Calls `f` on this gate and every nested gate.
    pub fn visit(&self, f: &mut dyn FnMut(&GateSpec)) {
        f(self);
        match self {
            Self::Composite { gates } => gates.iter().for_each(|g| g.visit(f)),
            Self::WaitOnRefuse { gate } => gate.visit(f),
            Self::TierPriorityAdmission {
                saturation_gate, ..
            } => saturation_gate.visit(f),
            _ => {}
        }
    }

    /// The parameters in upstream shape with typed values (numbers as
    /// numbers), every default spelled out. Parsing them again gives an
    /// equal `GateSpec`.
    pub fn to_params(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_owned(), v);
        };
        let num = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
        let map = |labels: &BTreeMap<String, String>| {
            Value::Object(
                labels
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            )
        };
        match self {
            Self::Constant => {}
            Self::Composite { gates } => {
                put(
                    "gates",
                    Value::Array(gates.iter().map(GateSpec::to_upstream).collect()),
                );
            }
            Self::LocalMaxConcurrency { limit, gating_mode } => {
                put("limit", Value::from(*limit));
                put("gating_mode", Value::from(gating_mode.as_str()));
            }
            Self::WaitOnRefuse { gate } => put("gate", gate.to_upstream()),
            Self::Redis {
                address,
                budget_key,
                missing,
            } => {
                put("address", Value::from(address.as_str()));
                put("budget_key", Value::from(budget_key.as_str()));
                put(
                    "missing",
                    match missing {
                        MissingBudget::Closed => Value::from("closed"),
                        MissingBudget::Fallback(x) => num(*x),
                    },
                );
            }
            Self::PrometheusSaturation {
                pool,
                namespace,
                threshold,
                fallback,
            } => {
                put("pool", Value::from(pool.as_str()));
                if let Some(ns) = namespace {
                    put("namespace", Value::from(ns.as_str()));
                }
                put("threshold", num(*threshold));
                if let Some(f) = fallback {
                    put("fallback", num(*f));
                }
            }
            Self::PrometheusBudget {
                pool,
                namespace,
                max_concurrency,
                baseline,
                fallback,
            } => {
                put("pool", Value::from(pool.as_str()));
                if let Some(ns) = namespace {
                    put("namespace", Value::from(ns.as_str()));
                }
                put("max_concurrency", num(*max_concurrency));
                put("baseline", num(*baseline));
                if let Some(f) = fallback {
                    put("fallback", num(*f));
                }
            }
            Self::PrometheusQuery {
                query,
                fallback,
                pool,
            } => {
                put("query", Value::from(query.as_str()));
                if let Some(f) = fallback {
                    put("fallback", num(*f));
                }
                if let Some(p) = pool {
                    put("pool", Value::from(p.as_str()));
                }
            }
            Self::EndpointScrape {
                url,
                metric,
                labels,
                max_count_per_pod,
                baseline,
                fallback,
                pods_url,
                pods_metric,
                pods_labels,
            } => {
                put("url", Value::from(url.as_str()));
                put("metric", Value::from(metric.as_str()));
                put("labels", map(labels));
                put("max_count_per_pod", num(*max_count_per_pod));
                put("baseline", num(*baseline));
                if let Some(f) = fallback {
                    put("fallback", num(*f));
                }
                if let Some(u) = pods_url {
                    put("pods_url", Value::from(u.as_str()));
                }
                if let Some(m) = pods_metric {
                    put("pods_metric", Value::from(m.as_str()));
                }
                put("pods_labels", map(pods_labels));
            }
            Self::RedisQuota {
                address,
                attribute,
                mode,
                limit,
                window,
                prefix,
                gating_mode,
            } => {
                put("address", Value::from(address.as_str()));
                put("attribute", Value::from(attribute.as_str()));
                put("mode", Value::from(mode.as_str()));
                put("limit", Value::from(*limit));
                put("window", Value::from(format_duration(*window)));
                put("prefix", Value::from(prefix.as_str()));
                put("gating_mode", Value::from(gating_mode.as_str()));
            }
            Self::TierPriorityAdmission {
                saturation_gate,
                tier_label,
            } => {
                put("saturation_gate", saturation_gate.to_upstream());
                put("tier_label", Value::from(tier_label.as_str()));
            }
            Self::Vllm {
                urls,
                kv_ceiling,
                queue_threshold,
                max_num_seqs,
                baseline,
            } => {
                put(
                    "urls",
                    Value::Array(urls.iter().map(|u| Value::from(u.as_str())).collect()),
                );
                put("kv_ceiling", num(*kv_ceiling));
                put("queue_threshold", num(*queue_threshold));
                if let Some(n) = max_num_seqs {
                    put("max_num_seqs", Value::from(*n));
                }
                put("baseline", num(*baseline));
            }
        }
        m
    }

    /// `{"gate_type": …, "gate_params": {…}}`, the upstream object shape.
    pub fn to_upstream(&self) -> Value {
        let mut m = Map::new();
        m.insert("gate_type".to_owned(), Value::from(self.upstream_name()));
        m.insert("gate_params".to_owned(), Value::Object(self.to_params()));
        Value::Object(m)
    }
}

impl fmt::Display for GateSpec {
    /// Compact one-line form for summaries: `prometheus-budget(pool=p, …)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.upstream_name();
        match self {
            Self::Composite { gates } => {
                write!(f, "{name}[")?;
                for (i, g) in gates.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{g}")?;
                }
                f.write_str("]")
            }
            Self::WaitOnRefuse { gate } => write!(f, "{name}[{gate}]"),
            Self::TierPriorityAdmission {
                saturation_gate,
                tier_label,
            } => write!(f, "{name}(tier_label={tier_label})[{saturation_gate}]"),
            _ => {
                let params = self.to_params();
                if params.is_empty() {
                    return f.write_str(name);
                }
                write!(f, "{name}(")?;
                for (i, (k, v)) in params.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    match v {
                        Value::String(s) => write!(f, "{k}={s}")?,
                        other => write!(f, "{k}={other}")?,
                    }
                }
                if let Some(fb) = fallback_of(self)
                    && fb.is_none()
                {
                    f.write_str(", fallback=none")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// The `fallback` of gates that have one.
fn fallback_of(g: &GateSpec) -> Option<Option<f64>> {
    match g {
        GateSpec::PrometheusSaturation { fallback, .. }
        | GateSpec::PrometheusBudget { fallback, .. }
        | GateSpec::PrometheusQuery { fallback, .. }
        | GateSpec::EndpointScrape { fallback, .. } => Some(*fallback),
        _ => None,
    }
}

/// Parameter reader for one gate: records errors under
/// `<path>.<name>` and knows which names the gate accepts.
struct Params<'c> {
    gate_type: &'static str,
    map: Map<String, Value>,
    path: String,
    ctx: &'c mut Ctx,
}

impl Params<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.path)
    }

    /// The value, treating absent, null and empty strings as not set
    /// (upstream configs write `""` for "default").
    fn raw(&self, name: &str) -> Option<Value> {
        match self.map.get(name) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.trim().is_empty() => None,
            Some(v) => Some(v.clone()),
        }
    }

    fn opt<T>(&mut self, name: &str, f: impl FnOnce(&Value) -> Result<T, String>) -> Option<T> {
        let v = self.raw(name);
        let key = self.key(name);
        self.ctx.conv(&key, v.as_ref(), f)
    }

    fn req<T>(
        &mut self,
        name: &str,
        what: &str,
        f: impl FnOnce(&Value) -> Result<T, String>,
    ) -> Option<T> {
        if self.raw(name).is_none() {
            let key = self.key(name);
            let gate = self.gate_type;
            self.ctx.err(
                key,
                format!("required parameter of gate `{gate}` is missing ({what})"),
            );
            return None;
        }
        self.opt(name, f)
    }

    fn or<T>(&mut self, name: &str, default: T, f: impl FnOnce(&Value) -> Result<T, String>) -> T {
        self.opt(name, f).unwrap_or(default)
    }

    fn fraction(&mut self, name: &str, default: f64) -> f64 {
        self.or(name, default, |v| as_f64_in(v, 0.0, 1.0))
    }

    fn fallback(&mut self) -> Option<f64> {
        self.opt("fallback", |v| as_f64_in(v, 0.0, 1.0))
    }

    fn http_url(&mut self, name: &str, required: bool) -> Option<String> {
        let check = |v: &Value| {
            let s = as_string(v)?;
            let u = Url::parse(&s).map_err(|e| format!("expected an http(s) URL: {e}"))?;
            if !matches!(u.scheme(), "http" | "https") {
                return Err(format!(
                    "expected an http(s) URL, got scheme {:?}",
                    u.scheme()
                ));
            }
            no_password(&u)?;
            Ok(s)
        };
        if required {
            self.req(name, "an http(s) URL", check)
        } else {
            self.opt(name, check)
        }
    }

    fn redis_address(&mut self) -> Option<String> {
        self.req("address", "host:port or redis://host:port/db", |v| {
            let s = as_nonempty_string(v)?;
            if s.contains("://") {
                let u = Url::parse(&s).map_err(|e| format!("invalid redis URL: {e}"))?;
                if !matches!(u.scheme(), "redis" | "rediss") {
                    return Err(format!(
                        "expected host:port or a redis:// or rediss:// URL, got scheme {:?}",
                        u.scheme()
                    ));
                }
                no_password(&u)?;
            }
            Ok(s)
        })
    }

    fn nested(&mut self, name: &str, depth: usize) -> Option<GateSpec> {
        let key = self.key(name);
        let v = self.raw(name);
        let Some(v) = v else {
            let gate = self.gate_type;
            self.ctx.err(
                key,
                format!(
                    "required parameter of gate `{gate}` is missing (a gate: {{\"gate_type\": …, \"gate_params\": {{…}}}})"
                ),
            );
            return None;
        };
        parse_gate_object(self.ctx, &v, &key, depth)
    }

    /// Reports parameters the gate does not accept.
    fn finish(self) {
        let allowed = allowed_params(self.gate_type).unwrap_or(&[]);
        for k in self.map.keys() {
            if !allowed.contains(&k.as_str()) {
                let msg = if allowed.is_empty() {
                    format!(
                        "unknown parameter; gate `{}` takes no parameters",
                        self.gate_type
                    )
                } else {
                    format!(
                        "unknown parameter for gate `{}`; allowed: {}",
                        self.gate_type,
                        allowed.join(", ")
                    )
                };
                self.ctx.err(format!("{}.{k}", self.path), msg);
            }
        }
    }
}

fn no_password(u: &Url) -> Result<(), String> {
    if u.password().is_some() {
        Err(
            "credentials in gate parameters are not allowed (they would be shown); \
             use [redis] password or [prometheus] credentials"
                .to_owned(),
        )
    } else {
        Ok(())
    }
}

/// A nested gate: an object `{gate_type, gate_params}` or a JSON string
/// holding one (upstream nests gates as JSON text).
fn parse_gate_object(ctx: &mut Ctx, v: &Value, key: &str, depth: usize) -> Option<GateSpec> {
    let parsed;
    let v = match v {
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(p) => {
                parsed = p;
                &parsed
            }
            Err(e) => {
                ctx.err(
                    key,
                    format!("expected a gate object {{\"gate_type\": …, \"gate_params\": {{…}}}} or JSON text of one: {e}"),
                );
                return None;
            }
        },
        other => other,
    };
    let Value::Object(obj) = v else {
        ctx.err(
            key,
            format!(
                "expected a gate object {{\"gate_type\": …, \"gate_params\": {{…}}}}, got {}",
                kind(v)
            ),
        );
        return None;
    };
    for k in obj.keys() {
        if k != "gate_type" && k != "gate_params" {
            ctx.err(
                format!("{key}.{k}"),
                "unknown key in a gate; allowed: gate_type, gate_params",
            );
        }
    }
    parse_gate(
        ctx,
        obj.get("gate_type"),
        obj.get("gate_params"),
        key,
        depth + 1,
    )
}

/// Parses `<key>.gate_type` and `<key>.gate_params`.
pub(crate) fn parse_gate(
    ctx: &mut Ctx,
    gate_type: Option<&Value>,
    gate_params: Option<&Value>,
    key: &str,
    depth: usize,
) -> Option<GateSpec> {
    let type_key = format!("{key}.gate_type");
    let params_key = format!("{key}.gate_params");
    if depth > MAX_GATE_DEPTH {
        ctx.err(
            key,
            format!("gates nest deeper than {MAX_GATE_DEPTH} levels"),
        );
        return None;
    }
    let Some(type_value) = gate_type else {
        ctx.err(
            type_key,
            format!(
                "gate_type is required (no gate would mean an open gate); allowed: {}",
                GATE_TYPES.join(", ")
            ),
        );
        return None;
    };
    let type_name = match type_value {
        Value::String(s) => s.as_str(),
        other => {
            ctx.err(
                type_key,
                format!(
                    "expected a gate type name, got {}; allowed: {}",
                    show(other),
                    GATE_TYPES.join(", ")
                ),
            );
            return None;
        }
    };
    let Some(&gate_type) = GATE_TYPES.iter().find(|t| **t == type_name) else {
        ctx.err(
            type_key,
            format!(
                "unknown gate type {type_name:?}; allowed: {}",
                GATE_TYPES.join(", ")
            ),
        );
        return None;
    };
    let map = match gate_params {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            Ok(other) => {
                ctx.err(
                    params_key,
                    format!("expected a JSON object of parameters, got {}", kind(&other)),
                );
                return None;
            }
            Err(e) => {
                ctx.err(
                    params_key,
                    format!("expected a JSON object of parameters: {e}"),
                );
                return None;
            }
        },
        Some(other) => {
            ctx.err(
                params_key,
                format!("expected a table of parameters, got {}", kind(other)),
            );
            return None;
        }
    };
    let errors_before = ctx.errors.len();
    let mut p = Params {
        gate_type,
        map,
        path: params_key,
        ctx,
    };
    let spec = build(&mut p, gate_type, depth);
    p.finish();
    if ctx.errors.len() > errors_before {
        None
    } else {
        spec
    }
}

/// Builds one gate from its parameters; returns `None` when a required
/// parameter failed (errors are already recorded).
fn build(p: &mut Params<'_>, gate_type: &str, depth: usize) -> Option<GateSpec> {
    let fraction_or_none = |v: &Value| as_f64_in(v, 0.0, 1.0);
    Some(match gate_type {
        "constant" => GateSpec::Constant,
        "composite" => {
            let key = p.key("gates");
            let list = match p.raw("gates") {
                None => {
                    p.ctx.err(
                        key,
                        "required parameter of gate `composite` is missing (an array of gates)",
                    );
                    return None;
                }
                Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
                    Ok(v) => v,
                    Err(e) => {
                        p.ctx
                            .err(key, format!("expected a JSON array of gates: {e}"));
                        return None;
                    }
                },
                Some(v) => v,
            };
            let Value::Array(items) = list else {
                p.ctx.err(
                    key,
                    format!("expected an array of gates, got {}", kind(&list)),
                );
                return None;
            };
            if items.is_empty() {
                p.ctx.err(key, "must hold at least one gate");
                return None;
            }
            let gates: Vec<Option<GateSpec>> = items
                .iter()
                .enumerate()
                .map(|(i, g)| parse_gate_object(p.ctx, g, &format!("{key}[{i}]"), depth))
                .collect();
            GateSpec::Composite {
                gates: gates.into_iter().collect::<Option<Vec<_>>>()?,
            }
        }
        "local-max-concurrency" => {
            let limit = if p.raw("limit").is_none() && p.raw("max_concurrency").is_some() {
                // Newer upstream releases call it max_concurrency.
                p.opt("max_concurrency", as_u32_at_least_one)
            } else {
                if p.raw("limit").is_some() && p.raw("max_concurrency").is_some() {
                    let key = p.key("max_concurrency");
                    p.ctx
                        .err(key, "set either limit or max_concurrency, not both");
                }
                p.req("limit", "maximum in flight, >= 1", as_u32_at_least_one)
            };
            let gating_mode = p.or("gating_mode", GatingMode::Blocking, |v| {
                as_choice(v, &GatingMode::CHOICES)
            });
            GateSpec::LocalMaxConcurrency {
                limit: limit?,
                gating_mode,
            }
        }
        "wait-on-refuse" => GateSpec::WaitOnRefuse {
            gate: Box::new(p.nested("gate", depth)?),
        },
        "redis" => {
            let address = p.redis_address();
            let budget_key = p.or(
                "budget_key",
                "dispatch-gate-budget".to_owned(),
                as_nonempty_string,
            );
            let missing = p.or("missing", MissingBudget::Closed, |v| match v {
                Value::String(s) if s == "closed" => Ok(MissingBudget::Closed),
                Value::String(s) if s == "open" => Ok(MissingBudget::Fallback(1.0)),
                other => as_f64_in(other, 0.0, 1.0)
                    .map(MissingBudget::Fallback)
                    .map_err(|_| {
                        format!(
                            "allowed: \"closed\", \"open\" or a budget in [0, 1], got {}",
                            show(other)
                        )
                    }),
            });
            GateSpec::Redis {
                address: address?,
                budget_key,
                missing,
            }
        }
        "prometheus-saturation" => {
            let pool = p.req("pool", "the InferencePool name", as_nonempty_string);
            let namespace = p.opt("namespace", as_string);
            let threshold = p.fraction("threshold", 0.8);
            let fallback = p.fallback();
            GateSpec::PrometheusSaturation {
                pool: pool?,
                namespace,
                threshold,
                fallback,
            }
        }
        "prometheus-budget" => {
            let pool = p.req("pool", "the InferencePool name", as_nonempty_string);
            let namespace = p.opt("namespace", as_string);
            let max_concurrency = p.or("max_concurrency", 100.0, as_positive_f64);
            let baseline = p.fraction("baseline", 0.05);
            let fallback = p.fallback();
            GateSpec::PrometheusBudget {
                pool: pool?,
                namespace,
                max_concurrency,
                baseline,
                fallback,
            }
        }
        "prometheus-query" => {
            let query = p.req("query", "a PromQL expression", as_nonempty_string);
            let fallback = p.opt("fallback", fraction_or_none);
            let pool = p.opt("pool", as_string);
            GateSpec::PrometheusQuery {
                query: query?,
                fallback,
                pool,
            }
        }
        "endpoint-scrape" => {
            let url = p.http_url("url", true);
            let metric = p.req("metric", "a metric name", as_nonempty_string);
            let labels = p.or("labels", BTreeMap::new(), as_string_map);
            let max_count_per_pod = p.or("max_count_per_pod", 0.0, as_nonneg_f64);
            let baseline = p.fraction("baseline", 0.0);
            let fallback = p.fallback();
            let pods_url = p.http_url("pods_url", false);
            let pods_metric = p.opt("pods_metric", as_nonempty_string);
            let pods_labels = p.or("pods_labels", BTreeMap::new(), as_string_map);
            GateSpec::EndpointScrape {
                url: url?,
                metric: metric?,
                labels,
                max_count_per_pod,
                baseline,
                fallback,
                pods_url,
                pods_metric,
                pods_labels,
            }
        }
        "redis-quota" => {
            let address = p.redis_address();
            let attribute = p.or("attribute", "userid".to_owned(), as_nonempty_string);
            let mode = p.or("mode", QuotaMode::RateLimit, |v| {
                as_choice(v, &QuotaMode::CHOICES)
            });
            let limit = p.req("limit", "a whole number >= 1", as_u32_at_least_one);
            let window = p.or("window", Duration::from_secs(60), |v| {
                let d = as_duration(v)?;
                if d.is_zero() {
                    Err("must be greater than 0".to_owned())
                } else {
                    Ok(d)
                }
            });
            let prefix = p.or("prefix", "quota:".to_owned(), as_string);
            let gating_mode = p.or("gating_mode", GatingMode::Classifying, |v| {
                as_choice(v, &GatingMode::CHOICES)
            });
            GateSpec::RedisQuota {
                address: address?,
                attribute,
                mode,
                limit: limit?,
                window,
                prefix,
                gating_mode,
            }
        }
        "tier-priority-admission" => {
            let tier_label = p.or("tier_label", "tier".to_owned(), as_nonempty_string);
            let gate_key = p.key("saturation_gate");
            let saturation_gate = match p.raw("saturation_gate") {
                // A gate type name, with its parameters beside it.
                Some(Value::String(s)) if !s.trim_start().starts_with('{') => {
                    let params = p.raw("saturation_gate_params");
                    let ty = Value::String(s);
                    let path = p.path.clone();
                    parse_gate_split(p.ctx, &ty, params.as_ref(), &path, depth + 1)
                }
                Some(v) => {
                    if p.raw("saturation_gate_params").is_some() {
                        let key = p.key("saturation_gate_params");
                        p.ctx.err(
                            key,
                            "not allowed when saturation_gate is a gate object (put gate_params inside it)",
                        );
                    }
                    parse_gate_object(p.ctx, &v, &gate_key, depth)
                }
                None => {
                    p.ctx.err(
                        gate_key,
                        format!(
                            "required parameter of gate `tier-priority-admission` is missing (a gate type name or gate object; allowed types: {})",
                            GATE_TYPES.join(", ")
                        ),
                    );
                    None
                }
            };
            GateSpec::TierPriorityAdmission {
                saturation_gate: Box::new(saturation_gate?),
                tier_label,
            }
        }
        "vllm" => {
            let urls_key = p.key("urls");
            let urls = p.req("urls", "a list of vLLM /metrics URLs", as_string_list);
            if let Some(list) = &urls {
                if list.is_empty() {
                    p.ctx.err(urls_key.clone(), "must list at least one URL");
                }
                for (i, u) in list.iter().enumerate() {
                    match Url::parse(u) {
                        Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {
                            if let Err(e) = no_password(&parsed) {
                                p.ctx.err(format!("{urls_key}[{i}]"), e);
                            }
                        }
                        _ => p.ctx.err(
                            format!("{urls_key}[{i}]"),
                            format!("expected an http(s) URL, got {u:?}"),
                        ),
                    }
                }
            }
            let kv_ceiling = p.or("kv_ceiling", 0.9, |v| {
                let x = as_f64_in(v, 0.0, 1.0)?;
                if x > 0.0 {
                    Ok(x)
                } else {
                    Err("must be in (0, 1], got 0".to_owned())
                }
            });
            let queue_threshold = p.or("queue_threshold", 5.0, as_positive_f64);
            let max_num_seqs = p.opt("max_num_seqs", as_u32_at_least_one);
            let baseline = p.fraction("baseline", 0.05);
            GateSpec::Vllm {
                urls: urls?,
                kv_ceiling,
                queue_threshold,
                max_num_seqs,
                baseline,
            }
        }
        // GATE_TYPES and this match list the same names; the unit test
        // `every_gate_type_builds` keeps them in step.
        _ => return None,
    })
}

/// Parses a gate given as a type name plus separate parameters (the
/// `saturation_gate` + `saturation_gate_params` pair), reporting errors
/// under `<path>.saturation_gate` / `<path>.saturation_gate_params`.
fn parse_gate_split(
    ctx: &mut Ctx,
    gate_type: &Value,
    params: Option<&Value>,
    path: &str,
    depth: usize,
) -> Option<GateSpec> {
    let mut sub = Ctx {
        errors: Vec::new(),
        origins: ctx.origins.clone(),
    };
    let spec = parse_gate(&mut sub, Some(gate_type), params, "\u{0}", depth);
    for mut e in sub.errors {
        if e.key == "\u{0}" {
            e.key = format!("{path}.saturation_gate");
        }
        e.key = e
            .key
            .replacen("\u{0}.gate_type", &format!("{path}.saturation_gate"), 1)
            .replacen(
                "\u{0}.gate_params",
                &format!("{path}.saturation_gate_params"),
                1,
            );
        if e.origin.is_none()
            && let Some(o) = ctx.origin_of(&e.key)
        {
            e.origin = Some(o);
        }
        ctx.push(e);
    }
    spec
}

/// Parses one gate from its upstream shape. `key` is the gate's path for errors (`queue[0]`);
/// errors are keyed `<key>.gate_type` / `<key>.gate_params.<name>`. A missing gate_type is an
/// error ("gate_type is required (fail closed: no default gate); ... allowed: <GATE_TYPES>").
pub(crate) fn parse_gate_spec(
    gate_type: Option<&Value>,
    gate_params: Option<&Value>,
    key: &str,
) -> Result<GateSpec, Vec<ConfigError>> {
    let type_key = format!("{key}.gate_type");
    if gate_type.is_none() {
        return Err(vec![ConfigError::new(
            type_key,
            format!(
                "gate_type is required (fail closed: no default gate); set gate_type on the queue or SLUICEGATE_GATE_TYPE; allowed: {}",
                GATE_TYPES.join(", ")
            ),
        )]);
    }
    let mut ctx = Ctx::default();
    match parse_gate(&mut ctx, gate_type, gate_params, key, 0) {
        Some(spec) if ctx.errors.is_empty() => Ok(spec),
        // A failed parse always records an error; the fallback keeps it
        // fail closed should one ever be missed.
        _ if ctx.errors.is_empty() => Err(vec![ConfigError::new(type_key, "invalid gate")]),
        _ => Err(ctx.errors),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(t: &str, p: Value) -> Result<GateSpec, ConfigErrors> {
        GateSpec::parse(t, &p, "queue[0]")
    }

    fn sample_params(t: &str) -> Value {
        match t {
            "constant" => json!({}),
            "composite" => json!({"gates": [{"gate_type": "constant", "gate_params": {}}]}),
            "local-max-concurrency" => json!({"limit": 4}),
            "wait-on-refuse" => json!({"gate": {"gate_type": "constant"}}),
            "redis" => json!({"address": "127.0.0.1:6379"}),
            "prometheus-saturation" | "prometheus-budget" => json!({"pool": "p"}),
            "prometheus-query" => json!({"query": "1 - up"}),
            "endpoint-scrape" => json!({"url": "http://127.0.0.1:9000/metrics", "metric": "m"}),
            "redis-quota" => json!({"address": "127.0.0.1:6379", "limit": "10"}),
            "tier-priority-admission" => {
                json!({"saturation_gate": "prometheus-saturation", "saturation_gate_params": {"pool": "p"}})
            }
            "vllm" => json!({"urls": ["http://127.0.0.1:8000/metrics"]}),
            other => panic!("no sample for {other}"),
        }
    }

    #[test]
    fn every_gate_type_builds_and_round_trips() {
        for t in GATE_TYPES {
            let spec = parse(t, sample_params(t)).unwrap_or_else(|e| panic!("{t}: {e}"));
            assert_eq!(spec.upstream_name(), *t);
            let again = parse(t, Value::Object(spec.to_params()))
                .unwrap_or_else(|e| panic!("{t} round trip: {e}"));
            assert_eq!(spec, again, "{t}");
            let allowed = allowed_params(t).unwrap_or_else(|| panic!("{t}"));
            for k in spec.to_params().keys() {
                assert!(allowed.contains(&k.as_str()), "{t} renders unlisted {k}");
            }
        }
    }

    #[test]
    fn prometheus_budget_accepts_strings_and_numbers_with_defaults() {
        let spec = parse(
            "prometheus-budget",
            json!({"pool": "p", "baseline": "0.1", "max_concurrency": 10}),
        )
        .expect("valid");
        assert_eq!(
            spec,
            GateSpec::PrometheusBudget {
                pool: "p".into(),
                namespace: None,
                max_concurrency: 10.0,
                baseline: 0.1,
                fallback: None,
            }
        );
    }

    #[test]
    fn unknown_gate_type_lists_allowed_types() {
        let err = parse("prometheus-budgt", json!({}))
            .expect_err("unknown")
            .to_string();
        assert!(err.contains("queue[0].gate_type"), "{err}");
        assert!(err.contains("prometheus-budget, prometheus-query"), "{err}");
    }

    #[test]
    fn unknown_param_lists_allowed_params() {
        let err = parse("prometheus-budget", json!({"pool": "p", "basline": 0.1}))
            .expect_err("unknown")
            .to_string();
        assert!(err.contains("queue[0].gate_params.basline"), "{err}");
        assert!(
            err.contains("pool, namespace, max_concurrency, baseline, fallback"),
            "{err}"
        );
    }

    #[test]
    fn collects_all_parameter_errors() {
        let errs = parse(
            "prometheus-budget",
            json!({"baseline": 1.5, "max_concurrency": 0, "fallback": "x"}),
        )
        .expect_err("invalid");
        let text = errs.to_string();
        assert_eq!(errs.len(), 4, "{text}");
        assert!(
            text.contains("gate_params.pool: required parameter"),
            "{text}"
        );
        assert!(
            text.contains("gate_params.baseline: must be in [0, 1], got 1.5"),
            "{text}"
        );
        assert!(
            text.contains("gate_params.max_concurrency: must be greater than 0"),
            "{text}"
        );
        assert!(
            text.contains("gate_params.fallback: expected a number"),
            "{text}"
        );
    }

    #[test]
    fn composite_accepts_upstream_json_text_with_string_params() {
        let gates = r#"[{"gate_type":"prometheus-budget","gate_params":{"pool":"p","baseline":"0.2"}},
                        {"gate_type":"local-max-concurrency","gate_params":{"limit":"3","gating_mode":"classifying"}}]"#;
        let spec = parse("composite", json!({ "gates": gates })).expect("valid");
        let GateSpec::Composite { gates } = spec else {
            panic!("not composite")
        };
        assert_eq!(gates.len(), 2);
        assert_eq!(
            gates[1],
            GateSpec::LocalMaxConcurrency {
                limit: 3,
                gating_mode: GatingMode::Classifying
            }
        );
    }

    #[test]
    fn nested_errors_name_the_full_path() {
        let err = parse(
            "wait-on-refuse",
            json!({"gate": {"gate_type": "composite", "gate_params": {"gates": [
                {"gate_type": "constant"},
                {"gate_type": "prometheus-budget", "gate_params": {"pool": "p", "baseline": 2}}
            ]}}}),
        )
        .expect_err("invalid")
        .to_string();
        assert!(
            err.contains("queue[0].gate_params.gate.gate_params.gates[1].gate_params.baseline"),
            "{err}"
        );
    }

    #[test]
    fn tier_priority_admission_reports_split_params_by_name() {
        let err = parse(
            "tier-priority-admission",
            json!({"saturation_gate": "prometheus-saturation", "saturation_gate_params": {"threshold": 3}}),
        )
        .expect_err("invalid")
        .to_string();
        assert!(
            err.contains("queue[0].gate_params.saturation_gate_params.pool"),
            "{err}"
        );
        assert!(
            err.contains("queue[0].gate_params.saturation_gate_params.threshold"),
            "{err}"
        );
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let mut g = json!({"gate_type": "constant"});
        for _ in 0..50 {
            g = json!({"gate_type": "wait-on-refuse", "gate_params": {"gate": g}});
        }
        let err = parse("wait-on-refuse", g["gate_params"].clone())
            .expect_err("too deep")
            .to_string();
        assert!(err.contains("nest deeper"), "{err}");
    }

    #[test]
    fn redis_gate_fails_closed_unless_told() {
        let spec = parse("redis", json!({"address": "r:6379"})).expect("valid");
        assert!(matches!(
            spec,
            GateSpec::Redis {
                missing: MissingBudget::Closed,
                ..
            }
        ));
        let spec = parse("redis", json!({"address": "r:6379", "missing": "open"})).expect("valid");
        assert!(matches!(
            spec,
            GateSpec::Redis {
                missing: MissingBudget::Fallback(x),
                ..
            } if x == 1.0
        ));
    }

    #[test]
    fn credentials_in_gate_urls_are_rejected() {
        let err = parse("redis", json!({"address": "redis://:pw@r:6379"}))
            .expect_err("password")
            .to_string();
        assert!(err.contains("credentials"), "{err}");
        assert!(!err.contains("pw@"), "{err}");
    }

    #[test]
    fn local_max_concurrency_accepts_newer_upstream_name() {
        let spec = parse("local-max-concurrency", json!({"max_concurrency": "8"})).expect("valid");
        assert_eq!(
            spec,
            GateSpec::LocalMaxConcurrency {
                limit: 8,
                gating_mode: GatingMode::Blocking
            }
        );
        let err = parse("local-max-concurrency", json!({"limit": 0}))
            .expect_err("zero")
            .to_string();
        assert!(err.contains(">= 1"), "{err}");
    }
}
