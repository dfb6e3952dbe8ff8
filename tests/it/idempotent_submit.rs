//! Idempotent submit through the queue's client face against real servers
//! (Redis, an embedded store, PostgreSQL): a repeat enqueues nothing and
//! returns the first submission, a different submission under the same
//! key is a conflict naming it, lookup finds the record, and the record
//! goes once its TTL has passed; transports that cannot record a key say
//! so.

use std::sync::Arc;
use std::time::Duration;

use crate::support::TempDir;
use crate::support::postgres::Postgres;
use crate::support::redis::{RedisOptions, RedisServer, redis_config};
use bytes::Bytes;
use sluicegate::clock::unix_secs;
use sluicegate::config::EndpointUrl;
use sluicegate::queue::{
    Client, ClientError, ClientTarget, MemoryQueue, Outgoing, SubmissionRecord, Submitted,
    open_client,
};

/// How long a record outlives the last deadline in these tests.
const KEEP: Duration = Duration::from_secs(1);

fn requests(ids: &[&str], prompt: &str) -> Vec<Outgoing> {
    // Deadlines 2 s ahead: the records expire about 3 s from now.
    requests_due(ids, prompt, 2)
}

/// [`requests`] with deadlines `in_secs` ahead.
fn requests_due(ids: &[&str], prompt: &str, in_secs: i64) -> Vec<Outgoing> {
    let deadline = unix_secs() + in_secs;
    (ids.iter())
        .map(|id| Outgoing {
            body: Bytes::from(
                serde_json::json!({
                    "id": id,
                    "deadline": deadline,
                    "payload": {"model": "m", "prompt": prompt, "max_tokens": 4},
                })
                .to_string(),
            ),
            deadline,
        })
        .collect()
}

/// The shared scenario; returns the first record. The caller then checks
/// that the queue holds only the first submission's two requests.
async fn repeat_conflict_lookup(client: &dyn Client) -> SubmissionRecord {
    let first = client
        .enqueue_idempotent("order-7".into(), requests(&["a", "b"], "Hi"), KEEP)
        .await
        .expect("first submit");
    let Submitted::New(record) = first else {
        panic!("a new key enqueues: {first:?}");
    };
    assert_eq!(record.key, "order-7");
    assert_eq!(record.identity.len(), 64);
    let ids: Vec<&str> = record.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);

    let again = client
        .enqueue_idempotent("order-7".into(), requests(&["a", "b"], "Hi"), KEEP)
        .await
        .expect("repeat");
    assert_eq!(again, Submitted::Existing(record.clone()));

    let other = client
        .enqueue_idempotent("order-7".into(), requests(&["a", "b"], "Bye"), KEEP)
        .await
        .expect_err("a different submission under the key");
    match &other {
        ClientError::IdempotencyConflict {
            key,
            recorded,
            offered,
        } => {
            assert_eq!(key, "order-7");
            assert_eq!(recorded, &record.identity);
            assert_ne!(offered, &record.identity);
        }
        e => panic!("expected a conflict, got {e}"),
    }
    assert!(other.to_string().contains("`order-7`"), "{other}");

    let reordered = client
        .enqueue_idempotent("order-7".into(), requests(&["b", "a"], "Hi"), KEEP)
        .await;
    assert!(matches!(
        reordered,
        Err(ClientError::IdempotencyConflict { .. })
    ));

    let found = client.lookup("order-7".into()).await.expect("lookup");
    assert_eq!(found.as_ref(), Some(&record));
    let none = client.lookup("never-used".into()).await.expect("lookup");
    assert_eq!(none, None);
    record
}

/// The record expires with its TTL; afterwards the key is free again.
async fn expires(client: &dyn Client) {
    let mut gone = false;
    for _ in 0..100 {
        if client
            .lookup("order-7".into())
            .await
            .expect("lookup")
            .is_none()
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the record outlived its expiry by 10 s");
    let reused = client
        .enqueue_idempotent("order-7".into(), requests(&["c"], "Hi"), KEEP)
        .await
        .expect("a key whose record expired");
    assert!(matches!(reused, Submitted::New(_)), "{reused:?}");
}

/// Only the first submission's ids are queued (a repeat enqueued
/// nothing); once the record expired, the key enqueues again.
async fn only_first_then_reused(client: &dyn Client) {
    let all = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
    let active = client.active(all.clone()).await.expect("active");
    assert_eq!(
        active.expect("told"),
        ["a", "b"],
        "a repeat enqueues nothing"
    );
    expires(client).await;
    let active = client.active(all).await.expect("active");
    assert_eq!(active.expect("told"), ["a", "b", "c"]);
}

#[tokio::test]
async fn redis_records_a_key_with_its_requests() {
    let server = RedisServer::start();
    let client = open_client(ClientTarget::Redis {
        config: redis_config(&server),
        queue: "idem-q".into(),
        result_list: None,
        fairness_attribute: None,
    })
    .await
    .expect("client");
    let record = repeat_conflict_lookup(client.as_ref()).await;
    assert_eq!(
        server.int(&["ZCARD", "idem-q"]),
        2,
        "a repeat enqueues nothing"
    );
    // The recorded tokens are the ones the queued messages carry.
    for r in &record.requests {
        let token = server.cli(&["GET", &format!("request-active:{}", r.id)]);
        assert_eq!(Some(token.trim()), r.token.as_deref());
    }
    let ttl = server.int(&["TTL", "sluicegate-idempotency:idem-q:order-7"]);
    assert!((1..=4).contains(&ttl), "record TTL {ttl}");
    expires(client.as_ref()).await;
    assert_eq!(server.int(&["ZCARD", "idem-q"]), 3);
}

#[tokio::test]
async fn embedded_records_a_key_in_the_enqueue_transaction() {
    let dir = TempDir::new("idem-embedded");
    let client = open_client(ClientTarget::Embedded {
        path: dir.0.join("store.db"),
        queue: "q".into(),
        create: true,
    })
    .await
    .expect("client");
    repeat_conflict_lookup(client.as_ref()).await;
    only_first_then_reused(client.as_ref()).await;
}

/// A client of queue `idem-q` (results to `idem-results`) on `pg`.
async fn sql_client(pg: &Postgres) -> Arc<dyn Client> {
    open_client(ClientTarget::Sql {
        url: EndpointUrl::new(url::Url::parse(&pg.url()).expect("url")),
        connect_timeout: Duration::from_secs(5),
        queue: "idem-q".into(),
        route: "idem-results".into(),
        fairness_attribute: None,
    })
    .await
    .expect("client")
}

#[tokio::test]
async fn sql_records_a_key_in_the_insert_statement() {
    let pg = Postgres::start();
    let client = sql_client(&pg).await;
    let record = repeat_conflict_lookup(client.as_ref()).await;
    assert_eq!(record.result_route, "idem-results");
    only_first_then_reused(client.as_ref()).await;
}

/// A producer that lost the answer while PostgreSQL restarted sends the
/// same submission again under its key: the record written before the
/// restart holds after it, and nothing is enqueued twice.
#[tokio::test]
async fn sql_a_key_holds_across_a_postgres_restart() {
    let mut pg = Postgres::start();
    let client = sql_client(&pg).await;
    let submission = || requests_due(&["a", "b"], "Hi", 3600);
    let first = client
        .enqueue_idempotent("order-9".into(), submission(), KEEP)
        .await
        .expect("first submit");
    assert!(matches!(first, Submitted::New(_)), "{first:?}");
    pg.restart();
    // The client reconnects on its next statement; a statement caught by
    // the restart fails and the producer sends again, as it would.
    let mut again = None;
    for _ in 0..5 {
        match client
            .enqueue_idempotent("order-9".into(), submission(), KEEP)
            .await
        {
            Ok(done) => {
                again = Some(done);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let again = again.expect("a repeat after the restart is answered");
    assert_eq!(again, Submitted::Existing(first.record().clone()));
    assert_eq!(
        pg.psql("SELECT COUNT(*) FROM async_requests WHERE queue = 'idem-q'"),
        "2",
        "the repeat enqueued nothing"
    );
}

/// A queue server a test can crash (SIGKILL) and start again on the same
/// data, and count a queue's messages on.
trait Crashable {
    fn crash(&mut self);
    fn start_again(&mut self);
    fn queued(&self, queue: &str) -> i64;
    async fn client(&self, queue: &str) -> Arc<dyn Client>;
}

impl Crashable for RedisServer {
    fn crash(&mut self) {
        self.kill();
    }
    fn start_again(&mut self) {
        self.restart();
    }
    fn queued(&self, queue: &str) -> i64 {
        self.int(&["ZCARD", queue])
    }
    async fn client(&self, queue: &str) -> Arc<dyn Client> {
        open_client(ClientTarget::Redis {
            config: redis_config(self),
            queue: queue.into(),
            result_list: None,
            fairness_attribute: None,
        })
        .await
        .expect("client")
    }
}

impl Crashable for Postgres {
    fn crash(&mut self) {
        self.kill();
    }
    fn start_again(&mut self) {
        self.restart();
    }
    fn queued(&self, queue: &str) -> i64 {
        self.psql(&format!(
            "SELECT COUNT(*) FROM async_requests WHERE queue = '{queue}'"
        ))
        .parse()
        .expect("a count")
    }
    async fn client(&self, queue: &str) -> Arc<dyn Client> {
        open_client(ClientTarget::Sql {
            url: EndpointUrl::new(url::Url::parse(&self.url()).expect("url")),
            connect_timeout: Duration::from_secs(5),
            queue: queue.into(),
            route: "idem-results".into(),
            fairness_attribute: None,
        })
        .await
        .expect("client")
    }
}

/// Issue 36 part 4: the server SIGKILLed while an idempotent submit of
/// `n` requests under a key runs (killed at 0 to 1¼ of the time an
/// undisturbed submit of `n` took, denser near its end, one round each on its own
/// queue and key), started again; the producer
/// sends the same submission under the key until answered. Whether the
/// first call committed before the kill or not, the queue then holds the
/// `n` requests exactly once, and a first call that was answered is
/// answered the same record again. At least one kill must land while a
/// call is in flight.
async fn killed_mid_enqueue<S: Crashable>(server: &mut S, n: usize) {
    let calibration: Vec<String> = (0..n).map(|i| format!("c-{i}")).collect();
    let refs: Vec<&str> = calibration.iter().map(String::as_str).collect();
    let client = server.client("kill-calibrate").await;
    let began = std::time::Instant::now();
    (client.enqueue_idempotent("calibrate".into(), requests_due(&refs, "Hi", 3600), KEEP))
        .await
        .expect("an undisturbed submit");
    let took = began.elapsed();
    // Denser near the end, where the commit and the answer are.
    let delays: Vec<Duration> = [0, 4, 8, 12, 14, 15, 16, 20]
        .iter()
        .map(|sixteenths| took * *sixteenths / 16)
        .collect();
    eprintln!("an undisturbed submit of {n} took {took:?}");
    let mut rounds = Vec::new();
    for (round, delay) in delays.iter().enumerate() {
        let queue = format!("kill-q{round}");
        let key = format!("kill-key-{round}");
        let ids: Vec<String> = (0..n).map(|i| format!("k{round}-{i}")).collect();
        let submission = || {
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            requests_due(&refs, "Hi", 3600)
        };
        let client = server.client(&queue).await;
        let first = {
            let (client, key, requests) = (client.clone(), key.clone(), submission());
            tokio::spawn(async move { client.enqueue_idempotent(key, requests, KEEP).await })
        };
        tokio::time::sleep(*delay).await;
        let in_flight = !first.is_finished();
        server.crash();
        let first = first.await.expect("the submit task");
        let at_kill = server_count_after_restart(server, &queue);
        // The producer sends again until answered (bounded).
        let mut again = None;
        for _ in 0..50 {
            match client
                .enqueue_idempotent(key.clone(), submission(), KEEP)
                .await
            {
                Ok(done) => {
                    again = Some(done);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let again = again.expect("a retry after the restart is answered within 5 s");
        let queued = server.queued(&queue);
        eprintln!(
            "round {round}: killed {delay:?} in, in flight {in_flight}, first {}, {at_kill} queued after the restart, retry {}, {queued} queued",
            if first.is_ok() { "answered" } else { "failed" },
            if matches!(again, Submitted::New(_)) {
                "new"
            } else {
                "existing"
            },
        );
        assert_eq!(queued, n as i64, "round {round}: enqueued exactly once");
        // All or nothing: the kill never leaves part of a submission.
        assert!(
            at_kill == 0 || at_kill == n as i64,
            "round {round}: {at_kill} of {n}"
        );
        assert_eq!(
            matches!(again, Submitted::Existing(_)),
            at_kill == n as i64,
            "round {round}: the retry finds the record exactly when the first committed: {again:?}"
        );
        if let Ok(first) = &first {
            assert_eq!(again.record(), first.record(), "round {round}");
        }
        let got: Vec<&str> = again
            .record()
            .requests
            .iter()
            .map(|r| r.id.as_str())
            .collect();
        assert_eq!(got, ids.iter().map(String::as_str).collect::<Vec<_>>());
        rounds.push(in_flight);
    }
    assert!(
        rounds.iter().any(|in_flight| *in_flight),
        "no kill landed while a submit was in flight: {rounds:?}"
    );
}

/// Starts the crashed `server` again; what `queue` holds then.
fn server_count_after_restart<S: Crashable>(server: &mut S, queue: &str) -> i64 {
    server.start_again();
    server.queued(queue)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_idempotent_enqueue_enqueues_exactly_once_on_retry() {
    // Append-only with fsync on every write: what Redis answered survives
    // the kill, as a deployment that keeps its queue must run it.
    let mut server = RedisServer::start_with(RedisOptions {
        aof: true,
        ..RedisOptions::default()
    });
    killed_mid_enqueue(&mut server, 3000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_killed_mid_idempotent_enqueue_enqueues_exactly_once_on_retry() {
    let mut pg = Postgres::start();
    killed_mid_enqueue(&mut pg, 2000).await;
}

/// A loopback proxy in front of a server that, once armed, loses the
/// first reply matching its predicate: it forwards nothing more to that
/// client (closing its side) but keeps the server's side open, as a
/// network that fails after the server committed. Connections opened
/// later pass through.
struct LosingProxy {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
    lost: Arc<tokio::sync::Notify>,
}

impl LosingProxy {
    async fn start(upstream: u16, lose: fn(&[u8]) -> bool) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let lost = Arc::new(tokio::sync::Notify::new());
        let (is_armed, on_lost) = (armed.clone(), lost.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let (armed, lost) = (is_armed.clone(), on_lost.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut losing = false;
                    loop {
                        let n = match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if !losing
                            && lose(&buf[..n])
                            && armed.swap(false, std::sync::atomic::Ordering::SeqCst)
                        {
                            losing = true;
                            let _ = client_write.shutdown().await;
                            lost.notify_one();
                        }
                        if !losing && client_write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port, armed, lost }
    }

    fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The server commits a keyed submit, then dies before its answer reaches
/// the producer (the proxy loses the reply, the server is SIGKILLed): the
/// retry under the key after the restart finds the record, `Existing`,
/// and the queue holds the submission once. `committed` waits until the
/// server has the rows (PostgreSQL commits at the `Sync` that follows the
/// reply the proxy lost).
async fn killed_after_commit_before_the_answer<S: Crashable>(
    server: &mut S,
    proxied: Arc<dyn Client>,
    proxy: &LosingProxy,
    queue: &str,
) {
    const N: usize = 500;
    let ids: Vec<String> = (0..N).map(|i| format!("lost-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    // A first keyed submit through the proxy readies the connection (the
    // Redis script cache, PostgreSQL's session), so the armed reply is
    // the submit's own.
    let primer = ["primer"];
    (proxied.enqueue_idempotent("primer".into(), requests_due(&primer, "Hi", 3600), KEEP))
        .await
        .expect("primer");
    proxy.arm();
    let first =
        (proxied.enqueue_idempotent("lost-key".into(), requests_due(&refs, "Hi", 3600), KEEP))
            .await;
    assert!(first.is_err(), "the answer was lost: {first:?}");
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    while server.queued(queue) < N as i64 + 1 {
        assert!(
            std::time::Instant::now() < give_up,
            "the submit never committed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::timeout(Duration::from_secs(1), proxy.lost.notified())
        .await
        .ok();
    server.crash();
    server.start_again();
    let mut again = None;
    for _ in 0..50 {
        match (proxied.enqueue_idempotent("lost-key".into(), requests_due(&refs, "Hi", 3600), KEEP))
            .await
        {
            Ok(done) => {
                again = Some(done);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let again = again.expect("a retry after the restart is answered within 5 s");
    assert!(matches!(again, Submitted::Existing(_)), "{again:?}");
    assert_eq!(
        server.queued(queue),
        N as i64 + 1,
        "the submission once, and the primer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_after_commit_before_the_answer_the_retry_finds_the_record() {
    let mut server = RedisServer::start_with(RedisOptions {
        aof: true,
        ..RedisOptions::default()
    });
    // The first reply after arming is the script's: Redis answers after
    // the write is in the append-only file (`appendfsync always`).
    let proxy = LosingProxy::start(server.port, |_| true).await;
    let mut config = redis_config(&server);
    config.url = EndpointUrl::new(
        url::Url::parse(&format!("redis://127.0.0.1:{}/0", proxy.port)).expect("url"),
    );
    let client = open_client(ClientTarget::Redis {
        config,
        queue: "lost-q".into(),
        result_list: None,
        fairness_attribute: None,
    })
    .await
    .expect("client");
    killed_after_commit_before_the_answer(&mut server, client, &proxy, "lost-q").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_killed_after_commit_before_the_answer_the_retry_finds_the_record() {
    let mut pg = Postgres::start();
    // The insert statement's completion (`SELECT 1`: its CTE answers a
    // count); the expiry sweep before it completes as `DELETE n`.
    let proxy = LosingProxy::start(pg.port, |bytes| {
        bytes.windows(9).any(|w| w == b"SELECT 1\0")
    })
    .await;
    let url = pg
        .url()
        .replace(&format!(":{}/", pg.port), &format!(":{}/", proxy.port));
    let client = open_client(ClientTarget::Sql {
        url: EndpointUrl::new(url::Url::parse(&url).expect("url")),
        connect_timeout: Duration::from_secs(5),
        queue: "lost-q".into(),
        route: "idem-results".into(),
        fairness_attribute: None,
    })
    .await
    .expect("client");
    killed_after_commit_before_the_answer(&mut pg, client, &proxy, "lost-q").await;
}

#[tokio::test]
async fn memory_refuses_a_key_instead_of_ignoring_it() {
    let client: Arc<dyn Client> = Arc::new(MemoryQueue::new("q"));
    let refused = client
        .enqueue_idempotent("k".into(), requests(&["a"], "Hi"), KEEP)
        .await
        .expect_err("memory records no keys");
    assert!(
        matches!(refused, ClientError::Unsupported { .. }),
        "{refused}"
    );
    assert!(matches!(
        client.lookup("k".into()).await,
        Err(ClientError::Unsupported { .. })
    ));
}

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

/// Runs `sluicegate ARGS…` with `env`; exit code, stdout, stderr.
fn sluicegate(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = std::process::Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .env_remove("SLUICEGATE_IDEMPOTENCY_KEY")
        .output()
        .expect("sluicegate runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `submit --idempotency-key` twice with one file, once with another,
/// then `status`; `place` holds the flags naming the queue. Returns the
/// status output.
fn submit_twice_then_conflict(dir: &TempDir, place: &[&str], env: &[(&str, &str)]) -> String {
    let file = |name: &str, prompt: &str| {
        let path = dir.0.join(name);
        let lines: Vec<String> = ["x-1", "x-2"]
            .iter()
            .map(|id| {
                serde_json::json!({"custom_id": id, "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": prompt}})
                .to_string()
            })
            .collect();
        std::fs::write(&path, lines.join("\n")).expect("write");
        path.display().to_string()
    };
    let (a, b) = (file("a.jsonl", "Hi"), file("b.jsonl", "Bye"));
    let submit = |f: &str| {
        let mut args = vec!["submit", "--idempotency-key", "nightly-42"];
        args.extend(place);
        args.push(f);
        sluicegate(&args, env)
    };
    let (code, out, err) = submit(&a);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("submitted 2") && out.contains("`nightly-42`"),
        "{out}"
    );
    let (code, out, err) = submit(&a);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("already exists"), "{out}");
    assert!(
        out.contains("`x-1`, `x-2`") && out.contains("nothing enqueued"),
        "{out}"
    );
    let (code, out, err) = submit(&b);
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("idempotency key `nightly-42`"), "{err}");
    let mut args = vec!["status", "--idempotency-key", "nightly-42"];
    args.extend(place);
    let (code, out, err) = sluicegate(&args, env);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 requests"), "{out}");
    let mut args = vec!["status", "--idempotency-key", "other"];
    args.extend(place);
    let (code, _, err) = sluicegate(&args, env);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("`other`"), "{err}");
    out
}

#[tokio::test]
async fn cli_submit_with_a_key_on_redis_enqueues_once() {
    let server = RedisServer::start();
    let dir = TempDir::new("idem-cli-redis");
    let url = server.url();
    let status = submit_twice_then_conflict(
        &dir,
        &["--queue", "idem-cli"],
        &[("SLUICEGATE_REDIS_URL", url.as_str())],
    );
    assert!(
        status.contains("state: 2 pending, results present for 0 of 2"),
        "{status}"
    );
    assert_eq!(server.int(&["ZCARD", "idem-cli"]), 2);
}

#[tokio::test]
async fn cli_submit_with_a_key_in_an_embedded_store_enqueues_once() {
    let dir = TempDir::new("idem-cli-embedded");
    let store = dir.0.join("store.db").display().to_string();
    let status = submit_twice_then_conflict(&dir, &["--embedded", &store], &[]);
    assert!(
        status.contains("state: 2 pending, results present for 0 of 2"),
        "{status}"
    );
    // A cancel answers both at once: the status then counts their results.
    let (code, out, err) = sluicegate(&["cancel", "--embedded", &store, "x-1", "x-2"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = sluicegate(
        &[
            "status",
            "--idempotency-key",
            "nightly-42",
            "--embedded",
            &store,
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("state: 0 pending, results present for 2 of 2"),
        "{out}"
    );
}

#[tokio::test]
async fn cli_submit_with_a_key_on_sql_enqueues_once() {
    let pg = Postgres::start();
    let dir = TempDir::new("idem-cli-sql");
    let url = pg.url();
    let status = submit_twice_then_conflict(&dir, &["--sql-url", &url], &[]);
    assert!(
        status.contains("state: 2 pending, results present for 0 of 2"),
        "{status}"
    );
}
