//! Idempotency records in the embedded store: the `idempotency` table,
//! written in the same transaction as the messages a key accepted, so a
//! crash leaves both or neither.

use bytes::Bytes;
use rusqlite::{OptionalExtension, params};

use super::{EmbeddedError, EmbeddedQueue, insert_messages};

impl EmbeddedQueue {
    /// Enqueues `(bytes, deadline)` pairs with `record` under `key` (kept
    /// until `expires_at`, Unix s) in one transaction, unless this queue
    /// already records `key`: then nothing is written and the recorded
    /// text is returned. Records past their expiry are removed first.
    pub fn enqueue_idempotent(
        &self,
        items: &[(Bytes, i64)],
        key: &str,
        record: &str,
        expires_at: i64,
    ) -> Result<Option<String>, EmbeddedError> {
        let now_ms = crate::clock::unix_millis();
        let found = self.inner.write(|tx, queue| {
            tx.execute(
                "DELETE FROM idempotency WHERE queue = ?1 AND expires_at <= ?2",
                params![queue, now_ms / 1000],
            )?;
            let found: Option<String> = tx
                .query_row(
                    "SELECT record FROM idempotency WHERE queue = ?1 AND key = ?2",
                    params![queue, key],
                    |r| r.get(0),
                )
                .optional()?;
            if found.is_some() {
                return Ok(found);
            }
            insert_messages(tx, queue, items, now_ms)?;
            tx.execute(
                "INSERT INTO idempotency (queue, key, record, expires_at) VALUES (?1, ?2, ?3, ?4)",
                params![queue, key, record, expires_at],
            )?;
            Ok(None)
        })?;
        if found.is_none() {
            self.inner.arrived.notify_waiters();
        }
        Ok(found)
    }

    /// The record this queue keeps under `key`, unless it has expired.
    pub fn idempotency_record(&self, key: &str) -> Result<Option<String>, EmbeddedError> {
        let now = crate::clock::unix_secs();
        self.inner.read(|c, queue| {
            c.query_row(
                "SELECT record FROM idempotency WHERE queue = ?1 AND key = ?2 AND expires_at > ?3",
                params![queue, key, now],
                |r| r.get(0),
            )
            .optional()
        })
    }
}
