//! The `sluicegate` binary: parses the command line and hands over to the
//! library (`sluicegate::cli`).

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    sluicegate::cli::run(sluicegate::cli::Cli::parse()).await
}
