//! `sluicegate serve`: the OpenAI Batch API (`docs/batch-api.md`). Loads
//! the configuration as `run` does, plus `[serve]`; the transport is
//! `embedded` unless the file, environment or `--transport` say otherwise.

use std::io::Write as _;
use std::process::ExitCode;

use clap::Args;
use tokio_util::sync::CancellationToken;

use super::{ConfigArgs, EXIT_CONFIG, spawn_signal_handler};
use crate::config::ServeConfig;

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Address of the Batch API (`serve.listen`).
    #[arg(long)]
    api_listen: Option<String>,
    /// Directory of file bodies and, embedded, batch records (`serve.data_dir`).
    #[arg(long)]
    data_dir: Option<String>,
}

pub(super) async fn run(mut args: ServeArgs) -> ExitCode {
    let named = args.config.config.is_some()
        || std::env::var_os("SLUICEGATE_CONFIG").is_some_and(|v| !v.is_empty());
    if args.config.transport.is_none()
        && !named
        && std::env::var_os("SLUICEGATE_TRANSPORT").is_none()
    {
        args.config.transport = Some("embedded".to_owned());
    }
    let config = match args.config.load() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut sources = args.config.sources();
    // The two flags are `[serve]` keys given on the command line.
    for (var, value) in [
        ("SLUICEGATE_SERVE_LISTEN", &args.api_listen),
        ("SLUICEGATE_SERVE_DATA_DIR", &args.data_dir),
    ] {
        if let Some(value) = value {
            sources.env.insert(var.to_owned(), value.clone());
        }
    }
    let serve = match ServeConfig::load(&sources) {
        Ok(s) => s,
        Err(errors) => {
            eprintln!("configuration errors:\n{errors}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    crate::telemetry::logging::init(config.telemetry.log_format, &config.telemetry.log_level);
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let server = match crate::serve::start(&config, &serve, shutdown.cancelled_owned()).await {
        Ok(s) => s,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "{error}");
            return ExitCode::from(error.exit_code());
        }
    };
    println!("batch api on http://{}", server.addr);
    match server.wait().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "{error}");
            ExitCode::from(error.exit_code())
        }
    }
}
