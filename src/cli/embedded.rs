//! The embedded transport from the command line: `submit --embedded PATH`
//! and the deprecated `results-embedded` alias of `results --embedded PATH`
//! (`run` with `transport = "embedded"` goes through [`crate::app::run`]
//! like every transport).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;

use crate::batch::input::{DuplicateIds, parse_input_with};
use crate::queue::Queue;
use crate::queue::embedded::EmbeddedQueue;

/// Flags of the deprecated `sluicegate results-embedded` (hidden; kept so
/// existing scripts work; `results --embedded PATH` replaces it).
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
/// Ids repeated inside the file refuse the whole file (nothing enqueued,
/// exit 2) unless `allow_duplicates`; ids already waiting in the queue
/// are warned about.
pub(crate) fn submit(
    store: &Path,
    queue: &str,
    deadline_in: Duration,
    file: &Path,
    allow_duplicates: bool,
) -> ExitCode {
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
    let policy = if allow_duplicates {
        DuplicateIds::Allow
    } else {
        DuplicateIds::Refuse
    };
    let parsed = parse_input_with(&text, deadline, policy);
    if let Some(code) = super::submit::report_lines(&parsed, allow_duplicates) {
        return code;
    }
    let store_queue = match EmbeddedQueue::open(store, queue.to_owned()) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match store_queue.pending_ids() {
        Ok(pending) => {
            let ids = parsed.valid.iter().map(|l| l.custom_id.as_str());
            let already: Vec<&str> = ids
                .filter(|id| pending.binary_search_by(|p| p.as_str().cmp(id)).is_ok())
                .collect();
            super::submit::warn_active(&already, "waiting in this queue");
        }
        // Only a warning depends on it: say so and carry on.
        Err(e) => eprintln!("warning: cannot check for ids already waiting: {e}"),
    }
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

/// The deprecated `sluicegate results-embedded`: a one-line notice on
/// standard error, then exactly what `results --embedded PATH` prints.
pub(crate) fn results(args: &ResultsEmbeddedArgs) -> ExitCode {
    eprintln!(
        "note: `results-embedded` is deprecated; use `sluicegate results --embedded PATH` (same output)"
    );
    super::results::embedded_results(
        &args.embedded,
        &args.queue,
        super::results::Format::Native,
        None,
    )
}

/// Says on standard error why a queue printed no results: messages still
/// waiting (the worker has not answered them yet), or nothing at all in
/// this queue (most often a different queue name), naming the queues the
/// store holds.
pub(super) fn explain_empty(queue: &EmbeddedQueue) {
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
