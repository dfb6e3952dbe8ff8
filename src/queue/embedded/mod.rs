//! Embedded durable queue: the [`Queue`] contract on one SQLite file, for a
//! single machine without Redis or Pub/Sub.
//!
//! Why SQLite (`rusqlite`, bundled library) rather than `redb`: every
//! contract step is one SQL transaction (ack = insert the result *and*
//! delete the message, atomically), several processes may open the same
//! file safely (SQLite's file locks serialise writers, `BEGIN IMMEDIATE`
//! avoids upgrade deadlocks), and the file can be inspected with the
//! `sqlite3` shell. `redb` allows one process per file only.
//!
//! Files: `schema.rs` holds the tables and their migrations check; this
//! file holds the store and the [`Queue`] implementation.
//!
//! Durability: WAL journal with `synchronous = FULL`, so a committed
//! transaction survives a crash of the process or the machine. Leases are
//! stored as a tag and a wall-clock expiry on the message row, so a lease
//! held by a process that died simply expires and the message is delivered
//! again with a new tag; the dead holder's tag no longer matches, so it can
//! never acknowledge.

mod client;
mod idempotency;
mod lanes;
mod schema;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use tokio::sync::Notify;

use super::due::{DueProfile, HORIZONS};
use super::{
    AckReport, Completion, Delivery, DeliveryTag, Look, NackReason, Queue, QueueError, long_poll,
};
use crate::request::{AttemptRecord, parse_message};
use crate::result::ResultRecord;

pub use client::EmbeddedClient;
pub use lanes::TenantLanes;

/// How often an empty receive looks again for messages written by another
/// process (in-process writers wake receivers at once).
const POLL: Duration = Duration::from_millis(100);
/// How long a statement waits for another process's write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the store could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// SQLite refused an operation.
    #[error("embedded store {path}: {source}")]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },
    /// The file was written by an incompatible version of sluicegate.
    #[error(
        "embedded store {path}: schema version {found} is not supported (this build reads {expected})"
    )]
    Schema {
        /// The database file.
        path: PathBuf,
        /// Version found in the file.
        found: String,
        /// Version this build writes.
        expected: u32,
    },
    /// A reading command named a store file that does not exist (reading
    /// never creates a store: a mistyped path would read as empty).
    #[error(
        "embedded store {path} does not exist (`submit --embedded` or `run` creates it; check the path)"
    )]
    Missing {
        /// The file that was named.
        path: PathBuf,
    },
    /// Another process holds the store's exclusive owner lock.
    #[error(
        "embedded store {path} is in use by another sluicegate process (only one may own it); stop it or use another state directory"
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
}

impl From<EmbeddedError> for QueueError {
    fn from(e: EmbeddedError) -> Self {
        match &e {
            EmbeddedError::Sqlite {
                source: rusqlite::Error::SqliteFailure(f, _),
                ..
            } if matches!(
                f.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ) =>
            {
                QueueError::EmbeddedBusy(e)
            }
            _ => QueueError::Embedded(e),
        }
    }
}

/// A message that used up its attempts, with its last error.
#[derive(Debug, Clone)]
pub struct EmbeddedDeadLetter {
    /// The original message bytes.
    pub body: Bytes,
    /// The last error seen.
    pub last_error: ResultRecord,
}

/// What a stop does to a message a dispatcher has leased.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leased {
    /// Marks it: not sent, or aborted in flight (a cancel).
    Mark,
    /// Leaves it to finish (a batch's expiry).
    Leave,
}

/// What [`EmbeddedQueue::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbeddedCancel {
    /// This many waiting messages were removed and answered `CANCELLED`.
    Cancelled(u64),
    /// The id is only under a lease: a worker is sending it now.
    InFlight,
    /// No unsettled message has the id (finished, never submitted, or
    /// another queue).
    NotPending,
}

/// One queue in an embedded database file. Cheap to clone; clones share
/// one connection.
#[derive(Debug, Clone)]
pub struct EmbeddedQueue {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    queue: String,
    conn: Mutex<Connection>,
    /// Random per open: delivery tags from different processes never collide.
    nonce: u64,
    next_tag: AtomicU64,
    /// Wakes in-process receivers when this process enqueues or nacks.
    arrived: Notify,
    /// Claims take the heads of the tenant lanes (`lanes.rs`).
    lanes: Option<TenantLanes>,
}

/// Inserts `(bytes, deadline)` pairs into `queue`, visible from `now_ms`.
fn insert_messages(
    tx: &rusqlite::Transaction<'_>,
    queue: &str,
    items: &[(Bytes, i64)],
    now_ms: i64,
) -> rusqlite::Result<()> {
    let mut insert = tx.prepare_cached(
        "INSERT INTO messages (queue, deadline, body, retry_count, visible_at_ms) VALUES (?1, ?2, ?3, 0, ?4)",
    )?;
    for (body, deadline) in items {
        insert.execute(params![queue, deadline, body.as_ref(), now_ms])?;
    }
    Ok(())
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EmbeddedQueue {
    /// Opens (creating if needed) the database at `path` and the queue
    /// `queue` in it. Several processes may open the same file.
    pub fn open(path: impl AsRef<Path>, queue: impl Into<String>) -> Result<Self, EmbeddedError> {
        Self::open_with_lanes(path, queue, None)
    }

    /// [`EmbeddedQueue::open`] for a dispatcher with a fairness attribute:
    /// its claims take the heads of the tenant lanes round robin by weight,
    /// so every tenant's work reaches its fair buffer however deep the
    /// queue is (`lanes.rs`).
    pub fn open_with_lanes(
        path: impl AsRef<Path>,
        queue: impl Into<String>,
        lanes: Option<TenantLanes>,
    ) -> Result<Self, EmbeddedError> {
        let path = path.as_ref().to_path_buf();
        let conn = schema::open(&path)?;
        Ok(Self {
            inner: Arc::new(Inner {
                path,
                queue: queue.into(),
                conn: Mutex::new(conn),
                nonce: rand::random::<u64>(),
                next_tag: AtomicU64::new(0),
                arrived: Notify::new(),
                lanes,
            }),
        })
    }

    /// Opens the queue `queue` of a store that must already exist: for
    /// commands that only read, so a mistyped path is an error naming it
    /// instead of a new empty store.
    pub fn open_existing(
        path: impl AsRef<Path>,
        queue: impl Into<String>,
    ) -> Result<Self, EmbeddedError> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(EmbeddedError::Missing {
                path: path.to_path_buf(),
            });
        }
        Self::open(path, queue)
    }

    /// Every queue name the store holds messages, results or dead letters
    /// for, sorted (to name the right one when a queue reads as empty).
    pub fn queue_names(&self) -> Result<Vec<String>, EmbeddedError> {
        self.inner.read(|c, _| {
            let mut s = c.prepare(
                "SELECT queue FROM messages UNION SELECT queue FROM results UNION SELECT queue FROM dead_letters ORDER BY queue",
            )?;
            s.query_map([], |r| r.get(0))?.collect()
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Enqueues message bytes ordered by their deadline (read from the
    /// bytes; unparsable messages get deadline 0 so they are answered
    /// first), and sets `meta` keys, all in one transaction.
    pub fn enqueue(&self, bodies: &[Bytes], meta: &[(&str, &str)]) -> Result<(), EmbeddedError> {
        let items: Vec<(Bytes, i64)> = bodies
            .iter()
            .map(|b| {
                let deadline = parse_message(b).map_or(0, |m| m.request.deadline);
                (b.clone(), deadline)
            })
            .collect();
        self.enqueue_with_deadlines(&items, meta)
    }

    /// Enqueues `(bytes, deadline)` pairs and sets `meta` keys in one
    /// transaction.
    pub fn enqueue_with_deadlines(
        &self,
        items: &[(Bytes, i64)],
        meta: &[(&str, &str)],
    ) -> Result<(), EmbeddedError> {
        let now = crate::clock::unix_millis();
        self.inner.write(|tx, queue| {
            insert_messages(tx, queue, items, now)?;
            for (key, value) in meta {
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    params![key, value],
                )?;
            }
            Ok(())
        })?;
        self.inner.arrived.notify_waiters();
        Ok(())
    }

    /// A `meta` value (free-form keys shared by every queue in the file).
    pub fn meta(&self, key: &str) -> Result<Option<String>, EmbeddedError> {
        self.inner.read(|c, _| {
            c.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
                .optional()
        })
    }

    /// Forgets a `meta` key (nothing when it is absent).
    pub fn remove_meta(&self, key: &str) -> Result<(), EmbeddedError> {
        self.inner.write(|tx, _| {
            tx.execute("DELETE FROM meta WHERE key = ?1", [key])
                .map(drop)
        })
    }

    /// Results written so far for this queue, in write order.
    pub fn results(&self) -> Result<Vec<ResultRecord>, EmbeddedError> {
        let rows: Vec<String> = self.inner.read(|c, queue| {
            let mut s = c.prepare("SELECT record FROM results WHERE queue = ?1 ORDER BY seq")?;
            s.query_map([queue], |r| r.get(0))?.collect()
        })?;
        Ok(rows
            .iter()
            .filter_map(|r| serde_json::from_str(r).ok())
            .collect())
    }

    /// How many results this queue has.
    pub fn result_count(&self) -> Result<u64, EmbeddedError> {
        self.count("SELECT COUNT(*) FROM results WHERE queue = ?1")
    }

    /// Dead letters of this queue, oldest first.
    pub fn dead_letters(&self) -> Result<Vec<EmbeddedDeadLetter>, EmbeddedError> {
        let rows: Vec<(Vec<u8>, String)> = self.inner.read(|c, queue| {
            let mut s = c.prepare(
                "SELECT body, last_error FROM dead_letters WHERE queue = ?1 ORDER BY seq",
            )?;
            s.query_map([queue], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })?;
        Ok(rows
            .into_iter()
            .filter_map(|(body, e)| {
                Some(EmbeddedDeadLetter {
                    body: Bytes::from(body),
                    last_error: serde_json::from_str(&e).ok()?,
                })
            })
            .collect())
    }

    /// How many dead letters this queue has.
    pub fn dead_letter_count(&self) -> Result<u64, EmbeddedError> {
        self.count("SELECT COUNT(*) FROM dead_letters WHERE queue = ?1")
    }

    /// Messages not yet settled (waiting, delayed or leased).
    pub fn unsettled_count(&self) -> Result<u64, EmbeddedError> {
        self.count("SELECT COUNT(*) FROM messages WHERE queue = ?1")
    }

    /// Ids of this queue's unsettled messages (waiting, delayed or
    /// leased), sorted, without repeats: what `submit --embedded` checks a
    /// new file against.
    pub fn pending_ids(&self) -> Result<Vec<String>, EmbeddedError> {
        let bodies: Vec<Vec<u8>> = self.inner.read(|c, queue| {
            let mut s = c.prepare("SELECT body FROM messages WHERE queue = ?1")?;
            s.query_map([queue], |r| r.get(0))?.collect()
        })?;
        let mut ids: Vec<String> = bodies
            .iter()
            .filter_map(|b| parse_message(b).ok().map(|m| m.request.id))
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// Cancels the waiting messages with id `id`: each is removed and
    /// answered with a `CANCELLED` result, in one transaction. A message
    /// under an unexpired lease is in flight and left alone (its worker
    /// answers it).
    pub fn cancel(&self, id: &str) -> Result<EmbeddedCancel, EmbeddedError> {
        Ok(match self.cancel_where(|candidate| candidate == id)? {
            (0, 0) => EmbeddedCancel::NotPending,
            (0, _) => EmbeddedCancel::InFlight,
            (n, _) => EmbeddedCancel::Cancelled(n),
        })
    }

    /// [`EmbeddedQueue::cancel`] for every message whose id `matches`, in
    /// one pass over the queue (the Batch API cancels a whole batch at
    /// once); returns `(cancelled, in flight)`.
    pub fn cancel_where(
        &self,
        matches: impl Fn(&str) -> bool,
    ) -> Result<(u64, u64), EmbeddedError> {
        self.cancel_matching(matches, Leased::Mark, |_, _| {})
    }

    /// [`EmbeddedQueue::cancel`] for each of `ids`, in one pass over the
    /// queue: what each came to, in the order given.
    pub fn cancel_ids(&self, ids: &[String]) -> Result<Vec<EmbeddedCancel>, EmbeddedError> {
        self.stop_ids(ids, Leased::Mark)
    }

    /// [`EmbeddedQueue::cancel_ids`] that leaves leased messages unmarked:
    /// a dispatcher that holds one sends it (or has) and keeps its answer
    /// (a batch's expiry, `Client::expire`).
    pub fn expire_ids(&self, ids: &[String]) -> Result<Vec<EmbeddedCancel>, EmbeddedError> {
        self.stop_ids(ids, Leased::Leave)
    }

    fn stop_ids(
        &self,
        ids: &[String],
        leased: Leased,
    ) -> Result<Vec<EmbeddedCancel>, EmbeddedError> {
        let mut seen: HashMap<String, (u64, u64)> = HashMap::new();
        let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
        self.cancel_matching(
            |id| wanted.contains(id),
            leased,
            |id, leased| {
                let (cancelled, in_flight) = seen.entry(id.to_owned()).or_default();
                *if leased { in_flight } else { cancelled } += 1;
            },
        )?;
        Ok(ids
            .iter()
            .map(|id| match seen.get(id) {
                None => EmbeddedCancel::NotPending,
                Some((0, _)) => EmbeddedCancel::InFlight,
                Some((n, _)) => EmbeddedCancel::Cancelled(*n),
            })
            .collect())
    }

    /// The pass behind [`EmbeddedQueue::cancel_where`]; `each` hears every
    /// matching id and whether it was leased.
    fn cancel_matching(
        &self,
        matches: impl Fn(&str) -> bool,
        leased_ones: Leased,
        mut each: impl FnMut(&str, bool),
    ) -> Result<(u64, u64), EmbeddedError> {
        let now = crate::clock::unix_millis();
        self.inner.write(|tx, queue| {
            let rows: Vec<(i64, Vec<u8>, bool)> = {
                let mut s = tx.prepare(
                    "SELECT seq, body, lease_tag IS NOT NULL AND lease_expires_ms > ?2 FROM messages WHERE queue = ?1",
                )?;
                s.query_map(params![queue, now], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                    .collect::<rusqlite::Result<_>>()?
            };
            let (mut cancelled, mut in_flight) = (0u64, 0u64);
            for (seq, body, leased) in rows {
                let Ok(message) = parse_message(&body) else {
                    continue;
                };
                let id = message.request.id.as_str();
                if !matches(id) {
                    continue;
                }
                each(id, leased);
                if leased {
                    // Leased is not yet sent: a dispatcher may hold it in
                    // its lookahead or at a gate. The mark makes
                    // `Queue::cancelled` say so before it is sent (and
                    // its cancel watcher abort it in flight).
                    if leased_ones == Leased::Mark {
                        tx.execute(
                            "INSERT OR IGNORE INTO cancel_marks (seq) VALUES (?1)",
                            [seq],
                        )?;
                    }
                    in_flight += 1;
                    continue;
                }
                answer_cancelled(tx, queue, seq, &message, "cancelled before dispatch", now)?;
                cancelled += 1;
            }
            Ok((cancelled, in_flight))
        })
    }

    /// Withdraws each of `ids` that is still waiting (not under an
    /// unexpired lease): removed and answered `CANCELLED`, in one
    /// transaction. A leased one is left alone, unmarked: unlike
    /// [`EmbeddedQueue::cancel`] this never stops a request a dispatcher
    /// has taken (a flex request past `serve.flex_max_wait` that has
    /// started must still get its answer). Per id: whether it was
    /// withdrawn.
    pub fn withdraw_ids(&self, ids: &[String]) -> Result<Vec<bool>, EmbeddedError> {
        let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
        let now = crate::clock::unix_millis();
        let withdrawn: HashSet<String> = self.inner.write(|tx, queue| {
            let rows: Vec<(i64, Vec<u8>)> = {
                let mut s = tx.prepare(
                    "SELECT seq, body FROM messages WHERE queue = ?1 AND NOT (lease_tag IS NOT NULL AND lease_expires_ms > ?2)",
                )?;
                s.query_map(params![queue, now], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<rusqlite::Result<_>>()?
            };
            let mut withdrawn = HashSet::new();
            for (seq, body) in rows {
                let Ok(message) = parse_message(&body) else {
                    continue;
                };
                let id = message.request.id.as_str();
                if !wanted.contains(id) {
                    continue;
                }
                answer_cancelled(tx, queue, seq, &message, "withdrawn before dispatch", now)?;
                withdrawn.insert(id.to_owned());
            }
            Ok(withdrawn)
        })?;
        Ok(ids.iter().map(|id| withdrawn.contains(id)).collect())
    }

    /// Which of `ids` are under an unexpired lease now: taken by a
    /// dispatcher, so past the gate's window (a flex request has started,
    /// a background response is `in_progress`).
    pub fn leased_ids(&self, ids: &[String]) -> Result<Vec<bool>, EmbeddedError> {
        let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
        let now = crate::clock::unix_millis();
        let bodies: Vec<Vec<u8>> = self.inner.read(|c, queue| {
            let mut s = c.prepare(
                "SELECT body FROM messages WHERE queue = ?1 AND lease_tag IS NOT NULL AND lease_expires_ms > ?2",
            )?;
            s.query_map(params![queue, now], |r| r.get(0))?.collect()
        })?;
        let leased: HashSet<String> = (bodies.iter())
            .filter_map(|b| parse_message(b).ok().map(|m| m.request.id))
            .filter(|id| wanted.contains(id.as_str()))
            .collect();
        Ok(ids.iter().map(|id| leased.contains(id)).collect())
    }

    /// Results written after write position `after`, at most `limit`, each
    /// with its position: a reader that keeps the last position sees
    /// every result once, in write order (the Batch API's collector).
    pub fn results_after(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<(i64, ResultRecord)>, EmbeddedError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(i64, String)> = self.inner.read(|c, queue| {
            let mut s = c.prepare_cached(
                "SELECT seq, record FROM results WHERE queue = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
            )?;
            s.query_map(params![queue, after, limit], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })?;
        Ok(rows
            .into_iter()
            .filter_map(|(seq, r)| Some((seq, serde_json::from_str(&r).ok()?)))
            .collect())
    }

    /// Messages currently under an unexpired lease.
    pub fn leased_count(&self) -> Result<u64, EmbeddedError> {
        let now = crate::clock::unix_millis();
        self.inner
            .read(|c, queue| live_lease_deadlines(c, queue, now).map(|d| d.len() as u64))
    }

    /// Ends every lease of this queue at once, so a restarted sole owner
    /// does not wait for the leases of its dead predecessor to expire.
    /// Only correct when the caller knows no other process holds
    /// deliveries (see [`OwnerLock`]).
    pub fn release_all_leases(&self) -> Result<u64, EmbeddedError> {
        let n = self.inner.write(|tx, queue| {
            tx.execute(
                "UPDATE messages SET lease_tag = NULL, lease_expires_ms = NULL WHERE queue = ?1 AND lease_tag IS NOT NULL",
                [queue],
            )
        })?;
        self.inner.arrived.notify_waiters();
        Ok(n as u64)
    }

    fn count(&self, sql: &str) -> Result<u64, EmbeddedError> {
        self.inner.read(|c, queue| {
            c.query_row(sql, [queue], |r| r.get::<_, i64>(0))
                .map(|n| u64::try_from(n).unwrap_or(0))
        })
    }

    /// Runs a blocking store operation off the async runtime.
    async fn blocking<T, F>(&self, f: F) -> Result<T, QueueError>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T, EmbeddedError> + Send + 'static,
    {
        let inner = self.inner.clone();
        match tokio::task::spawn_blocking(move || f(&inner)).await {
            Ok(r) => r.map_err(QueueError::from),
            Err(e) => Err(QueueError::Task(e)),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the connection leaves no half-done
        // transaction behind (rusqlite rolls back on drop).
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, source: rusqlite::Error) -> EmbeddedError {
        EmbeddedError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&Connection, &str) -> rusqlite::Result<T>,
    ) -> Result<T, EmbeddedError> {
        let conn = self.lock();
        f(&conn, &self.queue).map_err(|e| self.err(e))
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction: all of it is durable,
    /// or none of it.
    fn write<T>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>, &str) -> rusqlite::Result<T>,
    ) -> Result<T, EmbeddedError> {
        let mut conn = self.lock();
        let run = |conn: &mut Connection| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let out = f(&tx, &self.queue)?;
            tx.commit()?;
            Ok(out)
        };
        run(&mut conn).map_err(|e| self.err(e))
    }

    fn new_tag(&self, seq: i64) -> String {
        let n = self.next_tag.fetch_add(1, Ordering::Relaxed);
        format!("{seq}.{:016x}.{n}", self.nonce)
    }

    /// Leases up to `max` messages that are visible (or whose lease
    /// expired); with `expired_by` (Unix s), only those whose deadline is
    /// at or before it, whether or not their delay has ended.
    fn take(
        &self,
        max: usize,
        lease: Duration,
        expired_by: Option<i64>,
    ) -> Result<Vec<Delivery>, EmbeddedError> {
        let now = crate::clock::unix_millis();
        let expires = now.saturating_add(ms(lease));
        let limit = i64::try_from(max.max(1)).unwrap_or(i64::MAX);
        self.write(|tx, queue| {
            let rows: Vec<lanes::Row> = match (&self.lanes, expired_by) {
                (Some(tenant_lanes), None) => {
                    lanes::heads(tx, queue, tenant_lanes, now, max.max(1))?
                }
                (None, None) => {
                    let mut s = tx.prepare_cached(&format!(
                        "SELECT seq, body, retry_count FROM messages
                         WHERE queue = ?1 AND {}
                         ORDER BY deadline, seq LIMIT ?3",
                        lanes::CLAIMABLE
                    ))?;
                    s.query_map(params![queue, now, limit], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                    })?
                    .collect::<rusqlite::Result<_>>()?
                }
                // The deadline sweep, whatever the tenant.
                (_, Some(by)) => {
                    let mut s = tx.prepare_cached(
                        "SELECT seq, body, retry_count FROM messages
                         WHERE queue = ?1 AND deadline <= ?4 AND (
                            lease_tag IS NULL OR lease_expires_ms <= ?2)
                         ORDER BY deadline, seq LIMIT ?3",
                    )?;
                    s.query_map(params![queue, now, limit, by], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                    })?
                    .collect::<rusqlite::Result<_>>()?
                }
            };
            // A row still carrying a (lapsed) lease was taken by a holder
            // that lost it, killed mid-request perhaps: it may have been
            // sent, so the reclaim counts as an attempt (issue 22).
            let mut update = tx.prepare_cached(
                "UPDATE messages SET lease_tag = ?1, lease_expires_ms = ?2,
                     retry_count = retry_count + (lease_tag IS NOT NULL)
                 WHERE seq = ?3 RETURNING retry_count",
            )?;
            let mut out = Vec::with_capacity(rows.len());
            for (seq, body, _) in rows {
                let tag = self.new_tag(seq);
                let retry_count: u32 =
                    update.query_row(params![tag, expires, seq], |r| r.get(0))?;
                out.push(Delivery {
                    tag: DeliveryTag(tag),
                    body: Bytes::from(body),
                    retry_count,
                    source_id: None,
                });
            }
            Ok(out)
        })
    }

    fn ack(&self, completions: Vec<Completion>) -> Result<AckReport, EmbeddedError> {
        let now = crate::clock::unix_millis();
        self.write(|tx, queue| {
            let mut report = AckReport::default();
            let mut find = tx.prepare_cached(
                "SELECT seq FROM messages WHERE lease_tag = ?1",
            )?;
            let mut insert = tx.prepare_cached(
                "INSERT OR IGNORE INTO results (queue, id, token, record, written_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            let mut delete = tx.prepare_cached("DELETE FROM messages WHERE seq = ?1")?;
            let mut unmark = tx.prepare_cached("DELETE FROM cancel_marks WHERE seq = ?1")?;
            for Completion { tag, result } in completions {
                let seq: Option<i64> = find
                    .query_row(params![tag.0], |r| r.get(0))
                    .optional()?;
                let Some(seq) = seq else {
                    report.lease_lost += 1;
                    continue;
                };
                // A result is plain strings and numbers: serialising cannot fail.
                let record = serde_json::to_string(&result).unwrap_or_default();
                let token = result.request_token.clone().unwrap_or_default();
                let written = insert.execute(params![queue, result.id, token, record, now])?;
                if written == 1 {
                    report.acked += 1;
                } else {
                    report.duplicates += 1;
                }
                delete.execute([seq])?;
                unmark.execute([seq])?;
            }
            Ok(report)
        })
    }

    fn nack(
        &self,
        tag: &DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> Result<(), EmbeddedError> {
        let visible = crate::clock::unix_millis().saturating_add(ms(delay));
        let add = i64::from(reason.counts_as_failure());
        self.write(|tx, _| {
            tx.execute(
                "UPDATE messages SET lease_tag = NULL, lease_expires_ms = NULL,
                 visible_at_ms = ?1, retry_count = retry_count + ?2 WHERE lease_tag = ?3",
                params![visible, add, tag.0],
            )
        })?;
        self.arrived.notify_waiters();
        Ok(())
    }

    /// [`Self::nack`] that keeps what the attempt learned in the stored
    /// message (`internal.attempts` and `internal.last_answer`, written
    /// as an envelope, as the Redis transport does), so a deadline that
    /// passes while it waits still answers with the last HTTP answer. An
    /// unparsable body is kept as it is.
    fn requeue_after_attempt(
        &self,
        tag: &DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: AttemptRecord,
    ) -> Result<(), EmbeddedError> {
        let visible = crate::clock::unix_millis().saturating_add(ms(delay));
        let add = i64::from(reason.counts_as_failure());
        self.write(|tx, _| {
            let body: Option<Vec<u8>> = tx
                .query_row(
                    "SELECT body FROM messages WHERE lease_tag = ?1",
                    params![tag.0],
                    |r| r.get(0),
                )
                .optional()?;
            let Some(body) = body else {
                // The lease was lost: its new holder answers.
                return Ok(0);
            };
            let body = match parse_message(&body) {
                Ok(mut message) => {
                    message.internal.attempts = Some(record.attempts);
                    if record.last_answer.is_some() {
                        message.internal.last_answer = record.last_answer;
                    }
                    message.to_envelope_json().into_bytes()
                }
                Err(_) => body,
            };
            tx.execute(
                "UPDATE messages SET lease_tag = NULL, lease_expires_ms = NULL,
                 visible_at_ms = ?1, retry_count = retry_count + ?2, body = ?3
                 WHERE lease_tag = ?4",
                params![visible, add, body, tag.0],
            )
        })?;
        self.arrived.notify_waiters();
        Ok(())
    }

    fn extend(&self, tags: &[DeliveryTag], lease: Duration) -> Result<(), EmbeddedError> {
        let now = crate::clock::unix_millis();
        let expires = now.saturating_add(ms(lease));
        self.write(|tx, _| {
            let mut s = tx
                .prepare_cached("UPDATE messages SET lease_expires_ms = ?1 WHERE lease_tag = ?2")?;
            for tag in tags {
                s.execute(params![expires, tag.0])?;
            }
            Ok(())
        })
    }

    fn dead_letter(
        &self,
        tag: &DeliveryTag,
        last_error: &ResultRecord,
    ) -> Result<(), EmbeddedError> {
        let now = crate::clock::unix_millis();
        let record = serde_json::to_string(last_error).unwrap_or_default();
        self.write(|tx, queue| {
            let row: Option<(i64, Vec<u8>)> = tx
                .query_row(
                    "SELECT seq, body FROM messages WHERE lease_tag = ?1",
                    params![tag.0],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            if let Some((seq, body)) = row {
                tx.execute(
                    "INSERT INTO dead_letters (queue, id, body, last_error, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![queue, last_error.id, body, record, now],
                )?;
                tx.execute("DELETE FROM messages WHERE seq = ?1", [seq])?;
            }
            Ok(())
        })
    }

    /// The waiting messages (as [`Self::backlog`] counts them) by time
    /// to deadline: every message of the queue counted on the covering
    /// `(queue, deadline, seq)` index, less those under a live lease (found
    /// through the lease index, as many as are in flight). Filtering on the
    /// lease columns in the counting statement itself visited every waiting
    /// row, body pages included, each poll interval: linear in the backlog,
    /// and most of the batch runner's CPU in issue 38's live runs (about 15
    /// CPU-s a 170 s run, 4 polls a second, 10 880 lines waiting).
    fn due(&self) -> Result<DueProfile, EmbeddedError> {
        let now_ms = crate::clock::unix_millis();
        let now = now_ms.div_euclid(1000);
        let [m1, m5, m15, h1, h4, d1] = HORIZONS.map(|h| now.saturating_add(h));
        self.read(|c, queue| {
            let (mut within, earliest) = c.query_row(
                "SELECT MIN(deadline), COUNT(*) FILTER (WHERE deadline <= ?2),
                        COUNT(*) FILTER (WHERE deadline <= ?3), COUNT(*) FILTER (WHERE deadline <= ?4),
                        COUNT(*) FILTER (WHERE deadline <= ?5), COUNT(*) FILTER (WHERE deadline <= ?6),
                        COUNT(*) FILTER (WHERE deadline <= ?7)
                 FROM messages INDEXED BY messages_order WHERE queue = ?1",
                params![queue, m1, m5, m15, h1, h4, d1],
                |r| {
                    let mut within = [0u64; HORIZONS.len()];
                    for (i, w) in within.iter_mut().enumerate() {
                        *w = u64::try_from(r.get::<_, i64>(i + 1)?).unwrap_or(0);
                    }
                    Ok((within, r.get::<_, Option<i64>>(0)?))
                },
            )?;
            let leased = live_lease_deadlines(c, queue, now_ms)?;
            if leased.is_empty() {
                return Ok(DueProfile::from_counts(within, earliest));
            }
            let in_flight = DueProfile::of(now, leased);
            for (w, l) in within.iter_mut().zip(in_flight.within) {
                *w = w.saturating_sub(l);
            }
            // The earliest waiting deadline: in deadline order, past the
            // leased rows (claims take the earliest first).
            let earliest = c
                .query_row(
                    "SELECT deadline FROM messages INDEXED BY messages_order
                     WHERE queue = ?1 AND (lease_tag IS NULL OR lease_expires_ms <= ?2)
                     ORDER BY deadline LIMIT 1",
                    params![queue, now_ms],
                    |r| r.get::<_, i64>(0),
                )
                .optional()?;
            Ok(DueProfile::from_counts(within, earliest))
        })
    }

    /// Messages not under a live lease: all of the queue's, counted on the
    /// covering index, less the leased ones (see [`Self::due`]).
    fn backlog(&self) -> Result<u64, EmbeddedError> {
        let now = crate::clock::unix_millis();
        self.read(|c, queue| {
            let all: i64 = c.query_row(
                "SELECT COUNT(*) FROM messages INDEXED BY messages_order WHERE queue = ?1",
                [queue],
                |r| r.get(0),
            )?;
            let leased = live_lease_deadlines(c, queue, now)?.len();
            Ok(u64::try_from(all)
                .unwrap_or(0)
                .saturating_sub(leased as u64))
        })
    }
}

/// The deadlines of `queue`'s messages under a lease that has not expired
/// at `now_ms`, read through the lease index: only the leased rows.
fn live_lease_deadlines(c: &Connection, queue: &str, now_ms: i64) -> rusqlite::Result<Vec<i64>> {
    let mut s = c.prepare_cached(
        "SELECT deadline FROM messages INDEXED BY messages_lease
         WHERE lease_tag IS NOT NULL AND queue = ?1 AND lease_expires_ms > ?2",
    )?;
    s.query_map(params![queue, now_ms], |r| r.get(0))?.collect()
}

/// Answers the waiting message at `seq` `CANCELLED` (saying `why`) and
/// removes it, inside the caller's transaction: what a cancel and a
/// withdrawal both do to a message no dispatcher has taken.
fn answer_cancelled(
    tx: &rusqlite::Transaction<'_>,
    queue: &str,
    seq: i64,
    message: &crate::request::Message,
    why: &str,
    now_ms: i64,
) -> rusqlite::Result<()> {
    let id = message.request.id.as_str();
    let result = ResultRecord::error(
        id,
        message.token(),
        crate::result::ErrorCode::Cancelled,
        why,
    );
    // A result is plain strings and numbers: serialising cannot fail.
    let record = serde_json::to_string(&result).unwrap_or_default();
    tx.execute(
        "INSERT OR IGNORE INTO results (queue, id, token, record, written_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![queue, id, message.token().unwrap_or_default(), record, now_ms],
    )?;
    tx.execute("DELETE FROM messages WHERE seq = ?1", [seq])?;
    Ok(())
}

impl Queue for EmbeddedQueue {
    fn name(&self) -> &str {
        &self.inner.queue
    }

    fn receive(
        &self,
        max: usize,
        lease: Duration,
        wait: Duration,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        // Woken by a push from this process; other processes' writes to the
        // file are seen at the next look, every `POLL`.
        Box::pin(long_poll(
            wait,
            Some(&self.inner.arrived),
            move || async move {
                let got = self.blocking(move |i| i.take(max, lease, None)).await?;
                Ok(Look::again_after(got, POLL))
            },
        ))
    }

    fn receive_expired(
        &self,
        max: usize,
        lease: Duration,
        now_unix: i64,
    ) -> BoxFuture<'_, Result<Vec<Delivery>, QueueError>> {
        if max == 0 {
            return Box::pin(std::future::ready(Ok(Vec::new())));
        }
        Box::pin(self.blocking(move |i| i.take(max, lease, Some(now_unix))))
    }

    fn ack(&self, completions: Vec<Completion>) -> BoxFuture<'_, Result<AckReport, QueueError>> {
        Box::pin(self.blocking(move |i| i.ack(completions)))
    }

    fn nack(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(self.blocking(move |i| i.nack(&tag, delay, reason)))
    }

    fn requeue_after_attempt(
        &self,
        tag: DeliveryTag,
        delay: Duration,
        reason: NackReason,
        record: AttemptRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(self.blocking(move |i| i.requeue_after_attempt(&tag, delay, reason, record)))
    }

    fn extend_lease(
        &self,
        tags: Vec<DeliveryTag>,
        lease: Duration,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(self.blocking(move |i| i.extend(&tags, lease)))
    }

    fn dead_letter(
        &self,
        tag: DeliveryTag,
        last_error: ResultRecord,
    ) -> BoxFuture<'_, Result<(), QueueError>> {
        Box::pin(self.blocking(move |i| i.dead_letter(&tag, &last_error)))
    }

    fn backlog(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(async move { self.blocking(|i| i.backlog()).await.map(Some) })
    }

    fn due(&self) -> BoxFuture<'_, Result<Option<DueProfile>, QueueError>> {
        Box::pin(async move { self.blocking(|i| i.due()).await.map(Some) })
    }

    fn records_cancels(&self) -> bool {
        true
    }

    fn cancelled(&self, tag: &DeliveryTag) -> BoxFuture<'_, bool> {
        let tag = tag.0.clone();
        Box::pin(async move {
            self.blocking(move |i| {
                i.read(|c, _| {
                    c.query_row(
                        "SELECT EXISTS (SELECT 1 FROM messages m JOIN cancel_marks k ON k.seq = m.seq WHERE m.lease_tag = ?1)",
                        [&tag],
                        |r| r.get::<_, bool>(0),
                    )
                })
            })
            .await
            // Unreadable: send it; a cancel is best effort for leased work.
            .unwrap_or(false)
        })
    }

    // `close` keeps the default: several workers may share one store, and
    // the dispatcher's drain has already handed back what this one held.

    fn outstanding(&self) -> BoxFuture<'_, Result<Option<u64>, QueueError>> {
        Box::pin(async move {
            self.blocking(|i| {
                i.read(|c, queue| {
                    c.query_row(
                        "SELECT COUNT(*) FROM messages WHERE queue = ?1",
                        [queue],
                        |r| r.get::<_, i64>(0),
                    )
                    .map(|n| u64::try_from(n).unwrap_or(0))
                })
            })
            .await
            .map(Some)
        })
    }
}

/// An exclusive claim on a store, held for the life of the value: a second
/// process asking for it gets [`EmbeddedError::Locked`]. The operating
/// system releases it when the holder dies, even by `kill -9`, so a crash
/// never leaves a stale lock behind.
///
/// Used by owners that must be alone (the batch runner, which ends the
/// leases of a dead predecessor at start). It is an open write transaction
/// on a small side file, `<store>.lock`.
#[derive(Debug)]
pub struct OwnerLock {
    _conn: Connection,
}

impl OwnerLock {
    /// Takes the owner lock of the store at `store_path`, or fails at once.
    pub fn acquire(store_path: &Path) -> Result<Self, EmbeddedError> {
        let mut lock_path = store_path.as_os_str().to_owned();
        lock_path.push(".lock");
        let path = PathBuf::from(lock_path);
        let sqlite = |source| EmbeddedError::Sqlite {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(sqlite)?;
        conn.execute_batch(
            "PRAGMA locking_mode = EXCLUSIVE; CREATE TABLE IF NOT EXISTS owner (pid INTEGER);",
        )
        .map_err(|e| locked_or(e, &path))?;
        // The first write under EXCLUSIVE locking mode takes the file lock
        // and keeps it until the connection closes.
        conn.execute(
            "INSERT INTO owner (pid) VALUES (?1)",
            [i64::from(std::process::id())],
        )
        .map_err(|e| locked_or(e, &path))?;
        Ok(Self { _conn: conn })
    }
}

fn locked_or(e: rusqlite::Error, path: &Path) -> EmbeddedError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(
                f.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ) =>
        {
            EmbeddedError::Locked {
                path: path.to_path_buf(),
            }
        }
        _ => EmbeddedError::Sqlite {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

#[cfg(test)]
mod tests;
