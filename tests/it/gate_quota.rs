//! `redis-quota` against a real `redis-server`: both modes count in
//! upstream's keys (`quota:userid:<tenant>`, inspected with `redis-cli`),
//! classify `reserved` / `overflow`, fail closed (no attribute, Redis
//! down), authenticate with `[redis]` credentials, and a SIGKILLed `sluicegate run`'s concurrency units come back
//! when their leases expire.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::cli::{Background, sluicegate};
use crate::support::redis::RedisServer;
use crate::support::redis::submit;
use crate::support::tenants::{recording_gateway, seen, tenant_line};
use serde_json::json;
use sluicegate::clock::unix_secs;
use sluicegate::config::{GateSpec, Secret};
use sluicegate::gate::{
    Admission, AdmissionRequest, Classification, DispatchGate, GateContext, build_gate,
};

fn gate(params: serde_json::Value) -> Box<dyn DispatchGate> {
    let spec = GateSpec::parse("redis-quota", &params, "q").expect("valid params");
    let ctx = GateContext::new(None, None, Duration::from_secs(1), Duration::from_secs(10));
    build_gate(&spec, &ctx).expect("builds")
}

/// Credentials from `[redis]` reach the quota gate's connection (AUTH),
/// as they do the `redis` gate's; without them it refuses.
#[tokio::test(flavor = "multi_thread")]
async fn authenticates_with_the_redis_section_credentials() {
    use crate::support::redis::RedisOptions;
    let server = RedisServer::start_with(RedisOptions {
        password: Some("quota-pass".into()),
        ..RedisOptions::default()
    });
    let spec = GateSpec::parse(
        "redis-quota",
        &json!({"address": format!("127.0.0.1:{}", server.port), "limit": 1}),
        "q",
    )
    .expect("valid params");
    let mut redis = support::redis::redis_config(&server);
    redis.password = Some(Secret::new("quota-pass"));
    let with = GateContext::new(
        None,
        Some(redis),
        Duration::from_secs(1),
        Duration::from_secs(10),
    );
    let authed = build_gate(&spec, &with).expect("builds");
    let v = admit(authed.as_ref(), &tenant("frank")).await;
    assert_eq!(classification(&v), Some(Classification::Reserved), "{v:?}");
    let without = gate(json!({"address": format!("127.0.0.1:{}", server.port), "limit": 1}));
    assert!(matches!(
        admit(without.as_ref(), &tenant("frank")).await,
        Admission::Refuse {
            reason: "quota_unavailable"
        }
    ));
}

fn tenant(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("userid".to_owned(), name.to_owned())])
}

async fn admit(gate: &dyn DispatchGate, metadata: &BTreeMap<String, String>) -> Admission {
    let labels = BTreeMap::new();
    gate.admit(AdmissionRequest::new("r", metadata, &labels))
        .await
}

fn classification(verdict: &Admission) -> Option<Classification> {
    match verdict {
        Admission::Continue(ticket) => ticket.classification(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limit_is_a_sliding_window_in_the_upstream_key() {
    let server = RedisServer::start();
    let g = gate(json!({
        "address": format!("127.0.0.1:{}", server.port),
        "limit": "3", "window": "2s",
    }));
    let alice = tenant("alice");
    for _ in 0..3 {
        let v = admit(g.as_ref(), &alice).await;
        assert_eq!(classification(&v), Some(Classification::Reserved), "{v:?}");
    }
    let over = admit(g.as_ref(), &alice).await;
    assert!(
        matches!(
            over,
            Admission::Refuse {
                reason: "over_quota"
            }
        ),
        "{over:?}"
    );
    // Upstream's key and type: a ZSET of admissions, expiring.
    assert_eq!(server.cli(&["TYPE", "quota:userid:alice"]).trim(), "zset");
    assert_eq!(server.int(&["ZCARD", "quota:userid:alice"]), 3);
    let ttl = server.int(&["PTTL", "quota:userid:alice"]);
    assert!(ttl > 0 && ttl <= 3000, "PTTL {ttl}");
    // Another tenant has its own quota.
    let bob = admit(g.as_ref(), &tenant("bob")).await;
    assert_eq!(classification(&bob), Some(Classification::Reserved));
    assert_eq!(server.int(&["ZCARD", "quota:userid:bob"]), 1);
    // The window slides: the admissions age out.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let again = admit(g.as_ref(), &alice).await;
    assert_eq!(classification(&again), Some(Classification::Reserved));
    assert_eq!(server.int(&["ZCARD", "quota:userid:alice"]), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrency_units_are_leases_renewed_while_held_and_removed_when_done() {
    let server = RedisServer::start();
    let g = gate(json!({
        "address": format!("127.0.0.1:{}", server.port),
        "mode": "concurrency", "limit": 2, "lease": "1s", "prefix": "q:",
        "gating_mode": "blocking",
    }));
    let alice = tenant("alice");
    let first = admit(g.as_ref(), &alice).await;
    let second = admit(g.as_ref(), &alice).await;
    assert_eq!(classification(&first), Some(Classification::Reserved));
    assert_eq!(classification(&second), Some(Classification::Reserved));
    // Blocking mode: over the limit waits (parks) rather than refusing.
    let third = admit(g.as_ref(), &alice).await;
    assert!(
        matches!(
            third,
            Admission::Wait {
                reason: "over_quota"
            }
        ),
        "{third:?}"
    );
    assert_eq!(server.cli(&["TYPE", "q:userid:alice"]).trim(), "zset");
    assert_eq!(server.int(&["ZCARD", "q:userid:alice"]), 2);
    // Held for three leases: the renewals keep both units taken.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert!(matches!(
        admit(g.as_ref(), &alice).await,
        Admission::Wait { .. }
    ));
    assert_eq!(server.int(&["ZCARD", "q:userid:alice"]), 2);
    // The request ends: its unit is removed at once (not at lease expiry).
    drop(first);
    support::wait_until(Duration::from_secs(5), "unit removed", || {
        server.int(&["ZCARD", "q:userid:alice"]) == 1
    })
    .await;
    let fourth = admit(g.as_ref(), &alice).await;
    assert_eq!(classification(&fourth), Some(Classification::Reserved));
    drop((second, fourth));
}

#[tokio::test(flavor = "multi_thread")]
async fn fails_closed_without_attribute_or_redis_and_classifies_overflow_when_asked() {
    let server = RedisServer::start();
    let address = format!("127.0.0.1:{}", server.port);
    let strict = gate(json!({"address": address, "limit": 1}));
    let verdict = admit(strict.as_ref(), &BTreeMap::new()).await;
    assert!(
        matches!(
            verdict,
            Admission::Refuse {
                reason: "quota_attribute_missing"
            }
        ),
        "{verdict:?}"
    );
    // An empty value is no tenant either.
    assert!(matches!(
        admit(strict.as_ref(), &tenant("")).await,
        Admission::Refuse { .. }
    ));
    let lenient = gate(json!({"address": address, "limit": 1, "missing_attribute": "allow"}));
    let verdict = admit(lenient.as_ref(), &BTreeMap::new()).await;
    assert!(matches!(verdict, Admission::Continue(_)), "{verdict:?}");
    assert_eq!(classification(&verdict), None);

    // Upstream's classifying mode: over quota goes on as overflow.
    let classifying = gate(json!({"address": address, "limit": 1, "admit_overflow": true}));
    let carol = tenant("carol");
    let within = admit(classifying.as_ref(), &carol).await;
    let over = admit(classifying.as_ref(), &carol).await;
    assert_eq!(classification(&within), Some(Classification::Reserved));
    assert_eq!(classification(&over), Some(Classification::Overflow));
    assert_eq!(server.int(&["ZCARD", "quota:userid:carol"]), 1);

    // Redis unreachable: refused, never admitted.
    let (_refusing, port) = support::refused_port();
    let down = gate(json!({"address": format!("127.0.0.1:{port}"), "limit": 5}));
    let verdict = admit(down.as_ref(), &carol).await;
    assert!(
        matches!(
            verdict,
            Admission::Refuse {
                reason: "quota_unavailable"
            }
        ),
        "{verdict:?}"
    );
}

/// The units a SIGKILLed dispatcher held in `concurrency` mode come back
/// once their leases expire: nothing renews them any more.
#[tokio::test(flavor = "multi_thread")]
async fn concurrency_units_of_a_sigkilled_dispatcher_come_back_after_their_lease() {
    const LIMIT: usize = 4;
    let server = RedisServer::start();
    // The gateway never answers in time: the units stay held.
    let (gateway, arrivals) = recording_gateway(Duration::from_secs(600)).await;
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..LIMIT + 2)
        .map(|i| tenant_line(&format!("k-{i}"), "alice", deadline))
        .collect();
    submit(&server, "killq", &lines).await;
    let params = json!({
        "address": format!("127.0.0.1:{}", server.port),
        "mode": "concurrency", "limit": LIMIT, "lease": "2s",
    })
    .to_string();
    let mut run = Background::spawn(
        sluicegate(&["run"])
            .env("SLUICEGATE_TRANSPORT", "redis")
            .env("SLUICEGATE_REDIS_URL", server.url())
            .env("SLUICEGATE_QUEUE", "killq")
            .env("SLUICEGATE_GATEWAY_URL", gateway.uri())
            .env("SLUICEGATE_GATE_TYPE", "redis-quota")
            .env("SLUICEGATE_GATE_PARAMS", &params)
            .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
            .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
            .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms"),
    );
    support::wait_until(Duration::from_secs(30), "the limit is in flight", || {
        seen(&arrivals).len() >= LIMIT
    })
    .await;
    // Past two leases the live process still holds every unit (renewed),
    // and the quota kept the rest back.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(seen(&arrivals).len(), LIMIT);
    let now_us = |server: &RedisServer| {
        let t = server.cli(&["TIME"]);
        let mut parts = t.lines().map(|l| l.trim().parse::<i64>().expect("TIME"));
        let (s, us) = (parts.next().expect("s"), parts.next().expect("us"));
        s * 1_000_000 + us
    };
    let live = |server: &RedisServer| {
        let from = format!("({}", now_us(server));
        server.int(&["ZCOUNT", "quota:userid:alice", &from, "+inf"])
    };
    assert_eq!(live(&server), LIMIT as i64);
    run.kill();
    // Nobody renews: within a lease (plus slack) every unit has expired,
    // and a new admission for the tenant succeeds up to the limit.
    support::wait_until(Duration::from_secs(10), "leases expire", || {
        live(&server) == 0
    })
    .await;
    let g = gate(json!({
        "address": format!("127.0.0.1:{}", server.port),
        "mode": "concurrency", "limit": LIMIT, "lease": "2s",
    }));
    let alice = tenant("alice");
    let mut held = Vec::new();
    for _ in 0..LIMIT {
        let v = admit(g.as_ref(), &alice).await;
        assert_eq!(classification(&v), Some(Classification::Reserved), "{v:?}");
        held.push(v);
    }
    assert!(matches!(
        admit(g.as_ref(), &alice).await,
        Admission::Refuse { .. }
    ));
}
