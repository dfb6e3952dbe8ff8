//! Issue 37: streamed flex requests (`stream: true`) stream once
//! dispatched. Each test proves a piece reached the client *before the
//! engine finished*, by the engine's own state (the simulator still
//! counts the request running, or a scripted gateway has not yet sent the
//! rest), never by a time threshold.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support;
use crate::support::serve::{ServeSpec, Served, start};
use crate::support::sim::{aborted, pool_in_flight};

/// Generous bound on anything that should happen soon on a loaded machine.
const LONG: Duration = Duration::from_secs(60);

/// A simulator whose decode is slow: one replica, 25 ms a step, so a
/// request of `max_tokens` tokens runs for seconds.
async fn slow_pool() -> sluicegate::sim::SimHandle {
    let mut cfg = sluicegate::sim::SimConfig {
        pool_name: "p".into(),
        replicas: 1,
        ..sluicegate::sim::SimConfig::default()
    };
    cfg.engine.step.c0_ms = 25.0;
    cfg.http.max_output_tokens = 1500;
    sluicegate::sim::spawn_http(cfg)
        .await
        .expect("simulator starts")
}

fn streamed_chat(max_tokens: u32) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello"}],
           "max_tokens": max_tokens, "service_tier": "flex", "stream": true})
}

/// Reads server-sent events off a streamed answer, as they arrive.
struct Events {
    answer: reqwest::Response,
    buf: Vec<u8>,
}

impl Events {
    async fn open(url: &str, body: &Value) -> Self {
        let answer = reqwest::Client::new()
            .post(url)
            .json(body)
            .send()
            .await
            .expect("serve answers");
        assert_eq!(answer.status().as_u16(), 200);
        let kind = answer.headers()["content-type"].to_str().expect("text");
        assert!(kind.starts_with("text/event-stream"), "{kind}");
        Self {
            answer,
            buf: Vec::new(),
        }
    }

    /// The next event's `data`, `None` at the end of the body.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = String::from_utf8(event).expect("utf-8");
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            let chunk = tokio::time::timeout(LONG, self.answer.chunk())
                .await
                .expect("the stream moves")
                .expect("the stream reads");
            match chunk {
                Some(bytes) => self.buf.extend_from_slice(&bytes),
                None => return None,
            }
        }
    }

    /// The next event with content, its text.
    async fn next_content(&mut self) -> String {
        loop {
            let data = self.next().await.expect("more events");
            let chunk: Value = serde_json::from_str(&data).expect("a JSON chunk");
            if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str()
                && !text.is_empty()
            {
                return text.to_owned();
            }
        }
    }

    /// Every remaining event's data, through the end of the body.
    async fn rest(&mut self) -> Vec<String> {
        let mut all = Vec::new();
        while let Some(data) = self.next().await {
            all.push(data);
        }
        all
    }
}

/// The content of `events` (chat chunks, then `[DONE]`).
fn content(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// What the simulator writes for `n` tokens (its filler words, in order).
fn filler(n: usize) -> String {
    const WORDS: [&str; 10] = [
        " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    ];
    (0..n).map(|i| WORDS[i % WORDS.len()]).collect()
}

fn serve_metric(served: &Served, name: &str, labels: &str) -> f64 {
    let text = served.server.metrics.encode();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(labels)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let give_up = Instant::now() + LONG;
    while !done().await {
        assert!(Instant::now() < give_up, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Streams one answer of `tokens` tokens from `base` and checks it
/// arrived while the simulator still ran it, in order and complete.
async fn streams_while_running(base: &str, sim: &sluicegate::sim::SimHandle, tokens: usize) {
    let http = reqwest::Client::new();
    let mut events = Events::open(
        &format!("{base}/v1/chat/completions"),
        &streamed_chat(tokens as u32),
    )
    .await;
    let first = events.next_content().await;
    assert_eq!(
        pool_in_flight(&http, sim).await,
        1.0,
        "the first piece came while the engine still runs the request"
    );
    let rest = events.rest().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert_eq!(
        format!("{first}{}", content(&rest)),
        filler(tokens),
        "every token, in order, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_streamed_answers_reach_the_client_while_the_engine_runs_in_process() {
    let sim = slow_pool().await;
    let served = start(&ServeSpec::new(&sim.base_url()), None).await;
    streams_while_running(&served.base, &sim, 200).await;
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_streams_total",
            "reason=\"complete\""
        ),
        1.0
    );
    assert_eq!(
        serve_metric(&served, "sluicegate_flex_first_chunk_seconds_count", ""),
        1.0
    );
    until("serve holds nothing", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 0.0
    })
    .await;
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// `serve` with `dispatcher = separate` on the Redis at `port`, and a
/// `sluicegate run` process as its dispatcher (killed on drop).
async fn separate_on_redis(
    port: u16,
    sim: &sluicegate::sim::SimHandle,
) -> (Served, support::cli::Background) {
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.redis_port = Some(port);
    spec.in_process = false;
    let served = start(&spec, None).await;
    let config = served.dir.0.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "transport = \"redis\"\n[redis]\nurl = \"redis://127.0.0.1:{port}/0\"\n[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nmax_staleness = \"1s\"\ncancel_check_interval = \"200ms\"\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"batch-api\"\nmax_sys = 8\ngate_type = \"constant\"\n",
            sim.base_url()
        ),
    )
    .expect("config");
    let run = support::cli::Background::spawn(
        support::cli::sluicegate(&["run", "--config"]).arg(&config),
    );
    (served, run)
}

/// `serve` with `dispatcher = separate` and a `sluicegate run` process as
/// the dispatcher, on Redis: the answer crosses processes through the
/// queue's relay stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_streamed_answers_cross_processes_through_redis() {
    let redis = support::redis::RedisServer::start();
    let sim = slow_pool().await;
    let (served, _run) = separate_on_redis(redis.port, &sim).await;
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}/", redis.port))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let http = reqwest::Client::new();
    let mut events = Events::open(
        &format!("{}/v1/chat/completions", served.base),
        &streamed_chat(200),
    )
    .await;
    let first = events.next_content().await;
    assert_eq!(pool_in_flight(&http, &sim).await, 1.0, "still running");
    let streams: Vec<String> = redis::cmd("KEYS")
        .arg("batch-api:flex-stream:*")
        .query_async(&mut conn)
        .await
        .expect("keys");
    assert_eq!(streams.len(), 1, "the answer came through its relay stream");
    let rest = events.rest().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert_eq!(format!("{first}{}", content(&rest)), filler(200));
    until("the finished stream is deleted", async || {
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("batch-api:flex-stream:*")
            .query_async(&mut conn)
            .await
            .expect("keys");
        left.is_empty()
    })
    .await;
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_a_client_that_leaves_mid_stream_aborts_the_request_at_the_engine() {
    let sim = slow_pool().await;
    let served = start(&ServeSpec::new(&sim.base_url()), None).await;
    let http = reqwest::Client::new();
    let mut events = Events::open(
        &format!("{}/v1/chat/completions", served.base),
        &streamed_chat(1000),
    )
    .await;
    events.next_content().await;
    assert_eq!(pool_in_flight(&http, &sim).await, 1.0);
    assert_eq!(aborted(&http, &sim).await, 0);
    drop(events);
    until("the engine saw the abort", async || {
        aborted(&http, &sim).await == 1
    })
    .await;
    assert_eq!(pool_in_flight(&http, &sim).await, 0.0, "its slot is free");
    until("serve holds nothing", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 0.0
    })
    .await;
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// What the scripted gateway does with its `n`-th request (from 0).
#[derive(Clone, Copy)]
enum Script {
    /// 429 to the first request, then a stream.
    CongestedFirst,
    /// A stream that breaks (the connection closes) after its first
    /// pieces.
    BreakMidStream,
}

/// A gateway that answers by a script and streams its pieces only as
/// the test releases them: 3 pieces, then the rest once released.
struct Scripted {
    url: String,
    requests: Arc<AtomicUsize>,
    release: Arc<tokio::sync::Notify>,
}

fn piece(text: &str) -> String {
    let chunk = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

fn chunked(text: &str) -> String {
    format!("{:x}\r\n{text}\r\n", text.len())
}

impl Scripted {
    async fn start(script: Script) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let requests = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(tokio::sync::Notify::new());
        let (count, go) = (requests.clone(), release.clone());
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (count, go) = (count.clone(), go.clone());
                tokio::spawn(async move {
                    if !read_request(&mut socket).await {
                        return;
                    }
                    let n = count.fetch_add(1, Ordering::SeqCst);
                    if matches!(script, Script::CongestedFirst) && n == 0 {
                        let body = r#"{"error":{"message":"busy"}}"#;
                        let answer = format!(
                            "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = socket.write_all(answer.as_bytes()).await;
                        return;
                    }
                    let released = go.notified();
                    let mut head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_owned();
                    for i in 0..3 {
                        head.push_str(&chunked(&piece(&format!("w{i}"))));
                    }
                    if socket.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    released.await;
                    if matches!(script, Script::BreakMidStream) {
                        // Half a piece, then the connection closes.
                        let _ = socket.write_all(b"40\r\ndata: {\"cho").await;
                        let _ = socket.shutdown().await;
                        return;
                    }
                    let mut tail = String::new();
                    for i in 3..6 {
                        tail.push_str(&chunked(&piece(&format!("w{i}"))));
                    }
                    tail.push_str(&chunked("data: [DONE]\n\n"));
                    tail.push_str("0\r\n\r\n");
                    let _ = socket.write_all(tail.as_bytes()).await;
                    let _ = socket.shutdown().await;
                });
            }
        });
        Self {
            url,
            requests,
            release,
        }
    }
}

/// Reads one request's head and the body its length names.
async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let Ok(n) = socket.read(&mut buf).await else {
            return false;
        };
        if n == 0 {
            return false;
        }
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if seen.len() >= end + 4 + length {
                return true;
            }
        }
    }
}

/// A 429 before any piece: the stream has not begun, the message is
/// retried, and the retry's pieces are the client's stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_a_429_before_the_first_piece_is_retried_and_the_retry_streams() {
    let gateway = Scripted::start(Script::CongestedFirst).await;
    let served = start(&ServeSpec::new(&gateway.url), None).await;
    let mut events = Events::open(
        &format!("{}/v1/chat/completions", served.base),
        &streamed_chat(6),
    )
    .await;
    let mut got = String::new();
    for _ in 0..3 {
        got.push_str(&events.next_content().await);
    }
    // The gateway holds the rest until released: these came mid-stream.
    assert_eq!(got, "w0w1w2");
    assert_eq!(
        gateway.requests.load(Ordering::SeqCst),
        2,
        "the 429, then the retry"
    );
    gateway.release.notify_waiters();
    let rest = events.rest().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert_eq!(content(&rest), "w3w4w5");
    served.stop().await;
}

/// A stream that breaks after pieces reached the client is not retried
/// (a second answer would be spliced after the first's beginning): the
/// client's stream ends with an error event in OpenAI's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_a_stream_that_breaks_after_pieces_ends_with_an_error_event_and_is_not_retried() {
    let gateway = Scripted::start(Script::BreakMidStream).await;
    let served = start(&ServeSpec::new(&gateway.url), None).await;
    let mut events = Events::open(
        &format!("{}/v1/chat/completions", served.base),
        &streamed_chat(6),
    )
    .await;
    let mut got = String::new();
    for _ in 0..3 {
        got.push_str(&events.next_content().await);
    }
    assert_eq!(got, "w0w1w2");
    gateway.release.notify_waiters();
    let rest = events.rest().await;
    let last: Value = serde_json::from_str(rest.last().expect("an error event")).expect("JSON");
    assert_eq!(last["error"]["type"], "server_error", "{rest:?}");
    assert!(last["error"]["message"].is_string(), "{rest:?}");
    assert!(!rest.iter().any(|e| e == "[DONE]"), "{rest:?}");
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_streams_total",
            "reason=\"interrupted\""
        ),
        1.0
    );
    // Settled, not requeued: the queue is empty and the gateway saw one
    // request.
    until("the message is settled", async || {
        let db = rusqlite::Connection::open(served.dir.0.join("queue.db")).expect("queue file");
        let n: i64 = db
            .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
            .expect("count");
        n == 0
    })
    .await;
    assert_eq!(gateway.requests.load(Ordering::SeqCst), 1, "never retried");
    served.stop().await;
}

/// On a Redis Cluster: the relay's streams live in the queue's slot, so
/// `serve`'s one `XREAD` over them all is routed to one node, and a
/// `sluicegate run` dispatcher's answer streams through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_streamed_answers_relay_on_a_redis_cluster() {
    let cluster = support::redis_cluster::RedisCluster::start();
    let sim = slow_pool().await;
    let dir = support::TempDir::new("flex-cluster");
    let text = format!(
        "transport = \"redis\"\n[redis]\nurl = \"{}\"\ncluster = true\n[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nmax_staleness = \"1s\"\n[telemetry]\nlisten = \"127.0.0.1:0\"\n[[queue]]\nqueue_name = \"{{fq}}\"\nresult_queue_name = \"{{fq}}:results\"\nmax_sys = 8\ngate_type = \"constant\"\n",
        cluster.url(),
        sim.base_url()
    );
    let config_file = dir.0.join("run.toml");
    std::fs::write(&config_file, &text).expect("config");
    let _run = support::cli::Background::spawn(
        support::cli::sluicegate(&["run", "--config"]).arg(&config_file),
    );
    let config = sluicegate::config::Config::from_toml_str(&text, &Default::default())
        .expect("config loads");
    let serve = sluicegate::config::ServeConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        data_dir: dir.0.join("data"),
        dispatcher: sluicegate::config::ServeDispatcher::Separate,
        ..sluicegate::config::ServeConfig::default()
    };
    let server = sluicegate::serve::start(&config, &serve, std::future::pending())
        .await
        .expect("serve starts on the cluster");
    let http = reqwest::Client::new();
    let mut events = Events::open(
        &format!("http://{}/v1/chat/completions", server.addr),
        &streamed_chat(200),
    )
    .await;
    let first = events.next_content().await;
    assert_eq!(pool_in_flight(&http, &sim).await, 1.0, "still running");
    assert_eq!(
        cluster.keys("{fq}:flex-stream:*").len(),
        1,
        "the answer came through its relay stream, in the queue's slot"
    );
    let rest = events.rest().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert_eq!(format!("{first}{}", content(&rest)), filler(200));
    server.shutdown();
    server.wait().await.expect("serve stops");
    sim.shutdown().await.expect("simulator stops");
}

/// Across processes, a client that leaves mid-stream cancels its message
/// through the queue, and the `run` dispatcher's cancel watcher aborts
/// the request at the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_a_client_that_leaves_mid_stream_aborts_at_the_engine_across_processes() {
    let redis = support::redis::RedisServer::start();
    let sim = slow_pool().await;
    let (served, _run) = separate_on_redis(redis.port, &sim).await;
    let http = reqwest::Client::new();
    let mut events = Events::open(
        &format!("{}/v1/chat/completions", served.base),
        &streamed_chat(1000),
    )
    .await;
    events.next_content().await;
    assert_eq!(pool_in_flight(&http, &sim).await, 1.0);
    drop(events);
    until("the engine saw the abort", async || {
        aborted(&http, &sim).await == 1
    })
    .await;
    assert_eq!(pool_in_flight(&http, &sim).await, 0.0, "its slot is free");
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// `serve` on Redis with its dispatcher in process: the answer goes
/// through the in-process channel (the holder is local), and streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_streamed_answers_stream_in_process_on_redis() {
    let redis = support::redis::RedisServer::start();
    let sim = slow_pool().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.redis_port = Some(redis.port);
    let served = start(&spec, None).await;
    streams_while_running(&served.base, &sim, 200).await;
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_streams_total",
            "reason=\"complete\""
        ),
        1.0
    );
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}
