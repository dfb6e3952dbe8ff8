//! `[redis] mode = "sentinel"` on a real Sentinel deployment (one master,
//! one replica, three sentinels on loopback): the `sluicegate` binary
//! submits and drains through the sentinels, a failover happens mid-drain
//! (`SENTINEL FAILOVER`, or the master SIGKILLed), and every id must end
//! with exactly one result on the new master, nothing pending, claimed or
//! waiting to retry. Plus the config's typed errors for the new keys.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, RedisMode};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support;
use crate::support::redis_sentinel::{MASTER_NAME, Node, SentinelGroup};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");
const QUEUE: &str = "sentinel-drain";
/// Messages per drain: enough that the failover lands mid-drain.
const N: usize = 2000;

async fn gateway() -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_string(r#"{"choices":[{"text":"ok"}]}"#)
                .set_delay(Duration::from_millis(20)),
        )
        .mount(&server)
        .await;
    server
}

/// The sentinel flags of the producer tools.
fn sentinel_flags(group: &SentinelGroup) -> Vec<String> {
    vec![
        "--redis-mode".into(),
        "sentinel".into(),
        "--redis-addrs".into(),
        group.sentinel_addrs().join(","),
        "--redis-master-name".into(),
        MASTER_NAME.into(),
    ]
}

/// Submits `N` requests with `sluicegate submit` through the sentinels,
/// then waits until the replica holds them all (so the failover cannot
/// lose what was submitted before the drain).
async fn submit(group: &SentinelGroup, dir: &Path) {
    let file = dir.join("requests.jsonl");
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..N)
        .map(|i| {
            serde_json::json!({"id": format!("m-{i}"), "deadline": deadline,
                "metadata": {"userid": format!("tenant-{}", i % 3)},
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("write requests");
    let out = Command::new(BIN)
        .arg("submit")
        .args(sentinel_flags(group))
        .args(["--queue", QUEUE])
        .arg(&file)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .output()
        .expect("submit runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let master = group.master();
    assert_eq!(
        master.int(&["ZCARD", QUEUE]),
        N as i64,
        "submitted to the master"
    );
    let replica = group
        .data
        .iter()
        .find(|n| n.port != master.port)
        .expect("replica");
    support::wait_until(Duration::from_secs(20), "replica caught up", || {
        replica.int(&["ZCARD", QUEUE]) == N as i64
    })
    .await;
}

/// A `sluicegate run` process, SIGKILLed on drop.
struct Dispatcher(Child);

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sluicegate run` on `config` (a TOML file), logging to `log`.
fn dispatcher(config: &Path, log: &Path) -> Dispatcher {
    let log = std::fs::File::create(log).expect("log file");
    Command::new(BIN)
        .args(["run", "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(Dispatcher)
        .expect("dispatcher runs")
}

/// The dispatcher's config: the Redis transport through the sentinels,
/// a 2 s lease (a result written to the old master after the promotion
/// is lost with it; its claim, still ours on the new master, comes back
/// when the lease lapses), and `gate` as the queue's gate.
fn config_toml(group: &SentinelGroup, gateway: &str, dispatch: &str, gate: &str) -> String {
    let addrs = group
        .sentinel_addrs()
        .iter()
        .map(|a| format!("\"{a}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
transport = "redis"
[gateway]
url = "{gateway}"
[redis]
mode = "sentinel"
addrs = [{addrs}]
master_name = "{MASTER_NAME}"
[dispatch]
lease = "2s"
poll_interval = "100ms"
receive_wait = "100ms"
retry_initial_backoff = "100ms"
retry_max_backoff = "200ms"
shutdown_grace = "5s"
{dispatch}
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "{QUEUE}"
max_sys = 64
{gate}
"#
    )
}

/// Waits until `master` holds at least `n` results and nothing is
/// pending, claimed or waiting to retry.
async fn wait_drained(master: &Node, n: i64, within: Duration, log: &Path) {
    let give_up = Instant::now() + within;
    loop {
        let results = master.int(&["LLEN", "result-list"]);
        let pending = master.int(&["ZCARD", QUEUE]);
        let claims = master.int(&["ZCARD", &format!("{QUEUE}:claims-idx")]);
        let retries = master.int(&["ZCARD", "retry-sortedset"]);
        if results >= n && pending == 0 && claims == 0 && retries == 0 {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "not drained: {results} results, {pending} pending, {claims} claims, {retries} retries; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every id `m-0..N` has exactly one (successful) result on `master`, and
/// the queue's keys are empty.
fn assert_exactly_once(master: &Node) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for line in master.cli(&["LRANGE", "result-list", "0", "-1"]).lines() {
        let r: serde_json::Value = serde_json::from_str(line).expect("result JSON");
        assert_eq!(r["status_code"], 200, "{r}");
        *seen
            .entry(r["id"].as_str().expect("id").to_owned())
            .or_default() += 1;
    }
    let duplicated: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
    assert!(duplicated.is_empty(), "duplicate results: {duplicated:?}");
    assert_eq!(seen.len(), N, "missing results");
    assert_eq!(master.int(&["ZCARD", QUEUE]), 0);
    assert_eq!(master.int(&["ZCARD", "retry-sortedset"]), 0);
    assert_eq!(master.int(&["HLEN", &format!("{QUEUE}:claimed")]), 0);
    assert_eq!(master.int(&["HLEN", &format!("{QUEUE}:claim-owners")]), 0);
}

/// `SENTINEL FAILOVER` mid-drain. Besides the transport, the queue's gate
/// reads its budget key through the sentinels (a `redis` gate whose
/// address is a sentinel) and the window is the shared one in Redis: if
/// either kept talking to the old master the drain would stall (a gate
/// that cannot read closes; a window that cannot lease holds nothing).
#[tokio::test(flavor = "multi_thread")]
async fn sentinel_failover_mid_drain_loses_nothing_and_answers_each_id_once() {
    let group = SentinelGroup::start();
    let gw = gateway().await;
    let tmp = support::TempDir::new("sentinel-failover");
    let dir = &tmp.0;
    let old = group.master_port();
    // The gate's budget: open, written before the drain so the replica
    // has it too.
    assert_eq!(
        group
            .master()
            .cli(&["SET", "sentinel-budget", "1.0"])
            .trim(),
        "OK"
    );
    submit(&group, dir).await;
    let gate = format!(
        r#"gate_type = "redis"
gate_params = {{ address = "{}", budget_key = "sentinel-budget" }}"#,
        group.sentinel_addrs()[1]
    );
    let config = dir.join("sluicegate.toml");
    std::fs::write(
        &config,
        config_toml(
            &group,
            &gw.uri(),
            "shared_window = \"redis\"\nshared_window_lease = \"2s\"",
            &gate,
        ),
    )
    .expect("config");
    let log = dir.join("run.log");
    let mut child = dispatcher(&config, &log);
    support::wait_until(Duration::from_secs(30), "drain started", || {
        group.master().int(&["LLEN", "result-list"]) >= (N / 10) as i64
    })
    .await;
    let before = group.master().int(&["LLEN", "result-list"]);
    group.failover();
    let new = group.wait_new_master(old, Duration::from_secs(30)).await;
    assert_ne!(new, old);
    let master = group
        .data
        .iter()
        .find(|n| n.port == new)
        .expect("new master");
    wait_drained(master, N as i64, Duration::from_secs(90), &log).await;
    // The failover really was mid-drain, and the old master is a replica.
    assert!(before < N as i64, "drained before the failover: {before}");
    let old_node = group
        .data
        .iter()
        .find(|n| n.port == old)
        .expect("old master");
    support::wait_until(Duration::from_secs(30), "old master demoted", || {
        old_node.role() == "slave"
    })
    .await;
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.0.id().to_string())
        .status();
    let _ = child.0.wait();
    assert_exactly_once(master);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("asking the sentinels again"),
        "the dispatcher never re-resolved the master:\n{text}"
    );
}

/// The master SIGKILLed mid-drain: the sentinels agree it is down and
/// promote the replica; the dispatcher finds it through them. The queue's
/// gate is a `redis-quota` whose address is a sentinel (a limit no drain
/// reaches): a quota gate that kept dialling the dead master would refuse
/// every message from then on and the drain would not finish.
#[tokio::test(flavor = "multi_thread")]
async fn killed_master_mid_drain_loses_nothing_and_answers_each_id_once() {
    let mut group = SentinelGroup::start();
    let gw = gateway().await;
    let tmp = support::TempDir::new("sentinel-kill");
    let dir = &tmp.0;
    submit(&group, dir).await;
    let config = dir.join("sluicegate.toml");
    std::fs::write(
        &config,
        config_toml(
            &group,
            &gw.uri(),
            "wait_requeue_delay = \"100ms\"",
            &format!(
                r#"gate_type = "redis-quota"
gate_params = {{ address = "{}", limit = 1000000, window = "1m" }}"#,
                group.sentinel_addrs()[2]
            ),
        ),
    )
    .expect("config");
    let log = dir.join("run.log");
    let mut child = dispatcher(&config, &log);
    support::wait_until(Duration::from_secs(30), "drain started", || {
        group.master().int(&["LLEN", "result-list"]) >= (N / 10) as i64
    })
    .await;
    let old = group.kill_master();
    let new = group.wait_new_master(old, Duration::from_secs(60)).await;
    let master = group
        .data
        .iter()
        .find(|n| n.port == new)
        .expect("new master");
    wait_drained(master, N as i64, Duration::from_secs(90), &log).await;
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.0.id().to_string())
        .status();
    let _ = child.0.wait();
    assert_exactly_once(master);
    // The quota gate did count in Redis (its three tenants' keys reached
    // the new master): it was in the path of every admission, and it
    // refuses on a Redis error, so the drain finishing means it reached
    // the new master after the kill.
    let quota_keys = master.cli(&["KEYS", "quota:userid:*"]);
    assert!(
        quota_keys.lines().count() >= 3,
        "no quota keys on the new master: {quota_keys:?}"
    );
}

/// `sluicegate serve` (the Batch API, in process) on the Redis transport
/// through the sentinels: its batch records live in the master, so a
/// batch made before a `SENTINEL FAILOVER` is still there after it, and a
/// new one runs to completion on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_keeps_its_batches_across_a_sentinel_failover() {
    let group = SentinelGroup::start();
    let sim = support::sim::small_pool().await;
    let tmp = support::TempDir::new("sentinel-serve");
    let addrs = group
        .sentinel_addrs()
        .iter()
        .map(|a| format!("\"{a}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let text = format!(
        "transport = \"redis\"\n[redis]\nmode = \"sentinel\"\naddrs = [{addrs}]\nmaster_name = \"{MASTER_NAME}\"\n[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nretry_initial_backoff = \"100ms\"\nretry_max_backoff = \"200ms\"\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"batch-api\"\nmax_sys = 8\ngate_type = \"constant\"\n",
        sim.base_url()
    );
    let config = Config::from_toml_str(&text, &BTreeMap::new()).expect("config loads");
    let serve = sluicegate::config::ServeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: tmp.0.join("data"),
        ..sluicegate::config::ServeConfig::default()
    };
    let server = sluicegate::serve::start(&config, &serve, std::future::pending())
        .await
        .expect("serve starts");
    let api = support::serve::Api::new(&format!("http://{}", server.addr), None);
    let long = Duration::from_secs(60);
    let first = api
        .batch(
            &support::serve::completion_lines(6, 4),
            "/v1/completions",
            "24h",
        )
        .await;
    let first_id = first["id"].as_str().expect("id").to_owned();
    let done = api
        .wait_for(&first_id, long, support::serve::terminal)
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert!(
        group.master().int(&["DBSIZE"]) > 0,
        "serve's records are in the master"
    );
    group.wait_replica_synced().await;
    let old = group.master_port();
    group.failover();
    let new = group.wait_new_master(old, Duration::from_secs(30)).await;
    assert_ne!(new, old);
    // The record written before the failover, read from the new master.
    let (status, again) = api.get(&format!("/v1/batches/{first_id}")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["status"], "completed", "{again}");
    let second = api
        .batch(
            &support::serve::completion_lines(6, 4),
            "/v1/completions",
            "24h",
        )
        .await;
    let second_id = second["id"].as_str().expect("id").to_owned();
    let done = api
        .wait_for(&second_id, long, support::serve::terminal)
        .await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        serde_json::json!({"total": 6, "completed": 6, "failed": 0})
    );
    server.shutdown();
    server.wait().await.expect("serve stops");
}

fn load(toml: &str, env: &[(&str, &str)]) -> Result<Config, sluicegate::config::ConfigErrors> {
    let env: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Config::from_toml_str(toml, &env)
}

const BASE: &str = r#"
transport = "redis"
[gateway]
url = "http://127.0.0.1:8000"
[[queue]]
queue_name = "q"
gate_type = "constant"
"#;

/// The key an error is reported under, with its message, for each error.
fn errors(toml: &str, env: &[(&str, &str)]) -> Vec<(String, String)> {
    match load(toml, env) {
        Ok(c) => panic!("expected errors, got {:#?}", c.redis),
        Err(e) => e
            .errors()
            .iter()
            .map(|e| (e.key.clone(), e.message.clone()))
            .collect(),
    }
}

#[test]
fn sentinel_config_is_checked_key_by_key() {
    // A complete sentinel section loads, with upstream's names.
    let ok = format!(
        "{BASE}[redis]\nmode = \"sentinel\"\naddrs = [\"10.0.0.1:26379\", \"rediss://s2:26379\"]\nmaster_name = \"mymaster\"\nsentinel_password = \"s3cret\"\n"
    );
    let c = load(&ok, &[]).unwrap_or_else(|e| panic!("{e}"));
    let redis = c.redis.clone().expect("[redis]");
    assert_eq!(redis.mode, RedisMode::Sentinel);
    assert_eq!(redis.addrs, ["10.0.0.1:26379", "rediss://s2:26379"]);
    assert_eq!(redis.master_name.as_deref(), Some("mymaster"));
    assert!(!redis.cluster);
    // The sentinels' password is a secret: never shown.
    let shown = c.to_redacted_toml();
    assert!(!shown.contains("s3cret"), "{shown}");

    // The same from the environment (comma-separated addresses).
    let c = load(
        BASE,
        &[
            ("SLUICEGATE_REDIS_MODE", "sentinel"),
            ("SLUICEGATE_REDIS_ADDRS", "127.0.0.1:26379,127.0.0.1:26380"),
            ("SLUICEGATE_REDIS_MASTER_NAME", "m"),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let redis = c.redis.expect("[redis]");
    assert_eq!(redis.addrs.len(), 2);
    assert_eq!(redis.mode, RedisMode::Sentinel);

    // Sentinel without master_name or addrs: each missing key named.
    let errs = errors(&format!("{BASE}[redis]\nmode = \"sentinel\"\n"), &[]);
    let keys: Vec<&str> = errs.iter().map(|(k, _)| k.as_str()).collect();
    assert!(keys.contains(&"redis.master_name"), "{errs:?}");
    assert!(keys.contains(&"redis.addrs"), "{errs:?}");
    let master_name = errs
        .iter()
        .find(|(k, _)| k == "redis.master_name")
        .expect("named");
    assert!(
        master_name
            .1
            .contains("required with redis.mode = \"sentinel\""),
        "{errs:?}"
    );

    // An unknown mode: the key and the allowed values.
    let errs = errors(&format!("{BASE}[redis]\nmode = \"replicated\"\n"), &[]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].0, "redis.mode");
    assert!(
        errs[0]
            .1
            .contains("unknown value \"replicated\"; allowed: standalone, cluster, sentinel"),
        "{errs:?}"
    );

    // cluster = true contradicts mode = "sentinel".
    let errs = errors(
        &format!(
            "{BASE}[redis]\nmode = \"sentinel\"\ncluster = true\naddrs = [\"h:1\"]\nmaster_name = \"m\"\n"
        ),
        &[],
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].0, "redis.cluster");

    // Sentinel-only keys outside sentinel mode, addrs on one server, a
    // bad address and a password in an address.
    let errs = errors(
        &format!("{BASE}[redis]\nmaster_name = \"m\"\naddrs = [\"h:1\"]\n"),
        &[],
    );
    let keys: Vec<&str> = errs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["redis.master_name", "redis.addrs"], "{errs:?}");
    let errs = errors(
        &format!(
            "{BASE}[redis]\nmode = \"sentinel\"\nmaster_name = \"m\"\naddrs = [\"no-port\"]\n"
        ),
        &[],
    );
    assert_eq!(errs[0].0, "redis.addrs", "{errs:?}");
    assert!(errs[0].1.contains("host:port"), "{errs:?}");
    let errs = errors(
        &format!(
            "{BASE}[redis]\nmode = \"sentinel\"\nmaster_name = \"m\"\naddrs = [\"redis://:pw@h:1\"]\n"
        ),
        &[],
    );
    assert_eq!(errs[0].0, "redis.addrs", "{errs:?}");
    assert!(errs[0].1.contains("sentinel_password"), "{errs:?}");

    // mode = "cluster" is cluster = true; cluster = true alone is mode
    // cluster.
    let c = load(&format!("{BASE}[redis]\nmode = \"cluster\"\n"), &[])
        .unwrap_or_else(|e| panic!("{e}"));
    let redis = c.redis.expect("[redis]");
    assert!(redis.cluster);
    let c =
        load(&format!("{BASE}[redis]\ncluster = true\n"), &[]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.redis.expect("[redis]").mode, RedisMode::Cluster);
}

#[test]
fn producer_flags_name_the_missing_sentinel_flag() {
    let out = support::cli::output(&mut support::cli::sluicegate(&[
        "submit",
        "--redis-mode",
        "sentinel",
        "--redis-addrs",
        "127.0.0.1:1",
        "--queue",
        "q",
        "/dev/null",
    ]));
    assert!(!out.status.success());
    let err = support::cli::text(&out.stderr);
    assert!(err.contains("--redis-master-name"), "{err}");
    let out = support::cli::output(&mut support::cli::sluicegate(&[
        "submit",
        "--redis-mode",
        "mirror",
        "--queue",
        "q",
        "/dev/null",
    ]));
    assert!(!out.status.success());
    let err = support::cli::text(&out.stderr);
    assert!(
        err.contains(
            "--redis-mode: unknown value \"mirror\"; allowed: standalone, cluster, sentinel"
        ),
        "{err}"
    );
}
