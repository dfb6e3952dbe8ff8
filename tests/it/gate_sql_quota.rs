//! `sql-quota` against a real PostgreSQL (started by `support::postgres`):
//! both modes count in upstream's quota tables (inspected with `psql`),
//! classify `reserved` / `overflow`, wait or refuse per `gating_mode`,
//! give units back, share one count across two gates (two dispatchers),
//! and fail closed (no attribute, database down, no `[sql] url`).

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::postgres::Postgres;
use serde_json::json;
use sluicegate::config::{Config, GateSpec, SqlConfig};
use sluicegate::gate::{
    Admission, AdmissionRequest, Classification, DispatchGate, GateContext, build_gate,
};

fn ctx(url: &str) -> GateContext {
    let mut ctx = GateContext::new(None, None, Duration::from_secs(1), Duration::from_secs(10));
    ctx.sql = Some(SqlConfig {
        url: Some(sluicegate::config::EndpointUrl::new(
            url::Url::parse(url).expect("url"),
        )),
        connect_timeout: Duration::from_secs(2),
        ..SqlConfig::default()
    });
    ctx
}

fn gate(url: &str, params: serde_json::Value) -> Box<dyn DispatchGate> {
    let spec = GateSpec::parse("sql-quota", &params, "q").expect("valid params");
    build_gate(&spec, &ctx(url)).expect("builds")
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

fn is_refused(v: &Admission, why: &str) -> bool {
    matches!(v, Admission::Refuse { reason } if *reason == why)
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limit_counts_in_upstreams_window_tables_and_refunds() {
    let pg = Postgres::start();
    let g = gate(&pg.url(), json!({"limit": "3", "window": "2s"}));
    let alice = tenant("alice");
    let mut held = Vec::new();
    for _ in 0..3 {
        let v = admit(g.as_ref(), &alice).await;
        assert_eq!(classification(&v), Some(Classification::Reserved), "{v:?}");
        held.push(v);
    }
    let over = admit(g.as_ref(), &alice).await;
    assert!(is_refused(&over, "over_quota"), "{over:?}");
    // Upstream's key and tables: one window row, its admissions.
    assert_eq!(
        pg.psql("SELECT used FROM async_quota_windows WHERE key = 'quota:userid:alice' AND window_ms = 2000"),
        "3"
    );
    assert_eq!(
        pg.psql("SELECT sum(n) FROM async_quota_admits WHERE key = 'quota:userid:alice'"),
        "3"
    );
    // Another tenant has its own quota.
    let bob = admit(g.as_ref(), &tenant("bob")).await;
    assert_eq!(classification(&bob), Some(Classification::Reserved));
    // An admission whose message was not sent after all is given back.
    if let Some(Admission::Continue(ticket)) = held.pop() {
        ticket.refund();
    }
    support::wait_until(Duration::from_secs(10), "refund", || {
        pg.psql("SELECT used FROM async_quota_windows WHERE key = 'quota:userid:alice'") == "2"
    })
    .await;
    let again = admit(g.as_ref(), &alice).await;
    assert_eq!(
        classification(&again),
        Some(Classification::Reserved),
        "{again:?}"
    );
    // The window slides: the admissions age out.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let later = admit(g.as_ref(), &alice).await;
    assert_eq!(
        classification(&later),
        Some(Classification::Reserved),
        "{later:?}"
    );
    assert_eq!(
        pg.psql("SELECT used FROM async_quota_windows WHERE key = 'quota:userid:alice'"),
        "1"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrency_slots_are_shared_by_two_dispatchers_and_given_back() {
    let pg = Postgres::start();
    let params =
        json!({"limit": 2, "mode": "concurrency", "gating_mode": "blocking", "lease": "3s"});
    let a = gate(&pg.url(), params.clone());
    let b = gate(&pg.url(), params);
    let carol = tenant("carol");
    let first = admit(a.as_ref(), &carol).await;
    let second = admit(b.as_ref(), &carol).await;
    assert_eq!(classification(&first), Some(Classification::Reserved));
    assert_eq!(classification(&second), Some(Classification::Reserved));
    // Full across both: blocking mode waits.
    let third = admit(a.as_ref(), &carol).await;
    assert!(
        matches!(
            third,
            Admission::Wait {
                reason: "over_quota"
            }
        ),
        "{third:?}"
    );
    // Two holders, one slot each, in upstream's tables.
    assert_eq!(
        pg.psql("SELECT sum(used) FROM async_quota_slots WHERE key = 'quota:userid:carol'"),
        "2"
    );
    assert_eq!(pg.psql("SELECT COUNT(*) FROM async_quota_holders"), "2");
    // Holders are renewed while held: still full after two leases.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let still = admit(b.as_ref(), &carol).await;
    assert!(matches!(still, Admission::Wait { .. }), "{still:?}");
    // The request ends: its slot comes back.
    drop(first);
    support::wait_until(Duration::from_secs(10), "slot given back", || {
        pg.psql("SELECT sum(used) FROM async_quota_slots WHERE key = 'quota:userid:carol'") == "1"
    })
    .await;
    let now = admit(b.as_ref(), &carol).await;
    assert_eq!(
        classification(&now),
        Some(Classification::Reserved),
        "{now:?}"
    );
    // Every request ended: nothing counts any more.
    drop(a);
    drop(now);
    drop(second);
    support::wait_until(Duration::from_secs(10), "all slots back", || {
        pg.psql(
            "SELECT coalesce(sum(s.used), 0) FROM async_quota_slots s JOIN async_quota_holders h USING (holder)
             WHERE s.key = 'quota:userid:carol' AND h.expires_ms > (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        ) == "0"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn overflow_missing_attribute_and_a_down_database() {
    let mut pg = Postgres::start();
    let over = gate(
        &pg.url(),
        json!({"limit": 1, "admit_overflow": true, "mode": "concurrency"}),
    );
    let dave = tenant("dave");
    let held = admit(over.as_ref(), &dave).await;
    assert_eq!(classification(&held), Some(Classification::Reserved));
    let spill = admit(over.as_ref(), &dave).await;
    assert_eq!(
        classification(&spill),
        Some(Classification::Overflow),
        "{spill:?}"
    );
    let none = admit(over.as_ref(), &BTreeMap::new()).await;
    assert!(is_refused(&none, "quota_attribute_missing"), "{none:?}");
    let allow = gate(&pg.url(), json!({"limit": 1, "missing_attribute": "allow"}));
    let let_in = admit(allow.as_ref(), &BTreeMap::new()).await;
    assert!(matches!(let_in, Admission::Continue(_)), "{let_in:?}");
    // The database down: refuse (fail closed), never admit uncounted.
    pg.stop();
    let down = admit(over.as_ref(), &tenant("erin")).await;
    assert!(is_refused(&down, "quota_unavailable"), "{down:?}");
    let fresh = gate(&pg.url(), json!({"limit": 1}));
    let never = admit(fresh.as_ref(), &tenant("erin")).await;
    assert!(is_refused(&never, "quota_unavailable"), "{never:?}");
}

#[test]
fn params_and_the_sql_section_are_checked_by_key() {
    let bad = GateSpec::parse(
        "sql-quota",
        &json!({"limit": 1, "mode": "burst"}),
        "queue[0]",
    )
    .expect_err("bad mode")
    .to_string();
    assert!(bad.contains("mode"), "{bad}");
    assert!(
        bad.contains("rate-limit") && bad.contains("concurrency"),
        "{bad}"
    );
    let missing = GateSpec::parse("sql-quota", &json!({}), "queue[0]")
        .expect_err("no limit")
        .to_string();
    assert!(missing.contains("limit"), "{missing}");
    let address = GateSpec::parse(
        "sql-quota",
        &json!({"limit": 1, "address": "h:1"}),
        "queue[0]",
    )
    .expect_err("address is redis-quota's")
    .to_string();
    assert!(address.contains("address"), "{address}");
    let toml = r#"
transport = "memory"
[[queue]]
queue_name = "q"
igw_base_url = "http://127.0.0.1:1"
gate_type = "sql-quota"
gate_params = { limit = 1 }
"#;
    let err = Config::from_toml_str(toml, &Default::default())
        .expect_err("needs [sql] url")
        .to_string();
    assert!(err.contains("sql.url"), "{err}");
    let with = format!("{toml}\n[sql]\nurl = \"postgres://h/db\"\n");
    Config::from_toml_str(&with, &Default::default()).expect("valid with [sql] url");
}

/// A dispatcher that died holding a slot (its holder row and slot left
/// behind, never renewed, as after a SIGKILL; written here as upstream's
/// or our own dispatcher leaves them) stops counting once the holder's
/// lease lapses; another dispatcher is admitted then.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_dispatchers_slots_stop_counting_when_its_holder_lapses() {
    let pg = Postgres::start();
    let params =
        json!({"limit": 1, "mode": "concurrency", "gating_mode": "blocking", "lease": "1s"});
    let survivor = gate(&pg.url(), params);
    let frank = tenant("frank");
    // Opens the connection and creates the schema.
    drop(admit(survivor.as_ref(), &tenant("warm-up")).await);
    pg.psql(
        "INSERT INTO async_quota_holders (holder, expires_ms)
             VALUES ('dead-dispatcher', (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 1500);
         INSERT INTO async_quota_slots (key, holder, used) VALUES ('quota:userid:frank', 'dead-dispatcher', 1)",
    );
    let blocked = admit(survivor.as_ref(), &frank).await;
    assert!(matches!(blocked, Admission::Wait { .. }), "{blocked:?}");
    let give_up = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let v = admit(survivor.as_ref(), &frank).await;
        if classification(&v) == Some(Classification::Reserved) {
            break;
        }
        assert!(std::time::Instant::now() < give_up, "still blocked: {v:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The lapsed holder is deleted with its slots a lease later.
    support::wait_until(Duration::from_secs(10), "dead holder reaped", || {
        pg.psql("SELECT COUNT(*) FROM async_quota_holders WHERE holder = 'dead-dispatcher'") == "0"
    })
    .await;
}

#[test]
fn gate_probe_explains_the_rule_and_masks_the_password() {
    let tmp = support::TempDir::new("sql-quota-probe");
    let config = tmp.0.join("probe.toml");
    std::fs::write(
        &config,
        r#"
transport = "memory"
[sql]
url = "postgres://u:hunter2@127.0.0.1:1/db"
[[queue]]
queue_name = "q"
igw_base_url = "http://127.0.0.1:1"
gate_type = "sql-quota"
gate_params = { limit = 5, mode = "concurrency", gating_mode = "blocking" }
"#,
    )
    .expect("config");
    let path = config.to_string_lossy().into_owned();
    let out = support::cli::output(&mut support::cli::sluicegate(&[
        "gate", "probe", "--config", &path,
    ]));
    let text = support::cli::text(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("at most 5 requests in flight per `userid` value"),
        "{text}"
    );
    assert!(text.contains("counted in PostgreSQL"), "{text}");
    assert!(text.contains("a message over quota waits"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}
