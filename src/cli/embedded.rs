//! The embedded transport from the command line: `run` with
//! `transport = "embedded"`, `submit --embedded PATH` and
//! `results-embedded`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::batch::input::parse_input;
use crate::config::Config;
use crate::queue::Queue;
use crate::queue::embedded::EmbeddedQueue;

/// Flags of `sluicegate results-embedded`.
#[derive(Debug, Args)]
pub(crate) struct ResultsEmbeddedArgs {
    /// The embedded store file.
    #[arg(long)]
    pub(crate) embedded: PathBuf,
    /// Queue name in the store.
    #[arg(long, default_value = "batch")]
    pub(crate) queue: String,
}

/// `sluicegate submit --embedded PATH`: enqueues every valid line of
/// `file` into `queue` of the store at `store`, with `deadline_in` from now
/// for lines without a deadline; invalid lines are reported on standard
/// error with their line number and not enqueued (exit 1 if there were any).
pub(crate) fn submit(store: &Path, queue: &str, deadline_in: Duration, file: &Path) -> ExitCode {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let deadline = i64::try_from(now.saturating_add(deadline_in.as_secs())).unwrap_or(i64::MAX);
    let parsed = parse_input(&text, deadline);
    for bad in &parsed.invalid {
        eprintln!("skipped {}", bad.message);
    }
    let store_queue = match EmbeddedQueue::open(store, queue.to_owned()) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let items: Vec<(bytes::Bytes, i64)> = parsed
        .valid
        .iter()
        .map(|l| (l.body.clone(), l.deadline))
        .collect();
    if let Err(e) = store_queue.enqueue_with_deadlines(&items, &[]) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    println!(
        "submitted {} messages to queue `{}` in {}",
        items.len(),
        queue,
        store.display()
    );
    if parsed.invalid.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Prints the results of a queue in an embedded store as JSON lines.
pub(crate) fn results(args: &ResultsEmbeddedArgs) -> ExitCode {
    let queue = match EmbeddedQueue::open(&args.embedded, args.queue.clone()) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match queue.results() {
        Ok(results) => {
            for r in results {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `run` with the embedded transport: a long-running worker on the store
/// in `embedded.path`, one queue per `[[queue]]`, until SIGTERM/SIGINT.
/// Several workers may share one file (every step is a transaction and a
/// delivery tag fences each lease).
pub(crate) async fn run_worker(config: &Config, exit_when_done: bool) -> ExitCode {
    let path = config
        .embedded
        .as_ref()
        .map_or_else(|| PathBuf::from("sluicegate.db"), |e| e.path.clone());
    let mut stores = Vec::new();
    for q in &config.queues {
        match EmbeddedQueue::open(&path, q.queue_name.clone()) {
            Ok(store) => stores.push(store),
            Err(e) => {
                eprintln!("embedded.path: {e}");
                return ExitCode::from(super::EXIT_CONFIG);
            }
        }
    }
    let shutdown = CancellationToken::new();
    super::spawn_signal_handler(shutdown.clone());
    let queues: Vec<Arc<dyn Queue>> = stores
        .iter()
        .map(|s| Arc::new(s.clone()) as Arc<dyn Queue>)
        .collect();
    let running = match crate::app::start(config, queues, shutdown.clone()).await {
        Ok(r) => r,
        Err(error) => {
            eprintln!("cannot start: {error}");
            return ExitCode::from(super::EXIT_CONFIG);
        }
    };
    if exit_when_done {
        let stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let left: u64 = stores
                    .iter()
                    .map(|s| s.unsettled_count().unwrap_or(1))
                    .sum();
                if left == 0 {
                    stop.cancel();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    running.wait().await;
    ExitCode::SUCCESS
}
