//! `redis-quota`: per-tenant quota admission in Redis (rate limit or
//! concurrency limit per tenant attribute). Parsed and validated; not
//! built yet, so a queue using it refuses to start (never an open gate).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose};
use super::{BuildError, DispatchGate, GateContext, GatingMode};

/// How a `redis-quota` gate counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuotaMode {
    /// At most `limit` admissions per `window` per tenant.
    #[default]
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
}

/// Parameters of `redis-quota`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisQuotaParams {
    /// `host:port` or `redis://host:port/db` (required).
    #[serde(deserialize_with = "loose::string")]
    pub address: String,
    /// Metadata attribute naming the tenant (default `userid`).
    #[serde(deserialize_with = "loose::string")]
    pub attribute: String,
    /// Rate limit or concurrency limit (default rate-limit).
    pub mode: QuotaMode,
    /// Limit per tenant, >= 1 (required).
    #[serde(deserialize_with = "loose::u32")]
    pub limit: u32,
    /// Rate-limit window, > 0 (default 60 s).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub window: Duration,
    /// Redis key prefix (default `quota:`).
    #[serde(deserialize_with = "loose::string")]
    pub prefix: String,
    /// Wait or refuse when over quota (default classifying).
    pub gating_mode: GatingMode,
}

impl Default for RedisQuotaParams {
    fn default() -> Self {
        Self {
            address: String::new(),
            attribute: "userid".to_owned(),
            mode: QuotaMode::RateLimit,
            limit: 0,
            window: Duration::from_secs(60),
            prefix: "quota:".to_owned(),
            gating_mode: GatingMode::Classifying,
        }
    }
}

impl GateParams for RedisQuotaParams {
    const BUILT: bool = false;

    fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("address", "host:port or redis://host:port/db") {
            cx.redis_address("address", &self.address);
        }
        if cx.require("limit", "a whole number >= 1") {
            cx.at_least_one("limit", self.limit);
        }
        if self.window.is_zero() {
            cx.error("window", "must be greater than 0");
        }
    }

    fn build(&self, _: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        Err(BuildError::NotAvailable {
            gate_type: "redis-quota",
        })
    }
}
