//! `sql-quota`: `redis-quota` counted in the `sql` transport's PostgreSQL
//! database (`[sql] url`), with upstream's parameters (those of
//! `redis-quota` without `address`) and upstream's quota tables, so
//! upstream dispatchers on the same database share the count.
//!
//! - `rate-limit`: at most `limit` admissions per `window` per tenant;
//!   each admission is a row of `async_quota_admits`, aged out by the
//!   next admission of its key. An admission whose message is not sent
//!   after all (a later gate refused it) is refunded.
//! - `concurrency`: at most `limit` requests in flight per tenant, counted
//!   as slots of this process's *holder* (`async_quota_holders`), whose
//!   lease (`lease`) is renewed every third of it; a killed dispatcher's
//!   slots stop counting once its holder lapses (upstream's scheme).
//!   A slot is given back when its request ends.
//!
//! Keys are upstream's `<prefix><attribute>:<value>`. Every statement is
//! timed by the database clock. The connection is opened on the first
//! admission (building a gate does no I/O); errors refuse (fail closed).
//! A message over quota waits (`blocking`) or is refused
//! (`classifying`), or with `admit_overflow` goes on classified
//! `overflow`, exactly as `redis-quota`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose};
use super::quota::{DEFAULT_LEASE, LeaseRenewal, admission_only};
use super::{
    Admission, AdmissionRequest, BuildError, DispatchGate, Explanation, GateContext, GateError,
    GatingMode, MissingAttribute, Observation, QuotaMode, Ticket,
};
use crate::postgres::{Db, SqlConfig, SqlError, TlsKeys};
use crate::secret::EndpointUrl;
use crate::tasks::Tasks;

/// Parameters of `sql-quota`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqlQuotaParams {
    /// Metadata attribute naming the tenant (default `userid`).
    #[serde(deserialize_with = "loose::string")]
    pub attribute: String,
    /// Rate limit or concurrency limit (default rate-limit).
    pub mode: QuotaMode,
    /// Limit per tenant, >= 1 (required).
    #[serde(deserialize_with = "loose::u32")]
    pub limit: u32,
    /// Rate-limit window, > 0 (default 60 s; unused in concurrency mode).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub window: Duration,
    /// Key prefix (default `quota:`).
    #[serde(deserialize_with = "loose::string")]
    pub prefix: String,
    /// Wait or refuse when over quota (default classifying = refuse).
    pub gating_mode: GatingMode,
    /// A message without the attribute: refuse (default) or allow.
    pub missing_attribute: MissingAttribute,
    /// Let over-quota messages go on classified `overflow` (default false).
    #[serde(deserialize_with = "loose::bool")]
    pub admit_overflow: bool,
    /// Concurrency mode: the lease of this process's holder, renewed every
    /// third of it; a dead dispatcher's slots stop counting after it
    /// (default 30 s, at least 1 s).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub lease: Duration,
}

impl Default for SqlQuotaParams {
    fn default() -> Self {
        Self {
            attribute: "userid".to_owned(),
            mode: QuotaMode::RateLimit,
            limit: 0,
            window: Duration::from_secs(60),
            prefix: "quota:".to_owned(),
            gating_mode: GatingMode::Classifying,
            missing_attribute: MissingAttribute::Refuse,
            admit_overflow: false,
            lease: DEFAULT_LEASE,
        }
    }
}

impl GateParams for SqlQuotaParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        self.policy().validate(cx);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let sql = ctx.sql.as_ref();
        let url = (sql.and_then(|s| s.url.clone())).ok_or(BuildError::NoSql {
            gate_type: "sql-quota",
        })?;
        let timeout = sql.map_or(Duration::from_secs(5), |s| s.connect_timeout);
        let tls = sql.map(SqlConfig::tls_keys).unwrap_or_default();
        Ok(Box::new(SqlQuotaGate::new(
            url,
            tls,
            timeout,
            self.clone(),
            ctx.tasks.clone(),
        )))
    }
}

/// The `sql-quota` gate.
#[derive(Debug)]
pub struct SqlQuotaGate {
    inner: Arc<Inner>,
    renewal: LeaseRenewal,
}

#[derive(Debug)]
struct Inner {
    url: EndpointUrl,
    /// `[sql] sslmode` and `tls_ca`.
    tls: TlsKeys,
    connect_timeout: Duration,
    db: tokio::sync::OnceCell<Arc<Db>>,
    params: SqlQuotaParams,
    /// This process's current holder name (concurrency mode); `None`
    /// until registered, or after it lapsed.
    holder: Mutex<Option<String>>,
}

const REGISTER: &str = concat!(
    "INSERT INTO async_quota_holders (holder, expires_ms) VALUES ($1, ",
    now_ms!(),
    " + $2)"
);
const RENEW: &str = concat!(
    "UPDATE async_quota_holders SET expires_ms = ",
    now_ms!(),
    " + $2 WHERE holder = $1 AND expires_ms > ",
    now_ms!()
);
const REAP: &str = concat!(
    "WITH dead AS (
         DELETE FROM async_quota_holders WHERE expires_ms < ",
    now_ms!(),
    " - $1 RETURNING holder)
     DELETE FROM async_quota_slots s USING dead WHERE s.holder = dead.holder"
);
const ACQUIRE: &str = "SELECT sluicegate_quota_acquire($1, $2, $3)";
const RELEASE: &str = "UPDATE async_quota_slots SET used = greatest(used - 1, 0)
     WHERE holder = $1 AND key = $2";
const ADMIT: &str = "SELECT sluicegate_quota_admit($1, $2, $3)";
const REFUND: &str = "SELECT sluicegate_quota_refund($1, $2, $3)";

/// A statement failed (connect, PostgreSQL error).
#[derive(Debug, thiserror::Error)]
enum QuotaError {
    #[error(transparent)]
    Open(#[from] SqlError),
    #[error("sql-quota: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl SqlQuotaGate {
    /// The gate counting in the database at `url` (over TLS as `tls`
    /// says) with `params`; its holder renewal runs on `tasks`.
    pub fn new(
        url: EndpointUrl,
        tls: TlsKeys,
        connect_timeout: Duration,
        params: SqlQuotaParams,
        tasks: Tasks,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                url,
                tls,
                connect_timeout,
                db: tokio::sync::OnceCell::new(),
                params,
                holder: Mutex::new(None),
            }),
            renewal: LeaseRenewal::new(tasks),
        }
    }

    /// The key counting `tenant` (upstream's layout).
    pub fn key(&self, tenant: &str) -> String {
        self.inner.params.policy().key(tenant)
    }

    async fn take(&self, key: &str) -> Result<Option<Ticket>, QuotaError> {
        let inner = &self.inner;
        let p = &inner.params;
        let db = inner.db().await?;
        let limit = i32::try_from(p.limit).unwrap_or(i32::MAX);
        match p.mode {
            QuotaMode::RateLimit => {
                let window = ms(p.window);
                let rows = db.query(ADMIT, &[&key, &limit, &window]).await?;
                let at: i64 = rows.first().map_or(0, |r| r.get(0));
                Ok((at > 0).then(|| {
                    let (inner, key) = (inner.clone(), key.to_owned());
                    Ticket::none().refundable(move || inner.refund_later(key, window, at))
                }))
            }
            QuotaMode::Concurrency => {
                for _ in 0..2 {
                    let holder = inner.holder(&db).await?;
                    let rows = db.query(ACQUIRE, &[&key, &holder, &limit]).await?;
                    match rows.first().map_or(0, |r| r.get::<_, i32>(0)) {
                        1 => {
                            let slot = Slot {
                                inner: inner.clone(),
                                holder,
                                key: key.to_owned(),
                            };
                            return Ok(Some(Ticket::holding(slot)));
                        }
                        // The holder lapsed (its slots no longer count):
                        // register a new one and try once more.
                        -1 => inner.drop_holder(&holder),
                        _ => return Ok(None),
                    }
                }
                Ok(None)
            }
        }
    }
}

impl Inner {
    async fn db(&self) -> Result<Arc<Db>, SqlError> {
        self.db
            .get_or_try_init(|| Db::open(&self.url, &self.tls, self.connect_timeout))
            .await
            .cloned()
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.holder.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn holder(&self, db: &Db) -> Result<String, tokio_postgres::Error> {
        if let Some(h) = self.current().clone() {
            return Ok(h);
        }
        let name = format!(
            "sluicegate-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        db.execute(REGISTER, &[&name, &ms(self.params.lease)])
            .await?;
        *self.current() = Some(name.clone());
        Ok(name)
    }

    fn drop_holder(&self, holder: &str) {
        let mut current = self.current();
        if current.as_deref() == Some(holder) {
            *current = None;
        }
    }

    /// Renews the holder; a lapsed one is dropped (the next admission
    /// registers a new one). Then removes holders lapsed a lease ago.
    async fn renew(&self) {
        let Some(holder) = self.current().clone() else {
            return;
        };
        let Some(db) = self.db.get().cloned() else {
            return;
        };
        let lease = ms(self.params.lease);
        match db.execute(RENEW, &[&holder, &lease]).await {
            Ok(1) => {}
            Ok(_) => {
                tracing::info!(holder, "sql-quota holder lapsed; its slots no longer count");
                self.drop_holder(&holder);
            }
            Err(error) => tracing::warn!(%error, holder, "cannot renew the sql-quota holder"),
        }
        if let Err(error) = db.execute(REAP, &[&lease]).await {
            tracing::warn!(%error, "cannot remove lapsed sql-quota holders");
        }
    }

    /// Gives back a rate-limit admission in the background (from a drop,
    /// which cannot wait); without a runtime it ages out instead.
    fn refund_later(self: Arc<Self>, key: String, window: i64, at: i64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Some(db) = self.db.get()
                && let Err(error) = db.query(REFUND, &[&key, &window, &at]).await
            {
                tracing::warn!(%error, key, "cannot refund a quota admission; it ages out instead");
            }
        });
    }

    /// Gives back a concurrency slot in the background; if that fails the
    /// slot counts until the holder lapses.
    fn release_later(self: Arc<Self>, holder: String, key: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Some(db) = self.db.get()
                && let Err(error) = db.execute(RELEASE, &[&holder, &key]).await
            {
                tracing::warn!(%error, key, "cannot give a quota slot back");
            }
        });
    }
}

/// A concurrency slot held by an admitted request; dropping it (the
/// request ended) gives it back.
struct Slot {
    inner: Arc<Inner>,
    holder: String,
    key: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.inner.clone().release_later(
            std::mem::take(&mut self.holder),
            std::mem::take(&mut self.key),
        );
    }
}

impl DispatchGate for SqlQuotaGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        admission_only()
    }

    fn admit<'a>(&'a self, request: AdmissionRequest<'a>) -> BoxFuture<'a, Admission> {
        Box::pin(async move {
            let policy = self.inner.params.policy();
            self.renewal.start(
                "sql-quota: holder renewal",
                policy,
                &self.inner,
                |inner| async move { inner.renew().await },
            );
            policy
                .admit(request.metadata, "sql quota", async |key| {
                    self.take(key).await
                })
                .await
        })
    }

    fn kind(&self) -> &'static str {
        "sql-quota"
    }

    fn explain(&self) -> BoxFuture<'_, Explanation> {
        Box::pin(async move {
            let p = &self.inner.params;
            let what = match p.mode {
                QuotaMode::RateLimit => format!(
                    "at most {} admissions per {} per `{}` value",
                    p.limit,
                    crate::values::format_duration(p.window),
                    p.attribute
                ),
                QuotaMode::Concurrency => format!(
                    "at most {} requests in flight per `{}` value (holder lease {})",
                    p.limit,
                    p.attribute,
                    crate::values::format_duration(p.lease)
                ),
            };
            let over = match (p.admit_overflow, p.gating_mode) {
                (true, _) => "goes on classified overflow",
                (false, GatingMode::Blocking) => "waits",
                (false, GatingMode::Classifying) => "is refused (requeued)",
            };
            let notes = vec![
                format!(
                    "admission only: {what}, counted in PostgreSQL at {} (keys `{}{}:<value>`)",
                    self.inner.url.masked(),
                    p.prefix,
                    p.attribute
                ),
                format!("a message over quota {over}; the database unreachable refuses"),
            ];
            Explanation::sourceless(self.observe().await, notes)
        })
    }
}
