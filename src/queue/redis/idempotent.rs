//! Idempotent enqueue on a single Redis server: one script checks the
//! idempotency record and, when the key is new, enqueues the batch as
//! [`super::enqueue`] does (`ZADD`, `request-active:<id>`, the tenant
//! lanes) and sets the record, so the record and the requests are written
//! together or not at all, and a repeated key writes nothing: not even an
//! active key, whose token the first submission's messages carry.
//!
//! A Redis Cluster has no such script: the active keys live in other hash
//! slots than the queue, so a check, the messages and the record cannot
//! be one atomic step there, and the client answers `Unsupported`.

use std::sync::LazyLock;

use super::Keys;
use super::producer::Submission;
use crate::redis::RedisConnection;

/// KEYS: 1 the record, 2 the queue, 3 the set of lanes, then each
/// message's active key, then each message's lane (the queue when it has
/// none; unused then). ARGV: 1 the record, 2 its TTL in seconds, 3 the
/// message count, then per message: score, member, token, active TTL,
/// "1" when it has a lane, its tenant. Returns the record already under
/// the key, or nil when it set this one.
const SCRIPT: &str = r"
local found = redis.call('GET', KEYS[1])
if found then return found end
local n = tonumber(ARGV[3])
for i = 1, n do
  local a = 3 + (i - 1) * 6
  redis.call('ZADD', KEYS[2], ARGV[a + 1], ARGV[a + 2])
  redis.call('SET', KEYS[3 + i], ARGV[a + 3], 'EX', ARGV[a + 4])
  if ARGV[a + 5] == '1' then
    redis.call('ZADD', KEYS[3 + n + i], ARGV[a + 1], ARGV[a + 2])
    redis.call('SADD', KEYS[3], ARGV[a + 6])
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
";

static ENQUEUE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(SCRIPT));

/// The key of the record of idempotency key `key` on `queue`: scoped by
/// the queue, as upstream scopes keys by the producer's namespace.
pub(super) fn record_key(queue: &str, key: &str) -> String {
    format!("sluicegate-idempotency:{queue}:{key}")
}

/// Enqueues `batch` into `queue` with `record` under `record_key` (TTL
/// `ttl_secs`), unless that key is set: then nothing is written and its
/// value is returned.
pub(super) async fn enqueue(
    conn: &mut RedisConnection,
    queue: &str,
    batch: &[Submission],
    record_key: &str,
    record: &str,
    ttl_secs: u64,
) -> redis::RedisResult<Option<String>> {
    let keys = Keys::new(queue, false);
    let mut invocation = ENQUEUE.prepare_invoke();
    invocation.key(record_key).key(queue).key(&keys.lanes);
    for s in batch {
        invocation.key(format!("request-active:{}", s.id));
    }
    for s in batch {
        match &s.lane {
            Some(tenant) => invocation.key(keys.lane(tenant)),
            None => invocation.key(queue),
        };
    }
    invocation.arg(record).arg(ttl_secs.max(1)).arg(batch.len());
    for s in batch {
        invocation
            .arg(s.score)
            .arg(&s.member)
            .arg(&s.token)
            .arg(s.active_ttl)
            .arg(if s.lane.is_some() { "1" } else { "0" })
            .arg(s.lane.as_deref().unwrap_or(""));
    }
    invocation.invoke_async(conn).await
}
