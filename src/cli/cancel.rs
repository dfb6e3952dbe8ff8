//! `sluicegate cancel`: cancels active submissions by id through the
//! queue's client ([`crate::queue::Client`]). Redis follows the upstream
//! protocol (the active token is copied to `request-cancel:<id>`); an
//! embedded store (`--embedded PATH`) and PostgreSQL (`--sql-url`) remove
//! waiting messages and answer them `CANCELLED` at once.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::args::{RedisArgs, store_target};
use crate::queue::{CancelOutcome, ClientTarget};

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

impl CancelArgs {
    /// The queue the flags name: Redis unless `--embedded` or `--sql-url`
    /// says otherwise (Redis cancels by id, whatever the queue).
    fn target(&self) -> Result<ClientTarget, String> {
        let (embedded, sql) = (self.embedded.as_ref(), self.sql_url.as_deref());
        if let Some(store) = store_target(embedded, sql, &self.queue, &self.route, false) {
            return store;
        }
        Ok(ClientTarget::Redis {
            config: self.redis.config()?,
            queue: self.queue.clone(),
            result_list: None,
            fairness_attribute: None,
        })
    }
}

pub(super) async fn run(args: CancelArgs) -> ExitCode {
    let client = match super::args::open(args.target()).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let outcomes = match client.cancel(args.ids.clone()).await {
        Ok(outcomes) => outcomes,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    let (mut cancelled, mut inactive) = (0usize, 0usize);
    for (id, outcome) in args.ids.iter().zip(outcomes) {
        match outcome {
            CancelOutcome::Cancelled => {
                cancelled += 1;
                println!("{id}: cancelled");
            }
            CancelOutcome::InFlight => {
                inactive += 1;
                println!(
                    "{id}: flagged (in flight: answered CANCELLED unless a worker already sent it)"
                );
            }
            CancelOutcome::NotActive => {
                inactive += 1;
                println!("{id}: not active (finished, expired or unknown)");
            }
        }
    }
    println!("{cancelled} cancelled, {inactive} not active");
    ExitCode::SUCCESS
}
