//! The `sql` transport from the command line: `submit --sql-url URL`,
//! `results --sql-url URL` and `cancel --sql-url URL`. Each is a thin
//! shell over [`SqlClient`] (`src/queue/sql/client.rs`), which holds the
//! statements.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::batch::input::{DuplicateIds, parse_input_with};
use crate::config::EndpointUrl;
use crate::queue::sql::SqlClient;

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Results read per statement.
const PAGE: usize = 1000;

async fn connect(url: &str) -> Result<SqlClient, ExitCode> {
    let parsed = match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "postgres" | "postgresql") => EndpointUrl::new(u),
        Ok(u) => {
            eprintln!(
                "--sql-url: expected a postgres:// or postgresql:// URL, got scheme {:?}",
                u.scheme()
            );
            return Err(ExitCode::from(super::EXIT_CONFIG));
        }
        Err(e) => {
            eprintln!("--sql-url: {e}");
            return Err(ExitCode::from(super::EXIT_CONFIG));
        }
    };
    SqlClient::open(&parsed, CONNECT_TIMEOUT)
        .await
        .map_err(|e| {
            eprintln!("{e}");
            ExitCode::FAILURE
        })
}

/// `submit --sql-url URL`: every valid line of `file` into `queue`, with
/// `deadline_in` from now for lines without one; the same line checks and
/// messages as the other transports.
pub(super) async fn submit(
    url: &str,
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
    let policy = match allow_duplicates {
        true => DuplicateIds::Allow,
        false => DuplicateIds::Refuse,
    };
    let parsed = parse_input_with(&text, deadline, policy);
    if let Some(code) = super::submit::report_lines(&parsed, allow_duplicates) {
        return code;
    }
    let client = match connect(url).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let ids: Vec<String> = parsed.valid.iter().map(|l| l.custom_id.clone()).collect();
    match client.active_ids(queue, &ids).await {
        Ok(active) => {
            let active: Vec<&str> = active.iter().map(String::as_str).collect();
            super::submit::warn_active(&active, "waiting in this queue");
        }
        // Only a warning depends on it: say so and carry on.
        Err(e) => eprintln!("warning: cannot check for ids already waiting: {e}"),
    }
    let items: Vec<(bytes::Bytes, i64)> = (parsed.valid.iter())
        .map(|l| (l.body.clone(), l.deadline))
        .collect();
    let inserted = match client.enqueue(queue, &items).await {
        Ok(n) => n,
        Err(e) => {
            eprintln!("sql: {e}; nothing submitted (one transaction per 1000 lines)");
            return ExitCode::FAILURE;
        }
    };
    println!("submitted {inserted} messages to queue `{queue}` (sql)");
    if parsed.invalid.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `results --sql-url URL`: the results of `route` after position
/// `after`, in write order (they stay in the table); the summary names
/// the last position, to pass as `--after` next time.
pub(super) async fn results(
    url: &str,
    route: &str,
    after: i64,
    format: super::results::Format,
    output: Option<&Path>,
) -> ExitCode {
    let client = match connect(url).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut sink = match super::results::Sink::open(output) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut cursor, mut got, mut errors) = (after, 0u64, 0u64);
    loop {
        let page = match client.results_after(route, cursor, PAGE).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("sql: {e}");
                return ExitCode::FAILURE;
            }
        };
        let Some(last) = page.last() else { break };
        cursor = last.seq;
        for stored in page {
            got += 1;
            let line = match (&stored.record, format) {
                (Some(r), super::results::Format::Openai) => {
                    super::results::openai_line(r, got).to_string()
                }
                _ => stored.raw,
            };
            if stored
                .record
                .as_ref()
                .is_none_or(|r| r.status_code.is_none_or(|s| !(200..300).contains(&s)))
            {
                errors += 1;
            }
            if let Err(e) = sink.line(&line) {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Err(e) = sink.flush() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    sink.summary(&format!(
        "collected {got} results from route `{route}` into {} ({errors} not 2xx); last position {cursor} (pass --after {cursor} to read only newer ones)",
        sink.name()
    ));
    ExitCode::SUCCESS
}

/// `cancel --sql-url URL`: the same lines and summary as the other
/// transports.
pub(super) async fn cancel(url: &str, queue: &str, route: &str, ids: &[String]) -> ExitCode {
    let client = match connect(url).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let (mut cancelled, mut inactive) = (0usize, 0usize);
    for id in ids {
        match client.cancel(queue, route, std::slice::from_ref(id)).await {
            Ok(done) if done.cancelled > 0 => {
                cancelled += 1;
                println!("{id}: cancelled");
            }
            Ok(done) if done.in_flight > 0 => {
                inactive += 1;
                println!(
                    "{id}: flagged (in flight: answered CANCELLED unless a worker already sent it)"
                );
            }
            Ok(_) => {
                inactive += 1;
                println!("{id}: not active (finished, expired or unknown)");
            }
            Err(error) => {
                eprintln!("{id}: sql: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{cancelled} cancelled, {inactive} not active");
    ExitCode::SUCCESS
}
