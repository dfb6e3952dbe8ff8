//! The `prometheus-budget` cascade's rules on scripted Prometheus answers:
//! only absent sources fall through, errors and invalid values close the
//! gate, several series are summed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::json;
use sluicegate::config::{EndpointUrl, GateSpec, PrometheusConfig};
use sluicegate::gate::{FailClosed, GateContext, build_gate};
use wiremock::matchers::{method, path, query_param, query_param_contains};
use wiremock::{Mock, MockServer, ResponseTemplate};

const READY: &str = r#"max(llm_d_epp_ready_endpoints{name="p"})"#;
const FLOW: &str = r#"sum(llm_d_epp_flow_control_queue_size{inference_pool="p"})"#;
const FLOW_LEGACY: &str = r#"sum(inference_extension_flow_control_queue_size{inference_pool="p"})"#;
const PER_ENDPOINT: &str = r#"avg(llm_d_epp_per_endpoint_queue_size{name="p"})"#;

fn vector(values: &[&str]) -> ResponseTemplate {
    ResponseTemplate::new(200).set_body_json(json!({"status": "success", "data": {
        "resultType": "vector",
        "result": values.iter().enumerate().map(|(i, v)| json!({"metric": {"i": i.to_string()}, "value": [1.7e9, v]})).collect::<Vec<_>>()
    }}))
}

async fn answer(server: &MockServer, query: &str, response: ResponseTemplate) {
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(query_param("query", query))
        .respond_with(response)
        .mount(server)
        .await;
}

async fn observe(server: &MockServer) -> sluicegate::gate::Observation {
    // Every source is dated by `min(timestamp(...))` of its samples: here
    // the scrape time equals the evaluation time (fresh data).
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(query_param_contains("query", "min(timestamp("))
        .respond_with(vector(&["1.7e9"]))
        .mount(server)
        .await;
    let cfg = PrometheusConfig {
        url: EndpointUrl::new(server.uri().parse().unwrap()),
        bearer_token: None,
        bearer_token_file: None,
        basic_user: None,
        basic_password: None,
        basic_password_file: None,
    };
    let ctx = GateContext::new(
        Some(cfg),
        None,
        Duration::from_millis(10),
        Duration::from_secs(5),
    );
    let spec = GateSpec::parse(
        "prometheus-budget",
        &json!({"pool": "p", "max_concurrency": 10, "baseline": 0.1}),
        "t",
    )
    .unwrap();
    FailClosed::new(build_gate(&spec, &ctx).unwrap(), Duration::from_secs(5))
        .observe()
        .await
}

#[tokio::test]
async fn an_erroring_source_closes_the_gate_instead_of_falling_through() {
    let server = MockServer::start().await;
    answer(&server, READY, vector(&["2"])).await;
    answer(
        &server,
        FLOW,
        ResponseTemplate::new(422)
            .set_body_json(json!({"status": "error", "errorType": "execution", "error": "boom"})),
    )
    .await;
    answer(&server, PER_ENDPOINT, vector(&["0"])).await;
    let o = observe(&server).await;
    assert_eq!(o.budget.get(), 0.0, "{o:?}");
    assert!(!o.source_available);
    assert!(o.reason.contains("flow-control"), "{}", o.reason);
}

#[tokio::test]
async fn absent_sources_fall_through_and_several_series_are_summed() {
    let server = MockServer::start().await;
    answer(&server, READY, vector(&["2"])).await;
    answer(&server, FLOW, vector(&[])).await;
    // Two series (say, two endpoint-picker replicas' views): summed, 3 + 5.
    answer(&server, FLOW_LEGACY, vector(&["3", "5"])).await;
    let o = observe(&server).await;
    assert!(o.source_available, "{o:?}");
    assert!((o.budget.get() - (1.0 - 8.0 / 20.0)).abs() < 1e-9, "{o:?}");
    assert!((o.baseline.get() - 0.1).abs() < 1e-12);
    assert_eq!(o.max_sys, Some(20.0));
}

#[tokio::test]
async fn overload_reads_zero_and_invalid_values_close_the_gate() {
    let server = MockServer::start().await;
    answer(&server, READY, vector(&["2"])).await;
    answer(&server, FLOW, vector(&["50"])).await;
    let o = observe(&server).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");

    for bad in ["NaN", "-1", "+Inf"] {
        let server = MockServer::start().await;
        answer(&server, READY, vector(&[bad])).await;
        let o = observe(&server).await;
        assert!(
            !o.source_available && o.budget.get() == 0.0,
            "ready {bad}: {o:?}"
        );
        let server = MockServer::start().await;
        answer(&server, READY, vector(&["2"])).await;
        answer(&server, FLOW, vector(&[bad])).await;
        let o = observe(&server).await;
        assert!(
            !o.source_available && o.budget.get() == 0.0,
            "queue {bad}: {o:?}"
        );
    }
}
