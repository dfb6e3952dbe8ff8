//! `serve.passthrough` (`docs/flex.md`, "Passthrough"): a request that is
//! neither flex nor background goes straight to the queue's gateway as
//! interactive traffic, outside the gate's window, its answer streamed
//! back as it arrives.

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::flex::Flex;
use super::http::ApiError;
use crate::endpoint::Endpoint;

impl Flex {
    /// Forwards an interactive request to the gateway as it came, its
    /// answer streamed back as it arrives (`serve.passthrough`).
    pub(super) async fn pass_through(
        &self,
        base: &str,
        endpoint: Endpoint,
        body: Bytes,
    ) -> Response {
        let url = format!("{}{}", base.trim_end_matches('/'), endpoint.as_str());
        let sent = self
            .http
            .post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await;
        match sent {
            Ok(answer) => {
                let status = StatusCode::from_u16(answer.status().as_u16())
                    .unwrap_or(StatusCode::BAD_GATEWAY);
                let kind = answer
                    .headers()
                    .get(reqwest::header::CONTENT_TYPE)
                    .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
                let mut response = Response::new(Body::from_stream(answer.bytes_stream()));
                *response.status_mut() = status;
                if let Some(kind) = kind {
                    response.headers_mut().insert(header::CONTENT_TYPE, kind);
                }
                response
            }
            Err(error) => ApiError {
                status: StatusCode::BAD_GATEWAY,
                message: format!("the gateway did not answer: {error}"),
                kind: "server_error",
                param: None,
                code: None,
            }
            .into_response(),
        }
    }
}
