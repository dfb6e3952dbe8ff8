//! Subcommands of the `sluicegate` binary. `main.rs` only parses the
//! command line and calls [`run`].

#![allow(clippy::print_stdout)] // A CLI prints its answers.

mod args;
mod batch;
mod bench;
mod cancel;
mod demo;
mod eval;
mod eval_live;
mod output;
mod probe;
mod pubsub;
mod results;
mod serve;
mod sim;
mod sim_sweep;
mod status;
mod submit;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::app::{ResultsOutput, RunOptions};
use crate::config::{Config, ConfigSources, Overrides, ServeConfig, TransportKind};

/// Exit code for configuration errors (as `check-config` documents).
pub(crate) const EXIT_CONFIG: u8 = crate::app::EXIT_CONFIG;

/// sluicegate: dispatches LLM batch work into an inference pool only as
/// fast as the pool has slack.
#[derive(Debug, Parser)]
#[command(name = "sluicegate", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the dispatcher until SIGTERM or SIGINT.
    Run(RunArgs),
    /// Validate a config file (with the environment): exit 0 and a summary,
    /// or exit 2 and every error.
    CheckConfig(ConfigArgs),
    /// Configuration commands.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// The pool simulator.
    #[command(subcommand)]
    Sim(SimCommand),
    /// Run an OpenAI batch file through a gate into the gateway
    /// (resumable: re-run the same command after Ctrl-C or a crash).
    Batch(batch::BatchArgs),
    /// The one-command demo: a simulated pool with interactive waves, a
    /// batch through a metric-driven gate, a report and a chart.
    Demo(demo::DemoArgs),
    /// Deprecated: `results --embedded PATH` (hidden; prints a notice).
    #[command(hide = true)]
    ResultsEmbedded(results::ResultsEmbeddedArgs),
    /// Enqueue requests (JSON lines or OpenAI Batch API lines) into a Redis
    /// queue or, with `--embedded PATH`, an embedded store.
    Submit(submit::SubmitArgs),
    /// Collect results from a Redis result list or, with `--embedded
    /// PATH`, an embedded store, as JSON lines (native or OpenAI batch
    /// output).
    Results(results::ResultsArgs),
    /// Cancel active submissions by id (Redis, or `--embedded PATH`).
    Cancel(cancel::CancelArgs),
    /// The submission an idempotency key records and its state: pending
    /// ids, results present (Redis, `--embedded PATH` or `--sql-url`).
    Status(status::StatusArgs),
    /// Serve the OpenAI Files and Batches API in front of the queue, with
    /// the dispatcher in the same process unless `serve.dispatcher =
    /// "separate"` (`docs/batch-api.md`).
    Serve(serve::ServeArgs),
    /// Benchmarks against real servers.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Dispatch gate commands.
    #[command(subcommand)]
    Gate(GateCommand),
    /// Google Cloud Pub/Sub tools.
    #[command(subcommand)]
    Pubsub(PubsubCommand),
    /// Gate quality in virtual time: every scenario without batch and with
    /// each gate and baseline, scored by harvest, excess SLO violations
    /// and tail inflation (`docs/gate-quality.md`).
    Eval(eval::EvalArgs),
}

#[derive(Debug, Subcommand)]
enum GateCommand {
    /// Evaluate a queue's gate once against the live sources and explain
    /// the budget (each source, raw values, D, B, max_SYS, N, open or
    /// closed and why). `--queue NAME` picks the queue.
    Probe(probe::ProbeArgs),
}

#[derive(Debug, Subcommand)]
enum PubsubCommand {
    /// Creates the request topic and subscription (retry policy, dead-letter
    /// topic, optionally exactly-once delivery) and the result topic and
    /// subscription; existing ones are left as they are.
    Setup(pubsub::SetupArgs),
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// Serve a simulated vLLM pool behind OpenAI-compatible HTTP, with vLLM
    /// and endpoint-picker metrics, until SIGTERM or SIGINT.
    Serve(sim::ServeArgs),
    /// A closed-loop concurrency sweep of one simulated replica, side by
    /// side with the llm-d H100 figures (calibration; virtual time).
    Sweep(sim_sweep::SweepArgs),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print the effective configuration (file + environment + flags),
    /// secrets redacted.
    Show(ConfigArgs),
}

/// Where the configuration comes from, and the flags that override it.
#[derive(Debug, Args)]
struct ConfigArgs {
    /// Config file (TOML); also `SLUICEGATE_CONFIG`.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Queue transport: memory, redis, pubsub, embedded.
    #[arg(long)]
    transport: Option<String>,
    /// Inference gateway base URL.
    #[arg(long)]
    gateway_url: Option<String>,
    /// Default request path on the gateway.
    #[arg(long)]
    request_path: Option<String>,
    /// Queue name (single-queue setups).
    #[arg(long)]
    queue: Option<String>,
    /// Address of /metrics, /healthz, /readyz.
    #[arg(long)]
    listen: Option<String>,
    /// Log format: text or json.
    #[arg(long)]
    log_format: Option<String>,
    /// Log filter directive, e.g. `info` or `sluicegate=debug`.
    #[arg(long)]
    log_level: Option<String>,
    /// Upstream's merge-policy JSON file (`type`, `parameters`), mapped
    /// onto `dispatch.merge_*`; also `SLUICEGATE_MERGE_POLICY_FILE`.
    #[arg(
        long = "request-merge-policy-config-file",
        alias = "request-merge-policy-config",
        value_name = "FILE"
    )]
    merge_policy_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Memory transport only: request messages to load (JSON lines).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Memory transport only: where to write results (JSON lines) at exit;
    /// standard output when absent. Messages still unsettled at exit are
    /// written to `<output>.unsettled.jsonl` (or standard error), so nothing
    /// is lost silently.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Memory and embedded transports: stop once every message is settled.
    #[arg(long)]
    exit_when_done: bool,
}

impl ConfigArgs {
    fn load(&self) -> Result<Config, ExitCode> {
        Config::load(&self.sources()).map_err(|errors| {
            eprintln!("configuration errors:\n{errors}");
            ExitCode::from(EXIT_CONFIG)
        })
    }

    fn sources(&self) -> ConfigSources {
        let overrides = Overrides {
            transport: self.transport.clone(),
            gateway_url: self.gateway_url.clone(),
            request_path: self.request_path.clone(),
            queue: self.queue.clone(),
            listen: self.listen.clone(),
            log_format: self.log_format.clone(),
            log_level: self.log_level.clone(),
        };
        let mut sources = ConfigSources::from_process(self.config.clone(), overrides);
        // The flag sets what its variable sets.
        if let Some(path) = &self.merge_policy_file {
            sources.env.insert(
                "SLUICEGATE_MERGE_POLICY_FILE".to_owned(),
                path.display().to_string(),
            );
        }
        sources
    }
}

/// Runs the parsed command line; the last log lines reach stderr before
/// it returns (briefly waited for, never blocking the exit).
pub async fn run(cli: Cli) -> ExitCode {
    let code = run_command(cli).await;
    crate::telemetry::logging::flush(std::time::Duration::from_secs(2));
    let dropped = crate::telemetry::logging::dropped_lines();
    if dropped > 0 {
        // Stderr may be the very thing that failed: best effort, no panic.
        let _ = writeln!(
            std::io::stderr(),
            "{dropped} log lines were dropped (stderr closed or not keeping up)"
        );
    }
    code
}

async fn run_command(cli: Cli) -> ExitCode {
    match cli.command {
        // Loading alone would approve a transport or gate `run` refuses:
        // the same preflight `run` starts with decides.
        // `[serve]` is checked too: `serve` would refuse what it refuses.
        Command::CheckConfig(args) => match (args.load(), ServeConfig::load(&args.sources())) {
            (Ok(_), Err(errors)) => {
                eprintln!("configuration errors:\n{errors}");
                ExitCode::from(EXIT_CONFIG)
            }
            (Err(code), _) => code,
            (Ok(_), Ok(serve)) if let Err(error) = crate::serve::check_access(&serve) => {
                eprintln!("configuration errors:\n{error}");
                ExitCode::from(error.exit_code())
            }
            (Ok(config), Ok(_)) => match crate::app::preflight(&config) {
                Ok(()) => {
                    println!("{}", config.summary());
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("configuration errors:\n{error}");
                    ExitCode::from(error.exit_code())
                }
            },
        },
        Command::Config(ConfigCommand::Show(args)) => match args.load() {
            Ok(config) => {
                println!("{}", config.to_redacted_toml());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Run(args) => run_dispatcher(args).await,
        Command::Batch(args) => batch::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::ResultsEmbedded(args) => results::run_embedded_alias(args).await,
        Command::Submit(args) => submit::run(args).await,
        Command::Results(args) => results::run(args).await,
        Command::Cancel(args) => cancel::run(args).await,
        Command::Status(args) => status::run(args).await,
        Command::Serve(args) => serve::run(args).await,
        Command::Bench(command) => bench::run(command).await,
        Command::Gate(GateCommand::Probe(args)) => probe::run(args).await,
        Command::Pubsub(PubsubCommand::Setup(args)) => pubsub::run_setup(args).await,
        Command::Eval(args) if args.is_live() => eval::run_live(args).await,
        // Virtual time on its own runtimes: off the async workers.
        Command::Eval(args) => tokio::task::spawn_blocking(move || eval::run(args))
            .await
            .unwrap_or(ExitCode::FAILURE),
        Command::Sim(SimCommand::Sweep(args)) => sim_sweep::run(args).await,
        Command::Sim(SimCommand::Serve(args)) => {
            crate::telemetry::logging::init(crate::telemetry::LogFormat::Text, "info");
            let shutdown = CancellationToken::new();
            spawn_signal_handler(shutdown.clone());
            match sim::serve(args, async move { shutdown.cancelled().await }).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("simulator: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn run_dispatcher(args: RunArgs) -> ExitCode {
    let config = match args.config.load() {
        Ok(c) => c,
        Err(code) => return code,
    };
    crate::telemetry::logging::init(config.telemetry.log_format, &config.telemetry.log_level);
    // The memory transport keeps nothing after exit: its results always go
    // somewhere (standard output when no file is named).
    let output = match (config.transport, args.output) {
        (TransportKind::Memory, Some(path)) => Some(ResultsOutput::File(path)),
        (TransportKind::Memory, None) => Some(ResultsOutput::Stdout),
        (_, Some(path)) => Some(ResultsOutput::File(path)),
        (_, None) => None,
    };
    let options = RunOptions {
        input: args.input,
        output,
        exit_when_done: args.exit_when_done,
        relay: None,
    };
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    match crate::app::run(&config, options, shutdown.cancelled_owned()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Not `eprintln!`: it panics when stderr is closed, and the
            // exit code still tells what happened.
            let _ = writeln!(std::io::stderr(), "{error}");
            ExitCode::from(error.exit_code())
        }
    }
}

/// Cancels `shutdown` on SIGTERM or SIGINT; a second signal exits at once.
/// The drain starts before anything is logged, so nothing about the log
/// (a closed or full stderr) can keep a signal from stopping the process.
fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        shutdown.cancel();
        tracing::info!("signal received; draining (send again to exit at once)");
        wait_for_signal().await;
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
