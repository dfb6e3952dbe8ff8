//! What the two quota gates share, `redis-quota` and `sql-quota`: the
//! parameters they have in common (read through [`QuotaPolicy`]), their
//! checks, the admission path from a message's tenant to a verdict, and the
//! background renewal of concurrency leases. Only the store that counts
//! differs (a Redis ZSET per tenant or PostgreSQL rows), and it stays in
//! each gate's file.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Once, Weak};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::param::ParseCx;
use super::redis_quota::RedisQuotaParams;
use super::sql_quota::SqlQuotaParams;
use super::{Admission, Budget, Classification, GateError, GatingMode, Observation, Ticket};
use crate::tasks::{Tasks, sleep_unless};

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

/// What `redis-quota` does with a message that lacks the tenant attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingAttribute {
    /// Refuse it (requeue with delay): the default, fail closed.
    #[default]
    Refuse,
    /// Admit it unclassified and uncounted (upstream's behaviour).
    Allow,
}

/// The parameters both quota gates take (the same names in both, upstream's
/// shape), borrowed from either gate's parameters.
#[derive(Debug, Clone, Copy)]
pub(super) struct QuotaPolicy<'a> {
    pub(super) attribute: &'a str,
    pub(super) mode: QuotaMode,
    pub(super) limit: u32,
    pub(super) window: Duration,
    pub(super) prefix: &'a str,
    pub(super) gating_mode: GatingMode,
    pub(super) missing_attribute: MissingAttribute,
    pub(super) admit_overflow: bool,
    pub(super) lease: Duration,
}

/// `fn policy(&self) -> QuotaPolicy` for a quota gate's parameters: written
/// once because both parameter structs spell the shared fields alike.
macro_rules! quota_policy {
    ($params:ty) => {
        impl $params {
            /// The parameters the quota rules read.
            pub(super) fn policy(&self) -> QuotaPolicy<'_> {
                QuotaPolicy {
                    attribute: &self.attribute,
                    mode: self.mode,
                    limit: self.limit,
                    window: self.window,
                    prefix: &self.prefix,
                    gating_mode: self.gating_mode,
                    missing_attribute: self.missing_attribute,
                    admit_overflow: self.admit_overflow,
                    lease: self.lease,
                }
            }
        }
    };
}
quota_policy!(RedisQuotaParams);
quota_policy!(SqlQuotaParams);

/// Default lease of a concurrency unit.
pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Shortest lease: renewals every third of it must fit the store's round
/// trips.
const MIN_LEASE: Duration = Duration::from_secs(1);

impl QuotaPolicy<'_> {
    /// Checks the shared parameters.
    pub(super) fn validate(&self, cx: &mut ParseCx<'_>) {
        if cx.require("limit", "a whole number >= 1") {
            cx.at_least_one("limit", self.limit);
        }
        if self.window.is_zero() {
            cx.error("window", "must be greater than 0");
        }
        if self.attribute.is_empty() {
            cx.error("attribute", "must not be empty");
        }
        if self.lease < MIN_LEASE {
            cx.error("lease", "must be at least 1s");
        }
    }

    /// The key counting `tenant` (upstream's layout,
    /// `<prefix><attribute>:<value>`).
    pub(super) fn key(&self, tenant: &str) -> String {
        format!("{}{}:{tenant}", self.prefix, self.attribute)
    }

    /// A message's verdict: `take` tries to take a unit under the key of
    /// its tenant; `what` names the gate in the log.
    pub(super) async fn admit<E: std::fmt::Display>(
        &self,
        metadata: &BTreeMap<String, String>,
        what: &str,
        take: impl AsyncFnOnce(&str) -> Result<Option<Ticket>, E>,
    ) -> Admission {
        let key = match self.key_of(metadata) {
            Ok(key) => key,
            Err(answer) => return answer,
        };
        let taken = take(&key).await;
        self.verdict(taken, &key, what)
    }

    /// The key a message is counted under: its tenant's; a message without
    /// the attribute (or with it empty) is answered at once as
    /// `missing_attribute` says.
    fn key_of(&self, metadata: &BTreeMap<String, String>) -> Result<String, Admission> {
        match metadata.get(self.attribute).filter(|v| !v.is_empty()) {
            Some(tenant) => Ok(self.key(tenant)),
            None => Err(match self.missing_attribute {
                MissingAttribute::Refuse => Admission::Refuse {
                    reason: "quota_attribute_missing",
                },
                MissingAttribute::Allow => Admission::Continue(Ticket::none()),
            }),
        }
    }

    /// The answer once the gate tried to take a unit for `key`: a unit
    /// admits the message as `reserved`; none left admits it as `overflow`
    /// (when `admit_overflow`), else it waits (blocking) or is refused
    /// (classifying); a count that cannot be read refuses it (fail closed).
    fn verdict<E: std::fmt::Display>(
        &self,
        taken: Result<Option<Ticket>, E>,
        key: &str,
        what: &str,
    ) -> Admission {
        match taken {
            Ok(Some(mut ticket)) => {
                ticket.join(Ticket::holding(Classification::Reserved));
                Admission::Continue(ticket)
            }
            Ok(None) if self.admit_overflow => {
                Admission::Continue(Ticket::holding(Classification::Overflow))
            }
            Ok(None) => match self.gating_mode {
                GatingMode::Blocking => Admission::Wait {
                    reason: "over_quota",
                },
                GatingMode::Classifying => Admission::Refuse {
                    reason: "over_quota",
                },
            },
            Err(error) => {
                tracing::warn!(%error, key, "{what} unreadable; refusing");
                Admission::Refuse {
                    reason: "quota_unavailable",
                }
            }
        }
    }
}

/// A quota gate's reading: admission only, so like `constant` every call
/// is a fresh, open reading and the window is the other gates' business (a
/// fixed date would never refill it).
pub(super) fn admission_only() -> BoxFuture<'static, Result<Observation, GateError>> {
    let mut reading = Observation::open(Budget::FULL, Instant::now());
    reading.reason = "quota gate: admission only".into();
    Box::pin(std::future::ready(Ok(reading)))
}

/// The background renewal of a concurrency-mode gate's leases: started on
/// the first admission (building a gate does no I/O and may happen outside
/// the runtime), run on the task tree until the gate is dropped or the root
/// token is cancelled.
#[derive(Debug)]
pub(super) struct LeaseRenewal {
    /// The renewal starts once.
    started: Once,
    /// The tree the renewal runs on.
    tasks: Tasks,
}

impl LeaseRenewal {
    /// Renewal on `tasks`, not started yet.
    pub(super) fn new(tasks: Tasks) -> Self {
        Self {
            started: Once::new(),
            tasks,
        }
    }

    /// Starts calling `renew` on `inner` every third of the lease, once,
    /// in concurrency mode; rate-limit mode holds no leases.
    pub(super) fn start<T, F, Fut>(
        &self,
        name: &'static str,
        policy: QuotaPolicy<'_>,
        inner: &Arc<T>,
        renew: F,
    ) where
        T: Send + Sync + 'static,
        F: Fn(Arc<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if policy.mode != QuotaMode::Concurrency {
            return;
        }
        self.started.call_once(|| {
            let weak = Arc::downgrade(inner);
            let every = policy.lease / 3;
            // Until the root token, not the drain: requests still in
            // flight during the drain hold leases that must not lapse.
            let stop = self.tasks.root_token().clone();
            self.tasks.spawn(name, renew_loop(weak, every, stop, renew));
        });
    }
}

/// Calls `renew` each `every` until the gate is dropped or `stop` is
/// cancelled.
async fn renew_loop<T, F, Fut>(inner: Weak<T>, every: Duration, stop: CancellationToken, renew: F)
where
    F: Fn(Arc<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    while sleep_unless(&stop, every).await {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        renew(inner).await;
    }
}
