//! `sluicegate submit`: enqueues request lines into a Redis queue, as an
//! upstream producer would (envelope, score, `request-active:<id>`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::batch::input::{DuplicateIds, ParsedInput, parse_input_with};
use crate::config::{EndpointUrl, RedisConfig, Secret, parse_duration, read_secret_file};
use crate::queue::redis::{Submission, enqueue};
use crate::redis::{RedisConnection, connection};
use crate::request::parse_message;

/// Lines sent per pipelined round trip.
const CHUNK: usize = 1000;

/// Where Redis is (shared by the producer tools).
#[derive(Debug, Args)]
pub(super) struct RedisArgs {
    /// Redis URL (`redis://` or `rediss://`, database number in the path).
    #[arg(
        long,
        env = "SLUICEGATE_REDIS_URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    redis_url: String,
    /// Redis ACL user.
    #[arg(long, env = "SLUICEGATE_REDIS_USERNAME")]
    redis_username: Option<String>,
    /// Redis password (prefer the environment or a file).
    #[arg(long, env = "SLUICEGATE_REDIS_PASSWORD", hide_env_values = true)]
    redis_password: Option<String>,
    /// File holding the Redis password.
    #[arg(long, env = "SLUICEGATE_REDIS_PASSWORD_FILE")]
    redis_password_file: Option<PathBuf>,
    /// `--redis-url` is a seed node of a Redis Cluster.
    #[arg(long, env = "SLUICEGATE_REDIS_CLUSTER")]
    redis_cluster: bool,
}

impl RedisArgs {
    /// The connection settings these flags describe.
    pub(super) fn config(&self) -> Result<RedisConfig, String> {
        let url = url::Url::parse(&self.redis_url).map_err(|e| format!("--redis-url: {e}"))?;
        let password = match (&self.redis_password, &self.redis_password_file) {
            (Some(p), _) => Some(Secret::new(p.clone())),
            (None, Some(path)) => {
                Some(read_secret_file(path).map_err(|e| format!("--redis-password-file: {e}"))?)
            }
            (None, None) => None,
        };
        Ok(RedisConfig {
            url: EndpointUrl::new(url),
            username: self.redis_username.clone(),
            password,
            password_file: self.redis_password_file.clone(),
            cluster: self.redis_cluster,
        })
    }

    /// A lazily connecting connection, or a message for the user.
    pub(super) fn connect(&self) -> Result<RedisConnection, String> {
        connection(&self.config()?).map_err(|e| e.to_string())
    }
}

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
    pubsub: super::pubsub::PubSubArgs,
    /// Publish to this Pub/Sub topic instead of Redis (each line as the
    /// plain request JSON).
    #[arg(long, conflicts_with_all = ["embedded", "result_list"])]
    pubsub_topic: Option<String>,
    /// The dispatcher's `[gateway] fairness_attribute` (Redis): each
    /// message is also filed in its tenant's lane (its metadata value of
    /// this attribute), so the dispatcher sees every tenant's work however
    /// deep the queue is. Leave it off when the dispatcher has none.
    #[arg(long, env = "SLUICEGATE_FAIRNESS_ATTRIBUTE")]
    fairness_attribute: Option<String>,
    /// Submit lines whose id an earlier line of the file already has
    /// (without it such a file is refused and nothing is submitted).
    #[arg(long)]
    allow_duplicates: bool,
    /// Request lines: sluicegate/upstream request JSON, envelopes, or
    /// OpenAI Batch API lines (`custom_id`, `method`, `url`, `body`).
    file: PathBuf,
}

/// How many ids a warning lists before it says "and N more".
const LIST_IDS: usize = 10;

/// Reports a parsed file's problems on standard error, in the wording
/// `batch` uses for the same lines. Returns the exit code when nothing
/// may be submitted: ids repeated inside the file without
/// `allow_duplicates` refuse the whole file, naming every line.
pub(super) fn report_lines(parsed: &ParsedInput, allow_duplicates: bool) -> Option<ExitCode> {
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
pub(super) fn warn_active(ids: &[&str], state: &str) {
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

/// The ids among `ids` that have a `request-active:<id>` key (submitted
/// and not finished), in the order given.
async fn active_ids<'a>(
    conn: &mut RedisConnection,
    ids: &[&'a str],
) -> redis::RedisResult<Vec<&'a str>> {
    let mut active = Vec::new();
    for chunk in ids.chunks(CHUNK) {
        // One MGET per chunk: a cluster connection splits it by slot.
        let mut mget = redis::cmd("MGET");
        for id in chunk {
            mget.arg(format!("request-active:{id}"));
        }
        let found: Vec<Option<String>> = mget.query_async(conn).await?;
        active.extend(
            chunk
                .iter()
                .zip(found)
                .filter(|(_, token)| token.is_some())
                .map(|(id, _)| *id),
        );
    }
    Ok(active)
}

pub(super) async fn run(args: SubmitArgs) -> ExitCode {
    let deadline = match parse_duration(&args.deadline) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("--deadline: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(store) = &args.embedded {
        return super::embedded::submit(
            store,
            &args.queue,
            deadline,
            &args.file,
            args.allow_duplicates,
        );
    }
    if let Some(url) = &args.sql_url {
        let file = &args.file;
        return super::sql::submit(url, &args.queue, deadline, file, args.allow_duplicates).await;
    }
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read {}: {e}", args.file.display());
            return ExitCode::from(2);
        }
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let default_deadline =
        now_ms / 1000 + i64::try_from(deadline.as_secs()).unwrap_or(i64::MAX / 2);
    let policy = if args.allow_duplicates {
        DuplicateIds::Allow
    } else {
        DuplicateIds::Refuse
    };
    // Every line is checked before anything is sent: a refused file sends
    // nothing.
    let parsed = parse_input_with(&text, default_deadline, policy);
    if let Some(code) = report_lines(&parsed, args.allow_duplicates) {
        return code;
    }
    if let Some(topic) = &args.pubsub_topic {
        return super::pubsub::submit(&args.pubsub, topic, &parsed).await;
    }
    let mut conn = match args.redis.connect() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let ids: Vec<&str> = parsed.valid.iter().map(|l| l.custom_id.as_str()).collect();
    match active_ids(&mut conn, &ids).await {
        Ok(active) => warn_active(&active, "active (`request-active:<id>`)"),
        Err(error) => {
            eprintln!("redis: {error}; nothing submitted");
            return ExitCode::FAILURE;
        }
    }
    let bad = parsed.invalid.len();
    let bar = ProgressBar::new(parsed.valid.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} lines {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut submitted = 0usize;
    let started = std::time::Instant::now();
    for chunk in parsed.valid.chunks(CHUNK) {
        let mut batch = Vec::with_capacity(chunk.len());
        for line in chunk {
            // The validator accepted exactly these bytes, so they parse.
            let mut message = match parse_message(&line.body) {
                Ok(m) => m,
                Err(failure) => {
                    bar.suspend(|| eprintln!("skipped line {}: {}", line.line, failure.reason));
                    continue;
                }
            };
            if let Some(list) = &args.result_list {
                message.internal.result_queue_name = Some(list.clone());
            }
            let tenant = (args.fairness_attribute.as_deref())
                .map(|a| message.request.metadata.get(a).cloned().unwrap_or_default());
            batch.push(
                Submission::new(message, &args.queue, now_ms)
                    .in_sequence(line.line as u64)
                    .in_lane(tenant),
            );
        }
        if let Err(error) = enqueue(&mut conn, &args.queue, &batch).await {
            bar.abandon();
            eprintln!(
                "redis: {error}; {submitted} lines submitted before the failure (line {} onwards not submitted)",
                chunk.first().map_or(0, |l| l.line)
            );
            return ExitCode::FAILURE;
        }
        submitted += batch.len();
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "submitted {submitted} requests to `{}` in {:.2}s ({:.0}/s); {bad} bad lines",
        args.queue,
        secs,
        submitted as f64 / secs
    );
    if bad > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
