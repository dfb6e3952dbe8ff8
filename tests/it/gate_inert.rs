//! Inert gates are visible (upstream llm-d-async #363): the running
//! application, with `dispatch.inert_after` short, reports
//! `sluicegate_gate_inert` 1 with the right reason for a gate that can
//! never open against the simulator and for a queue whose `max_sys` caps
//! batch below what the pool shows, and 0 for a gate that opens.

use crate::support;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::sim::small_pool;
use sluicegate::config::Config;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

/// `GET /metrics` of the app.
async fn scrape(client: &reqwest::Client, app: &support::App) -> String {
    client
        .get(format!("http://{}/metrics", app.running.telemetry_addr))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body")
}

/// A pool `/metrics` page whose saturation the test switches.
struct SaturationPage(Arc<AtomicBool>);

impl Respond for SaturationPage {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let saturation = if self.0.load(Ordering::SeqCst) { 1 } else { 0 };
        ResponseTemplate::new(200).set_body_string(format!(
            "# TYPE pool_saturation gauge\npool_saturation {saturation}\n"
        ))
    }
}

/// The value of `sluicegate_gate_inert{queue, reason}` on a `/metrics` page.
fn inert(page: &str, queue: &str, reason: &str) -> Option<i64> {
    page.lines()
        .filter(|l| l.starts_with("sluicegate_gate_inert{"))
        .filter(|l| l.contains(&format!("queue=\"{queue}\"")))
        .find(|l| l.contains(&format!("reason=\"{reason}\"")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Log lines written into a shared buffer (JSON, one per line).
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    /// The process's log capture: a global JSON subscriber installed by
    /// the first test that asks (tests filter lines by their queue names).
    fn global() -> Self {
        static LOGS: OnceLock<Capture> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Capture::default();
            let writer = logs.clone();
            let _ = tracing_subscriber::fmt()
                .json()
                .with_max_level(tracing::Level::INFO)
                .with_writer(move || writer.clone())
                .try_init();
            logs
        })
        .clone()
    }

    /// The `fields` of every captured line whose `event` is `event`.
    fn events(&self, event: &str) -> Vec<serde_json::Value> {
        let text = String::from_utf8(self.0.lock().expect("log buffer").clone()).expect("utf-8");
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v.get("fields").cloned())
            .filter(|f| f["event"] == event)
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_threshold_and_a_low_max_sys_raise_the_gauge_and_an_open_gate_does_not() {
    let logs = Capture::global();
    let sim = small_pool().await;
    let pool_page = format!("{}/metrics", sim.base_url());
    // A gateway that holds every request for a minute: the capped queue's
    // one request stays in flight for the whole test.
    let slow = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_string("{}")
                .set_delay(Duration::from_secs(60)),
        )
        .mount(&slow)
        .await;
    // stuck: `vllm` with baseline 1, which D (at most 1) never exceeds.
    // capped: `constant` (D = 1, the pool's room unknown) with max_sys 1.
    // open: `vllm` with the default baseline against the same pool.
    // Each in its own pool, so one queue's work is not another's in-flight.
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{sim}"
[telemetry]
listen = "127.0.0.1:0"
[dispatch]
poll_interval = "50ms"
receive_wait = "50ms"
inert_after = "1s"
shutdown_grace = "1s"
[[queue]]
queue_name = "stuck"
pool = "stuck"
gate_type = "vllm"
gate_params = {{ urls = ["{pool_page}"], max_num_seqs = 2, baseline = 1.0 }}
[[queue]]
queue_name = "capped"
pool = "capped"
igw_base_url = "{slow}"
max_sys = 1
gate_type = "constant"
[[queue]]
queue_name = "open"
pool = "open"
gate_type = "vllm"
gate_params = {{ urls = ["{pool_page}"], max_num_seqs = 2 }}
"#,
        sim = sim.base_url(),
        slow = slow.uri(),
    );
    let config = Config::from_toml_str(&toml, &BTreeMap::new()).expect("valid config");
    let app = support::start_app(&config).await;
    let deadline = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 600;
    let queues = app.running.transports().memory();
    let by_name = |name: &str| {
        queues
            .iter()
            .find(|q| sluicegate::queue::Queue::name(q.as_ref()) == name)
            .unwrap_or_else(|| panic!("queue {name}"))
            .clone()
    };
    for name in ["stuck", "capped", "open"] {
        let q = by_name(name);
        for i in 0..3 {
            q.push_message(format!(
                r#"{{"id":"{name}-{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hi","max_tokens":4}}}}"#
            ));
        }
    }
    let metrics = format!("http://{}/metrics", app.running.telemetry_addr);
    let client = reqwest::Client::new();
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    let page = loop {
        let page = client
            .get(&metrics)
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("body");
        let done = inert(&page, "stuck", "never_opens") == Some(1)
            && inert(&page, "capped", "max_sys_below_capacity") == Some(1)
            && by_name("open").results().len() == 3;
        if done || tokio::time::Instant::now() > give_up {
            break page;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let gauges: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("sluicegate_gate_inert{"))
        .collect();
    assert_eq!(inert(&page, "stuck", "never_opens"), Some(1), "{gauges:#?}");
    assert_eq!(inert(&page, "stuck", "max_sys_below_capacity"), Some(0));
    assert_eq!(
        inert(&page, "capped", "max_sys_below_capacity"),
        Some(1),
        "{gauges:#?}"
    );
    assert_eq!(inert(&page, "capped", "never_opens"), Some(0));
    // The open gate sent its work and was never inert.
    assert_eq!(by_name("open").results().len(), 3);
    assert_eq!(inert(&page, "open", "never_opens"), Some(0), "{gauges:#?}");
    assert_eq!(inert(&page, "open", "max_sys_below_capacity"), Some(0));
    // Nothing of the stuck queue went out.
    assert!(by_name("stuck").results().is_empty());
    app.stop().await;

    // One WARN line per state entered, naming the queue, the gate type,
    // the reason, the span and the values that show it.
    let entered = logs.events("gate_inert");
    let stuck: Vec<_> = entered.iter().filter(|f| f["queue"] == "stuck").collect();
    assert_eq!(stuck.len(), 1, "{entered:#?}");
    let s = stuck[0];
    assert_eq!(s["reason"], "never_opens");
    assert_eq!(s["gate"], "vllm");
    assert_eq!(s["span_secs"], 1.0);
    assert_eq!(s["baseline"], 1.0);
    assert_eq!(s["budget"], 1.0, "an idle pool reads D = 1: {s}");
    assert_eq!(s["max_sys"], 4.0, "2 engines x max_num_seqs 2");
    assert_eq!(s["own_in_flight"], 0);
    let capped: Vec<_> = entered.iter().filter(|f| f["queue"] == "capped").collect();
    assert_eq!(capped.len(), 1, "{entered:#?}");
    let c = capped[0];
    assert_eq!(c["reason"], "max_sys_below_capacity");
    assert_eq!(c["gate"], "constant");
    assert_eq!(
        (c["max_sys"].clone(), c["ceiling"].clone()),
        (1.0.into(), 1.into())
    );
    assert_eq!(c["own_in_flight"], 1);
    assert!(entered.iter().all(|f| f["queue"] != "open"), "{entered:#?}");
}

/// A pool that reads full for longer than the span is reported (the
/// detector cannot tell it from an unreachable threshold; the runbook
/// says how), and the first reading with room ends it: the gauge goes
/// back to 0 and one `gate no longer inert` line says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_reading_with_room_ends_the_state_with_one_line() {
    let logs = Capture::global();
    let full = Arc::new(AtomicBool::new(true));
    let pool = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/metrics"))
        .respond_with(SaturationPage(full.clone()))
        .mount(&pool)
        .await;
    let toml = format!(
        r#"
transport = "memory"
[gateway]
url = "{pool}"
[telemetry]
listen = "127.0.0.1:0"
[dispatch]
poll_interval = "50ms"
receive_wait = "50ms"
inert_after = "1s"
shutdown_grace = "1s"
[[queue]]
queue_name = "saturated"
gate_type = "endpoint-scrape"
gate_params = {{ url = "{pool}/metrics", metric = "pool_saturation" }}
"#,
        pool = pool.uri(),
    );
    let config = Config::from_toml_str(&toml, &BTreeMap::new()).expect("valid config");
    let app = support::start_app(&config).await;
    let client = reqwest::Client::new();
    let until = |want: i64| {
        let client = client.clone();
        let app = &app;
        async move {
            let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let page = scrape(&client, app).await;
                let got = inert(&page, "saturated", "never_opens");
                if got == Some(want) || tokio::time::Instant::now() > give_up {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(until(1).await, Some(1), "full for the span: inert");
    full.store(false, Ordering::SeqCst);
    assert_eq!(until(0).await, Some(0), "room: no longer inert");
    app.stop().await;

    let entered: Vec<_> = logs
        .events("gate_inert")
        .into_iter()
        .filter(|f| f["queue"] == "saturated")
        .collect();
    assert_eq!(entered.len(), 1, "{entered:#?}");
    assert_eq!(entered[0]["gate"], "endpoint-scrape");
    assert_eq!(entered[0]["reason"], "never_opens");
    assert_eq!(entered[0]["budget"], 0.0);
    assert_eq!(entered[0]["extreme_budget"], 0.0);
    let left: Vec<_> = logs
        .events("gate_not_inert")
        .into_iter()
        .filter(|f| f["queue"] == "saturated")
        .collect();
    assert_eq!(left.len(), 1, "{left:#?}");
    assert_eq!(left[0]["reason"], "never_opens");
    assert_eq!(left[0]["budget"], 1.0, "the reading with room: {}", left[0]);
    assert_eq!(left[0]["source_available"], true);
    assert!(
        left[0]["held_secs"].as_f64().expect("held_secs") >= 1.0,
        "{}",
        left[0]
    );
}
