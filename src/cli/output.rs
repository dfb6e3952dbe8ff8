//! What the producer tools print: result line formats, where result
//! lines go, and their progress bars.

use std::io::Write;
use std::path::Path;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};

use crate::result::ResultRecord;

/// Output shape of result lines.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Format {
    /// Result records as the transport holds them.
    Native,
    /// OpenAI Batch API output lines.
    Openai,
}

/// Where result lines go: a file opened for appending, or standard output.
pub(super) struct Output {
    out: Box<dyn Write>,
    /// The file's name, or "standard output", for messages.
    name: String,
    /// Whether the lines go to standard output (the summary then goes to
    /// standard error so it does not mix with them).
    stdout: bool,
}

impl Output {
    /// Appends to `path`, or writes to standard output when `None`.
    pub(super) fn open(path: Option<&Path>) -> Result<Self, String> {
        match path {
            None => Ok(Self {
                out: Box::new(std::io::BufWriter::new(std::io::stdout())),
                name: "standard output".into(),
                stdout: true,
            }),
            Some(path) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(|f| Self {
                    out: Box::new(std::io::BufWriter::new(f)),
                    name: path.display().to_string(),
                    stdout: false,
                })
                .map_err(|e| format!("cannot open {}: {e}", path.display())),
        }
    }

    /// Writes one line.
    pub(super) fn line(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.out, "{line}").map_err(|e| format!("cannot write {}: {e}", self.name))
    }

    /// Makes what was written durable enough to acknowledge it.
    pub(super) fn flush(&mut self) -> Result<(), String> {
        self.out
            .flush()
            .map_err(|e| format!("cannot write {}: {e}", self.name))
    }

    /// The file's name, or "standard output".
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Whether the lines go to standard output.
    pub(super) fn is_stdout(&self) -> bool {
        self.stdout
    }

    /// Prints a summary where it does not mix with the lines.
    pub(super) fn summary(&self, text: &str) {
        if self.stdout {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }
}

/// One OpenAI Batch API output line for `record`, in the same shape as
/// `sluicegate batch` writes (`request_id`, error codes, string
/// `custom_id`: see `docs/batch.md`).
pub(super) fn openai_line(record: &ResultRecord, n: u64) -> serde_json::Value {
    crate::batch::output::openai_line(&format!("batch_req_{n}"), &record.id, record)
}

/// A progress bar over `len` items called `what` (a spinner when the
/// total is unknown).
pub(super) fn bar(len: Option<u64>, what: &str) -> ProgressBar {
    let bar = len.map_or_else(ProgressBar::new_spinner, ProgressBar::new);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{bar:40}} {{pos}}/{{len}} {what} {{per_sec}} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::ErrorCode;

    #[test]
    fn openai_lines_carry_body_or_error() {
        let ok = ResultRecord::http("a", Some("t"), 200, r#"{"x":1}"#.into(), 1);
        let line = openai_line(&ok, 1);
        assert_eq!(line["custom_id"], "a");
        assert_eq!(line["response"]["status_code"], 200);
        assert_eq!(line["response"]["body"]["x"], 1);
        assert!(line["error"].is_null());
        let err = ResultRecord::error("b", None, ErrorCode::Cancelled, "cancelled");
        let line = openai_line(&err, 2);
        assert!(line["response"].is_null());
        // OpenAI's code where one exists, the llm-d code kept beside it.
        assert_eq!(line["error"]["code"], "batch_cancelled");
        assert_eq!(line["error"]["llm_d_code"], "CANCELLED");
    }

    #[test]
    fn openai_request_id_has_the_batch_runner_format() {
        // `batch` writes `<custom_id>#<attempts>`; so does `results`, also
        // for records without a submission token (never `null`).
        let ok = ResultRecord::http("a", None, 200, "{}".into(), 2);
        let line = openai_line(&ok, 1);
        assert_eq!(line["response"]["request_id"], "a#2");
        let with_token = ResultRecord::http("b", Some("t"), 200, "{}".into(), 1);
        assert_eq!(openai_line(&with_token, 2)["response"]["request_id"], "b#1");
    }
}
