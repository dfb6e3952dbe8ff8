//! The shared window: one pool's window across replicas, as a lease
//! semaphore in Redis (`dispatch.shared_window = "redis"`).
//!
//! Each replica (a *holder*) holds units of the pool's total under a lease
//! and sends only within them: [`super::pool::PoolWindow`]'s cap is the
//! units held, valid until shortly before the lease would expire, and
//! checked again just before each send (`send.rs`), so a request released
//! before a pause that outlasted the lease is not sent on it. One Lua
//! script ([`SYNC`]) does everything in one round trip per tick (every
//! third of the lease, or at once when the window runs out of units):
//! - holders whose lease expired lose their token; their units stay held,
//!   as an *orphan*, until the lease's expiry plus the gateway's attempt
//!   timeout, since what a dead or paused replica had in flight may run at
//!   the pool until then (by then it has been answered, or a live replica
//!   would have abandoned it);
//! - the caller proves its *fencing token* (handed out when it joined);
//!   a holder that was expired gets `fenced`, holds nothing and must join
//!   again, so a replica that stalled past its lease cannot keep sending
//!   on units that were handed to others meanwhile; if it joins while its
//!   orphan entry is still there it keeps, of the orphan's units, what it
//!   still has in flight;
//! - the pool's total `C` is written from the caller's fresh gate reading
//!   (each reading once): `C = Σ min(base, in flight) + N`, where each
//!   holder's `base` is what its own latest reading counted as in flight
//!   (its window minus its `N`; zero for a blind gate, whose window is `N`
//!   itself), or what it has in flight now if less; never more than the
//!   reading's `max_SYS × (1 − B)`, the window if all the pool's load
//!   were ours (readings race with answers: a request the pool finished
//!   but whose answer is still on its way counts in a base and in `N`
//!   both; a single process is kept safe there by its release budget,
//!   which the replicas do not share). `C` expires after
//!   `max_staleness`: no fresh reading anywhere, no units;
//! - units are taken in chunks (`shared_window_chunk` beyond what is in
//!   flight) and given back past twice that, never below what is in
//!   flight, and down to the total when it shrinks. The script grants
//!   only `C − Σ held`, so `Σ held ≤ C` and the pool's global batch in
//!   flight, which never exceeds `Σ held`, never exceeds `C`;
//! - a 429/503 seen by any replica is published as a hold key with an
//!   expiry; each replica applies a hold it has not seen yet to its own
//!   congestion hold and window, so one replica's 429 holds them all.
//!
//! When Redis cannot be reached the cap is zero at once (fail closed) and
//! readiness says why until a sync succeeds again.
//!
//! Keys of one pool, all in one Redis Cluster slot through the `{pool}`
//! hash tag (docs/scale-out.md): `sluicegate:window:{<pool>}:holders`
//! (sorted set holder → lease expiry, ms), `:held`, `:base`, `:used`,
//! `:tokens`, `:want` (hashes by holder), `:total` (the window `C`), `:epoch` (the
//! counter behind tokens and hold ids), `:hold` (the shared hold, its value
//! the hold id), `:orphans` (sorted set expired holder → when its units
//! return, ms).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::congestion::CongestionHold;
use super::pool::Pool;
use crate::telemetry::{Health, PoolMetrics};

/// SYNC: expire dead holders, check the fencing token, renew the lease,
/// record in flight and base, write the total from a fresh reading, take
/// or give back units, publish and read the shared hold.
/// KEYS: holders, held, base, used, tokens, total, epoch, hold, want,
/// orphans.
/// ARGV: holder, token (empty = join), lease ms, used, want, base, N (−1 =
/// no fresh reading), total ttl ms, hold ms (0 = none), leave (0/1),
/// ceiling of the total, orphan hold ms (the attempt timeout).
/// Returns `{-1}` when fenced, else `{1, token, held, total, Σ held, Σ
/// used, hold ttl ms, hold id, allowed}`: `held` never drops below what
/// the caller has in flight, `allowed` (what it may have in flight) does
/// when it must shrink to its fair share or to a smaller total.
static SYNC: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget(h)
  redis.call('ZREM', KEYS[1], h)
  redis.call('ZREM', KEYS[10], h)
  for i = 2, 5 do redis.call('HDEL', KEYS[i], h) end
  redis.call('HDEL', KEYS[9], h)
end
-- Orphans whose requests are over or abandoned by now: their units return.
for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', now)) do forget(h) end
-- Holders whose lease expired are fenced (no token, no want). Their
-- units stay held, as an orphan, until the lease's expiry plus the
-- attempt timeout: a dead or paused replica may have had up to its units
-- in flight (it sends within them until its cap lapses, between syncs
-- too), and those requests may run at the pool until then.
local drain = tonumber(ARGV[12])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES')
for i = 1, #expired, 2 do
  local h, until_ms = expired[i], tonumber(expired[i + 1]) + drain
  local left = tonumber(redis.call('HGET', KEYS[2], h) or '0')
  if left > 0 and until_ms > now then
    redis.call('ZREM', KEYS[1], h)
    redis.call('HDEL', KEYS[5], h)
    redis.call('HDEL', KEYS[9], h)
    redis.call('ZADD', KEYS[10], until_ms, h)
  else
    forget(h)
  end
end
local holder, token = ARGV[1], ARGV[2]
local current = redis.call('HGET', KEYS[5], holder)
if token ~= '' and current ~= token then return {-1} end
if ARGV[10] == '1' then
  forget(holder)
  return {1, token, 0, 0, 0, 0, 0, '', 0}
end
local used = tonumber(ARGV[4])
if token == '' then
  token = tostring(redis.call('INCR', KEYS[7]))
  redis.call('HSET', KEYS[5], holder, token)
  -- A replica that was fenced and comes back while its orphan entry
  -- still holds its units keeps what it has in flight of them (its
  -- requests from before are still out); the rest returns. Otherwise it
  -- starts from nothing: a new replica has nothing out, and an orphan's
  -- requests are past the attempt timeout once its entry is released.
  local orphaned = redis.call('ZSCORE', KEYS[10], holder)
  local kept = 0
  if orphaned then
    kept = math.min(used, tonumber(redis.call('HGET', KEYS[2], holder) or '0'))
    redis.call('ZREM', KEYS[10], holder)
  end
  redis.call('HSET', KEYS[2], holder, kept)
end
local lease = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + lease, holder)
redis.call('HSET', KEYS[4], holder, used)
redis.call('HSET', KEYS[3], holder, ARGV[6])
local function sum(key)
  local s = 0
  for _, v in ipairs(redis.call('HVALS', key)) do s = s + tonumber(v) end
  return s
end
local n = tonumber(ARGV[7])
if n >= 0 then
  -- Each holder's share of what the readings saw: its base, or what it
  -- has in flight now if less (requests that finished since its reading
  -- are headroom in ours).
  local seen = 0
  local used_by = redis.call('HGETALL', KEYS[4])
  for i = 1, #used_by, 2 do
    local b = tonumber(redis.call('HGET', KEYS[3], used_by[i]) or '0')
    seen = seen + math.min(b, tonumber(used_by[i + 1]))
  end
  redis.call('SET', KEYS[6], math.min(seen + n, tonumber(ARGV[11])), 'PX', ARGV[8])
end
local total = tonumber(redis.call('GET', KEYS[6]) or '0')
local mine = tonumber(redis.call('HGET', KEYS[2], holder) or '0')
local held = sum(KEYS[2])
local want = tonumber(ARGV[5])
redis.call('HSET', KEYS[9], holder, want)
-- When the replicas want more than the total, nobody keeps more than a
-- fair share: a replica that joins late is not starved by one that
-- holds everything and keeps reusing it.
local target = want
if sum(KEYS[9]) > total then
  local fair = math.ceil(total / math.max(redis.call('ZCARD', KEYS[1]), 1))
  target = math.min(target, fair)
end
local others = held - mine
if target > mine then
  local free = total - held
  if free > 0 then mine = mine + math.min(target - mine, free) end
elseif target < mine then
  mine = math.max(target, used)
end
if others + mine > total then
  target = math.min(target, math.max(total - others, 0))
  if mine > used then mine = math.max(used, total - others) end
end
redis.call('HSET', KEYS[2], holder, mine)
local allowed = math.min(mine, target)
local hold_ms = tonumber(ARGV[9])
if hold_ms > 0 then
  local id = redis.call('INCR', KEYS[7])
  local ttl = math.max(redis.call('PTTL', KEYS[8]), hold_ms)
  redis.call('SET', KEYS[8], id, 'PX', ttl)
end
local keep = lease * 10 + drain
for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], keep) end
redis.call('PEXPIRE', KEYS[9], keep)
redis.call('PEXPIRE', KEYS[10], keep)
local hold_ttl = math.max(redis.call('PTTL', KEYS[8]), 0)
local hold_id = redis.call('GET', KEYS[8]) or ''
return {1, token, mine, total, others + mine, sum(KEYS[4]), hold_ttl, hold_id, allowed}
"#,
    )
});

/// The keys of one pool's semaphore, all hash-tagged with the pool.
#[derive(Debug, Clone)]
pub struct Keys {
    names: [String; 10],
}

impl Keys {
    /// The keys of `pool`, in [`SYNC`]'s order.
    pub fn new(pool: &str) -> Self {
        let key = |part: &str| format!("sluicegate:window:{{{pool}}}:{part}");
        Self {
            names: [
                key("holders"),
                key("held"),
                key("base"),
                key("used"),
                key("tokens"),
                key("total"),
                key("epoch"),
                key("hold"),
                key("want"),
                key("orphans"),
            ],
        }
    }

    /// Every key, in [`SYNC`]'s order.
    pub fn all(&self) -> &[String] {
        &self.names
    }

    /// The key of the pool's total `C` (the window across replicas).
    pub fn total(&self) -> &str {
        &self.names[5]
    }

    /// The hash of units held, by holder.
    pub fn held(&self) -> &str {
        &self.names[1]
    }
}

/// Tunables of a shared window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedWindowSettings {
    /// Lease on the units held; renewed every third of it.
    pub lease: Duration,
    /// Units taken beyond what is in flight.
    pub chunk: u64,
    /// How long the total written from a reading lasts.
    pub max_staleness: Duration,
    /// How long after its lease expired an expired holder's units stay
    /// held (the gateway's attempt timeout): by then every request it sent
    /// within its lease has been answered, or abandoned by the attempt
    /// timeout had it been alive.
    pub orphan_hold: Duration,
}

impl SharedWindowSettings {
    /// How often the lease is renewed.
    fn renew_every(&self) -> Duration {
        self.lease / 3
    }

    /// How long after a sync *started* its units may be used: the lease
    /// less a tenth. Redis counts the lease from the script's run, after
    /// the sync started, so the round trip there only adds to the margin
    /// (and a reply that comes back late, after a pause, finds its units
    /// expired already); the tenth is for clocks that run at different
    /// rates (the replica's monotonic clock against Redis's). Each send
    /// checks it just before it goes ([`super::pool::PoolWindow::lease_holds`]).
    fn valid_for(&self) -> Duration {
        self.lease - self.lease / 10
    }
}

/// How many units to ask for, given what is held, in flight and wanted.
/// Pure: the hysteresis of the shared window.
///
/// With demand (a lane has budget the cap blocks), top up to `in flight +
/// chunk` once the slack falls below half a chunk; without a live grant,
/// give back everything beyond what is in flight; otherwise give back
/// down to `in flight + chunk` once the slack exceeds two chunks.
pub fn want_units(held: u64, in_flight: u64, chunk: u64, demand: bool, granted: bool) -> u64 {
    let slack = held.saturating_sub(in_flight);
    if !granted {
        return in_flight;
    }
    if demand && slack < chunk.div_ceil(2) {
        return in_flight + chunk;
    }
    if slack > 2 * chunk {
        return in_flight + chunk;
    }
    held.max(in_flight)
}

/// What one sync told us.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Synced {
    /// Our token was not the holder's: we were expired.
    Fenced,
    /// The sync went through.
    Held {
        token: String,
        held: u64,
        total: u64,
        all_held: u64,
        all_used: u64,
        hold_ttl: Duration,
        hold_id: String,
        allowed: u64,
    },
}

/// One pool's link to its Redis semaphore: the keeper task's state.
#[derive(Debug)]
pub struct SharedWindow<C> {
    conn: C,
    pool: Arc<Pool>,
    congestion: Arc<CongestionHold>,
    keys: Keys,
    holder: String,
    settings: SharedWindowSettings,
    metrics: PoolMetrics,
    health: Arc<Health>,
    token: Option<String>,
    held: u64,
    hold_seen: String,
    /// When the data of the last reading written to the total was taken.
    last_reading: Option<Instant>,
}

impl<C> SharedWindow<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A link for `pool` as `replica` (made unique per process start, so a
    /// restarted pod with the same name is a new holder).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        conn: C,
        pool: Arc<Pool>,
        congestion: Arc<CongestionHold>,
        replica: &str,
        settings: SharedWindowSettings,
        metrics: PoolMetrics,
        health: Arc<Health>,
    ) -> Self {
        // Fail closed until the first sync: no units, no sends.
        pool.window().set_cap(0, Instant::now());
        Self {
            conn,
            keys: Keys::new(&pool.name),
            pool,
            congestion,
            holder: format!("{replica}-{:08x}", rand::random::<u32>()),
            settings,
            metrics,
            health,
            token: None,
            held: 0,
            hold_seen: String::new(),
            last_reading: None,
        }
    }

    /// What readiness calls this link's trouble.
    fn health_key(&self) -> String {
        format!("shared window of pool `{}`", self.pool.name)
    }

    /// Syncs every third of the lease, or when the pool runs out of units
    /// or has a 429 to publish, until `stop`; then gives its units back.
    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            self.tick().await;
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(self.settings.renew_every()) => {}
                () = self.pool.wants_units.notified() => {}
            }
        }
        if let Some(token) = self.token.take() {
            let leave = self.sync_call(&token, 0, 0, None, None, true).await;
            if let Err(error) = leave {
                tracing::warn!(pool = %self.pool.name, %error, "could not give shared-window units back; they return when the lease expires");
            }
        }
        self.pool.window().set_cap(0, Instant::now());
    }

    /// One sync: renew, take or give back units, set the cap, apply holds.
    async fn tick(&mut self) {
        let started = Instant::now();
        let (in_flight, demand, reading) = {
            let mut window = self.pool.window();
            let reading = window.reading(started);
            let demand = window.blocked_by_cap(started);
            // What this sync reports in flight stays the most in flight
            // until its reply sets the cap again: Redis may cut the units
            // down to it.
            (window.freeze_cap(), demand, reading)
        };
        let granted = reading.is_some();
        let want = want_units(self.held, in_flight, self.settings.chunk, demand, granted);
        let hold = self.pool.take_hold();
        let token = self.token.clone().unwrap_or_default();
        // A reading is used for the total once: passed again, its `N`
        // would be added to bases that already grew from its headroom.
        let fresh = reading.filter(|r| self.last_reading.is_none_or(|at| r.taken_at > at));
        let base = reading.map_or(in_flight, |r| r.base);
        let result = tokio::time::timeout(
            self.settings.renew_every(),
            self.sync_call(
                &token,
                in_flight,
                want,
                Some((base, fresh.map(|r| (r.n, r.ceiling)))),
                hold,
                false,
            ),
        )
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()));
        match result {
            Ok(Synced::Held {
                token,
                held,
                total,
                all_held,
                all_used,
                hold_ttl,
                hold_id,
                allowed,
            }) => {
                self.token = Some(token);
                self.held = held;
                if let Some(r) = fresh {
                    self.last_reading = Some(r.taken_at);
                }
                self.pool
                    .window()
                    .set_cap(allowed, started + self.settings.valid_for());
                self.metrics.renewals.inc();
                self.metrics.held.set(saturating_i64(held));
                self.metrics.total.set(saturating_i64(total));
                self.metrics.all_held.set(saturating_i64(all_held));
                self.metrics.all_in_flight.set(saturating_i64(all_used));
                self.health.clear_blocker(&self.health_key());
                if hold.is_some() {
                    // Ours: already applied locally.
                    self.hold_seen = hold_id;
                } else if !hold_ttl.is_zero() && hold_id != self.hold_seen {
                    self.apply_hold(hold_ttl);
                    self.hold_seen = hold_id;
                }
                self.pool.notify_changed();
            }
            Ok(Synced::Fenced) => {
                tracing::warn!(pool = %self.pool.name, "shared-window lease lost (expired); joining again");
                self.lost("lease expired; joining again".to_owned());
            }
            Err(error) => {
                tracing::warn!(pool = %self.pool.name, %error, "shared-window sync failed; window closed");
                self.lost(format!("redis unreachable: {error}"));
                if let Some(hold) = hold {
                    // Publish it on the next sync that goes through.
                    self.pool.publish_hold(hold);
                }
            }
        }
    }

    /// No units any more: cap zero at once, readiness says why.
    fn lost(&mut self, why: String) {
        self.token = None;
        self.held = 0;
        self.pool.window().set_cap(0, Instant::now());
        self.metrics.failures.inc();
        self.metrics.held.set(0);
        self.health.set_blocker(&self.health_key(), why);
    }

    /// Another replica saw a 429/503: hold here too for what is left of it.
    fn apply_hold(&self, ttl: Duration) {
        let now = Instant::now();
        self.congestion
            .lock()
            .signal(now, now, Some(ttl), rand::random::<f64>());
        self.pool.window().congested(now);
        self.metrics.holds_applied.inc();
        tracing::info!(pool = %self.pool.name, hold = ?ttl, "another replica saw 429/503; holding");
    }

    async fn sync_call(
        &self,
        token: &str,
        used: u64,
        want: u64,
        reading: Option<(u64, Option<(u64, u64)>)>,
        hold: Option<Duration>,
        leave: bool,
    ) -> Result<Synced, String> {
        let (base, fresh) = reading.unwrap_or((0, None));
        let (n, ceiling) = fresh.map_or((-1, 0), |(n, ceiling)| {
            (
                i64::try_from(n).unwrap_or(i64::MAX),
                // Lua numbers are doubles: keep the ceiling exact.
                ceiling.min(1 << 52),
            )
        });
        let mut invocation = SYNC.prepare_invoke();
        for key in &self.keys.names {
            invocation.key(key);
        }
        invocation
            .arg(&self.holder)
            .arg(token)
            .arg(millis(self.settings.lease))
            .arg(used)
            .arg(want)
            .arg(base)
            .arg(n)
            .arg(millis(self.settings.max_staleness))
            .arg(hold.map_or(0, millis))
            .arg(u8::from(leave))
            .arg(ceiling)
            .arg(millis(self.settings.orphan_hold));
        let mut conn = self.conn.clone();
        let reply: redis::Value = invocation
            .invoke_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        parse_reply(reply)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Reads [`SYNC`]'s reply.
fn parse_reply(reply: redis::Value) -> Result<Synced, String> {
    use redis::Value as V;
    let V::Array(items) = reply else {
        return Err(format!("unexpected reply {reply:?}"));
    };
    let int = |i: usize| -> Result<i64, String> {
        match items.get(i) {
            Some(V::Int(n)) => Ok(*n),
            other => Err(format!("field {i}: expected an integer, got {other:?}")),
        }
    };
    let text = |i: usize| -> Result<String, String> {
        match items.get(i) {
            Some(V::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            Some(V::Int(n)) => Ok(n.to_string()),
            other => Err(format!("field {i}: expected a string, got {other:?}")),
        }
    };
    let unsigned = |i: usize| int(i).map(|n| u64::try_from(n).unwrap_or(0));
    if int(0)? < 0 {
        return Ok(Synced::Fenced);
    }
    Ok(Synced::Held {
        token: text(1)?,
        held: unsigned(2)?,
        total: unsigned(3)?,
        all_held: unsigned(4)?,
        all_used: unsigned(5)?,
        hold_ttl: Duration::from_millis(unsigned(6)?),
        hold_id: text(7)?,
        allowed: unsigned(8)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = Keys::new("pool-a");
        for key in &keys.names {
            assert!(key.starts_with("sluicegate:window:{pool-a}:"), "{key}");
        }
    }

    #[test]
    fn units_are_usable_for_nine_tenths_of_the_lease_from_before_the_sync() {
        let settings = SharedWindowSettings {
            lease: Duration::from_secs(2),
            chunk: 2,
            max_staleness: Duration::from_secs(60),
            orphan_hold: Duration::from_secs(120),
        };
        assert_eq!(settings.valid_for(), Duration::from_millis(1800));
        assert_eq!(settings.renew_every(), Duration::from_secs(2) / 3);
        // A renewal, and its reply within its timeout (a third of the
        // lease), comes before the units lapse.
        assert!(settings.renew_every() * 2 < settings.valid_for());
    }

    #[test]
    fn units_are_taken_and_given_back_in_chunks() {
        // Demand with little slack: top up to in flight + chunk.
        assert_eq!(want_units(5, 4, 4, true, true), 8);
        // Enough slack: keep what is held (no round trip for a unit).
        assert_eq!(want_units(7, 4, 4, true, true), 7);
        // Idle with too much slack: give back to in flight + chunk.
        assert_eq!(want_units(20, 4, 4, false, true), 8);
        assert_eq!(want_units(12, 4, 4, false, true), 12);
        // No live reading: keep only what is in flight.
        assert_eq!(want_units(20, 4, 4, true, false), 4);
        // Never below what is in flight.
        assert_eq!(want_units(2, 6, 4, false, true), 6);
    }

    #[test]
    fn a_fenced_reply_and_a_held_reply_parse() {
        use redis::Value as V;
        assert_eq!(parse_reply(V::Array(vec![V::Int(-1)])), Ok(Synced::Fenced));
        let reply = V::Array(vec![
            V::Int(1),
            V::BulkString(b"7".to_vec()),
            V::Int(3),
            V::Int(10),
            V::Int(9),
            V::Int(2),
            V::Int(1500),
            V::BulkString(b"12".to_vec()),
            V::Int(2),
        ]);
        assert_eq!(
            parse_reply(reply),
            Ok(Synced::Held {
                token: "7".into(),
                held: 3,
                total: 10,
                all_held: 9,
                all_used: 2,
                hold_ttl: Duration::from_millis(1500),
                hold_id: "12".into(),
                allowed: 2,
            })
        );
    }
}
