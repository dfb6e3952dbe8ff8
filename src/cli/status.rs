//! `sluicegate status --idempotency-key KEY`: the submission a key
//! records (`submit --idempotency-key`) and its state, through the
//! queue's client ([`crate::queue::Client::lookup`]): how many of its ids
//! are still pending and for how many a result can be read.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::args::{RedisArgs, store_target};
use crate::queue::{Client, ClientTarget, Cursor, SubmissionRecord};

/// Results read per page while counting.
const PAGE: usize = 1000;

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// The key the submission was recorded under.
    #[arg(long, env = "SLUICEGATE_IDEMPOTENCY_KEY")]
    idempotency_key: String,
    /// Look in this embedded store file instead of Redis (it must exist).
    #[arg(long)]
    embedded: Option<PathBuf>,
    /// Look in this PostgreSQL database (the `sql` transport's `[sql]
    /// url`) instead of Redis.
    #[arg(long, env = "SLUICEGATE_SQL_URL", conflicts_with = "embedded")]
    sql_url: Option<String>,
    /// The queue submitted to (the same default as `submit`): keys are
    /// scoped by queue.
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
    queue: String,
    /// Where results are counted: the Redis result list, or with
    /// `--sql-url` the route (default: the record's).
    #[arg(long)]
    results_from: Option<String>,
}

impl StatusArgs {
    /// The queue the flags name, its results read from `results`.
    fn target(&self, results: Option<String>) -> Result<ClientTarget, String> {
        let (embedded, sql) = (self.embedded.as_ref(), self.sql_url.as_deref());
        let route = results
            .clone()
            .unwrap_or_else(|| crate::queue::sql::DEFAULT_RESULT_ROUTE.to_owned());
        if let Some(store) = store_target(embedded, sql, &self.queue, &route, false) {
            return store;
        }
        Ok(ClientTarget::Redis {
            config: self.redis.config()?,
            queue: self.queue.clone(),
            result_list: results,
            fairness_attribute: None,
        })
    }
}

pub(super) async fn run(args: StatusArgs) -> ExitCode {
    let client = match super::args::open(args.target(args.results_from.clone())).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let key = args.idempotency_key.clone();
    let record = match client.lookup(key.clone()).await {
        Ok(Some(record)) => record,
        Ok(None) => {
            eprintln!(
                "no submission recorded under idempotency key `{key}` in {} (never submitted, or its record expired; do not resubmit on that alone)",
                client.describe().place
            );
            return ExitCode::FAILURE;
        }
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    // Results are read where the record says they go, unless a flag
    // says otherwise (the embedded store keeps them in the queue).
    let results_client = match (&args.results_from, args.embedded.is_some()) {
        (None, false) if record.result_route != client_route(&args) => {
            match super::args::open(args.target(Some(record.result_route.clone()))).await {
                Ok(c) => c,
                Err(code) => return code,
            }
        }
        _ => client,
    };
    match describe(results_client.as_ref(), &record).await {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

/// The result route the flags alone would read.
fn client_route(args: &StatusArgs) -> String {
    match args.sql_url {
        Some(_) => crate::queue::sql::DEFAULT_RESULT_ROUTE.to_owned(),
        None => crate::queue::redis::DEFAULT_RESULT_LIST.to_owned(),
    }
}

/// The record and its state, as printed.
async fn describe(
    client: &dyn Client,
    record: &SubmissionRecord,
) -> Result<String, crate::queue::ClientError> {
    let ids: Vec<String> = record.requests.iter().map(|r| r.id.clone()).collect();
    let pending = client.active(ids).await?;
    let answered = results_present(client, record).await?;
    let n = record.requests.len();
    let pending = match pending {
        Some(p) => format!("{} pending", p.len()),
        None => "pending unknown".to_owned(),
    };
    let mut out = format!(
        "idempotency key `{}`: {n} requests to `{}`, results in `{}`\n",
        record.key, record.request_route, record.result_route
    );
    out += &format!("identity {}\n", record.identity);
    out += &format!("record kept until {} (Unix s)\n", record.expires_at);
    out += &format!("state: {pending}, results present for {answered} of {n}\n");
    out += &format!("ids: {}\n", super::submit::list_ids(record));
    Ok(out)
}

/// How many of the record's requests have a result readable now (matched
/// by id, and by token where the record has one). A store keeps every
/// result, so all are counted; a Redis list holds only the results no
/// reader has taken yet (one page of its oldest).
async fn results_present(
    client: &dyn Client,
    record: &SubmissionRecord,
) -> Result<usize, crate::queue::ClientError> {
    let wanted: HashMap<&str, Option<&str>> = (record.requests.iter())
        .map(|r| (r.id.as_str(), r.token.as_deref()))
        .collect();
    let mut found = std::collections::HashSet::new();
    let mut cursor = Cursor::default();
    loop {
        let page = client.results(cursor, PAGE).await?;
        for read in &page.results {
            let Some(result) = &read.record else { continue };
            let matches = wanted.get(result.id.as_str()).is_some_and(|token| {
                token.is_none_or(|t| result.request_token.as_deref() == Some(t))
            });
            if matches {
                found.insert(result.id.clone());
            }
        }
        // A transport that keeps no positions hands back the same page.
        if page.results.is_empty() || page.cursor <= cursor {
            break;
        }
        cursor = page.cursor;
    }
    Ok(found.len())
}
