//! The router and the small endpoints (health, models, metrics, state).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use super::*;
use crate::sim::bad_request::BadRequest;
use crate::sim::metrics::render;

pub(super) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        // vLLM's pooling-model endpoints, under every path vLLM serves.
        .route("/v1/rerank", post(rerank))
        .route("/v2/rerank", post(rerank))
        .route("/rerank", post(rerank))
        .route("/v1/score", post(score))
        .route("/score", post(score))
        .route("/classify", post(classify))
        .route("/pooling", post(pooling))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/sim/state", get(state))
        .fallback(not_found)
        .with_state(shared)
}

/// An OpenAI-style error response.
pub(super) fn error(
    status: StatusCode,
    message: impl Into<String>,
    kind: &str,
    param: Option<&str>,
) -> Response {
    let body = json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": param,
            "code": status.as_u16(),
        }
    });
    (status, axum::Json(body)).into_response()
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        error(
            StatusCode::BAD_REQUEST,
            self.message,
            "invalid_request_error",
            self.param,
        )
    }
}

pub(super) async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not found", "not_found_error", None)
}

pub(super) async fn health() -> StatusCode {
    StatusCode::OK
}

pub(super) async fn models(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "sluicegate-sim",
            "root": s.cfg.model_name,
            "max_model_len": s.cfg.engine.max_model_len,
        }]
    }))
    .into_response()
}

pub(super) async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let now = s.now();
    if s.blackouts.blacked_out(now) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics blackout (simulated)\n",
        )
            .into_response();
    }
    let text = {
        let mut live = s.lock();
        live.advance(now);
        match &live.history {
            Some(h) => match h.observe(now) {
                Some((_, snap)) => render(snap, &s.labels),
                None => {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "metrics not yet available (lag)\n",
                    )
                        .into_response();
                }
            },
            None => render(&live.pool.snapshot(), &s.labels),
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub(super) async fn state(State(s): State<Arc<Shared>>) -> Response {
    let now = s.now();
    let mut live = s.lock();
    live.advance(now);
    let (r429, r503) = live.pool.rejections();
    axum::Json(json!({
        "now": now,
        "observation": live.pool.observe(),
        "rejected_429": r429,
        "rejected_503": r503,
        "aborted": live.pool.aborted(),
    }))
    .into_response()
}
