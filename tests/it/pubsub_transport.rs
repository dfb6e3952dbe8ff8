//! The Pub/Sub transport against the official emulator (one per test,
//! started on a free port and killed by process group): round trip through
//! the simulator, a gate that closes and reopens mid-drain without a pull
//! restart, `INVALID_REQUEST` for unparsable messages (under their message
//! ids), dead letters (a last delivery's and the dispatcher's), SIGKILL of
//! the dispatcher mid-drain, an emulator restart mid-drain, and a 429/503
//! storm with messages published by Google's Python client.

use crate::support;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::pubsub::{Emulator, Names, collect, create, publish, results_by_id};
use serde_json::json;
use sluicegate::clock::unix_secs;
use sluicegate::config::Config;
use sluicegate::result::ErrorCode;
use sluicegate::sim::{SimConfig, SimHandle, spawn_http};

fn request(id: &str) -> String {
    json!({
        "id": id,
        "deadline": unix_secs() + 3600,
        "payload": {"model": "sim-model", "prompt": "Summarise.", "max_tokens": 4}
    })
    .to_string()
}

fn requests(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| request(&format!("{prefix}-{i}"))).collect()
}

async fn fast_sim() -> SimHandle {
    spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator")
}

/// A dispatcher config on `names.subscription`, gated by `gate`.
fn config_toml(
    emulator: &Emulator,
    names: &Names,
    gateway: &str,
    extra_dispatch: &str,
    gate: &str,
) -> String {
    format!(
        r#"
transport = "pubsub"
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "100ms"
receive_wait = "200ms"
retry_initial_backoff = "100ms"
retry_max_backoff = "200ms"
lease = "10s"
{extra_dispatch}
[telemetry]
listen = "127.0.0.1:0"
{pubsub}
[[queue]]
subscriber_id = "{sub}"
max_sys = 32
{gate}
"#,
        pubsub = emulator.toml(&names.results),
        sub = names.subscription,
    )
}

/// A dispatcher with the constant gate (always open).
async fn start_constant(
    emulator: &Emulator,
    names: &Names,
    gateway: &str,
    extra_dispatch: &str,
) -> support::App {
    start(&config_toml(
        emulator,
        names,
        gateway,
        extra_dispatch,
        r#"gate_type = "constant""#,
    ))
    .await
}

/// What reached the dead-letter topic's subscription, once something did.
async fn dead_letters(
    client: &gcloud_pubsub::client::Client,
    names: &Names,
    within: Duration,
) -> Vec<(Vec<u8>, HashMap<String, String>)> {
    collect(client, &format!("{}-sub", names.dead), within, |got| {
        !got.is_empty()
    })
    .await
}

async fn start(toml: &str) -> support::App {
    let config = Config::from_toml_str(toml, &Default::default()).expect("valid config");
    support::start_app(&config).await
}

/// The value of `name{queue="<queue>"}` in the app's metrics.
fn metric(app: &support::App, name: &str, queue: &str) -> f64 {
    let text = app.running.metrics.encode();
    let prefix = format!("{name}{{queue=\"{queue}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("{prefix} missing from:\n{text}"))
        .trim()
        .parse()
        .expect("a number")
}

/// Collects results until every id in `ids` has one.
async fn results_for(
    client: &gcloud_pubsub::client::Client,
    names: &Names,
    ids: &BTreeSet<String>,
    within: Duration,
) -> HashMap<String, Vec<sluicegate::result::ResultRecord>> {
    let messages = collect(client, &names.result_sub, within, |got| {
        let seen: BTreeSet<String> = results_by_id(got).into_keys().collect();
        ids.is_subset(&seen)
    })
    .await;
    results_by_id(&messages)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_through_the_simulator_publishes_one_result_per_request() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("rt");
    create(&client, &names, 5).await;
    let sim = fast_sim().await;
    let app = start_constant(&emulator, &names, &sim.base_url(), "").await;

    let mut bodies = requests("rt", 20);
    // Routed: the result carries `result_route` from the metadata, and a
    // message attribute merges into the metadata.
    bodies.push(
        json!({"id": "routed", "deadline": unix_secs() + 3600, "metadata": {"result_route": "blue"},
               "payload": {"model": "sim-model", "prompt": "x", "max_tokens": 4}})
        .to_string(),
    );
    publish(&client, &names.topic, &bodies).await;
    let ids: BTreeSet<String> = (0..20)
        .map(|i| format!("rt-{i}"))
        .chain(["routed".to_owned()])
        .collect();
    let messages = collect(&client, &names.result_sub, Duration::from_secs(60), |got| {
        got.len() >= ids.len()
    })
    .await;
    let by_id = results_by_id(&messages);
    assert_eq!(by_id.keys().cloned().collect::<BTreeSet<_>>(), ids);
    for (id, results) in &by_id {
        assert_eq!(results.len(), 1, "{id}: {results:?}");
        assert_eq!(results[0].status_code, Some(200), "{id}: {results:?}");
    }
    let routed = messages
        .iter()
        .find(|(_, a)| a.get("id").map(String::as_str) == Some("routed"))
        .expect("routed result");
    assert_eq!(
        routed.1.get("result_route").map(String::as_str),
        Some("blue")
    );
    assert_eq!(
        metric(&app, "sluicegate_pubsub_acks_total", &names.subscription),
        21.0
    );
    assert_eq!(
        metric(
            &app,
            "sluicegate_pubsub_in_flight_messages",
            &names.subscription
        ),
        0.0
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_messages_get_invalid_request_then_the_ack() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("bad");
    create(&client, &names, 5).await;
    let sim = fast_sim().await;
    let app = start_constant(&emulator, &names, &sim.base_url(), "").await;
    publish(
        &client,
        &names.topic,
        &[
            "not json at all".to_owned(),
            json!({"id": "no-deadline", "payload": {}}).to_string(),
        ],
    )
    .await;
    let messages = collect(&client, &names.result_sub, Duration::from_secs(60), |got| {
        got.len() >= 2
    })
    .await;
    let by_id = results_by_id(&messages);
    assert_eq!(by_id.len(), 2, "{by_id:?}");
    for results in by_id.values() {
        assert_eq!(results.len(), 1);
        assert_eq!(
            results[0].error_code,
            Some(ErrorCode::InvalidRequest),
            "{results:?}"
        );
    }
    assert!(by_id.contains_key("no-deadline"), "{by_id:?}");
    app.stop().await;
    // Acked, not dropped or nacked: nothing comes back on the subscription.
    let left = collect(
        &client,
        &names.subscription,
        Duration::from_secs(3),
        |got| !got.is_empty(),
    )
    .await;
    assert!(left.is_empty(), "still on the subscription: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_closing_and_reopening_mid_drain_never_restarts_the_pull() {
    let emulator = Emulator::start();
    let redis = support::redis::RedisServer::start();
    redis.cli(&["SET", "dispatch-gate-budget", "1"]);
    let client = emulator.client().await;
    let names = Names::new("gate");
    create(&client, &names, 5).await;
    let sim = fast_sim().await;
    let gate = format!(
        "gate_type = \"redis\"\ngate_params = {{address = \"127.0.0.1:{}\"}}",
        redis.port
    );
    let app = start(&config_toml(&emulator, &names, &sim.base_url(), "", &gate)).await;
    let n = 1000;
    publish(&client, &names.topic, &requests("g", n)).await;
    let ids: BTreeSet<String> = (0..n).map(|i| format!("g-{i}")).collect();

    // Let about a third through, then close the gate.
    let mut messages = collect(
        &client,
        &names.result_sub,
        Duration::from_secs(120),
        |got| got.len() >= n / 3,
    )
    .await;
    redis.cli(&["SET", "dispatch-gate-budget", "0"]);
    // Closed: what was in flight finishes, then nothing more is sent.
    tokio::time::sleep(Duration::from_secs(2)).await;
    messages.extend(
        collect(&client, &names.result_sub, Duration::from_secs(1), |_| {
            false
        })
        .await,
    );
    let at_close = messages.len();
    messages.extend(
        collect(&client, &names.result_sub, Duration::from_secs(2), |_| {
            false
        })
        .await,
    );
    assert_eq!(
        messages.len(),
        at_close,
        "results kept coming with the gate closed"
    );
    assert!(at_close < n, "the drain ended before the gate closed");
    // Reopen through several budget changes.
    for budget in ["0.2", "0.6", "1"] {
        redis.cli(&["SET", "dispatch-gate-budget", budget]);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    messages.extend(
        collect(
            &client,
            &names.result_sub,
            Duration::from_secs(180),
            |got| got.len() + at_close >= n,
        )
        .await,
    );
    let by_id = results_by_id(&messages);
    assert_eq!(by_id.keys().cloned().collect::<BTreeSet<_>>(), ids);
    assert!(by_id.values().all(|r| r.len() == 1), "a duplicate result");
    assert_eq!(
        metric(
            &app,
            "sluicegate_pubsub_pull_stream_restarts_total",
            &names.subscription
        ),
        0.0
    );
    app.stop().await;
}

/// A message whose attempts keep failing reaches the subscription's
/// `max_delivery_attempts`: its last delivery is answered (an
/// `INFERENCE_ERROR` result) and dead-lettered by the dispatcher, before
/// the broker would dead-letter it without a result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_on_its_last_delivery_gets_a_result_and_lands_in_the_dead_letter_topic() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("dlq");
    create(&client, &names, 5).await;
    // Nothing listens there: every attempt is a retryable transport error,
    // handed back after the backoff, and the broker counts the deliveries.
    // A refused connection is also a congestion signal: its hold (2 s
    // doubling by default, 30 s over the four hand-backs) is 250 ms
    // doubling to 500 ms here.
    let (_refusing, port) = support::refused_port();
    let closed = format!("http://127.0.0.1:{port}");
    let app = start_constant(
        &emulator,
        &names,
        &closed,
        "congestion_backoff = \"250ms\"\ncongestion_max_backoff = \"500ms\"",
    )
    .await;
    publish(&client, &names.topic, &[request("doomed")]).await;
    let ids = BTreeSet::from(["doomed".to_owned()]);
    let by_id = results_for(&client, &names, &ids, Duration::from_secs(90)).await;
    let result = by_id
        .get("doomed")
        .expect("a result before the dead letter");
    assert_eq!(result.len(), 1, "{result:?}");
    assert_eq!(
        result[0].error_code,
        Some(ErrorCode::InferenceError),
        "{result:?}"
    );
    let dead = dead_letters(&client, &names, Duration::from_secs(30)).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let body: serde_json::Value = serde_json::from_slice(&dead[0].0).expect("the request");
    assert_eq!(body["id"], "doomed");
    // The dispatcher's copy (the broker's carries no such attribute).
    assert_eq!(
        dead[0].1.get("sluicegate_queue"),
        Some(&names.subscription),
        "{dead:?}"
    );
    let text = app.running.metrics.encode();
    let nacks = metric(&app, "sluicegate_pubsub_nacks_total", &names.subscription);
    assert_eq!(
        nacks, 4.0,
        "deliveries 1-4 went back, the 5th was answered: {text}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatchers_own_dead_letter_publishes_a_result_and_the_message() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("own");
    // The broker's limit is out of reach: the dispatcher's comes first.
    create(&client, &names, 100).await;
    let (_refusing, port) = support::refused_port();
    let closed = format!("http://127.0.0.1:{port}");
    let app = start_constant(&emulator, &names, &closed, "max_attempts = 2").await;
    publish(&client, &names.topic, &[request("given-up")]).await;
    let ids = BTreeSet::from(["given-up".to_owned()]);
    let by_id = results_for(&client, &names, &ids, Duration::from_secs(60)).await;
    let result = &by_id["given-up"];
    assert_eq!(result.len(), 1);
    assert_eq!(
        result[0].error_code,
        Some(ErrorCode::InferenceError),
        "{result:?}"
    );
    let dead = dead_letters(&client, &names, Duration::from_secs(30)).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.get("id").map(String::as_str), Some("given-up"));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulator_restarted_mid_drain_loses_nothing_the_dispatcher_held() {
    let mut emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("er");
    create(&client, &names, 5).await;
    let sim = fast_sim().await;
    let app = start_constant(&emulator, &names, &sim.base_url(), "").await;
    let n = 300;
    let bodies = requests("er", n);
    publish(&client, &names.topic, &bodies).await;
    let ids: BTreeSet<String> = (0..n).map(|i| format!("er-{i}")).collect();
    let mut messages = collect(&client, &names.result_sub, Duration::from_secs(60), |got| {
        got.len() >= n / 4
    })
    .await;

    // The emulator keeps everything in memory: a restart comes back empty.
    // The dispatcher must survive the outage and resume pulling; the
    // producer re-submits what the broker itself lost (every id without a
    // result yet), as it would after a real broker lost a topic.
    emulator.restart();
    let client = emulator.client().await;
    create(&client, &names, 5).await;
    let answered: BTreeSet<String> = results_by_id(&messages).into_keys().collect();
    let again: Vec<String> = bodies
        .iter()
        .zip(0..n)
        .filter(|(_, i)| !answered.contains(&format!("er-{i}")))
        .map(|(b, _)| b.clone())
        .collect();
    publish(&client, &names.topic, &again).await;
    messages.extend(
        collect(
            &client,
            &names.result_sub,
            Duration::from_secs(120),
            |got| {
                let mut seen = answered.clone();
                seen.extend(results_by_id(got).into_keys());
                ids.is_subset(&seen)
            },
        )
        .await,
    );
    let by_id = results_by_id(&messages);
    assert_eq!(
        by_id.keys().cloned().collect::<BTreeSet<_>>(),
        ids,
        "an id without a result"
    );
    assert!(
        metric(
            &app,
            "sluicegate_pubsub_pull_stream_restarts_total",
            &names.subscription
        ) >= 1.0,
        "the outage was seen and pulling resumed"
    );
    app.stop().await;
}

/// Says what can be seen of ids without a result (CI once missed 32 in
/// this test and left nothing to read): what is still on the request
/// subscription, and each run's warnings and counts of pulls, acks and
/// deadline changes (the full logs are in the test's directory while it
/// runs).
async fn explain_missing(
    client: &gcloud_pubsub::client::Client,
    names: &Names,
    ids: &BTreeSet<String>,
    answered: &BTreeSet<String>,
    logs: &std::path::Path,
) {
    let missing: Vec<&String> = ids.difference(answered).collect();
    eprintln!("{} ids without a result: {missing:?}", missing.len());
    let left = collect(client, &names.subscription, Duration::from_secs(10), |_| {
        false
    })
    .await;
    let left: Vec<String> = left
        .iter()
        .map(|(data, _)| String::from_utf8_lossy(data).chars().take(60).collect())
        .collect();
    eprintln!("still on the request subscription: {left:?}");
    for k in 0..4 {
        let log = std::fs::read_to_string(logs.join(format!("run-{k}.log"))).unwrap_or_default();
        for line in log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        {
            eprintln!("run {k}: {line}");
        }
        eprintln!(
            "run {k}: {} pulls, {} acks, {} deadline changes",
            log.matches("pubsub: pulled").count(),
            log.matches("pubsub: ack ").count(),
            log.matches("pubsub: modack").count()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_drain_and_restart_leaves_exactly_one_result_per_id_and_token() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("kill");
    create(&client, &names, 100).await;
    let sim = spawn_http(SimConfig {
        time_scale: 2.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let dir = support::TempDir::new("pubsub-kill");
    let toml = config_toml(
        &emulator,
        &names,
        &sim.base_url(),
        "",
        r#"gate_type = "constant""#,
    )
    .replace("max_sys = 32", "max_sys = 8");
    let config = dir.0.join("sluicegate.toml");
    std::fs::write(&config, toml).expect("config file");
    // Each run's log (with the transport's pulls and acks) is read back if
    // an id goes missing.
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let spawn = || {
        let k = runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = std::fs::File::create(dir.0.join(format!("run-{k}.log"))).expect("log file");
        std::process::Command::new(env!("CARGO_BIN_EXE_sluicegate"))
            .args(["run", "--config"])
            .arg(&config)
            .env_remove("PUBSUB_EMULATOR_HOST")
            .env("RUST_LOG", "info,sluicegate::queue::pubsub=debug")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("sluicegate runs")
    };
    let n = 400;
    publish(&client, &names.topic, &requests("k", n)).await;
    let ids: BTreeSet<String> = (0..n).map(|i| format!("k-{i}")).collect();
    let mut messages = Vec::new();
    for kill_at in [60, 160, 260] {
        let mut child = spawn();
        messages.extend(
            collect(
                &client,
                &names.result_sub,
                Duration::from_secs(120),
                |got| messages.len() + got.len() >= kill_at,
            )
            .await,
        );
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }
    assert!(messages.len() < n, "the drain ended before the last kill");
    let mut child = spawn();
    let answered = |got: &[(Vec<u8>, HashMap<String, String>)]| {
        let mut seen: BTreeSet<String> = results_by_id(&messages).into_keys().collect();
        seen.extend(results_by_id(got).into_keys());
        ids.is_subset(&seen)
    };
    let rest = collect(
        &client,
        &names.result_sub,
        Duration::from_secs(180),
        answered,
    )
    .await;
    messages.extend(rest);
    // Stragglers of the last run (duplicates, if any) arrive within a second.
    messages.extend(
        collect(&client, &names.result_sub, Duration::from_secs(2), |_| {
            false
        })
        .await,
    );
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");

    let by_id = results_by_id(&messages);
    let answered_ids: BTreeSet<String> = by_id.keys().cloned().collect();
    if answered_ids != ids {
        explain_missing(&client, &names, &ids, &answered_ids, &dir.0).await;
    }
    assert_eq!(answered_ids, ids, "an id without a result");
    // Readers dedupe by (id, request_token): one result each. The raw topic
    // may repeat an id only for a message whose result was confirmed and
    // whose ack the kill cut off: at most one result batch per kill (what
    // completed during the previous publish and ack; 18 to 52 per kill in
    // this test's runs, up to 512, docs/transports.md). A process never
    // answers a message twice, so half the ids answered twice would mean
    // far more than the kills.
    let raw_duplicates: usize = by_id.values().map(|r| r.len() - 1).sum();
    for (id, results) in &by_id {
        let tokens: BTreeSet<_> = results.iter().map(|r| r.request_token.clone()).collect();
        assert_eq!(
            tokens.len(),
            1,
            "{id}: different submissions answered: {results:?}"
        );
    }
    assert!(
        raw_duplicates < n / 2,
        "{raw_duplicates} duplicate results for 3 kills"
    );
    eprintln!("raw duplicate results after 3 kills: {raw_duplicates}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_sets_up_submits_and_collects_results_once_each() {
    let emulator = Emulator::start();
    let names = Names::new("cli");
    let dir = support::TempDir::new("pubsub-cli");
    let bin = env!("CARGO_BIN_EXE_sluicegate");
    let run = |args: &[&str]| {
        std::process::Command::new(bin)
            .args(args)
            .env("SLUICEGATE_PUBSUB_PROJECT_ID", support::pubsub::PROJECT)
            .env("PUBSUB_EMULATOR_HOST", emulator.host())
            .output()
            .expect("sluicegate runs")
    };
    let dead_sub = format!("{}-sub", names.dead);
    let setup_args = [
        "pubsub",
        "setup",
        "--topic",
        &names.topic,
        "--subscription",
        &names.subscription,
        "--result-topic",
        &names.results,
        "--result-subscription",
        &names.result_sub,
        "--dead-letter-topic",
        &names.dead,
        "--max-delivery-attempts",
        "5",
        "--ack-deadline",
        "10s",
    ];
    let first = run(&setup_args);
    assert!(first.status.success(), "{first:?}");
    let text = String::from_utf8_lossy(&first.stdout);
    assert_eq!(text.matches(": created").count(), 6, "{text}");
    assert!(
        text.contains(&format!(
            "dead letters to {} after 5 deliveries",
            names.dead
        )),
        "{text}"
    );
    // Re-running changes nothing.
    let again = run(&setup_args);
    assert_eq!(
        String::from_utf8_lossy(&again.stdout)
            .matches("exists, left as is")
            .count(),
        6
    );
    assert!(text.contains(&dead_sub), "{text}");

    let input = dir.0.join("requests.jsonl");
    let lines: Vec<String> = (0..30)
        .map(|i| {
            json!({"custom_id": format!("c-{i}"), "method": "POST", "url": "/v1/completions",
                   "body": {"model": "sim-model", "prompt": "x", "max_tokens": 4}})
            .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).expect("input");
    let submitted = run(&[
        "submit",
        "--pubsub-topic",
        &names.topic,
        input.to_str().expect("utf8"),
    ]);
    assert!(submitted.status.success(), "{submitted:?}");
    assert!(String::from_utf8_lossy(&submitted.stdout).contains("submitted 30 requests"));

    let sim = fast_sim().await;
    let app = start_constant(&emulator, &names, &sim.base_url(), "").await;
    let output = dir.0.join("results.jsonl");
    let results = run(&[
        "results",
        "--pubsub-subscription",
        &names.result_sub,
        "--expect",
        "30",
        "--timeout",
        "60s",
        "--output",
        output.to_str().expect("utf8"),
    ]);
    assert!(results.status.success(), "{results:?}");
    let written = std::fs::read_to_string(&output).expect("results file");
    let ids: BTreeSet<String> = written
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json")["id"]
                .as_str()
                .expect("id")
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 30);
    assert_eq!(written.lines().count(), 30);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_refuses_a_missing_result_topic_or_subscription_naming_the_key() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("miss");
    let toml = config_toml(
        &emulator,
        &names,
        "http://127.0.0.1:9",
        "",
        r#"gate_type = "constant""#,
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let run = || {
        sluicegate::app::start(
            &config,
            sluicegate::app::RunOptions::default(),
            std::future::ready(()),
        )
    };
    let error = run().await.expect_err("no result topic").to_string();
    assert!(
        error.contains("pubsub.result_topic_id") && error.contains(&names.results),
        "{error}"
    );
    client
        .topic(&names.results)
        .create(None, None)
        .await
        .expect("topic");
    let error = run().await.expect_err("no subscription").to_string();
    assert!(
        error.contains("queue.subscriber_id") && error.contains(&names.subscription),
        "{error}"
    );
    // And without [pubsub] result_topic_id the config itself is refused.
    let without = toml.replace(&format!("result_topic_id = \"{}\"\n", names.results), "");
    let errors = Config::from_toml_str(&without, &Default::default())
        .expect_err("refused")
        .to_string();
    assert!(errors.contains("pubsub.result_topic_id"), "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_subscription_drains_with_one_result_each_and_nothing_left() {
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("eod");
    let mut plan = names.plan(5);
    plan.exactly_once = true;
    sluicegate::queue::pubsub::setup(&client, &plan)
        .await
        .expect("setup");
    let (_, sub) = client
        .subscription(&names.subscription)
        .config(None)
        .await
        .expect("subscription");
    assert!(
        sub.enable_exactly_once_delivery,
        "the emulator kept the flag"
    );
    let sim = fast_sim().await;
    let app = start_constant(&emulator, &names, &sim.base_url(), "").await;
    publish(&client, &names.topic, &requests("e", 50)).await;
    let ids: BTreeSet<String> = (0..50).map(|i| format!("e-{i}")).collect();
    let by_id = results_for(&client, &names, &ids, Duration::from_secs(60)).await;
    assert_eq!(by_id.keys().cloned().collect::<BTreeSet<_>>(), ids);
    assert!(by_id.values().all(|r| r.len() == 1), "a duplicate result");
    assert_eq!(
        metric(&app, "sluicegate_pubsub_acks_total", &names.subscription),
        50.0
    );
    app.stop().await;
    let left = collect(
        &client,
        &names.subscription,
        Duration::from_secs(3),
        |got| !got.is_empty(),
    )
    .await;
    assert!(left.is_empty(), "still on the subscription: {left:?}");
}

/// The official Python client (`google-cloud-pubsub`, pinned in
/// `target/py-venv` by `scripts/test.sh`), or `None` when the suite is
/// skipped knowingly (`SLUICEGATE_SKIP_PYTHON_SUITE`, as for the openai
/// suite).
fn python_client() -> Option<std::path::PathBuf> {
    support::pytest::venv_python("the google-cloud-pubsub Python client test")
}

/// Publishes `messages` (bodies, or `{"data", "attributes"}` objects) with
/// the Python client (`tests/python/pubsub_publish.py`); returns the
/// message ids the emulator assigned, in order.
async fn python_publish(
    python: &std::path::Path,
    emulator: &Emulator,
    topic: &str,
    messages: &serde_json::Value,
) -> Vec<String> {
    let dir = support::TempDir::new("pubsub-python");
    let file = dir.0.join("messages.json");
    std::fs::write(&file, messages.to_string()).expect("messages file");
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let (python, host, topic) = (python.to_owned(), emulator.host(), topic.to_owned());
    // Off the runtime's workers: the dispatcher under test runs on them.
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(root.join("tests/python/pubsub_publish.py"))
            .args([support::pubsub::PROJECT, &topic])
            .arg(&file)
            .env("PUBSUB_EMULATOR_HOST", host)
            .output()
            .expect("python runs")
    })
    .await
    .expect("publish task");
    assert!(
        output.status.success(),
        "the Python publisher failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("a JSON array of message ids")
}

/// `sluicegate pubsub setup` as the README runs it (a retry policy and a
/// dead-letter topic), with the dead-letter limit the issue's user had.
fn cli_setup(emulator: &Emulator, names: &Names, max_delivery_attempts: &str) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluicegate"))
        .args(["pubsub", "setup", "--topic", &names.topic])
        .args(["--subscription", &names.subscription])
        .args(["--dead-letter-topic", &names.dead])
        .args(["--max-delivery-attempts", max_delivery_attempts])
        .args(["--result-topic", &names.results])
        .args(["--result-subscription", &names.result_sub])
        .env("SLUICEGATE_PUBSUB_PROJECT_ID", support::pubsub::PROJECT)
        .env("PUBSUB_EMULATOR_HOST", emulator.host())
        .output()
        .expect("sluicegate runs");
    assert!(output.status.success(), "{output:?}");
}

/// How long the storm gateway refuses everything, from its first request:
/// two of the dispatcher's 10 s ack deadlines (30 s before issue 34).
const STORM: Duration = Duration::from_secs(20);

/// For [`STORM`] after the first request it sees, a pool under load: two
/// requests in three are refused (503, or 429 with `Retry-After: 1`), the
/// third answered, so the congestion hold keeps clearing and the same
/// messages are refused again and again; then 200 to everything. Counts
/// refusals.
struct StormGateway {
    first: std::sync::OnceLock<std::time::Instant>,
    seen: std::sync::atomic::AtomicUsize,
    refused: std::sync::atomic::AtomicUsize,
    answered: std::sync::atomic::AtomicUsize,
}

/// The responder, sharing the counts with the test.
struct Storm(std::sync::Arc<StormGateway>);

impl wiremock::Respond for Storm {
    fn respond(&self, _request: &wiremock::Request) -> wiremock::ResponseTemplate {
        use std::sync::atomic::Ordering;
        let gateway = &self.0;
        let first = *gateway.first.get_or_init(std::time::Instant::now);
        if first.elapsed() < STORM {
            let n = gateway.seen.fetch_add(1, Ordering::SeqCst);
            if n % 3 != 2 {
                gateway.refused.fetch_add(1, Ordering::SeqCst);
                return if n.is_multiple_of(2) {
                    wiremock::ResponseTemplate::new(503)
                } else {
                    wiremock::ResponseTemplate::new(429).insert_header("retry-after", "1")
                };
            }
        }
        gateway.answered.fetch_add(1, Ordering::SeqCst);
        wiremock::ResponseTemplate::new(200).set_body_json(json!({
            "id": "cmpl", "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]
        }))
    }
}

/// The request subscription a storm test drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// What `sluicegate pubsub setup` makes: a retry policy and dead
    /// letters after 5 deliveries.
    Setup,
    /// A plain subscription: no retry policy, no dead-letter policy.
    Plain,
}

/// Creates the topics and a plain request subscription (10 s ack
/// deadline, nothing else) with its result subscription.
async fn plain_setup(client: &gcloud_pubsub::client::Client, names: &Names) {
    use gcloud_pubsub::subscription::SubscriptionConfig;
    for topic in [&names.topic, &names.results] {
        client
            .topic(topic)
            .create(None, None)
            .await
            .expect("create topic");
    }
    for (sub, topic) in [
        (&names.subscription, &names.topic),
        (&names.result_sub, &names.results),
    ] {
        let config = SubscriptionConfig {
            ack_deadline_seconds: 10,
            ..SubscriptionConfig::default()
        };
        client
            .subscription(sub)
            .create(&client.fully_qualified_topic_name(topic), config, None)
            .await
            .expect("create subscription");
    }
}

/// Issue 22, item 6, and issue 36, part 3: 300 messages published with
/// Google's Python client, through a gateway that refuses most requests
/// with 503/429 for 20 s (twice the 10 s lease, the ack deadline the holds
/// must keep extending). Waiting out the congestion must burn no delivery
/// attempt and do no work twice: exactly 300 results on the topic (not
/// only after deduplication), exactly 300 answered requests at the
/// gateway, nothing nacked, nothing dead-lettered and nothing left on the
/// subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_503_storm_answers_each_message_of_the_python_client_once() {
    python_storm(Shape::Setup).await;
}

/// [`a_429_503_storm_answers_each_message_of_the_python_client_once`] on a
/// subscription without retry or dead-letter policy (the issue's second
/// shape: 80 of 300 ids were answered twice, 2 messages left behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_503_storm_on_a_plain_subscription_answers_each_message_once() {
    python_storm(Shape::Plain).await;
}

async fn python_storm(shape: Shape) {
    use std::sync::atomic::Ordering;
    let Some(python) = python_client() else {
        return;
    };
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("storm");
    match shape {
        Shape::Setup => cli_setup(&emulator, &names, "5"),
        Shape::Plain => plain_setup(&client, &names).await,
    }
    let server = wiremock::MockServer::start().await;
    let gateway = std::sync::Arc::new(StormGateway {
        first: std::sync::OnceLock::new(),
        seen: 0.into(),
        refused: 0.into(),
        answered: 0.into(),
    });
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(Storm(gateway.clone()))
        .mount(&server)
        .await;
    // Holds capped at 8 s keep the test short; the storm still sees several.
    let app = start_constant(
        &emulator,
        &names,
        &server.uri(),
        "congestion_max_backoff = \"8s\"",
    )
    .await;
    let n = 300;
    let bodies: Vec<serde_json::Value> = requests("s", n).into_iter().map(Into::into).collect();
    let ids: BTreeSet<String> = (0..n).map(|i| format!("s-{i}")).collect();
    let published = python_publish(&python, &emulator, &names.topic, &bodies.into()).await;
    assert_eq!(published.len(), n);

    let messages = collect(
        &client,
        &names.result_sub,
        STORM + Duration::from_secs(60),
        |got| results_by_id(got).len() >= n,
    )
    .await;
    // Stragglers (a duplicate, or a result for an unexpected id) would
    // arrive within a second.
    let mut messages = messages;
    messages.extend(
        collect(&client, &names.result_sub, Duration::from_secs(2), |_| {
            false
        })
        .await,
    );
    let by_id = results_by_id(&messages);
    let answered: BTreeSet<String> = by_id.keys().cloned().collect();
    let missing: Vec<_> = ids.difference(&answered).collect();
    let extra: Vec<_> = answered.difference(&ids).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{} of {n} ids missing ({missing:?}), unexpected ids {extra:?}; gateway refused {} and answered {}",
        missing.len(),
        gateway.refused.load(Ordering::SeqCst),
        gateway.answered.load(Ordering::SeqCst),
    );
    // One result per id on the topic itself, and it is the 200; one
    // inference per message at the pool.
    let twice: Vec<_> = by_id.iter().filter(|(_, r)| r.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "{} ids answered more than once: {twice:?}",
        twice.len()
    );
    for (id, results) in &by_id {
        assert_eq!(results[0].status_code, Some(200), "{id}: {results:?}");
    }
    assert_eq!(
        gateway.answered.load(Ordering::SeqCst),
        n,
        "requests the gateway answered with 200"
    );
    assert!(
        gateway.refused.load(Ordering::SeqCst) > 0,
        "the storm never happened"
    );
    // Waiting for the pool held the messages leased: no nack reached the
    // broker, so no delivery attempt was used.
    assert_eq!(
        metric(&app, "sluicegate_pubsub_nacks_total", &names.subscription),
        0.0
    );
    app.stop().await;
    if shape == Shape::Setup {
        let dead = collect(
            &client,
            &format!("{}-sub", names.dead),
            Duration::from_secs(2),
            |got| !got.is_empty(),
        )
        .await;
        assert!(dead.is_empty(), "dead-lettered: {}", dead.len());
    }
    let left = collect(
        &client,
        &names.subscription,
        Duration::from_secs(2),
        |got| !got.is_empty(),
    )
    .await;
    assert!(left.is_empty(), "still on the subscription: {}", left.len());
}

/// Four distinct unparsable messages (two pairs with equal bodies), from
/// the Python client, get four results, each under `invalid:<message id>`;
/// and a message attribute overwrites the body's metadata key, as upstream
/// merges them (the gateway sees the attribute's fairness id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_messages_are_answered_under_their_message_ids_and_attributes_win() {
    let Some(python) = python_client() else {
        return;
    };
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("inv");
    cli_setup(&emulator, &names, "5");
    let server = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_string("{}"))
        .mount(&server)
        .await;
    let app = start_constant(&emulator, &names, &server.uri(), "").await;
    let routed = json!({
        "data": json!({"id": "attr", "deadline": unix_secs() + 3600,
            "metadata": {"userid": "from-body"},
            "payload": {"model": "m", "prompt": "x", "max_tokens": 1}}).to_string(),
        "attributes": {"userid": "from-attribute"},
    });
    let messages = json!([
        "not json at all",
        "not json at all",
        json!({"payload": {}}).to_string(),
        json!({"payload": {}}).to_string(),
        routed,
    ]);
    let message_ids = python_publish(&python, &emulator, &names.topic, &messages).await;
    let expected: BTreeSet<String> = message_ids[..4]
        .iter()
        .map(|m| format!("invalid:{m}"))
        .chain(["attr".to_owned()])
        .collect();
    let results = results_for(&client, &names, &expected, Duration::from_secs(60)).await;
    assert_eq!(
        results.keys().cloned().collect::<BTreeSet<_>>(),
        expected,
        "{results:?}"
    );
    for (id, r) in &results {
        assert_eq!(r.len(), 1, "{id}: {r:?}");
        if id != "attr" {
            assert_eq!(r[0].error_code, Some(ErrorCode::InvalidRequest), "{r:?}");
        }
    }
    let sent = server.received_requests().await.expect("recorded requests");
    assert_eq!(sent.len(), 1);
    assert_eq!(
        sent[0]
            .headers
            .get("x-llm-d-inference-fairness-id")
            .and_then(|v| v.to_str().ok()),
        Some("from-attribute")
    );
    app.stop().await;
}

/// Issue 22, item 3 on Pub/Sub: 60 messages with a 12 s deadline (past the
/// 10 s lease, so the holds extend the ack deadline; 20 s before issue 34) and a
/// gateway answering 429 to everything. Messages wait out the congestion
/// hold leased (holds, above) and the deadline sweep hands the expired
/// ones back to the dispatcher: every message is answered within 1 s of
/// its deadline (the 429 or `DEADLINE_EXCEEDED`), none before it.
/// Lateness is measured from the result's first appearance on the result
/// subscription, pulled without pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_answers_every_deadline_on_time_on_pubsub() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    const N: usize = 60;
    let emulator = Emulator::start();
    let client = emulator.client().await;
    let names = Names::new("dl");
    create(&client, &names, 100).await;
    let gateway = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(429).set_body_string("pool busy"))
        .mount(&gateway)
        .await;
    let app = start(
        &config_toml(
            &emulator,
            &names,
            &gateway.uri(),
            "",
            r#"gate_type = "constant""#,
        )
        .replace(
            "retry_initial_backoff = \"100ms\"\nretry_max_backoff = \"200ms\"\n",
            "",
        ),
    )
    .await;
    let deadline = unix_secs() + 12;
    let bodies: Vec<String> = (0..N)
        .map(|i| {
            json!({"id": format!("dl-{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string()
        })
        .collect();
    publish(&client, &names.topic, &bodies).await;
    let mut first_seen: HashMap<String, f64> = HashMap::new();
    let messages = collect(&client, &names.result_sub, Duration::from_secs(60), |got| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64();
        for id in results_by_id(got).into_keys() {
            first_seen.entry(id).or_insert(now);
        }
        first_seen.len() >= N
    })
    .await;
    let by_id = results_by_id(&messages);
    assert_eq!(by_id.len(), N, "every id answered");
    let mut lateness: Vec<f64> = first_seen.values().map(|t| t - deadline as f64).collect();
    lateness.sort_by(f64::total_cmp);
    eprintln!(
        "pubsub 429 storm: {N} answered; lateness vs deadline min {:+.2} s, max {:+.2} s",
        lateness[0],
        lateness[N - 1]
    );
    for (id, records) in &by_id {
        assert_eq!(records.len(), 1, "{id}: one result");
        let r = &records[0];
        let ended = r.status_code == Some(429)
            || r.error_code == Some(sluicegate::result::ErrorCode::DeadlineExceeded);
        assert!(ended, "{id}: {r:?}");
    }
    assert!(
        lateness[0] >= -0.05,
        "answered before the deadline: {lateness:?}"
    );
    assert!(
        lateness[N - 1] <= 1.0,
        "answered more than 1 s late: {lateness:?}"
    );
    app.stop().await;
}
