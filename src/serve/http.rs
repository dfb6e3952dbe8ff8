//! The HTTP surface: the OpenAI Files and Batches endpoints, bearer-key
//! tenants, and OpenAI-shaped errors (`{"error": {message, type, param,
//! code}}`). A tenant sees only its own objects: another tenant's id
//! answers 404, exactly like an id that does not exist.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Multipart, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use super::auth::Keys;
use super::engine::Engine;
use super::model::{BatchRecord, BatchStatus, FileRecord, NewBatch, list, new_id, now};
use crate::config::parse_duration;

/// Endpoints a batch may name (OpenAI's list).
pub const ENDPOINTS: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
];
/// Most `metadata` pairs on a batch (OpenAI's limit).
const MAX_METADATA: usize = 16;
/// Room for the multipart framing around the file itself.
const MULTIPART_SLACK: u64 = 64 * 1024;

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The lifecycle runner (store, bodies, limits).
    pub engine: Arc<Engine>,
    /// API keys; empty means one anonymous tenant (loopback only).
    pub keys: Keys,
}

type Shared = Arc<AppState>;

/// An error in the OpenAI shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    fn not_found(what: &str, id: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("No such {what}: {id}"),
            kind: "invalid_request_error",
            param: Some("id"),
            code: None,
        }
    }

    fn internal(error: impl std::fmt::Display) -> Self {
        tracing::error!(%error, "batch api request failed");
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("internal error: {error}"),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is never read: the connection cannot
            // carry another request.
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

macro_rules! internal {
    ($e:expr) => {
        $e.map_err(ApiError::internal)?
    };
}

/// The caller's tenant, from `Authorization: Bearer <key>`.
#[derive(Debug)]
pub struct Tenant(String);

impl FromRequestParts<Shared> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        state.keys.tenant(presented).map(Tenant).ok_or(ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect API key provided.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        })
    }
}

/// The router of the Files and Batches API.
pub fn router(state: Shared) -> Router {
    let body_limit = state
        .engine
        .limits
        .max_file_bytes
        .saturating_add(MULTIPART_SLACK);
    Router::new()
        .route("/v1/files", post(upload).get(list_files))
        .route("/v1/files/{id}", get(get_file).delete(delete_file))
        .route("/v1/files/{id}/content", get(file_content))
        .route("/v1/batches", post(create_batch).get(list_batches))
        .route("/v1/batches/{id}", get(get_batch))
        .route("/v1/batches/{id}/cancel", post(cancel_batch))
        .layer(DefaultBodyLimit::max(
            usize::try_from(body_limit).unwrap_or(usize::MAX),
        ))
        .with_state(state)
}

/// `POST /v1/files`: multipart `purpose` and `file`, streamed to disk.
async fn upload(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    mut form: Multipart,
) -> Result<axum::Json<Value>, ApiError> {
    let bodies = &state.engine.bodies;
    let max = state.engine.limits.max_file_bytes;
    let mut purpose = None;
    let mut stored: Option<(std::path::PathBuf, String, u64)> = None;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!("the file is larger than {max} bytes (serve.max_file_bytes)"),
        kind: "invalid_request_error",
        param: Some("file"),
        code: Some("file_too_large"),
    };
    // The body limit (the file limit plus the framing's slack) ends the
    // stream with a 413 error: a file far over the limit is answered as
    // one just over it, not as an interrupted upload (issue 22).
    let unreadable =
        |e: axum::extract::multipart::MultipartError, what: &str, param: Option<&'static str>| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large()
            } else {
                ApiError::invalid(format!("{what}: {e}"), param)
            }
        };
    let result = async {
        while let Some(mut field) = form
            .next_field()
            .await
            .map_err(|e| unreadable(e, "malformed multipart body", None))?
        {
            match field.name() {
                Some("purpose") => {
                    let text = field.text().await.map_err(|e| {
                        ApiError::invalid(format!("unreadable purpose: {e}"), Some("purpose"))
                    })?;
                    purpose = Some(text);
                }
                Some("file") => {
                    if stored.is_some() {
                        return Err(ApiError::invalid("only one file per upload", Some("file")));
                    }
                    let name = field.file_name().unwrap_or("upload.jsonl").to_owned();
                    let temp = bodies.temp();
                    let mut out = internal!(tokio::fs::File::create(&temp).await);
                    stored = Some((temp, name, 0));
                    while let Some(chunk) = field
                        .chunk()
                        .await
                        .map_err(|e| unreadable(e, "upload interrupted", Some("file")))?
                    {
                        let Some((_, _, size)) = stored.as_mut() else {
                            break;
                        };
                        *size += chunk.len() as u64;
                        if *size > max {
                            return Err(too_large());
                        }
                        internal!(out.write_all(&chunk).await);
                    }
                    internal!(out.flush().await);
                    internal!(out.sync_all().await);
                }
                _ => {}
            }
        }
        Ok(())
    }
    .await;
    let discard = |stored: &Option<(std::path::PathBuf, String, u64)>| {
        if let Some((temp, _, _)) = stored {
            let _ = std::fs::remove_file(temp);
        }
    };
    if let Err(e) = result {
        discard(&stored);
        return Err(e);
    }
    let purpose = match purpose.as_deref() {
        Some("batch") => "batch".to_owned(),
        Some(other) => {
            discard(&stored);
            return Err(ApiError::invalid(
                format!("purpose `{other}` is not supported; only `batch`"),
                Some("purpose"),
            ));
        }
        None => {
            discard(&stored);
            return Err(ApiError::invalid("purpose is required", Some("purpose")));
        }
    };
    let Some((temp, filename, bytes)) = stored else {
        return Err(ApiError::invalid("file is required", Some("file")));
    };
    let file = FileRecord {
        id: new_id("file-"),
        tenant,
        bytes,
        created_at: now(),
        filename,
        purpose,
    };
    internal!(bodies.commit(&temp, &file.id).await);
    internal!(state.engine.store.put_file(&file).await);
    Ok(axum::Json(file.api()))
}

/// `after`, `limit`, `order` and `purpose` of the list endpoints.
#[derive(Debug, Deserialize)]
struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
    purpose: Option<String>,
}

/// The page of `ids` (newest first) after `after`: its ids and whether
/// more follow.
fn page(
    mut ids: Vec<String>,
    q: &ListQuery,
    default_limit: usize,
) -> Result<(Vec<String>, bool), ApiError> {
    let limit = q.limit.unwrap_or(default_limit);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::invalid(
            "limit must be between 1 and 10000",
            Some("limit"),
        ));
    }
    match q.order.as_deref() {
        None | Some("desc") => {}
        Some("asc") => ids.reverse(),
        Some(_) => {
            return Err(ApiError::invalid(
                "order must be asc or desc",
                Some("order"),
            ));
        }
    }
    let start = match &q.after {
        Some(after) => ids
            .iter()
            .position(|id| id == after)
            .map_or(ids.len(), |i| i + 1),
        None => 0,
    };
    let rest = ids.split_off(start.min(ids.len()));
    let has_more = rest.len() > limit;
    Ok((rest.into_iter().take(limit).collect(), has_more))
}

async fn list_files(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Query(q): Query<ListQuery>,
) -> Result<axum::Json<Value>, ApiError> {
    let store = &state.engine.store;
    let mut ids = internal!(store.file_ids(&tenant).await);
    if let Some(purpose) = &q.purpose {
        let mut kept = Vec::with_capacity(ids.len());
        for id in ids {
            if internal!(store.file(&id).await).is_some_and(|f| &f.purpose == purpose) {
                kept.push(id);
            }
        }
        ids = kept;
    }
    let (ids, has_more) = page(ids, &q, 10_000)?;
    let mut data = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(f) = internal!(store.file(&id).await) {
            data.push(f.api());
        }
    }
    Ok(axum::Json(list(data, has_more)))
}

async fn own_file(state: &AppState, tenant: &str, id: &str) -> Result<FileRecord, ApiError> {
    match internal!(state.engine.store.file(id).await) {
        Some(f) if f.tenant == tenant => Ok(f),
        _ => Err(ApiError::not_found("File", id)),
    }
}

async fn get_file(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    Ok(axum::Json(own_file(&state, &tenant, &id).await?.api()))
}

async fn delete_file(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let file = own_file(&state, &tenant, &id).await?;
    // A running batch reads its input again (enqueue, cancel, expiry).
    let active = internal!(state.engine.store.active_batches().await);
    if let Some(batch) = active.iter().find(|b| b.input_file_id == file.id) {
        return Err(ApiError {
            status: StatusCode::CONFLICT,
            message: format!(
                "file {} is the input of batch {}, which is {}; delete it once the batch has ended",
                file.id,
                batch.id,
                batch.status.as_str()
            ),
            kind: "invalid_request_error",
            param: Some("file_id"),
            code: None,
        });
    }
    internal!(state.engine.store.delete_file(&file.id).await);
    internal!(state.engine.bodies.remove(&file.id).await);
    Ok(axum::Json(
        json!({"id": file.id, "object": "file", "deleted": true}),
    ))
}

/// `GET /v1/files/{id}/content`: the body, streamed from disk.
async fn file_content(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let file = own_file(&state, &tenant, &id).await?;
    let body = internal!(tokio::fs::File::open(state.engine.bodies.path(&file.id)).await);
    let stream = tokio_util::io::ReaderStream::new(body);
    Ok((
        [
            (header::CONTENT_TYPE, "application/jsonl".to_owned()),
            (header::CONTENT_LENGTH, file.bytes.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct CreateBatch {
    input_file_id: Option<String>,
    endpoint: Option<String>,
    completion_window: Option<String>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, Value>>,
}

async fn create_batch(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, ApiError> {
    let req: CreateBatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("the body is not a valid request: {e}"), None))?;
    let input_file_id = req
        .input_file_id
        .ok_or_else(|| ApiError::invalid("input_file_id is required", Some("input_file_id")))?;
    let endpoint = req
        .endpoint
        .ok_or_else(|| ApiError::invalid("endpoint is required", Some("endpoint")))?;
    if !ENDPOINTS.contains(&endpoint.as_str()) {
        return Err(ApiError::invalid(
            format!(
                "endpoint {endpoint} is not supported; allowed: {}",
                ENDPOINTS.join(", ")
            ),
            Some("endpoint"),
        ));
    }
    let window = req.completion_window.unwrap_or_else(|| "24h".to_owned());
    let span = parse_duration(&window)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            ApiError::invalid(
                format!("completion_window `{window}` is not a duration such as 24h"),
                Some("completion_window"),
            )
        })?;
    let mut metadata = BTreeMap::new();
    for (key, value) in req.metadata.unwrap_or_default() {
        let Value::String(value) = value else {
            return Err(ApiError::invalid(
                "metadata values must be strings",
                Some("metadata"),
            ));
        };
        metadata.insert(key, value);
    }
    if metadata.len() > MAX_METADATA {
        return Err(ApiError::invalid(
            format!("metadata has more than {MAX_METADATA} pairs"),
            Some("metadata"),
        ));
    }
    // Another tenant's file is as unknown as a missing one: 404, as every
    // other endpoint answers for it.
    let input = own_file(&state, &tenant, &input_file_id)
        .await
        .map_err(|e| match e.status {
            StatusCode::NOT_FOUND => ApiError {
                param: Some("input_file_id"),
                ..ApiError::not_found("File object", &input_file_id)
            },
            _ => e,
        })?;
    if input.purpose != "batch" {
        return Err(ApiError::invalid(
            format!(
                "file {input_file_id} has purpose {}; a batch needs purpose batch",
                input.purpose
            ),
            Some("input_file_id"),
        ));
    }
    let batch = BatchRecord::new(NewBatch {
        tenant,
        endpoint,
        input_file_id,
        completion_window: window,
        window_secs: i64::try_from(span.as_secs()).unwrap_or(i64::MAX),
        metadata,
    });
    internal!(state.engine.store.insert_batch(&batch).await);
    state.engine.start_intake(&batch.id);
    Ok(axum::Json(batch.api(0, 0)))
}

async fn batch_json(state: &AppState, batch: &BatchRecord) -> Result<Value, ApiError> {
    let (ok, failed) = internal!(state.engine.store.counts(&batch.id).await);
    Ok(batch.api(ok, failed))
}

async fn own_batch(state: &AppState, tenant: &str, id: &str) -> Result<BatchRecord, ApiError> {
    match internal!(state.engine.store.batch(id).await) {
        Some(b) if b.tenant == tenant => Ok(b),
        _ => Err(ApiError::not_found("batch", id)),
    }
}

async fn get_batch(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let batch = own_batch(&state, &tenant, &id).await?;
    Ok(axum::Json(batch_json(&state, &batch).await?))
}

async fn list_batches(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Query(q): Query<ListQuery>,
) -> Result<axum::Json<Value>, ApiError> {
    let ids = internal!(state.engine.store.batch_ids(&tenant).await);
    let q = ListQuery {
        limit: Some(q.limit.unwrap_or(20)),
        ..q
    };
    if q.limit.is_some_and(|l| l > 100) {
        return Err(ApiError::invalid(
            "limit must be between 1 and 100",
            Some("limit"),
        ));
    }
    let (ids, has_more) = page(ids, &q, 20)?;
    let mut data = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(b) = internal!(state.engine.store.batch(&id).await) {
            data.push(batch_json(&state, &b).await?);
        }
    }
    Ok(axum::Json(list(data, has_more)))
}

async fn cancel_batch(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let batch = own_batch(&state, &tenant, &id).await?;
    if batch.status.is_terminal() || batch.status == BatchStatus::Finalizing {
        return Err(ApiError {
            status: StatusCode::CONFLICT,
            message: format!(
                "Cannot cancel a batch with status {}.",
                batch.status.as_str()
            ),
            kind: "invalid_request_error",
            param: None,
            code: None,
        });
    }
    let batch = internal!(state.engine.cancel(&id).await).unwrap_or(batch);
    Ok(axum::Json(batch_json(&state, &batch).await?))
}

/// Whether `addr` is loopback only (an unauthenticated server may listen
/// there and nowhere else).
pub fn is_loopback(addr: &std::net::SocketAddr) -> bool {
    addr.ip().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(after: Option<&str>, limit: Option<usize>) -> ListQuery {
        ListQuery {
            after: after.map(str::to_owned),
            limit,
            order: None,
            purpose: None,
        }
    }

    #[test]
    fn pages_follow_the_after_cursor() {
        let ids: Vec<String> = ["e", "d", "c", "b", "a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (p, more) = page(ids.clone(), &q(None, Some(2)), 20).expect("page");
        assert_eq!((p, more), (vec!["e".to_owned(), "d".to_owned()], true));
        let (p, more) = page(ids.clone(), &q(Some("d"), Some(2)), 20).expect("page");
        assert_eq!((p, more), (vec!["c".to_owned(), "b".to_owned()], true));
        let (p, more) = page(ids, &q(Some("b"), Some(2)), 20).expect("page");
        assert_eq!((p, more), (vec!["a".to_owned()], false));
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let response = ApiError::not_found("batch", "batch_x").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let e = ApiError::invalid("bad", Some("limit"));
        assert_eq!((e.param, e.kind), (Some("limit"), "invalid_request_error"));
    }
}
