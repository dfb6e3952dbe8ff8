//! Batch output lines in the OpenAI Batch API output shape: `id`,
//! `custom_id`, `response {status_code, request_id, body}`, `error`.

use std::io::Write;
use std::path::Path;

use serde_json::{Value, json};

use super::input::InvalidLine;
use crate::result::ResultRecord;

/// The output line for a result (an HTTP answer, or an error without one).
pub fn result_line(line: usize, custom_id: &str, result: &ResultRecord) -> Value {
    let id = format!("batch_req_{line}");
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
                    "request_id": format!("{custom_id}#{}", result.attempts),
                    "body": body,
                },
                "error": null,
            })
        }
        None => json!({
            "id": id,
            "custom_id": custom_id,
            "response": null,
            "error": {
                "code": result.error_code.map_or("UNKNOWN", |c| c.as_str()),
                "message": result.error_message.clone().unwrap_or_default(),
            },
        }),
    }
}

/// The output line for an input line that could not be sent.
pub fn invalid_line(invalid: &InvalidLine) -> Value {
    json!({
        "id": format!("batch_req_{}", invalid.line),
        "custom_id": invalid.custom_id,
        "response": null,
        "error": {
            "code": "INVALID_REQUEST",
            "message": invalid.message,
            "line": invalid.line,
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
        assert_eq!(v["error"]["code"], "DEADLINE_EXCEEDED");
        assert_eq!(v["error"]["message"], "late");
    }
}
