//! `sluicegate batch`: an OpenAI batch file through a gate into the
//! gateway, resumable (see `docs/batch.md`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::batch::{BatchOptions, run_batch};
use crate::config::GateSpec;
use crate::gate::{DispatchGate, GateContext, build_gate};

/// Exit code of a run stopped before every line had a result.
const EXIT_INTERRUPTED: u8 = 130;

/// Flags of `sluicegate batch`.
#[derive(Debug, Args)]
pub(crate) struct BatchArgs {
    /// Input: OpenAI Batch API lines (custom_id, method, url, body) or
    /// sluicegate request lines, one JSON object per line.
    #[arg(long)]
    input: PathBuf,
    /// Output: one line per input line, OpenAI batch output shape.
    #[arg(long)]
    output: PathBuf,
    /// Inference gateway base URL.
    #[arg(long)]
    gateway: String,
    /// Gate type, as in the config (`constant`, `local-max-concurrency`,
    /// `vllm`, `composite`, ...).
    #[arg(long, default_value = "constant")]
    gate: String,
    /// Gate parameters as JSON, as `gate_params` in the config.
    #[arg(long, default_value = "{}")]
    gate_params: String,
    /// State directory (resume data); default `<output>.state`.
    #[arg(long)]
    state: Option<PathBuf>,
    /// Batch requests in flight at budget 1 (`max_SYS`).
    #[arg(long, default_value_t = 64)]
    max_in_flight: u32,
    /// Failed attempts before a line ends as a dead letter (0 = until its
    /// deadline).
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// Path for request lines without an endpoint.
    #[arg(long, default_value = "/v1/chat/completions")]
    request_path: String,
    /// Deadline, in seconds from the first run, of lines without one.
    #[arg(long, default_value_t = 86_400)]
    deadline_secs: u64,
    /// No progress display.
    #[arg(long)]
    quiet: bool,
}

/// Builds a gate from `--gate` and `--gate-params`.
pub(crate) fn gate_from_flags(gate: &str, params: &str) -> Result<Box<dyn DispatchGate>, String> {
    let params: serde_json::Value =
        serde_json::from_str(params).map_err(|e| format!("--gate-params: not JSON: {e}"))?;
    let spec = GateSpec::parse(gate, &params, "--gate").map_err(|e| e.to_string())?;
    // No `[prometheus]` or `[redis]` section on this command line: gates
    // that need one report it; scrape gates (`vllm`, `endpoint-scrape`)
    // take their URLs from the parameters.
    let ctx = GateContext::new(
        None,
        None,
        Duration::from_millis(250),
        Duration::from_secs(10),
    );
    build_gate(&spec, &ctx).map_err(|e| format!("--gate: {e}"))
}

/// Runs `sluicegate batch`.
pub(crate) async fn run(args: BatchArgs) -> ExitCode {
    crate::telemetry::logging::init(crate::config::LogFormat::Text, "warn");
    let gate = match gate_from_flags(&args.gate, &args.gate_params) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let mut options = BatchOptions::new(args.input, args.output, args.gateway);
    options.state = args.state;
    options.max_in_flight = f64::from(args.max_in_flight);
    options.max_attempts = (args.max_attempts > 0).then_some(args.max_attempts);
    options.request_path = args.request_path;
    options.deadline = Duration::from_secs(args.deadline_secs);
    options.progress = !args.quiet;
    let shutdown = CancellationToken::new();
    super::spawn_signal_handler(shutdown.clone());
    match run_batch(&options, gate, None, shutdown).await {
        Ok((summary, _)) => {
            eprintln!("{summary}");
            if summary.interrupted {
                ExitCode::from(EXIT_INTERRUPTED)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("batch: {e}");
            ExitCode::FAILURE
        }
    }
}
