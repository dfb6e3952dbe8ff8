//! Tables of the embedded store, and the version check on open.
//!
//! - `meta(key, value)`: schema version and free-form keys (the batch
//!   runner records the input it imported).
//! - `messages`: one row per unsettled message; a lease is the pair
//!   `lease_tag`, `lease_expires_ms` (wall clock). Order: `deadline`, then
//!   `seq` (FIFO among equal deadlines).
//! - `results`: one row per `(queue, id, token)`: the unique key is what
//!   makes the first result win.
//! - `dead_letters`: messages that used up their attempts, with the last
//!   error.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use super::{BUSY_TIMEOUT, EmbeddedError};

/// Version of the tables this build reads and writes.
pub(super) const SCHEMA_VERSION: u32 = 1;

const TABLES: &str = "
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    queue            TEXT    NOT NULL,
    deadline         INTEGER NOT NULL,
    body             BLOB    NOT NULL,
    retry_count      INTEGER NOT NULL DEFAULT 0,
    visible_at_ms    INTEGER NOT NULL,
    lease_tag        TEXT,
    lease_expires_ms INTEGER
);
CREATE INDEX IF NOT EXISTS messages_order ON messages (queue, deadline, seq);
CREATE UNIQUE INDEX IF NOT EXISTS messages_lease ON messages (lease_tag);
CREATE TABLE IF NOT EXISTS results (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    queue         TEXT    NOT NULL,
    id            TEXT    NOT NULL,
    token         TEXT    NOT NULL,
    record        TEXT    NOT NULL,
    written_at_ms INTEGER NOT NULL,
    UNIQUE (queue, id, token)
);
CREATE TABLE IF NOT EXISTS cancel_marks (
    seq INTEGER PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    queue      TEXT    NOT NULL,
    id         TEXT,
    body       BLOB    NOT NULL,
    last_error TEXT    NOT NULL,
    at_ms      INTEGER NOT NULL
);
";

/// Opens the file, sets durability pragmas, creates the tables and checks
/// the schema version.
pub(super) fn open(path: &Path) -> Result<Connection, EmbeddedError> {
    let err = |source| EmbeddedError::Sqlite {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // A missing directory shows up as SQLite's "unable to open" below.
        let _ = std::fs::create_dir_all(dir);
    }
    let conn = Connection::open(path).map_err(err)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(err)?;
    // WAL lets readers run beside the writer; FULL makes every commit
    // durable across a crash of the machine, not only of the process.
    conn.pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))
        .map_err(err)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(err)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(err)?;
    conn.execute_batch(TABLES).map_err(err)?;
    let found: Option<String> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(err)?;
    match found {
        None => {
            conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?1)",
                [SCHEMA_VERSION.to_string()],
            )
            .map_err(err)?;
        }
        Some(v) if v == SCHEMA_VERSION.to_string() => {}
        Some(found) => {
            return Err(EmbeddedError::Schema {
                path: path.to_path_buf(),
                found,
                expected: SCHEMA_VERSION,
            });
        }
    }
    Ok(conn)
}
