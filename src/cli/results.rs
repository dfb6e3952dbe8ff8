//! `sluicegate results`: pops results from a Redis list (oldest first, as
//! upstream readers do), or reads an embedded queue's results
//! (`--embedded PATH`), into a JSON-lines file or standard output.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::path::Path;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use super::submit::RedisArgs;
use crate::queue::Queue as _;
use crate::redis::blocking_connection;
use crate::result::ResultRecord;

/// Output shape.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Format {
    /// Result records as written to the list.
    Native,
    /// OpenAI Batch API output lines.
    Openai,
}

#[derive(Debug, Args)]
pub(crate) struct ResultsArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Redis: result list to read (popped: each result is read once).
    #[arg(long, default_value = "result-list")]
    list: String,
    #[command(flatten)]
    pubsub: super::pubsub::PubSubArgs,
    /// Read this Pub/Sub subscription (on the result topic) instead of
    /// Redis; results are acknowledged once written, and a result whose
    /// `(id, request_token)` was already written in this run is skipped.
    #[arg(long, conflicts_with = "embedded")]
    pubsub_subscription: Option<String>,
    /// Read this embedded store file instead of Redis (it must exist);
    /// its results stay in the store, so reading twice gives them twice.
    #[arg(long, conflicts_with_all = ["expect", "timeout"])]
    embedded: Option<PathBuf>,
    /// Read the results of this PostgreSQL database (the `sql`
    /// transport's `[sql] url`) instead of Redis; they stay in the table.
    #[arg(long, env = "SLUICEGATE_SQL_URL", conflicts_with_all = ["embedded", "expect", "timeout"])]
    sql_url: Option<String>,
    /// With `--sql-url`: the result route (`[sql] result_queue_name`, or
    /// the queue's `result_queue_name`).
    #[arg(long, default_value = crate::queue::sql::DEFAULT_RESULT_ROUTE)]
    route: String,
    /// With `--sql-url`: only results after this position (the last one
    /// a previous read printed).
    #[arg(long, default_value_t = 0)]
    after: i64,
    /// With `--embedded`: the queue in the store (the same default as
    /// `submit --embedded` and `config/embedded.toml`).
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
    queue: String,
    /// File to append results to (JSON lines); standard output when absent
    /// (the summary then goes to standard error). `--out` is the old
    /// spelling, still accepted.
    #[arg(long, alias = "out")]
    output: Option<PathBuf>,
    /// Redis: wait until this many results were collected; without it,
    /// collect what is there and stop.
    #[arg(long)]
    expect: Option<u64>,
    /// Redis: give up waiting after this long (e.g. `10m`); default: wait
    /// forever.
    #[arg(long)]
    timeout: Option<String>,
    /// Output shape.
    #[arg(long, value_enum, default_value = "native")]
    format: Format,
}

/// Where result lines go: a file opened for appending, or standard output.
pub(super) struct Sink {
    out: Box<dyn Write>,
    /// The file's name, or "standard output", for messages.
    name: String,
    /// Whether the lines go to standard output (the summary then goes to
    /// standard error so it does not mix with them).
    stdout: bool,
}

impl Sink {
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

    pub(super) fn line(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.out, "{line}").map_err(|e| format!("cannot write {}: {e}", self.name))
    }

    pub(super) fn flush(&mut self) -> Result<(), String> {
        self.out
            .flush()
            .map_err(|e| format!("cannot write {}: {e}", self.name))
    }

    /// The file's name, or "standard output".
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn summary(&self, text: &str) {
        if self.stdout {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    }
}

/// Prints the results of `queue` in the embedded store at `store` to
/// `output` (standard output when `None`) in `format`. The store must
/// exist (reading never creates one); a queue with no results says on
/// standard error why.
pub(super) fn embedded_results(
    store: &Path,
    queue: &str,
    format: Format,
    output: Option<&Path>,
) -> ExitCode {
    let queue = match crate::queue::embedded::EmbeddedQueue::open_existing(store, queue) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let results = match queue.results() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if results.is_empty() {
        super::embedded::explain_empty(&queue);
    }
    let mut sink = match Sink::open(output) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut errors = 0u64;
    for (n, record) in results.iter().enumerate() {
        if record.status_code.is_none_or(|s| !(200..300).contains(&s)) {
            errors += 1;
        }
        let line = match format {
            // A result is plain strings and numbers: serialising cannot fail.
            Format::Native => serde_json::to_string(record).unwrap_or_default(),
            Format::Openai => openai_line(record, n as u64 + 1).to_string(),
        };
        if let Err(e) = sink.line(&line) {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    if let Err(e) = sink.flush() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    // Standard output carries only result lines, as `results-embedded`
    // always printed; a file gets the summary like the Redis path.
    if !sink.stdout {
        sink.summary(&format!(
            "collected {} results from `{}` in {} into {} ({errors} not 2xx)",
            results.len(),
            queue.name(),
            store.display(),
            sink.name
        ));
    }
    ExitCode::SUCCESS
}

/// One OpenAI Batch API output line for `record`, in the same shape as
/// `sluicegate batch` writes (`request_id`, error codes, string
/// `custom_id`: see `docs/batch.md`).
pub(super) fn openai_line(record: &ResultRecord, n: u64) -> serde_json::Value {
    crate::batch::output::openai_line(&format!("batch_req_{n}"), &record.id, record)
}

pub(super) async fn run(args: ResultsArgs) -> ExitCode {
    if let Some(store) = &args.embedded {
        return embedded_results(store, &args.queue, args.format, args.output.as_deref());
    }
    if let Some(url) = &args.sql_url {
        let output = args.output.as_deref();
        return super::sql::results(url, &args.route, args.after, args.format, output).await;
    }
    let timeout = match args.timeout.as_deref().map(crate::config::parse_duration) {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            eprintln!("--timeout: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(subscription) = &args.pubsub_subscription {
        let out = match Sink::open(args.output.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let read = super::pubsub::ResultsRead {
            subscription,
            expect: args.expect,
            timeout,
            format: args.format,
        };
        return super::pubsub::results(&args.pubsub, read, out).await;
    }
    let redis_config = match args.redis.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut conn = match blocking_connection(&redis_config).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = match Sink::open(args.output.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let bar = match args.expect {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} results {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let (mut got, mut errors, mut unparsable) = (0u64, 0u64, 0u64);
    loop {
        if args.expect.is_some_and(|n| got >= n) {
            break;
        }
        if timeout.is_some_and(|t| started.elapsed() >= t) {
            break;
        }
        let popped: redis::RedisResult<Option<(String, String)>> = if args.expect.is_some() {
            redis::cmd("BRPOP")
                .arg(&args.list)
                .arg(1)
                .query_async(&mut conn)
                .await
        } else {
            redis::cmd("RPOP")
                .arg(&args.list)
                .query_async::<Option<String>>(&mut conn)
                .await
                .map(|v| v.map(|s| (args.list.clone(), s)))
        };
        let text = match popped {
            Ok(Some((_, text))) => text,
            Ok(None) if args.expect.is_some() => continue,
            Ok(None) => break,
            Err(error) => {
                bar.suspend(|| eprintln!("redis: {error}; retrying"));
                tokio::time::sleep(Duration::from_millis(500)).await;
                if let Ok(c) = blocking_connection(&redis_config).await {
                    conn = c;
                }
                continue;
            }
        };
        got += 1;
        let line = match serde_json::from_str::<ResultRecord>(&text) {
            Ok(record) => {
                if record.status_code.is_none_or(|s| !(200..300).contains(&s)) {
                    errors += 1;
                }
                match args.format {
                    Format::Native => text,
                    Format::Openai => openai_line(&record, got).to_string(),
                }
            }
            Err(_) => {
                unparsable += 1;
                text
            }
        };
        if let Err(e) = out.line(&line) {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Err(e) = out.flush() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    out.summary(&format!(
        "collected {got} results from `{}` into {} ({errors} not 2xx, {unparsable} unparsable) in {:.1}s",
        args.list,
        out.name,
        started.elapsed().as_secs_f64()
    ));
    match args.expect {
        Some(n) if got < n => {
            eprintln!("expected {n} results, got {got}");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
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
