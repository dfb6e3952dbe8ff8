//! Result records (docs/architecture.md, "Result records"): exactly one per submission.

use serde::{Deserialize, Serialize};

use crate::request::LastAnswer;

/// Why a request ended without an HTTP answer. A closed set: result
/// readers switch on these strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The deadline passed before the request could be sent or completed.
    DeadlineExceeded,
    /// The submitter cancelled the request.
    Cancelled,
    /// An admission gate dropped the request.
    GateDropped,
    /// A gate failed in a way that ends the request.
    GateError,
    /// The gateway could not be reached or did not answer usefully.
    InferenceError,
    /// The message could not be parsed or is not a valid request.
    InvalidRequest,
    /// The request payload could not be fetched.
    PayloadUnavailable,
}

impl ErrorCode {
    /// The wire name, also used as a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::Cancelled => "CANCELLED",
            Self::GateDropped => "GATE_DROPPED",
            Self::GateError => "GATE_ERROR",
            Self::InferenceError => "INFERENCE_ERROR",
            Self::InvalidRequest => "INVALID_REQUEST",
            Self::PayloadUnavailable => "PAYLOAD_UNAVAILABLE",
        }
    }
}

/// The result of one submission, in the upstream wire shape plus
/// sluicegate's additive fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecord {
    /// The request id.
    pub id: String,
    /// HTTP status of the gateway's answer; absent when there was none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// The gateway's body as a string, or `{"error": "<message>"}`.
    pub payload: String,
    /// Typed error when there was no HTTP answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<ErrorCode>,
    /// Human-readable error when there was no HTTP answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// The submission token this result answers (fences duplicates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_token: Option<String>,
    /// How many times the request was sent to the gateway (additive field).
    #[serde(default)]
    pub attempts: u32,
    /// The last attempt ended because its timeout passed, with no answer
    /// (additive field, written only when true; OpenAI output reports it
    /// as `request_timeout`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
}

impl ResultRecord {
    /// A result carrying the gateway's HTTP answer.
    pub fn http(id: &str, token: Option<&str>, status: u16, body: String, attempts: u32) -> Self {
        Self {
            id: id.to_owned(),
            status_code: Some(status),
            payload: body,
            error_code: None,
            error_message: None,
            request_token: token.map(str::to_owned),
            attempts,
            timed_out: false,
        }
    }

    /// A typed error result; `payload` is `{"error": message}` for readers
    /// that only look at the payload.
    pub fn error(id: &str, token: Option<&str>, code: ErrorCode, message: &str) -> Self {
        let payload = serde_json::json!({ "error": message }).to_string();
        Self {
            id: id.to_owned(),
            status_code: None,
            payload,
            error_code: Some(code),
            error_message: Some(message.to_owned()),
            request_token: token.map(str::to_owned),
            attempts: 0,
            timed_out: false,
        }
    }

    /// The result of a message its deadline ended: the last HTTP answer an
    /// attempt got (docs/architecture.md, "Result records"), else `DEADLINE_EXCEEDED`.
    pub fn ended_by_deadline(
        id: &str,
        token: Option<&str>,
        last_answer: Option<&LastAnswer>,
        attempts: u32,
    ) -> Self {
        match last_answer {
            Some(answer) => {
                Self::http(id, token, answer.status_code, answer.body.clone(), attempts)
            }
            None => Self::error(id, token, ErrorCode::DeadlineExceeded, "deadline exceeded")
                .with_attempts(attempts),
        }
    }

    /// The result written with a dead letter: `INFERENCE_ERROR` saying the
    /// attempts ran out, keeping the last answer (`status_code` and its
    /// body as `payload`) or the last error, so a reader waiting for every
    /// result is not left waiting.
    pub fn dead_lettered(last: &Self) -> Self {
        let mut result = last.clone();
        let what = match (last.status_code, &last.error_message) {
            (Some(status), _) => format!("last answer HTTP {status}"),
            (None, Some(message)) => format!("last error: {message}"),
            (None, None) => "no answer".to_owned(),
        };
        let message = format!(
            "attempts exhausted after {} attempts; {what}",
            last.attempts
        );
        if last.status_code.is_none() {
            result.payload = serde_json::json!({ "error": message }).to_string();
        }
        result.error_code = Some(ErrorCode::InferenceError);
        result.error_message = Some(message);
        result
    }

    /// Marks the last attempt as timed out.
    #[must_use]
    pub fn timed_out(mut self) -> Self {
        self.timed_out = true;
        self
    }

    /// Sets the attempt count.
    pub fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    /// The outcome label used in metrics: `success`, `http_4xx`, `http_5xx`
    /// or the lowercase error code.
    pub fn outcome_label(&self) -> &'static str {
        match (self.status_code, self.error_code) {
            (Some(s), _) if (200..300).contains(&s) => "success",
            (Some(s), _) if (400..500).contains(&s) => "http_4xx",
            (Some(_), _) => "http_other",
            (None, Some(code)) => match code {
                ErrorCode::DeadlineExceeded => "deadline_exceeded",
                ErrorCode::Cancelled => "cancelled",
                ErrorCode::GateDropped => "gate_dropped",
                ErrorCode::GateError => "gate_error",
                ErrorCode::InferenceError => "inference_error",
                ErrorCode::InvalidRequest => "invalid_request",
                ErrorCode::PayloadUnavailable => "payload_unavailable",
            },
            (None, None) => "unknown",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_result_matches_upstream_shape() {
        let r = ResultRecord::error(
            "a",
            Some("t"),
            ErrorCode::DeadlineExceeded,
            "deadline exceeded",
        );
        let v: serde_json::Value = serde_json::to_value(&r).expect("serialises");
        assert_eq!(v["id"], "a");
        assert_eq!(v["error_code"], "DEADLINE_EXCEEDED");
        assert_eq!(v["payload"], r#"{"error":"deadline exceeded"}"#);
        assert!(v.get("status_code").is_none());
    }

    #[test]
    fn deadline_result_is_the_last_answer_when_there_was_one() {
        let answer = LastAnswer {
            status_code: 429,
            body: "busy".into(),
        };
        let r = ResultRecord::ended_by_deadline("a", Some("t"), Some(&answer), 4);
        assert_eq!(
            (r.status_code, r.payload.as_str(), r.attempts),
            (Some(429), "busy", 4)
        );
        assert_eq!(r.error_code, None);
        let r = ResultRecord::ended_by_deadline("a", None, None, 0);
        assert_eq!(r.error_code, Some(ErrorCode::DeadlineExceeded));
    }

    #[test]
    fn dead_letter_result_keeps_the_last_answer_or_error() {
        let http =
            ResultRecord::dead_lettered(&ResultRecord::http("a", None, 500, "boom".into(), 3));
        assert_eq!(
            (http.status_code, http.payload.as_str()),
            (Some(500), "boom")
        );
        assert_eq!(http.error_code, Some(ErrorCode::InferenceError));
        assert!(
            http.error_message
                .as_deref()
                .is_some_and(|m| m.contains("3 attempts"))
        );
        let error = ResultRecord::dead_lettered(
            &ResultRecord::error("a", None, ErrorCode::InferenceError, "reset").with_attempts(2),
        );
        assert_eq!(error.status_code, None);
        assert!(error.payload.contains("reset"), "{}", error.payload);
    }

    #[test]
    fn http_result_keeps_body_as_string() {
        let r = ResultRecord::http("a", None, 200, "{\"ok\":1}".into(), 1);
        let v: serde_json::Value = serde_json::to_value(&r).expect("serialises");
        assert_eq!(v["status_code"], 200);
        assert_eq!(v["payload"], "{\"ok\":1}");
        assert!(v.get("error_code").is_none());
    }
}
