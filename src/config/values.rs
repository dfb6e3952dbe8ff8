//! Loose values (TOML, JSON, environment strings) → typed ones: the
//! conversions named in the key declarations (`mod.rs`) that are this
//! config's own (the general ones, shared with the gate parameters, are
//! `crate::values`); and the error sink that attributes errors to their
//! origin.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use url::Url;

// The general readers live on the ground floor (gate parameters use them
// too); the ones below are this config's own.
use super::tenant_limits::{TenantLimit, TenantLimits};
use crate::secret::{EndpointUrl, Secret};
pub(crate) use crate::values::{
    ConfigError, NONZERO, as_bool, as_duration, as_f64_in, as_nonempty_string, as_positive_f64,
    as_string, as_string_list, as_string_map, as_u64, as_u64_in, choice, duration_min,
    format_duration, kind, show,
};

/// Collects errors and knows where overridden keys came from.
#[derive(Default)]
pub(crate) struct Ctx {
    /// Errors so far.
    pub(crate) errors: Vec<ConfigError>,
    /// Key path → environment variable or flag that set it.
    pub(crate) origins: BTreeMap<String, String>,
}

impl Ctx {
    /// Records an error; one without an origin is attributed to the
    /// variable or flag that set its key or one of its parents.
    pub(crate) fn push(&mut self, mut e: ConfigError) {
        e.origin = e.origin.or_else(|| self.origin_of(&e.key));
        self.errors.push(e);
    }

    /// Records an error for `key` (attributed as by [`Ctx::push`]).
    pub(crate) fn err(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.push(ConfigError::new(key, message));
    }

    /// Notes that `key` was set by `origin` (a variable or flag).
    pub(crate) fn set_origin(&mut self, key: impl Into<String>, origin: impl Into<String>) {
        self.origins.insert(key.into(), origin.into());
    }

    /// The origin of `key` or of its nearest parent (`a.b[1].c` → `a.b[1]`
    /// → `a.b` → `a`).
    pub(crate) fn origin_of(&self, key: &str) -> Option<String> {
        let mut k = key;
        loop {
            if let Some(o) = self.origins.get(k) {
                return Some(o.clone());
            }
            k = &k[..k.rfind(['.', '['])?];
        }
    }

    /// Converts `value` with `f`, recording a failure under `key`.
    pub(crate) fn conv<T>(
        &mut self,
        key: &str,
        value: Option<&Value>,
        f: impl FnOnce(&Value) -> Result<T, String>,
    ) -> Option<T> {
        f(value?).map_err(|msg| self.err(key, msg)).ok()
    }
}

/// A pool name: non-empty, without `{`, `}` (it becomes a Redis hash tag)
/// or whitespace.
pub(crate) fn pool_name(v: &Value) -> Result<Option<String>, String> {
    let name = as_nonempty_string(v)?;
    if name.contains(['{', '}']) || name.chars().any(char::is_whitespace) {
        return Err(format!(
            "a pool name without braces or spaces; got {name:?}"
        ));
    }
    Ok(Some(name))
}

/// A string where empty means "none".
pub(crate) fn optional_string(v: &Value) -> Result<Option<String>, String> {
    as_string(v).map(|s| (!s.is_empty()).then_some(s))
}

/// An optional integer (a number or a decimal string, possibly negative);
/// an empty string means none.
pub(crate) fn optional_i64(v: &Value) -> Result<Option<i64>, String> {
    let bad = || format!("expected a whole number, got {}", show(v));
    match v {
        Value::Number(n) => n.as_i64().map(Some).ok_or_else(bad),
        Value::String(s) if s.trim().is_empty() => Ok(None),
        Value::String(s) => s.trim().parse::<i64>().map(Some).map_err(|_| bad()),
        other => Err(format!("expected a whole number, got {}", kind(other))),
    }
}

/// An optional HTTP header name (empty = none): refused at load when it
/// is not a legal name, as a header the client could never write would
/// fail every request.
pub(crate) fn header_name(v: &Value) -> Result<Option<String>, String> {
    let Some(name) = optional_string(v)? else {
        return Ok(None);
    };
    let parsed = reqwest::header::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a legal HTTP header name"))?;
    // Not one the client sets itself (framing, routing), a credential, or
    // the body's `Content-Type`: the value would replace it.
    if !crate::headers::may_pass_through(&parsed) {
        return Err(format!(
            "{name:?} is a header the gateway client sets or refuses; choose another name"
        ));
    }
    Ok(Some(parsed.as_str().to_owned()))
}

/// `max_attempts`: 0 means unlimited (`None`).
pub(crate) fn attempts(v: &Value) -> Result<Option<u32>, String> {
    let n = as_u64_in(v, 0, u64::from(u32::MAX)).map_err(|e| format!("{e} (0 = unlimited)"))?;
    Ok(u32::try_from(n).ok().filter(|n| *n > 0))
}

/// A retention: `0` (keep until deleted) or at least one second (expiry
/// times are whole Unix seconds).
pub(crate) fn retention(v: &Value) -> Result<Duration, String> {
    match as_duration(v)? {
        d if d.is_zero() || d >= Duration::from_secs(1) => Ok(d),
        d => Err(format!(
            "must be 0 (keep files until deleted) or at least 1s, got {}",
            format_duration(d)
        )),
    }
}

/// Tenant weights: a table of whole numbers >= 1 (`{ alice = 3 }`), a JSON
/// object in a string, or `alice=3,bob=1` (environment variables).
pub(crate) fn tenant_weights(v: &Value) -> Result<BTreeMap<String, u32>, String> {
    (as_string_map(v)?.into_iter())
        .map(|(tenant, w)| {
            let weight = (w.trim().parse::<u32>().ok())
                .filter(|w| *w >= 1)
                .ok_or_else(|| {
                    format!("{tenant}: weight must be a whole number >= 1, got {w:?}")
                })?;
            if tenant.is_empty() {
                return Err("a tenant name must not be empty".to_owned());
            }
            Ok((tenant, weight))
        })
        .collect()
}

/// `serve.tenant_limits`: a table (or, from the environment, a JSON
/// object in a string) of `requests` and `tokens` (the default of every
/// tenant) and `tenants`, a table of per-tenant tables of the same two
/// keys. Each limit is a whole number >= 1; a limit left out is none.
pub(crate) fn tenant_limits(v: &Value) -> Result<TenantLimits, String> {
    const KEYS: &str = "requests, tokens, tenants";
    let map = match v {
        Value::Object(m) => m.clone(),
        Value::String(s) => match serde_json::from_str(s) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(format!(
                    "expected a JSON object with keys {KEYS}, got {s:?}"
                ));
            }
        },
        other => {
            return Err(format!(
                "expected a table with keys {KEYS}, got {}",
                kind(other)
            ));
        }
    };
    let mut limits = TenantLimits::default();
    for (key, value) in &map {
        match key.as_str() {
            "requests" | "tokens" => set_limit(&mut limits.default, key, value, key)?,
            "tenants" => {
                let Value::Object(tenants) = value else {
                    return Err(format!(
                        "tenants: expected a table of tenant tables, got {}",
                        kind(value)
                    ));
                };
                for (tenant, table) in tenants {
                    let at = format!("tenants.{tenant}");
                    if tenant.is_empty() {
                        return Err("tenants: a tenant name must not be empty".to_owned());
                    }
                    let Value::Object(table) = table else {
                        return Err(format!(
                            "{at}: expected a table with keys requests, tokens, got {}",
                            kind(table)
                        ));
                    };
                    let mut limit = TenantLimit::default();
                    for (key, value) in table {
                        set_limit(&mut limit, key, value, &format!("{at}.{key}"))?;
                    }
                    limits.tenants.insert(tenant.clone(), limit);
                }
            }
            other => return Err(format!("unknown key {other:?}; allowed: {KEYS}")),
        }
    }
    Ok(limits)
}

/// Sets `limit`'s `key` (`requests` or `tokens`) from `value`; `at` names
/// it in errors.
fn set_limit(limit: &mut TenantLimit, key: &str, value: &Value, at: &str) -> Result<(), String> {
    let n = (as_u64(value).ok().filter(|n| *n >= 1))
        .ok_or_else(|| format!("{at}: must be a whole number >= 1, got {}", show(value)))?;
    match key {
        "requests" => limit.requests = Some(n),
        "tokens" => limit.tokens = Some(n),
        other => {
            return Err(format!(
                "{at}: unknown key {other:?}; allowed: requests, tokens"
            ));
        }
    }
    Ok(())
}

/// A URL with one of `schemes` (`what` in messages) and a host.
fn url(v: &Value, what: &str, schemes: &[&str]) -> Result<EndpointUrl, String> {
    let u = Url::parse(as_string(v)?.trim()).map_err(|e| format!("expected {what}: {e}"))?;
    if !schemes.contains(&u.scheme()) {
        return Err(format!("expected {what}, got scheme {:?}", u.scheme()));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(format!("expected {what} with a host"));
    }
    Ok(EndpointUrl::new(u))
}

/// An http(s) URL with a host.
pub(crate) fn http_url(v: &Value) -> Result<EndpointUrl, String> {
    url(v, "an http(s) URL", &["http", "https"])
}

/// A `redis://` or `rediss://` URL.
pub(crate) fn redis_url(v: &Value) -> Result<EndpointUrl, String> {
    url(v, "a redis:// or rediss:// URL", &["redis", "rediss"])
}

/// Redis nodes (`[redis] addrs`: sentinels, or more cluster seeds): a
/// list (or comma-separated text) of `host:port` or `redis://` /
/// `rediss://` URLs.
pub(crate) fn redis_addrs(v: &Value) -> Result<Vec<String>, String> {
    let addrs = as_string_list(v)?;
    for a in &addrs {
        if a.contains("://") {
            let url = redis_url(&Value::String(a.clone()))
                .map_err(|e| format!("{a:?}: {e} (or host:port)"))?;
            // Addresses are logged and shown by `config show`.
            if url.has_password() {
                return Err(
                    "a password in addrs would be shown; give it as sentinel_password (the sentinels') or password (the master's)".to_owned(),
                );
            }
        } else if host_port(&Value::String(a.clone())).is_err() {
            return Err(format!(
                "expected host:port or a redis:// or rediss:// URL for each node, got {a:?}"
            ));
        }
    }
    Ok(addrs)
}

/// A `postgres://` or `postgresql://` URL (the `sql` transport).
pub(crate) fn postgres_url(v: &Value) -> Result<EndpointUrl, String> {
    url(
        v,
        "a postgres:// or postgresql:// URL",
        &["postgres", "postgresql"],
    )
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
    match s.starts_with('/') && !s.contains(char::is_whitespace) {
        true => Ok(s),
        false => Err(format!("must be a path starting with '/', got {s:?}")),
    }
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
    (s.trim().parse()).map_err(|_| {
        format!("expected a socket address such as 127.0.0.1:9464 or [::]:9464, got {s:?}")
    })
}

/// A `tracing` `EnvFilter` directive.
pub(crate) fn env_filter(v: &Value) -> Result<String, String> {
    let s = as_nonempty_string(v)?;
    let parsed = tracing_subscriber::EnvFilter::builder().parse(&s);
    let e = "expected an EnvFilter directive such as \"info\" or \"info,sluicegate=debug\"";
    parsed.map(|_| s).map_err(|err| format!("{e}: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_REDIS_URL;
    use crate::values::as_f64;
    use serde_json::json;

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
    fn numbers_accept_strings_and_numbers() {
        assert_eq!(as_f64(&json!("0.1")), Ok(0.1));
        assert_eq!(as_f64(&json!(0.1)), Ok(0.1));
        assert_eq!(as_u64(&json!("5")), Ok(5));
        assert_eq!(as_u64(&json!(5)), Ok(5));
        assert!(as_u64(&json!(-1)).is_err());
        assert!(as_u64(&json!(1.5)).is_err());
        assert!(as_f64(&json!("NaN")).is_err());
        assert!(as_f64(&json!([1])).is_err());
    }

    #[test]
    fn tenant_limits_take_a_default_and_overrides_and_refuse_the_rest() {
        let v = serde_json::json!({"tokens": 100, "tenants": {"acme": {"requests": "5"}}});
        let limits = tenant_limits(&v).expect("valid");
        assert_eq!(limits.default.tokens, Some(100));
        assert_eq!(limits.of("acme").requests, Some(5));
        assert_eq!(limits.of("acme").tokens, Some(100));
        let text = Value::from(r#"{"requests": 3}"#);
        assert_eq!(
            tenant_limits(&text).expect("json text").default.requests,
            Some(3)
        );
        for (bad, says) in [
            (
                serde_json::json!({"request": 1}),
                "unknown key \"request\"; allowed: requests, tokens, tenants",
            ),
            (serde_json::json!({"tokens": 0}), "tokens: "),
            (
                serde_json::json!({"tenants": {"acme": {"tokens": -1}}}),
                "tenants.acme.tokens: ",
            ),
            (
                serde_json::json!({"tenants": {"acme": {"max": 1}}}),
                "allowed: requests, tokens",
            ),
            (
                serde_json::json!({"tenants": {"acme": 5}}),
                "tenants.acme: expected a table",
            ),
            (Value::from("requests=1"), "expected a JSON object"),
        ] {
            let error = tenant_limits(&bad).expect_err("refused");
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    #[test]
    fn tenant_weights_from_a_table_or_text_and_never_zero() {
        let want: BTreeMap<String, u32> = [("alice".to_owned(), 3), ("bob".to_owned(), 1)].into();
        assert_eq!(
            tenant_weights(&serde_json::json!({"alice": 3, "bob": "1"})),
            Ok(want.clone())
        );
        assert_eq!(tenant_weights(&Value::from("alice=3, bob=1")), Ok(want));
        for bad in [
            serde_json::json!({"alice": 0}),
            serde_json::json!({"alice": "x"}),
            serde_json::json!({"alice": -1}),
            Value::from("alice"),
        ] {
            assert!(tenant_weights(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn choice_error_lists_allowed_values() {
        let err = choice(&[("text", 1), ("json", 2)])(&json!("xml")).expect_err("unknown");
        assert!(err.contains("text, json"), "{err}");
    }

    #[test]
    fn maps_and_lists_accept_several_spellings() {
        let want: BTreeMap<String, String> = [("tier".to_owned(), "batch".to_owned())].into();
        assert_eq!(as_string_map(&json!({"tier": "batch"})), Ok(want.clone()));
        assert_eq!(
            as_string_map(&json!("{\"tier\":\"batch\"}")),
            Ok(want.clone())
        );
        assert_eq!(as_string_map(&json!("tier=batch")), Ok(want));
        assert_eq!(
            as_string_list(&json!("a, b")),
            Ok(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(as_string_list(&json!("[\"a\"]")), Ok(vec!["a".to_owned()]));
    }

    #[test]
    fn origin_is_found_on_parent_keys() {
        let mut ctx = Ctx::default();
        ctx.set_origin("queue[0].gate_params", "SLUICEGATE_GATE_PARAMS");
        assert_eq!(
            ctx.origin_of("queue[0].gate_params.gates[1].gate_params.pool")
                .as_deref(),
            Some("SLUICEGATE_GATE_PARAMS")
        );
        assert_eq!(ctx.origin_of("queue[0].unit"), None);
    }
}
