//! Background response records (`crate::serve::background`) in both
//! stores. Every change after creation is a compare-and-set on the
//! record's text ([`Store::replace_response`]), so the collector, a
//! cancel and the in-progress probe never undo one another, and a result
//! delivered twice ends a response once.
//!
//! SQLite: a `responses` table beside the batches. Redis, under
//! `serve.key_prefix` (`P`): `P response:<id>` (the record),
//! `P responses-active` (a hash of unfinished ids → tenant, for the
//! bounds and the restart resume), `P responses-expiring` (terminal ids
//! scored by `expires_at`, for the retention sweep).

use rusqlite::{OptionalExtension, params};

use super::redis::RedisStore;
use super::sqlite::SqliteStore;
use super::{Store, StoreError, decode, encode};
use crate::serve::background::ResponseRecord;

/// The table, created when the store opens.
pub(super) const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    terminal INTEGER NOT NULL,
    expires_at INTEGER,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_active ON responses (terminal);
CREATE INDEX IF NOT EXISTS responses_expires_at ON responses (expires_at);
";

/// KEYS: record, active, expiring. ARGV: old, new, id, terminal (1/0),
/// expires_at (empty: none).
const REPLACE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] == '1' then redis.call('HDEL', KEYS[2], ARGV[3]) end
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[3], ARGV[5], ARGV[3]) end
return 1
";

impl Store {
    /// Saves a new background response.
    pub async fn insert_response(&self, r: &ResponseRecord) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.insert_response(r).await,
            Store::Redis(s) => s.insert_response(r).await,
        }
    }

    /// A background response by id, any tenant.
    pub async fn response(&self, id: &str) -> Result<Option<ResponseRecord>, StoreError> {
        let text = match self {
            Store::Sqlite(s) => s.response_text(id).await?,
            Store::Redis(s) => s.response_text(id).await?,
        };
        text.map(|t| decode(id, &t)).transpose()
    }

    /// Replaces `old` by `new` only if the stored record is still `old`.
    pub async fn replace_response(
        &self,
        old: &ResponseRecord,
        new: &ResponseRecord,
    ) -> Result<bool, StoreError> {
        let old = encode(old);
        match self {
            Store::Sqlite(s) => s.replace_response(&old, new).await,
            Store::Redis(s) => s.replace_response(&old, new).await,
        }
    }

    /// Forgets a background response.
    pub async fn delete_response(&self, id: &str) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(s) => s.delete_response(id).await,
            Store::Redis(s) => s.delete_response(id).await,
        }
    }

    /// The unfinished background responses whose queue message is not
    /// enqueued (a server died between storing and enqueuing them).
    pub async fn unenqueued_responses(&self) -> Result<Vec<ResponseRecord>, StoreError> {
        let texts = match self {
            Store::Sqlite(s) => s.unenqueued_response_texts().await?,
            Store::Redis(s) => s.active_response_texts().await?,
        };
        let records = (texts.iter())
            .map(|t| decode::<ResponseRecord>("response", t))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(records.into_iter().filter(|r| !r.enqueued).collect())
    }

    /// Unfinished background responses: `(tenant's, all)`, for the
    /// bounds at creation (a count, not a read of every record).
    pub async fn active_response_counts(&self, tenant: &str) -> Result<(u64, u64), StoreError> {
        match self {
            Store::Sqlite(s) => s.active_response_counts(tenant).await,
            Store::Redis(s) => s.active_response_counts(tenant).await,
        }
    }

    /// Whether several servers share this store (Redis): then a flex
    /// result one collects may be for a connection another holds.
    pub fn shares_replies(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// Keeps a flex result for the replica holding its connection, `ttl`
    /// long (a shared store only; nothing on SQLite's single server).
    pub async fn park_reply(
        &self,
        id: &str,
        text: &str,
        ttl: std::time::Duration,
    ) -> Result<(), StoreError> {
        match self {
            Store::Sqlite(_) => Ok(()),
            Store::Redis(s) => s.park_reply(id, text, ttl).await,
        }
    }

    /// Takes the parked results of `ids` (each taken once).
    pub async fn take_replies(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        match self {
            Store::Sqlite(_) => Ok(Vec::new()),
            Store::Redis(s) => s.take_replies(ids).await,
        }
    }

    /// Ids of the terminal responses whose `expires_at` is at or before
    /// `now`.
    pub async fn expired_responses(&self, now: i64) -> Result<Vec<String>, StoreError> {
        match self {
            Store::Sqlite(s) => s.expired_responses(now).await,
            Store::Redis(s) => s.expired_responses(now).await,
        }
    }

    /// Applies `change` to the stored response with compare-and-set,
    /// reading again when another writer changed it first; `None` when
    /// it is gone or `change` leaves it alone (returns `None`).
    pub async fn update_response(
        &self,
        id: &str,
        change: impl Fn(&ResponseRecord) -> Option<ResponseRecord>,
    ) -> Result<Option<ResponseRecord>, StoreError> {
        loop {
            let Some(old) = self.response(id).await? else {
                return Ok(None);
            };
            let Some(new) = change(&old) else {
                return Ok(None);
            };
            if self.replace_response(&old, &new).await? {
                return Ok(Some(new));
            }
        }
    }
}

impl SqliteStore {
    async fn insert_response(&self, r: &ResponseRecord) -> Result<(), StoreError> {
        let (id, tenant, terminal, expires, record) = (
            r.id.clone(),
            r.tenant.clone(),
            r.status.is_terminal(),
            r.expires_at,
            encode(r),
        );
        self.run(move |c| {
            c.execute(
                "INSERT INTO responses (id, tenant, terminal, expires_at, record) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id, tenant, terminal, expires, record],
            )
            .map(drop)
        })
        .await
    }

    async fn response_text(&self, id: &str) -> Result<Option<String>, StoreError> {
        let id = id.to_owned();
        self.run(move |c| {
            c.query_row("SELECT record FROM responses WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()
        })
        .await
    }

    async fn replace_response(&self, old: &str, new: &ResponseRecord) -> Result<bool, StoreError> {
        let (id, old, terminal, expires, record) = (
            new.id.clone(),
            old.to_owned(),
            new.status.is_terminal(),
            new.expires_at,
            encode(new),
        );
        self.run(move |c| {
            c.execute(
                "UPDATE responses SET record = ?3, terminal = ?4, expires_at = ?5 WHERE id = ?1 AND record = ?2",
                params![id, old, record, terminal, expires],
            )
            .map(|n| n == 1)
        })
        .await
    }

    async fn delete_response(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.run(move |c| {
            c.execute("DELETE FROM responses WHERE id = ?1", [id])
                .map(drop)
        })
        .await
    }

    async fn unenqueued_response_texts(&self) -> Result<Vec<String>, StoreError> {
        self.run(|c| {
            let mut s = c.prepare(
                "SELECT record FROM responses WHERE terminal = 0 AND json_extract(record, '$.enqueued') = 0",
            )?;
            s.query_map([], |r| r.get(0))?.collect()
        })
        .await
    }

    async fn active_response_counts(&self, tenant: &str) -> Result<(u64, u64), StoreError> {
        let tenant = tenant.to_owned();
        self.run(move |c| {
            c.query_row(
                "SELECT coalesce(sum(tenant = ?1), 0), count(*) FROM responses WHERE terminal = 0",
                [tenant],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)?.max(0) as u64,
                        r.get::<_, i64>(1)?.max(0) as u64,
                    ))
                },
            )
        })
        .await
    }

    async fn expired_responses(&self, now: i64) -> Result<Vec<String>, StoreError> {
        self.run(move |c| {
            let mut s = c.prepare(
                "SELECT id FROM responses WHERE terminal = 1 AND expires_at IS NOT NULL AND expires_at <= ?1",
            )?;
            s.query_map([now], |r| r.get(0))?.collect()
        })
        .await
    }
}

impl RedisStore {
    fn response_key(&self, id: &str) -> String {
        self.key(&["response:", id])
    }

    async fn insert_response(&self, r: &ResponseRecord) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("SET")
            .arg(self.response_key(&r.id))
            .arg(encode(r))
            .ignore();
        if !r.status.is_terminal() {
            pipe.cmd("HSET")
                .arg(self.key(&["responses-active"]))
                .arg(&r.id)
                .arg(&r.tenant)
                .ignore();
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    async fn response_text(&self, id: &str) -> Result<Option<String>, StoreError> {
        Ok(redis::cmd("GET")
            .arg(self.response_key(id))
            .query_async(&mut self.conn.clone())
            .await?)
    }

    async fn replace_response(&self, old: &str, new: &ResponseRecord) -> Result<bool, StoreError> {
        let done: i64 = redis::Script::new(REPLACE)
            .key(self.response_key(&new.id))
            .key(self.key(&["responses-active"]))
            .key(self.key(&["responses-expiring"]))
            .arg(old)
            .arg(encode(new))
            .arg(&new.id)
            .arg(if new.status.is_terminal() { "1" } else { "0" })
            .arg(new.expires_at.map_or_else(String::new, |at| at.to_string()))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    async fn delete_response(&self, id: &str) -> Result<(), StoreError> {
        redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(self.response_key(id))
            .ignore()
            .cmd("HDEL")
            .arg(self.key(&["responses-active"]))
            .arg(id)
            .ignore()
            .cmd("ZREM")
            .arg(self.key(&["responses-expiring"]))
            .arg(id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn active_response_texts(&self) -> Result<Vec<String>, StoreError> {
        let ids: Vec<String> = redis::cmd("HKEYS")
            .arg(self.key(&["responses-active"]))
            .query_async(&mut self.conn.clone())
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(text) = self.response_text(&id).await? {
                out.push(text);
            }
        }
        Ok(out)
    }

    async fn active_response_counts(&self, tenant: &str) -> Result<(u64, u64), StoreError> {
        let tenants: Vec<String> = redis::cmd("HVALS")
            .arg(self.key(&["responses-active"]))
            .query_async(&mut self.conn.clone())
            .await?;
        let mine = tenants.iter().filter(|t| *t == tenant).count() as u64;
        Ok((mine, tenants.len() as u64))
    }

    async fn park_reply(
        &self,
        id: &str,
        text: &str,
        ttl: std::time::Duration,
    ) -> Result<(), StoreError> {
        redis::cmd("SET")
            .arg(self.key(&["flex-reply:", id]))
            .arg(text)
            .arg("EX")
            .arg(ttl.as_secs().max(1))
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// `GETDEL` per id (one holder takes each), pipelined.
    async fn take_replies(&self, ids: &[String]) -> Result<Vec<String>, StoreError> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("GETDEL").arg(self.key(&["flex-reply:", id]));
        }
        let found: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
        Ok(found.into_iter().flatten().collect())
    }

    async fn expired_responses(&self, now: i64) -> Result<Vec<String>, StoreError> {
        Ok(redis::cmd("ZRANGEBYSCORE")
            .arg(self.key(&["responses-expiring"]))
            .arg("-inf")
            .arg(now)
            .query_async(&mut self.conn.clone())
            .await?)
    }
}
