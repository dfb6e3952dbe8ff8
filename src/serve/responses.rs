//! The background responses' own endpoints (`docs/flex.md`):
//! `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
//! `DELETE /v1/responses/{id}`, and what the collector does with their
//! results. A tenant sees only its own: another tenant's id answers 404,
//! exactly like an id that does not exist.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::json;

use super::background::{ResponseRecord, ResponseStatus};
use super::flex::Flex;
use super::http::{ApiError, AppState, Tenant};
use super::store::{Store, StoreError};
use crate::clock::unix_secs;
use crate::result::ResultRecord;

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
