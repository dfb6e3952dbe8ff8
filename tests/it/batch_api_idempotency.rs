//! The Batch API's `Idempotency-Key` on the Redis store (the SQLite
//! store and the files endpoint are driven by the openai client in
//! `tests/python/test_idempotency.py`): two replicas share the records, a
//! retried create on either returns the first batch, another body is a
//! 409 in OpenAI's error shape, keys are per tenant.

use crate::support;

use crate::support::redis::RedisServer;
use crate::support::serve::{Api, ServeSpec, completion_lines, start};
use crate::support::sim::small_pool;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_create_on_another_replica_returns_the_first_batch() {
    let redis = RedisServer::start();
    let sim = small_pool().await;
    let shared = support::TempDir::new("serve-idem");
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.redis_port = Some(redis.port);
    spec.keys = Some("acme:k,zeta:z".into());
    let a = start(&spec, Some(&shared.0)).await;
    spec.in_process = false;
    let b = start(&spec, Some(&shared.0)).await;
    let (api_a, api_b) = (Api::new(&a.base, Some("k")), Api::new(&b.base, Some("k")));

    let (status, file) = api_a
        .upload("batch", completion_lines(2, 4).as_bytes())
        .await;
    assert_eq!(status, 200, "{file}");
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"});
    let key = [("Idempotency-Key", "nightly-7")];
    let (status, first) = api_a.post_with("/v1/batches", &body, &key).await;
    assert_eq!(status, 200, "{first}");
    // The same body with its keys in another order is the same request.
    let reordered = json!({"completion_window": "24h", "endpoint": "/v1/completions",
        "input_file_id": file["id"]});
    let (status, again) = api_b.post_with("/v1/batches", &reordered, &key).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], first["id"]);
    let (_, list) = api_a.get("/v1/batches?limit=100").await;
    let ids = list["data"].as_array().expect("list");
    assert_eq!(ids.len(), 1, "one batch, not two: {list}");

    let other = json!({"input_file_id": file["id"], "endpoint": "/v1/completions",
        "completion_window": "24h", "metadata": {"run": "2"}});
    let (status, conflict) = api_b.post_with("/v1/batches", &other, &key).await;
    assert_eq!(status, 409, "{conflict}");
    assert_eq!(conflict["error"]["code"], "idempotency_key_conflict");
    assert_eq!(conflict["error"]["type"], "invalid_request_error");
    assert!(conflict["error"]["param"].is_null());
    let message = conflict["error"]["message"].as_str().expect("message");
    assert!(message.contains("`nightly-7`"), "{message}");
    let keys = redis.cli(&["KEYS", "*idem:batch:acme:nightly-7"]);
    assert_eq!(keys.lines().count(), 1, "{keys}");

    // Another tenant's key of the same name is its own.
    let zeta = Api::new(&a.base, Some("z"));
    let (status, zfile) = zeta
        .upload("batch", completion_lines(1, 4).as_bytes())
        .await;
    assert_eq!(status, 200, "{zfile}");
    let zbody = json!({"input_file_id": zfile["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"});
    let (status, zbatch) = zeta.post_with("/v1/batches", &zbody, &key).await;
    assert_eq!(status, 200, "{zbatch}");
    assert_ne!(zbatch["id"], first["id"]);

    // A header that cannot be a key is a 400, and makes nothing.
    let long = "x".repeat(300);
    let (status, bad) = api_a
        .post_with("/v1/batches", &body, &[("Idempotency-Key", long.as_str())])
        .await;
    assert_eq!(status, 400, "{bad}");

    a.stop().await;
    b.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// A caller that retries while its first request still runs (its own
/// timeout, a proxy's) sends the same key twice at once: one batch must
/// come of it, and both answers name it. 20 keys, each sent by two
/// concurrent requests. Before the fix (a record whose object did not
/// exist yet was taken for a dead claimer's and forgotten) 5 and 6 of 20
/// keys made two batches on the SQLite store, 10 of 20 on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_creates_with_one_key_make_one_batch() {
    concurrent_creates(None).await;
}

/// [`two_concurrent_creates_with_one_key_make_one_batch`] on the Redis store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_creates_with_one_key_make_one_batch_on_redis() {
    let redis = RedisServer::start();
    concurrent_creates(Some(redis.port)).await;
}

async fn concurrent_creates(redis_port: Option<u16>) {
    let mut spec = ServeSpec::new("http://127.0.0.1:9");
    spec.closed_gate = true;
    spec.redis_port = redis_port;
    let served = start(&spec, None).await;
    let api = std::sync::Arc::new(Api::new(&served.base, None));
    let (status, file) = api.upload("batch", completion_lines(2, 4).as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let mut doubled = Vec::new();
    for round in 0..20 {
        let body = json!({"input_file_id": file["id"], "endpoint": "/v1/completions",
            "completion_window": "24h", "metadata": {"round": round.to_string()}});
        let key = format!("race-{round}");
        let send = || {
            let (api, body, key) = (api.clone(), body.clone(), key.clone());
            tokio::spawn(async move {
                api.post_with("/v1/batches", &body, &[("Idempotency-Key", key.as_str())])
                    .await
            })
        };
        let (a, b) = (send(), send());
        let (a, b) = (a.await.expect("task"), b.await.expect("task"));
        let (_, list) = api.get("/v1/batches?limit=100").await;
        let made = (list["data"].as_array().expect("list").iter())
            .filter(|o| o["metadata"]["round"].as_str() == Some(round.to_string().as_str()))
            .count();
        if made != 1 || a.1["id"] != b.1["id"] {
            doubled.push((round, made, a, b));
        }
    }
    assert!(
        doubled.is_empty(),
        "{} of 20 keys made more than one batch or answered two ids: {:?}",
        doubled.len(),
        doubled.first()
    );
    served.stop().await;
}

/// A server that died between recording a key and making its object
/// leaves a record without an object: a retry once that record is older
/// than the making grace (10 s) forgets it and makes the object, at once.
/// The record is rewritten here as the dead server would have left it
/// (its object never made, claimed 11 s ago).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_claimer_died_before_making_the_batch_is_forgotten_after_the_grace() {
    let mut spec = ServeSpec::new("http://127.0.0.1:9");
    spec.closed_gate = true;
    let served = start(&spec, None).await;
    let api = Api::new(&served.base, None);
    let (status, file) = api.upload("batch", completion_lines(2, 4).as_bytes()).await;
    assert_eq!(status, 200, "{file}");
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"});
    let key = [("Idempotency-Key", "orphan")];
    let (status, first) = api.post_with("/v1/batches", &body, &key).await;
    assert_eq!(status, 200, "{first}");
    let db = rusqlite::Connection::open(served.dir.0.join("data").join("batches.db"))
        .expect("the store");
    let record: String = db
        .query_row(
            "SELECT record FROM idempotency_keys WHERE key = 'orphan'",
            [],
            |r| r.get(0),
        )
        .expect("the record");
    let mut record: serde_json::Value = serde_json::from_str(&record).expect("JSON");
    record["object_id"] = json!("batch_never_made");
    record["claimed_at_ms"] = json!(sluicegate::clock::unix_millis() - 11_000);
    db.execute(
        "UPDATE idempotency_keys SET object_id = 'batch_never_made', record = ?1 WHERE key = 'orphan'",
        [record.to_string()],
    )
    .expect("rewrite");
    let began = std::time::Instant::now();
    let (status, again) = api.post_with("/v1/batches", &body, &key).await;
    assert_eq!(status, 200, "{again}");
    assert_ne!(again["id"], "batch_never_made");
    assert_ne!(
        again["id"], first["id"],
        "a new batch: the record named another"
    );
    // Not held for the grace (10 s): the record was already past it.
    assert!(
        began.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    let (status, repeat) = api.post_with("/v1/batches", &body, &key).await;
    assert_eq!(status, 200, "{repeat}");
    assert_eq!(repeat["id"], again["id"], "the key now names the new batch");
    served.stop().await;
}
