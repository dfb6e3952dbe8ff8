//! The Lua scripts of the Redis transport. Each one settles a whole batch
//! in one round trip and is called by SHA (`EVALSHA`, loaded on first use).
//!
//! Claim keys are `id\0token` (or `id` without a token), as upstream.
//! Messages that cannot be decoded, or whose id is longer than
//! `MAX_ID_LEN` (512) bytes or contains NUL, are claimed under
//! `invalid\0<sha1>` so they still get a result.
//!
//! Result lists, `request-active:<id>`, `request-cancel:<id>` and retry
//! origins are addressed by name inside the scripts. On a Redis Cluster
//! every key one script touches must share a slot, so the transport keeps
//! the queue's result list and retry set in the queue's `{queue}` slot,
//! passes an empty token (no producer keys touched) and cleans the
//! producer's keys afterwards with [`FORGET`] (docs/transports.md).

use std::sync::LazyLock;

use redis::Script;

/// CLAIM: moves up to `max` lowest-scored members from pending to claimed;
/// with a fourth argument, only members scored below it (the deadline
/// sweep: a score is the deadline plus a fraction, so "below now + 1"
/// is "deadline at or before now").
/// KEYS: pending, claimed, owners, idx, scores. ARGV: max, lease expiry
/// (Unix s), owner token[, score bound (exclusive)]. Returns flat
/// `[claim_key, member, score, ...]`.
pub(super) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local items
if ARGV[4] then
  items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[4], 'WITHSCORES',
    'LIMIT', 0, tonumber(ARGV[1]))
else
  items = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
end
local out = {}
for i = 1, #items, 2 do
  local member = items[i]
  local score = items[i + 1]
  local ck = nil
  local ok, msg = pcall(cjson.decode, member)
  if ok and type(msg) == 'table' then
    local req = msg
    local token = nil
    if type(msg['data']) == 'table' then
      req = msg['data']
      local internal = msg['internal']
      if type(internal) == 'table' and type(internal['request_token']) == 'string'
        and internal['request_token'] ~= '' then
        token = internal['request_token']
      end
    end
    local id = req['id']
    -- Ids that cannot be part of a claim key (too long, or holding the
    -- NUL separator) are claimed as undecodable; the dispatcher answers
    -- them under a synthetic id.
    if type(id) == 'string' and id ~= '' and #id <= 512
      and not string.find(id, '\0', 1, true) then
      ck = req['id']
      if token then ck = ck .. '\0' .. token end
    end
  end
  if not ck then ck = 'invalid\0' .. redis.sha1hex(member) end
  redis.call('ZREM', KEYS[1], member)
  redis.call('HSET', KEYS[2], ck, member)
  redis.call('HSET', KEYS[3], ck, ARGV[3])
  redis.call('HSET', KEYS[5], ck, score)
  redis.call('ZADD', KEYS[4], ARGV[2], ck)
  out[#out + 1] = ck
  out[#out + 1] = member
  out[#out + 1] = score
end
return out
"#,
    )
});

/// ACK: for each message, if the caller still owns the claim, pushes the
/// result, applies the list TTL, drops the claim and cleans the producer's
/// keys when they still hold this token; otherwise writes nothing.
/// KEYS: claimed, owners, idx, scores. ARGV: count, then per message
/// claim key, owner, result list, result JSON, ttl seconds, id, token.
/// Returns `{acked, lease_lost}`.
pub(super) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local acked, lost = 0, 0
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local b = 1 + i * 7
  local ck, owner, list, res = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local ttl, id, token = tonumber(ARGV[b + 5]), ARGV[b + 6], ARGV[b + 7]
  if redis.call('HGET', KEYS[2], ck) == owner then
    redis.call('LPUSH', list, res)
    if ttl > 0 then redis.call('EXPIRE', list, ttl) end
    redis.call('HDEL', KEYS[1], ck)
    redis.call('HDEL', KEYS[2], ck)
    redis.call('HDEL', KEYS[4], ck)
    redis.call('ZREM', KEYS[3], ck)
    if token ~= '' then
      local active = 'request-active:' .. id
      if redis.call('GET', active) == token then redis.call('DEL', active) end
      local cancel = 'request-cancel:' .. id
      if redis.call('GET', cancel) == token then redis.call('DEL', cancel) end
    end
    acked = acked + 1
  else
    lost = lost + 1
  end
end
return {acked, lost}
"#,
    )
});

/// RELEASE: returns an owned claim to a sorted set (pending at its queue
/// score, or the retry set at its due time), possibly rewritten.
/// KEYS: claimed, owners, idx, scores, target. ARGV: claim key, owner,
/// score, member. Returns 1, or 0 when the claim is no longer ours.
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[4])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"#,
    )
});

/// DEAD: moves an owned claim to the dead-letter list and writes its
/// result (as ACK does: result list, list TTL, producer keys cleaned when
/// they still hold this token), so a reader waiting for every result is
/// not left waiting.
/// KEYS: claimed, owners, idx, scores, dead list. ARGV: claim key, owner,
/// record JSON, result list, result JSON, ttl seconds, id, token.
/// Returns 1, or 0 when the claim is no longer ours.
pub(super) static DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('LPUSH', KEYS[5], ARGV[3])
redis.call('LPUSH', ARGV[4], ARGV[5])
local ttl = tonumber(ARGV[6])
if ttl > 0 then redis.call('EXPIRE', ARGV[4], ttl) end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local id, token = ARGV[7], ARGV[8]
if token ~= '' then
  local active = 'request-active:' .. id
  if redis.call('GET', active) == token then redis.call('DEL', active) end
  local cancel = 'request-cancel:' .. id
  if redis.call('GET', cancel) == token then redis.call('DEL', cancel) end
end
return 1
"#,
    )
});

/// EXTEND: renews the leases of the claims the caller still owns.
/// KEYS: owners, idx. ARGV: expiry, then claim key / owner pairs.
/// Returns how many were renewed.
pub(super) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
    n = n + 1
  end
end
return n
"#,
    )
});

/// RECLAIM: returns claims whose lease expired to pending with their
/// original score (recorded at claim; for claims made by upstream, the
/// deadline). KEYS: pending, claimed, owners, idx, scores. ARGV: now,
/// limit. Returns how many were returned.
pub(super) static RECLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local cks = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local n = 0
for _, ck in ipairs(cks) do
  local member = redis.call('HGET', KEYS[2], ck)
  if member then
    local score = redis.call('HGET', KEYS[5], ck)
    if not score then
      score = 0
      local ok, msg = pcall(cjson.decode, member)
      if ok and type(msg) == 'table' then
        local req = msg
        if type(msg['data']) == 'table' then req = msg['data'] end
        score = tonumber(req['deadline']) or 0
      end
    end
    redis.call('ZADD', KEYS[1], score, member)
    n = n + 1
  end
  redis.call('HDEL', KEYS[2], ck)
  redis.call('HDEL', KEYS[3], ck)
  redis.call('HDEL', KEYS[5], ck)
  redis.call('ZREM', KEYS[4], ck)
end
return n
"#,
    )
});

/// MOVE: moves due retries back to their origin queues, each only once
/// even with several movers. KEYS: retry set. ARGV: triples of member,
/// origin queue, queue score. Returns how many moved.
pub(super) static MOVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local n = 0
for i = 1, #ARGV, 3 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', ARGV[i + 1], ARGV[i + 2], ARGV[i])
    n = n + 1
  end
end
return n
"#,
    )
});

/// FORGET: deletes a producer key (`request-active:<id>` or
/// `request-cancel:<id>`) only if it still holds the settled token, so a
/// newer submission of the same id keeps its keys. KEYS: the key. ARGV:
/// token. Returns 1 when deleted.
pub(super) static FORGET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"#,
    )
});
