//! The HTTP surface: the OpenAI Files and Batches endpoints, bearer-key
//! tenants, and OpenAI-shaped errors (`{"error": {message, type, param,
//! code}}`). A tenant sees only its own objects: another tenant's id
//! answers 404, exactly like an id that does not exist.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Multipart, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

use super::auth::Keys;
use super::engine::{CreateError, Engine};
use super::idempotency::{self, Claim, KeyName, Scope};
use super::model::{BatchRecord, BatchStatus, FileRecord, NewBatch, list, new_id};
use super::order::{self, Order};
use super::quota::{Exceeded, LimitKind};
use super::retention::ExpiresAfter;
use crate::clock::unix_secs;
use crate::config::parse_duration;
use crate::endpoint::Endpoints;
use crate::queue::idempotency::{canonical_sha256, hex};

/// Most `metadata` pairs on a batch (OpenAI's limit).
const MAX_METADATA: usize = 16;
/// Longest `metadata` key in characters (OpenAI's limit).
const MAX_METADATA_KEY: usize = 64;
/// Longest `metadata` value in characters (OpenAI's limit).
const MAX_METADATA_VALUE: usize = 512;
/// Shortest `completion_window` (an extension: OpenAI takes only `24h`).
const MIN_WINDOW: Duration = Duration::from_secs(60);
/// Longest `completion_window` (an extension: OpenAI takes only `24h`).
const MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// Largest `limit` of `GET /v1/files`.
const MAX_FILES_LIMIT: usize = 10_000;
/// Largest `limit` of `GET /v1/batches` (OpenAI's).
const MAX_BATCHES_LIMIT: usize = 100;
/// Room for the multipart framing around the file itself.
const MULTIPART_SLACK: u64 = 64 * 1024;
/// How far over the file limit an upload is still read to its end (and
/// discarded) before the 413: a client still sending its body then reads
/// the answer, where closing the connection under it would reset it
/// before the answer arrives (seen with reqwest as a broken pipe). Past
/// this the body limit ends the upload and the connection.
const OVERSIZE_DRAIN: u64 = 64 * 1024 * 1024;

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The lifecycle runner (store, bodies, limits).
    pub engine: Arc<Engine>,
    /// API keys; empty means one anonymous tenant (loopback only).
    pub keys: Keys,
    /// `serve.pass_headers`: copied from a batch's creation onto each of
    /// its requests.
    pub pass_headers: Vec<axum::http::HeaderName>,
    /// `serve.order`: a batch's order unless its metadata names one.
    pub order: Order,
    /// `serve.endpoints`: the endpoints a batch may name.
    pub endpoints: Endpoints,
}

type Shared = Arc<AppState>;

/// An error in the OpenAI shape.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) param: Option<&'static str>,
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    pub(super) fn not_found(what: &str, id: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("No such {what}: {id}"),
            kind: "invalid_request_error",
            param: Some("id"),
            code: None,
        }
    }

    /// 429 for a batch over its tenant's limit on enqueued work, worded
    /// as OpenAI words its enqueued-token limit.
    fn limit(tenant: &str, e: Exceeded) -> Self {
        let (what, kind, code) = match e.kind {
            LimitKind::Requests => ("request", "requests", "request_limit_exceeded"),
            LimitKind::Tokens => ("token", "tokens", "token_limit_exceeded"),
        };
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "Enqueued {what} limit reached for tenant {tenant}. Limit: {} enqueued {what}s; {} are enqueued and this batch adds {} (serve.tenant_limits). Please try again once some in_progress batches have been completed.",
                e.limit, e.held, e.asked
            ),
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// 409 for an `Idempotency-Key` that made an object from another
    /// request (OpenAI's error shape; the code is ours).
    fn conflict(key: &str) -> Self {
        Self {
            status: StatusCode::CONFLICT,
            message: format!(
                "Idempotency-Key `{key}` was already used with a different request; use a new key for a new request"
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("idempotency_key_conflict"),
        }
    }

    fn bad_key(e: idempotency::BadKey) -> Self {
        Self::invalid(e.to_string(), None)
    }

    pub(super) fn internal(error: impl std::fmt::Display) -> Self {
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
pub struct Tenant(pub(super) String);

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
        .saturating_add(MULTIPART_SLACK)
        .saturating_add(OVERSIZE_DRAIN);
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
    headers: axum::http::HeaderMap,
    mut form: Multipart,
) -> Result<axum::Json<Value>, ApiError> {
    let key = idempotency::key(&headers).map_err(ApiError::bad_key)?;
    // The file's bytes make its fingerprint with its purpose and expiry.
    let mut hasher = Sha256::new();
    let bodies = &state.engine.bodies;
    let max = state.engine.limits.max_file_bytes;
    let mut purpose = None;
    // `expires_after[anchor]` and `expires_after[seconds]`: how the
    // OpenAI clients send the nested object in a multipart form.
    let (mut expiry_anchor, mut expiry_seconds) = (None, None);
    let mut stored: Option<(std::path::PathBuf, String, u64)> = None;
    // The file went over `max`: the rest is read and discarded.
    let mut oversize = false;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!("the file is larger than {max} bytes (serve.max_file_bytes)"),
        kind: "invalid_request_error",
        param: Some("file"),
        code: Some("file_too_large"),
    };
    // The body limit (the file limit, the framing's slack and
    // `OVERSIZE_DRAIN`) ends the stream with a 413 error: a file far over
    // the limit is answered as one just over it, not as an interrupted
    // upload (issue 22).
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
                Some(name @ ("expires_after[anchor]" | "expires_after[seconds]")) => {
                    let anchor = name == "expires_after[anchor]";
                    let text = field.text().await.map_err(|e| {
                        ApiError::invalid(
                            format!("unreadable expires_after: {e}"),
                            Some("expires_after"),
                        )
                    })?;
                    match anchor {
                        true => expiry_anchor = Some(text),
                        false => expiry_seconds = Some(text),
                    }
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
                            // Read on, discarding (`OVERSIZE_DRAIN`).
                            oversize = true;
                            continue;
                        }
                        hasher.update(&chunk);
                        internal!(out.write_all(&chunk).await);
                    }
                    internal!(out.flush().await);
                    internal!(out.sync_all().await);
                }
                _ => {}
            }
        }
        if oversize {
            return Err(too_large());
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
    let expires_after =
        match ExpiresAfter::from_form(expiry_anchor.as_deref(), expiry_seconds.as_deref()) {
            Ok(e) => e,
            Err(message) => {
                discard(&stored);
                return Err(ApiError::invalid(message, Some("expires_after")));
            }
        };
    let Some((temp, filename, bytes)) = stored else {
        return Err(ApiError::invalid("file is required", Some("file")));
    };
    let created_at = unix_secs();
    let file = FileRecord {
        id: new_id("file-"),
        tenant,
        bytes,
        created_at,
        filename,
        purpose,
        expires_at: (state.engine.limits.retention)
            .expires_at(created_at, expires_after.map(ExpiresAfter::seconds)),
    };
    if let Some(key) = &key {
        let fingerprint = canonical_sha256(&json!({
            "purpose": file.purpose,
            "expires_after": [expiry_anchor, expiry_seconds],
            "sha256": hex(&hasher.finalize()),
        }));
        let store = &state.engine.store;
        let claimed = idempotency::claim(
            store,
            KeyName {
                tenant: &file.tenant,
                scope: Scope::File,
                key,
            },
            &fingerprint,
            &file.id,
            file.expires_at,
            |id| async move { Ok(store.file(&id).await?.is_some()) },
        )
        .await;
        match internal!(claimed) {
            Claim::New => {}
            Claim::Existing(id) => {
                let _ = std::fs::remove_file(&temp);
                let first = own_file(&state, &file.tenant, &id).await?;
                return Ok(axum::Json(first.api()));
            }
            Claim::Conflict => {
                let _ = std::fs::remove_file(&temp);
                return Err(ApiError::conflict(key));
            }
        }
    }
    let stored = async {
        bodies.commit(&temp, &file.id).await?;
        state.engine.store.put_file(&file).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    if let Err(error) = stored {
        if let Some(key) = &key {
            // The key made nothing: a retry may use it.
            let _ = idempotency::release(&state.engine.store, &file.tenant, Scope::File, key).await;
        }
        return Err(ApiError::internal(error));
    }
    Ok(axum::Json(file.api()))
}

/// `after`, `limit`, `order` and `purpose` of the list endpoints, checked.
#[derive(Debug, Default)]
struct ListQuery {
    after: Option<String>,
    limit: usize,
    ascending: bool,
    purpose: Option<String>,
}

/// Parses a list endpoint's query string: `limit` an integer in
/// `1..=max_limit` (`default_limit` when absent), `order` `asc` or `desc`;
/// anything else is a 400 naming the parameter, in OpenAI's shape (axum's
/// own extractor answers plain text). Unknown parameters are ignored.
fn list_query(
    raw: Option<&str>,
    default_limit: usize,
    max_limit: usize,
) -> Result<ListQuery, ApiError> {
    let mut q = ListQuery {
        limit: default_limit,
        ..ListQuery::default()
    };
    for (key, value) in url::form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        match key.as_ref() {
            "limit" => {
                q.limit = value
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=max_limit).contains(l))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!(
                                "Invalid 'limit': `{value}`; expected an integer between 1 and {max_limit}."
                            ),
                            Some("limit"),
                        )
                    })?;
            }
            "order" => {
                q.ascending = match value.as_ref() {
                    "asc" => true,
                    "desc" => false,
                    other => {
                        return Err(ApiError::invalid(
                            format!("Invalid 'order': `{other}`; expected `asc` or `desc`."),
                            Some("order"),
                        ));
                    }
                };
            }
            "after" => q.after = Some(value.into_owned()),
            "purpose" => q.purpose = Some(value.into_owned()),
            _ => {}
        }
    }
    Ok(q)
}

/// The page of `ids` (newest first) after `after`: its ids and whether
/// more follow. An `after` that is not among `ids` is a 400.
fn page(mut ids: Vec<String>, q: &ListQuery) -> Result<(Vec<String>, bool), ApiError> {
    if q.ascending {
        ids.reverse();
    }
    let start = match &q.after {
        Some(after) => ids
            .iter()
            .position(|id| id == after)
            .map(|i| i + 1)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("Invalid 'after': no object `{after}` in this list."),
                    Some("after"),
                )
            })?,
        None => 0,
    };
    let rest = ids.split_off(start.min(ids.len()));
    let has_more = rest.len() > q.limit;
    Ok((rest.into_iter().take(q.limit).collect(), has_more))
}

async fn list_files(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    RawQuery(raw): RawQuery,
) -> Result<axum::Json<Value>, ApiError> {
    let q = list_query(raw.as_deref(), MAX_FILES_LIMIT, MAX_FILES_LIMIT)?;
    let store = &state.engine.store;
    // Every record is read before paging: an expired file (404 from its
    // `expires_at` on, before the sweeper deletes it) and, when asked, one
    // of another purpose must not count towards a page.
    let at = unix_secs();
    let mut files = HashMap::new();
    let mut ids = Vec::new();
    for id in internal!(store.file_ids(&tenant).await) {
        let Some(f) = internal!(store.file(&id).await) else {
            continue;
        };
        if f.expired(at) || q.purpose.as_ref().is_some_and(|p| &f.purpose != p) {
            continue;
        }
        ids.push(id.clone());
        files.insert(id, f);
    }
    let (ids, has_more) = page(ids, &q)?;
    let data = (ids.iter())
        .filter_map(|id| files.get(id).map(FileRecord::api))
        .collect();
    Ok(axum::Json(list(data, has_more)))
}

/// The tenant's file `id`; another tenant's, or one past its
/// `expires_at` (as OpenAI answers, even before the sweeper deleted it),
/// is a 404.
async fn own_file(state: &AppState, tenant: &str, id: &str) -> Result<FileRecord, ApiError> {
    match internal!(state.engine.store.file(id).await) {
        Some(f) if f.tenant == tenant && !f.expired(unix_secs()) => Ok(f),
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
    #[serde(default)]
    output_expires_after: Option<Value>,
}

async fn create_batch(
    State(state): State<Shared>,
    Tenant(tenant): Tenant,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, ApiError> {
    let key = idempotency::key(&headers).map_err(ApiError::bad_key)?;
    let req: CreateBatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("the body is not a valid request: {e}"), None))?;
    let input_file_id = req
        .input_file_id
        .ok_or_else(|| ApiError::invalid("input_file_id is required", Some("input_file_id")))?;
    let endpoint = req
        .endpoint
        .ok_or_else(|| ApiError::invalid("endpoint is required", Some("endpoint")))?;
    if !state.endpoints.allows(&endpoint) {
        return Err(ApiError::invalid(
            format!(
                "endpoint {endpoint} is not supported; allowed: {} (serve.endpoints)",
                state.endpoints.paths().join(", ")
            ),
            Some("endpoint"),
        ));
    }
    let window = req.completion_window.unwrap_or_else(|| "24h".to_owned());
    let span = completion_window(&window)?;
    let metadata = metadata(req.metadata.unwrap_or_default())?;
    let output_expires_after = match &req.output_expires_after {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            ExpiresAfter::from_json("output_expires_after", v)
                .map_err(|m| ApiError::invalid(m, Some("output_expires_after")))?
                .seconds(),
        ),
    };
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
    let tenant_of = tenant.clone();
    let mut batch = BatchRecord::new(NewBatch {
        tenant,
        endpoint,
        input_file_id,
        completion_window: window,
        window_secs: i64::try_from(span.as_secs()).unwrap_or(i64::MAX),
        metadata,
        output_expires_after,
    });
    batch.headers = passed_headers(&state.pass_headers, &headers)?;
    batch.order = batch_order(&batch.metadata, state.order)?;
    if let Some(key) = &key {
        // The body was read as a request above, so it is JSON.
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let store = &state.engine.store;
        let claimed = idempotency::claim(
            store,
            KeyName {
                tenant: &tenant_of,
                scope: Scope::Batch,
                key,
            },
            &canonical_sha256(&body),
            &batch.id,
            None,
            |id| async move { Ok(store.batch(&id).await?.is_some()) },
        )
        .await;
        match internal!(claimed) {
            Claim::New => {}
            Claim::Existing(id) => {
                let first = own_batch(&state, &tenant_of, &id).await?;
                return Ok(axum::Json(batch_json(&state, &first).await?));
            }
            Claim::Conflict => return Err(ApiError::conflict(key)),
        }
    }
    let created = state.engine.create(batch).await;
    if let (Err(_), Some(key)) = (&created, &key) {
        // The key made nothing: a retry may use it.
        let _ = idempotency::release(&state.engine.store, &tenant_of, Scope::Batch, key).await;
    }
    let batch = match created {
        Ok(batch) => batch,
        Err(CreateError::Limit(e)) => return Err(ApiError::limit(&tenant_of, e)),
        Err(CreateError::Engine(e)) => return Err(ApiError::internal(e)),
    };
    Ok(axum::Json(batch.api(0, 0)))
}

/// A batch's line order: its metadata's [`order::METADATA_KEY`] when
/// given (a value that is no order is a 400 naming `metadata`), else the
/// server's.
fn batch_order(metadata: &BTreeMap<String, String>, server: Order) -> Result<Order, ApiError> {
    let Some(value) = metadata.get(order::METADATA_KEY) else {
        return Ok(server);
    };
    Order::parse(value).ok_or_else(|| {
        ApiError::invalid(
            format!(
                "Invalid 'metadata': `{}` is `{value}`; allowed: {}.",
                order::METADATA_KEY,
                Order::spellings()
            ),
            Some("metadata"),
        )
    })
}

/// The configured pass-through headers the creation carries, by name.
/// A value that is not visible ASCII is refused (it could not be sent on).
fn passed_headers(
    names: &[axum::http::HeaderName],
    headers: &axum::http::HeaderMap,
) -> Result<BTreeMap<String, String>, ApiError> {
    let mut passed = BTreeMap::new();
    for name in names {
        let Some(value) = headers.get(name) else {
            continue;
        };
        let text = value
            .to_str()
            .map_err(|_| ApiError::invalid(format!("header {name} is not visible ASCII"), None))?;
        passed.insert(name.as_str().to_owned(), text.to_owned());
    }
    Ok(passed)
}

/// A batch's `completion_window`: `24h` (OpenAI's only value) or, as an
/// extension, a duration with units between [`MIN_WINDOW`] and
/// [`MAX_WINDOW`]. A bare number is refused rather than read as seconds.
fn completion_window(text: &str) -> Result<Duration, ApiError> {
    let refuse = |why: &str| {
        ApiError::invalid(
            format!(
                "Invalid 'completion_window': `{text}`{why}; use 24h (or, as an extension, a duration such as 1h or 90m between 1m and 7d)."
            ),
            Some("completion_window"),
        )
    };
    let t = text.trim();
    if t.is_empty() || t.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(refuse(" has no unit"));
    }
    let span = parse_duration(t).map_err(|_| refuse(" is not a duration"))?;
    if span < MIN_WINDOW {
        return Err(refuse(" is shorter than 1m"));
    }
    if span > MAX_WINDOW {
        return Err(refuse(" is longer than 7d"));
    }
    Ok(span)
}

/// A batch's `metadata` within OpenAI's limits: string values, at most
/// [`MAX_METADATA`] pairs, keys of at most [`MAX_METADATA_KEY`] and values
/// of at most [`MAX_METADATA_VALUE`] characters.
fn metadata(given: BTreeMap<String, Value>) -> Result<BTreeMap<String, String>, ApiError> {
    let refuse =
        |why: String| ApiError::invalid(format!("Invalid 'metadata': {why}."), Some("metadata"));
    if given.len() > MAX_METADATA {
        return Err(refuse(format!(
            "{} pairs; at most {MAX_METADATA} are allowed",
            given.len()
        )));
    }
    let mut metadata = BTreeMap::new();
    for (key, value) in given {
        let Value::String(value) = value else {
            return Err(refuse(format!("the value of `{key}` is not a string")));
        };
        let key_chars = key.chars().count();
        if key_chars > MAX_METADATA_KEY {
            return Err(refuse(format!(
                "a key is {key_chars} characters long; at most {MAX_METADATA_KEY} are allowed"
            )));
        }
        let value_chars = value.chars().count();
        if value_chars > MAX_METADATA_VALUE {
            return Err(refuse(format!(
                "the value of `{key}` is {value_chars} characters long; at most {MAX_METADATA_VALUE} are allowed"
            )));
        }
        metadata.insert(key, value);
    }
    Ok(metadata)
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
    RawQuery(raw): RawQuery,
) -> Result<axum::Json<Value>, ApiError> {
    let q = list_query(raw.as_deref(), 20, MAX_BATCHES_LIMIT)?;
    let ids = internal!(state.engine.store.batch_ids(&tenant).await);
    let (ids, has_more) = page(ids, &q)?;
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

    fn q(after: Option<&str>, limit: usize) -> ListQuery {
        ListQuery {
            after: after.map(str::to_owned),
            limit,
            ..ListQuery::default()
        }
    }

    #[test]
    fn pages_follow_the_after_cursor() {
        let ids: Vec<String> = ["e", "d", "c", "b", "a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (p, more) = page(ids.clone(), &q(None, 2)).expect("page");
        assert_eq!((p, more), (vec!["e".to_owned(), "d".to_owned()], true));
        let (p, more) = page(ids.clone(), &q(Some("d"), 2)).expect("page");
        assert_eq!((p, more), (vec!["c".to_owned(), "b".to_owned()], true));
        let (p, more) = page(ids.clone(), &q(Some("b"), 2)).expect("page");
        assert_eq!((p, more), (vec!["a".to_owned()], false));
        let (p, more) = page(ids.clone(), &q(Some("a"), 2)).expect("page");
        assert_eq!((p, more), (vec![], false));
        let e = page(ids, &q(Some("zz"), 2)).expect_err("unknown cursor");
        assert_eq!(
            (e.status, e.param),
            (StatusCode::BAD_REQUEST, Some("after"))
        );
    }

    #[test]
    fn list_queries_refuse_bad_parameters_by_name() {
        for (raw, param) in [
            ("limit=-1", "limit"),
            ("limit=abc", "limit"),
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=", "limit"),
            ("limit=1.5", "limit"),
            ("order=sideways", "order"),
            ("order=ASC", "order"),
        ] {
            let e = list_query(Some(raw), 20, 100).expect_err(raw);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{raw}");
            assert_eq!(e.param, Some(param), "{raw}");
        }
        let q = list_query(Some("limit=100&order=asc&after=b%3Ax&x=1"), 20, 100).expect("valid");
        assert_eq!(
            (q.limit, q.ascending, q.after.as_deref()),
            (100, true, Some("b:x"))
        );
        assert_eq!(list_query(None, 20, 100).expect("empty").limit, 20);
    }

    #[test]
    fn completion_windows_are_24h_or_between_a_minute_and_a_week() {
        for ok in ["24h", "1m", "60s", "90m", "7d", "168h", " 2h "] {
            assert!(completion_window(ok).is_ok(), "{ok}");
        }
        for bad in [
            "24", "3600", "100ms", "59s", "100000h", "8d", "7d1s", "", "abc", "-1h", "24 hours",
        ] {
            let e = completion_window(bad).expect_err(bad);
            assert_eq!(e.param, Some("completion_window"), "{bad}");
        }
    }

    #[test]
    fn metadata_follows_openai_limits() {
        let pairs = |n: usize, key: usize, value: usize| -> BTreeMap<String, Value> {
            (0..n)
                .map(|i| {
                    (
                        format!("{i:0>width$}", width = key),
                        Value::String("v".repeat(value)),
                    )
                })
                .collect()
        };
        assert_eq!(
            metadata(pairs(16, 64, 512)).expect("at the limits").len(),
            16
        );
        for (n, key, value) in [(17, 2, 1), (1, 65, 1), (1, 2, 513)] {
            let e = metadata(pairs(n, key, value)).expect_err("over a limit");
            assert_eq!(
                (e.status, e.param),
                (StatusCode::BAD_REQUEST, Some("metadata"))
            );
        }
        // Characters, not bytes: 512 two-byte characters are allowed.
        let wide = BTreeMap::from([("k".to_owned(), Value::String("é".repeat(512)))]);
        assert!(metadata(wide).is_ok());
        let number = BTreeMap::from([("k".to_owned(), json!(1))]);
        assert!(metadata(number).is_err());
    }

    #[test]
    fn a_batch_order_comes_from_its_metadata_or_the_server() {
        let with = |v: &str| BTreeMap::from([(order::METADATA_KEY.to_owned(), v.to_owned())]);
        let none = BTreeMap::new();
        assert_eq!(
            batch_order(&none, Order::ModelPrefix).ok(),
            Some(Order::ModelPrefix)
        );
        assert_eq!(
            batch_order(&with("arrival"), Order::ModelPrefix).ok(),
            Some(Order::Arrival)
        );
        assert_eq!(
            batch_order(&with("model-prefix-v1"), Order::Arrival).ok(),
            Some(Order::ModelPrefix)
        );
        let e = batch_order(&with("shuffled"), Order::Arrival).expect_err("not an order");
        assert_eq!(
            (e.status, e.param),
            (StatusCode::BAD_REQUEST, Some("metadata"))
        );
        assert!(e.message.contains("arrival, model-prefix"), "{}", e.message);
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let response = ApiError::not_found("batch", "batch_x").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let e = ApiError::invalid("bad", Some("limit"));
        assert_eq!((e.param, e.kind), (Some("limit"), "invalid_request_error"));
    }
}
