//! The real `sluicegate` binary on the Redis transport under faults:
//! SIGKILL at random points, SIGTERM, a Redis restart (AOF) mid-drain, and
//! Redis down at startup. Every id must end with exactly one result and
//! the queue, retry set and claims must end empty.

use crate::support;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::redis::{RedisOptions, RedisServer, free_port};
use rand::RngExt;
use sluicegate::clock::unix_secs;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");
const QUEUE: &str = "faults";

async fn gateway(delay: Duration) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_string(r#"{"choices":[{"text":"ok"}]}"#)
                .set_delay(delay),
        )
        .mount(&server)
        .await;
    server
}

/// Submits `n` requests with the `submit` command.
fn submit(server: &RedisServer, dir: &Path, n: usize) {
    submit_with(server, dir, n, &[]);
}

fn submit_with(server: &RedisServer, dir: &Path, n: usize, env: &[(&str, &Path)]) {
    let file = dir.join("requests.jsonl");
    let deadline = unix_secs() + 3600;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({"id": format!("m-{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("write requests");
    let out = Command::new(BIN)
        .args(["submit", "--redis-url", &server.url(), "--queue", QUEUE])
        .arg(&file)
        .envs(env.iter().copied())
        .output()
        .expect("submit runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains(&format!("submitted {n} requests")),
        "{summary}"
    );
}

fn dispatcher(redis_url: &str, gateway: &str, lease: &str, listen: &str, log: &Path) -> Dispatcher {
    dispatcher_with(redis_url, gateway, lease, listen, log, &[])
}

/// A dispatcher process, SIGKILLed on drop so a failing test leaves none
/// behind.
struct Dispatcher(Child);

impl std::ops::Deref for Dispatcher {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Dispatcher {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn dispatcher_with(
    redis_url: &str,
    gateway: &str,
    lease: &str,
    listen: &str,
    log: &Path,
    env: &[(&str, &Path)],
) -> Dispatcher {
    let log = std::fs::File::create(log).expect("log file");
    Command::new(BIN)
        .arg("run")
        .env_clear()
        .envs(env.iter().copied())
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "redis")
        .env("SLUICEGATE_REDIS_URL", redis_url)
        .env("SLUICEGATE_QUEUE", QUEUE)
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_GATE_TYPE", "constant")
        .env("SLUICEGATE_QUEUE_MAX_SYS", "64")
        .env("SLUICEGATE_LISTEN", listen)
        .env("SLUICEGATE_DISPATCH_LEASE", lease)
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .env("SLUICEGATE_DISPATCH_SHUTDOWN_GRACE", "5s")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(Dispatcher)
        .expect("dispatcher runs")
}

fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .expect("kill runs");
    assert!(status.success());
}

/// Waits until `n` results exist and nothing is pending or claimed.
async fn wait_drained(server: &RedisServer, n: i64, within: Duration) {
    let give_up = Instant::now() + within;
    loop {
        let results = server.int(&["LLEN", "result-list"]);
        let pending = server.int(&["ZCARD", QUEUE]);
        let claims = server.int(&["ZCARD", &format!("{QUEUE}:claims-idx")]);
        let retries = server.int(&["ZCARD", "retry-sortedset"]);
        if results >= n && pending == 0 && claims == 0 && retries == 0 {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "not drained: {results} results, {pending} pending, {claims} claims, {retries} retries"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every id `m-0..n` has exactly one result, and the queue's keys are empty.
fn assert_exactly_once(server: &RedisServer, n: usize) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for line in server.cli(&["LRANGE", "result-list", "0", "-1"]).lines() {
        let r: serde_json::Value = serde_json::from_str(line).expect("result JSON");
        assert_eq!(r["status_code"], 200, "{r}");
        *seen
            .entry(r["id"].as_str().expect("id").to_owned())
            .or_default() += 1;
    }
    let duplicated: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
    assert!(duplicated.is_empty(), "duplicate results: {duplicated:?}");
    assert_eq!(seen.len(), n, "missing results");
    assert_eq!(server.int(&["ZCARD", QUEUE]), 0);
    assert_eq!(server.int(&["ZCARD", "retry-sortedset"]), 0);
    assert_eq!(server.int(&["HLEN", &format!("{QUEUE}:claimed")]), 0);
    assert_eq!(server.int(&["HLEN", &format!("{QUEUE}:claim-owners")]), 0);
    assert_eq!(server.int(&["ZCARD", &format!("{QUEUE}:claims-idx")]), 0);
    assert_eq!(server.int(&["HLEN", &format!("{QUEUE}:claim-reclaims")]), 0);
}

/// Issue 22: a request in flight when its dispatcher is SIGKILLed was
/// sent; the one that finishes it after the lease expired reports two
/// attempts (every result said 1 before).
#[tokio::test(flavor = "multi_thread")]
async fn a_request_in_flight_at_sigkill_counts_its_attempt() {
    let server = RedisServer::start();
    let hanging = gateway(Duration::from_secs(60)).await;
    let fast = gateway(Duration::from_millis(2)).await;
    let tmp = support::TempDir::new("sigkill-attempts");
    let dir = &tmp.0;
    submit(&server, dir, 4);
    let mut child = dispatcher(
        &server.url(),
        &hanging.uri(),
        "2s",
        "127.0.0.1:0",
        &dir.join("run.log"),
    );
    let give_up = Instant::now() + Duration::from_secs(30);
    while hanging.received_requests().await.map_or(0, |r| r.len()) < 4 {
        assert!(
            Instant::now() < give_up,
            "the requests never reached the gateway"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let mut child = dispatcher(
        &server.url(),
        &fast.uri(),
        "2s",
        "127.0.0.1:0",
        &dir.join("run2.log"),
    );
    wait_drained(&server, 4, Duration::from_secs(30)).await;
    sigterm(&child);
    let _ = child.wait();
    for line in server.cli(&["LRANGE", "result-list", "0", "-1"]).lines() {
        let r: serde_json::Value = serde_json::from_str(line).expect("result JSON");
        assert_eq!(
            (r["status_code"].as_i64(), r["attempts"].as_i64()),
            (Some(200), Some(2)),
            "{r}"
        );
    }
    assert_exactly_once(&server, 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_random_points_never_duplicates_or_loses_results() {
    let server = RedisServer::start();
    let gw = gateway(Duration::from_millis(2)).await;
    let tmp = support::TempDir::new("sigkill");
    let dir = &tmp.0;
    submit(&server, dir, 2000);
    assert_eq!(server.int(&["ZCARD", QUEUE]), 2000);
    let mut rng = rand::rng();
    for round in 0..5 {
        let mut child = dispatcher(
            &server.url(),
            &gw.uri(),
            "2s",
            "127.0.0.1:0",
            &dir.join("run.log"),
        );
        let after = Duration::from_millis(rng.random_range(150..700));
        tokio::time::sleep(after).await;
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let results = server.int(&["LLEN", "result-list"]);
        eprintln!("round {round}: killed after {after:?}, {results} results so far");
    }
    // A last run finishes the work, including what the killed runs held
    // (their claims come back when their leases expire).
    let mut child = dispatcher(
        &server.url(),
        &gw.uri(),
        "2s",
        "127.0.0.1:0",
        &dir.join("run.log"),
    );
    wait_drained(&server, 2000, Duration::from_secs(40)).await;
    sigterm(&child);
    let _ = child.wait();
    assert_exactly_once(&server, 2000);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_hands_claims_back_at_once_instead_of_waiting_out_leases() {
    let server = RedisServer::start();
    // Slow answers keep many messages claimed when the signal arrives.
    let gw = gateway(Duration::from_millis(300)).await;
    let tmp = support::TempDir::new("sigterm");
    let dir = &tmp.0;
    submit(&server, dir, 300);
    let mut child = dispatcher(
        &server.url(),
        &gw.uri(),
        "10m",
        "127.0.0.1:0",
        &dir.join("run.log"),
    );
    let give_up = Instant::now() + Duration::from_secs(10);
    while server.int(&["ZCARD", &format!("{QUEUE}:claims-idx")]) == 0 {
        assert!(Instant::now() < give_up, "nothing claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sigterm(&child);
    let status = child.wait().expect("exits");
    assert!(status.success(), "{status:?}");
    // With a 10-minute lease, only a release could have emptied the claims.
    assert_eq!(server.int(&["ZCARD", &format!("{QUEUE}:claims-idx")]), 0);
    assert_eq!(server.int(&["HLEN", &format!("{QUEUE}:claimed")]), 0);
    let results = server.int(&["LLEN", "result-list"]);
    let pending = server.int(&["ZCARD", QUEUE]);
    assert_eq!(
        results + pending,
        300,
        "{results} results, {pending} pending"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_restart_with_aof_mid_drain_loses_nothing() {
    let mut server = RedisServer::start_with(RedisOptions {
        aof: true,
        ..RedisOptions::default()
    });
    let gw = gateway(Duration::from_millis(20)).await;
    let tmp = support::TempDir::new("aof");
    let dir = &tmp.0;
    submit(&server, dir, 2000);
    let mut child = dispatcher(
        &server.url(),
        &gw.uri(),
        "3s",
        "127.0.0.1:0",
        &dir.join("run.log"),
    );
    support::wait_until(Duration::from_secs(20), "drain did not start", || {
        server.int(&["LLEN", "result-list"]) >= 200
    })
    .await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.restart();
    wait_drained(&server, 2000, Duration::from_secs(40)).await;
    sigterm(&child);
    let _ = child.wait();
    assert_exactly_once(&server, 2000);
}

async fn ready(listen: &str) -> Option<u16> {
    let response = reqwest::get(format!("http://{listen}/readyz")).await.ok()?;
    Some(response.status().as_u16())
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_down_at_startup_is_reported_not_ready_and_recovers() {
    let mut server = RedisServer::not_started();
    let gw = gateway(Duration::ZERO).await;
    let tmp = support::TempDir::new("down");
    let dir = &tmp.0;
    let listen = format!("127.0.0.1:{}", free_port());
    let log = dir.join("run.log");
    let mut child = dispatcher(&server.url(), &gw.uri(), "5s", &listen, &log);
    let give_up = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = ready(&listen).await {
            assert_eq!(status, 503, "ready while Redis is down");
            break;
        }
        assert!(Instant::now() < give_up, "telemetry never came up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        stderr.contains(&format!(
            "redis at 127.0.0.1:{} is unreachable",
            server.port
        )) || stderr.contains("did not answer"),
        "{stderr}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ready(&listen).await, Some(503));
    server.restart();
    let give_up = Instant::now() + Duration::from_secs(20);
    while ready(&listen).await != Some(200) {
        assert!(Instant::now() < give_up, "never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    submit(&server, dir, 5);
    wait_drained(&server, 5, Duration::from_secs(20)).await;
    assert_exactly_once(&server, 5);
    child.kill().expect("SIGKILL");
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread")]
async fn producer_commands_submit_cancel_and_collect_with_line_numbers_for_bad_lines() {
    let server = RedisServer::start();
    let gw = gateway(Duration::ZERO).await;
    let tmp = support::TempDir::new("producer");
    let dir = &tmp.0;
    let file = dir.join("batch.jsonl");
    std::fs::write(
        &file,
        [
            r#"{"custom_id":"b-1","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"p"}}"#,
            r#"{"custom_id":"b-2","method":"POST","url":"/v1/completions","body":{"model":"m","prompt":"p"}}"#,
            "",
            "{not json",
            r#"{"id":"b-3","payload":{"model":"m","prompt":"p"}}"#,
            r#"{"custom_id":"b-4","method":"GET","url":"/v1/models","body":{}}"#,
        ]
        .join("\n"),
    )
    .expect("write batch");
    let out = Command::new(BIN)
        .args([
            "submit",
            "--redis-url",
            &server.url(),
            "--queue",
            QUEUE,
            "--deadline",
            "1h",
        ])
        .arg(&file)
        .output()
        .expect("submit runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "bad lines make the exit code 1");
    assert!(stderr.contains("line 4: not valid JSON"), "{stderr}");
    assert!(stderr.contains("line 6: method GET"), "{stderr}");
    assert!(stdout.contains("submitted 3 requests"), "{stdout}");
    assert_eq!(server.int(&["ZCARD", QUEUE]), 3);
    let out = Command::new(BIN)
        .args(["cancel", "--redis-url", &server.url(), "b-2", "unknown"])
        .output()
        .expect("cancel runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("b-2: cancelled"), "{stdout}");
    assert!(stdout.contains("unknown: not active"), "{stdout}");
    let mut child = dispatcher(
        &server.url(),
        &gw.uri(),
        "5s",
        "127.0.0.1:0",
        &dir.join("run.log"),
    );
    let results = dir.join("results.jsonl");
    let out = Command::new(BIN)
        .args([
            "results",
            "--redis-url",
            &server.url(),
            "--list",
            "result-list",
            "--expect",
            "3",
        ])
        .args(["--timeout", "30s", "--format", "openai", "--out"])
        .arg(&results)
        .output()
        .expect("results runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&results)
        .expect("results file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 3);
    for line in &lines {
        match line["custom_id"].as_str() {
            // OpenAI's code; the llm-d code is kept in `llm_d_code`.
            Some("b-2") => {
                assert_eq!(line["error"]["code"], "batch_cancelled", "{line}");
                assert_eq!(line["error"]["llm_d_code"], "CANCELLED", "{line}");
            }
            Some("b-1" | "b-3") => {
                assert_eq!(line["response"]["status_code"], 200, "{line}");
                assert_eq!(line["response"]["body"]["choices"][0]["text"], "ok");
            }
            other => panic!("unexpected result {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rediss_with_a_private_ca_drains_over_tls() {
    let server = RedisServer::start_with(RedisOptions {
        tls: true,
        ..RedisOptions::default()
    });
    let gw = gateway(Duration::ZERO).await;
    let tmp = support::TempDir::new("tls");
    let dir = &tmp.0;
    // rustls reads extra trust roots from SSL_CERT_FILE (as a deployment
    // mounts its CA bundle).
    let ca = server.ca_file();
    let env = [("SSL_CERT_FILE", ca.as_path())];
    submit_with(&server, dir, 50, &env);
    let mut child = dispatcher_with(
        &server.url(),
        &gw.uri(),
        "5s",
        "127.0.0.1:0",
        &dir.join("run.log"),
        &env,
    );
    wait_drained(&server, 50, Duration::from_secs(20)).await;
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    assert_exactly_once(&server, 50);
}
