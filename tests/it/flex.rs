//! Issue 37: flex requests (`service_tier: "flex"`) and background
//! responses through `serve`, against our simulator as the pool. The
//! gate is an endpoint-scrape gate reading a `/metrics` page this suite
//! serves ([`Gate`]), so a test opens and closes it while a request is
//! held.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support;
use crate::support::gate::Gate;
use crate::support::serve::{ServeSpec, Served, start};
use crate::support::sim::{metric_sum, small_pool};

/// Generous bound on anything that should happen soon on a loaded machine.
const LONG: Duration = Duration::from_secs(60);

/// A JSON POST with `key` as bearer; status, `Retry-After` and body.
async fn post(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: Value,
) -> (u16, Option<String>, Value) {
    let mut request = client.post(url).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let answer = request.send().await.expect("serve answers");
    let status = answer.status().as_u16();
    let retry = (answer.headers().get("retry-after"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = answer.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, retry, body)
}

async fn get(client: &reqwest::Client, url: &str, key: Option<&str>) -> (u16, Value) {
    let mut request = client.get(url);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let answer = request.send().await.expect("serve answers");
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

fn chat(tier: &str) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "service_tier": tier})
}

/// The value of a metric series of serve (`name` with `labels` inside the
/// braces, or bare), 0 when absent.
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

/// Waits until `done` holds, polling; panics after [`LONG`].
async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let give_up = Instant::now() + LONG;
    while !done().await {
        assert!(Instant::now() < give_up, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Messages in the embedded queue file of a served instance.
fn queued(served: &Served) -> i64 {
    let db = rusqlite::Connection::open(served.dir.0.join("queue.db")).expect("queue file");
    db.query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
        .expect("count")
}

async fn completions_at(sim: &sluicegate::sim::SimHandle) -> f64 {
    metric_sum(
        &reqwest::Client::new(),
        &sim.base_url(),
        &["vllm:request_success_total"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flex_request_waits_while_the_gate_is_closed_and_completes_when_it_opens() {
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.gate_url = Some(gate.url.clone());
    let served = start(&spec, None).await;
    let url = format!("{}/v1/chat/completions", served.base);
    let held =
        tokio::spawn(async move { post(&reqwest::Client::new(), &url, None, chat("flex")).await });
    until("the flex request is held", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 1.0 && queued(&served) == 1
    })
    .await;
    // Several gate readings later it is still waiting, unsent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!held.is_finished(), "answered while the gate was closed");
    assert_eq!(completions_at(&sim).await, 0.0, "nothing reached the pool");
    assert_eq!(queued(&served), 1);
    gate.set_open(true);
    let (status, _, body) = tokio::time::timeout(LONG, held)
        .await
        .expect("answered once the gate opened")
        .expect("task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["service_tier"], "flex", "{body}");
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert_eq!(completions_at(&sim).await, 1.0);
    assert_eq!(serve_metric(&served, "sluicegate_flex_waiting", ""), 0.0);
    assert_eq!(
        serve_metric(&served, "sluicegate_flex_dispatch_seconds_count", ""),
        1.0,
        "its time to dispatch was observed"
    );
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flex_request_not_started_within_max_wait_gets_429_and_leaves_the_queue() {
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new("http://127.0.0.1:9");
    spec.gate_url = Some(gate.url.clone());
    spec.flex_max_wait = Some(Duration::from_secs(1));
    let served = start(&spec, None).await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    let (status, retry, body) = post(
        &client,
        &format!("{}/v1/responses", served.base),
        None,
        json!({"model": "m", "input": "hi", "service_tier": "flex"}),
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "not before max_wait"
    );
    assert_eq!(body["error"]["code"], "resource_unavailable", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("serve.flex_max_wait")),
        "{body}"
    );
    let retry: u64 = retry.expect("Retry-After").parse().expect("seconds");
    // No flex request was ever taken: the gate is shut; the longest
    // suggestion, cut to max_wait (a next attempt waits that long itself).
    assert_eq!(retry, 1);
    assert_eq!(queued(&served), 0, "withdrawn from the queue");
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_refusals_total",
            "reason=\"max_wait\""
        ),
        1.0
    );
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_while_waiting_leaves_the_queue() {
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.gate_url = Some(gate.url.clone());
    let served = start(&spec, None).await;
    let url = format!("{}/v1/chat/completions", served.base);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("client");
    let gave_up = impatient.post(&url).json(&chat("flex")).send().await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()), "the client gave up");
    until("the abandoned request left the queue", async || {
        queued(&served) == 0 && serve_metric(&served, "sluicegate_flex_waiting", "") == 0.0
    })
    .await;
    // With the gate open, only a later request reaches the pool.
    gate.set_open(true);
    let (status, _, body) = post(&reqwest::Client::new(), &url, None, chat("flex")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        completions_at(&sim).await,
        1.0,
        "the abandoned one was never sent"
    );
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_flex_input_gets_a_typed_400_and_non_flex_requests_are_refused() {
    let served = start(&ServeSpec::new("http://127.0.0.1:9"), None).await;
    let client = reqwest::Client::new();
    let base = &served.base;
    let cases = [
        ("/v1/chat/completions", chat("cheap"), "service_tier"),
        (
            "/v1/responses",
            json!({"model": "m", "input": "x", "background": true, "stream": true}),
            "stream",
        ),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "x", "background": true}),
            "background",
        ),
        ("/v1/chat/completions", chat("default"), "service_tier"),
        (
            "/v1/responses",
            json!({"model": "m", "input": "x"}),
            "service_tier",
        ),
    ];
    for (path, body, param) in cases {
        let (status, _, answer) = post(&client, &format!("{base}{path}"), None, body.clone()).await;
        assert_eq!(status, 400, "{path} {body}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{path} {body}: {answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
    }
    let (_, _, refused) = post(
        &client,
        &format!("{base}/v1/chat/completions"),
        None,
        chat("auto"),
    )
    .await;
    assert_eq!(refused["error"]["code"], "flex_required", "{refused}");
    assert_eq!(queued(&served), 0, "nothing refused was enqueued");
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_sends_interactive_requests_outside_the_window() {
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.gate_url = Some(gate.url.clone());
    spec.passthrough = true;
    let served = start(&spec, None).await;
    // The gate stays shut: only a request outside the window can pass.
    let (status, _, body) = post(
        &reqwest::Client::new(),
        &format!("{}/v1/chat/completions", served.base),
        None,
        chat("auto"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert!(
        body.get("service_tier").is_none_or(|t| t != "flex"),
        "{body}"
    );
    assert_eq!(queued(&served), 0, "not queued");
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_and_background_bounds_answer_429() {
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new("http://127.0.0.1:9");
    spec.gate_url = Some(gate.url.clone());
    spec.keys = Some("alice:ka,bob:kb,carol:kc".into());
    spec.flex_max_held_per_tenant = Some(1);
    spec.flex_max_held = Some(2);
    spec.background_max_per_tenant = Some(1);
    let served = start(&spec, None).await;
    let url = format!("{}/v1/chat/completions", served.base);
    let hold = |key: &'static str| {
        let url = url.clone();
        tokio::spawn(
            async move { post(&reqwest::Client::new(), &url, Some(key), chat("flex")).await },
        )
    };
    let first = hold("ka");
    until("alice's request is held", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 1.0
    })
    .await;
    let client = reqwest::Client::new();
    let (status, retry, body) = post(&client, &url, Some("ka"), chat("flex")).await;
    assert_eq!(status, 429, "{body}");
    assert!(retry.is_some(), "a Retry-After");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("serve.flex_max_held_per_tenant")),
        "{body}"
    );
    let second = hold("kb");
    until("bob's request is held", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 2.0
    })
    .await;
    // Carol holds nothing, but the total is reached.
    let (status, _, body) = post(&client, &url, Some("kc"), chat("flex")).await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("serve.flex_max_held ")),
        "{body}"
    );
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_refusals_total",
            "reason=\"held_tenant\""
        ),
        1.0
    );
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_refusals_total",
            "reason=\"held_total\""
        ),
        1.0
    );
    first.abort();
    second.abort();
    let responses = format!("{}/v1/responses", served.base);
    let background = json!({"model": "m", "input": "hi", "background": true});
    let (status, _, body) = post(&client, &responses, Some("ka"), background.clone()).await;
    assert_eq!(
        (status, body["status"].clone()),
        (200, json!("queued")),
        "{body}"
    );
    let (status, _, body) = post(&client, &responses, Some("ka"), background.clone()).await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("serve.background_max_per_tenant")),
        "{body}"
    );
    let (status, _, body) = post(&client, &responses, Some("kb"), background).await;
    assert_eq!(status, 200, "another tenant has its own bound: {body}");
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_complete_cancel_delete_and_stay_with_their_tenant() {
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.gate_url = Some(gate.url.clone());
    spec.keys = Some("alice:ka,bob:kb".into());
    let served = start(&spec, None).await;
    let client = reqwest::Client::new();
    let responses = format!("{}/v1/responses", served.base);
    let create = async |body: Value| {
        let path = match body.get("messages") {
            Some(_) => format!("{}/v1/chat/completions", served.base),
            None => responses.clone(),
        };
        let (status, _, r) = post(&client, &path, Some("ka"), body).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["status"], "queued", "{r}");
        assert_eq!(r["background"], true, "{r}");
        r["id"].as_str().expect("id").to_owned()
    };
    let done_id = create(json!({"model": "m", "input": "hi", "max_output_tokens": 8, "background": true, "service_tier": "flex"})).await;
    let chat_id = create(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "background": true})).await;
    let at = |id: &str| format!("{responses}/{id}");
    // Another tenant's id is not found, exactly like a missing one.
    let (status, body) = get(&client, &at(&done_id), Some("kb")).await;
    assert_eq!(status, 404, "{body}");
    let (status, _, _) = post(
        &client,
        &format!("{}/cancel", at(&done_id)),
        Some("kb"),
        json!({}),
    )
    .await;
    assert_eq!(status, 404);
    let missing = client
        .delete(at(&done_id))
        .bearer_auth("kb")
        .send()
        .await
        .expect("answer");
    assert_eq!(missing.status().as_u16(), 404);
    let (status, body) = get(&client, &at(&done_id), Some("ka")).await;
    assert_eq!(
        (status, body["status"].clone()),
        (200, json!("queued")),
        "{body}"
    );
    gate.set_open(true);
    // The simulator writes up to `max_output_tokens`, so a Response ends
    // `incomplete` (OpenAI's status for that); a chat completion has no
    // such status and ends `completed`.
    for (id, end) in [(&done_id, "incomplete"), (&chat_id, "completed")] {
        until("the response ends", async || {
            get(&client, &at(id), Some("ka")).await.1["status"] == end
        })
        .await;
    }
    let (_, done) = get(&client, &at(&done_id), Some("ka")).await;
    assert_eq!(done["id"], done_id.as_str());
    assert_eq!(done["service_tier"], "flex", "{done}");
    assert!(
        done["output"].as_array().is_some_and(|o| !o.is_empty()),
        "{done}"
    );
    let (_, chat_done) = get(&client, &at(&chat_id), Some("ka")).await;
    assert_eq!(
        chat_done["chat_completion"]["object"], "chat.completion",
        "{chat_done}"
    );
    // Cancelling a finished response changes nothing.
    let (status, _, same) = post(
        &client,
        &format!("{}/cancel", at(&done_id)),
        Some("ka"),
        json!({}),
    )
    .await;
    assert_eq!((status, same["status"].clone()), (200, json!("incomplete")));
    // A waiting one is cancelled and leaves the queue.
    gate.set_open(false);
    // Give the gate a reading of the closed page before enqueuing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = completions_at(&sim).await;
    let waiting =
        create(json!({"model": "m", "input": "later", "max_output_tokens": 8, "background": true}))
            .await;
    let (status, _, cancelled) = post(
        &client,
        &format!("{}/cancel", at(&waiting)),
        Some("ka"),
        json!({}),
    )
    .await;
    assert_eq!(
        (status, cancelled["status"].clone()),
        (200, json!("cancelled")),
        "{cancelled}"
    );
    until("the cancelled response left the queue", async || {
        queued(&served) == 0
    })
    .await;
    let (_, still) = get(&client, &at(&waiting), Some("ka")).await;
    assert_eq!(still["status"], "cancelled", "{still}");
    let deleted = client
        .delete(at(&waiting))
        .bearer_auth("ka")
        .send()
        .await
        .expect("answer");
    assert_eq!(deleted.status().as_u16(), 200);
    let deleted: Value = deleted.json().await.expect("json");
    assert_eq!(deleted["deleted"], true);
    assert_eq!(get(&client, &at(&waiting), Some("ka")).await.0, 404);
    gate.set_open(true);
    let (status, _, _) = post(
        &client,
        &format!("{}/v1/chat/completions", served.base),
        Some("ka"),
        chat("flex"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        completions_at(&sim).await,
        before + 1.0,
        "the cancelled one was never sent"
    );
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_background_responses_total",
            "status=\"completed\""
        ),
        1.0
    );
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_background_responses_total",
            "status=\"incomplete\""
        ),
        1.0
    );
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_background_responses_total",
            "status=\"cancelled\""
        ),
        1.0
    );
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `sluicegate serve` as a child process on `config` (a file).
fn serve_child(config: &std::path::Path, data: &std::path::Path) -> std::process::Child {
    support::cli::sluicegate(&["serve", "--config"])
        .arg(config)
        .arg("--data-dir")
        .arg(data)
        .stdout(std::process::Stdio::null())
        .stderr(
            std::fs::File::create(data.with_extension(format!("{}.log", rand_suffix())))
                .expect("log"),
        )
        .spawn()
        .expect("serve starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_survive_kill_9_and_are_answered_once() {
    const N: usize = 4;
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let dir = support::TempDir::new("flex-kill");
    let (api_port, telemetry_port) = (support::free_port(), support::free_port());
    let config = dir.0.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "transport = \"embedded\"\n[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\nreceive_wait = \"100ms\"\nmax_staleness = \"1s\"\nlease = \"2s\"\n[telemetry]\nlisten = \"127.0.0.1:{telemetry_port}\"\n[[queue]]\nqueue_name = \"q\"\ngate_type = \"endpoint-scrape\"\n[queue.gate_params]\nurl = \"{}\"\nmetric = \"m\"\nmax_count_per_pod = 4\n[serve]\nlisten = \"127.0.0.1:{api_port}\"\napi_keys = \"alice:ka\"\n",
            sim.base_url(),
            gate.url
        ),
    )
    .expect("config");
    let data = dir.0.join("data");
    let base = format!("http://127.0.0.1:{api_port}");
    let client = reqwest::Client::new();
    let answering = async || {
        until("serve answers", async || {
            client
                .get(format!("{base}/v1/responses/resp_x"))
                .bearer_auth("ka")
                .send()
                .await
                .is_ok()
        })
        .await;
    };
    let mut first = serve_child(&config, &data);
    answering().await;
    let mut ids = Vec::new();
    for i in 0..N {
        let (status, _, r) = post(
            &client,
            &format!("{base}/v1/responses"),
            Some("ka"),
            json!({"model": "m", "input": format!("question {i}"), "max_output_tokens": 8, "background": true}),
        )
        .await;
        assert_eq!((status, r["status"].clone()), (200, json!("queued")), "{r}");
        ids.push(r["id"].as_str().expect("id").to_owned());
    }
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    gate.set_open(true);
    let mut second = serve_child(&config, &data);
    answering().await;
    for id in &ids {
        until("the response ends after the restart", async || {
            let (_, r) = get(&client, &format!("{base}/v1/responses/{id}"), Some("ka")).await;
            r["status"] == "incomplete" && r["output"][0]["type"] == "message"
        })
        .await;
    }
    // Each was sent once: the pool answered exactly N.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(completions_at(&sim).await, N as f64);
    second.kill().expect("stop serve");
    second.wait().expect("reaped");
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_flex_answers_arrive_in_order_and_complete() {
    let sim = small_pool().await;
    let served = start(&ServeSpec::new(&sim.base_url()), None).await;
    let mut body = chat("flex");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(12);
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", served.base))
        .json(&body)
        .send()
        .await
        .expect("answer");
    assert_eq!(answer.status().as_u16(), 200);
    let kind = answer.headers()["content-type"]
        .to_str()
        .expect("text")
        .to_owned();
    assert!(kind.starts_with("text/event-stream"), "{kind}");
    let text = answer.text().await.expect("body");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty(), "{text}");
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"].is_string()),
        "it completes: {text}"
    );
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_while_running_aborts_at_the_engine() {
    let mut cfg = sluicegate::sim::SimConfig {
        pool_name: "p".into(),
        ..sluicegate::sim::SimConfig::default()
    };
    cfg.http.max_output_tokens = 1500;
    let sim = sluicegate::sim::spawn_http(cfg)
        .await
        .expect("simulator starts");
    let served = start(&ServeSpec::new(&sim.base_url()), None).await;
    let url = format!("{}/v1/completions", served.base);
    let long =
        json!({"model": "m", "prompt": "Write on.", "max_tokens": 1500, "service_tier": "flex"});
    let client = tokio::spawn(async move { post(&reqwest::Client::new(), &url, None, long).await });
    let http = reqwest::Client::new();
    until("the generation runs at the engine", async || {
        crate::support::sim::pool_in_flight(&http, &sim).await == 1.0
    })
    .await;
    assert_eq!(crate::support::sim::aborted(&http, &sim).await, 0);
    // The client goes away: its connection to serve closes.
    client.abort();
    until("the engine saw the abort", async || {
        crate::support::sim::aborted(&http, &sim).await == 1
    })
    .await;
    assert_eq!(
        crate::support::sim::pool_in_flight(&http, &sim).await,
        0.0,
        "its slot is free"
    );
    assert_eq!(completions_at(&sim).await, 0.0, "it never finished");
    until("serve holds nothing", async || {
        serve_metric(&served, "sluicegate_flex_waiting", "") == 0.0 && queued(&served) == 0
    })
    .await;
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// The Redis transport and store: background records live in Redis, a
/// flex request answers on its connection, and one still waiting at
/// `flex_max_wait` is withdrawn from pending and answered 429, never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_and_background_responses_on_the_redis_transport() {
    let redis = crate::support::redis::RedisServer::start();
    let sim = small_pool().await;
    let gate = Gate::closed().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.redis_port = Some(redis.port);
    spec.gate_url = Some(gate.url.clone());
    spec.keys = Some("alice:ka,bob:kb".into());
    spec.flex_max_wait = Some(Duration::from_secs(1));
    let served = start(&spec, None).await;
    let client = reqwest::Client::new();
    let responses = format!("{}/v1/responses", served.base);
    let (status, _, created) = post(
        &client,
        &responses,
        Some("ka"),
        json!({"model": "m", "input": "hi", "max_output_tokens": 8, "background": true}),
    )
    .await;
    assert_eq!(
        (status, created["status"].clone()),
        (200, json!("queued")),
        "{created}"
    );
    let id = created["id"].as_str().expect("id").to_owned();
    assert_eq!(
        get(&client, &format!("{responses}/{id}"), Some("kb"))
            .await
            .0,
        404
    );
    let chat_url = format!("{}/v1/chat/completions", served.base);
    let (status, _, body) = post(&client, &chat_url, Some("ka"), chat("flex")).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_flex_refusals_total",
            "reason=\"max_wait\""
        ),
        1.0
    );
    // Only the background response is pending: the flex one was withdrawn.
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}/", redis.port))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let pending: i64 = redis::cmd("ZCARD")
        .arg("batch-api")
        .query_async(&mut conn)
        .await
        .expect("zcard");
    assert_eq!(pending, 1);
    gate.set_open(true);
    until("the background response ends", async || {
        get(&client, &format!("{responses}/{id}"), Some("ka"))
            .await
            .1["status"]
            == "incomplete"
    })
    .await;
    let (status, _, body) = post(&client, &chat_url, Some("ka"), chat("flex")).await;
    assert_eq!(
        (status, body["service_tier"].clone()),
        (200, json!("flex")),
        "{body}"
    );
    // The background response and the second flex request; the refused
    // one was never sent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(completions_at(&sim).await, 2.0);
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// A server killed between storing a background response and enqueuing
/// it left a record with no message: the next server enqueues it (once
/// it is older than a creation could still be running) and it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_background_response_never_enqueued_is_enqueued_by_the_server() {
    use sluicegate::serve::background::{ResponseRecord, ResponseStatus};
    use sluicegate::serve::store::{SqliteStore, Store};
    let sim = small_pool().await;
    let served = start(&ServeSpec::new(&sim.base_url()), None).await;
    let store = Store::Sqlite(
        SqliteStore::open(&served.dir.0.join("data").join("batches.db")).expect("store"),
    );
    let orphan = ResponseRecord {
        id: "resp_orphan".into(),
        tenant: "default".into(),
        endpoint: "/v1/responses".into(),
        model: Some("m".into()),
        status: ResponseStatus::Queued,
        flex: false,
        created_at: sluicegate::clock::unix_secs() - 60,
        request: Some(json!({"model": "m", "input": "hi", "max_output_tokens": 8})),
        enqueued: false,
        output: None,
        error: None,
        finished_at: None,
        expires_at: None,
    };
    store.insert_response(&orphan).await.expect("insert");
    let client = reqwest::Client::new();
    let url = format!("{}/v1/responses/resp_orphan", served.base);
    until("the orphan ends", async || {
        get(&client, &url, None).await.1["status"] == "incomplete"
    })
    .await;
    let stored = store
        .response("resp_orphan")
        .await
        .expect("read")
        .expect("kept");
    assert!(stored.enqueued && stored.request.is_none(), "{stored:?}");
    assert_eq!(completions_at(&sim).await, 1.0, "sent once");
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// Two replicas on one Redis share the result list: a flex result one
/// collects for a connection the other holds is parked in the store and
/// answered by the holder, so every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flex_answers_reach_their_connection_across_redis_replicas() {
    const N: usize = 12;
    let redis = crate::support::redis::RedisServer::start();
    let sim = small_pool().await;
    let shared = support::TempDir::new("flex-replicas");
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.redis_port = Some(redis.port);
    let a = start(&spec, Some(&shared.0)).await;
    spec.in_process = false;
    let b = start(&spec, Some(&shared.0)).await;
    let sent: Vec<_> = (0..N)
        .map(|i| {
            let base = if i % 2 == 0 {
                a.base.clone()
            } else {
                b.base.clone()
            };
            tokio::spawn(async move {
                let url = format!("{base}/v1/chat/completions");
                post(&reqwest::Client::new(), &url, None, chat("flex")).await
            })
        })
        .collect();
    for task in sent {
        let (status, _, body) = tokio::time::timeout(LONG, task)
            .await
            .expect("answered")
            .expect("task");
        assert_eq!(
            (status, body["service_tier"].clone()),
            (200, json!("flex")),
            "{body}"
        );
    }
    assert_eq!(completions_at(&sim).await, N as f64);
    a.stop().await;
    b.stop().await;
    sim.shutdown().await.expect("simulator stops");
}

/// A background response a dispatcher has taken reads `in_progress`
/// until its answer comes (a gateway that holds its requests until
/// released).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_reads_in_progress_while_it_runs() {
    let mut gateway = crate::support::serve::HeldGateway::start().await;
    let served = start(&ServeSpec::new(&gateway.url), None).await;
    let client = reqwest::Client::new();
    let (status, _, created) = post(
        &client,
        &format!("{}/v1/responses", served.base),
        None,
        json!({"model": "m", "input": "hi", "background": true}),
    )
    .await;
    assert_eq!(
        (status, created["status"].clone()),
        (200, json!("queued")),
        "{created}"
    );
    let url = format!(
        "{}/v1/responses/{}",
        served.base,
        created["id"].as_str().expect("id")
    );
    tokio::time::timeout(LONG, gateway.arrived.recv())
        .await
        .expect("the request reached the gateway");
    let (_, running) = get(&client, &url, None).await;
    assert_eq!(running["status"], "in_progress", "{running}");
    gateway.release.notify_waiters();
    until("it completes", async || {
        get(&client, &url, None).await.1["status"] == "completed"
    })
    .await;
    assert_eq!(
        serve_metric(
            &served,
            "sluicegate_background_responses_total",
            "status=\"in_progress\""
        ),
        1.0
    );
    served.stop().await;
}
