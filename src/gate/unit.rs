//! The unit a queue's `max_SYS` and headroom `N` count (`dispatch.unit`):
//! beside the gates, which weigh their budgets in it, and below the config
//! that reads it.

use serde::Serialize;

/// The unit `max_SYS` and the headroom `N` are counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Unit {
    /// Requests in flight.
    #[serde(rename = "requests")]
    Requests,
    /// Tokens in flight.
    #[serde(rename = "tokens")]
    Tokens,
    /// Request body bytes in flight.
    #[serde(rename = "bytes")]
    Bytes,
}

impl Unit {
    /// Every accepted spelling (the config reads them).
    pub(crate) const CHOICES: &'static [(&'static str, Unit)] = &[
        ("requests", Unit::Requests),
        ("tokens", Unit::Tokens),
        ("bytes", Unit::Bytes),
    ];

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
            Self::Bytes => "bytes",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unit_is_spelled_as_it_serializes() {
        for &(name, unit) in Unit::CHOICES {
            assert_eq!(unit.as_str(), name);
            assert_eq!(serde_json::to_value(unit).expect("serializes"), name);
        }
    }
}
