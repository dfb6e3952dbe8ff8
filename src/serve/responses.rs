//! Background responses (`docs/flex.md`): their creation (stored, then
//! enqueued, answered `queued` at once; one a killed server stored but
//! did not enqueue is enqueued on restart), their own endpoints
//! (`GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
//! `DELETE /v1/responses/{id}`) and what the collector does with their
//! results. A tenant sees only its own: another tenant's id answers 404,
//! exactly like an id that does not exist.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Map, Value, json};

use super::background::{ResponseRecord, ResponseStatus};
use super::flex::{BACKGROUND_WINDOW_SECS, Flex};
use super::http::{ApiError, AppState, Tenant};
use super::store::{Store, StoreError};
use crate::clock::unix_secs;
use crate::endpoint::Endpoint;
use crate::result::ResultRecord;

impl Flex {
    /// A background request: stored, enqueued, answered `queued`.
    pub(super) async fn background(
        &self,
        store: &super::store::Store,
        tenant: &str,
        endpoint: Endpoint,
        body: Map<String, Value>,
        flex: bool,
    ) -> Result<Response, ApiError> {
        // Checked here, not in the insert: creations racing on several
        // connections may each pass a bound by one.
        let (mine, all) = store
            .active_response_counts(tenant)
            .await
            .map_err(ApiError::internal)?;
        let over = if mine >= self.settings.background_per_tenant {
            Some("serve.background_max_per_tenant")
        } else if all >= self.settings.background_total {
            Some("serve.background_max_total")
        } else {
            None
        };
        if let Some(key) = over {
            return Ok(self.refuse(
                "background_bound",
                format!("Resource Unavailable: too many background responses are unfinished ({key} reached); retry later"),
            ));
        }
        let record = ResponseRecord {
            id: super::model::new_id("resp_"),
            tenant: tenant.to_owned(),
            endpoint: endpoint.as_str().to_owned(),
            model: body.get("model").and_then(Value::as_str).map(str::to_owned),
            status: ResponseStatus::Queued,
            flex,
            created_at: unix_secs(),
            request: Some(Value::Object(body)),
            enqueued: false,
            output: None,
            error: None,
            finished_at: None,
            expires_at: None,
        };
        store
            .insert_response(&record)
            .await
            .map_err(ApiError::internal)?;
        self.metrics.background(ResponseStatus::Queued.as_str());
        let record = self.enqueue_background(store, &record).await?;
        Ok((StatusCode::OK, axum::Json(record.api())).into_response())
    }

    /// Enqueues a stored background response's message and records that it
    /// is (the request body is not kept after). A server killed between
    /// the two enqueues it again on restart ([`Self::resume`]): at least
    /// once, and its first result wins.
    async fn enqueue_background(
        &self,
        store: &super::store::Store,
        record: &ResponseRecord,
    ) -> Result<ResponseRecord, ApiError> {
        let Some(Value::Object(body)) = record.request.clone() else {
            return Ok(record.clone());
        };
        let endpoint = Endpoint::parse(&record.endpoint).unwrap_or(Endpoint::Responses);
        let deadline = record.created_at.saturating_add(BACKGROUND_WINDOW_SECS);
        let message = self.message(&record.id, &record.tenant, endpoint, body, deadline)?;
        self.sink
            .enqueue_one(message)
            .await
            .map_err(ApiError::internal)?;
        let done = store
            .update_response(&record.id, |r| {
                (!r.enqueued).then(|| {
                    let mut next = r.clone();
                    next.enqueued = true;
                    next.request = None;
                    next
                })
            })
            .await
            .map_err(ApiError::internal)?;
        Ok(done.unwrap_or_else(|| record.clone()))
    }

    /// Enqueues the background responses a killed server stored but did
    /// not enqueue (older than `after`), then keeps the status gauges.
    pub async fn resume(
        self: Arc<Self>,
        store: super::store::Store,
        stop: tokio_util::sync::CancellationToken,
    ) {
        const EVERY: Duration = Duration::from_secs(2);
        const AFTER_SECS: i64 = 10;
        loop {
            match store.unenqueued_responses().await {
                Ok(unsent) => {
                    let now = unix_secs();
                    for r in unsent.iter().filter(|r| r.created_at + AFTER_SECS <= now) {
                        if let Err(error) = self.enqueue_background(&store, r).await {
                            tracing::warn!(response = %r.id, message = %error.message, "cannot enqueue a background response; retrying");
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "cannot read background responses"),
            }
            if let Ok(expired) = store.expired_responses(unix_secs()).await {
                for id in expired {
                    let _ = store.delete_response(&id).await;
                }
            }
            if !crate::tasks::sleep_unless(&stop, EVERY).await {
                return;
            }
        }
    }
}

/// Whether a queue message id is a background response's.
pub fn is_response_id(id: &str) -> bool {
    id.starts_with("resp_")
}

/// Ends each response with its result (the first one wins; a copy finds
/// it terminal and changes nothing).
pub async fn apply(
    store: &Store,
    flex: &Flex,
    results: Vec<ResultRecord>,
) -> Result<(), StoreError> {
    let keep = flex.settings.keep_secs;
    for result in results {
        let now = unix_secs();
        if let Some(done) = store
            .update_response(&result.id, |r| r.finish(&result, now, keep))
            .await?
        {
            flex.metrics.background(done.status.as_str());
        }
    }
    Ok(())
}

async fn own(store: &Store, tenant: &str, id: &str) -> Result<ResponseRecord, ApiError> {
    match store.response(id).await.map_err(ApiError::internal)? {
        Some(r) if r.tenant == tenant => Ok(r),
        _ => Err(ApiError::not_found("response", id)),
    }
}

/// `GET /v1/responses/{id}`: a `queued` one a dispatcher has taken is
/// `in_progress` from then on.
async fn retrieve(
    State(state): State<Arc<AppState>>,
    Extension(flex): Extension<Arc<Flex>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = &state.engine.store;
    let mut record = own(store, &tenant, &id).await?;
    if record.status == ResponseStatus::Queued
        && record.enqueued
        && flex
            .sink
            .leased(vec![id.clone()])
            .await
            .is_ok_and(|l| l.first() == Some(&true))
    {
        let moved = store
            .update_response(&id, |r| {
                (r.status == ResponseStatus::Queued).then(|| {
                    let mut next = r.clone();
                    next.status = ResponseStatus::InProgress;
                    next
                })
            })
            .await
            .map_err(ApiError::internal)?;
        match moved {
            Some(next) => {
                flex.metrics.background(next.status.as_str());
                record = next;
            }
            None => record = own(store, &tenant, &id).await?,
        }
    }
    Ok(Json(record.api()).into_response())
}

/// `POST /v1/responses/{id}/cancel`: its message is cancelled (a waiting
/// one leaves the queue, a running one is stopped by the dispatcher) and
/// it ends `cancelled` at once; one already ended is returned as it is.
async fn cancel(
    State(state): State<Arc<AppState>>,
    Extension(flex): Extension<Arc<Flex>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = &state.engine.store;
    let record = own(store, &tenant, &id).await?;
    if record.status.is_terminal() {
        return Ok(Json(record.api()).into_response());
    }
    flex.sink
        .cancel(vec![id.clone()])
        .await
        .map_err(ApiError::internal)?;
    let keep = flex.settings.keep_secs;
    let now = unix_secs();
    let done = store
        .update_response(&id, |r| r.cancel(now, keep))
        .await
        .map_err(ApiError::internal)?;
    let record = match done {
        Some(r) => {
            flex.metrics.background(r.status.as_str());
            r
        }
        None => own(store, &tenant, &id).await?,
    };
    Ok(Json(record.api()).into_response())
}

/// `DELETE /v1/responses/{id}`: an unfinished one is cancelled first.
async fn delete(
    State(state): State<Arc<AppState>>,
    Extension(flex): Extension<Arc<Flex>>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let store = &state.engine.store;
    let record = own(store, &tenant, &id).await?;
    if !record.status.is_terminal() {
        flex.sink
            .cancel(vec![id.clone()])
            .await
            .map_err(ApiError::internal)?;
    }
    store
        .delete_response(&id)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
}

/// The routes, for [`super::flex::router`].
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/responses/{id}", get(retrieve).delete(delete))
        .route("/v1/responses/{id}/cancel", post(cancel))
}
