//! `serve.tenant_limits`: the configured limits on each tenant's enqueued
//! work. The types live with the configuration that reads them; what a
//! batch holds against them and the admission rule are the Batch API's
//! (`crate::serve::quota`).

use std::collections::BTreeMap;

use serde::Serialize;

/// One tenant's limits; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TenantLimit {
    /// Most requests without a result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    /// Most estimated tokens of requests without a result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

/// `serve.tenant_limits`: a default for every tenant and per-tenant
/// overrides (a field an override leaves out is the default's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantLimits {
    /// Every tenant's limits unless overridden.
    #[serde(flatten)]
    pub default: TenantLimit,
    /// Overrides by tenant.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, TenantLimit>,
}

impl TenantLimit {
    /// Whether neither limit is set (nothing to reserve).
    pub fn is_unlimited(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }
}

impl TenantLimits {
    /// The limits of `tenant`.
    pub fn of(&self, tenant: &str) -> TenantLimit {
        let over = self.tenants.get(tenant).copied().unwrap_or_default();
        TenantLimit {
            requests: over.requests.or(self.default.requests),
            tokens: over.tokens.or(self.default.tokens),
        }
    }
}
