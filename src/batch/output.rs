//! Batch output lines in the OpenAI Batch API output shape: `id`,
//! `custom_id`, `response {status_code, request_id, body}`, `error`.

use std::io::Write;
use std::path::Path;

use serde_json::{Value, json};

use super::input::InvalidLine;
use crate::result::{ErrorCode, ResultRecord};

/// The OpenAI batch `error.code` for a result's error: OpenAI's own code
/// where one means the same (`batch_expired` for a deadline that passed,
/// `batch_cancelled` for a cancelled request, `request_timeout` for an
/// `INFERENCE_ERROR` whose last attempt timed out), else the llm-d code
/// itself. The llm-d code always travels in `error.llm_d_code` too.
pub const fn openai_error_code(code: ErrorCode, timed_out: bool) -> &'static str {
    match code {
        ErrorCode::DeadlineExceeded => "batch_expired",
        ErrorCode::Cancelled => "batch_cancelled",
        ErrorCode::InferenceError if timed_out => "request_timeout",
        ErrorCode::GateDropped
        | ErrorCode::GateError
        | ErrorCode::InferenceError
        | ErrorCode::InvalidRequest
        | ErrorCode::PayloadUnavailable => code.as_str(),
    }
}

/// The `response.request_id` of a result: `<id>#<attempts>`, the same in
/// `batch` output and `results --format openai`. Always a string (vLLM's
/// typed reader rejects `null`), and distinct per id and attempt count.
pub fn request_id(result: &ResultRecord) -> String {
    format!("{}#{}", result.id, result.attempts)
}

/// The `custom_id` given to an input line without a usable one (not JSON,
/// or no string `custom_id`): `invalid-line-<line>`. Output lines always
/// carry a string `custom_id`, because vLLM's typed reader rejects `null`.
pub fn line_custom_id(line: usize) -> String {
    format!("invalid-line-{line}")
}

/// One OpenAI Batch API output line: `id`, `custom_id`, then either
/// `response {status_code, request_id, body}` (the gateway answered, 4xx
/// and 5xx included) or `error {code, message, llm_d_code}`. Shared by
/// `batch` and `results --format openai`.
pub fn openai_line(id: &str, custom_id: &str, result: &ResultRecord) -> Value {
    match result.status_code {
        Some(status) => {
            // The gateway's body is JSON in practice; keep it as a string
            // when it is not.
            let body = serde_json::from_str::<Value>(&result.payload)
                .unwrap_or_else(|_| Value::String(result.payload.clone()));
            json!({
                "id": id,
                "custom_id": custom_id,
                "response": {
                    "status_code": status,
                    "request_id": request_id(result),
                    "body": body,
                },
                "error": null,
            })
        }
        None => {
            let llm_d = result.error_code.map_or("UNKNOWN", ErrorCode::as_str);
            json!({
                "id": id,
                "custom_id": custom_id,
                "response": null,
                "error": {
                    "code": result
                        .error_code
                        .map_or("UNKNOWN", |c| openai_error_code(c, result.timed_out)),
                    "message": result.error_message.clone().unwrap_or_default(),
                    "llm_d_code": llm_d,
                },
            })
        }
    }
}

/// The output line for a result (an HTTP answer, or an error without one).
pub fn result_line(line: usize, custom_id: &str, result: &ResultRecord) -> Value {
    openai_line(&format!("batch_req_{line}"), custom_id, result)
}

/// The output line for an input line that could not be sent. A line
/// without a usable `custom_id` gets [`line_custom_id`], and its message
/// says so.
pub fn invalid_line(invalid: &InvalidLine) -> Value {
    let (custom_id, message) = match &invalid.custom_id {
        Some(id) => (id.clone(), invalid.message.clone()),
        None => {
            let id = line_custom_id(invalid.line);
            let message = format!(
                "{} (custom_id `{id}` stands for input line {}, which has none)",
                invalid.message, invalid.line
            );
            (id, message)
        }
    };
    json!({
        "id": format!("batch_req_{}", invalid.line),
        "custom_id": custom_id,
        "response": null,
        "error": {
            "code": "INVALID_REQUEST",
            "message": message,
            "line": invalid.line,
            "llm_d_code": "INVALID_REQUEST",
        },
    })
}

/// Writes `lines` to `path` atomically (a temporary file renamed over it),
/// so a crash never leaves a half-written output behind.
pub fn write_lines(path: &Path, lines: &[Value]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let file = std::fs::File::create(&tmp)?;
        let mut w = std::io::BufWriter::new(file);
        for line in lines {
            serde_json::to_writer(&mut w, line)?;
            w.write_all(b"\n")?;
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::ErrorCode;

    #[test]
    fn http_result_has_openai_response_shape() {
        let r = ResultRecord::http("a", None, 200, r#"{"usage":{"total_tokens":3}}"#.into(), 1);
        let v = result_line(7, "a", &r);
        assert_eq!(v["custom_id"], "a");
        assert_eq!(v["id"], "batch_req_7");
        assert_eq!(v["response"]["status_code"], 200);
        assert_eq!(v["response"]["body"]["usage"]["total_tokens"], 3);
        assert!(v["error"].is_null());
    }

    #[test]
    fn error_result_has_error_and_no_response() {
        let r = ResultRecord::error("a", None, ErrorCode::DeadlineExceeded, "late");
        let v = result_line(1, "a", &r);
        assert!(v["response"].is_null());
        // The OpenAI code, with the llm-d code kept beside it.
        assert_eq!(v["error"]["code"], "batch_expired");
        assert_eq!(v["error"]["llm_d_code"], "DEADLINE_EXCEEDED");
        assert_eq!(v["error"]["message"], "late");
    }

    #[test]
    fn a_timed_out_last_attempt_is_a_request_timeout() {
        let r = ResultRecord::error(
            "t",
            None,
            ErrorCode::InferenceError,
            "gateway attempt timed out",
        )
        .timed_out();
        let v = result_line(4, "t", &r);
        assert_eq!(v["error"]["code"], "request_timeout");
        assert_eq!(v["error"]["llm_d_code"], "INFERENCE_ERROR");
        let other = ResultRecord::error("o", None, ErrorCode::InferenceError, "reset");
        assert_eq!(
            result_line(5, "o", &other)["error"]["code"],
            "INFERENCE_ERROR"
        );
        // The additive field is written only when true.
        assert!(
            serde_json::to_string(&r)
                .unwrap_or_default()
                .contains("\"timed_out\":true")
        );
        assert!(
            !serde_json::to_string(&other)
                .unwrap_or_default()
                .contains("timed_out")
        );
    }

    #[test]
    fn error_codes_map_to_openai_where_one_exists() {
        let cancelled = ResultRecord::error("c", None, ErrorCode::Cancelled, "cancelled");
        let v = result_line(2, "c", &cancelled);
        assert_eq!(v["error"]["code"], "batch_cancelled");
        assert_eq!(v["error"]["llm_d_code"], "CANCELLED");
        // No OpenAI equivalent: the llm-d code stays the code.
        let gate = ResultRecord::error("g", None, ErrorCode::GateDropped, "dropped");
        let v = result_line(3, "g", &gate);
        assert_eq!(v["error"]["code"], "GATE_DROPPED");
        assert_eq!(v["error"]["llm_d_code"], "GATE_DROPPED");
    }

    #[test]
    fn request_id_is_a_string_of_id_and_attempts() {
        let r = ResultRecord::http("a", None, 200, "{}".into(), 3);
        let v = result_line(1, "a", &r);
        assert_eq!(v["response"]["request_id"], "a#3");
    }

    #[test]
    fn unparsable_line_gets_a_string_custom_id_named_after_its_line() {
        let bad = InvalidLine {
            line: 9,
            custom_id: None,
            message: "line 9: not JSON".into(),
        };
        let v = invalid_line(&bad);
        assert_eq!(v["custom_id"], "invalid-line-9");
        assert_eq!(v["error"]["code"], "INVALID_REQUEST");
        let message = v["error"]["message"].as_str().expect("message");
        assert!(message.contains("invalid-line-9") && message.contains("line 9"));
        // A line with a readable id keeps it.
        let dup = InvalidLine {
            line: 4,
            custom_id: Some("x".into()),
            message: "line 4: duplicate custom_id".into(),
        };
        assert_eq!(invalid_line(&dup)["custom_id"], "x");
    }
}
