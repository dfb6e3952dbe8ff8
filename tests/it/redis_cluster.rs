//! The Redis transport on a real three-node Redis Cluster: producer tools,
//! a `sluicegate run` process against the simulator, retries through the
//! queue's own retry set, SIGKILLs mid-drain, tenant lanes (a small tenant
//! behind a deep backlog), and the start-up check that keeps the result
//! list in the queue's slot.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::cli::{output, sluicegate, text};
use crate::support::redis_cluster::RedisCluster;
use crate::support::{TempDir, wait_until};
use sluicegate::clock::unix_secs;
use sluicegate::sim::{SimConfig, spawn_http};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

const QUEUE: &str = "{jobs}";
const RESULTS: &str = "{jobs}:results";

/// A `sluicegate run` process, SIGKILLed on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `n` request lines `<prefix>-<i>` in a file.
fn request_file(dir: &TempDir, prefix: &str, n: usize, max_tokens: u32) -> std::path::PathBuf {
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            serde_json::json!({
                "id": id,
                "deadline": deadline,
                // The prompt carries the id, so a scripted gateway can tell
                // attempts of one request apart.
                "payload": {"model": "m", "prompt": id, "max_tokens": max_tokens},
            })
            .to_string()
        })
        .collect();
    let path = dir.0.join(format!("{prefix}.jsonl"));
    std::fs::write(&path, lines.join("\n") + "\n").expect("write requests");
    path
}

fn submit(cluster: &RedisCluster, file: &std::path::Path) {
    let out = output(
        sluicegate(&["submit", "--redis-cluster", "--queue", QUEUE])
            .arg("--redis-url")
            .arg(cluster.url())
            .arg(file),
    );
    assert!(out.status.success(), "submit failed: {}", text(&out.stderr));
}

fn run_process(cluster: &RedisCluster, gateway: &str, result_list: Option<&str>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluicegate"));
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "redis")
        .env("SLUICEGATE_REDIS_URL", cluster.url())
        .env("SLUICEGATE_REDIS_CLUSTER", "true")
        .env("SLUICEGATE_QUEUE", QUEUE)
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_GATE_TYPE", "constant")
        .env("SLUICEGATE_QUEUE_MAX_SYS", "16")
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .env("SLUICEGATE_DISPATCH_RETRY_INITIAL_BACKOFF", "100ms")
        .env("SLUICEGATE_DISPATCH_RETRY_MAX_BACKOFF", "200ms")
        // Short leases so a killed process's claims come back quickly.
        .env("SLUICEGATE_DISPATCH_LEASE", "2s");
    if let Some(list) = result_list {
        cmd.env("SLUICEGATE_QUEUE_RESULT_QUEUE_NAME", list);
    }
    cmd
}

fn start(cluster: &RedisCluster, gateway: &str) -> Process {
    run_process(cluster, gateway, Some(RESULTS))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Process)
        .expect("sluicegate run starts")
}

/// A gateway answering every request 200 after `delay`.
async fn slow_gateway(delay: Duration) -> MockServer {
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_string("{\"ok\":true}")
                .set_delay(delay),
        )
        .mount(&gateway)
        .await;
    gateway
}

/// Every result record in the result list, parsed.
fn results(cluster: &RedisCluster) -> Vec<serde_json::Value> {
    cluster
        .cli(&["LRANGE", RESULTS, "0", "-1"])
        .lines()
        .map(|l| serde_json::from_str(l).expect("result is JSON"))
        .collect()
}

fn per_id(results: &[serde_json::Value]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in results {
        let id = r["id"].as_str().expect("result has an id").to_owned();
        *counts.entry(id).or_insert(0) += 1;
    }
    counts
}

/// `submit`, `run` and `results` against a cluster: every request answered
/// once by the simulator, results read back with the CLI, and the
/// producer's keys (in other slots, on other nodes) cleaned afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_round_trip_through_a_redis_cluster() {
    const N: usize = 60;
    let cluster = RedisCluster::start();
    let sim = spawn_http(SimConfig {
        pool_name: "p".into(),
        time_scale: 8.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator starts");
    let dir = TempDir::new("cluster-roundtrip");
    submit(&cluster, &request_file(&dir, "rt", N, 8));
    assert_eq!(cluster.int(&["ZCARD", QUEUE]), N as i64);
    // The test means something only if the keys really are spread.
    let active: Vec<String> = (0..N).map(|i| format!("request-active:rt-{i}")).collect();
    let mut keys: Vec<&str> = active.iter().map(String::as_str).collect();
    keys.push(QUEUE);
    assert_eq!(cluster.nodes_owning(&keys), 3, "keys span every node");

    let _run = start(&cluster, &sim.base_url());
    let out = tokio::task::spawn_blocking({
        let url = cluster.url();
        move || {
            output(
                sluicegate(&["results", "--redis-cluster", "--list", RESULTS])
                    .arg("--redis-url")
                    .arg(url)
                    .arg("--expect")
                    .arg(N.to_string())
                    .arg("--timeout")
                    .arg("60s"),
            )
        }
    })
    .await
    .expect("results runs");
    assert!(
        out.status.success(),
        "results failed: {}",
        text(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), N);
    let counts = per_id(&lines);
    assert_eq!(counts.len(), N, "one result per id");
    assert!(
        lines.iter().all(|r| r["status_code"] == 200),
        "every request answered 200: {lines:?}"
    );
    wait_until(Duration::from_secs(10), "producer keys cleaned", || {
        active
            .iter()
            .all(|k| cluster.int(&["EXISTS", k.as_str()]) == 0)
    })
    .await;
    assert_eq!(cluster.int(&["ZCARD", QUEUE]), 0);
    assert_eq!(cluster.int(&["HLEN", "{jobs}:claimed"]), 0);
}

/// Fails the first attempt of every id with 500, then answers 200.
struct FailFirst(std::sync::Mutex<HashMap<String, usize>>);

impl Respond for FailFirst {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let id = body["prompt"].as_str().unwrap_or_default().to_owned();
        let mut seen = self.0.lock().expect("lock");
        let n = seen.entry(id).or_insert(0);
        *n += 1;
        if *n == 1 {
            ResponseTemplate::new(500).set_body_string("boom")
        } else {
            ResponseTemplate::new(200).set_body_string("{\"ok\":true}")
        }
    }
}

/// A failed attempt goes through the queue's own retry set
/// (`{jobs}:retry-sortedset`, same slot) and comes back: one 200 result per
/// id, two attempts each, nothing left in the retry set.
#[tokio::test(flavor = "multi_thread")]
async fn retries_on_a_cluster_go_through_the_queues_own_retry_set() {
    const N: usize = 20;
    let cluster = RedisCluster::start();
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(FailFirst(Default::default()))
        .mount(&gateway)
        .await;
    let dir = TempDir::new("cluster-retry");
    submit(&cluster, &request_file(&dir, "re", N, 4));
    let _run = start(&cluster, &gateway.uri());
    wait_until(
        Duration::from_secs(60),
        "every retried request answered",
        || cluster.int(&["LLEN", RESULTS]) >= N as i64,
    )
    .await;
    let all = results(&cluster);
    let counts = per_id(&all);
    assert_eq!(counts.len(), N);
    assert!(counts.values().all(|&c| c == 1), "{counts:?}");
    assert!(all.iter().all(|r| r["status_code"] == 200), "{all:?}");
    let attempts = gateway.received_requests().await.map_or(0, |r| r.len());
    assert_eq!(attempts, 2 * N, "one failed and one good attempt per id");
    assert_eq!(cluster.int(&["ZCARD", "{jobs}:retry-sortedset"]), 0);
    assert_eq!(cluster.int(&["EXISTS", "retry-sortedset"]), 0);
}

/// Dispatchers SIGKILLed mid-drain three times, each replaced at once:
/// every message ends with exactly one result per id (the result push and
/// the claim's removal are one script in the queue's slot, fenced by the
/// claim owner, so a claim reclaimed from a dead holder cannot be answered
/// twice).
#[tokio::test(flavor = "multi_thread")]
async fn sigkilled_dispatchers_on_a_cluster_leave_exactly_one_result_per_id() {
    const N: usize = 150;
    let cluster = RedisCluster::start();
    // Slow answers (about 0.3 s each) so every kill finds work in flight.
    let gateway = slow_gateway(Duration::from_millis(300)).await;
    let dir = TempDir::new("cluster-kill");
    submit(&cluster, &request_file(&dir, "k", N, 4));
    let mut kills = 0;
    let give_up = Instant::now() + Duration::from_secs(120);
    let mut run = start(&cluster, &gateway.uri());
    for target in [N / 5, 2 * N / 5, 3 * N / 5] {
        wait_until(Duration::from_secs(60), "results before the kill", || {
            cluster.int(&["LLEN", RESULTS]) >= target as i64
        })
        .await;
        let in_flight = cluster.int(&["HLEN", "{jobs}:claimed"]);
        run.0.kill().expect("SIGKILL");
        let _ = run.0.wait();
        kills += 1;
        assert!(in_flight > 0, "the kill found claims in flight");
        run = start(&cluster, &gateway.uri());
    }
    while cluster.int(&["LLEN", RESULTS]) < N as i64 {
        assert!(Instant::now() < give_up, "the drain did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let any redelivered straggler settle before counting.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let all = results(&cluster);
    let counts = per_id(&all);
    assert_eq!(kills, 3);
    assert_eq!(counts.len(), N, "every id answered");
    let doubles: Vec<_> = counts.iter().filter(|(_, c)| **c != 1).collect();
    assert!(
        doubles.is_empty(),
        "ids with more than one result: {doubles:?}"
    );
    assert_eq!(all.len(), N);
    assert_eq!(cluster.int(&["ZCARD", QUEUE]), 0);
    assert_eq!(cluster.int(&["HLEN", "{jobs}:claimed"]), 0);
    drop(run);
}

/// Issue 22's deep backlog on a cluster: `big` has 2 000 messages at the
/// head of queue `deep` and `small` 50 behind them, submitted with
/// `--fairness-attribute`, window 8. The queue name has no hash tag, so
/// the lanes (`{deep}:tenant-lane:<tenant>`, `{deep}:tenant-lanes`) get
/// the queue's slot from the tag the transport adds, and the claim script
/// reads them there: `small`'s last request reaches the gateway within the
/// first 120 dispatches (without lanes it would be dispatch 2 050). Every
/// id is answered once, and the queue and its lanes end empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_tenant_behind_a_deep_backlog_on_a_cluster_is_served_from_the_start() {
    deep_backlog_on_a_cluster(false).await;
}

/// The same deep backlog written by one plain `ZADD` of bare requests (as
/// another producer writes them, no lane): the dispatcher's lane filer
/// and claims file them in the queue's slot (`{deep}:tenant-index` as
/// cursor), with the same bound (issue 36).
#[tokio::test(flavor = "multi_thread")]
async fn a_plain_zadd_deep_backlog_on_a_cluster_is_served_from_the_start() {
    deep_backlog_on_a_cluster(true).await;
}

/// Issue 22's deep backlog on a cluster, written by `submit` with lanes or
/// (`plain_zadd`) by one `ZADD` without.
async fn deep_backlog_on_a_cluster(plain_zadd: bool) {
    use crate::support::tenants::{recording_gateway, seen, tenant_line};
    const BIG: usize = 2000;
    const SMALL: usize = 50;
    const DEEP: &str = "deep";
    const DEEP_RESULTS: &str = "{deep}:results";
    let cluster = RedisCluster::start();
    let (gateway, arrivals) = recording_gateway(Duration::from_millis(5)).await;
    let base = unix_secs() + 3600;
    let lines: Vec<String> = (0..BIG)
        .map(|i| tenant_line(&format!("big-{i}"), "big", base + i as i64))
        .chain(
            (0..SMALL)
                .map(|i| tenant_line(&format!("small-{i}"), "small", base + 10_000 + i as i64)),
        )
        .collect();
    let lane = |t: &str| cluster.int(&["ZCARD", &format!("{{deep}}:tenant-lane:{t}")]);
    if plain_zadd {
        let scored: Vec<String> = (0..BIG)
            .map(|i| base + i as i64)
            .chain((0..SMALL).map(|i| base + 10_000 + i as i64))
            .map(|d| d.to_string())
            .collect();
        let mut args = vec!["ZADD", DEEP];
        for (score, line) in scored.iter().zip(&lines) {
            args.push(score);
            args.push(line);
        }
        assert_eq!(cluster.int(&args), (BIG + SMALL) as i64);
        assert_eq!(cluster.int(&["EXISTS", "{deep}:tenant-lanes"]), 0);
    } else {
        let dir = TempDir::new("cluster-lanes");
        let file = dir.0.join("tenants.jsonl");
        std::fs::write(&file, lines.join("\n") + "\n").expect("write requests");
        let out = output(
            sluicegate(&["submit", "--redis-cluster", "--queue", DEEP])
                .args(["--fairness-attribute", "userid"])
                .arg("--redis-url")
                .arg(cluster.url())
                .arg(&file),
        );
        assert!(out.status.success(), "submit failed: {}", text(&out.stderr));
        assert_eq!((lane("big"), lane("small")), (BIG as i64, SMALL as i64));
        assert_eq!(cluster.int(&["SCARD", "{deep}:tenant-lanes"]), 2);
    }
    assert_eq!(
        cluster.nodes_owning(&[
            DEEP,
            "{deep}:tenant-lanes",
            "{deep}:tenant-lane:small",
            "{deep}:tenant-index"
        ]),
        1,
        "the lanes share the queue's node"
    );
    let _run = run_process(&cluster, &gateway.uri(), Some(DEEP_RESULTS))
        .env("SLUICEGATE_QUEUE", DEEP)
        .env("SLUICEGATE_QUEUE_MAX_SYS", "8")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Process)
        .expect("sluicegate run starts");
    wait_until(Duration::from_secs(60), "every small message sent", || {
        seen(&arrivals)
            .iter()
            .filter(|a| a.tenant == "small")
            .count()
            == SMALL
    })
    .await;
    let all = seen(&arrivals);
    let position = all
        .iter()
        .rposition(|a| a.tenant == "small")
        .map_or(0, |i| i + 1);
    eprintln!(
        "deep backlog, cluster (plain ZADD: {plain_zadd}): {SMALL} of `small` behind {BIG} of `big`, window 8: last `small` request is dispatch {position}"
    );
    assert!(
        position <= 120,
        "`small`'s last request was dispatch {position}"
    );
    wait_until(Duration::from_secs(120), "every request answered", || {
        cluster.int(&["LLEN", DEEP_RESULTS]) >= (BIG + SMALL) as i64
    })
    .await;
    let counts = per_id(
        &cluster
            .cli(&["LRANGE", DEEP_RESULTS, "0", "-1"])
            .lines()
            .map(|l| serde_json::from_str(l).expect("result is JSON"))
            .collect::<Vec<_>>(),
    );
    assert_eq!(counts.len(), BIG + SMALL);
    assert!(counts.values().all(|&c| c == 1), "an id answered twice");
    assert_eq!(cluster.int(&["ZCARD", DEEP]), 0);
    assert_eq!((lane("big"), lane("small")), (0, 0));
    assert_eq!(cluster.int(&["HLEN", "{deep}:claimed"]), 0);
}

/// On a cluster the result list must be named on the queue and share its
/// slot; otherwise `run` refuses to start and says how to fix it.
#[tokio::test(flavor = "multi_thread")]
async fn a_result_list_outside_the_queues_slot_stops_start_up() {
    let cluster = RedisCluster::start();
    for list in [None, Some("results-elsewhere")] {
        let out = run_process(&cluster, "http://127.0.0.1:9", list)
            .stdout(Stdio::null())
            .output()
            .expect("sluicegate run");
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "run started with {list:?}");
        assert!(
            stderr.contains("result_queue_name") && stderr.contains("{jobs}:results"),
            "{stderr}"
        );
    }
}

fn cluster_context(cluster: &RedisCluster) -> sluicegate::gate::GateContext {
    let redis = sluicegate::config::RedisConfig {
        url: sluicegate::config::EndpointUrl::new(url::Url::parse(&cluster.url()).expect("url")),
        username: None,
        password: None,
        password_file: None,
        cluster: true,
        ..sluicegate::config::RedisConfig::default()
    };
    sluicegate::gate::GateContext::new(
        None,
        Some(redis),
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
}

/// `redis-quota` with `[redis] cluster = true` counts in upstream's keys on
/// the cluster, for tenants whose keys live on different nodes, in both
/// modes; a concurrency unit is returned when its request ends.
#[tokio::test(flavor = "multi_thread")]
async fn redis_quota_counts_on_a_cluster_in_both_modes() {
    use sluicegate::config::GateSpec;
    use sluicegate::gate::{Admission, AdmissionRequest, build_gate};
    use std::collections::BTreeMap;
    let cluster = RedisCluster::start();
    let ctx = cluster_context(&cluster);
    let tenants = ["alice", "bob", "carol", "dave", "erin", "frank"];
    let keys: Vec<String> = tenants
        .iter()
        .map(|t| format!("quota:userid:{t}"))
        .collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert!(
        cluster.nodes_owning(&key_refs) >= 2,
        "keys on several nodes"
    );
    let labels = BTreeMap::new();
    let metadata = |t: &str| BTreeMap::from([("userid".to_owned(), t.to_owned())]);

    let rate = GateSpec::parse(
        "redis-quota",
        &serde_json::json!({"address": cluster.url(), "limit": 2, "window": "1m"}),
        "q",
    )
    .expect("valid params");
    let rate = build_gate(&rate, &ctx).expect("builds");
    for t in tenants {
        let m = metadata(t);
        for _ in 0..2 {
            let v = rate.admit(AdmissionRequest::new("r", &m, &labels)).await;
            assert!(matches!(v, Admission::Continue(_)), "{t}: {v:?}");
        }
        let over = rate.admit(AdmissionRequest::new("r", &m, &labels)).await;
        assert!(matches!(over, Admission::Refuse { .. }), "{t}: {over:?}");
        let key = format!("quota:userid:{t}");
        assert_eq!(cluster.int(&["ZCARD", key.as_str()]), 2, "{key}");
    }

    let conc = GateSpec::parse(
        "redis-quota",
        &serde_json::json!({"address": cluster.url(), "limit": 1, "mode": "concurrency",
            "prefix": "conc:"}),
        "q",
    )
    .expect("valid params");
    let conc = build_gate(&conc, &ctx).expect("builds");
    for t in tenants {
        let m = metadata(t);
        let held = conc.admit(AdmissionRequest::new("r", &m, &labels)).await;
        assert!(matches!(held, Admission::Continue(_)), "{t}: {held:?}");
        let second = conc.admit(AdmissionRequest::new("r2", &m, &labels)).await;
        assert!(
            matches!(second, Admission::Refuse { .. }),
            "{t}: {second:?}"
        );
        drop(held);
        let key = format!("conc:userid:{t}");
        wait_until(Duration::from_secs(5), "the unit is returned", || {
            cluster.int(&["ZCARD", key.as_str()]) == 0
        })
        .await;
    }
}

/// Two dispatchers sharing one window (`dispatch.shared_window = "redis"`)
/// through the cluster: the semaphore's keys live on the cluster under one
/// `{pool}` hash tag, and every request is answered once. (The window bound
/// itself is measured against a single Redis in `tests/it/shared_window.rs`.)
#[tokio::test(flavor = "multi_thread")]
async fn the_shared_window_works_through_a_cluster() {
    const N: usize = 60;
    let cluster = RedisCluster::start();
    let gateway = slow_gateway(Duration::from_millis(200)).await;
    let dir = TempDir::new("cluster-shared");
    submit(&cluster, &request_file(&dir, "sw", N, 4));
    let spawn = || {
        run_process(&cluster, &gateway.uri(), Some(RESULTS))
            .env("SLUICEGATE_DISPATCH_SHARED_WINDOW", "redis")
            .env("SLUICEGATE_DISPATCH_SHARED_WINDOW_LEASE", "2s")
            .env("SLUICEGATE_QUEUE_MAX_SYS", "6")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(Process)
            .expect("sluicegate run starts")
    };
    let (_a, _b) = (spawn(), spawn());
    let give_up = Instant::now() + Duration::from_secs(60);
    while cluster.int(&["LLEN", RESULTS]) < N as i64 {
        assert!(Instant::now() < give_up, "the drain did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counts = per_id(&results(&cluster));
    assert_eq!(counts.len(), N);
    assert!(counts.values().all(|&c| c == 1), "{counts:?}");
    let keys = cluster.keys("sluicegate:window:*");
    assert!(!keys.is_empty(), "no semaphore keys on the cluster");
    let tags: std::collections::BTreeSet<_> = keys
        .iter()
        .filter_map(|k| sluicegate::redis::hash_tag(k).map(str::to_owned))
        .collect();
    assert_eq!(
        tags.len(),
        1,
        "every key of the pool shares one tag: {keys:?}"
    );
}
