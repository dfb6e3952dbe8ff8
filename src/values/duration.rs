//! Duration text: Go/humantime style (`250ms`, `30s`, `5m`, `1h30m`, `24h`)
//! and plain numbers meaning seconds.

use std::time::Duration;

use serde::Serializer;

/// Units accepted in duration text, for error messages.
const DURATION_UNITS: &str = "ns, us, ms, s, m, h, d (e.g. \"250ms\", \"30s\", \"5m\", \"1h30m\"; a plain number is seconds)";

/// Nanoseconds per unit, largest first (the order `format_duration` tries).
const UNITS: [(&str, u128); 7] = [
    ("d", 86_400_000_000_000),
    ("h", 3_600_000_000_000),
    ("m", 60_000_000_000),
    ("s", 1_000_000_000),
    ("ms", 1_000_000),
    ("us", 1_000),
    ("ns", 1),
];

/// Parses a duration: a sequence of `<number><unit>` terms (`1h30m`,
/// `1.5s`) or a plain non-negative number of seconds (`30`, `0.25`).
/// Arithmetic is exact to the nanosecond.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let invalid = |why: &str| format!("invalid duration {text:?}{why}; use {DURATION_UNITS}");
    if s.is_empty() {
        return Err(format!("empty duration; use {DURATION_UNITS}"));
    }
    let is_number = |c: char| c.is_ascii_digit() || c == '.';
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest.find(|c| !is_number(c)).unwrap_or(rest.len());
        let (number, tail) = rest.split_at(num_len);
        let (unit, tail) = tail.split_at(tail.find(is_number).unwrap_or(tail.len()));
        rest = tail;
        let per_unit = match unit {
            _ if num_len == 0 => return Err(invalid("")),
            // A plain number (the whole text, no unit) means seconds.
            "" if number.len() == s.len() => 1_000_000_000,
            "" => return Err(invalid(": missing unit")),
            "\u{b5}s" => 1_000,
            unit => match UNITS.iter().find(|(name, _)| *name == unit) {
                Some((_, n)) => *n,
                None => return Err(invalid(&format!(": unknown unit {unit:?}"))),
            },
        };
        let term = scaled(number, per_unit).ok_or_else(|| invalid(""))?;
        total = total.checked_add(term).ok_or_else(|| invalid(""))?;
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| invalid(""))?;
    // The remainder of a division by 1e9 always fits in u32.
    let sub = u32::try_from(total % 1_000_000_000).map_err(|_| invalid(""))?;
    Ok(Duration::new(secs, sub))
}

/// `number` (digits with at most one '.') times `unit` nanoseconds,
/// truncated to whole nanoseconds.
fn scaled(number: &str, unit: u128) -> Option<u128> {
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 18 {
        return None;
    }
    let digits = |d: &str| {
        if d.is_empty() {
            Some(0)
        } else {
            d.parse::<u128>().ok()
        }
    };
    let denom = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let frac_part = digits(frac)?.checked_mul(unit)? / denom;
    digits(int)?.checked_mul(unit)?.checked_add(frac_part)
}

/// Formats a duration in the largest unit that represents it exactly, so
/// that `parse_duration(format_duration(d)) == d`.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    match UNITS.iter().find(|(_, size)| nanos.is_multiple_of(*size)) {
        _ if nanos == 0 => "0s".to_owned(),
        Some((name, size)) => format!("{}{name}", nanos / size),
        None => format!("{nanos}ns"),
    }
}

/// Serializes a duration as text (`30s`), which loads back exactly
/// (`serialize_with` of settings that show durations).
pub fn serialize_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

/// Serializes an optional duration as text; none is left out.
pub fn serialize_optional_duration<S: Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&format_duration(*d)),
        None => s.serialize_none(),
    }
}
