//! `sluicegate cancel`: cancels active submissions by id (upstream
//! protocol: the active token is copied to `request-cancel:<id>`).

use std::process::ExitCode;

use clap::Args;

use super::submit::RedisArgs;
use crate::queue::redis::{CancelOutcome, cancel};

#[derive(Debug, Args)]
pub(crate) struct CancelArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Request ids to cancel.
    #[arg(required = true)]
    ids: Vec<String>,
}

pub(super) async fn run(args: CancelArgs) -> ExitCode {
    let (_client, mut conn) = match args.redis.connect() {
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
