//! Background responses (`background: true`, `docs/flex.md`): the stored
//! record, its lifecycle and the OpenAI Response object it is served as.
//! Pure: the handlers (`responses.rs`) and the collector read and write
//! records through the store.
//!
//! Lifecycle: `queued` (stored, its queue message enqueued) →
//! `in_progress` (a dispatcher leased it: it passed the gate) → one of
//! `completed`, `failed`, `cancelled`, `incomplete`. The first result
//! ends it; a later copy of a result (at-least-once delivery) finds it
//! terminal and changes nothing, so each response is answered once.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::result::{ErrorCode, ResultRecord};

/// Where a background response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    /// Stored and enqueued, not taken by a dispatcher yet.
    Queued,
    /// Leased by a dispatcher: past the gate.
    InProgress,
    /// The gateway answered 2xx.
    Completed,
    /// The gateway answered an error, or no answer came.
    Failed,
    /// The tenant cancelled it.
    Cancelled,
    /// The engine stopped it short (`status: incomplete` upstream).
    Incomplete,
}

impl ResponseStatus {
    /// Every status, for the metrics.
    pub const ALL: [Self; 6] = [
        Self::Queued,
        Self::InProgress,
        Self::Completed,
        Self::Failed,
        Self::Cancelled,
        Self::Incomplete,
    ];

    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Incomplete => "incomplete",
        }
    }

    /// Whether nothing changes it any more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Queued | Self::InProgress)
    }
}

/// A stored background response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseRecord {
    /// `resp_…`: also its queue message id.
    pub id: String,
    /// The owning tenant.
    pub tenant: String,
    /// `/v1/responses`, or `/v1/chat/completions` (our extension).
    pub endpoint: String,
    /// The request's `model`, when it named one.
    pub model: Option<String>,
    /// Lifecycle state.
    pub status: ResponseStatus,
    /// Whether it was asked with `service_tier: "flex"`.
    pub flex: bool,
    /// Unix seconds.
    pub created_at: i64,
    /// The request body as enqueued, kept until its message is enqueued
    /// (a server killed in between enqueues it on restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<Value>,
    /// Whether its queue message is enqueued.
    pub enqueued: bool,
    /// The gateway's answer body, once completed (or its error body).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// OpenAI's `error` object, once failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// When it became terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<i64>,
    /// When the retention sweep removes it (terminal ones only; `None`
    /// keeps it until deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
}

impl ResponseRecord {
    /// The record `result` ends this response with, at `now`, kept for
    /// `keep_secs` (0: until deleted); `None` when it is already terminal
    /// (the first result won).
    pub fn finish(&self, result: &ResultRecord, now: i64, keep_secs: i64) -> Option<Self> {
        if self.status.is_terminal() {
            return None;
        }
        let mut next = self.clone();
        let body = serde_json::from_str::<Value>(&result.payload)
            .unwrap_or_else(|_| Value::String(result.payload.clone()));
        match (result.status_code, result.error_code) {
            (Some(s), _) if (200..300).contains(&s) => {
                let upstream = body.get("status").and_then(Value::as_str);
                next.status = match upstream {
                    Some("incomplete") => ResponseStatus::Incomplete,
                    Some("failed") => ResponseStatus::Failed,
                    _ => ResponseStatus::Completed,
                };
                next.output = Some(body);
            }
            (_, Some(ErrorCode::Cancelled)) => next.status = ResponseStatus::Cancelled,
            (status, code) => {
                next.status = ResponseStatus::Failed;
                let message = (body.pointer("/error/message").and_then(Value::as_str))
                    .map(str::to_owned)
                    .or_else(|| result.error_message.clone())
                    .unwrap_or_else(|| result.payload.clone());
                let code = match (status, code) {
                    (Some(429), _) => "rate_limit_exceeded".to_owned(),
                    (Some(s), _) if s < 500 => "invalid_request".to_owned(),
                    (_, Some(ErrorCode::DeadlineExceeded)) => "timeout".to_owned(),
                    _ => "server_error".to_owned(),
                };
                next.error = Some(json!({"code": code, "message": message}));
            }
        }
        next.request = None;
        next.finished_at = Some(now);
        next.expires_at = (keep_secs > 0).then(|| now.saturating_add(keep_secs));
        Some(next)
    }

    /// The record cancelled at `now` (see [`Self::finish`] for `keep_secs`);
    /// `None` when it already ended.
    pub fn cancel(&self, now: i64, keep_secs: i64) -> Option<Self> {
        if self.status.is_terminal() {
            return None;
        }
        let mut next = self.clone();
        next.status = ResponseStatus::Cancelled;
        next.request = None;
        next.finished_at = Some(now);
        next.expires_at = (keep_secs > 0).then(|| now.saturating_add(keep_secs));
        Some(next)
    }

    /// The OpenAI Response object. A `/v1/responses` answer is the
    /// engine's own Response object with our id, status and tier on it;
    /// a chat completion (our extension) is carried whole under
    /// `chat_completion`, with its text also in `output_text`.
    pub fn api(&self) -> Value {
        let tier = if self.flex { "flex" } else { "default" };
        let mut object = match &self.output {
            Some(Value::Object(o))
                if o.get("object").and_then(Value::as_str) == Some("response") =>
            {
                Value::Object(o.clone())
            }
            _ => json!({"output": []}),
        };
        if let (Some(Value::Object(body)), false) = (&self.output, self.endpoint == "/v1/responses")
        {
            let text = body
                .get("choices")
                .and_then(|c| c.get(0))
                .and_then(|c| c.pointer("/message/content").or_else(|| c.get("text")))
                .cloned();
            object["chat_completion"] = Value::Object(body.clone());
            if let Some(text) = text {
                object["output_text"] = text;
            }
            object["usage"] = body.get("usage").cloned().unwrap_or(Value::Null);
        }
        let fields = [
            ("id", json!(self.id)),
            ("object", json!("response")),
            ("created_at", json!(self.created_at)),
            ("status", json!(self.status.as_str())),
            ("background", json!(true)),
            ("service_tier", json!(tier)),
            ("error", self.error.clone().unwrap_or(Value::Null)),
        ];
        for (key, value) in fields {
            object[key] = value;
        }
        if object.get("model").is_none_or(Value::is_null) {
            object["model"] = json!(self.model);
        }
        for key in ["incomplete_details", "usage"] {
            if object.get(key).is_none() {
                object[key] = Value::Null;
            }
        }
        object
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ResponseRecord {
        ResponseRecord {
            id: "resp_1".into(),
            tenant: "t".into(),
            endpoint: "/v1/responses".into(),
            model: Some("m".into()),
            status: ResponseStatus::Queued,
            flex: false,
            created_at: 100,
            request: Some(json!({"model": "m", "input": "hi"})),
            enqueued: true,
            output: None,
            error: None,
            finished_at: None,
            expires_at: None,
        }
    }

    #[test]
    fn the_first_result_ends_a_response_and_a_copy_changes_nothing() {
        let body = json!({"object": "response", "id": "up", "status": "completed", "output": [{"type": "message"}]});
        let ok = ResultRecord::http("resp_1", None, 200, body.to_string(), 1);
        let done = record().finish(&ok, 200, 60).expect("ends it");
        assert_eq!(done.status, ResponseStatus::Completed);
        assert_eq!((done.finished_at, done.expires_at), (Some(200), Some(260)));
        assert_eq!(done.request, None, "the request is not kept once answered");
        assert_eq!(done.finish(&ok, 300, 60), None, "answered once");
        let api = done.api();
        assert_eq!(api["id"], "resp_1", "our id, not the engine's");
        assert_eq!(api["status"], "completed");
        assert_eq!(api["output"][0]["type"], "message");
        assert_eq!(api["background"], true);
    }

    #[test]
    fn errors_and_cancels_end_it_in_their_status() {
        let bad = ResultRecord::http(
            "resp_1",
            None,
            500,
            r#"{"error":{"message":"boom"}}"#.into(),
            1,
        );
        let failed = record().finish(&bad, 1, 0).expect("ends it");
        assert_eq!(failed.status, ResponseStatus::Failed);
        assert_eq!(
            failed.error.as_ref().map(|e| e["message"].clone()),
            Some(json!("boom"))
        );
        assert_eq!(failed.expires_at, None, "0 keeps it until deleted");
        let cancelled = ResultRecord::error("resp_1", None, ErrorCode::Cancelled, "x");
        assert_eq!(
            record().finish(&cancelled, 1, 0).map(|r| r.status),
            Some(ResponseStatus::Cancelled)
        );
        let mut done = record().cancel(5, 0).expect("cancels");
        assert_eq!(done.status, ResponseStatus::Cancelled);
        assert_eq!(done.cancel(6, 0), None);
        done.status = ResponseStatus::Completed;
        assert_eq!(done.finish(&cancelled, 7, 0), None);
    }

    #[test]
    fn a_chat_completion_is_carried_under_its_own_key() {
        let mut r = record();
        r.endpoint = "/v1/chat/completions".into();
        r.flex = true;
        let body = json!({"object": "chat.completion", "choices": [{"message": {"content": "hello"}}], "usage": {"total_tokens": 3}});
        let ok = ResultRecord::http("resp_1", None, 200, body.to_string(), 1);
        let api = r.finish(&ok, 1, 0).expect("ends").api();
        assert_eq!(api["object"], "response");
        assert_eq!(api["chat_completion"]["object"], "chat.completion");
        assert_eq!(api["output_text"], "hello");
        assert_eq!(api["service_tier"], "flex");
        assert_eq!(api["usage"]["total_tokens"], 3);
    }
}
