//! `sluicegate batch`: an OpenAI batch file through a gate into the
//! gateway, resumable (see `docs/batch.md`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::batch::{BatchOptions, run_batch};
use crate::gate::DispatchGate;

/// Where request lines without an endpoint go: one rule for every
/// command (`run`'s `gateway.request_path` default is the same).
const DEFAULT_REQUEST_PATH: &str = "/v1/completions";

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
    /// Inference gateway base URL (as `run --gateway-url`; `--gateway` is
    /// the old spelling, still accepted).
    #[arg(long, alias = "gateway")]
    gateway_url: String,
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
    /// Path for request lines without an endpoint (OpenAI lines carry
    /// their own `url`); the same default as the config's
    /// `gateway.request_path`.
    #[arg(long, default_value = DEFAULT_REQUEST_PATH)]
    request_path: String,
    /// The endpoints lines may name, comma-separated: OpenAI's four by
    /// default; vLLM's `/v1/rerank`, `/v1/score`, `/classify` and
    /// `/pooling` are known too, and any other path is sent as it is.
    /// A line naming another endpoint is answered `invalid_request`.
    #[arg(long, value_delimiter = ',', default_values_t = crate::endpoint::Endpoints::default().paths().to_vec())]
    endpoints: Vec<String>,
    /// Deadline of lines without one, from the first run (e.g. `24h`,
    /// `90m`), as `submit --deadline`.
    #[arg(long, default_value = "24h")]
    deadline: String,
    /// The old spelling of `--deadline`, in seconds (hidden; kept so
    /// existing scripts work).
    #[arg(long, hide = true, conflicts_with = "deadline")]
    deadline_secs: Option<u64>,
    /// No progress display.
    #[arg(long)]
    quiet: bool,
}

/// Builds a gate from `--gate` and `--gate-params` for a queue of
/// `max_sys` requests in flight (the capacity composites and feedback
/// windows are measured against).
pub(crate) fn gate_from_flags(
    gate: &str,
    params: &str,
    max_sys: f64,
) -> Result<Box<dyn DispatchGate>, String> {
    let params: serde_json::Value =
        serde_json::from_str(params).map_err(|e| format!("--gate-params: not JSON: {e}"))?;
    crate::batch::build_gate_for_batch(gate, &params, max_sys)
}

/// Runs `sluicegate batch`.
pub(crate) async fn run(args: BatchArgs) -> ExitCode {
    crate::telemetry::logging::init(crate::telemetry::LogFormat::Text, "warn");
    let max_sys = f64::from(args.max_in_flight).max(1.0);
    let gate = match gate_from_flags(&args.gate, &args.gate_params, max_sys) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let deadline = match args.deadline_secs {
        Some(secs) => Duration::from_secs(secs),
        None => match crate::config::parse_duration(&args.deadline) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("--deadline: {e}");
                return ExitCode::from(super::EXIT_CONFIG);
            }
        },
    };
    let endpoints = match crate::endpoint::Endpoints::new(&args.endpoints) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("--endpoints: {e}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let mut options = BatchOptions::new(args.input, args.output, args.gateway_url);
    options.endpoints = endpoints;
    options.state = args.state;
    options.max_in_flight = f64::from(args.max_in_flight);
    options.max_attempts = (args.max_attempts > 0).then_some(args.max_attempts);
    options.request_path = args.request_path;
    options.deadline = deadline;
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        args: BatchArgs,
    }

    #[test]
    fn default_request_path_is_the_gateway_default() {
        let gateway = crate::config::GatewayConfig::default();
        assert_eq!(DEFAULT_REQUEST_PATH, gateway.request_path);
    }

    #[test]
    fn old_spellings_parse_as_the_new_ones() {
        let old = Wrap::try_parse_from([
            "x",
            "--input",
            "i",
            "--output",
            "o",
            "--gateway",
            "http://g",
            "--deadline-secs",
            "60",
        ])
        .expect("old spellings parse");
        assert_eq!(old.args.gateway_url, "http://g");
        assert_eq!(old.args.deadline_secs, Some(60));
        let new = Wrap::try_parse_from([
            "x",
            "--input",
            "i",
            "--output",
            "o",
            "--gateway-url",
            "http://g",
            "--deadline",
            "1m",
        ])
        .expect("new spellings parse");
        assert_eq!(new.args.deadline, "1m");
        assert!(
            Wrap::try_parse_from([
                "x",
                "--input",
                "i",
                "--output",
                "o",
                "--gateway-url",
                "g",
                "--deadline",
                "1m",
                "--deadline-secs",
                "5",
            ])
            .is_err(),
            "one deadline spelling at a time"
        );
    }
}
