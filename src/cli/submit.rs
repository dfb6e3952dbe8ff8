//! `sluicegate submit`: enqueues request lines into a queue through its
//! client ([`crate::queue::Client`]): a Redis queue as an upstream
//! producer would (envelope, score, `request-active:<id>`), an embedded
//! store (`--embedded PATH`), a PostgreSQL database (`--sql-url`) or a
//! Pub/Sub topic (`--pubsub-topic`). One flow for all: every line is
//! checked before anything is sent, ids still active from an earlier
//! submission are warned about, then the lines go in chunks.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::args::{PubSubArgs, RedisArgs, store_target};
use super::output::bar;
use crate::batch::input::{DuplicateIds, ParsedInput, parse_input_with};
use crate::config::parse_duration;
use crate::queue::{Client, ClientError, ClientTarget, Outgoing, SubmissionRecord, Submitted};

/// Lines sent per enqueue.
const CHUNK: usize = 1000;

/// Exit code of a submit whose idempotency key records another
/// submission.
pub(crate) const EXIT_IDEMPOTENCY_CONFLICT: u8 = 3;

#[derive(Debug, Args)]
pub(crate) struct SubmitArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Queue (Redis: pending sorted set) to submit to; the same default as
    /// the config's `queue_name`, for Redis and `--embedded` alike.
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
    queue: String,
    /// Deadline for lines without one, from now (e.g. `24h`, `90m`).
    #[arg(long, default_value = "24h")]
    deadline: String,
    /// Result list to ask for (envelope `result_queue_name`).
    #[arg(long)]
    result_list: Option<String>,
    /// Submit into this embedded store file (the worker's `embedded.path`)
    /// instead of Redis.
    #[arg(long, conflicts_with = "result_list")]
    embedded: Option<PathBuf>,
    /// Submit into this PostgreSQL database (the `sql` transport's
    /// `[sql] url`) instead of Redis.
    #[arg(long, env = "SLUICEGATE_SQL_URL", conflicts_with_all = ["embedded", "result_list"])]
    sql_url: Option<String>,
    #[command(flatten)]
    pubsub: PubSubArgs,
    /// Publish to this Pub/Sub topic instead of Redis (each line as the
    /// plain request JSON).
    #[arg(long, conflicts_with_all = ["embedded", "result_list"])]
    pubsub_topic: Option<String>,
    /// The dispatcher's `[gateway] fairness_attribute` (Redis, `--sql-url`):
    /// each message is also filed in its tenant's lane (its metadata value
    /// of this attribute), so the dispatcher sees every tenant's work
    /// however deep the queue is without filing it itself. The default is
    /// the dispatcher's default; an empty value files no lane (on Redis
    /// for a dispatcher without an attribute, whose claims would never
    /// empty them; on `sql` the dispatcher's claims then file the rows).
    #[arg(
        long,
        env = "SLUICEGATE_FAIRNESS_ATTRIBUTE",
        default_value = crate::config::DEFAULT_FAIRNESS_ATTRIBUTE
    )]
    fairness_attribute: String,
    /// Submit lines whose id an earlier line of the file already has
    /// (without it such a file is refused and nothing is submitted).
    #[arg(long)]
    allow_duplicates: bool,
    /// Record the submission under this key (Redis, `--embedded`,
    /// `--sql-url`): the whole file is enqueued at once with the record,
    /// a repeat of the same file enqueues nothing and exits 0, another
    /// file under the key exits 3 (`status --idempotency-key` shows it).
    #[arg(
        long,
        env = "SLUICEGATE_IDEMPOTENCY_KEY",
        conflicts_with = "pubsub_topic"
    )]
    idempotency_key: Option<String>,
    /// How long the key's record outlives the file's last deadline: at
    /// least as long as its results are kept (a lookup after it finds
    /// nothing).
    #[arg(long, default_value = "7d")]
    idempotency_keep: String,
    /// Request lines: sluicegate/upstream request JSON, envelopes, or
    /// OpenAI Batch API lines (`custom_id`, `method`, `url`, `body`).
    file: PathBuf,
}

impl SubmitArgs {
    /// The queue the flags name: Redis unless `--embedded`, `--sql-url`
    /// or `--pubsub-topic` says otherwise.
    fn target(&self) -> Result<ClientTarget, String> {
        let route = crate::queue::sql::DEFAULT_RESULT_ROUTE;
        let (embedded, sql) = (self.embedded.as_ref(), self.sql_url.as_deref());
        // Empty: no lanes, as `[gateway] fairness_attribute = ""`.
        let lanes = Some(self.fairness_attribute.clone()).filter(|a| !a.is_empty());
        if let Some(store) = store_target(embedded, sql, &self.queue, route, true) {
            return store.map(|target| target.in_lanes(lanes));
        }
        if let Some(topic) = &self.pubsub_topic {
            return Ok(ClientTarget::PubSub {
                config: self.pubsub.config()?,
                topic: Some(topic.clone()),
                subscription: None,
            });
        }
        Ok(ClientTarget::Redis {
            config: self.redis.config()?,
            queue: self.queue.clone(),
            result_list: self.result_list.clone(),
            fairness_attribute: lanes,
        })
    }
}

/// How many ids a warning lists before it says "and N more".
const LIST_IDS: usize = 10;

/// Reports a parsed file's problems on standard error, in the wording
/// `batch` uses for the same lines. Returns the exit code when nothing
/// may be submitted: ids repeated inside the file without
/// `allow_duplicates` refuse the whole file, naming every line.
fn report_lines(parsed: &ParsedInput, allow_duplicates: bool) -> Option<ExitCode> {
    if !parsed.duplicates.is_empty() && !allow_duplicates {
        for bad in &parsed.invalid {
            eprintln!("{}", bad.message);
        }
        eprintln!(
            "nothing submitted: {} lines repeat the id of an earlier line (results are keyed by id); fix the file or pass --allow-duplicates",
            parsed.duplicates.len()
        );
        return Some(ExitCode::from(super::EXIT_CONFIG));
    }
    for bad in &parsed.invalid {
        eprintln!("skipped {}", bad.message);
    }
    for duplicate in &parsed.duplicates {
        eprintln!(
            "warning: {}; submitted anyway (--allow-duplicates)",
            duplicate.message
        );
    }
    None
}

/// Warns that `ids` were submitted before and are not finished yet
/// (`state` says where they are): submitting them again means a second
/// request and a second result for each.
fn warn_active(ids: &[String], state: &str) {
    if ids.is_empty() {
        return;
    }
    let mut shown: Vec<String> = ids
        .iter()
        .take(LIST_IDS)
        .map(|i| format!("`{i}`"))
        .collect();
    if ids.len() > LIST_IDS {
        shown.push(format!("and {} more", ids.len() - LIST_IDS));
    }
    eprintln!(
        "warning: {} ids are already {state} from an earlier submission and will be sent and answered again: {}",
        ids.len(),
        shown.join(", ")
    );
}

pub(super) async fn run(args: SubmitArgs) -> ExitCode {
    let deadline = match parse_duration(&args.deadline) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("--deadline: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read {}: {e}", args.file.display());
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let default_deadline = crate::clock::unix_secs()
        .saturating_add(i64::try_from(deadline.as_secs()).unwrap_or(i64::MAX / 2));
    let policy = match args.allow_duplicates {
        true => DuplicateIds::Allow,
        false => DuplicateIds::Refuse,
    };
    // Every line is checked before the queue is opened: a refused file
    // sends nothing (and creates no store).
    let parsed = parse_input_with(&text, default_deadline, policy);
    if let Some(code) = report_lines(&parsed, args.allow_duplicates) {
        return code;
    }
    let client = match super::args::open(args.target()).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(key) = args.idempotency_key {
        let keep = match parse_duration(&args.idempotency_keep) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("--idempotency-keep: {e}");
                return ExitCode::from(super::EXIT_CONFIG);
            }
        };
        return submit_idempotent(client.as_ref(), key, &parsed, keep).await;
    }
    let words = client.describe();
    let ids: Vec<String> = parsed.valid.iter().map(|l| l.custom_id.clone()).collect();
    match client.active(ids).await {
        Ok(Some(active)) => warn_active(&active, words.active),
        Ok(None) => {}
        // Only a warning depends on it: say so and carry on.
        Err(e) => eprintln!("warning: cannot check for ids already submitted: {e}"),
    }
    let bad = parsed.invalid.len();
    let bar = bar(Some(parsed.valid.len() as u64), "lines");
    let mut submitted = 0u64;
    let started = std::time::Instant::now();
    for chunk in parsed.valid.chunks(CHUNK) {
        let requests = (chunk.iter())
            .map(|l| Outgoing {
                body: l.body.clone(),
                deadline: l.deadline,
            })
            .collect();
        match client.enqueue(requests, None).await {
            Ok(n) => submitted += n,
            Err(error) => {
                bar.abandon();
                eprintln!(
                    "{error}; {submitted} lines submitted before the failure (line {} onwards not confirmed)",
                    chunk.first().map_or(0, |l| l.line)
                );
                return ExitCode::FAILURE;
            }
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "submitted {submitted} {} to {} in {secs:.2}s ({:.0}/s); {bad} bad lines",
        words.items,
        words.place,
        submitted as f64 / secs
    );
    match bad {
        0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// The whole file under `key` in one enqueue: its record covers every
/// line in order, so a repeat is recognised as a whole (no chunks, no
/// progress bar).
async fn submit_idempotent(
    client: &dyn Client,
    key: String,
    parsed: &ParsedInput,
    keep: Duration,
) -> ExitCode {
    let words = client.describe();
    let requests = (parsed.valid.iter())
        .map(|l| Outgoing {
            body: l.body.clone(),
            deadline: l.deadline,
        })
        .collect();
    let bad = parsed.invalid.len();
    match client.enqueue_idempotent(key, requests, keep).await {
        Ok(Submitted::New(record)) => println!(
            "submitted {} {} to {} under idempotency key `{}` (identity {}); {bad} bad lines",
            record.requests.len(),
            words.items,
            words.place,
            record.key,
            record.identity
        ),
        Ok(Submitted::Existing(record)) => println!(
            "submission under idempotency key `{}` already exists: {} {} in {} (identity {}: {}); nothing enqueued",
            record.key,
            record.requests.len(),
            words.items,
            words.place,
            record.identity,
            list_ids(&record)
        ),
        Err(error @ ClientError::IdempotencyConflict { .. }) => {
            eprintln!("{error}; nothing enqueued");
            return ExitCode::from(EXIT_IDEMPOTENCY_CONFLICT);
        }
        Err(error) => {
            eprintln!("{error}; nothing enqueued");
            return match error {
                ClientError::Unsupported { .. } | ClientError::IdempotencyKey { .. } => {
                    ExitCode::from(super::EXIT_CONFIG)
                }
                _ => ExitCode::FAILURE,
            };
        }
    }
    match bad {
        0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// A record's ids for a line of output, the first [`LIST_IDS`] of them.
pub(super) fn list_ids(record: &SubmissionRecord) -> String {
    let mut shown: Vec<String> = (record.requests.iter())
        .take(LIST_IDS)
        .map(|r| format!("`{}`", r.id))
        .collect();
    if record.requests.len() > LIST_IDS {
        shown.push(format!("and {} more", record.requests.len() - LIST_IDS));
    }
    shown.join(", ")
}

#[cfg(test)]
mod tests {
    use crate::request::parse_message;

    /// One line through the shared validator, as `run` sees it.
    fn to_request(line: &str, default_deadline: i64) -> Result<crate::request::Message, String> {
        let parsed = crate::batch::input::convert_line(line, 1, default_deadline)
            .map_err(|bad| bad.message)?;
        parse_message(&parsed.body).map_err(|e| e.reason)
    }

    #[test]
    fn openai_batch_line_becomes_a_request() {
        let m = to_request(
            r#"{"custom_id":"r1","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}"#,
            100,
        )
        .expect("valid");
        assert_eq!(m.request.id, "r1");
        assert_eq!(m.request.deadline, 100);
        assert_eq!(m.request.endpoint.as_deref(), Some("/v1/chat/completions"));
        assert_eq!(m.request.payload.get(), r#"{"model":"m"}"#);
    }

    #[test]
    fn request_line_keeps_its_deadline_and_bad_lines_say_why() {
        let m = to_request(r#"{"id":"a","deadline":7,"payload":{}}"#, 100).expect("valid");
        assert_eq!(m.request.deadline, 7);
        let m = to_request(r#"{"id":"a","payload":{}}"#, 100).expect("valid");
        assert_eq!(m.request.deadline, 100);
        assert!(to_request("{", 1).is_err());
        assert!(to_request(r#"{"custom_id":"x","method":"GET","body":{}}"#, 1).is_err());
    }
}
