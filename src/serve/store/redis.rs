//! The store in Redis, so that replicas behind a Service agree. Keys,
//! under `serve.key_prefix` (`P`):
//!
//! - `P file:<id>`, `P batch:<id>`: the records as JSON;
//! - `P files:<tenant>`, `P batches:<tenant>`: sorted sets of ids, scored
//!   by a creation sequence (`P seq`) for newest-first listing;
//! - `P file-bytes`: a hash of each file's body size, `P bytes` their sum
//!   (the `batch_file_bytes` gauge), `P expiring`: file ids scored by
//!   `expires_at` (the retention sweep);
//! - `P tenant-version:<tenant>`: bumped by each batch inserted against
//!   the tenant's limits (`serve.tenant_limits`), their compare-and-set;
//! - `P active`: ids of batches not yet terminal; `P status`: a hash of
//!   batches per status (the `batches` gauge);
//! - `P results:<batch>`: the output lines in arrival order (list),
//!   `P seen:<batch>`: custom_ids with a result (hash, first wins),
//!   `P counts:<batch>`: `ok` / `failed` (hash), and `closed` once the
//!   batch finished (its results dropped: later copies are not recorded).
//!
//! The compare-and-set and first-writer-wins steps are Lua scripts, so no
//! replica sees half of one.
//!
//! On a Redis Cluster (`[redis] cluster = true`) a script or a `MULTI`
//! must stay in one hash slot, so the keys carry hash tags ([`KeyScheme`]):
//! with a prefix `P` that has no `{tag}` of its own, the records and
//! indexes become `{P}file:<id>`, `{P}batch:<id>`, `{P}active`, … (one
//! slot: the scripts above span them), and the per-batch result keys
//! `P results:{<batch>}`, `P seen:{<batch>}`, `P counts:{<batch>}` (the
//! batch's own slot, so results spread over the nodes). A prefix with a
//! tag keeps every key as on a single server, all in that tag's slot. On
//! one server (or a proxy) the names are the ones listed above.

use crate::redis::RedisConnection;

use super::{KeyRecord, Recorded, ResultPage, StoreError, decode, encode};
use crate::serve::model::{BatchRecord, BatchStatus, FileRecord};

/// KEYS: batch, active, status. ARGV: old, new, id, old status, new
/// status, terminal (1/0).
const REPLACE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] ~= ARGV[5] then
  redis.call('HINCRBY', KEYS[3], ARGV[4], -1)
  redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
end
if ARGV[6] == '1' then redis.call('SREM', KEYS[2], ARGV[3]) end
return 1
";

/// KEYS: file, tenant index, file-bytes, bytes, expiring. ARGV: record,
/// id, seq, bytes, expires_at (empty: none). A file written again (an
/// output file a take-over rewrites) replaces its size in the sum.
const PUT_FILE: &str = r"
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
local old = redis.call('HGET', KEYS[3], ARGV[2])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
redis.call('INCRBY', KEYS[4], ARGV[4])
if ARGV[5] == '' then
  redis.call('ZREM', KEYS[5], ARGV[2])
else
  redis.call('ZADD', KEYS[5], ARGV[5], ARGV[2])
end
return 1
";

/// KEYS: file, tenant index, file-bytes, bytes, expiring. ARGV: id.
const DELETE_FILE: &str = r"
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], old)
end
redis.call('ZREM', KEYS[5], ARGV[1])
return 1
";

/// KEYS: seen, results, counts. ARGV: custom_id, ok|failed, stored line.
/// A batch whose results were dropped (finished: `closed` in its counts)
/// takes no more: another replica's collector may apply a copy of a
/// result after the batch finished, when `seen` is gone.
const RECORD: &str = r"
if redis.call('HEXISTS', KEYS[3], 'closed') == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return 1
";

/// KEYS: results, seen, counts. The batch's results are in its files:
/// they go, and its counts are closed to later copies (`RECORD`).
const DROP_RESULTS: &str = r"
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[3], 'closed', 1)
return 1
";

/// KEYS: tenant version, batch, tenant index, seq, active, status. ARGV:
/// expected version, record, id, status. The batch is inserted only if
/// no other batch of the tenant was inserted against its limit since the
/// version was read, and bumps it (`Store::insert_batch_if`).
const INSERT_IF: &str = r"
if (tonumber(redis.call('GET', KEYS[1])) or 0) ~= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
local seq = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], seq, ARGV[3])
redis.call('SADD', KEYS[5], ARGV[3])
redis.call('HINCRBY', KEYS[6], ARGV[4], 1)
return 1
";

/// How the store names its keys (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyScheme {
    /// `serve.key_prefix`.
    prefix: String,
    /// Hash tags for a Redis Cluster.
    cluster: bool,
}

impl KeyScheme {
    /// Keys under `prefix`, hash-tagged when `cluster`.
    pub fn new(prefix: impl Into<String>, cluster: bool) -> Self {
        Self {
            prefix: prefix.into(),
            cluster,
        }
    }

    /// Whether the prefix tags the keys itself (or no tags are needed).
    fn plain(&self) -> bool {
        !self.cluster || crate::redis::hash_tag(&self.prefix).is_some()
    }

    /// A record or index key: `P<parts>`, on a cluster `{P}<parts>` (all
    /// in the prefix's slot; an empty prefix, which makes no tag, is
    /// tagged `{batchapi}`).
    pub fn key(&self, parts: &[&str]) -> String {
        match (self.plain(), self.prefix.is_empty()) {
            (true, _) => format!("{}{}", self.prefix, parts.concat()),
            (false, false) => format!("{{{}}}{}", self.prefix, parts.concat()),
            (false, true) => format!("{{batchapi}}{}", parts.concat()),
        }
    }

    /// One of a batch's result keys (`results:`, `seen:`, `counts:`):
    /// `P<kind><batch>`, on a cluster `P<kind>{<batch>}` (the batch's
    /// slot; the record script touches only these three).
    pub fn of_batch(&self, kind: &str, batch: &str) -> String {
        match self.plain() {
            true => format!("{}{kind}{batch}", self.prefix),
            false => format!("{}{kind}{{{batch}}}", self.prefix),
        }
    }
}

/// The Redis store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RedisStore {
    pub(super) conn: RedisConnection,
    keys: KeyScheme,
}

impl RedisStore {
    /// The store on `conn`, keys under `prefix` (hash-tagged when `conn`
    /// is a cluster connection).
    pub fn new(conn: RedisConnection, prefix: impl Into<String>) -> Self {
        let keys = KeyScheme::new(prefix, conn.is_cluster());
        Self { conn, keys }
    }

    pub(super) fn key(&self, parts: &[&str]) -> String {
        self.keys.key(parts)
    }

    /// The start of a batch's intake mark key: `<prefix>intake:` (the
    /// queue's client tags it into the queue's slot on a cluster).
    pub fn intake_mark_prefix(&self) -> String {
        format!("{}intake:", self.keys.prefix)
    }

    fn of_batch(&self, kind: &str, batch: &str) -> String {
        self.keys.of_batch(kind, batch)
    }

    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        let text: Option<String> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut self.conn.clone())
            .await?;
        text.map(|t| decode(key, &t)).transpose()
    }

    async fn put_listed(
        &self,
        key: &str,
        index: &str,
        id: &str,
        record: String,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let seq: i64 = redis::cmd("INCR")
            .arg(self.key(&["seq"]))
            .query_async(&mut conn)
            .await?;
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(key)
            .arg(record)
            .ignore()
            .cmd("ZADD")
            .arg(index)
            .arg(seq)
            .arg(id)
            .ignore()
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    async fn ids(&self, index: &str) -> Result<Vec<String>, StoreError> {
        Ok(redis::cmd("ZREVRANGE")
            .arg(index)
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn.clone())
            .await?)
    }

    pub(super) async fn put_file(&self, file: &FileRecord) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let seq: i64 = redis::cmd("INCR")
            .arg(self.key(&["seq"]))
            .query_async(&mut conn)
            .await?;
        redis::Script::new(PUT_FILE)
            .key(self.key(&["file:", &file.id]))
            .key(self.key(&["files:", &file.tenant]))
            .key(self.key(&["file-bytes"]))
            .key(self.key(&["bytes"]))
            .key(self.key(&["expiring"]))
            .arg(encode(file))
            .arg(&file.id)
            .arg(seq)
            .arg(file.bytes)
            .arg(
                file.expires_at
                    .map_or_else(String::new, |at| at.to_string()),
            )
            .invoke_async::<i64>(&mut conn)
            .await?;
        Ok(())
    }

    pub(super) async fn expired_files(&self, now: i64) -> Result<Vec<FileRecord>, StoreError> {
        let ids: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.key(&["expiring"]))
            .arg("-inf")
            .arg(now)
            .query_async(&mut self.conn.clone())
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(file) = self.file(&id).await? {
                out.push(file);
            }
        }
        Ok(out)
    }

    pub(super) async fn file_bytes(&self) -> Result<u64, StoreError> {
        let n: Option<i64> = redis::cmd("GET")
            .arg(self.key(&["bytes"]))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
    }

    pub(super) async fn file(&self, id: &str) -> Result<Option<FileRecord>, StoreError> {
        self.get(&self.key(&["file:", id])).await
    }

    pub(super) async fn delete_file(&self, id: &str) -> Result<(), StoreError> {
        let Some(file) = self.file(id).await? else {
            return Ok(());
        };
        redis::Script::new(DELETE_FILE)
            .key(self.key(&["file:", id]))
            .key(self.key(&["files:", &file.tenant]))
            .key(self.key(&["file-bytes"]))
            .key(self.key(&["bytes"]))
            .key(self.key(&["expiring"]))
            .arg(id)
            .invoke_async::<i64>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// `SET NX` (with `EXAT` when the record expires), then the value
    /// that was there when it was not set; a record that expired in
    /// between is claimed again.
    pub(super) async fn claim_key(
        &self,
        tenant: &str,
        scope: &str,
        key: &str,
        record: &KeyRecord,
        expires_at: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let name = self.key(&["idem:", scope, ":", tenant, ":", key]);
        let text = encode(record);
        let mut conn = self.conn.clone();
        loop {
            let mut set = redis::cmd("SET");
            set.arg(&name).arg(&text).arg("NX");
            if let Some(at) = expires_at {
                set.arg("EXAT").arg(at.max(1));
            }
            let done: Option<String> = set.query_async(&mut conn).await?;
            if done.is_some() {
                return Ok(None);
            }
            if let Some(found) = self.get(&name).await? {
                return Ok(Some(found));
            }
        }
    }

    pub(super) async fn forget_key(
        &self,
        tenant: &str,
        scope: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        redis::cmd("DEL")
            .arg(self.key(&["idem:", scope, ":", tenant, ":", key]))
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    pub(super) async fn file_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        self.ids(&self.key(&["files:", tenant])).await
    }

    pub(super) async fn insert_batch(&self, batch: &BatchRecord) -> Result<(), StoreError> {
        let key = self.key(&["batch:", &batch.id]);
        let index = self.key(&["batches:", &batch.tenant]);
        self.put_listed(&key, &index, &batch.id, encode(batch))
            .await?;
        redis::pipe()
            .atomic()
            .cmd("SADD")
            .arg(self.key(&["active"]))
            .arg(&batch.id)
            .ignore()
            .cmd("HINCRBY")
            .arg(self.key(&["status"]))
            .arg(batch.status.as_str())
            .arg(1)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    pub(super) async fn tenant_version(&self, tenant: &str) -> Result<u64, StoreError> {
        let v: Option<u64> = redis::cmd("GET")
            .arg(self.key(&["tenant-version:", tenant]))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(v.unwrap_or(0))
    }

    pub(super) async fn insert_batch_if(
        &self,
        batch: &BatchRecord,
        version: u64,
    ) -> Result<bool, StoreError> {
        let done: i64 = redis::Script::new(INSERT_IF)
            .key(self.key(&["tenant-version:", &batch.tenant]))
            .key(self.key(&["batch:", &batch.id]))
            .key(self.key(&["batches:", &batch.tenant]))
            .key(self.key(&["seq"]))
            .key(self.key(&["active"]))
            .key(self.key(&["status"]))
            .arg(version)
            .arg(encode(batch))
            .arg(&batch.id)
            .arg(batch.status.as_str())
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    pub(super) async fn batch(&self, id: &str) -> Result<Option<BatchRecord>, StoreError> {
        self.get(&self.key(&["batch:", id])).await
    }

    pub(super) async fn batch_ids(&self, tenant: &str) -> Result<Vec<String>, StoreError> {
        self.ids(&self.key(&["batches:", tenant])).await
    }

    pub(super) async fn batch_text(&self, id: &str) -> Result<Option<String>, StoreError> {
        let text = redis::cmd("GET")
            .arg(self.key(&["batch:", id]))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(text)
    }

    pub(super) async fn replace_batch(
        &self,
        old_text: &str,
        old_status: BatchStatus,
        new: &BatchRecord,
    ) -> Result<bool, StoreError> {
        let done: i64 = redis::Script::new(REPLACE)
            .key(self.key(&["batch:", &new.id]))
            .key(self.key(&["active"]))
            .key(self.key(&["status"]))
            .arg(old_text)
            .arg(encode(new))
            .arg(&new.id)
            .arg(old_status.as_str())
            .arg(new.status.as_str())
            .arg(if new.status.is_terminal() { "1" } else { "0" })
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    pub(super) async fn active_batches(&self) -> Result<Vec<BatchRecord>, StoreError> {
        let ids: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.key(&["active"]))
            .query_async(&mut self.conn.clone())
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(batch) = self.batch(&id).await? {
                out.push(batch);
            }
        }
        out.sort_by_key(|b: &BatchRecord| b.created_at);
        Ok(out)
    }

    pub(super) async fn record_results(
        &self,
        batch: &str,
        items: &[Recorded],
    ) -> Result<Vec<bool>, StoreError> {
        let script = redis::Script::new(RECORD);
        let mut conn = self.conn.clone();
        let mut new = Vec::with_capacity(items.len());
        for item in items {
            let stored = format!("{}{}", if item.ok { '1' } else { '0' }, item.line);
            let added: i64 = script
                .key(self.of_batch("seen:", batch))
                .key(self.of_batch("results:", batch))
                .key(self.of_batch("counts:", batch))
                .arg(&item.custom_id)
                .arg(if item.ok { "ok" } else { "failed" })
                .arg(stored)
                .invoke_async(&mut conn)
                .await?;
            new.push(added == 1);
        }
        Ok(new)
    }

    pub(super) async fn counts(&self, batch: &str) -> Result<(u64, u64), StoreError> {
        let (ok, failed): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(self.of_batch("counts:", batch))
            .arg("ok")
            .arg("failed")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok((ok.unwrap_or(0), failed.unwrap_or(0)))
    }

    pub(super) async fn result_page(
        &self,
        batch: &str,
        cursor: u64,
        n: usize,
    ) -> Result<ResultPage, StoreError> {
        let n = n.max(1);
        let stop = cursor + n as u64 - 1;
        let items: Vec<String> = redis::cmd("LRANGE")
            .arg(self.of_batch("results:", batch))
            .arg(cursor)
            .arg(stop)
            .query_async(&mut self.conn.clone())
            .await?;
        let next = (items.len() == n).then_some(stop + 1);
        let page = items
            .into_iter()
            .map(|s| {
                let ok = s.starts_with('1');
                (ok, s.get(1..).unwrap_or_default().to_owned())
            })
            .collect();
        Ok((page, next))
    }

    pub(super) async fn drop_results(&self, batch: &str) -> Result<(), StoreError> {
        redis::Script::new(DROP_RESULTS)
            .key(self.of_batch("results:", batch))
            .key(self.of_batch("seen:", batch))
            .key(self.of_batch("counts:", batch))
            .invoke_async::<i64>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    pub(super) async fn status_counts(&self) -> Result<Vec<(BatchStatus, u64)>, StoreError> {
        let mut out = Vec::new();
        for status in BatchStatus::ALL {
            let n: Option<i64> = redis::cmd("HGET")
                .arg(self.key(&["status"]))
                .arg(status.as_str())
                .query_async(&mut self.conn.clone())
                .await?;
            out.push((status, u64::try_from(n.unwrap_or(0)).unwrap_or(0)));
        }
        Ok(out)
    }

    /// A connection for the collector (the result list) and the sink.
    pub fn connection(&self) -> RedisConnection {
        self.conn.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::KeyScheme;
    use crate::redis::key_slot;

    const GLOBAL: [&[&str]; 5] = [
        &["file:", "file-1"],
        &["batch:", "batch_1"],
        &["batches:", "acme"],
        &["active"],
        &["tenant-version:", "acme"],
    ];

    #[test]
    fn single_server_names_are_the_prefix_and_the_name() {
        let keys = KeyScheme::new("sluicegate:batchapi:", false);
        assert_eq!(keys.key(&["batch:", "b1"]), "sluicegate:batchapi:batch:b1");
        assert_eq!(
            keys.of_batch("results:", "b1"),
            "sluicegate:batchapi:results:b1"
        );
    }

    #[test]
    fn on_a_cluster_records_share_a_slot_and_results_share_their_batchs() {
        for prefix in ["sluicegate:batchapi:", "", "{mine}:"] {
            let keys = KeyScheme::new(prefix, true);
            let slots: Vec<u16> = GLOBAL.iter().map(|k| key_slot(&keys.key(k))).collect();
            assert!(slots.iter().all(|s| *s == slots[0]), "{prefix}: {slots:?}");
            for batch in ["batch_a", "batch_b"] {
                let per: Vec<u16> = ["results:", "seen:", "counts:"]
                    .iter()
                    .map(|k| key_slot(&keys.of_batch(k, batch)))
                    .collect();
                assert!(per.iter().all(|s| *s == per[0]), "{prefix}: {per:?}");
            }
        }
        let keys = KeyScheme::new("sluicegate:batchapi:", true);
        assert_eq!(
            keys.key(&["batch:", "b1"]),
            "{sluicegate:batchapi:}batch:b1"
        );
        assert_eq!(
            keys.of_batch("results:", "b1"),
            "sluicegate:batchapi:results:{b1}"
        );
        // A prefix with its own tag keeps the single-server names.
        let tagged = KeyScheme::new("{mine}:", true);
        assert_eq!(tagged.key(&["active"]), "{mine}:active");
    }
}
