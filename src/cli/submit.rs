//! `sluicegate submit`: enqueues request lines into a Redis queue, as an
//! upstream producer would (envelope, score, `request-active:<id>`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use redis::Client;
use redis::aio::ConnectionManager;

use crate::config::{EndpointUrl, RedisConfig, Secret, parse_duration, read_secret_file};
use crate::queue::redis::{ConnectError, Submission, client, enqueue, manager};
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
        })
    }

    /// Client and connection, or a message for the user.
    pub(super) fn connect(&self) -> Result<(Client, ConnectionManager), String> {
        connect(&self.config()?)
    }
}

/// A client and a lazily connecting manager for `config`.
pub(super) fn connect(config: &RedisConfig) -> Result<(Client, ConnectionManager), String> {
    let c = client(config).map_err(|e: ConnectError| e.to_string())?;
    let m = manager(&c).map_err(|e| e.to_string())?;
    Ok((c, m))
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
    /// Request lines: sluicegate/upstream request JSON, envelopes, or
    /// OpenAI Batch API lines (`custom_id`, `method`, `url`, `body`).
    file: PathBuf,
}

/// Converts one input line into a request message JSON; errors name what
/// is wrong.
fn to_request(line: &str, default_deadline: i64) -> Result<crate::request::Message, String> {
    let mut value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let object = value.as_object_mut().ok_or("not a JSON object")?;
    if object.contains_key("custom_id") {
        // The converter `batch` uses: one shape for OpenAI lines everywhere.
        let bytes =
            crate::batch::input::openai_request(line, default_deadline).map_err(|(_, why)| why)?;
        return parse_message(&bytes).map_err(|e| e.reason);
    } else {
        let target = if object.contains_key("data") {
            object.get_mut("data").and_then(|d| d.as_object_mut())
        } else {
            Some(object)
        };
        if let Some(request) = target
            && !request.contains_key("deadline")
        {
            request.insert("deadline".into(), default_deadline.into());
        }
    }
    parse_message(value.to_string().as_bytes()).map_err(|e| e.reason)
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
        return super::embedded::submit(store, &args.queue, deadline, &args.file);
    }
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read {}: {e}", args.file.display());
            return ExitCode::from(2);
        }
    };
    let (_client, mut conn) = match args.redis.connect() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let default_deadline =
        now_ms / 1000 + i64::try_from(deadline.as_secs()).unwrap_or(i64::MAX / 2);
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
        .collect();
    let bar = ProgressBar::new(lines.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} lines {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut bad = 0usize;
    let mut submitted = 0usize;
    let started = std::time::Instant::now();
    for chunk in lines.chunks(CHUNK) {
        let mut batch = Vec::with_capacity(chunk.len());
        for (number, line) in chunk {
            match to_request(line, default_deadline) {
                Ok(mut message) => {
                    if let Some(list) = &args.result_list {
                        message.internal.result_queue_name = Some(list.clone());
                    }
                    batch.push(
                        Submission::new(message, &args.queue, now_ms).in_sequence(*number as u64),
                    );
                }
                Err(reason) => {
                    bad += 1;
                    bar.suspend(|| eprintln!("line {number}: {reason}"));
                }
            }
        }
        if let Err(error) = enqueue(&mut conn, &args.queue, &batch).await {
            bar.abandon();
            eprintln!(
                "redis: {error}; {submitted} lines submitted before the failure (line {} onwards not submitted)",
                chunk.first().map_or(0, |(n, _)| *n)
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
