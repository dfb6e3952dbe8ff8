//! Reply routes: from a flex request's queue message id to the HTTP
//! connection holding it. The collector hands each result it reads to
//! [`Replies::deliver`]; the handler awaits its [`Ticket`].
//!
//! Bounded: a route is held per connection, at most
//! `serve.flex_max_held` in total and `serve.flex_max_held_per_tenant`
//! per tenant ([`admit`]); one more is refused before anything is
//! enqueued, so held connections never grow memory without bound. A
//! ticket dropped (answered, timed out, or its client gone) takes its
//! route away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::result::ResultRecord;

/// The configured bounds on held flex connections.
#[derive(Debug, Clone, Copy)]
pub struct HeldLimits {
    /// All tenants together.
    pub total: u64,
    /// Each tenant.
    pub per_tenant: u64,
}

/// Which bound a refused request would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `serve.flex_max_held`.
    Total,
    /// `serve.flex_max_held_per_tenant`.
    Tenant,
}

impl Bound {
    /// The config key, for the error and the refusal metric.
    pub fn key(self) -> &'static str {
        match self {
            Self::Total => "serve.flex_max_held",
            Self::Tenant => "serve.flex_max_held_per_tenant",
        }
    }
}

/// Whether one more connection may be held with `total` and `tenant`
/// already held (the tenant's bound is checked first: it names the
/// caller's own doing).
pub fn admit(total: u64, tenant: u64, limits: HeldLimits) -> Result<(), Bound> {
    if tenant >= limits.per_tenant {
        return Err(Bound::Tenant);
    }
    if total >= limits.total {
        return Err(Bound::Total);
    }
    Ok(())
}

/// One held connection's route.
#[derive(Debug)]
struct Route {
    tenant: String,
    tx: oneshot::Sender<ResultRecord>,
    /// When it was held (just before its message was enqueued).
    since: Instant,
    /// Whether a dispatcher was seen taking it.
    dispatched: bool,
}

#[derive(Debug, Default)]
struct Routes {
    waiting: HashMap<String, Route>,
    per_tenant: HashMap<String, u64>,
}

/// The reply routes of one server.
#[derive(Debug)]
pub struct Replies {
    routes: Mutex<Routes>,
    limits: HeldLimits,
}

/// One held connection's route; dropping it removes the route.
#[derive(Debug)]
pub struct Ticket {
    replies: Arc<Replies>,
    id: String,
    rx: oneshot::Receiver<ResultRecord>,
}

impl Ticket {
    /// The message id it waits for.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The result, once the collector delivers it (pending forever if the
    /// route is gone, which only the ticket's own drop does).
    pub async fn answer(&mut self) -> ResultRecord {
        match (&mut self.rx).await {
            Ok(result) => result,
            Err(_) => std::future::pending().await,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.replies.remove(&self.id);
    }
}

impl Replies {
    /// No routes, these bounds.
    pub fn new(limits: HeldLimits) -> Self {
        Self {
            routes: Mutex::new(Routes::default()),
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A route for `id` held by `tenant`, unless a bound is reached.
    pub fn hold(self: &Arc<Self>, tenant: &str, id: String) -> Result<Ticket, Bound> {
        let (tx, rx) = oneshot::channel();
        let mut routes = self.lock();
        let held = routes.per_tenant.get(tenant).copied().unwrap_or(0);
        admit(routes.waiting.len() as u64, held, self.limits)?;
        *routes.per_tenant.entry(tenant.to_owned()).or_default() += 1;
        let route = Route {
            tenant: tenant.to_owned(),
            tx,
            since: Instant::now(),
            dispatched: false,
        };
        routes.waiting.insert(id.clone(), route);
        Ok(Ticket {
            replies: self.clone(),
            id,
            rx,
        })
    }

    fn remove(&self, id: &str) {
        let mut routes = self.lock();
        if let Some(route) = routes.waiting.remove(id)
            && let Some(n) = routes.per_tenant.get_mut(&route.tenant)
        {
            *n -= 1;
            if *n == 0 {
                routes.per_tenant.remove(&route.tenant);
            }
        }
    }

    /// Hands `result` to the connection waiting for it; `false` when none
    /// is (its client left, or it was answered 429 and withdrawn).
    pub fn deliver(&self, result: ResultRecord) -> bool {
        let mut routes = self.lock();
        // The route stays (inert) until its ticket drops: the bound counts
        // the connection until its answer is written.
        let Some(route) = routes.waiting.get_mut(&result.id) else {
            return false;
        };
        let tx = std::mem::replace(&mut route.tx, oneshot::channel().0);
        drop(routes);
        tx.send(result).is_ok()
    }

    /// The held ids no dispatcher was seen taking yet.
    pub fn undispatched(&self) -> Vec<String> {
        (self.lock().waiting.iter())
            .filter(|(_, r)| !r.dispatched)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Marks `ids` taken by a dispatcher; how long each newly marked one
    /// waited (ids gone or already marked give nothing).
    pub fn mark_dispatched(&self, ids: &[String]) -> Vec<Duration> {
        let mut routes = self.lock();
        (ids.iter())
            .filter_map(|id| {
                let route = routes.waiting.get_mut(id)?;
                if route.dispatched {
                    return None;
                }
                route.dispatched = true;
                Some(route.since.elapsed())
            })
            .collect()
    }

    /// Every held id.
    pub fn held_ids(&self) -> Vec<String> {
        self.lock().waiting.keys().cloned().collect()
    }

    /// Connections held now.
    pub fn held(&self) -> u64 {
        self.lock().waiting.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HeldLimits = HeldLimits {
        total: 3,
        per_tenant: 2,
    };

    #[test]
    fn the_tenant_bound_then_the_total_decide() {
        assert_eq!(admit(0, 0, LIMITS), Ok(()));
        assert_eq!(admit(2, 1, LIMITS), Ok(()));
        assert_eq!(admit(2, 2, LIMITS), Err(Bound::Tenant));
        assert_eq!(admit(3, 0, LIMITS), Err(Bound::Total));
        assert_eq!(admit(3, 2, LIMITS), Err(Bound::Tenant));
    }

    #[tokio::test]
    async fn routes_are_bounded_answered_once_and_freed_by_their_drop() {
        let replies = Arc::new(Replies::new(LIMITS));
        let mut a = replies.hold("a", "flex_1".into()).expect("first");
        let b = replies.hold("a", "flex_2".into()).expect("second");
        assert_eq!(
            replies.hold("a", "flex_3".into()).err(),
            Some(Bound::Tenant)
        );
        let c = replies.hold("b", "flex_4".into()).expect("other tenant");
        assert_eq!(replies.hold("c", "flex_5".into()).err(), Some(Bound::Total));
        let result = ResultRecord::http("flex_1", None, 200, "{}".into(), 1);
        assert!(replies.deliver(result.clone()));
        assert_eq!(a.answer().await.id, "flex_1");
        assert!(!replies.deliver(result), "a copy finds nobody waiting");
        assert_eq!(replies.held(), 3, "held until the answer is written");
        drop(a);
        drop(b);
        assert_eq!(replies.held(), 1);
        assert!(replies.hold("a", "flex_6".into()).is_ok());
        drop(c);
        assert!(!replies.deliver(ResultRecord::http("flex_4", None, 200, "{}".into(), 1)));
    }
}
