//! Metric gates against a real Prometheus (Debian's 2.42) scraping the
//! simulator (or a fixed exporter) every second.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::support::prometheus::{Prometheus, PrometheusSpec};
use crate::support::sim::{flood, small_pool};
use serde_json::json;
use sluicegate::config::{EndpointUrl, GateSpec, PrometheusConfig};
use sluicegate::gate::{Explanation, Observation};
use sluicegate::gate::{FailClosed, GateContext, build_gate};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const STALENESS: Duration = Duration::from_secs(4);

fn context(prom: &Prometheus) -> GateContext {
    let cfg = PrometheusConfig {
        url: EndpointUrl::new(prom.url().parse().unwrap()),
        bearer_token: None,
        bearer_token_file: None,
        basic_user: None,
        basic_password: None,
        basic_password_file: None,
    };
    GateContext::new(Some(cfg), None, Duration::from_millis(250), STALENESS)
}

fn gate(kind: &str, params: serde_json::Value, prom: &Prometheus) -> FailClosed {
    let spec = GateSpec::parse(kind, &params, "test").unwrap();
    FailClosed::new(build_gate(&spec, &context(prom)).unwrap(), STALENESS)
}

fn explained(
    kind: &str,
    params: serde_json::Value,
    prom: &Prometheus,
) -> Box<dyn sluicegate::gate::DispatchGate> {
    let spec = GateSpec::parse(kind, &params, "test").unwrap();
    build_gate(&spec, &context(prom)).unwrap()
}

/// Polls `gate` until `pred` holds, up to `limit`; returns the last reading.
async fn until(
    gate: &FailClosed,
    limit: Duration,
    pred: impl Fn(&Observation) -> bool,
) -> Observation {
    let start = std::time::Instant::now();
    loop {
        let o = gate.observe().await;
        if pred(&o) || start.elapsed() > limit {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn used_source(e: &Explanation) -> Option<&str> {
    e.sources
        .iter()
        .find(|s| s.outcome == "used")
        .map(|s| s.role.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_falls_under_load_and_recovers_when_the_pool_drains() {
    let sim = small_pool().await;
    // An endpoint picker without flow control: the per-endpoint queue answers.
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: vec![".*flow_control.*".into()],
    })
    .await;
    prom.wait_for_sample("llm_d_epp_per_endpoint_queue_size", Duration::from_secs(20))
        .await;
    let params = json!({"pool": "p", "max_concurrency": 10, "baseline": 0.1});
    let g = gate("prometheus-budget", params.clone(), &prom);

    let idle = until(&g, Duration::from_secs(10), |o| o.source_available).await;
    assert!(idle.source_available, "{}", idle.reason);
    assert!(idle.budget.get() > 0.99, "idle pool: {idle:?}");
    assert_eq!(idle.max_sys, Some(20.0), "2 ready × max_concurrency 10");
    // The per-endpoint queue counts waiting requests only: batch work that
    // runs never lowers it, so the window must not add N to it.
    assert!(!idle.sees_own_load);

    let load = flood(&sim, 40, 300).await;
    let busy = until(&g, Duration::from_secs(15), |o| o.budget.get() < 0.5).await;
    assert!(busy.source_available, "{}", busy.reason);
    assert!(busy.budget.get() < 0.5, "loaded pool: {busy:?}");

    for h in load {
        h.await.unwrap();
    }
    let drained = until(&g, Duration::from_secs(15), |o| o.budget.get() > 0.99).await;
    assert!(drained.budget.get() > 0.99, "drained pool: {drained:?}");
    let e = explained("prometheus-budget", params, &prom)
        .explain()
        .await;
    assert_eq!(used_source(&e), Some("per-endpoint queue (current name)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_falls_through_absent_sources_and_names() {
    let sim = small_pool().await;
    // No flow control at all, and only the legacy per-pod queue name.
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: vec![
            ".*flow_control.*".into(),
            "llm_d_epp_per_endpoint_queue_size".into(),
        ],
    })
    .await;
    prom.wait_for_sample("inference_pool_per_pod_queue_size", Duration::from_secs(20))
        .await;
    let g = explained("prometheus-budget", json!({"pool": "p"}), &prom);
    let e = g.explain().await;
    let o = e.observation.as_ref().unwrap();
    assert!(o.source_available && o.budget.get() > 0.99, "{o:?}");
    assert_eq!(
        used_source(&e),
        Some("per-endpoint queue (legacy name)"),
        "{:#?}",
        e.sources
    );
    let outcomes: Vec<(&str, &str)> = e
        .sources
        .iter()
        .map(|s| (s.role.as_str(), s.outcome.as_str()))
        .collect();
    assert!(outcomes.contains(&("flow-control queue (current name)", "no sample")));
    assert!(outcomes.contains(&("flow-control queue (legacy name)", "no sample")));
    assert!(outcomes.contains(&("per-endpoint queue (current name)", "no sample")));

    // With every EPP name present, the flow-control queue (first source) wins.
    let full = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    full.wait_for_sample("llm_d_epp_flow_control_queue_size", Duration::from_secs(20))
        .await;
    let e = explained("prometheus-budget", json!({"pool": "p"}), &full)
        .explain()
        .await;
    assert_eq!(used_source(&e), Some("flow-control queue (current name)"));

    // Saturation: current name, then legacy.
    let e = explained(
        "prometheus-saturation",
        json!({"pool": "p", "threshold": 0.8}),
        &full,
    )
    .explain()
    .await;
    let o = e.observation.as_ref().unwrap();
    assert_eq!(used_source(&e), Some("pool saturation (current name)"));
    assert!((o.baseline.get() - 0.2).abs() < 1e-9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_prometheus_closes_the_gate_within_the_staleness_limit_and_restarting_reopens_it()
{
    let sim = small_pool().await;
    let mut prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    prom.wait_for_sample("llm_d_epp_ready_endpoints", Duration::from_secs(20))
        .await;
    let g = gate("prometheus-budget", json!({"pool": "p"}), &prom);
    let open = until(&g, Duration::from_secs(10), |o| o.is_open()).await;
    assert!(open.is_open(), "{open:?}");

    prom.stop();
    let stopped = std::time::Instant::now();
    let closed = until(&g, STALENESS + Duration::from_secs(3), |o| {
        !o.source_available
    })
    .await;
    assert!(!closed.source_available, "still available: {closed:?}");
    assert_eq!(closed.budget.get(), 0.0);
    assert!(
        stopped.elapsed() <= STALENESS + Duration::from_secs(3),
        "closed after {:?}",
        stopped.elapsed()
    );

    prom.restart().await;
    let reopened = until(&g, Duration::from_secs(20), |o| o.is_open()).await;
    assert!(
        reopened.is_open() && reopened.source_available,
        "{reopened:?}"
    );
}

/// Serves a fixed `/metrics` page.
async fn exporter(page: &'static str) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/metrics"))
        .respond_with(ResponseTemplate::new(200).set_body_string(page))
        .mount(&server)
        .await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_ready_endpoints_reads_closed_not_idle() {
    // Scaled to zero: the EPP reports 0 ready endpoints and an empty queue.
    let zero = exporter(
        "llm_d_epp_ready_endpoints{name=\"z\"} 0\n\
         llm_d_epp_flow_control_queue_size{inference_pool=\"z\"} 0\n\
         inference_pool_ready_pods{name=\"frozen\"} 3\n",
    )
    .await;
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![zero.address().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    prom.wait_for_sample("llm_d_epp_ready_endpoints", Duration::from_secs(20))
        .await;
    let o = gate("prometheus-budget", json!({"pool": "z"}), &prom)
        .observe()
        .await;
    assert_eq!(o.budget.get(), 0.0, "{o:?}");
    assert!(!o.is_open());
    assert_eq!(o.max_sys, Some(0.0));
    assert!(o.reason.contains("no ready endpoints"), "{}", o.reason);

    // The legacy ready-pod gauge froze at 3 but every load metric is gone:
    // closed and unavailable, never idle.
    let o = gate("prometheus-budget", json!({"pool": "frozen"}), &prom)
        .observe()
        .await;
    assert_eq!(o.budget.get(), 0.0, "{o:?}");
    assert!(!o.source_available);
    assert!(o.reason.contains("never idle"), "{}", o.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typo_in_a_metric_name_gives_budget_zero_and_an_unavailable_source() {
    let sim = small_pool().await;
    let prom = Prometheus::start(&PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: Vec::new(),
    })
    .await;
    prom.wait_for_sample("llm_d_epp_ready_endpoints", Duration::from_secs(20))
        .await;

    let good = gate(
        "prometheus-query",
        json!({"query": "1 - max(llm_d_epp_flow_control_pool_saturation)"}),
        &prom,
    )
    .observe()
    .await;
    assert!(good.source_available && good.is_open(), "{good:?}");

    for (kind, params) in [
        (
            "prometheus-query",
            json!({"query": "1 - max(llm_d_epp_flow_control_pool_saturaton)"}),
        ),
        ("prometheus-budget", json!({"pool": "no-such-pool"})),
        ("prometheus-saturation", json!({"pool": "no-such-pool"})),
        ("prometheus-query", json!({"query": "sum(rate(("})),
        ("prometheus-query", json!({"query": "vector(2)"})),
        ("prometheus-query", json!({"query": "vector(0) / 0"})),
    ] {
        let o = gate(kind, params.clone(), &prom).observe().await;
        assert_eq!(o.budget.get(), 0.0, "{kind} {params}: {o:?}");
        assert!(!o.source_available, "{kind} {params}: {o:?}");
    }

    // Opting into a fallback is explicit, and still marked unavailable.
    let o = gate(
        "prometheus-query",
        json!({"query": "no_such_metric", "fallback": 0.3}),
        &prom,
    )
    .observe()
    .await;
    assert_eq!(o.budget.get(), 0.3);
    assert!(!o.source_available);
}
