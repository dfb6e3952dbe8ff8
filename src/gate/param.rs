//! What every gate's parameters share: the [`GateParams`] trait (parse,
//! validate, build), the loose value adapters for upstream's shape (numbers
//! written as strings, lists as comma text, tables as JSON text) and
//! [`ParseCx`], which collects every error of a gate under
//! `<key>.gate_params.<name>`.
//!
//! A gate's parameters are a serde struct whose fields all have defaults, so
//! deserializing can only fail on a value of the wrong type; required
//! parameters and ranges are checked by [`GateParams::validate`], which sees
//! which keys were set. That is what lets every error be collected rather
//! than only the first serde meets.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::{Deserialize, Serializer};
use serde_json::{Map, Value};
use url::Url;

use super::GateSpec;
use super::{BuildError, DispatchGate, GateContext};
use crate::values::{ConfigError, format_duration};
pub(crate) use crate::values::{kind, show};

/// One gate's parameters: a serde struct (`deny_unknown_fields`, defaults
/// for every field) that validates itself and builds its gate.
pub trait GateParams: Sized + DeserializeOwned + serde::Serialize {
    /// Keys upstream accepts besides the struct's fields (old spellings,
    /// split forms), consumed by an overridden [`GateParams::parse`].
    const EXTRA_KEYS: &'static [&'static str] = &[];

    /// Whether this build can run the gate. A gate that is not built still
    /// parses and validates, and refuses to start with a typed error.
    const BUILT: bool = true;

    /// Parses the parameters (unknown keys are already reported and
    /// removed; null and blank values removed, meaning "default"). The
    /// default decodes with serde and runs [`GateParams::validate`]; gates
    /// holding other gates override it to report nested paths.
    fn parse(map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<Self> {
        decode(map, cx)
    }

    /// Records every missing required parameter and range error.
    fn validate(&self, cx: &mut ParseCx<'_>) {
        let _ = cx;
    }

    /// The gates nested in this one.
    fn children(&self) -> Vec<&GateSpec> {
        Vec::new()
    }

    /// Builds the gate.
    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError>;
}

/// The field names of a serde struct, in declaration order, as serde's
/// derive passes them to `deserialize_struct` (so there is no second list).
pub(crate) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Probe<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names captured"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    // The probe always errors; the error is how it stops after capturing.
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// The default [`GateParams::parse`]: each key is decoded on its own first
/// (every field has a default, so a failure belongs to that key), then the
/// keys that decoded are decoded together and validated.
pub(crate) fn decode<T: GateParams>(map: Map<String, Value>, cx: &mut ParseCx<'_>) -> Option<T> {
    let before = cx.errors.len();
    let mut good = Map::new();
    for (k, v) in map {
        cx.present.insert(k.clone());
        let mut one = Map::new();
        one.insert(k.clone(), v.clone());
        match serde_json::from_value::<T>(Value::Object(one)) {
            Ok(_) => {
                good.insert(k, v);
            }
            Err(e) => cx.error(&k, e.to_string()),
        }
    }
    let params = match serde_json::from_value::<T>(Value::Object(good)) {
        Ok(p) => p,
        Err(e) => {
            let at = cx.path.clone();
            cx.error_at(at, e.to_string());
            return None;
        }
    };
    params.validate(cx);
    (cx.errors.len() == before).then_some(params)
}

/// Parses a gate's parameters: reports unknown keys (listing the allowed
/// ones), then runs `T::parse`.
pub(crate) fn parse_params<T: GateParams>(
    map: Map<String, Value>,
    cx: &mut ParseCx<'_>,
) -> Option<T> {
    let before = cx.errors.len();
    let allowed = allowed::<T>();
    let mut known = Map::new();
    for (k, v) in map {
        if allowed.contains(&k.as_str()) {
            known.insert(k, v);
        } else {
            let msg = if allowed.is_empty() {
                format!(
                    "unknown parameter; gate `{}` takes no parameters",
                    cx.gate_type
                )
            } else {
                format!(
                    "unknown parameter for gate `{}`; allowed: {}",
                    cx.gate_type,
                    allowed.join(", ")
                )
            };
            cx.error(&k, msg);
        }
    }
    let params = T::parse(known, cx);
    if cx.errors.len() > before {
        None
    } else {
        params
    }
}

/// Every key `T` accepts: its fields, then [`GateParams::EXTRA_KEYS`].
pub(crate) fn allowed<T: GateParams>() -> Vec<&'static str> {
    let mut out = field_names::<T>().to_vec();
    out.extend_from_slice(T::EXTRA_KEYS);
    out
}

/// Where one gate's parameters are being parsed, and the errors so far.
pub struct ParseCx<'e> {
    /// The upstream gate name, for messages.
    pub(crate) gate_type: &'static str,
    /// `<key>.gate_params`.
    pub(crate) path: String,
    /// Nesting depth of this gate (0 = a queue's gate).
    pub(crate) depth: usize,
    /// Keys that were set (not absent, null or blank).
    present: BTreeSet<String>,
    /// Keys already reported: a key gets one error, the first (a type error
    /// beats the range check on the default that replaced it).
    reported: BTreeSet<String>,
    /// Every error of the whole gate tree.
    pub(crate) errors: &'e mut Vec<ConfigError>,
}

impl<'e> ParseCx<'e> {
    /// A context for the parameters at `path` of a `gate_type` gate.
    pub(crate) fn new(
        gate_type: &'static str,
        path: String,
        depth: usize,
        errors: &'e mut Vec<ConfigError>,
    ) -> Self {
        Self {
            gate_type,
            path,
            depth,
            present: BTreeSet::new(),
            reported: BTreeSet::new(),
            errors,
        }
    }

    /// `<path>.<name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.path)
    }

    /// Whether parameter `name` was set.
    pub fn is_set(&self, name: &str) -> bool {
        self.present.contains(name)
    }

    /// Records an error for parameter `name` (only the first per name).
    pub fn error(&mut self, name: &str, message: impl Into<String>) {
        if self.reported.insert(name.to_owned()) {
            let key = self.key(name);
            self.errors.push(ConfigError::new(key, message));
        }
    }

    /// Records an error under a full key.
    pub fn error_at(&mut self, key: String, message: impl Into<String>) {
        self.errors.push(ConfigError::new(key, message));
    }

    /// Reports `name` when it is not set; returns whether it is.
    pub fn require(&mut self, name: &str, what: &str) -> bool {
        let set = self.is_set(name);
        if !set {
            let gate = self.gate_type;
            self.error(
                name,
                format!("required parameter of gate `{gate}` is missing ({what})"),
            );
        }
        set
    }

    /// `x` must be in [0, 1].
    pub fn fraction(&mut self, name: &str, x: f64) {
        if !(0.0..=1.0).contains(&x) {
            self.error(name, format!("must be in [0, 1], got {x}"));
        }
    }

    /// The opt-in `fallback` budget, when set, must be in [0, 1].
    pub fn fallback(&mut self, fallback: Option<f64>) {
        if let Some(f) = fallback {
            self.fraction("fallback", f);
        }
    }

    /// `x` must be greater than 0.
    pub fn positive(&mut self, name: &str, x: f64) {
        if x <= 0.0 {
            self.error(name, format!("must be greater than 0, got {x}"));
        }
    }

    /// `x` must be >= 0.
    pub fn non_negative(&mut self, name: &str, x: f64) {
        if x < 0.0 {
            self.error(name, format!("must be >= 0, got {x}"));
        }
    }

    /// A required whole number of at least 1.
    pub fn at_least_one(&mut self, name: &str, x: u32) {
        if x < 1 {
            self.error(name, format!("must be a whole number >= 1, got {x}"));
        }
    }

    /// An http(s) URL without credentials (checked when set).
    pub fn http_url(&mut self, name: &str, value: &str) {
        if let Err(e) = check_http_url(value) {
            self.error(name, e);
        }
    }

    /// `host:port` or a `redis://` / `rediss://` URL without credentials.
    pub fn redis_address(&mut self, name: &str, value: &str) {
        if !value.contains("://") {
            return;
        }
        let checked = Url::parse(value)
            .map_err(|e| format!("invalid redis URL: {e}"))
            .and_then(|u| {
                if matches!(u.scheme(), "redis" | "rediss") {
                    no_password(&u)
                } else {
                    Err(format!(
                        "expected host:port or a redis:// or rediss:// URL, got scheme {:?}",
                        u.scheme()
                    ))
                }
            });
        if let Err(e) = checked {
            self.error(name, e);
        }
    }

    /// A gate nested at `key` (an object or JSON text of one).
    pub fn nested(&mut self, value: &Value, key: &str) -> Option<GateSpec> {
        GateSpec::parse_nested(value, key, self.depth, self.errors)
    }

    /// Removes and returns `name` from `map`, marking it set.
    pub fn take(&mut self, map: &mut Map<String, Value>, name: &str) -> Option<Value> {
        let v = map.remove(name)?;
        self.present.insert(name.to_owned());
        Some(v)
    }
}

/// Checks a required list of vLLM `/metrics` URLs under `urls` (the
/// engine-scraping gates: `vllm`, `feedback`, `slo-headroom`).
pub(crate) fn validate_engine_urls(cx: &mut ParseCx<'_>, urls: &[String]) {
    if cx.require("urls", "a list of vLLM /metrics URLs") {
        if urls.is_empty() {
            cx.error("urls", "must list at least one URL");
        }
        let key = cx.key("urls");
        for (i, u) in urls.iter().enumerate() {
            if let Err(e) = check_http_url(u) {
                cx.error_at(format!("{key}[{i}]"), e);
            }
        }
    }
}

/// An http(s) URL without a password.
pub(crate) fn check_http_url(value: &str) -> Result<(), String> {
    let u = Url::parse(value).map_err(|e| format!("expected an http(s) URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!(
            "expected an http(s) URL, got scheme {:?}",
            u.scheme()
        ));
    }
    no_password(&u)
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

/// `key: message` of every error parsing `params` for `gate_type`: the
/// gates' parameter tests share it.
#[cfg(test)]
pub(crate) fn parse_errors(gate_type: &str, params: serde_json::Value) -> Vec<(String, String)> {
    match crate::gate::GateSpec::parse(gate_type, &params, "q") {
        Ok(spec) => panic!("expected errors, parsed {spec:?}"),
        Err(e) => e.0.into_iter().map(|e| (e.key, e.message)).collect(),
    }
}

/// serde adapters for upstream's loose shapes, used as
/// `#[serde(deserialize_with = "loose::…")]`.
pub(crate) mod loose {
    use super::*;
    use crate::values::{as_duration, as_f64, as_string, as_string_list, as_string_map, as_u64_in};

    fn value<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    /// A finite float from a number or a decimal string (`"0.1"`).
    pub(crate) fn to_f64(v: &Value) -> Result<f64, String> {
        as_f64(v)
    }

    /// A finite float (number or string).
    pub(crate) fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        as_f64(&value(d)?).map_err(de::Error::custom)
    }

    /// An optional finite float (number or string).
    pub(crate) fn opt_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        f64(d).map(Some)
    }

    /// A whole number that fits `u32` (number or string).
    pub(crate) fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let n = as_u64_in(&value(d)?, 0, u64::from(u32::MAX)).map_err(de::Error::custom)?;
        u32::try_from(n).map_err(de::Error::custom)
    }

    /// An optional whole number (number or string).
    pub(crate) fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        u32(d).map(Some)
    }

    /// A boolean: `true`/`false`, or the strings `"true"`/`"false"`.
    pub(crate) fn bool<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        let v = value(d)?;
        match &v {
            Value::Bool(b) => Ok(*b),
            Value::String(s) if s.trim().eq_ignore_ascii_case("true") => Ok(true),
            Value::String(s) if s.trim().eq_ignore_ascii_case("false") => Ok(false),
            _ => Err(de::Error::custom(format!(
                "expected true or false, got {}",
                show(&v)
            ))),
        }
    }

    /// A string (or a number or boolean as text).
    pub(crate) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        as_string(&value(d)?).map_err(de::Error::custom)
    }

    /// An optional string.
    pub(crate) fn opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        string(d).map(Some)
    }

    /// A string map: a table, a JSON object in a string, or `k=v,k2=v2`.
    pub(crate) fn string_map<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        as_string_map(&value(d)?).map_err(de::Error::custom)
    }

    /// A list of strings: an array, a JSON array in a string, or comma text.
    pub(crate) fn string_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        as_string_list(&value(d)?).map_err(de::Error::custom)
    }

    /// A duration: text such as `"30s"` or a number of seconds.
    pub(crate) fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        as_duration(&value(d)?).map_err(de::Error::custom)
    }

    /// Writes a duration as text (`"30s"`), which [`duration`] reads back.
    pub(crate) fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }
}
