//! `sluicegate serve` replicas as they are deployed: real `serve`
//! processes (the binary) on one real `redis-server` or a real three-node
//! Redis Cluster, sharing one data directory for file bodies, killed with
//! SIGKILL. Issue 26, item 8: a batch created on one replica is finished,
//! cancelled or expired by another after its creator died, and `serve`
//! runs on a Redis Cluster.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use crate::support::cli::Background;
use crate::support::redis::RedisServer;
use crate::support::redis_cluster::RedisCluster;
use crate::support::serve::{Api, HeldGateway, completion_lines, terminal};
use crate::support::sim::small_pool;
use serde_json::{Value, json};
use sluicegate::serve::model::{BatchRecord, Stop};
use sluicegate::serve::store::{RedisStore, Store};

/// Bound on every wait for a batch to move.
const LONG: Duration = Duration::from_secs(120);

/// Where a replica's Redis is.
#[derive(Debug, Clone)]
enum Backend {
    /// One server: queue `batch-api`, `serve.result_list` for results.
    Single(u16),
    /// A cluster seeded by this URL: queue `{batch-api}`, results in
    /// `{batch-api}:results` (the queue's slot).
    Cluster(String),
}

impl Backend {
    fn toml(&self) -> String {
        match self {
            Self::Single(port) => {
                format!("transport = \"redis\"\n[redis]\nurl = \"redis://127.0.0.1:{port}/0\"\n")
            }
            Self::Cluster(url) => {
                format!("transport = \"redis\"\n[redis]\nurl = \"{url}\"\ncluster = true\n")
            }
        }
    }

    fn queue(&self) -> &'static str {
        match self {
            Self::Single(_) => "queue_name = \"batch-api\"\n",
            Self::Cluster(_) => {
                "queue_name = \"{batch-api}\"\nresult_queue_name = \"{batch-api}:results\"\n"
            }
        }
    }

    /// A store client on the same keys as the servers (to read records
    /// and move a deadline as another server would).
    fn store(&self) -> Store {
        let conn = match self {
            Self::Single(port) => {
                let client =
                    redis::Client::open(format!("redis://127.0.0.1:{port}/0")).expect("redis url");
                sluicegate::redis::RedisConnection::Single(
                    sluicegate::redis::manager(&client).expect("manager"),
                )
            }
            Self::Cluster(url) => sluicegate::redis::RedisConnection::Cluster(
                sluicegate::redis::cluster_connection(
                    url,
                    None,
                    None,
                    Duration::from_secs(3),
                    Some(Duration::from_secs(10)),
                )
                .expect("cluster connection"),
            ),
        };
        Store::Redis(RedisStore::new(conn, "sluicegate:batchapi:"))
    }
}

/// One `sluicegate serve` process: its API, its own working directory.
struct Replica {
    process: Background,
    api: Api,
    log: std::path::PathBuf,
}

impl Drop for Replica {
    /// A failing test shows the end of each replica's log.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- {} (last lines)", self.log.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Starts `sluicegate serve --config` in `cwd` (its own directory) with
/// `data` as the data directory every replica shares, the in-process
/// dispatcher sending to `gateway` through an open gate with a window of
/// `max_sys`, and a 2 s message lease (a dead replica's claims return to
/// the queue 2 s after it stops renewing them); without `lookahead` its
/// dispatcher leases only what its window can send (`tenant_lookahead =
/// 0`), so the other replica gets the rest. Waits until the API answers.
async fn replica(
    cwd: &Path,
    data: &Path,
    backend: &Backend,
    gateway: &str,
    max_sys: u32,
    lookahead: bool,
) -> Replica {
    replica_with(
        cwd,
        data,
        backend,
        gateway,
        max_sys,
        lookahead,
        false,
        "",
        &Tuning::default(),
    )
    .await
}

/// Timings and sizes of one replica that the intake tests shorten.
struct Tuning {
    /// `dispatch.lease`.
    lease: &'static str,
    /// `serve.intake_chunk`.
    intake_chunk: usize,
    /// `serve.takeover_after`.
    takeover_after: &'static str,
}

impl Default for Tuning {
    /// A 2 s lease; the production chunk (500) and takeover (60 s).
    fn default() -> Self {
        Self {
            lease: "2s",
            intake_chunk: 500,
            takeover_after: "60s",
        }
    }
}

/// The intake takeover tests: chunks of 50 lines, so a kill lands
/// mid-intake in a batch of 3 000, and a step untouched for 5 s is taken
/// over (60 s by default). The replica that dispatches keeps leases of
/// `lease`.
fn intake_tuning(lease: &'static str) -> Tuning {
    Tuning {
        lease,
        intake_chunk: 50,
        takeover_after: "5s",
    }
}

/// [`replica`], with a gate that never opens when `closed` (an
/// endpoint-scrape gate on a dead port: unreadable metrics mean zero
/// budget), so the batches it enqueues stay queued for the others, and
/// `gateway_toml` lines added to `[gateway]`.
#[allow(clippy::too_many_arguments)]
async fn replica_with(
    cwd: &Path,
    data: &Path,
    backend: &Backend,
    gateway: &str,
    max_sys: u32,
    lookahead: bool,
    closed: bool,
    gateway_toml: &str,
    tuning: &Tuning,
) -> Replica {
    std::fs::create_dir_all(cwd).expect("cwd");
    let (api_port, telemetry_port) = (support::free_port(), support::free_port());
    let text = format!(
        "{}[gateway]\nurl = \"{gateway}\"\n{gateway_toml}[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nmax_staleness = \"1s\"\nlease = \"{}\"\n{}[telemetry]\nlisten = \"127.0.0.1:{telemetry_port}\"\n[serve]\nlisten = \"127.0.0.1:{api_port}\"\ndata_dir = \"{}\"\nintake_chunk = {}\ntakeover_after = \"{}\"\napi_keys = \"acme:sk-acme\"\n[[queue]]\n{}max_sys = {max_sys}\n{}",
        backend.toml(),
        tuning.lease,
        if lookahead {
            ""
        } else {
            "tenant_lookahead = 0\n"
        },
        data.display(),
        tuning.intake_chunk,
        tuning.takeover_after,
        backend.queue(),
        match closed {
            true => format!(
                "gate_type = \"endpoint-scrape\"\n[queue.gate_params]\nurl = \"http://127.0.0.1:{}/metrics\"\nmetric = \"m\"\nmax_count_per_pod = 4\n",
                support::free_port()
            ),
            false => "gate_type = \"constant\"\n".to_owned(),
        },
    );
    let file = cwd.join("serve.toml");
    std::fs::write(&file, text).expect("config file");
    let log_path = cwd.join("serve.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let process = Background(
        support::cli::sluicegate(&["serve", "--config"])
            .arg(&file)
            .current_dir(cwd)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("serve starts"),
    );
    let api = Api::new(&format!("http://127.0.0.1:{api_port}"), Some("sk-acme"));
    let give_up = std::time::Instant::now() + LONG;
    loop {
        if reqwest::get(format!("{}/v1/files", api.base)).await.is_ok() {
            break;
        }
        assert!(std::time::Instant::now() < give_up, "serve never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Replica {
        process,
        api,
        log: log_path,
    }
}

fn lines_of(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).expect("output line is JSON"))
        .collect()
}

/// Every line of the batch's output and error files by `custom_id`,
/// asserting that no `custom_id` has two lines.
async fn answers(api: &Api, done: &Value) -> BTreeMap<String, Value> {
    let mut by_id = BTreeMap::new();
    for key in ["output_file_id", "error_file_id"] {
        let Some(file) = done[key].as_str() else {
            continue;
        };
        let (status, text) = api.text(&format!("/v1/files/{file}/content")).await;
        assert_eq!(status, 200, "{key}: {text}");
        for line in lines_of(&text) {
            let id = line["custom_id"].as_str().expect("custom_id").to_owned();
            assert!(
                by_id.insert(id.clone(), line).is_none(),
                "{id} answered twice"
            );
        }
    }
    by_id
}

/// The custom_ids `r0 … r<n-1>`.
fn ids(n: usize) -> Vec<String> {
    let mut ids: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    ids.sort();
    ids
}

/// Waits until `n` more requests arrived at `gateway`.
async fn arrivals(gateway: &mut HeldGateway, n: usize) {
    for _ in 0..n {
        tokio::time::timeout(LONG, gateway.arrived.recv())
            .await
            .expect("a request reaches the gateway")
            .expect("gateway runs");
    }
}

/// Requests that arrived at `gateway` and were not counted yet.
fn more_arrivals(gateway: &mut HeldGateway) -> usize {
    let mut n = 0;
    while gateway.arrived.try_recv().is_ok() {
        n += 1;
    }
    n
}

/// The stored record (fields the API does not show, such as `stop`).
async fn record(store: &Store, id: &str) -> BatchRecord {
    store.batch(id).await.expect("read").expect("batch exists")
}

/// A batch created through replica A, which is SIGKILLed once results
/// come in, is finished by replica B: `completed`, every `custom_id`
/// answered exactly once in the output file.
async fn a_killed_replicas_batch_is_finished_by_the_other(backend: Backend) {
    const N: usize = 40;
    let sim = small_pool().await;
    let dir = support::TempDir::new("replicas-kill");
    let data = dir.0.join("data");
    let mut a = replica(&dir.0.join("a"), &data, &backend, &sim.base_url(), 2, true).await;
    let b = replica(&dir.0.join("b"), &data, &backend, &sim.base_url(), 2, true).await;
    let batch = a
        .api
        .batch(&completion_lines(N, 64), "/v1/completions", "24h")
        .await;
    let id = batch["id"].as_str().expect("id").to_owned();
    let running = a
        .api
        .wait_for(&id, LONG, |b| {
            b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 2 || terminal(b)
        })
        .await;
    assert_eq!(
        running["status"], "in_progress",
        "killed mid-batch: {running}"
    );
    a.process.kill();
    let done = b.api.wait_for(&id, LONG, terminal).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": N, "completed": N, "failed": 0})
    );
    let by_id = answers(&b.api, &done).await;
    assert_eq!(by_id.keys().cloned().collect::<Vec<_>>(), ids(N));
    assert!(
        by_id.values().all(|l| l["response"]["status_code"] == 200),
        "every answer is the pool's"
    );
    drop(b);
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_is_finished_by_the_other() {
    let redis = RedisServer::start();
    a_killed_replicas_batch_is_finished_by_the_other(Backend::Single(redis.port)).await;
}

/// Two replicas, each sending to its own held gateway (window 2), so the
/// test knows which requests each holds in flight. A batch is created on
/// A; once both hold requests, A is SIGKILLed and `stop` (cancel or
/// expiry) is applied through B, then B's gateway answers. The batch ends
/// `status`: at expiry the requests B had in flight keep their real
/// answers (a full run once kept neither, when expiry still marked them
/// for B's cancel watcher); at a cancel one keeps its answer only when it
/// came before the watcher aborted it (within
/// `dispatch.cancel_check_interval`). Every other one (unsent, or in
/// flight on dead A and returned to the queue when its lease lapsed)
/// reads `code`, each `custom_id` exactly once.
async fn a_stop_on_the_surviving_replica(backend: Backend, stop: Stop, window: &str) {
    const N: usize = 12;
    let store = backend.store();
    let dir = support::TempDir::new("replicas-stop");
    let data = dir.0.join("data");
    let mut gateway_a = HeldGateway::start().await;
    let mut gateway_b = HeldGateway::start().await;
    let mut a = replica(&dir.0.join("a"), &data, &backend, &gateway_a.url, 2, false).await;
    let b = replica(&dir.0.join("b"), &data, &backend, &gateway_b.url, 2, false).await;
    let batch = a
        .api
        .batch(&completion_lines(N, 8), "/v1/completions", window)
        .await;
    let id = batch["id"].as_str().expect("id").to_owned();
    // Both windows full: 2 requests in flight on each replica.
    arrivals(&mut gateway_a, 2).await;
    arrivals(&mut gateway_b, 2).await;
    a.process.kill();
    let (status, code) = match stop {
        Stop::Cancel => {
            let (status, cancelling) = b
                .api
                .post(&format!("/v1/batches/{id}/cancel"), &json!({}))
                .await;
            assert_eq!(status, 200, "{cancelling}");
            assert_eq!(cancelling["status"], "cancelling", "{cancelling}");
            ("cancelled", "batch_cancelled")
        }
        // The completion window passes while A is dead: a real one of a
        // minute, waited out.
        Stop::Expire if window != "24h" => ("expired", "batch_expired"),
        Stop::Expire => {
            // Or its deadline moved to now, as another server writes
            // (compare-and-set).
            loop {
                let old = record(&store, &id).await;
                let mut new = old.clone();
                new.expires_at = old.created_at;
                if store.replace_batch(&old, &new).await.expect("write") {
                    break;
                }
            }
            ("expired", "batch_expired")
        }
    };
    if stop == Stop::Expire {
        // B's sweep sees the end of the window and stops the batch.
        let give_up = std::time::Instant::now() + LONG;
        while record(&store, &id).await.stop != Some(Stop::Expire) {
            assert!(
                std::time::Instant::now() < give_up,
                "B never stopped the expired batch"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    if stop == Stop::Expire {
        // Past B's cancel watcher's next look (every 1 s): an expiry must
        // not abort what B has in flight.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // The requests in flight on B get their answers now.
    gateway_b.release_all();
    let done = b.api.wait_for(&id, LONG, terminal).await;
    assert_eq!(done["status"], status, "{done}");
    let answered_by_b = 2 + more_arrivals(&mut gateway_b);
    let counts = &done["request_counts"];
    assert_eq!(counts["total"], N, "{done}");
    let completed = counts["completed"].as_u64().expect("completed");
    if stop == Stop::Expire {
        assert_eq!(
            completed, answered_by_b as u64,
            "the answers of B's requests in flight are kept: {done}"
        );
    }
    assert!(
        completed <= answered_by_b as u64,
        "only B's requests in flight can have answers: {done}"
    );
    assert_eq!(
        counts["failed"].as_u64(),
        Some(N as u64 - completed),
        "{done}"
    );
    let by_id = answers(&b.api, &done).await;
    assert_eq!(by_id.keys().cloned().collect::<Vec<_>>(), ids(N));
    for (custom_id, line) in &by_id {
        match line["response"]["status_code"].as_u64() {
            Some(200) => assert_eq!(
                line["response"]["body"]["choices"][0]["text"], "held answer",
                "{custom_id}: {line}"
            ),
            _ => assert_eq!(line["error"]["code"], code, "{custom_id}: {line}"),
        }
    }
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_is_cancelled_through_the_other() {
    let redis = RedisServer::start();
    a_stop_on_the_surviving_replica(Backend::Single(redis.port), Stop::Cancel, "24h").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_expires_through_the_other() {
    let redis = RedisServer::start();
    a_stop_on_the_surviving_replica(Backend::Single(redis.port), Stop::Expire, "24h").await;
}

/// Cancel and expiry through the surviving replica on a Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_is_cancelled_or_expires_through_the_other_on_a_redis_cluster()
{
    let cluster = RedisCluster::start();
    for stop in [Stop::Cancel, Stop::Expire] {
        a_stop_on_the_surviving_replica(Backend::Cluster(cluster.url()), stop, "24h").await;
    }
}

/// The same with a real completion window of one minute (the shortest
/// accepted) that runs out while A is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_expires_through_the_other_at_the_end_of_its_window() {
    let redis = RedisServer::start();
    a_stop_on_the_surviving_replica(Backend::Single(redis.port), Stop::Expire, "1m").await;
}

/// The same on a real three-node Redis Cluster: replica A killed mid-batch,
/// replica B finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_a_killed_replica_is_finished_by_the_other_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    a_killed_replicas_batch_is_finished_by_the_other(Backend::Cluster(cluster.url())).await;
}

/// `serve` on a Redis Cluster (it refused `redis.cluster = true` before):
/// a batch runs to `completed` with its output, its records carry the
/// prefix's hash tag (one slot for the records and indexes), and a
/// server SIGKILLed mid-batch and started again finishes it with every
/// `custom_id` answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_and_restarts_on_a_redis_cluster() {
    const N: usize = 30;
    let cluster = RedisCluster::start();
    let backend = Backend::Cluster(cluster.url());
    let sim = small_pool().await;
    let dir = support::TempDir::new("serve-cluster");
    let data = dir.0.join("data");

    // Round trip.
    let mut first = replica(
        &dir.0.join("first"),
        &data,
        &backend,
        &sim.base_url(),
        4,
        true,
    )
    .await;
    let small = first
        .api
        .batch(&completion_lines(4, 8), "/v1/completions", "24h")
        .await;
    let small_id = small["id"].as_str().expect("id").to_owned();
    let done = first.api.wait_for(&small_id, LONG, terminal).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": 4, "completed": 4, "failed": 0})
    );
    let by_id = answers(&first.api, &done).await;
    assert_eq!(by_id.keys().cloned().collect::<Vec<_>>(), ids(4));
    let record_key = format!("{{sluicegate:batchapi:}}batch:{small_id}");
    assert_eq!(
        cluster.keys(&format!("*batch:{small_id}")),
        vec![record_key.clone()],
        "the record carries the prefix's hash tag"
    );
    assert_eq!(
        cluster.nodes_owning(&[
            &record_key,
            "{sluicegate:batchapi:}active",
            "{sluicegate:batchapi:}status",
            "{sluicegate:batchapi:}seq",
        ]),
        1
    );

    // SIGKILL mid-batch, then the same server again.
    let batch = first
        .api
        .batch(&completion_lines(N, 64), "/v1/completions", "24h")
        .await;
    let id = batch["id"].as_str().expect("id").to_owned();
    let running = first
        .api
        .wait_for(&id, LONG, |b| {
            b["request_counts"]["completed"].as_u64().unwrap_or(0) >= 2 || terminal(b)
        })
        .await;
    assert_eq!(
        running["status"], "in_progress",
        "killed mid-batch: {running}"
    );
    first.process.kill();
    let second = replica(
        &dir.0.join("second"),
        &data,
        &backend,
        &sim.base_url(),
        4,
        true,
    )
    .await;
    let done = second.api.wait_for(&id, LONG, terminal).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": N, "completed": N, "failed": 0})
    );
    let by_id = answers(&second.api, &done).await;
    assert_eq!(by_id.keys().cloned().collect::<Vec<_>>(), ids(N));
    // Listing still sees both batches through the tagged indexes.
    let (status, list) = second.api.get("/v1/batches").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(2), "{list}");
    drop(second);
    sim.shutdown().await.expect("simulator stops");
}

/// A gateway answering every completion at once and keeping every request
/// (wiremock records them), to count how often each prompt arrived.
async fn counting_gateway() -> wiremock::MockServer {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let gateway = MockServer::start().await;
    let body = r#"{"id":"cmpl-count","object":"text_completion","model":"sim-model","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("content-type", "application/json")
                .set_body_string(body),
        )
        .mount(&gateway)
        .await;
    gateway
}

/// Replica A (its gate closed: it only enqueues) is SIGKILLed while it
/// enqueues a batch's lines (some chunks in, not all); replica B, which
/// dispatches, takes the intake over once A's step is stale
/// (`serve.takeover_after`, 5 s here, 60 s by default) and resumes after
/// the last chunk A enqueued: the gateway gets every line exactly once
/// and the output has each `custom_id` once. On a cluster this rests on
/// the chunk and its progress key being one `MULTI` in the queue's slot.
///
/// "Exactly once at the gateway" also needs B never to let a lease lapse
/// while a request is in flight: a lapsed claim is taken again and sent
/// again (at-least-once sending, exactly one result; `docs/transports.md`).
/// With a 2 s lease (renewed every 0.67 s) a renewal late by 1.3 s on a
/// loaded machine is enough; B's lease is 30 s (the default), so only a
/// stall of 20 s could. A's stays 2 s: what it leased returns quickly.
async fn a_killed_replicas_intake_is_taken_over_by_the_other(backend: Backend) {
    const N: usize = 3_000;
    let Store::Redis(store) = backend.store() else {
        unreachable!("a Redis store")
    };
    let mut conn = store.connection();
    let dir = support::TempDir::new("replicas-intake");
    let data = dir.0.join("data");
    let gateway = counting_gateway().await;
    let mut a = replica_with(
        &dir.0.join("a"),
        &data,
        &backend,
        &gateway.uri(),
        64,
        true,
        true,
        "",
        &intake_tuning("2s"),
    )
    .await;
    let b = replica_with(
        &dir.0.join("b"),
        &data,
        &backend,
        &gateway.uri(),
        64,
        true,
        false,
        "",
        &intake_tuning("30s"),
    )
    .await;
    let batch = a
        .api
        .batch(&completion_lines(N, 4), "/v1/completions", "24h")
        .await;
    let id = batch["id"].as_str().expect("id").to_owned();
    let progress_key = match &backend {
        Backend::Single(_) => format!("sluicegate:batchapi:intake:{id}"),
        Backend::Cluster(_) => format!("{{batch-api}}:sluicegate:batchapi:intake:{id}"),
    };
    let progress = |conn: &mut sluicegate::redis::RedisConnection| {
        let key = progress_key.clone();
        let mut conn = conn.clone();
        async move {
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<u64>>(&mut conn)
                .await
                .expect("GET")
        }
    };
    // Killed as soon as the first chunk (50 lines) and its progress are in.
    let give_up = std::time::Instant::now() + LONG;
    while progress(&mut conn).await.is_none() {
        assert!(std::time::Instant::now() < give_up, "intake never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    a.process.kill();
    let at_kill = progress(&mut conn).await;
    eprintln!("killed with {at_kill:?} of {N} lines enqueued");
    assert!(
        at_kill.is_some_and(|n| n < N as u64 && n % 50 == 0),
        "killed mid-intake, after whole chunks: {at_kill:?} of {N} lines enqueued"
    );
    let done = b
        .api
        .wait_for(&id, Duration::from_secs(600), terminal)
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": N, "completed": N, "failed": 0})
    );
    let mut sent = BTreeMap::<String, usize>::new();
    for request in gateway.received_requests().await.expect("recorded") {
        let body: Value = serde_json::from_slice(&request.body).expect("request JSON");
        let prompt = body["prompt"].as_str().expect("prompt").to_owned();
        *sent.entry(prompt).or_default() += 1;
    }
    let twice: Vec<_> = sent.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} lines sent more than once (killed at {at_kill:?}), e.g. {:?}",
        twice.len(),
        twice.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(sent.len(), N, "every line sent");
    let by_id = answers(&b.api, &done).await;
    assert_eq!(by_id.len(), N);
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_intake_is_taken_over_by_the_other_without_sending_twice() {
    let redis = RedisServer::start();
    a_killed_replicas_intake_is_taken_over_by_the_other(Backend::Single(redis.port)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_intake_is_taken_over_on_a_redis_cluster_without_sending_twice() {
    let cluster = RedisCluster::start();
    a_killed_replicas_intake_is_taken_over_by_the_other(Backend::Cluster(cluster.url())).await;
}

/// On a cluster `serve` needs the queue to name a result list in its own
/// hash slot (as `run` does): a config without one stops it at start,
/// naming the key and the list to use, also with `dispatcher = separate`
/// (no dispatcher in the process to refuse it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_a_cluster_refuses_a_result_list_outside_the_queues_slot() {
    let dir = support::TempDir::new("serve-cluster-list");
    let text = format!(
        "transport = \"redis\"\n[redis]\nurl = \"redis://127.0.0.1:{}\"\ncluster = true\n[gateway]\nurl = \"http://127.0.0.1:9\"\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"{{jobs}}\"\ngate_type = \"constant\"\n",
        support::free_port()
    );
    let config = sluicegate::config::Config::from_toml_str(&text, &Default::default())
        .expect("config loads");
    let serve = sluicegate::config::ServeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: dir.0.join("data"),
        dispatcher: sluicegate::config::ServeDispatcher::Separate,
        ..sluicegate::config::ServeConfig::default()
    };
    let error = sluicegate::serve::start(&config, &serve, std::future::pending())
        .await
        .expect_err("refused");
    let text = error.to_string();
    assert!(
        text.starts_with("queue `{jobs}`: result_queue_name: with redis.cluster = true")
            && text.contains("`{jobs}:results`"),
        "{text}"
    );
    assert_eq!(error.exit_code(), 2);
}

/// Every replica's collector reads the same result list, so two of them
/// may apply the same result; the first one recorded wins (`seen`). But
/// a replica that read the batch as running just before another one
/// finished it (files written, results dropped) recorded its copy after
/// the drop: `seen` was gone, so the copy counted again and the finished
/// batch read `completed` above `total`. A finished batch's results now
/// take nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_recorded_again_after_its_batch_finished_is_not_counted() {
    use sluicegate::serve::store::Recorded;
    let redis = RedisServer::start();
    let store = Backend::Single(redis.port).store();
    let line = Recorded {
        custom_id: "r0".into(),
        ok: true,
        line: "{\"custom_id\":\"r0\"}".into(),
    };
    let batch = "batch_0123456789abcdef01234567";
    assert_eq!(
        store
            .record_results(batch, std::slice::from_ref(&line))
            .await
            .expect("record"),
        vec![true]
    );
    // Another replica's copy while the batch runs: not counted.
    assert_eq!(
        store
            .record_results(batch, std::slice::from_ref(&line))
            .await
            .expect("record"),
        vec![false]
    );
    // The batch is finalized: its results are in its files now.
    store.drop_results(batch).await.expect("drop");
    assert_eq!(
        store.record_results(batch, &[line]).await.expect("record"),
        vec![false],
        "a copy applied after the batch finished is not recorded"
    );
    assert_eq!(store.counts(batch).await.expect("counts"), (1, 0));
    let (page, _) = store.result_page(batch, 0, 10).await.expect("page");
    assert!(page.is_empty(), "nothing left behind: {page:?}");
}

/// Replica A (its gate closed: it only enqueues) is SIGKILLed mid-intake,
/// and the batch is cancelled through B before anyone took the intake
/// over. B adopts the cancel once A's step is stale
/// (`serve.takeover_after`, 5 s here, 60 s by default): what A
/// enqueued is stopped through the cancel protocol, and the lines never
/// enqueued are answered `batch_cancelled` once the cancel's grace
/// (`gateway.attempt_timeout`, 5 s here, + 10 s) has passed. The batch
/// ends `cancelled` with each `custom_id` once: the requests B had sent
/// keep their answers (as many `completed` as the gateway got, each line
/// at most once), every other one reads `batch_cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cancelled_after_its_replica_died_mid_intake_ends_cancelled() {
    const N: usize = 3_000;
    let redis = RedisServer::start();
    let backend = Backend::Single(redis.port);
    let Store::Redis(store) = backend.store() else {
        unreachable!("a Redis store")
    };
    let mut conn = store.connection();
    let dir = support::TempDir::new("replicas-cancel-intake");
    let data = dir.0.join("data");
    let gateway = counting_gateway().await;
    let url = gateway.uri();
    let mut a = replica_with(
        &dir.0.join("a"),
        &data,
        &backend,
        &url,
        64,
        true,
        true,
        "",
        &intake_tuning("2s"),
    )
    .await;
    let grace = "attempt_timeout = \"5s\"\n";
    let b = replica_with(
        &dir.0.join("b"),
        &data,
        &backend,
        &url,
        64,
        true,
        false,
        grace,
        &intake_tuning("30s"),
    )
    .await;
    let batch = a
        .api
        .batch(&completion_lines(N, 4), "/v1/completions", "24h")
        .await;
    let id = batch["id"].as_str().expect("id").to_owned();
    let key = format!("sluicegate:batchapi:intake:{id}");
    let give_up = std::time::Instant::now() + LONG;
    loop {
        let lines: Option<u64> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("GET");
        if lines.is_some() {
            break;
        }
        assert!(std::time::Instant::now() < give_up, "intake never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    a.process.kill();
    let at_kill: Option<u64> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("GET");
    eprintln!("killed with {at_kill:?} of {N} lines enqueued");
    assert!(
        at_kill.is_some_and(|n| n < N as u64 && n % 50 == 0),
        "killed mid-intake, after whole chunks: {at_kill:?} of {N} lines enqueued"
    );
    let (status, cancelling) = b
        .api
        .post(&format!("/v1/batches/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 200, "{cancelling}");
    assert_eq!(cancelling["status"], "cancelling", "{cancelling}");
    let done = b
        .api
        .wait_for(&id, Duration::from_secs(300), terminal)
        .await;
    assert_eq!(done["status"], "cancelled", "{done}");
    let mut sent = BTreeMap::<String, usize>::new();
    for request in gateway.received_requests().await.expect("recorded") {
        let body: Value = serde_json::from_slice(&request.body).expect("request JSON");
        let prompt = body["prompt"].as_str().expect("prompt").to_owned();
        *sent.entry(prompt).or_default() += 1;
    }
    assert!(sent.values().all(|n| *n == 1), "a line sent twice");
    let counts = &done["request_counts"];
    assert_eq!(counts["total"], N, "{done}");
    assert_eq!(
        counts["completed"].as_u64(),
        Some(sent.len() as u64),
        "{done}"
    );
    assert_eq!(
        counts["failed"].as_u64(),
        Some((N - sent.len()) as u64),
        "{done}"
    );
    let by_id = answers(&b.api, &done).await;
    assert_eq!(by_id.keys().cloned().collect::<Vec<_>>(), ids(N));
    for (custom_id, line) in &by_id {
        if line["response"]["status_code"].as_u64() != Some(200) {
            assert_eq!(
                line["error"]["code"], "batch_cancelled",
                "{custom_id}: {line}"
            );
        }
    }
    drop(b);
}
