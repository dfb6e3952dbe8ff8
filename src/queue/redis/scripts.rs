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

/// The claim key of a member: `id\0token`, `id` without a token, or
/// `invalid\0<sha1>` for a member that cannot be decoded or whose id
/// cannot be part of a key (too long, or holding the NUL separator; the
/// dispatcher answers it under a synthetic id).
const CLAIM_KEY: &str = r#"
local function claim_key(member)
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
    if type(id) == 'string' and id ~= '' and #id <= 512
      and not string.find(id, '\0', 1, true) then
      if token then return id .. '\0' .. token end
      return id
    end
  end
  return 'invalid\0' .. redis.sha1hex(member)
end
"#;

/// The tenant of a member, for the lane scripts: `metadata[attr]` of the
/// request (bare or in an envelope's `data`), "" without one. Prepended to
/// every script that files a member into a tenant lane.
const TENANT_OF: &str = r#"
local function tenant_of(member, attr)
  local ok, msg = pcall(cjson.decode, member)
  if not ok or type(msg) ~= 'table' then return '' end
  local req = msg
  if type(msg['data']) == 'table' then req = msg['data'] end
  local md = req['metadata']
  if type(md) ~= 'table' or type(md[attr]) ~= 'string' then return '' end
  return md[attr]
end
local function file_in_lane(member, score, attr, prefix, lanes)
  if attr == '' then return end
  local t = tenant_of(member, attr)
  redis.call('ZADD', prefix .. t, score, member)
  redis.call('SADD', lanes, t)
end
"#;

/// One step of filing members written without a lane (a plain `ZADD` by
/// another producer) into their tenants' lanes, for CLAIM and INDEX.
///
/// While pending holds more members than the lanes together (counted when
/// there are at most `counted` lanes; above that, always), one `ZSCAN`
/// step of about `per_step` members from the cursor kept in the cursor
/// key, each `ZADD`ed to its tenant's lane at its pending score (one
/// already there stays one entry). Filing only adds index entries for
/// members in pending at that moment, and a claim checks pending for
/// every lane entry it takes, so replicas filing and claiming together
/// never lose or duplicate a member. Returns 0 when nothing needed filing,
/// 1 after a step with more of the pass to go, 2 after a pass's last step.
/// Needs `TENANT_OF` and `BATCHED`.
const FILE_UNFILED: &str = r#"
local INDEX_PER_STEP, CLAIM_COUNTS_LANES, INDEX_COUNTS_LANES = 1000, 256, 10000
local function file_unfiled(pending_key, lanes_key, cursor_key, attr, prefix, per_step, counted)
  local pending = redis.call('ZCARD', pending_key)
  if pending == 0 then
    redis.call('DEL', cursor_key)
    return 0
  end
  if redis.call('SCARD', lanes_key) <= counted then
    local filed = 0
    for _, t in ipairs(redis.call('SMEMBERS', lanes_key)) do
      filed = filed + redis.call('ZCARD', prefix .. t)
    end
    if filed >= pending then return 0 end
  end
  local step = redis.call('ZSCAN', pending_key, redis.call('GET', cursor_key) or '0',
    'COUNT', per_step)
  local items = step[2]
  local by_lane, tenants = {}, {}
  for i = 1, #items, 2 do
    local t = tenant_of(items[i], attr)
    if not by_lane[t] then
      by_lane[t] = {}
      tenants[#tenants + 1] = t
    end
    push_all(by_lane[t], items[i + 1], items[i])
  end
  for _, t in ipairs(tenants) do call_chunked('ZADD', prefix .. t, by_lane[t]) end
  if #tenants > 0 then redis.call('SADD', lanes_key, unpack(tenants)) end
  if step[1] == '0' then
    redis.call('DEL', cursor_key)
    return 2
  end
  redis.call('SET', cursor_key, step[1])
  return 1
end
"#;

/// Helpers for scripts that write a whole batch in a few variadic calls.
/// `unpack` of a long table overflows Lua's C stack (about 8 000 values),
/// so the calls go in chunks of `CHUNK` arguments (even, so field/value
/// and score/member pairs never split).
const BATCHED: &str = r#"
local CHUNK = 1000
local function push_all(t, a, b)
  t[#t + 1] = a
  t[#t + 1] = b
end
local function call_chunked(cmd, key, args)
  for i = 1, #args, CHUNK do
    redis.call(cmd, key, unpack(args, i, math.min(i + CHUNK - 1, #args)))
  end
end
local function hmget_chunked(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end
"#;

/// CLAIM: moves up to `max` members from pending to claimed, the one
/// claim of the transport:
/// - plain (no attribute, or a queue without lanes): the lowest-scored;
/// - with tenant lanes (issue 22): the heads of up to 64 lanes (sampled at
///   random when there are more) and the head of pending, round robin, a
///   lane's weight in members per round, so a tenant's work is seen
///   however deep it sits behind another's. A lane entry whose member is
///   no longer pending (claimed from the head, or by an upstream
///   dispatcher) is dropped; an empty lane leaves the lane set;
/// - with a score bound (the deadline sweep): only members scored below it
///   (a score is the deadline plus a fraction, so "below now + 1" is
///   "deadline at or before now"), whatever their tenant.
///
/// Claimed members leave their lane.
///
/// Before a claim without a score bound, one step of `FILE_UNFILED` (at
/// most 256 lanes counted) files members written without a lane.
/// KEYS: pending, claimed, owners, idx, scores, reclaims, lanes, index
/// cursor. ARGV:
/// max, lease expiry (Unix s), owner token, attribute ("" = no lanes),
/// lane key prefix, score bound ("" = none), then tenant / weight pairs
/// (`dispatch.tenant_weights`). Returns flat `[claim_key, member, score,
/// reclaims, ...]`: reclaims = how often the member's lease expired on an
/// earlier holder (each counts as an attempt).
pub(super) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{TENANT_OF}{CLAIM_KEY}{BATCHED}{FILE_UNFILED}{}",
        r#"
local max = tonumber(ARGV[1])
local attr, prefix, bound = ARGV[4], ARGV[5], ARGV[6]

if attr ~= '' and bound == '' then
  file_unfiled(KEYS[1], KEYS[7], KEYS[8], attr, prefix, INDEX_PER_STEP, CLAIM_COUNTS_LANES)
end
-- Whether members are filed in lanes (then a claimed one leaves its lane),
-- and whether this claim takes the lanes' heads.
local filed = attr ~= '' and redis.call('SCARD', KEYS[7]) > 0
local by_lane = filed and bound == ''

-- The head of pending (below the bound, if any).
local function head()
  local picked = {}
  local items
  if bound ~= '' then
    items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. bound, 'WITHSCORES',
      'LIMIT', 0, max)
  else
    items = redis.call('ZRANGE', KEYS[1], 0, max - 1, 'WITHSCORES')
  end
  for i = 1, #items, 2 do picked[#picked + 1] = {items[i], items[i + 1]} end
  return picked
end

-- The tenants' weights (ARGV pairs after the bound; 1 when not named).
local weights = {}
for i = 7, #ARGV, 2 do weights[ARGV[i]] = tonumber(ARGV[i + 1]) end

-- Round robin over every lane and pending, each round taking a lane's
-- weight in members from its head (pending: one), so what the
-- dispatcher's fair buffer receives keeps the shares it serves.
local function round_robin()
  local sources = {}
  for _, t in ipairs(redis.call('SRANDMEMBER', KEYS[7], 64)) do
    local key = prefix .. t
    local items = redis.call('ZRANGE', key, 0, max - 1)
    if #items == 0 then
      redis.call('SREM', KEYS[7], t)
    else
      sources[#sources + 1] = {key = key, items = items, at = 0, weight = weights[t] or 1}
    end
  end
  local items = redis.call('ZRANGE', KEYS[1], 0, max - 1)
  sources[#sources + 1] = {key = false, items = items, at = 0, weight = 1}
  local picked, seen = {}, {}
  repeat
    local any = false
    for _, src in ipairs(sources) do
      for _ = 1, src.weight do
        src.at = src.at + 1
        local member = src.items[src.at]
        if not member or #picked >= max then break end
        any = true
        if not seen[member] then
          seen[member] = true
          local score = redis.call('ZSCORE', KEYS[1], member)
          if score then
            picked[#picked + 1] = {member, score}
          elseif src.key then
            redis.call('ZREM', src.key, member)
          end
        end
      end
    end
  until not any or #picked >= max
  return picked
end

local picked
if by_lane then picked = round_robin() else picked = head() end
if #picked == 0 then return {} end
-- One HLEN per claim rather than an HGET per member while nothing was
-- ever reclaimed (the common case).
local reclaimed = redis.call('HLEN', KEYS[6]) > 0
-- The writes are gathered and made once per key for the whole batch:
-- the same state as a call per member, in a handful of calls.
local members, claimed, owners, scores, idx, cks = {}, {}, {}, {}, {}, {}
local lane_members = {}
for _, p in ipairs(picked) do
  local member, score = p[1], p[2]
  local ck = claim_key(member)
  cks[#cks + 1] = ck
  members[#members + 1] = member
  if filed then
    local lane = prefix .. tenant_of(member, attr)
    lane_members[lane] = lane_members[lane] or {}
    table.insert(lane_members[lane], member)
  end
  push_all(claimed, ck, member)
  push_all(owners, ck, ARGV[3])
  push_all(scores, ck, score)
  push_all(idx, ARGV[2], ck)
end
call_chunked('ZREM', KEYS[1], members)
for lane, ms in pairs(lane_members) do call_chunked('ZREM', lane, ms) end
call_chunked('HSET', KEYS[2], claimed)
call_chunked('HSET', KEYS[3], owners)
call_chunked('HSET', KEYS[5], scores)
call_chunked('ZADD', KEYS[4], idx)
local counts = {}
if reclaimed then counts = hmget_chunked(KEYS[6], cks) end
local out = {}
for i, p in ipairs(picked) do
  out[#out + 1] = cks[i]
  out[#out + 1] = p[1]
  out[#out + 1] = p[2]
  out[#out + 1] = tonumber(counts[i] or '0') or 0
end
return out
"#
    ))
});

/// ACK: for each message, if the caller still owns the claim, pushes the
/// result, applies the list TTL, drops the claim and cleans the producer's
/// keys when they still hold this token; otherwise writes nothing. A claim
/// key that comes twice is settled once (the second is a lost lease, as it
/// was when each message was checked after the one before).
/// KEYS: claimed, owners, idx, scores, reclaims. ARGV: count, then per
/// message claim key, owner, result list, result JSON, ttl seconds, id,
/// token. Returns `{acked, lease_lost}`.
///
/// The batch is settled in a fixed number of calls (one `HMGET` of the
/// owners, one `LPUSH` per result list, one `HDEL`/`ZREM` per key, one
/// `MGET` and `DEL` for the producer's keys), not about a dozen calls per
/// message: those calls were half the Redis CPU of a drain (issue 21).
pub(super) static ACK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{BATCHED}{}",
        r#"
local n = tonumber(ARGV[1])
if n == 0 then return {0, 0} end
local cks = {}
for i = 0, n - 1 do cks[#cks + 1] = ARGV[2 + i * 7] end
local holders = hmget_chunked(KEYS[2], cks)
local acked, lost = 0, 0
local settled, seen = {}, {}
-- Results per list in message order, the list's TTL the last positive
-- one (as an EXPIRE after each push left it), lists in first-use order.
local lists, pushes, ttls = {}, {}, {}
local producer_keys, producer_tokens = {}, {}
for i = 0, n - 1 do
  local b = 1 + i * 7
  local ck, owner, list, res = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local ttl, id, token = tonumber(ARGV[b + 5]), ARGV[b + 6], ARGV[b + 7]
  if holders[i + 1] == owner and not seen[ck] then
    seen[ck] = true
    settled[#settled + 1] = ck
    if not pushes[list] then
      pushes[list] = {}
      lists[#lists + 1] = list
    end
    table.insert(pushes[list], res)
    if ttl > 0 then ttls[list] = ttl end
    if token ~= '' then
      push_all(producer_keys, 'request-active:' .. id, 'request-cancel:' .. id)
      push_all(producer_tokens, token, token)
    end
    acked = acked + 1
  else
    lost = lost + 1
  end
end
for _, list in ipairs(lists) do
  call_chunked('LPUSH', list, pushes[list])
  if ttls[list] then redis.call('EXPIRE', list, ttls[list]) end
end
call_chunked('HDEL', KEYS[1], settled)
call_chunked('HDEL', KEYS[2], settled)
call_chunked('HDEL', KEYS[4], settled)
call_chunked('HDEL', KEYS[5], settled)
call_chunked('ZREM', KEYS[3], settled)
-- A producer key is dropped only while it still holds this token, so a
-- newer submission of the same id keeps its keys.
if #producer_keys > 0 then
  local held = {}
  for i = 1, #producer_keys, CHUNK do
    local part = redis.call('MGET', unpack(producer_keys, i, math.min(i + CHUNK - 1, #producer_keys)))
    for _, v in ipairs(part) do held[#held + 1] = v end
  end
  local drop = {}
  for i, key in ipairs(producer_keys) do
    if held[i] == producer_tokens[i] then drop[#drop + 1] = key end
  end
  for i = 1, #drop, CHUNK do
    redis.call('DEL', unpack(drop, i, math.min(i + CHUNK - 1, #drop)))
  end
end
return {acked, lost}
"#
    ))
});

/// RELEASE: returns an owned claim to a sorted set (pending at its queue
/// score, or the retry set at its due time), possibly rewritten; back in
/// pending, a queue with lanes files it into its tenant's lane.
/// The reclaim count stays unless the member was rewritten with it
/// (ARGV forget = "1").
/// KEYS: claimed, owners, idx, scores, target, reclaims. ARGV: claim key,
/// owner, score, member, attribute ("" = no lanes), lane key prefix, lane
/// set, forget. Returns 1, or 0 when the claim is no longer ours.
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{TENANT_OF}{}",
        r#"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[4])
file_in_lane(ARGV[4], ARGV[3], ARGV[5], ARGV[6], ARGV[7])
if ARGV[8] == '1' then redis.call('HDEL', KEYS[6], ARGV[1]) end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"#
    ))
});

/// DEAD: moves an owned claim to the dead-letter list and writes its
/// result (as ACK does: result list, list TTL, producer keys cleaned when
/// they still hold this token), so a reader waiting for every result is
/// not left waiting.
/// KEYS: claimed, owners, idx, scores, dead list, reclaims. ARGV: claim
/// key, owner, record JSON, result list, result JSON, ttl seconds, id,
/// token.
/// Returns 1, or 0 when the claim is no longer ours.
pub(super) static DEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('LPUSH', KEYS[5], ARGV[3])
redis.call('LPUSH', ARGV[4], ARGV[5])
redis.call('HDEL', KEYS[6], ARGV[1])
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
/// deadline), each into its tenant lane on a queue with lanes, and counts
/// the reclaim (the next claim reports it: the dead holder may have sent
/// it, so it counts as an attempt).
/// KEYS: pending, claimed, owners, idx, scores, reclaims. ARGV: now, limit,
/// attribute ("" = no lanes), lane key prefix, lane set. Returns how many
/// were returned.
pub(super) static RECLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{TENANT_OF}{}",
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
    redis.call('HINCRBY', KEYS[6], ck, 1)
    file_in_lane(member, score, ARGV[3], ARGV[4], ARGV[5])
    n = n + 1
  end
  redis.call('HDEL', KEYS[2], ck)
  redis.call('HDEL', KEYS[3], ck)
  redis.call('HDEL', KEYS[5], ck)
  redis.call('ZREM', KEYS[4], ck)
end
return n
"#
    ))
});

/// MOVE: moves due retries back to their origin queues, each only once
/// even with several movers, into their tenant lane where the origin has
/// lanes. KEYS: retry set. ARGV: attribute ("" = no lanes), then 5-tuples
/// of member, origin queue, queue score, lane key prefix and lane set of
/// the origin ("" when it has none). Returns how many moved.
pub(super) static MOVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{TENANT_OF}{}",
        r#"
local n = 0
for i = 2, #ARGV, 5 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', ARGV[i + 1], ARGV[i + 2], ARGV[i])
    if ARGV[i + 4] ~= '' then
      file_in_lane(ARGV[i], ARGV[i + 2], ARGV[1], ARGV[i + 3], ARGV[i + 4])
    end
    n = n + 1
  end
end
return n
"#
    ))
});

/// INDEX: one step of `FILE_UNFILED` for the background filer (counting
/// up to 10 000 lanes). KEYS: pending, lanes, index cursor. ARGV:
/// attribute, lane key prefix. Returns 0 (nothing to file), 1 (more to
/// go) or 2 (a pass ended).
pub(super) static INDEX: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{TENANT_OF}{BATCHED}{FILE_UNFILED}{}",
        r#"
return file_unfiled(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], INDEX_PER_STEP, INDEX_COUNTS_LANES)
"#
    ))
});

/// DROP_LANES: deletes up to 64 tenant lanes and the filing cursor of a
/// queue whose dispatcher has no fairness attribute. Its claims neither
/// read the lanes nor take members out of them, so lanes a producer
/// filed (`submit` does by default) would only grow; a dispatcher with an
/// attribute that shares the queue files its members again.
/// KEYS: lanes, index cursor. ARGV: lane key prefix. Returns how many
/// lanes were deleted.
pub(super) static DROP_LANES: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local tenants = redis.call('SPOP', KEYS[1], 64)
for _, t in ipairs(tenants) do redis.call('DEL', ARGV[1] .. t) end
redis.call('DEL', KEYS[2])
return #tenants
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
