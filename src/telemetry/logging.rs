//! Log setup: `tracing` with text or JSON lines to stderr.
//!
//! Logging must never hold up the service, least of all its shutdown: a
//! log line is handed to a background writer thread through a bounded
//! channel and never waited for. When the channel is full (stderr is a
//! pipe nobody reads) or stderr is closed (`sluicegate run 2>&1 | head -1`
//! after `head` exits), lines are dropped and counted
//! ([`dropped_lines`]) instead of blocking, failing or panicking. Colour
//! codes are written only when stderr is a terminal, so log files and
//! pipes hold plain text.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use serde::Serialize;

/// Log output format (`telemetry.log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LogFormat {
    /// Human-readable lines.
    #[serde(rename = "text")]
    Text,
    /// One JSON object per line.
    #[serde(rename = "json")]
    Json,
}

impl LogFormat {
    /// Every accepted spelling (the config's `choice` list).
    pub(crate) const CHOICES: &'static [(&'static str, Self)] =
        &[("text", Self::Text), ("json", Self::Json)];

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Json => "json",
        }
    }
}

/// Log lines that may wait for the writer thread before new ones are
/// dropped (a few seconds of a busy debug log).
const CAPACITY: usize = 4096;

/// Lines dropped because stderr was closed, failing or not keeping up.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Lines handed to the writer thread and not yet written (or dropped).
static PENDING: AtomicU64 = AtomicU64::new(0);
/// Set once stderr reports a closed pipe: later lines are not attempted.
static CLOSED: AtomicBool = AtomicBool::new(false);
/// The writer thread's inbox, started by the first [`init`].
static SENDER: OnceLock<Mutex<SyncSender<Vec<u8>>>> = OnceLock::new();

/// Installs the global subscriber. `directive` is an `EnvFilter` string
/// (e.g. `info` or `sluicegate=debug`); `RUST_LOG` wins when set. Calling
/// it twice keeps the first subscriber (tests call it freely).
pub fn init(format: LogFormat, directive: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(directive))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        // Our writer never reports an error; this also keeps
        // tracing-subscriber from `eprintln!`, which panics on a closed
        // stderr.
        .log_internal_errors(false)
        .with_writer(StderrLines);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// How many log lines were dropped so far (stderr closed, failing, or
/// slower than the log).
pub fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Waits up to `limit` for the lines already logged to reach stderr (at
/// exit, so the last lines are not lost); returns at once when stderr is
/// closed or nothing waits.
pub fn flush(limit: Duration) {
    let give_up = Instant::now() + limit;
    while PENDING.load(Ordering::Acquire) > 0
        && !CLOSED.load(Ordering::Relaxed)
        && Instant::now() < give_up
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The writer thread's inbox, starting the thread on first use (when the
/// thread cannot be started, stderr counts as closed: lines are dropped).
fn sender() -> SyncSender<Vec<u8>> {
    let cell = SENDER.get_or_init(|| {
        let (tx, rx) = sync_channel(CAPACITY);
        let started = std::thread::Builder::new()
            .name("sluicegate-log".into())
            .spawn(move || write_lines(&rx));
        if started.is_err() {
            CLOSED.store(true, Ordering::Relaxed);
        }
        Mutex::new(tx)
    });
    // A poisoned lock only means another thread panicked while cloning
    // the sender, which leaves it intact.
    cell.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The writer thread: writes each line to stderr; after a closed pipe it
/// only counts what it drops.
fn write_lines(rx: &Receiver<Vec<u8>>) {
    let mut stderr = std::io::stderr();
    for line in rx {
        if CLOSED.load(Ordering::Relaxed) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        } else if let Err(error) = stderr.write_all(&line) {
            if error.kind() == std::io::ErrorKind::BrokenPipe {
                CLOSED.store(true, Ordering::Relaxed);
            }
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        PENDING.fetch_sub(1, Ordering::Release);
    }
}

/// One log event's writer: the formatter writes the whole event in one
/// `write_all`, which becomes one line handed to the writer thread.
#[derive(Debug, Clone, Copy)]
struct StderrLines;

impl<'a> MakeWriter<'a> for StderrLines {
    type Writer = StderrLines;

    fn make_writer(&'a self) -> Self::Writer {
        StderrLines
    }
}

impl Write for StderrLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if CLOSED.load(Ordering::Relaxed) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return Ok(buf.len());
        }
        let tx = sender();
        PENDING.fetch_add(1, Ordering::AcqRel);
        match tx.try_send(buf.to_vec()) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                PENDING.fetch_sub(1, Ordering::AcqRel);
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writing_never_fails_and_flush_returns() {
        let mut w = StderrLines;
        assert_eq!(w.write(b"a log line\n").expect("never fails"), 11);
        flush(Duration::from_secs(2));
        assert_eq!(PENDING.load(Ordering::Acquire), 0);
    }
}
