//! `sluicegate cancel`: cancels active submissions by id. Redis follows
//! the upstream protocol (the active token is copied to
//! `request-cancel:<id>`); an embedded store (`--embedded PATH`) removes
//! waiting messages and answers them `CANCELLED` at once.

use std::path::Path;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::submit::RedisArgs;
use crate::queue::embedded::{EmbeddedCancel, EmbeddedQueue};
use crate::queue::redis::{CancelOutcome, cancel};

#[derive(Debug, Args)]
pub(crate) struct CancelArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Cancel in this embedded store file instead of Redis (it must
    /// exist).
    #[arg(long)]
    embedded: Option<PathBuf>,
    /// Cancel in this PostgreSQL database (the `sql` transport's `[sql]
    /// url`) instead of Redis.
    #[arg(long, env = "SLUICEGATE_SQL_URL", conflicts_with = "embedded")]
    sql_url: Option<String>,
    /// With `--sql-url`: the route `CANCELLED` results are written under.
    #[arg(long, default_value = crate::queue::sql::DEFAULT_RESULT_ROUTE)]
    route: String,
    /// With `--embedded` or `--sql-url`: the queue (the same default as
    /// `submit`).
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
    queue: String,
    /// Request ids to cancel.
    #[arg(required = true)]
    ids: Vec<String>,
}

pub(super) async fn run(args: CancelArgs) -> ExitCode {
    if let Some(store) = &args.embedded {
        return cancel_embedded(store, &args.queue, &args.ids);
    }
    if let Some(url) = &args.sql_url {
        return super::sql::cancel(url, &args.queue, &args.route, &args.ids).await;
    }
    let mut conn = match args.redis.connect() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let (mut cancelled, mut inactive) = (0usize, 0usize);
    for id in &args.ids {
        match cancel(&mut conn, id).await {
            Ok(CancelOutcome::Cancelled) => {
                cancelled += 1;
                println!("{id}: cancelled");
            }
            Ok(CancelOutcome::NotActive) => {
                inactive += 1;
                println!("{id}: not active (finished, expired or unknown)");
            }
            Err(error) => {
                eprintln!("{id}: redis: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{cancelled} cancelled, {inactive} not active");
    ExitCode::SUCCESS
}

/// `cancel --embedded PATH`: the same lines and summary as the Redis path.
fn cancel_embedded(store: &Path, queue: &str, ids: &[String]) -> ExitCode {
    let queue = match EmbeddedQueue::open_existing(store, queue) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut cancelled, mut inactive) = (0usize, 0usize);
    for id in ids {
        match queue.cancel(id) {
            Ok(EmbeddedCancel::Cancelled(_)) => {
                cancelled += 1;
                println!("{id}: cancelled");
            }
            Ok(EmbeddedCancel::InFlight) => {
                inactive += 1;
                println!("{id}: not cancelled (in flight: a worker is sending it now)");
            }
            Ok(EmbeddedCancel::NotPending) => {
                inactive += 1;
                println!("{id}: not active (finished, expired or unknown)");
            }
            Err(error) => {
                eprintln!("{id}: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{cancelled} cancelled, {inactive} not active");
    ExitCode::SUCCESS
}
