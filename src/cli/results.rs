//! `sluicegate results`: reads a queue's results through its client
//! ([`crate::queue::Client`]) into a JSON-lines file or standard output:
//! a Redis result list (each result taken once, oldest first, as upstream
//! readers do), an embedded store (`--embedded PATH`) or a PostgreSQL
//! database (`--sql-url`), where results stay and `--after` skips those
//! read before, or a Pub/Sub subscription on the result topic
//! (`--pubsub-subscription`). Each page is written and flushed before it
//! is confirmed, so a crash re-reads and never loses; a result whose
//! `(id, request_token)` this run already wrote is skipped (Pub/Sub can
//! repeat one, `docs/transports.md`).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use super::args::{PubSubArgs, RedisArgs, store_target};
use super::output::{Format, Output, bar, openai_line};
use crate::queue::{Client, ClientTarget, Cursor};

/// Results read per page.
const PAGE: usize = 1000;
/// Pause before reading again while waiting for `--expect`.
const IDLE: Duration = Duration::from_millis(100);
/// Pause before retrying after a transport error while waiting.
const RETRY: Duration = Duration::from_millis(500);

#[derive(Debug, Args)]
pub(crate) struct ResultsArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Redis: result list to read (popped: each result is read once).
    #[arg(long, default_value = "result-list")]
    list: String,
    #[command(flatten)]
    pubsub: PubSubArgs,
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
    /// With `--sql-url` or `--embedded`: only results after this position
    /// (the last one a previous read printed).
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

impl ResultsArgs {
    /// The queue the flags name: Redis unless `--embedded`, `--sql-url`
    /// or `--pubsub-subscription` says otherwise.
    fn target(&self) -> Result<ClientTarget, String> {
        let (embedded, sql) = (self.embedded.as_ref(), self.sql_url.as_deref());
        if let Some(store) = store_target(embedded, sql, &self.queue, &self.route, false) {
            return store;
        }
        if let Some(subscription) = &self.pubsub_subscription {
            return Ok(ClientTarget::PubSub {
                config: self.pubsub.config()?,
                topic: None,
                subscription: Some(subscription.clone()),
            });
        }
        Ok(ClientTarget::Redis {
            config: self.redis.config()?,
            queue: self.queue.clone(),
            result_list: Some(self.list.clone()),
            fairness_attribute: None,
        })
    }
}

/// Flags of the deprecated `sluicegate results-embedded` (hidden; kept so
/// existing scripts work; `results --embedded PATH` replaces it).
#[derive(Debug, Args)]
pub(crate) struct ResultsEmbeddedArgs {
    /// The embedded store file.
    #[arg(long)]
    embedded: PathBuf,
    /// Queue name in the store (the same default as `submit --embedded`
    /// and `config/embedded.toml`).
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
    queue: String,
}

/// The deprecated `sluicegate results-embedded`: a one-line notice on
/// standard error, then exactly the lines `results --embedded PATH`
/// prints (and no summary: the notice stays its only line there).
pub(super) async fn run_embedded_alias(args: ResultsEmbeddedArgs) -> ExitCode {
    eprintln!(
        "note: `results-embedded` is deprecated; use `sluicegate results --embedded PATH` (same output)"
    );
    let target = ClientTarget::Embedded {
        path: args.embedded,
        queue: args.queue,
        create: false,
    };
    let read = Read {
        cursor: Cursor::default(),
        expect: None,
        timeout: None,
        format: Format::Native,
        summary: false,
    };
    match super::args::open(Ok(target)).await {
        Ok(client) => collect(client.as_ref(), read, None).await,
        Err(code) => code,
    }
}

/// What one `results` run reads, and how.
struct Read {
    cursor: Cursor,
    expect: Option<u64>,
    timeout: Option<Duration>,
    format: Format,
    /// Whether to print the summary when the lines go to standard output.
    summary: bool,
}

/// What one `results` run counted.
#[derive(Debug, Default)]
struct Counts {
    got: u64,
    errors: u64,
    unparsable: u64,
    duplicates: u64,
}

pub(super) async fn run(args: ResultsArgs) -> ExitCode {
    let timeout = match args.timeout.as_deref().map(crate::config::parse_duration) {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            eprintln!("--timeout: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let client: Arc<dyn Client> = match super::args::open(args.target()).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let read = Read {
        cursor: Cursor(args.after),
        expect: args.expect,
        timeout,
        format: args.format,
        summary: true,
    };
    collect(client.as_ref(), read, args.output).await
}

/// Reads pages until the results run out (or, with `expect`, until that
/// many arrived or `timeout` passed), writing each page and flushing it
/// before it is confirmed.
async fn collect(client: &dyn Client, read: Read, output: Option<PathBuf>) -> ExitCode {
    let mut out = match Output::open(output.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let bar = bar(read.expect, "results");
    let started = Instant::now();
    let mut seen: HashSet<(String, Option<String>)> = HashSet::new();
    let mut counts = Counts::default();
    let mut cursor = read.cursor;
    loop {
        if read.expect.is_some_and(|n| counts.got >= n)
            || read.timeout.is_some_and(|t| started.elapsed() >= t)
        {
            break;
        }
        let page = match client.results(cursor, PAGE).await {
            Ok(page) => page,
            // Only a reader that waits for more retries: one that reads
            // what is there says what failed and stops.
            Err(error) if read.expect.is_some() => {
                bar.suspend(|| eprintln!("{error}; retrying"));
                tokio::time::sleep(RETRY).await;
                continue;
            }
            Err(error) => {
                bar.abandon();
                eprintln!("{error}");
                return ExitCode::FAILURE;
            }
        };
        if page.results.is_empty() {
            if read.expect.is_none() {
                break;
            }
            tokio::time::sleep(IDLE).await;
            continue;
        }
        cursor = page.cursor;
        let mut taken = Vec::with_capacity(page.results.len());
        for result in page.results {
            let line = match &result.record {
                Some(record) => {
                    if !seen.insert((record.id.clone(), record.request_token.clone())) {
                        counts.duplicates += 1;
                        taken.push(result);
                        continue;
                    }
                    if !result.is_success() {
                        counts.errors += 1;
                    }
                    match read.format {
                        Format::Native => result.raw.clone(),
                        Format::Openai => openai_line(record, counts.got + 1).to_string(),
                    }
                }
                None => {
                    counts.unparsable += 1;
                    result.raw.clone()
                }
            };
            counts.got += 1;
            if let Err(e) = out.line(&line) {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
            bar.inc(1);
            taken.push(result);
        }
        if let Err(e) = out.flush() {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        if let Err(error) = client.confirm(taken, Vec::new()).await {
            bar.suspend(|| eprintln!("{error}; these results may be read again"));
        }
    }
    bar.finish_and_clear();
    if let Err(e) = out.flush() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    if counts.got == 0
        && let Some(why) = client.why_empty().await
    {
        eprintln!("{why}");
    }
    if read.summary || !out.is_stdout() {
        out.summary(&summary(
            client,
            &counts,
            cursor,
            read.cursor,
            &out,
            started,
        ));
    }
    match read.expect {
        Some(n) if counts.got < n => {
            eprintln!("expected {n} results, got {}", counts.got);
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
}

/// The closing line: what was collected from where, and where a store's
/// next read may start.
fn summary(
    client: &dyn Client,
    counts: &Counts,
    cursor: Cursor,
    from: Cursor,
    out: &Output,
    started: Instant,
) -> String {
    let Counts {
        got,
        errors,
        unparsable,
        duplicates,
    } = counts;
    let mut text = format!(
        "collected {got} results from {} into {} ({errors} not 2xx, {unparsable} unparsable, {duplicates} repeated results skipped) in {:.1}s",
        client.describe().results,
        out.name(),
        started.elapsed().as_secs_f64()
    );
    if cursor != from {
        let Cursor(at) = cursor;
        text.push_str(&format!(
            "; last position {at} (pass --after {at} to read only newer ones)"
        ));
    }
    text
}
