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
//! - `messages.tenant` and `lanes(queue, tenant)` (version 2): the tenant
//!   lanes of a dispatcher with a fairness attribute (`lanes.rs`); NULL
//!   until a claim files the row. A version 1 file gains them on open.
//! - `idempotency(queue, key)`: the submission an idempotency key
//!   records (JSON) and when it may go (`expires_at`, Unix s); written in
//!   the enqueue's transaction (`idempotency.rs`). A new table, made by
//!   `IF NOT EXISTS` on open: older builds never read it, so the version
//!   stays.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use super::{BUSY_TIMEOUT, EmbeddedError};

/// Version of the tables this build reads and writes.
pub(super) const SCHEMA_VERSION: u32 = 2;

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
    lease_expires_ms INTEGER,
    tenant           TEXT
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
CREATE TABLE IF NOT EXISTS lanes (
    queue  TEXT NOT NULL,
    tenant TEXT NOT NULL,
    PRIMARY KEY (queue, tenant)
);
CREATE TABLE IF NOT EXISTS idempotency (
    queue      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    record     TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (queue, key)
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

/// Indexes on `messages.tenant`, made once the column exists (after the
/// migration of a version 1 file).
const LANE_INDEXES: &str = "
CREATE INDEX IF NOT EXISTS messages_lane ON messages (queue, tenant, deadline, seq);
CREATE INDEX IF NOT EXISTS messages_unfiled ON messages (queue) WHERE tenant IS NULL;
";

/// Opens the file, sets durability pragmas, creates the tables, checks
/// the schema version and migrates a version 1 file.
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
        Some(v) if v == "1" => migrate_from_1(&conn).map_err(err)?,
        Some(found) => {
            return Err(EmbeddedError::Schema {
                path: path.to_path_buf(),
                found,
                expected: SCHEMA_VERSION,
            });
        }
    }
    conn.execute_batch(LANE_INDEXES).map_err(err)?;
    Ok(conn)
}

/// Version 1 → 2: the `tenant` column (the `lanes` table is made with the
/// others). In one write transaction that looks again, so two processes
/// opening the same old file migrate it once.
fn migrate_from_1(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let run = || -> rusqlite::Result<()> {
        let version: String = conn.query_row(
            "SELECT value FROM meta WHERE key = 'schema_version'",
            [],
            |r| r.get(0),
        )?;
        if version == "1" {
            conn.execute_batch("ALTER TABLE messages ADD COLUMN tenant TEXT")?;
            conn.execute(
                "UPDATE meta SET value = ?1 WHERE key = 'schema_version'",
                [SCHEMA_VERSION.to_string()],
            )?;
        }
        Ok(())
    };
    match run() {
        Ok(()) => conn.execute_batch("COMMIT"),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}
