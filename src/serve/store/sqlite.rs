//! The store in one SQLite file (`<data_dir>/batches.db`): the embedded
//! transport's single-node deployment. Same durability settings as the
//! embedded queue (WAL, `synchronous = FULL`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, params};

use super::{KeyRecord, Recorded, ResultPage, StoreError, decode, encode};
use crate::serve::model::{BatchRecord, BatchStatus, FileRecord};

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = FULL;
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    record TEXT NOT NULL
);
-- The retention sweep's lookup; records without `expires_at` are NULL
-- here and never match.
CREATE INDEX IF NOT EXISTS files_expires_at ON files (json_extract(record, '$.expires_at'));
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS results (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    batch TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    ok INTEGER NOT NULL,
    line TEXT NOT NULL,
    UNIQUE (batch, custom_id)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- Bumped by every batch inserted against a tenant limit: the limit's
-- compare-and-set (`Store::insert_batch_if`).
CREATE TABLE IF NOT EXISTS tenant_versions (tenant TEXT PRIMARY KEY, version INTEGER NOT NULL);
-- `Idempotency-Key` records (`Store::claim_key`): removed with the file
-- they point to, or by the sweep once `expires_at` (Unix s) has passed.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    object_id TEXT NOT NULL,
    record TEXT NOT NULL,
    expires_at INTEGER,
    PRIMARY KEY (tenant, scope, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_object ON idempotency_keys (object_id);
CREATE TABLE IF NOT EXISTS counts (
    batch TEXT PRIMARY KEY,
    ok INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
";

/// The SQLite store. Cheap to clone; clones share one connection.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    path: PathBuf,
    conn: Arc<Mutex<Connection>>,
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let err = |source| StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        conn.execute_batch(super::responses::SQLITE_SCHEMA)
            .map_err(err)?;
        Ok(Self {
            path: path.to_path_buf(),
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Runs `f` on the connection off the async runtime.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (conn, path) = (self.conn.clone(), self.path.clone());
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut conn).map_err(|source| StoreError::Sqlite { path, source })
        })
        .await?
    }

    pub(super) async fn put_file(&self, file: &FileRecord) -> Result<(), StoreError> {
        let (id, tenant, record) = (file.id.clone(), file.tenant.clone(), encode(file));
        self.run(move |c| {
            c.execute(
                "INSERT INTO files (id, tenant, record) VALUES (?1, ?2, ?3) ON CONFLICT(id) DO UPDATE SET record = excluded.record",
                params![id, tenant, record],
            )
            .map(drop)
        })
        .await
    }

    pub(super) async fn file(&self, id: &str) -> Result<Option<FileRecord>, StoreError> {
        let key = id.to_owned();
        let text: Option<String> = self
            .run(move |c| {
                c.query_row("SELECT record FROM files WHERE id = ?1", [key], |r| {
                    r.get(0)
                })
                .optional()
            })
            .await?;
        text.map(|t| decode(id, &t)).transpose()
    }

    /// The file and the `Idempotency-Key` record that made it, together.
    pub(super) async fn delete_file(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.run(move |c| {
            let tx = c.transaction()?;
            tx.execute("DELETE FROM files WHERE id = ?1", [&id])?;
            tx.execute("DELETE FROM idempotency_keys WHERE object_id = ?1", [&id])?;
            tx.commit()
        })
        .await
    }

    pub(super) async fn claim_key(
        &self,
        tenant: &str,
        scope: &str,
        key: &str,
        record: &KeyRecord,
        expires_at: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let (tenant, scope, key) = (tenant.to_owned(), scope.to_owned(), key.to_owned());
        let (object, text) = (record.object_id.clone(), encode(record));
        let now = crate::clock::unix_secs();
        let name = key.clone();
        let found: Option<String> = self
            .run(move |c| {
                let tx = c.transaction()?;
                tx.execute(
                    "DELETE FROM idempotency_keys WHERE tenant = ?1 AND scope = ?2 AND key = ?3 AND expires_at <= ?4",
                    params![tenant, scope, key, now],
                )?;
                let found: Option<String> = tx
                    .query_row(
                        "SELECT record FROM idempotency_keys WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
                        params![tenant, scope, key],
                        |r| r.get(0),
                    )
                    .optional()?;
                if found.is_none() {
                    tx.execute(
                        "INSERT INTO idempotency_keys (tenant, scope, key, object_id, record, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                        params![tenant, scope, key, object, text, expires_at],
                    )?;
                }
                tx.commit()?;
                Ok(found)
            })
            .await?;
        found.map(|t| decode(&name, &t)).transpose()
    }

    pub(super) async fn forget_key(
        &self,
        tenant: &str,
        scope: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        let (tenant, scope, key) = (tenant.to_owned(), scope.to_owned(), key.to_owned());
        self.run(move |c| {
            c.execute(
                "DELETE FROM idempotency_keys WHERE tenant = ?1 AND scope = ?2 AND key = ?3",
                params![tenant, scope, key],
            )
            .map(drop)
        })
        .await
    }

    pub(super) async fn expired_files(&self, now: i64) -> Result<Vec<FileRecord>, StoreError> {
        let rows: Vec<(String, String)> = self
            .run(move |c| {
                let mut s = c.prepare_cached(
                    "SELECT id, record FROM files WHERE json_extract(record, '$.expires_at') <= ?1 ORDER BY seq",
                )?;
                s.query_map([now], |r| Ok((r.get(0)?, r.get(1)?)))?.collect()
            })
            .await?;
        rows.iter().map(|(id, t)| decode(id, t)).collect()
    }

    pub(super) async fn file_bytes(&self) -> Result<u64, StoreError> {
        let n: i64 = self
            .run(|c| {
                c.query_row(
                    "SELECT COALESCE(SUM(json_extract(record, '$.bytes')), 0) FROM files",
                    [],
                    |r| r.get(0),
                )
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    pub(super) async fn file_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        self.ids("files", tenant).await
    }

    async fn ids(&self, table: &'static str, tenant: &str) -> Result<Vec<String>, StoreError> {
        let tenant = tenant.to_owned();
        self.run(move |c| {
            let mut s = c.prepare(&format!(
                "SELECT id FROM {table} WHERE tenant = ?1 ORDER BY seq DESC"
            ))?;
            s.query_map([tenant], |r| r.get(0))?.collect()
        })
        .await
    }

    pub(super) async fn insert_batch(&self, batch: &BatchRecord) -> Result<(), StoreError> {
        let (id, tenant, status, record) = (
            batch.id.clone(),
            batch.tenant.clone(),
            batch.status.as_str(),
            encode(batch),
        );
        self.run(move |c| {
            c.execute(
                "INSERT INTO batches (id, tenant, status, record) VALUES (?1, ?2, ?3, ?4)",
                params![id, tenant, status, record],
            )
            .map(drop)
        })
        .await
    }

    pub(super) async fn tenant_version(&self, tenant: &str) -> Result<u64, StoreError> {
        let tenant = tenant.to_owned();
        let v: i64 = self
            .run(move |c| {
                c.query_row(
                    "SELECT version FROM tenant_versions WHERE tenant = ?1",
                    [tenant],
                    |r| r.get(0),
                )
                .optional()
                .map(Option::unwrap_or_default)
            })
            .await?;
        Ok(u64::try_from(v).unwrap_or(0))
    }

    pub(super) async fn insert_batch_if(
        &self,
        batch: &BatchRecord,
        version: u64,
    ) -> Result<bool, StoreError> {
        let (id, tenant, status, record) = (
            batch.id.clone(),
            batch.tenant.clone(),
            batch.status.as_str(),
            encode(batch),
        );
        let version = i64::try_from(version).unwrap_or(i64::MAX);
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let now: i64 = tx
                .query_row(
                    "SELECT version FROM tenant_versions WHERE tenant = ?1",
                    [&tenant],
                    |r| r.get(0),
                )
                .optional()?
                .unwrap_or_default();
            if now != version {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO tenant_versions (tenant, version) VALUES (?1, 1) ON CONFLICT(tenant) DO UPDATE SET version = version + 1",
                [&tenant],
            )?;
            tx.execute(
                "INSERT INTO batches (id, tenant, status, record) VALUES (?1, ?2, ?3, ?4)",
                params![id, tenant, status, record],
            )?;
            tx.commit()?;
            Ok(true)
        })
        .await
    }

    pub(super) async fn batch(&self, id: &str) -> Result<Option<BatchRecord>, StoreError> {
        let text = self.batch_text(id).await?;
        text.map(|t| decode(id, &t)).transpose()
    }

    pub(super) async fn batch_text(&self, id: &str) -> Result<Option<String>, StoreError> {
        let key = id.to_owned();
        self.run(move |c| {
            c.query_row("SELECT record FROM batches WHERE id = ?1", [key], |r| {
                r.get(0)
            })
            .optional()
        })
        .await
    }

    pub(super) async fn batch_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        self.ids("batches", tenant).await
    }

    pub(super) async fn replace_batch(
        &self,
        old_text: &str,
        _old_status: BatchStatus,
        new: &BatchRecord,
    ) -> Result<bool, StoreError> {
        let (id, old, status, new) = (
            new.id.clone(),
            old_text.to_owned(),
            new.status.as_str(),
            encode(new),
        );
        self.run(move |c| {
            c.execute(
                "UPDATE batches SET record = ?3, status = ?4 WHERE id = ?1 AND record = ?2",
                params![id, old, new, status],
            )
            .map(|n| n == 1)
        })
        .await
    }

    pub(super) async fn active_batches(&self) -> Result<Vec<BatchRecord>, StoreError> {
        let rows: Vec<(String, String)> = self
            .run(|c| {
                let mut s = c.prepare(
                    "SELECT id, record FROM batches WHERE status NOT IN ('failed', 'completed', 'expired', 'cancelled') ORDER BY seq",
                )?;
                s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect()
            })
            .await?;
        rows.iter().map(|(id, t)| decode(id, t)).collect()
    }

    pub(super) async fn record_results(
        &self,
        batch: &str,
        items: &[Recorded],
    ) -> Result<Vec<bool>, StoreError> {
        let (batch, items) = (batch.to_owned(), items.to_vec());
        // One transaction (one fsync) for the lot: a 50k-request cancel
        // would otherwise take minutes of fsyncs.
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let mut new = Vec::with_capacity(items.len());
            let (mut ok, mut failed) = (0i64, 0i64);
            {
                let mut insert = tx.prepare_cached(
                    "INSERT OR IGNORE INTO results (batch, custom_id, ok, line) VALUES (?1, ?2, ?3, ?4)",
                )?;
                for item in &items {
                    let added = insert.execute(params![batch, item.custom_id, item.ok, item.line])? == 1;
                    if added {
                        *(if item.ok { &mut ok } else { &mut failed }) += 1;
                    }
                    new.push(added);
                }
            }
            tx.execute(
                "INSERT INTO counts (batch, ok, failed) VALUES (?1, ?2, ?3) ON CONFLICT(batch) DO UPDATE SET ok = ok + ?2, failed = failed + ?3",
                params![batch, ok, failed],
            )?;
            tx.commit()?;
            Ok(new)
        })
        .await
    }

    pub(super) async fn counts(&self, batch: &str) -> Result<(u64, u64), StoreError> {
        let batch = batch.to_owned();
        let (ok, failed): (i64, i64) = self
            .run(move |c| {
                c.query_row(
                    "SELECT ok, failed FROM counts WHERE batch = ?1",
                    [batch],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map(Option::unwrap_or_default)
            })
            .await?;
        Ok((
            u64::try_from(ok).unwrap_or(0),
            u64::try_from(failed).unwrap_or(0),
        ))
    }

    pub(super) async fn result_page(
        &self,
        batch: &str,
        cursor: u64,
        n: usize,
    ) -> Result<ResultPage, StoreError> {
        let batch = batch.to_owned();
        let after = i64::try_from(cursor).unwrap_or(i64::MAX);
        let limit = i64::try_from(n).unwrap_or(i64::MAX);
        let rows: Vec<(i64, bool, String)> = self
            .run(move |c| {
                let mut s = c.prepare_cached(
                    "SELECT seq, ok, line FROM results WHERE batch = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
                )?;
                s.query_map(params![batch, after, limit], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?
                .collect()
            })
            .await?;
        let next = (rows.len() == n)
            .then(|| rows.last().map(|r| u64::try_from(r.0).unwrap_or(0)))
            .flatten();
        Ok((rows.into_iter().map(|(_, ok, l)| (ok, l)).collect(), next))
    }

    pub(super) async fn drop_results(&self, batch: &str) -> Result<(), StoreError> {
        let batch = batch.to_owned();
        self.run(move |c| {
            c.execute("DELETE FROM results WHERE batch = ?1", [batch])
                .map(drop)
        })
        .await
    }

    pub(super) async fn status_counts(&self) -> Result<Vec<(BatchStatus, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = self
            .run(|c| {
                let mut s = c.prepare("SELECT status, COUNT(*) FROM batches GROUP BY status")?;
                s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect()
            })
            .await?;
        Ok(BatchStatus::ALL
            .iter()
            .map(|s| {
                let n = rows.iter().find(|r| r.0 == s.as_str()).map_or(0, |r| r.1);
                (*s, u64::try_from(n).unwrap_or(0))
            })
            .collect())
    }

    /// The embedded queue's result position the collector has applied up
    /// to (0 at first), so a restart does not re-read every result.
    pub async fn collected_up_to(&self) -> Result<i64, StoreError> {
        self.run(|c| {
            c.query_row("SELECT value FROM meta WHERE key = 'collected'", [], |r| {
                r.get(0)
            })
            .optional()
            .map(Option::unwrap_or_default)
        })
        .await
    }

    /// Saves the collector's position (after applying what precedes it).
    pub async fn set_collected_up_to(&self, seq: i64) -> Result<(), StoreError> {
        self.run(move |c| {
            c.execute(
                "INSERT INTO meta (key, value) VALUES ('collected', ?1) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [seq],
            )
            .map(drop)
        })
        .await
    }
}
