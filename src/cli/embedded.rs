//! The embedded transport from the command line: `submit --embedded PATH`
//! and `results-embedded` (`run` with `transport = "embedded"` goes
//! through [`crate::app::run`] like every transport).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;

use crate::batch::input::parse_input;
use crate::queue::Queue;
use crate::queue::embedded::EmbeddedQueue;

/// Flags of `sluicegate results-embedded`.
#[derive(Debug, Args)]
pub(crate) struct ResultsEmbeddedArgs {
    /// The embedded store file.
    #[arg(long)]
    pub(crate) embedded: PathBuf,
    /// Queue name in the store (the same default as `submit --embedded`
    /// and `config/embedded.toml`).
    #[arg(long, default_value = crate::config::DEFAULT_QUEUE_NAME)]
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

/// Prints the results of a queue in an embedded store as JSON lines. The
/// store must exist (reading never creates one); a queue with no results
/// says on standard error whether messages are still waiting, or that the
/// queue is empty and which queues the store does hold.
pub(crate) fn results(args: &ResultsEmbeddedArgs) -> ExitCode {
    let queue = match EmbeddedQueue::open_existing(&args.embedded, args.queue.clone()) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match queue.results() {
        Ok(results) => {
            if results.is_empty() {
                explain_empty(&queue);
            }
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

/// Says on standard error why a queue printed no results: messages still
/// waiting (the worker has not answered them yet), or nothing at all in
/// this queue (most often a different queue name), naming the queues the
/// store holds.
fn explain_empty(queue: &EmbeddedQueue) {
    let name = queue.name();
    let path = queue.path().display();
    let waiting = queue.unsettled_count().unwrap_or(0);
    let dead = queue.dead_letter_count().unwrap_or(0);
    if waiting > 0 || dead > 0 {
        eprintln!(
            "queue `{name}` in {path}: no results yet; {waiting} messages waiting, {dead} dead letters"
        );
        return;
    }
    let others: Vec<String> = queue
        .queue_names()
        .unwrap_or_default()
        .into_iter()
        .filter(|q| q != name)
        .map(|q| format!("`{q}`"))
        .collect();
    if others.is_empty() {
        eprintln!("queue `{name}` in {path} has no messages and no results; the store is empty");
    } else {
        eprintln!(
            "queue `{name}` in {path} has no messages and no results; the store holds queues {} (pick one with --queue)",
            others.join(", ")
        );
    }
}
