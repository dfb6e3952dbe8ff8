//! Duration text: Go/humantime style (`250ms`, `30s`, `5m`, `1h30m`, `24h`)
//! and plain numbers meaning seconds.

use std::time::Duration;

/// Units accepted in duration text, for error messages.
pub(crate) const DURATION_UNITS: &str = "ns, us, ms, s, m, h, d (e.g. \"250ms\", \"30s\", \"5m\", \"1h30m\"; a plain number is seconds)";

/// Parses a duration: a sequence of `<number><unit>` terms (`1h30m`,
/// `1.5s`) or a plain non-negative number of seconds (`30`, `0.25`).
/// Arithmetic is exact to the nanosecond.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let invalid = || format!("invalid duration {text:?}; use {DURATION_UNITS}");
    if s.is_empty() {
        return Err(format!("empty duration; use {DURATION_UNITS}"));
    }
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(invalid());
        }
        let number = &rest[..num_len];
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" => 1_000,
            "ms" => 1_000_000,
            // A plain number (the whole text, no unit) means seconds.
            "" if number.len() == s.len() => 1_000_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            "" => {
                return Err(format!(
                    "invalid duration {text:?}: missing unit; use {DURATION_UNITS}"
                ));
            }
            other => {
                return Err(format!(
                    "invalid duration {text:?}: unknown unit {other:?}; use {DURATION_UNITS}"
                ));
            }
        };
        let term = scaled(number, nanos_per_unit).ok_or_else(invalid)?;
        total = total.checked_add(term).ok_or_else(invalid)?;
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| invalid())?;
    // The remainder of a division by 1e9 always fits in u32.
    let sub = u32::try_from(total % 1_000_000_000).map_err(|_| invalid())?;
    Ok(Duration::new(secs, sub))
}

/// `number` (digits with at most one '.') times `unit` nanoseconds,
/// truncated to whole nanoseconds.
fn scaled(number: &str, unit: u128) -> Option<u128> {
    let (int, frac) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 18 {
        return None;
    }
    let int_value: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let mut value = int_value.checked_mul(unit)?;
    if !frac.is_empty() {
        let frac_value: u128 = frac.parse().ok()?;
        let denom = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
        value = value.checked_add(frac_value.checked_mul(unit)? / denom)?;
    }
    Some(value)
}

/// A non-negative finite number of seconds as a `Duration`.
pub(crate) fn seconds(secs: f64) -> Option<Duration> {
    if secs.is_finite() && (0.0..1e15).contains(&secs) {
        Some(Duration::from_secs_f64(secs))
    } else {
        None
    }
}

/// Formats a duration in the largest unit that represents it exactly, so
/// that `parse_duration(format_duration(d)) == d`.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    const UNITS: [(u128, &str); 6] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
    ];
    for (size, name) in UNITS {
        if nanos.is_multiple_of(size) {
            return format!("{}{name}", nanos / size);
        }
    }
    format!("{nanos}ns")
}
