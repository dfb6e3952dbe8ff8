//! Conversions from loosely typed values (TOML, JSON, environment strings)
//! to typed ones, and the error sink that attributes errors to their origin.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use super::duration::{parse_duration, seconds};
use super::error::ConfigError;

/// Collects errors and knows where overridden keys came from.
#[derive(Default)]
pub(crate) struct Ctx {
    /// Errors so far.
    pub(crate) errors: Vec<ConfigError>,
    /// Key path → environment variable or flag that set it.
    pub(crate) origins: BTreeMap<String, String>,
}

impl Ctx {
    /// Records an error for `key`, attributed to the variable or flag that
    /// set `key` or one of its parents.
    pub(crate) fn err(&mut self, key: impl Into<String>, message: impl Into<String>) {
        let key = key.into();
        let mut e = ConfigError::new(key.clone(), message);
        if let Some(origin) = self.origin_of(&key) {
            e = e.with_origin(origin);
        }
        self.errors.push(e);
    }

    /// Records an error already attributed.
    pub(crate) fn push(&mut self, e: ConfigError) {
        self.errors.push(e);
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
            let cut = k.rfind(['.', '['])?;
            k = &k[..cut];
        }
    }

    /// Converts `value` with `f`, recording a failure under `key`.
    pub(crate) fn conv<T>(
        &mut self,
        key: &str,
        value: Option<&Value>,
        f: impl FnOnce(&Value) -> Result<T, String>,
    ) -> Option<T> {
        let v = value?;
        match f(v) {
            Ok(t) => Some(t),
            Err(msg) => {
                self.err(key, msg);
                None
            }
        }
    }
}

/// Short description of a value for error messages (never used for secrets).
pub(crate) fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        let head: String = s.chars().take(77).collect();
        format!("{head}…")
    } else {
        s
    }
}

/// A string; numbers and booleans are accepted in their text form since
/// upstream configurations carry every parameter as a string.
pub(crate) fn as_string(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        other => Err(format!("expected a string, got {}", kind(other))),
    }
}

/// A string that must not be empty.
pub(crate) fn as_nonempty_string(v: &Value) -> Result<String, String> {
    let s = as_string(v)?;
    if s.trim().is_empty() {
        Err("must not be empty".to_owned())
    } else {
        Ok(s)
    }
}

/// A finite float, from a number or a decimal string.
pub(crate) fn as_f64(v: &Value) -> Result<f64, String> {
    let x = match v {
        Value::Number(n) => n.as_f64().ok_or_else(|| format!("{n} is not a number"))?,
        Value::String(s) => s
            .trim()
            .parse::<f64>()
            .map_err(|_| format!("expected a number, got {}", show(v)))?,
        other => return Err(format!("expected a number, got {}", kind(other))),
    };
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("expected a finite number, got {}", show(v)))
    }
}

/// A float strictly greater than zero.
pub(crate) fn as_positive_f64(v: &Value) -> Result<f64, String> {
    let x = as_f64(v)?;
    if x > 0.0 {
        Ok(x)
    } else {
        Err(format!("must be greater than 0, got {x}"))
    }
}

/// A non-negative integer, from a number or a decimal string.
pub(crate) fn as_u64(v: &Value) -> Result<u64, String> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("expected a whole number >= 0, got {n}")),
        Value::String(s) => s
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("expected a whole number >= 0, got {}", show(v))),
        other => Err(format!("expected a whole number, got {}", kind(other))),
    }
}

/// An integer in `[lo, hi]`.
pub(crate) fn as_u64_in(v: &Value, lo: u64, hi: u64) -> Result<u64, String> {
    let x = as_u64(v)?;
    if (lo..=hi).contains(&x) {
        Ok(x)
    } else {
        Err(format!("must be in [{lo}, {hi}], got {x}"))
    }
}

/// A duration: text such as `"30s"` or a number of seconds.
pub(crate) fn as_duration(v: &Value) -> Result<Duration, String> {
    match v {
        Value::String(s) => parse_duration(s),
        Value::Number(n) => n
            .as_f64()
            .and_then(seconds)
            .ok_or_else(|| format!("expected a duration >= 0, got {n}")),
        other => Err(format!(
            "expected a duration such as \"30s\", got {}",
            kind(other)
        )),
    }
}

/// One of a closed set of names.
pub(crate) fn as_choice<T: Copy>(v: &Value, choices: &[(&str, T)]) -> Result<T, String> {
    let allowed = || {
        choices
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match v {
        Value::String(s) => choices
            .iter()
            .find(|(n, _)| n == s)
            .map(|(_, t)| *t)
            .ok_or_else(|| format!("unknown value {s:?}; allowed: {}", allowed())),
        other => Err(format!(
            "expected one of {}, got {}",
            allowed(),
            show(other)
        )),
    }
}

/// A string map: a table/object of scalars, a JSON object in a string, or
/// `k=v,k2=v2` text.
pub(crate) fn as_string_map(v: &Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| {
                as_string(v)
                    .map(|s| (k.clone(), s))
                    .map_err(|e| format!("{k}: {e}"))
            })
            .collect(),
        Value::String(s) if s.trim_start().starts_with('{') => {
            let parsed: Value =
                serde_json::from_str(s).map_err(|e| format!("expected a JSON object: {e}"))?;
            as_string_map(&parsed)
        }
        Value::String(s) => {
            let mut out = BTreeMap::new();
            for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| format!("expected key=value pairs, got {pair:?}"))?;
                out.insert(k.trim().to_owned(), v.trim().to_owned());
            }
            Ok(out)
        }
        other => Err(format!("expected a table of strings, got {}", kind(other))),
    }
}

/// A list of strings: an array, a JSON array in a string, or comma-separated
/// text.
pub(crate) fn as_string_list(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(a) => a.iter().map(as_string).collect(),
        Value::String(s) if s.trim_start().starts_with('[') => {
            let parsed: Value =
                serde_json::from_str(s).map_err(|e| format!("expected a JSON array: {e}"))?;
            as_string_list(&parsed)
        }
        Value::String(s) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect()),
        other => Err(format!("expected a list of strings, got {}", kind(other))),
    }
}

/// The JSON kind of a value, for messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "a table",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
    fn choice_error_lists_allowed_values() {
        let err = as_choice(&json!("xml"), &[("text", 1), ("json", 2)]).expect_err("unknown");
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
