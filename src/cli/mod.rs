//! Subcommands of the `sluicegate` binary. `main.rs` only parses the
//! command line and calls [`run`].

#![allow(clippy::print_stdout)] // A CLI prints its answers.

mod batch;
mod bench;
mod cancel;
mod demo;
mod embedded;
mod probe;
mod results;
mod submit;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigSources, Overrides, TransportKind};
use crate::queue::{MemoryQueue, Queue};

/// Exit code for configuration errors (as `check-config` documents).
pub(crate) const EXIT_CONFIG: u8 = 2;

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
    /// Print the results of a queue in an embedded store (JSON lines).
    ResultsEmbedded(embedded::ResultsEmbeddedArgs),
    /// Enqueue requests (JSON lines or OpenAI Batch API lines) into a Redis queue.
    Submit(submit::SubmitArgs),
    /// Collect results from a Redis result list into a JSON-lines file.
    Results(results::ResultsArgs),
    /// Cancel active submissions by id.
    Cancel(cancel::CancelArgs),
    /// Benchmarks against real servers.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Dispatch gate commands.
    #[command(subcommand)]
    Gate(GateCommand),
}

#[derive(Debug, Subcommand)]
enum GateCommand {
    /// Evaluate a queue's gate once against the live sources and explain
    /// the budget (each source, raw values, D, B, max_SYS, N, open or
    /// closed and why). `--queue NAME` picks the queue.
    Probe(probe::ProbeArgs),
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// Serve a simulated vLLM pool behind OpenAI-compatible HTTP, with vLLM
    /// and endpoint-picker metrics, until SIGTERM or SIGINT.
    Serve(crate::sim::ServeArgs),
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
        let overrides = Overrides {
            transport: self.transport.clone(),
            gateway_url: self.gateway_url.clone(),
            request_path: self.request_path.clone(),
            queue: self.queue.clone(),
            listen: self.listen.clone(),
            log_format: self.log_format.clone(),
            log_level: self.log_level.clone(),
        };
        let sources = ConfigSources::from_process(self.config.clone(), overrides);
        Config::load(&sources).map_err(|errors| {
            eprintln!("configuration errors:\n{errors}");
            ExitCode::from(EXIT_CONFIG)
        })
    }
}

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::CheckConfig(args) => match args.load() {
            Ok(config) => {
                println!("{}", config.summary());
                ExitCode::SUCCESS
            }
            Err(code) => code,
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
        Command::ResultsEmbedded(args) => embedded::results(&args),
        Command::Submit(args) => submit::run(args).await,
        Command::Results(args) => results::run(args).await,
        Command::Cancel(args) => cancel::run(args).await,
        Command::Bench(command) => bench::run(command).await,
        Command::Gate(GateCommand::Probe(args)) => probe::run(args).await,
        Command::Sim(SimCommand::Serve(args)) => {
            crate::telemetry::logging::init(crate::config::LogFormat::Text, "info");
            let shutdown = CancellationToken::new();
            spawn_signal_handler(shutdown.clone());
            match crate::sim::serve(args, async move { shutdown.cancelled().await }).await {
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
    if config.transport == TransportKind::Embedded {
        if args.input.is_some() || args.output.is_some() {
            eprintln!(
                "--input/--output are for the memory transport; feed the embedded store with `sluicegate submit --embedded PATH`"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
        return embedded::run_worker(&config, args.exit_when_done).await;
    }
    if config.transport == TransportKind::Redis {
        return run_redis(&config).await;
    }
    if config.transport != TransportKind::Memory {
        eprintln!(
            "transport: `{}` is not available in this build; available: memory, redis, embedded",
            config.transport.as_str()
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    if config.queues.len() != 1 && args.input.is_some() {
        eprintln!("--input needs exactly one configured queue");
        return ExitCode::from(EXIT_CONFIG);
    }
    let memory: Vec<Arc<MemoryQueue>> = config
        .queues
        .iter()
        .map(|q| Arc::new(MemoryQueue::new(q.queue_name.clone())))
        .collect();
    let mut loaded = 0usize;
    if let (Some(path), Some(queue)) = (&args.input, memory.first()) {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                    queue.push_message(line.to_owned());
                    loaded += 1;
                }
            }
            Err(error) => {
                eprintln!("--input: cannot read {}: {error}", path.display());
                return ExitCode::from(EXIT_CONFIG);
            }
        }
    }
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let queues: Vec<Arc<dyn Queue>> = memory.iter().map(|q| q.clone() as Arc<dyn Queue>).collect();
    let running = match crate::app::start(&config, queues, shutdown.clone()).await {
        Ok(r) => r,
        Err(error) => {
            eprintln!("cannot start: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.exit_when_done {
        let queues = memory.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let settled: usize = queues
                    .iter()
                    .map(|q| q.result_count() + q.dead_letters().len())
                    .sum();
                if settled >= loaded {
                    stop.cancel();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    running.wait().await;
    write_results(&memory, args.output.as_ref())
}

/// Runs the dispatcher on Redis queues until SIGTERM/SIGINT, then hands
/// every claim still held back to pending at once.
async fn run_redis(config: &Config) -> ExitCode {
    let redis_config = config
        .redis
        .clone()
        .unwrap_or_else(submit::default_redis_config);
    let (client, conn) = match submit::connect(&redis_config) {
        Ok(c) => c,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let addr = crate::queue::redis::masked_addr(&client);
    let mut probe = conn.clone();
    let ping = tokio::time::timeout(
        Duration::from_secs(3),
        redis::cmd("PING").query_async::<String>(&mut probe),
    )
    .await;
    match ping {
        Ok(Ok(_)) => tracing::info!(%addr, "redis reachable"),
        Ok(Err(error)) => {
            eprintln!(
                "redis at {addr} is unreachable: {error}; retrying in the background, not ready until it answers"
            );
            tracing::error!(%addr, %error, "redis unreachable; not ready until it answers");
        }
        Err(_) => {
            eprintln!(
                "redis at {addr} did not answer within 3s; retrying in the background, not ready until it answers"
            );
            tracing::error!(%addr, "redis did not answer; not ready until it answers");
        }
    }
    let redis_queues: Vec<Arc<crate::queue::redis::RedisQueue>> = config
        .queues
        .iter()
        .map(|q| {
            let mut settings = crate::queue::redis::RedisQueueSettings::new(q.queue_name.clone());
            // Precedence queue > message > default: only a list the queue
            // names overrides the message's.
            settings.result_list = q.result_queue_name.clone();
            settings.result_ttl_seconds = q.result_ttl_seconds;
            Arc::new(crate::queue::redis::RedisQueue::start(
                conn.clone(),
                settings,
            ))
        })
        .collect();
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let queues: Vec<Arc<dyn Queue>> = redis_queues
        .iter()
        .map(|q| q.clone() as Arc<dyn Queue>)
        .collect();
    let running = match crate::app::start(config, queues, shutdown).await {
        Ok(r) => r,
        Err(error) => {
            eprintln!("cannot start: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    running.wait().await;
    for queue in &redis_queues {
        match queue.release_all().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(queue = %queue.name(), released = n, "claims handed back"),
            Err(error) => {
                tracing::warn!(%error, "could not hand claims back; they return when their lease expires");
            }
        }
    }
    ExitCode::SUCCESS
}

/// Writes the memory queues' results as JSON lines, and hands on what is
/// still unsettled (the memory transport keeps nothing after exit).
fn write_results(queues: &[Arc<MemoryQueue>], output: Option<&PathBuf>) -> ExitCode {
    let mut results = String::new();
    let mut unsettled = String::new();
    let mut unsettled_count = 0usize;
    for queue in queues {
        for result in queue.results() {
            // A result is plain strings and numbers: serialising cannot fail.
            results.push_str(&serde_json::to_string(&result).unwrap_or_default());
            results.push('\n');
        }
        for dead in queue.dead_letters() {
            eprintln!(
                "dead letter: {}",
                serde_json::to_string(&dead.last_error).unwrap_or_default()
            );
        }
        for body in queue.unsettled() {
            unsettled.push_str(&String::from_utf8_lossy(&body));
            unsettled.push('\n');
            unsettled_count += 1;
        }
    }
    let written = match output {
        Some(path) => std::fs::write(path, &results).and_then(|()| {
            if unsettled_count == 0 {
                return Ok(());
            }
            let mut rest = path.clone().into_os_string();
            rest.push(".unsettled.jsonl");
            let rest = PathBuf::from(rest);
            eprintln!(
                "{unsettled_count} messages were not settled; written to {}",
                rest.display()
            );
            std::fs::write(rest, &unsettled)
        }),
        None => {
            if unsettled_count > 0 {
                eprintln!("{unsettled_count} messages were not settled:\n{unsettled}");
            }
            std::io::stdout().write_all(results.as_bytes())
        }
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("cannot write results: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Cancels `shutdown` on SIGTERM or SIGINT; a second signal exits at once.
fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("signal received; draining (send again to exit at once)");
        shutdown.cancel();
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
