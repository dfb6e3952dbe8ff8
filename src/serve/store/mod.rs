//! Where file and batch records and per-request results live: one SQLite
//! file in the data directory with the embedded transport (`sqlite.rs`),
//! Redis with the Redis transport (`redis.rs`), so that every replica
//! behind a Service reads and writes the same records. File bodies are
//! never here (`super::files`).
//!
//! Every write that two servers may race on is a compare-and-set
//! ([`Store::replace_batch`]) or first-writer-wins
//! ([`Store::record_result`]), so replicas may all run the same loops.

mod redis;
mod responses;
mod sqlite;

pub use self::redis::{KeyScheme, RedisStore};
pub use self::sqlite::SqliteStore;

use super::model::{BatchRecord, BatchStatus, FileRecord};

/// A store operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite refused the operation.
    #[error("batch store {path}: {source}")]
    Sqlite {
        /// The database file.
        path: std::path::PathBuf,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// A Redis round trip failed.
    #[error("batch store: redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// A stored record could not be read back.
    #[error("batch store: corrupt record {key}: {source}")]
    Corrupt {
        /// The record's key or id.
        key: String,
        /// The decode error.
        #[source]
        source: serde_json::Error,
    },
    /// The blocking task of a SQLite operation failed.
    #[error("batch store: task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// A record as stored (JSON).
fn encode<T: serde::Serialize>(value: &T) -> String {
    // Records are strings, numbers and maps of strings: cannot fail.
    serde_json::to_string(value).unwrap_or_default()
}

/// A stored record read back; `key` names it in the error.
fn decode<T: serde::de::DeserializeOwned>(key: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|source| StoreError::Corrupt {
        key: key.to_owned(),
        source,
    })
}

/// One request's output line, to record.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The request's `custom_id`.
    pub custom_id: String,
    /// A 2xx answer (output file) or not (error file).
    pub ok: bool,
    /// The OpenAI output line.
    pub line: String,
}

/// One page of a batch's results: `(ok, output line)` pairs and the
/// cursor of the next page, `None` after the last.
pub type ResultPage = (Vec<(bool, String)>, Option<u64>);

/// What an `Idempotency-Key` records for one tenant on one endpoint
/// (`super::idempotency`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyRecord {
    /// SHA-256 of the request that made the object.
    pub fingerprint: String,
    /// The object it made (a file or batch id).
    pub object_id: String,
    /// When the key was claimed (Unix ms, the claimer's clock): the
    /// object is made after the claim, so until a grace has passed a
    /// record without its object may be one still in the making. Records
    /// written before this field read 0: old, so as before.
    #[serde(default)]
    pub claimed_at_ms: i64,
}

/// The configured store.
#[derive(Debug, Clone)]
pub enum Store {
    /// The embedded transport's single-node store.
    Sqlite(SqliteStore),
    /// Shared by replicas through Redis.
    Redis(RedisStore),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Store::Sqlite($s) => $e,
            Store::Redis($s) => $e,
        }
    };
}

impl Store {
    /// Saves a file record (new, or replacing one with the same id).
    pub async fn put_file(&self, file: &FileRecord) -> Result<(), StoreError> {
        both!(self, s => s.put_file(file).await)
    }

    /// Records `record` under `(tenant, scope, key)` unless something is
    /// recorded there; returns what was (`None`: this one went in). A
    /// record with `expires_at` (Unix s) may go after it.
    pub async fn claim_key(
        &self,
        tenant: &str,
        scope: &str,
        key: &str,
        record: &KeyRecord,
        expires_at: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        both!(self, s => s.claim_key(tenant, scope, key, record, expires_at).await)
    }

    /// Forgets the record under `(tenant, scope, key)` (nothing when
    /// absent).
    pub async fn forget_key(&self, tenant: &str, scope: &str, key: &str) -> Result<(), StoreError> {
        both!(self, s => s.forget_key(tenant, scope, key).await)
    }

    /// A file record by id, any tenant.
    pub async fn file(&self, id: &str) -> Result<Option<FileRecord>, StoreError> {
        both!(self, s => s.file(id).await)
    }

    /// Forgets a file record.
    pub async fn delete_file(&self, id: &str) -> Result<(), StoreError> {
        both!(self, s => s.delete_file(id).await)
    }

    /// Files whose `expires_at` is at or before `now` (Unix seconds).
    pub async fn expired_files(&self, now: i64) -> Result<Vec<FileRecord>, StoreError> {
        both!(self, s => s.expired_files(now).await)
    }

    /// Bytes of every stored file's body, by their records.
    pub async fn file_bytes(&self) -> Result<u64, StoreError> {
        both!(self, s => s.file_bytes().await)
    }

    /// A tenant's file ids, newest first.
    pub async fn file_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        both!(self, s => s.file_ids(tenant).await)
    }

    /// Saves a new batch record.
    pub async fn insert_batch(&self, batch: &BatchRecord) -> Result<(), StoreError> {
        both!(self, s => s.insert_batch(batch).await)
    }

    /// How many batches of `tenant` were inserted with
    /// [`Store::insert_batch_if`]: read before summing what the tenant's
    /// batches hold, so a reservation can be made conditional on it.
    pub async fn tenant_version(&self, tenant: &str) -> Result<u64, StoreError> {
        both!(self, s => s.tenant_version(tenant).await)
    }

    /// Saves a new batch only if its tenant's version is still `version`
    /// (and bumps it); `false` when another batch of the tenant was
    /// inserted meanwhile. Only insertions raise what a tenant holds, so
    /// a limit checked against the batches seen at `version` holds for
    /// the batch inserted here: concurrent creations cannot overshoot.
    pub async fn insert_batch_if(
        &self,
        batch: &BatchRecord,
        version: u64,
    ) -> Result<bool, StoreError> {
        both!(self, s => s.insert_batch_if(batch, version).await)
    }

    /// A batch record by id, any tenant.
    pub async fn batch(&self, id: &str) -> Result<Option<BatchRecord>, StoreError> {
        both!(self, s => s.batch(id).await)
    }

    /// A tenant's batch ids, newest first.
    pub async fn batch_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        both!(self, s => s.batch_ids(tenant).await)
    }

    /// Replaces `old` by `new` only if the stored record is still `old`
    /// (compare-and-set); `false` when another writer changed it first.
    ///
    /// The stores compare text. A record written by an older build encodes
    /// differently from the same record written now (a field added since
    /// is written with its default), so its text never equals `old`'s and
    /// every update of it would lose the race forever. When the text
    /// differs, the stored record still counts as `old` if it decodes to
    /// it, and is replaced from its own text.
    pub async fn replace_batch(
        &self,
        old: &BatchRecord,
        new: &BatchRecord,
    ) -> Result<bool, StoreError> {
        let expected = encode(old);
        if both!(self, s => s.replace_batch(&expected, old.status, new).await)? {
            return Ok(true);
        }
        let Some(stored) = both!(self, s => s.batch_text(&new.id).await)? else {
            return Ok(false);
        };
        if stored == expected || decode::<BatchRecord>(&new.id, &stored).ok().as_ref() != Some(old)
        {
            return Ok(false);
        }
        both!(self, s => s.replace_batch(&stored, old.status, new).await)
    }

    /// Every batch not in a terminal status.
    pub async fn active_batches(&self) -> Result<Vec<BatchRecord>, StoreError> {
        both!(self, s => s.active_batches().await)
    }

    /// Records requests' output lines, each once; per item `false` when
    /// the request already has one (a redelivered or re-read result).
    pub async fn record_results(
        &self,
        batch: &str,
        items: &[Recorded],
    ) -> Result<Vec<bool>, StoreError> {
        both!(self, s => s.record_results(batch, items).await)
    }

    /// `(ok, failed)` results recorded for a batch.
    pub async fn counts(&self, batch: &str) -> Result<(u64, u64), StoreError> {
        both!(self, s => s.counts(batch).await)
    }

    /// Up to `n` results from `cursor` (0 = the start).
    pub async fn result_page(
        &self,
        batch: &str,
        cursor: u64,
        n: usize,
    ) -> Result<ResultPage, StoreError> {
        both!(self, s => s.result_page(batch, cursor, n).await)
    }

    /// Forgets a finished batch's results (they are in its files now);
    /// its counts stay.
    pub async fn drop_results(&self, batch: &str) -> Result<(), StoreError> {
        both!(self, s => s.drop_results(batch).await)
    }

    /// How many batches are in each status.
    pub async fn status_counts(&self) -> Result<Vec<(BatchStatus, u64)>, StoreError> {
        both!(self, s => s.status_counts().await)
    }

    /// The queue result position the collector has applied up to (0 at
    /// first). Only the embedded queue keeps its results, so only its
    /// server has a position to remember; a Redis result list is consumed
    /// as it is read.
    pub async fn collected_up_to(&self) -> Result<i64, StoreError> {
        match self {
            Store::Sqlite(s) => s.collected_up_to().await,
            Store::Redis(_) => Ok(0),
        }
    }

    /// Saves the collector's position (see [`Store::collected_up_to`]).
    pub async fn set_collected_up_to(&self, position: i64) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.set_collected_up_to(position).await,
            Store::Redis(_) => Ok(()),
        }
    }

    /// The start of a batch's intake mark key, in this store's namespace
    /// (the mark lives with the queue: a `meta` row of the embedded queue
    /// file, or a Redis key beside the records).
    pub fn intake_mark_prefix(&self) -> String {
        match self {
            Store::Sqlite(_) => "serve.intake.".to_owned(),
            Store::Redis(s) => s.intake_mark_prefix(),
        }
    }
}
