//! `redis-leased-rate` against a real `redis-server`: a planner's lease in
//! upstream's hash format admits at its rate from a token bucket kept in
//! `<control key>:state`; a missing, expired, malformed or foreign lease is
//! budget zero and refuses every message without creating bucket state; a
//! pause (rate 0) is a valid zero; each new decision id is acknowledged in
//! `<control key>:applied`; Redis going away is zero, and its return is
//! picked up without a restart.
//!
//! No wall-clock thresholds: rates are so low (one token per 1000 s) that a
//! slow test cannot refill a token by itself, and refills are made by
//! moving the bucket's `last_ms` back on the Redis clock.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::redis::RedisServer;
use serde_json::json;
use sluicegate::config::GateSpec;
use sluicegate::gate::{
    AdmissionRequest, Budget, DispatchGate, GateContext, LEASE_API_VERSION, build_gate,
};

const CONTROL: &str = "llm-d-async:drain-limit:pool-a";
const STATE: &str = "llm-d-async:drain-limit:pool-a:state";
const APPLIED: &str = "llm-d-async:drain-limit:pool-a:applied";
const REPLICA: &str = "replica-under-test";

fn build(server: &RedisServer, extra: serde_json::Value) -> Box<dyn DispatchGate> {
    let mut params = json!({
        "address": format!("127.0.0.1:{}", server.port),
        "control_key": CONTROL,
    });
    for (k, v) in extra.as_object().expect("object") {
        params[k] = v.clone();
    }
    let spec = GateSpec::parse("redis-leased-rate", &params, "q").expect("valid params");
    let mut ctx = GateContext::new(None, None, Duration::ZERO, Duration::from_secs(10));
    ctx.replica = REPLICA.to_owned();
    ctx.worker_pool_id = "pool-a".to_owned();
    build_gate(&spec, &ctx).expect("builds")
}

/// The Redis server's clock in Unix milliseconds.
fn redis_now_ms(server: &RedisServer) -> i64 {
    let time = server.cli(&["TIME"]);
    let mut parts = time.lines().map(|l| l.trim().parse::<i64>().expect("TIME"));
    let (s, us) = (parts.next().expect("s"), parts.next().expect("us"));
    s * 1000 + us / 1000
}

/// Writes a lease as a planner does (`HSET` of the five fields).
fn write_lease(server: &RedisServer, pool: &str, rps: &str, valid_until_ms: &str, decision: &str) {
    server.cli(&[
        "HSET",
        CONTROL,
        "api_version",
        LEASE_API_VERSION,
        "pool_id",
        pool,
        "max_admission_rps",
        rps,
        "valid_until_unix_ms",
        valid_until_ms,
        "decision_id",
        decision,
    ]);
}

fn in_a_minute(server: &RedisServer) -> String {
    (redis_now_ms(server) + 60_000).to_string()
}

async fn verdict(gate: &dyn DispatchGate) -> (&'static str, &'static str) {
    let empty = BTreeMap::new();
    let a = gate.admit(AdmissionRequest::new("r", &empty, &empty)).await;
    (a.verdict_label(), a.reason_label())
}

/// Moves the bucket's clock back `ms` and empties it: the next admission
/// refills `ms / 1000 × rate` tokens.
fn age_bucket(server: &RedisServer, ms: i64) {
    let last = redis_now_ms(server) - ms;
    server.cli(&["HSET", STATE, "tokens", "0", "last_ms", &last.to_string()]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_valid_lease_admits_at_its_rate_and_is_acknowledged() {
    let server = RedisServer::start();
    // 0.001/s × 2000 s: a bucket of 2 tokens refilling one per 1000 s.
    let gate = build(&server, json!({"burst_seconds": 2000}));
    write_lease(&server, "pool-a", "0.001", &in_a_minute(&server), "d-1");

    let reading = gate.observe().await.expect("a valid lease is readable");
    assert_eq!(reading.budget, Budget::FULL);
    assert!(reading.reason.contains("d-1"), "{}", reading.reason);
    assert_eq!(server.cli(&["HGET", APPLIED, REPLICA]).trim(), "d-1");
    let ttl = server.int(&["TTL", APPLIED]);
    assert!(ttl > 0 && ttl <= 3600, "acknowledgements expire: {ttl}");

    // The bucket starts full: its burst, then nothing.
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "rate_limited"));
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "rate_limited"));
    // The state is upstream's hash, expiring after the lease.
    assert_eq!(server.cli(&["HEXISTS", STATE, "last_ms"]).trim(), "1");
    let pttl = server.int(&["PTTL", STATE]);
    assert!(
        pttl > 0 && pttl <= 61_000,
        "state expires with the lease: {pttl}"
    );

    // 1000 s of the leased rate is one token: one admission, then none.
    age_bucket(&server, 1_000_000);
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "rate_limited"));
    // A long pause refills only up to the burst (2 tokens).
    age_bucket(&server, 100_000_000);
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "rate_limited"));
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_share_one_bucket() {
    let server = RedisServer::start();
    let a = build(&server, json!({"burst_seconds": 1000}));
    let b = build(&server, json!({"burst_seconds": 1000}));
    write_lease(&server, "pool-a", "0.001", &in_a_minute(&server), "d-1");
    // One token (0.001 × 1000) for both.
    assert_eq!(verdict(a.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(b.as_ref()).await, ("refuse", "rate_limited"));
    assert_eq!(verdict(a.as_ref()).await, ("refuse", "rate_limited"));
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_expired_malformed_or_foreign_leases_are_zero() {
    let server = RedisServer::start();
    let gate = build(&server, json!({"pool_id": "pool-a"}));

    // Missing: no hash at all.
    assert!(gate.observe().await.is_err(), "missing lease");
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "lease_invalid"));

    let until = in_a_minute(&server);
    let expired = (redis_now_ms(&server) - 1).to_string();
    let cases: [(&str, &str, &str, &str); 8] = [
        ("expired", "pool-a", "5", &expired),
        ("NaN rate", "pool-a", "NaN", &until),
        ("infinite rate", "pool-a", "+Inf", &until),
        ("negative rate", "pool-a", "-1", &until),
        ("fractional expiry", "pool-a", "5", "1700000060000.5"),
        ("text expiry", "pool-a", "5", "soon"),
        ("empty rate", "pool-a", "", &until),
        ("another pool", "pool-b", "5", &until),
    ];
    for (what, pool, rps, valid_until) in cases {
        server.cli(&["DEL", CONTROL, STATE]);
        write_lease(&server, pool, rps, valid_until, "d-bad");
        let reading = gate.observe().await;
        assert!(reading.is_err(), "{what}: {reading:?}");
        assert_eq!(
            verdict(gate.as_ref()).await,
            ("refuse", "lease_invalid"),
            "{what}"
        );
        assert_eq!(
            server.int(&["EXISTS", STATE]),
            0,
            "{what}: no bucket state for an unusable lease"
        );
    }
    // A wrong api_version and a missing decision id.
    server.cli(&["DEL", CONTROL]);
    write_lease(&server, "pool-a", "5", &until, "d-ok");
    server.cli(&["HSET", CONTROL, "api_version", "llm-d.ai/v0"]);
    assert!(gate.observe().await.is_err(), "wrong api_version");
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "lease_invalid"));
    server.cli(&["DEL", CONTROL]);
    write_lease(&server, "pool-a", "5", &until, "d-ok");
    server.cli(&["HDEL", CONTROL, "decision_id"]);
    assert!(gate.observe().await.is_err(), "no decision id");
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "lease_invalid"));
    // None of them was acknowledged.
    assert_eq!(server.int(&["EXISTS", APPLIED]), 0);

    // Redis unreachable: zero as well.
    let (_refusing, port) = support::refused_port();
    let down = {
        let spec = GateSpec::parse(
            "redis-leased-rate",
            &json!({"address": format!("127.0.0.1:{port}"),
                    "control_key": CONTROL, "pool_id": "pool-a"}),
            "q",
        )
        .expect("valid");
        let ctx = GateContext::new(None, None, Duration::ZERO, Duration::from_secs(2));
        build_gate(&spec, &ctx).expect("builds")
    };
    assert!(down.observe().await.is_err());
    assert_eq!(
        verdict(down.as_ref()).await,
        ("refuse", "lease_unavailable")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pause_is_zero_and_a_new_decision_is_picked_up() {
    let server = RedisServer::start();
    // No pool_id: the queue's worker pool (`pool-a` in this context).
    let gate = build(&server, json!({"burst_seconds": 1000}));
    write_lease(&server, "pool-a", "0", &in_a_minute(&server), "pause-1");
    let reading = gate.observe().await.expect("a pause is a valid lease");
    assert_eq!(reading.budget, Budget::ZERO);
    assert!(reading.source_available);
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "lease_paused"));
    assert_eq!(server.cli(&["HGET", APPLIED, REPLICA]).trim(), "pause-1");

    // The planner's next decision: a rate, then a new expiry.
    write_lease(&server, "pool-a", "0.001", &in_a_minute(&server), "d-2");
    let reading = gate.observe().await.expect("readable");
    assert_eq!(reading.budget, Budget::FULL);
    assert!(reading.reason.contains("d-2"), "{}", reading.reason);
    assert_eq!(server.cli(&["HGET", APPLIED, REPLICA]).trim(), "d-2");
    assert_eq!(verdict(gate.as_ref()).await, ("continue", "admitted"));
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "rate_limited"));

    // The lease runs out (written expired by the planner's clock): zero.
    let expired = (redis_now_ms(&server) - 1).to_string();
    write_lease(&server, "pool-a", "0.001", &expired, "d-3");
    assert!(gate.observe().await.is_err());
    assert_eq!(verdict(gate.as_ref()).await, ("refuse", "lease_invalid"));
    // An expired decision is not acknowledged.
    assert_eq!(server.cli(&["HGET", APPLIED, REPLICA]).trim(), "d-2");
}

#[tokio::test(flavor = "multi_thread")]
async fn probe_explains_the_lease() {
    let server = RedisServer::start();
    let gate = build(&server, json!({}));
    write_lease(&server, "pool-a", "3", &in_a_minute(&server), "d-9");
    let e = gate.explain().await;
    assert!(e.observation.is_ok());
    assert_eq!(e.sources.len(), 1);
    assert!(e.sources[0].target.contains(CONTROL), "{:?}", e.sources);
    assert_eq!(
        e.sources[0].values,
        vec![("max_admission_rps".to_owned(), 3.0)]
    );
    let notes = e.notes.join("\n");
    assert!(notes.contains(STATE) && notes.contains(APPLIED), "{notes}");
    // Looking is not applying: the probe acknowledges nothing.
    assert_eq!(server.int(&["EXISTS", APPLIED]), 0);
}

/// Redis gone while a valid lease is held: the gate reads no lease (budget
/// zero: fail closed, never the last rate it saw) and refuses every
/// message as `lease_unavailable`; once Redis is back and the planner has
/// written a lease again, the same gate admits again.
#[tokio::test(flavor = "multi_thread")]
async fn redis_down_is_zero_and_the_gate_recovers_when_it_returns() {
    let mut server = RedisServer::start();
    let gate = build(&server, json!({"burst_seconds": 2000}));
    write_lease(&server, "pool-a", "0.001", &in_a_minute(&server), "d-1");
    assert_eq!(gate.observe().await.expect("readable").budget, Budget::FULL);

    server.kill();
    match gate.observe().await {
        Err(_) => {}
        Ok(reading) => assert_eq!(reading.budget, Budget::ZERO, "{}", reading.reason),
    }
    assert_eq!(
        verdict(gate.as_ref()).await,
        ("refuse", "lease_unavailable")
    );

    server.restart();
    write_lease(&server, "pool-a", "0.001", &in_a_minute(&server), "d-2");
    // The connection comes back on its own; bounded, no timing asserted.
    let mut admitted = false;
    for _ in 0..100 {
        if gate.observe().await.is_ok_and(|r| r.budget == Budget::FULL)
            && verdict(gate.as_ref()).await == ("continue", "admitted")
        {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        admitted,
        "the gate admits again once Redis and the lease are back"
    );
    assert_eq!(server.cli(&["HGET", APPLIED, REPLICA]).trim(), "d-2");
}
