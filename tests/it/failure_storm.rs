//! Failure storms below HTTP (issue 22, item 2): a gateway that resets
//! every connection, one whose port is closed, and one that never answers
//! until the attempt times out. Each is a sign the pool cannot take work,
//! like a 429, so it must hold every queue on the gateway with the same
//! growing backoff and single probe: the attempts the gateway sees stay at
//! a few per backoff period whatever the backlog. Before the fix these
//! failures got only per-request backoff, and with a backlog the attempt
//! rate grew with it (issue 22: 228 attempts/s mean, 1 090/s peak with
//! 2 000 queued).
//!
//! On Pub/Sub (the official emulator, the subscription `pubsub setup`
//! makes: a retry policy, dead letters after 5 deliveries) a resetting
//! and a refusing gateway are bounded the same way, and once the gateway
//! recovers every id is answered exactly once: the storm loses nothing and
//! answers nothing twice.
//!
//! Attempts are counted at the scripted server (a real loopback socket)
//! where there is one; the closed port has no server, so there the
//! application's own `sluicegate_requests_sent_total` is sampled. Limits
//! are the issue's targets (mean ≤ 2 attempts/s, peak ≤ one window per
//! second) with no wall-clock speed thresholds.
//!
//! Time runs in units of [`UNIT`] (issue 34): every timing of the storm
//! (attempt timeout, congestion backoff and its cap, retry backoff, poll
//! and receive wait) is a number of units, and the limits are per unit.
//! With a unit of a second these are the issue 22 figures; the storms run
//! with a quarter second, so they observe the same number of backoff
//! periods in a quarter of the time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::support::TempDir;
use crate::support::failing::{FailingGateway, Failure, per_unit};
use crate::support::postgres::Postgres;
use crate::support::pubsub::{Emulator, Names, collect, create, publish, results_by_id};
use crate::support::redis::RedisServer;
use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, EndpointUrl};
use sluicegate::queue::embedded::EmbeddedQueue;
use sluicegate::queue::sql::SqlClient;
use sluicegate::result::ResultRecord;

/// The window: `max_sys` of the one queue, through the blind `constant`
/// gate (always a fresh reading, so only the hold keeps the gateway quiet).
const WINDOW: usize = 32;

/// The storms' unit of time: issue 22's second, a quarter as long.
const UNIT: Duration = Duration::from_millis(250);

/// `n` units.
fn units(n: u32) -> Duration {
    UNIT * n
}

/// `n` units in the configuration's spelling (milliseconds).
fn units_toml(n: u32) -> String {
    format!("{}ms", units(n).as_millis())
}

/// A storm's `[gateway]` timings in units: an attempt times out after 1.
fn gateway_timings() -> String {
    format!(
        "attempt_timeout = \"{}\"\nconnect_timeout = \"{}\"\n",
        units_toml(1),
        units_toml(1)
    )
}

/// A storm's `[dispatch]` timings in units: the congestion hold starts
/// at 2 (the default `congestion_backoff`, 2 s in issue 22's seconds) and
/// doubles to 8, a failed message's own backoff starts at 1 (the default
/// `retry_initial_backoff`), and the receiver polls every 0.1.
fn dispatch_timings() -> String {
    format!(
        "congestion_backoff = \"{}\"\ncongestion_max_backoff = \"{}\"\nretry_initial_backoff = \"{}\"\nretry_max_backoff = \"{}\"\npoll_interval = \"{}ms\"\n",
        units_toml(2),
        units_toml(8),
        units_toml(1),
        units_toml(60),
        (UNIT / 10).as_millis(),
    )
}

fn config(gateway: &str) -> Config {
    config_on(&Store::Memory, gateway)
}

/// The storm's configuration on `store`'s transport.
fn config_on(store: &Store, gateway: &str) -> Config {
    let toml = format!(
        r#"
{transport}
[gateway]
url = "{gateway}"
{gateway_timings}[dispatch]
{dispatch_timings}receive_wait = "{wait}ms"
shutdown_grace = "2s"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "storm"
max_sys = {WINDOW}
gate_type = "constant"
"#,
        transport = store.transport_toml(),
        gateway_timings = gateway_timings(),
        dispatch_timings = dispatch_timings(),
        wait = (UNIT / 10).as_millis(),
    );
    Config::from_toml_str(&toml, &Default::default()).unwrap()
}

/// `sluicegate_requests_sent_total` of `queue`.
fn sent(app: &support::App, queue: &str) -> usize {
    let text = app.running.metrics.encode();
    let prefix = format!("sluicegate_requests_sent_total{{queue=\"{queue}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as usize)
}

/// Runs `queued` messages against `url` for `span`; returns the attempts
/// per unit, read from `server` when there is one, else from the app's
/// sent counter sampled every tenth of a unit.
async fn storm(
    url: &str,
    server: Option<&FailingGateway>,
    queued: usize,
    span: Duration,
) -> Vec<usize> {
    let app = support::start_app(&config(url)).await;
    let queue = app.running.transports().memory()[0].clone();
    let deadline = unix_secs() + 3600;
    let start = Instant::now();
    for i in 0..queued {
        queue.push_message(
            serde_json::json!({"id": format!("m{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string(),
        );
    }
    let per_unit = attempts_per_unit(&app, "storm", server, start, span).await;
    app.stop().await;
    // Nothing answered, nothing lost: every message is still waiting.
    assert_eq!(queue.result_count(), 0, "{:?}", queue.results());
    assert!(queue.dead_letters().is_empty());
    assert_eq!(queue.unsettled().len(), queued);
    per_unit
}

/// Waits until `span` has passed since `start`; returns the attempts per
/// unit on `queue` from `start`, read from `server` when there is one,
/// else from the app's sent counter sampled every tenth of a unit.
async fn attempts_per_unit(
    app: &support::App,
    queue: &str,
    server: Option<&FailingGateway>,
    start: Instant,
    span: Duration,
) -> Vec<usize> {
    let mut samples = vec![(start, 0usize)];
    while start.elapsed() < span {
        tokio::time::sleep(UNIT / 10).await;
        samples.push((Instant::now(), sent(app, queue)));
    }
    match server {
        Some(server) => per_unit(&server.attempts(), start, span, UNIT),
        None => {
            // Rebuild one instant per attempt from the sampled counter.
            let mut at = Vec::new();
            for pair in samples.windows(2) {
                at.extend(std::iter::repeat_n(
                    pair[1].0,
                    pair[1].1.saturating_sub(pair[0].1),
                ));
            }
            per_unit(&at, start, span, UNIT)
        }
    }
}

fn check(what: &str, per_unit: &[usize]) {
    let total: usize = per_unit.iter().sum();
    let mean = total as f64 / per_unit.len() as f64;
    let peak = per_unit.iter().copied().max().unwrap_or(0);
    println!(
        "{what}: {total} attempts in {} units of {UNIT:?}, mean {mean:.2}/unit, peak {peak}/unit; per unit {per_unit:?}",
        per_unit.len()
    );
    assert!(total > 0, "{what}: the gateway saw no attempt at all");
    assert!(mean <= 2.0, "{what}: mean {mean:.2} attempts/unit");
    // The first wave is the window released before the first failure
    // came back; the first probe follows a hold of at least 1 unit (half
    // of `congestion_backoff`, 2 units), in a later unit.
    assert!(peak <= WINDOW, "{what}: peak {peak} attempts/unit");
    // After the first wave (its failures are back within FIRST_WAVE
    // units), one probe per hold, not a stream: holds of at least 1 unit
    // doubling to at least 4 leave room for 1 + 1 + 1 probes in the next
    // 7 units and one per 4 units after; twice that is the bound.
    let after: usize = per_unit.iter().skip(FIRST_WAVE).sum();
    let holds = 3 + per_unit.len().saturating_sub(FIRST_WAVE + 7) / 4;
    assert!(
        after <= 2 * holds,
        "{what}: {after} attempts after the first wave, more than 2 per hold ({holds} holds)"
    );
}

/// Units the first wave (the window released before the first failure
/// came back) is given to end.
const FIRST_WAVE: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_with_2000_queued_sees_a_few_attempts_per_backoff() {
    let server = FailingGateway::start(Failure::Reset).await;
    let counts = storm(&server.url, Some(&server), 2000, units(60)).await;
    check("reset, 2000 queued, 60 units", &counts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_a_congestion_signal() {
    // A port nothing listens on: every connect is refused at once.
    let (_refusing, port) = support::refused_port();
    let url = format!("http://127.0.0.1:{port}");
    let counts = storm(&url, None, 500, units(30)).await;
    check("connect refused, 500 queued, 30 units", &counts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_hangs_past_the_attempt_timeout_is_a_congestion_signal() {
    let server = FailingGateway::start(Failure::Hang).await;
    // The first wave alone is 32 attempts: over 30 units it leaves room
    // for the probes within the mean of 2 per unit.
    let counts = storm(&server.url, Some(&server), 500, units(30)).await;
    check(
        "hang past attempt_timeout 1 unit, 500 queued, 30 units",
        &counts,
    );
}

/// A reset is a failed attempt: it is counted in the result's `attempts`
/// (and toward `max_attempts`), and the message is tried again once the
/// hold has passed, from the same message, not a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_hit_a_reset_is_counted() {
    let server = FailingGateway::start(Failure::ResetThenOk(2)).await;
    let app = support::start_app(&config(&server.url)).await;
    let queue = app.running.transports().memory()[0].clone();
    queue.push_message(
        serde_json::json!({"id": "once", "deadline": unix_secs() + 600,
            "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
        .to_string(),
    );
    // Two holds of 1–2 and 2–4 units, then the answer.
    support::wait_until(Duration::from_secs(30), "the message answered", || {
        queue.result_count() == 1
    })
    .await;
    app.stop().await;
    let result = &queue.results()[0];
    assert_eq!(result.status_code, Some(200), "{result:?}");
    assert_eq!(result.attempts, 3, "{result:?}");
    assert_eq!(server.count(), 3);
}

/// A Pub/Sub storm in progress: the emulator, the subscription `pubsub
/// setup` makes (retry policy, dead letters after 5 deliveries), the
/// dispatcher on it, and `queued` messages published at `start`.
struct PubsubStorm {
    _emulator: Emulator,
    client: gcloud_pubsub::client::Client,
    names: Names,
    app: support::App,
    ids: BTreeSet<String>,
    start: Instant,
}

impl PubsubStorm {
    async fn start(tag: &str, gateway: &str, queued: usize) -> Self {
        let emulator = Emulator::start();
        let client = emulator.client().await;
        let names = Names::new(tag);
        create(&client, &names, 5).await;
        // The memory storm's dispatch settings, on the subscription.
        let toml = format!(
            r#"
transport = "pubsub"
[gateway]
url = "{gateway}"
{gateway_timings}[dispatch]
{dispatch_timings}receive_wait = "{wait}ms"
shutdown_grace = "2s"
lease = "10s"
[telemetry]
listen = "127.0.0.1:0"
{pubsub}
[[queue]]
subscriber_id = "{sub}"
max_sys = {WINDOW}
gate_type = "constant"
"#,
            pubsub = emulator.toml(&names.results),
            sub = names.subscription,
            gateway_timings = gateway_timings(),
            dispatch_timings = dispatch_timings(),
            wait = (UNIT / 5).as_millis(),
        );
        let config = Config::from_toml_str(&toml, &Default::default()).unwrap();
        let app = support::start_app(&config).await;
        let deadline = unix_secs() + 3600;
        let ids: BTreeSet<String> = (0..queued).map(|i| format!("{tag}-{i}")).collect();
        let bodies: Vec<String> = ids
            .iter()
            .map(|id| {
                serde_json::json!({"id": id, "deadline": deadline,
                    "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
                .to_string()
            })
            .collect();
        let start = Instant::now();
        publish(&client, &names.topic, &bodies).await;
        Self {
            _emulator: emulator,
            client,
            names,
            app,
            ids,
            start,
        }
    }

    /// Attempts per unit until `span` after the publish.
    async fn attempts(&self, server: Option<&FailingGateway>, span: Duration) -> Vec<usize> {
        attempts_per_unit(
            &self.app,
            &self.names.subscription,
            server,
            self.start,
            span,
        )
        .await
    }

    /// Once the gateway answers again: every id gets exactly one result,
    /// a 200 (no message used up its deliveries on a storm the pool held
    /// out), nothing is dead-lettered and nothing is left on the
    /// subscription.
    async fn every_id_answered_once(self, what: &str) {
        let n = self.ids.len();
        let mut messages = collect(
            &self.client,
            &self.names.result_sub,
            Duration::from_secs(120),
            |got| results_by_id(got).len() >= n,
        )
        .await;
        // A duplicate (a redelivery answered again) would follow within
        // a second or two.
        messages.extend(
            collect(
                &self.client,
                &self.names.result_sub,
                Duration::from_secs(3),
                |_| false,
            )
            .await,
        );
        let by_id = results_by_id(&messages);
        let answered: BTreeSet<String> = by_id.keys().cloned().collect();
        let missing: Vec<_> = self.ids.difference(&answered).collect();
        let extra: Vec<_> = answered.difference(&self.ids).collect();
        let nacks = metric(
            &self.app,
            "sluicegate_pubsub_nacks_total",
            &self.names.subscription,
        );
        println!(
            "{what}: {} of {n} ids answered after the gateway recovered, {} results, {nacks} nacks",
            answered.len(),
            messages.len()
        );
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{what}: {} of {n} ids missing ({missing:?}), unexpected ids {extra:?}",
            missing.len()
        );
        for (id, results) in &by_id {
            assert_eq!(
                results.len(),
                1,
                "{what}: {id} answered more than once: {results:?}"
            );
            assert_eq!(
                results[0].status_code,
                Some(200),
                "{what}: {id}: {results:?}"
            );
        }
        self.app.stop().await;
        let dead = collect(
            &self.client,
            &format!("{}-sub", self.names.dead),
            Duration::from_secs(2),
            |got| !got.is_empty(),
        )
        .await;
        assert!(dead.is_empty(), "{what}: dead-lettered: {}", dead.len());
        let left = collect(
            &self.client,
            &self.names.subscription,
            Duration::from_secs(2),
            |got| !got.is_empty(),
        )
        .await;
        assert!(
            left.is_empty(),
            "{what}: still on the subscription: {}",
            left.len()
        );
    }
}

/// The value of `name{queue="<queue>"}` in the app's metrics (0 when absent).
fn metric(app: &support::App, name: &str, queue: &str) -> f64 {
    let text = app.running.metrics.encode();
    let prefix = format!("{name}{{queue=\"{queue}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Pub/Sub, 500 published, a gateway resetting every connection for 30 units:
/// attempts bounded as on the memory queue; then it answers, and every id
/// is answered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_on_pubsub_is_bounded_and_loses_nothing() {
    let server = FailingGateway::start(Failure::Reset).await;
    let storm = PubsubStorm::start("psreset", &server.url, 500).await;
    let counts = storm.attempts(Some(&server), units(30)).await;
    check("pubsub, reset, 500 queued, 30 units", &counts);
    server.recover();
    storm.every_id_answered_once("pubsub, reset").await;
}

/// Pub/Sub, 500 published, a gateway port refusing connections for 30 units:
/// attempts bounded; then a gateway starts on that port, and every id is
/// answered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_gateway_on_pubsub_is_bounded_and_loses_nothing() {
    let port = support::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let storm = PubsubStorm::start("psrefuse", &url, 500).await;
    let counts = storm.attempts(None, units(30)).await;
    check("pubsub, connect refused, 500 queued, 30 units", &counts);
    // Answers every request from the first.
    let _server = FailingGateway::start_on(port, Failure::ResetThenOk(0)).await;
    storm
        .every_id_answered_once("pubsub, connect refused")
        .await;
}

/// Where a storm's messages wait: the memory queue, or a transport whose
/// messages outlive the process (issue 36 part 4: the reset and refuse
/// storms had run on memory and Pub/Sub only).
enum Store {
    Memory,
    Redis(RedisServer),
    Embedded(TempDir),
    Sql(Postgres, SqlClient),
}

/// The result route of the `sql` storms (the transport's default).
const SQL_ROUTE: &str = "result-sql";

impl Store {
    fn redis() -> Self {
        Self::Redis(RedisServer::start())
    }

    fn embedded() -> Self {
        Self::Embedded(TempDir::new("storm-embedded"))
    }

    async fn sql() -> Self {
        let pg = Postgres::start();
        let url = EndpointUrl::new(url::Url::parse(&pg.url()).unwrap());
        let client = SqlClient::open(&url, Duration::from_secs(5)).await.unwrap();
        Self::Sql(pg, client)
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis(_) => "redis",
            Self::Embedded(_) => "embedded",
            Self::Sql(..) => "sql",
        }
    }

    /// The configuration's transport lines (before `[gateway]`).
    fn transport_toml(&self) -> String {
        match self {
            Self::Memory => "transport = \"memory\"".to_owned(),
            Self::Redis(server) => {
                format!("transport = \"redis\"\n[redis]\nurl = \"{}\"", server.url())
            }
            Self::Embedded(_) => format!(
                "transport = \"embedded\"\n[embedded]\npath = \"{}\"",
                self.embedded_path().display()
            ),
            Self::Sql(pg, _) => format!(
                "transport = \"sql\"\n[sql]\nurl = \"{}\"\npoll_interval = \"{}ms\"",
                pg.url(),
                (UNIT / 10).as_millis()
            ),
        }
    }

    fn embedded_path(&self) -> std::path::PathBuf {
        match self {
            Self::Embedded(dir) => dir.0.join("store.db"),
            _ => unreachable!("an embedded store"),
        }
    }

    /// Enqueues `bodies` on queue `storm` (memory: the running `app`'s;
    /// the others before the app starts).
    async fn push(&self, app: Option<&support::App>, bodies: &[String]) {
        match self {
            Self::Memory => {
                let app = app.expect("the memory queue lives in the app");
                let queue = app.running.transports().memory()[0].clone();
                for body in bodies {
                    queue.push_message(body.clone());
                }
            }
            Self::Redis(server) => support::redis::submit(server, "storm", bodies).await,
            Self::Embedded(_) => {
                let bytes: Vec<bytes::Bytes> = bodies.iter().map(|b| b.clone().into()).collect();
                EmbeddedQueue::open(self.embedded_path(), "storm")
                    .unwrap()
                    .enqueue(&bytes, &[])
                    .unwrap();
            }
            Self::Sql(_, client) => {
                let deadline = unix_secs() + 3600;
                let items: Vec<(bytes::Bytes, i64)> = bodies
                    .iter()
                    .map(|b| (b.clone().into(), deadline))
                    .collect();
                client.enqueue("storm", &items).await.unwrap();
            }
        }
    }

    /// Every result written for queue `storm` so far.
    async fn results(&self, app: &support::App) -> Vec<Answer> {
        let records: Vec<ResultRecord> = match self {
            Self::Memory => app.running.transports().memory()[0].results(),
            // Upstream's result shape: the id and the status code are
            // what these tests read.
            Self::Redis(server) => {
                return server
                    .cli(&["LRANGE", "result-list", "0", "-1"])
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| {
                        let r: serde_json::Value = serde_json::from_str(l).unwrap();
                        Answer {
                            id: r["id"].as_str().unwrap().to_owned(),
                            status_code: r["status_code"].as_u64().map(|c| c as u16),
                        }
                    })
                    .collect();
            }
            Self::Embedded(_) => EmbeddedQueue::open(self.embedded_path(), "storm")
                .unwrap()
                .results()
                .unwrap(),
            Self::Sql(_, client) => client
                .results_after(SQL_ROUTE, 0, 100_000)
                .await
                .unwrap()
                .into_iter()
                .map(|r| serde_json::from_str(&r.raw).unwrap())
                .collect(),
        };
        records
            .into_iter()
            .map(|r| Answer {
                id: r.id,
                status_code: r.status_code,
            })
            .collect()
    }
}

/// What a storm test reads of a result.
#[derive(Debug)]
struct Answer {
    id: String,
    status_code: Option<u16>,
}

/// `n` storm messages, ids `m0`…, due in an hour.
fn storm_bodies(n: usize) -> Vec<String> {
    let deadline = unix_secs() + 3600;
    (0..n)
        .map(|i| {
            serde_json::json!({"id": format!("m{i}"), "deadline": deadline,
                "payload": {"model": "m", "prompt": "p", "max_tokens": 1}})
            .to_string()
        })
        .collect()
}

/// A gateway failing with `failure` (`None`: a port nothing listens on)
/// for 30 units while 500 messages wait on `store`: attempts bounded as
/// [`check`] says and nothing answered; then the gateway answers (the
/// failing one recovers, or one starts on the refused port) and every id
/// gets exactly one result, a 200.
async fn storm_then_recover(store: Store, failure: Option<Failure>) {
    const QUEUED: usize = 500;
    let what = format!("{}, {failure:?}, {QUEUED} queued, 30 units", store.name());
    let (server, port) = match failure {
        Some(failure) => (Some(FailingGateway::start(failure).await), 0),
        None => (None, support::free_port()),
    };
    let url = server
        .as_ref()
        .map_or_else(|| format!("http://127.0.0.1:{port}"), |s| s.url.clone());
    let bodies = storm_bodies(QUEUED);
    let durable = !matches!(store, Store::Memory);
    if durable {
        store.push(None, &bodies).await;
    }
    let app = support::start_app(&config_on(&store, &url)).await;
    let start = Instant::now();
    if !durable {
        store.push(Some(&app), &bodies).await;
    }
    let counts = attempts_per_unit(&app, "storm", server.as_ref(), start, units(30)).await;
    let during = store.results(&app).await;
    assert!(
        during.is_empty(),
        "{what}: answered in the storm: {during:?}"
    );
    check(&what, &counts);
    let _answering = match &server {
        Some(server) => {
            server.recover();
            None
        }
        None => Some(FailingGateway::start_on(port, Failure::ResetThenOk(0)).await),
    };
    let give_up = Instant::now() + Duration::from_secs(60);
    while store.results(&app).await.len() < QUEUED {
        assert!(Instant::now() < give_up, "{what}: not all answered in 60 s");
        tokio::time::sleep(UNIT / 5).await;
    }
    // A second answer (a lease lapsed during the holds, say) would follow
    // within a few units.
    tokio::time::sleep(units(4)).await;
    let results = store.results(&app).await;
    app.stop().await;
    let mut by_id = std::collections::BTreeMap::<&str, Vec<&Answer>>::new();
    for r in &results {
        by_id.entry(r.id.as_str()).or_default().push(r);
    }
    let twice: Vec<_> = by_id.iter().filter(|(_, rs)| rs.len() > 1).collect();
    println!(
        "{what}: after recovery {} results for {} ids, {} answered more than once",
        results.len(),
        by_id.len(),
        twice.len()
    );
    assert!(twice.is_empty(), "{what}: answered twice: {twice:?}");
    assert_eq!(by_id.len(), QUEUED, "{what}: ids lost");
    for r in &results {
        assert_eq!(r.status_code, Some(200), "{what}: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_on_redis_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::redis(), Some(Failure::Reset)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_gateway_on_redis_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::redis(), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_on_the_embedded_store_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::embedded(), Some(Failure::Reset)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_gateway_on_the_embedded_store_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::embedded(), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resetting_gateway_on_sql_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::sql().await, Some(Failure::Reset)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_gateway_on_sql_is_bounded_and_loses_nothing() {
    storm_then_recover(Store::sql().await, None).await;
}
