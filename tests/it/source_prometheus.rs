//! The PromQL source: authentication headers, result shapes and errors,
//! against a scripted HTTP server speaking Prometheus' API.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::json;
use sluicegate::source::{PromAuth, PromClient, SourceError};
use wiremock::matchers::{header, method, path, query_param};
use wiremock::{Mock, MockServer, ResponseTemplate};

fn vector(series: &[(&str, &str)]) -> serde_json::Value {
    json!({"status": "success", "data": {"resultType": "vector", "result":
        series.iter().map(|(pod, v)| json!({"metric": {"pod": pod}, "value": [1.7e9, v]})).collect::<Vec<_>>()
    }})
}

async fn client(server: &MockServer, auth: PromAuth) -> PromClient {
    PromClient::new(
        &server.uri().parse().unwrap(),
        &auth,
        Duration::from_secs(2),
    )
    .unwrap()
}

#[tokio::test]
async fn sends_bearer_and_basic_credentials() {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(header("authorization", "Bearer s3cret"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[("a", "0.5")])))
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(header("authorization", "Basic dTpwdw=="))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[("b", "0.25")])))
        .mount(&server)
        .await;
    let bearer = client(&server, PromAuth::Bearer("s3cret".into())).await;
    assert_eq!(bearer.instant("up").await.unwrap().value[0].value, 0.5);
    let basic = client(
        &server,
        PromAuth::Basic {
            user: "u".into(),
            password: "pw".into(),
        },
    )
    .await;
    assert_eq!(basic.instant("up").await.unwrap().value[0].value, 0.25);
    // No credentials: no mock matches, wiremock answers 404.
    let none = client(&server, PromAuth::None).await;
    assert!(none.instant("up").await.is_err());
    // Credentials never appear in Debug output.
    assert!(!format!("{bearer:?}").contains("s3cret"));
}

#[tokio::test]
async fn returns_every_series_with_labels_and_special_values() {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(query_param("query", "many"))
        .respond_with(ResponseTemplate::new(200).set_body_json(vector(&[
            ("a", "1"),
            ("b", "NaN"),
            ("c", "+Inf"),
        ])))
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(query_param("query", "scalar(1)"))
        .respond_with(ResponseTemplate::new(200).set_body_json(
            json!({"status": "success", "data": {"resultType": "scalar", "result": [1.7e9, "0.75"]}}),
        ))
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(path("/api/v1/query"))
        .and(query_param("query", "bad("))
        .respond_with(ResponseTemplate::new(400).set_body_json(
            json!({"status": "error", "errorType": "bad_data", "error": "parse error"}),
        ))
        .mount(&server)
        .await;
    let c = client(&server, PromAuth::None).await;
    let many = c.instant("many").await.unwrap().value;
    assert_eq!(many.len(), 3);
    assert_eq!(many[0].labels["pod"], "a");
    assert!(many[1].value.is_nan());
    assert_eq!(many[2].value, f64::INFINITY);
    let scalar = c.instant("scalar(1)").await.unwrap().value;
    assert_eq!(scalar.len(), 1);
    assert_eq!(scalar[0].value, 0.75);
    assert!(matches!(
        c.instant("bad(").await,
        Err(SourceError::Query(_))
    ));
}

#[tokio::test]
async fn a_slow_server_times_out() {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(vector(&[("a", "1")]))
                .set_delay(Duration::from_secs(5)),
        )
        .mount(&server)
        .await;
    let c = PromClient::new(
        &server.uri().parse().unwrap(),
        &PromAuth::None,
        Duration::from_millis(200),
    )
    .unwrap();
    assert!(c.instant("up").await.is_err());
}
