//! Manual testing of the simulator front until `sluicegate sim serve` is
//! wired: `cargo run --example sim_serve -- --listen 127.0.0.1:8000 --interactive waves`.

use clap::Parser;
use sluicegate::sim::{ServeArgs, SimError, serve};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[tokio::main]
async fn main() -> Result<(), SimError> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let cli = Cli::parse();
    serve(cli.serve, async {
        // Ctrl-C ends the demo; a failing signal handler just means no Ctrl-C.
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
