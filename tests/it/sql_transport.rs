//! The `sql` transport against a real PostgreSQL (started by
//! `support::postgres`, never the machine's own server) and the simulator:
//! a round trip, three SIGKILLs of `sluicegate run` mid-drain, a
//! PostgreSQL restart mid-drain, cancellation, deadlines, malformed and
//! upstream-written rows, dead letters, the producer commands, and config
//! errors naming their key.

use crate::support;

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::postgres::Postgres;
use bytes::Bytes;
use sluicegate::clock::unix_secs;
use sluicegate::config::{Config, EndpointUrl};
use sluicegate::queue::sql::SqlClient;
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");
const ROUTE: &str = "result-sql";

fn request_line(id: &str, deadline: i64) -> String {
    serde_json::json!({
        "id": id,
        "deadline": deadline,
        "payload": {"model": "sim-model", "prompt": "Summarise.", "max_tokens": 4}
    })
    .to_string()
}

fn app_toml(pg: &Postgres, gateway: &str, queue: &str, gate: &str) -> String {
    format!(
        r#"
transport = "sql"
[sql]
url = "{url}"
poll_interval = "50ms"
batch_size = 50
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
lease = "2s"
retry_initial_backoff = "100ms"
retry_max_backoff = "200ms"
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
queue_name = "{queue}"
max_sys = 16
{gate}
"#,
        url = pg.url()
    )
}

async fn client(pg: &Postgres) -> SqlClient {
    let url = EndpointUrl::new(url::Url::parse(&pg.url()).expect("url"));
    SqlClient::open(&url, Duration::from_secs(5))
        .await
        .expect("client opens")
}

async fn submit(client: &SqlClient, queue: &str, ids: &[String], deadline: i64) {
    let items: Vec<(Bytes, i64)> = ids
        .iter()
        .map(|id| (Bytes::from(request_line(id, deadline)), deadline))
        .collect();
    let n = client.enqueue(queue, &items).await.expect("enqueued");
    assert_eq!(n as usize, ids.len());
}

/// A plain session of our own, for a transaction a test holds open.
async fn session(pg: &Postgres) -> tokio_postgres::Client {
    let (session, connection) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    session
}

/// Waits (bounded) until `route` holds at least `n` results.
async fn wait_results(client: &SqlClient, n: u64, within: Duration) {
    let give_up = std::time::Instant::now() + within;
    loop {
        let have = client.result_count(ROUTE).await.unwrap_or(0);
        if have >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "only {have} of {n} results after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every result of the route, as JSON records keyed by their row id.
async fn all_results(client: &SqlClient) -> Vec<(String, serde_json::Value)> {
    let rows = client
        .results_after(ROUTE, 0, 100_000)
        .await
        .expect("results");
    rows.into_iter()
        .map(|r| (r.id, serde_json::from_str(&r.raw).expect("record is JSON")))
        .collect()
}

/// Asserts exactly one result per id of `ids` and nothing else.
fn one_each(results: &[(String, serde_json::Value)], ids: &[String]) {
    let mut seen: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
    seen.sort_unstable();
    let total = seen.len();
    seen.dedup();
    assert_eq!(total, seen.len(), "a duplicate result");
    let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
    want.sort_unstable();
    assert_eq!(seen, want, "one result per submitted id");
}

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn round_trip_through_the_simulator_writes_one_result_per_request() {
    let pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let c = client(&pg).await;
    // Opening again finds the schema there (idempotent creation).
    let _again = client(&pg).await;
    let want = ids("rt", 60);
    submit(&c, "rt", &want, unix_secs() + 3600).await;
    assert_eq!(c.outstanding("rt").await.expect("count"), 60);
    let toml = app_toml(&pg, &sim.base_url(), "rt", r#"gate_type = "constant""#);
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    wait_results(&c, 60, Duration::from_secs(60)).await;
    app.stop().await;
    let results = all_results(&c).await;
    one_each(&results, &want);
    for (_, r) in &results {
        assert_eq!(r["status_code"], 200, "{r}");
    }
    assert_eq!(c.outstanding("rt").await.expect("count"), 0);
    // The schema version row is there for the next build to check.
    assert_eq!(
        pg.psql("SELECT value FROM sluicegate_sql_meta WHERE key = 'schema_version'"),
        "1"
    );
}

/// `sluicegate run` as a process on `config`, SIGKILLed on drop.
fn run_process(config: &std::path::Path) -> support::cli::Background {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--config"])
        .arg(config)
        .env("SLUICEGATE_LOG_LEVEL", "warn")
        .stdin(Stdio::null());
    support::cli::Background::spawn(&mut cmd)
}

#[tokio::test(flavor = "multi_thread")]
async fn three_sigkills_mid_drain_of_500_leave_exactly_one_result_per_id() {
    let pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 5.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let c = client(&pg).await;
    let want = ids("kill", 500);
    submit(&c, "kq", &want, unix_secs() + 3600).await;
    let tmp = support::TempDir::new("sql-kills");
    let config = tmp.0.join("sql.toml");
    let gate = r#"gate_type = "local-max-concurrency"
gate_params = { limit = "16", gating_mode = "blocking" }"#;
    std::fs::write(&config, app_toml(&pg, &sim.base_url(), "kq", gate)).expect("config");
    let mut worker = run_process(&config);
    for k in 1..=3u64 {
        wait_results(&c, k * 60, Duration::from_secs(120)).await;
        let have = c.result_count(ROUTE).await.expect("count");
        assert!(have < 500, "the kill must land mid-drain (already {have})");
        worker.kill();
        // Leases of the killed process stay in the table until they lapse.
        worker = run_process(&config);
    }
    wait_results(&c, 500, Duration::from_secs(180)).await;
    // Let anything still in flight settle before counting.
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while c.outstanding("kq").await.expect("count") > 0 {
        assert!(std::time::Instant::now() < give_up, "rows left unsettled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.kill();
    let results = all_results(&c).await;
    one_each(&results, &want);
    assert_eq!(
        pg.psql(
            "SELECT COUNT(*) FROM (SELECT id FROM async_results GROUP BY id HAVING COUNT(*) > 1) d"
        ),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_restart_mid_drain_loses_nothing() {
    let mut pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 5.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let want = ids("restart", 300);
    {
        let c = client(&pg).await;
        submit(&c, "pq", &want, unix_secs() + 3600).await;
    }
    let toml = app_toml(
        &pg,
        &sim.base_url(),
        "pq",
        r#"gate_type = "local-max-concurrency"
gate_params = { limit = "16", gating_mode = "blocking" }"#,
    );
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    {
        let c = client(&pg).await;
        wait_results(&c, 50, Duration::from_secs(120)).await;
        let have = c.result_count(ROUTE).await.expect("count");
        assert!(
            have < 300,
            "the restart must land mid-drain (already {have})"
        );
    }
    pg.restart();
    let c = client(&pg).await;
    wait_results(&c, 300, Duration::from_secs(180)).await;
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while c.outstanding("pq").await.expect("count") > 0 {
        assert!(std::time::Instant::now() < give_up, "rows left unsettled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.stop().await;
    one_each(&all_results(&c).await, &want);
}

#[tokio::test(flavor = "multi_thread")]
async fn cancellation_deadlines_malformed_and_upstream_rows_each_get_their_result() {
    let pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let c = client(&pg).await;
    let future = unix_secs() + 3600;
    // Waiting rows cancelled by the producer: answered at once.
    let cancel_me = ids("cancel", 3);
    submit(&c, "mix", &cancel_me, future).await;
    let done = c
        .cancel("mix", ROUTE, &cancel_me[..2])
        .await
        .expect("cancel");
    assert_eq!(done.cancelled, 2);
    assert_eq!(done.in_flight, 0);
    // A row flagged the way upstream's producer cancels (the flag only):
    // the dispatcher answers it CANCELLED without sending it.
    pg.psql("UPDATE async_requests SET cancelled = 1 WHERE id = 'cancel-2'");
    // A deadline already past.
    submit(&c, "mix", &["late".to_owned()], unix_secs() - 10).await;
    // A row upstream's producer wrote (its columns only), and one whose
    // payload is not a request.
    let upstream = request_line("upstream-1", future).replace('\'', "''");
    pg.psql(&format!(
        "INSERT INTO async_requests (id, request_token, queue, partition_id, deadline, payload, created_at)
         VALUES ('upstream-1', 'tok-1', 'mix', 7, {future}, '{upstream}', 1),
                ('broken', '', 'mix', 3, {future}, 'not json at all', 2)"
    ));
    let toml = app_toml(&pg, &sim.base_url(), "mix", r#"gate_type = "constant""#);
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    wait_results(&c, 6, Duration::from_secs(60)).await;
    app.stop().await;
    let results = all_results(&c).await;
    let want: Vec<String> = [
        "cancel-0",
        "cancel-1",
        "cancel-2",
        "late",
        "upstream-1",
        "broken",
    ]
    .map(str::to_owned)
    .to_vec();
    one_each(&results, &want);
    let get = |id: &str| {
        &results
            .iter()
            .find(|(i, _)| i == id)
            .unwrap_or_else(|| panic!("no result for {id}"))
            .1
    };
    for id in ["cancel-0", "cancel-1", "cancel-2"] {
        assert_eq!(get(id)["error_code"], "CANCELLED", "{id}: {}", get(id));
    }
    assert_eq!(
        get("late")["error_code"],
        "DEADLINE_EXCEEDED",
        "{}",
        get("late")
    );
    assert_eq!(
        get("upstream-1")["status_code"],
        200,
        "{}",
        get("upstream-1")
    );
    assert_eq!(
        get("broken")["error_code"],
        "INVALID_REQUEST",
        "{}",
        get("broken")
    );
    // The upstream row's token is kept on its result row.
    assert_eq!(
        pg.psql("SELECT request_token FROM async_results WHERE id = 'upstream-1'"),
        "tok-1"
    );
    assert_eq!(c.outstanding("mix").await.expect("count"), 0);
}

#[test]
fn config_errors_name_the_key_and_what_is_allowed() {
    let base = |sql: &str| {
        format!(
            r#"
transport = "sql"
{sql}
[gateway]
url = "http://127.0.0.1:1"
[[queue]]
queue_name = "q"
gate_type = "constant"
"#
        )
    };
    let err = |text: &str| {
        Config::from_toml_str(text, &Default::default())
            .expect_err("invalid")
            .to_string()
    };
    let missing = err(&base(""));
    assert!(missing.contains("sql.url"), "{missing}");
    assert!(missing.contains("SQL_URL"), "{missing}");
    let scheme = err(&base("[sql]\nurl = \"mysql://h/db\""));
    assert!(scheme.contains("sql.url"), "{scheme}");
    assert!(scheme.contains("postgres://"), "{scheme}");
    let batch = err(&base("[sql]\nurl = \"postgres://h/db\"\nbatch_size = 0"));
    assert!(batch.contains("sql.batch_size"), "{batch}");
    let lease = err(&base(
        "[sql]\nurl = \"postgres://h/db\"\nlease_ttl = \"2s\"\n[dispatch]\nlease = \"10s\"",
    ));
    assert!(lease.contains("sql.lease_ttl"), "{lease}");
    let unknown = err(&base(
        "[sql]\nurl = \"postgres://h/db\"\npoll_interval_ms = 5",
    ));
    assert!(unknown.contains("sql.poll_interval_ms"), "{unknown}");
    // Upstream's variable names the database too; a password is masked
    // when the config is shown.
    let env = [("SQL_URL".to_owned(), "postgres://u:secret@h/db".to_owned())].into();
    let config = Config::from_toml_str(&base(""), &env).expect("SQL_URL is enough");
    let url = config.sql.and_then(|s| s.url).expect("url set");
    assert!(!url.masked().contains("secret"));
    assert_eq!(url.expose().host_str(), Some("h"));
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_cancel_and_results_commands_use_the_database() {
    let pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let tmp = support::TempDir::new("sql-cli");
    let file = tmp.0.join("in.jsonl");
    let lines: Vec<String> = (0..3)
        .map(|i| {
            serde_json::json!({
                "custom_id": format!("c-{i}"), "method": "POST", "url": "/v1/completions",
                "body": {"model": "sim-model", "prompt": "hi", "max_tokens": 4}
            })
            .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).expect("input");
    let url = pg.url();
    let run = |args: &[&str]| {
        let out = support::cli::output(&mut support::cli::sluicegate(args));
        assert!(out.status.success(), "{args:?}: {out:?}");
        support::cli::text(&out.stdout)
    };
    let file_arg = file.to_string_lossy().into_owned();
    let submitted = run(&["submit", "--sql-url", &url, "--queue", "cli", &file_arg]);
    assert!(submitted.contains("submitted 3 messages"), "{submitted}");
    let cancelled = run(&["cancel", "--sql-url", &url, "--queue", "cli", "c-1", "nope"]);
    assert!(cancelled.contains("c-1: cancelled"), "{cancelled}");
    assert!(cancelled.contains("nope: not active"), "{cancelled}");
    let first = run(&["results", "--sql-url", &url]);
    assert_eq!(first.lines().count(), 1, "{first}");
    assert!(first.contains("CANCELLED"), "{first}");

    let toml = app_toml(&pg, &sim.base_url(), "cli", r#"gate_type = "constant""#);
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    let c = client(&pg).await;
    wait_results(&c, 3, Duration::from_secs(60)).await;
    app.stop().await;
    let cursor = c.results_after(ROUTE, 0, 1).await.expect("first")[0].seq;
    let rest = run(&[
        "results",
        "--sql-url",
        &url,
        "--after",
        &cursor.to_string(),
        "--format",
        "openai",
    ]);
    let custom: Vec<String> = rest
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            assert_eq!(v["response"]["status_code"], 200, "{v}");
            v["custom_id"].as_str().expect("custom_id").to_owned()
        })
        .collect();
    assert_eq!(custom.len(), 2, "{rest}");
    assert!(!custom.contains(&"c-1".to_owned()));
}

/// A gateway that answers every request 500.
async fn failing_gateway() -> String {
    let app = axum::Router::new().fallback(axum::routing::post(|| async {
        (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom")
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread")]
async fn attempts_used_up_move_the_row_to_the_dead_letters_with_one_result() {
    let pg = Postgres::start();
    let gateway = failing_gateway().await;
    let c = client(&pg).await;
    let want = ids("dead", 2);
    submit(&c, "dl", &want, unix_secs() + 3600).await;
    let toml = app_toml(&pg, &gateway, "dl", r#"gate_type = "constant""#)
        .replace("[dispatch]\n", "[dispatch]\nmax_attempts = 2\n");
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    wait_results(&c, 2, Duration::from_secs(60)).await;
    app.stop().await;
    let results = all_results(&c).await;
    one_each(&results, &want);
    for (_, r) in &results {
        assert_eq!(r["status_code"], 500, "{r}");
        assert_eq!(r["attempts"], 2, "{r}");
    }
    assert_eq!(c.dead_letter_count("dl").await.expect("count"), 2);
    assert_eq!(c.outstanding("dl").await.expect("count"), 0);
    // Each dead letter keeps its last error (the 500).
    assert_eq!(
        pg.psql("SELECT COUNT(*) FROM sluicegate_dead_letters WHERE queue = 'dl' AND last_error LIKE '%500%'"),
        "2"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn run_exit_when_done_drains_the_queue_and_exits() {
    let pg = Postgres::start();
    let sim = spawn_http(SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    })
    .await
    .expect("simulator");
    let c = client(&pg).await;
    let want = ids("done", 20);
    submit(&c, "ewd", &want, unix_secs() + 3600).await;
    let tmp = support::TempDir::new("sql-exit");
    let config = tmp.0.join("sql.toml");
    std::fs::write(
        &config,
        app_toml(&pg, &sim.base_url(), "ewd", r#"gate_type = "constant""#),
    )
    .expect("config");
    let config_arg = config.to_string_lossy().into_owned();
    let mut cmd = support::cli::sluicegate(&["run", "--config", &config_arg, "--exit-when-done"]);
    let child = cmd.spawn().expect("run starts");
    let pid = child.id();
    let waited = tokio::task::spawn_blocking(move || child.wait_with_output());
    let out = tokio::time::timeout(Duration::from_secs(60), waited)
        .await
        .unwrap_or_else(|_| {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("run --exit-when-done did not exit")
        })
        .expect("join")
        .expect("output");
    assert!(out.status.success(), "{out:?}");
    one_each(&all_results(&c).await, &want);
    assert_eq!(c.outstanding("ewd").await.expect("count"), 0);
}

/// Found in a full test run: `a_postgres_restart_mid_drain_loses_nothing`
/// failed to open its second client with "deadlock detected". Every open
/// ran the schema script, whose `CREATE INDEX IF NOT EXISTS` and `ALTER
/// TABLE … ADD COLUMN IF NOT EXISTS` lock `async_requests` even when
/// nothing is missing, against the claims of a dispatcher draining it. An
/// open of a database whose schema is in place must take no table lock:
/// here a transaction holding a claim's lock on the table stays open
/// while a producer's client opens.
#[tokio::test(flavor = "multi_thread")]
async fn opening_a_database_in_use_waits_for_no_table_lock() {
    let pg = Postgres::start();
    let _first = client(&pg).await;
    let holder = session(&pg).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE async_requests IN ROW EXCLUSIVE MODE")
        .await
        .expect("a claim's lock held");
    let opened = tokio::time::timeout(Duration::from_secs(20), client(&pg)).await;
    holder.batch_execute("COMMIT").await.expect("released");
    assert!(
        opened.is_ok(),
        "opening waited for the lock of a claim in flight"
    );
}

/// Deadline proximity on PostgreSQL: the waiting rows by time to
/// deadline, behind a gate that stays shut (a page reading saturation 1).
#[tokio::test(flavor = "multi_thread")]
async fn waiting_rows_show_by_time_to_deadline() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};
    let pg = Postgres::start();
    let page = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(200).set_body_string("pool_saturation 1\n"))
        .mount(&page)
        .await;
    let c = client(&pg).await;
    let now = unix_secs();
    for (i, deadline) in crate::telemetry_http::due_deadlines(now)
        .into_iter()
        .enumerate()
    {
        submit(&c, "due", &[format!("d-{i}")], deadline).await;
    }
    let gate = format!(
        "gate_type = \"endpoint-scrape\"\ngate_params = {{ url = \"{}/metrics\", metric = \"pool_saturation\" }}",
        page.uri()
    );
    let toml = app_toml(&pg, "http://127.0.0.1:9", "due", &gate);
    let config = Config::from_toml_str(&toml, &Default::default()).expect("valid config");
    let app = support::start_app(&config).await;
    let base = format!("http://{}/metrics", app.running.telemetry_addr);
    crate::telemetry_http::assert_due_profile(&base, "due", now, "sql").await;
    app.stop().await;
}

/// Found by the chaos soak (a run stalled at 49 997 of 50 000 results): a
/// result's `seq` is taken at insert, so one committing late sits below a
/// result already readable. A reader must not pass the missing position
/// while the row after it is fresh, and must pass a position that never
/// fills (a rolled-back insert) once that row has settled.
#[tokio::test(flavor = "multi_thread")]
async fn a_result_committed_late_is_not_passed_over() {
    let pg = Postgres::start();
    let c = client(&pg).await;
    let late = session(&pg).await;
    let insert = |id: &str| {
        format!(
            "INSERT INTO async_results (route, id, request_token, payload, created_at)
             VALUES ('{ROUTE}', '{id}', 't', '{{}}',
                     (extract(epoch FROM clock_timestamp()) * 1000)::bigint)"
        )
    };
    late.batch_execute(&format!("BEGIN; {}", insert("late")))
        .await
        .expect("an insert left uncommitted");
    pg.psql(&insert("early"));
    let ids = |rows: Vec<sluicegate::queue::sql::StoredResult>| -> Vec<String> {
        rows.into_iter().map(|r| r.id).collect()
    };
    let read = c.results_after(ROUTE, 0, 10).await.expect("read");
    assert_eq!(
        ids(read),
        Vec::<String>::new(),
        "passed a position still committing"
    );
    late.batch_execute("COMMIT").await.expect("committed");
    let read = c.results_after(ROUTE, 0, 10).await.expect("read");
    assert_eq!(ids(read), ["late", "early"]);

    // A position that never fills holds readers back only until the row
    // after it has settled.
    late.batch_execute(&format!("BEGIN; {}; ROLLBACK", insert("never")))
        .await
        .expect("rolled back");
    pg.psql(&insert("after-gap"));
    let cursor = c.results_after(ROUTE, 0, 10).await.expect("read")[1].seq;
    assert!(
        c.results_after(ROUTE, cursor, 10)
            .await
            .expect("read")
            .is_empty()
    );
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let read = ids(c.results_after(ROUTE, cursor, 10).await.expect("read"));
        if !read.is_empty() {
            assert_eq!(read, ["after-gap"]);
            break;
        }
        assert!(std::time::Instant::now() < give_up, "a gap held for good");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
