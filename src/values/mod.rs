//! Loose settings values (TOML, JSON, environment text, upstream's
//! all-strings parameters) to typed ones, duration text, and the keyed
//! error that names what was wrong where. On the ground floor: the config
//! loader and each gate's parameters read their values with these.

mod duration;
mod error;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

pub use duration::{
    format_duration, parse_duration, serialize_duration, serialize_optional_duration,
};
pub use error::{ConfigError, ConfigErrors};

/// Smallest duration that counts as "greater than 0".
pub const NONZERO: Duration = Duration::from_nanos(1);

/// Short description of a value for error messages (never used for secrets).
pub fn show(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(77) {
        Some((cut, _)) if s.chars().count() > 80 => format!("{}…", &s[..cut]),
        _ => s,
    }
}

/// The JSON kind of a value, for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "a table",
    }
}

/// A string; numbers and booleans are accepted in their text form since
/// upstream configurations carry every parameter as a string.
pub fn as_string(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(_) | Value::Bool(_) => Ok(v.to_string()),
        other => Err(format!("expected a string, got {}", kind(other))),
    }
}

/// A string that must not be empty.
pub fn as_nonempty_string(v: &Value) -> Result<String, String> {
    let s = as_string(v)?;
    (!s.trim().is_empty())
        .then_some(s)
        .ok_or_else(|| "must not be empty".to_owned())
}

/// A boolean, from `true`/`false` or their text form (environment values
/// are strings).
pub fn as_bool(v: &Value) -> Result<bool, String> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::String(s) => match s.trim() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("expected true or false, got {}", show(v))),
        },
        other => Err(format!("expected true or false, got {}", kind(other))),
    }
}

/// A finite float, from a number or a decimal string.
pub fn as_f64(v: &Value) -> Result<f64, String> {
    let x = match v {
        Value::Number(n) => n.as_f64().ok_or_else(|| format!("{n} is not a number"))?,
        Value::String(s) => s
            .trim()
            .parse::<f64>()
            .map_err(|_| format!("expected a number, got {}", show(v)))?,
        other => return Err(format!("expected a number, got {}", kind(other))),
    };
    x.is_finite()
        .then_some(x)
        .ok_or_else(|| format!("expected a finite number, got {}", show(v)))
}

/// A float in `[min, max]`.
pub fn as_f64_in(v: &Value, min: f64, max: f64) -> Result<f64, String> {
    let x = as_f64(v)?;
    (min..=max)
        .contains(&x)
        .then_some(x)
        .ok_or_else(|| format!("must be in [{min}, {max}], got {x}"))
}

/// A float strictly greater than zero.
pub fn as_positive_f64(v: &Value) -> Result<f64, String> {
    let x = as_f64(v)?;
    (x > 0.0)
        .then_some(x)
        .ok_or_else(|| format!("must be greater than 0, got {x}"))
}

/// A non-negative integer, from a number or a decimal string.
pub fn as_u64(v: &Value) -> Result<u64, String> {
    let bad = || format!("expected a whole number >= 0, got {}", show(v));
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(bad),
        Value::String(s) => s.trim().parse::<u64>().map_err(|_| bad()),
        other => Err(format!("expected a whole number, got {}", kind(other))),
    }
}

/// An integer in `[lo, hi]`.
pub fn as_u64_in(v: &Value, lo: u64, hi: u64) -> Result<u64, String> {
    let x = as_u64(v)?;
    (lo..=hi)
        .contains(&x)
        .then_some(x)
        .ok_or_else(|| format!("must be in [{lo}, {hi}], got {x}"))
}

/// A duration: text such as `"30s"` or a number of seconds.
pub fn as_duration(v: &Value) -> Result<Duration, String> {
    match v {
        Value::String(s) => parse_duration(s),
        Value::Number(n) => (n.as_f64().filter(|secs| (0.0..1e15).contains(secs)))
            .map(Duration::from_secs_f64)
            .ok_or_else(|| format!("expected a duration >= 0, got {n}")),
        other => Err(format!(
            "expected a duration such as \"30s\", got {}",
            kind(other)
        )),
    }
}

/// A duration of at least `min`.
pub fn duration_min(min: Duration) -> impl Fn(&Value) -> Result<Duration, String> {
    move |v| match as_duration(v)? {
        d if d >= min => Ok(d),
        _ if min == NONZERO => Err("must be greater than 0".to_owned()),
        _ => Err(format!("must be at least {}", format_duration(min))),
    }
}

/// One of an enum's spellings (`CHOICES` of a `spelled!` enum).
pub fn choice<T: Copy>(choices: &[(&str, T)]) -> impl Fn(&Value) -> Result<T, String> {
    move |v| {
        let allowed = choices
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ");
        match v {
            Value::String(s) => (choices.iter().find(|(n, _)| n == s).map(|(_, t)| *t))
                .ok_or_else(|| format!("unknown value {s:?}; allowed: {allowed}")),
            other => Err(format!("expected one of {allowed}, got {}", show(other))),
        }
    }
}

/// The non-empty items of comma-separated text.
fn comma_items(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|p| !p.is_empty())
}

/// A string map: a table/object of scalars, a JSON object in a string, or
/// `k=v,k2=v2` text.
pub fn as_string_map(v: &Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Object(m) => (m.iter())
            .map(|(k, v)| {
                as_string(v)
                    .map(|s| (k.clone(), s))
                    .map_err(|e| format!("{k}: {e}"))
            })
            .collect(),
        Value::String(s) if s.trim_start().starts_with('{') => as_string_map(
            &serde_json::from_str(s).map_err(|e| format!("expected a JSON object: {e}"))?,
        ),
        Value::String(s) => comma_items(s)
            .map(|pair| match pair.split_once('=') {
                Some((k, v)) => Ok((k.trim().to_owned(), v.trim().to_owned())),
                None => Err(format!("expected key=value pairs, got {pair:?}")),
            })
            .collect(),
        other => Err(format!("expected a table of strings, got {}", kind(other))),
    }
}

/// A list of strings: an array, a JSON array in a string, or comma-separated
/// text.
pub fn as_string_list(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(a) => a.iter().map(as_string).collect(),
        Value::String(s) if s.trim_start().starts_with('[') => as_string_list(
            &serde_json::from_str(s).map_err(|e| format!("expected a JSON array: {e}"))?,
        ),
        Value::String(s) => Ok(comma_items(s).map(str::to_owned).collect()),
        other => Err(format!("expected a list of strings, got {}", kind(other))),
    }
}
