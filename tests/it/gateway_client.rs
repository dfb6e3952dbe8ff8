//! The gateway client against scripted gateways (wiremock) and raw sockets
//! on loopback: classification, timeouts, body limits, headers, endpoint
//! confinement and byte-for-byte forwarding.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use sluicegate::gateway::{
    AttemptFailure, AttemptOutcome, EndpointError, GatewayClient, GatewaySettings, PrepareError,
    PreparedRequest, Target,
};
use sluicegate::request::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const PAYLOAD: &str = r#"{ "model" : "m",  "prompt":"caf\u00e9 ü", "n": 1.50 }"#;

fn settings() -> GatewaySettings {
    GatewaySettings {
        attempt_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        max_response_bytes: 1024,
        ..GatewaySettings::default()
    }
}

fn client() -> GatewayClient {
    GatewayClient::new(settings()).expect("valid settings")
}

fn request_json(extra: &str) -> Request {
    let text = format!(r#"{{"id":"r1","deadline":4000000000,"payload":{PAYLOAD}{extra}}}"#);
    serde_json::from_str(&text).expect("valid request")
}

fn target(server: &MockServer, objective: Option<&str>) -> Target {
    Target::new(
        &server.uri(),
        "/v1/completions",
        objective.map(str::to_owned),
    )
    .expect("valid target")
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

async fn send_to(server: &MockServer) -> AttemptOutcome {
    let c = client();
    let prepared = c
        .prepare(&target(server, None), &request_json(""))
        .expect("prepares");
    c.send(&prepared, soon()).await
}

async fn answering(template: ResponseTemplate) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/completions"))
        .respond_with(template)
        .mount(&server)
        .await;
    server
}

/// The single request the server received.
async fn only_request(server: &MockServer) -> wiremock::Request {
    let mut received = server.received_requests().await.expect("recording is on");
    assert_eq!(received.len(), 1, "expected exactly one request");
    received.remove(0)
}

fn header<'a>(request: &'a wiremock::Request, name: &str) -> Option<&'a str> {
    request
        .headers
        .get(name)
        .map(|v| v.to_str().expect("ascii header"))
}

// --- classification -------------------------------------------------------

#[tokio::test]
async fn success_returns_status_and_body() {
    let server = answering(ResponseTemplate::new(200).set_body_string(r#"{"ok":true}"#)).await;
    assert_eq!(
        send_to(&server).await,
        AttemptOutcome::Success {
            status: 200,
            body: r#"{"ok":true}"#.into()
        }
    );
}

#[tokio::test]
async fn client_error_is_final_with_body() {
    let server = answering(ResponseTemplate::new(400).set_body_string("bad prompt")).await;
    assert_eq!(
        send_to(&server).await,
        AttemptOutcome::Final {
            status: 400,
            body: "bad prompt".into()
        }
    );
}

#[tokio::test]
async fn too_many_requests_is_congestion_with_retry_after_seconds() {
    let server = answering(
        ResponseTemplate::new(429)
            .insert_header("retry-after", "7")
            .insert_header("x-llm-d-request-dropped-reason", "pool saturated")
            .set_body_string("slow down"),
    )
    .await;
    assert_eq!(
        send_to(&server).await,
        AttemptOutcome::Congested {
            status: 429,
            body: "slow down".into(),
            retry_after: Some(Duration::from_secs(7)),
            dropped_reason: Some("pool saturated".into()),
        }
    );
}

#[tokio::test]
async fn unavailable_is_congestion_with_http_date_retry_after() {
    let at = SystemTime::now() + Duration::from_secs(120);
    let server = answering(
        ResponseTemplate::new(503).insert_header("retry-after", httpdate::fmt_http_date(at)),
    )
    .await;
    match send_to(&server).await {
        AttemptOutcome::Congested {
            status: 503,
            retry_after: Some(delay),
            dropped_reason: None,
            ..
        } => assert!(
            delay > Duration::from_secs(100) && delay <= Duration::from_secs(120),
            "{delay:?}"
        ),
        other => panic!("expected congestion, got {other:?}"),
    }
}

#[tokio::test]
async fn garbage_retry_after_is_ignored() {
    let server = answering(ResponseTemplate::new(429).insert_header("retry-after", "soon")).await;
    let outcome = send_to(&server).await;
    assert!(
        matches!(outcome, AttemptOutcome::Congested { .. }),
        "{outcome:?}"
    );
    assert_eq!(outcome.retry_after(), None);
}

#[tokio::test]
async fn server_error_is_retryable_and_keeps_the_answer() {
    let server = answering(
        ResponseTemplate::new(500)
            .insert_header("retry-after", "3")
            .set_body_string("engine died"),
    )
    .await;
    let outcome = send_to(&server).await;
    assert_eq!(
        outcome,
        AttemptOutcome::Retryable {
            failure: AttemptFailure::Http {
                status: 500,
                body: "engine died".into()
            },
            retry_after: Some(Duration::from_secs(3)),
        }
    );
    assert_eq!(outcome.status(), Some(500));
}

#[tokio::test]
async fn not_implemented_is_final() {
    let server = answering(ResponseTemplate::new(501).set_body_string("no")).await;
    assert!(matches!(
        send_to(&server).await,
        AttemptOutcome::Final { status: 501, .. }
    ));
}

#[tokio::test]
async fn redirects_are_final_and_not_followed() {
    let elsewhere = answering(ResponseTemplate::new(200)).await;
    let server = answering(
        ResponseTemplate::new(302)
            .insert_header("location", format!("{}/v1/completions", elsewhere.uri())),
    )
    .await;
    assert!(matches!(
        send_to(&server).await,
        AttemptOutcome::Final { status: 302, .. }
    ));
    let followed = elsewhere
        .received_requests()
        .await
        .expect("recording is on");
    assert!(followed.is_empty());
}

#[tokio::test]
async fn connection_refused_is_retryable_connect() {
    // Bind a port, then free it: nobody listens there.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let c = client();
    let t = Target::new(&format!("http://127.0.0.1:{port}"), "/v1/completions", None)
        .expect("valid target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    let outcome = c.send(&prepared, soon()).await;
    match outcome {
        AttemptOutcome::Retryable {
            failure: failure @ AttemptFailure::Connect(_),
            retry_after: None,
        } => {
            assert_eq!(failure.label(), "connect");
            assert!(!failure.to_string().contains("127.0.0.1"), "{failure}");
        }
        other => panic!("expected a connect failure, got {other:?}"),
    }
}

#[tokio::test]
async fn connection_closed_without_answer_is_retryable_reset() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = [0u8; 1024];
        let _ = socket.read(&mut buf).await;
        let _ = socket.write_all(b"HTTP/1.1 200 OK\r\nContent-Le").await;
        // Dropping the socket closes it mid-answer.
    });
    let c = client();
    let t = Target::new(&format!("http://{addr}"), "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    let outcome = c.send(&prepared, soon()).await;
    server.await.expect("server task");
    match outcome {
        AttemptOutcome::Retryable {
            failure: AttemptFailure::Reset(_),
            ..
        } => {}
        other => panic!("expected a reset, got {other:?}"),
    }
}

#[tokio::test]
async fn body_cut_short_on_success_is_retryable() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = [0u8; 4096];
        let _ = socket.read(&mut buf).await;
        let _ = socket
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\":")
            .await;
    });
    let c = client();
    let t = Target::new(&format!("http://{addr}"), "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    let outcome = c.send(&prepared, soon()).await;
    server.await.expect("server task");
    match outcome {
        AttemptOutcome::Retryable {
            failure: failure @ AttemptFailure::Body(_),
            ..
        } => assert_eq!(failure.label(), "body"),
        other => panic!("expected a body failure, got {other:?}"),
    }
}

// --- time bounds --------------------------------------------------------------

#[tokio::test]
async fn hang_past_the_attempt_timeout_is_retryable_timeout() {
    let server = answering(ResponseTemplate::new(200).set_delay(Duration::from_secs(30))).await;
    let c = GatewayClient::new(GatewaySettings {
        attempt_timeout: Duration::from_millis(200),
        ..settings()
    })
    .expect("valid settings");
    let prepared = c
        .prepare(&target(&server, None), &request_json(""))
        .expect("prepares");
    assert_eq!(
        c.send(&prepared, soon()).await,
        AttemptOutcome::Retryable {
            failure: AttemptFailure::Timeout,
            retry_after: None
        }
    );
}

#[tokio::test]
async fn deadline_reached_during_the_attempt_is_deadline_exceeded() {
    let server = answering(ResponseTemplate::new(200).set_delay(Duration::from_secs(30))).await;
    let c = client(); // attempt timeout 10 s, far beyond the deadline
    let prepared = c
        .prepare(&target(&server, None), &request_json(""))
        .expect("prepares");
    let deadline = Instant::now() + Duration::from_millis(200);
    assert_eq!(
        c.send(&prepared, deadline).await,
        AttemptOutcome::DeadlineExceeded
    );
}

#[tokio::test]
async fn past_deadline_sends_nothing() {
    let server = answering(ResponseTemplate::new(200)).await;
    let c = client();
    let prepared = c
        .prepare(&target(&server, None), &request_json(""))
        .expect("prepares");
    let past = Instant::now()
        .checked_sub(Duration::from_secs(1))
        .expect("clock has run for a second");
    assert_eq!(
        c.send(&prepared, past).await,
        AttemptOutcome::DeadlineExceeded
    );
    let expired = sluicegate::gateway::deadline_instant(1);
    assert_eq!(
        c.send(&prepared, expired).await,
        AttemptOutcome::DeadlineExceeded
    );
    let received = server.received_requests().await.expect("recording is on");
    assert_eq!(received.len(), 0);
}

// --- body limit -------------------------------------------------------------------

#[tokio::test]
async fn success_larger_than_the_limit_is_body_too_large() {
    let server = answering(ResponseTemplate::new(200).set_body_string("x".repeat(4096))).await;
    let outcome = send_to(&server).await;
    assert_eq!(
        outcome,
        AttemptOutcome::Failed {
            failure: AttemptFailure::BodyTooLarge { limit: 1024 }
        }
    );
    assert!(!outcome.is_retryable());
}

#[tokio::test]
async fn chunked_success_larger_than_the_limit_is_body_too_large() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = [0u8; 4096];
        let _ = socket.read(&mut buf).await;
        let _ = socket
            .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            .await;
        let chunk = format!("200\r\n{}\r\n", "y".repeat(0x200));
        for _ in 0..8 {
            if socket.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
        }
        let _ = socket.write_all(b"0\r\n\r\n").await;
    });
    let c = client();
    let t = Target::new(&format!("http://{addr}"), "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    let outcome = c.send(&prepared, soon()).await;
    server.await.expect("server task");
    assert_eq!(
        outcome,
        AttemptOutcome::Failed {
            failure: AttemptFailure::BodyTooLarge { limit: 1024 }
        }
    );
}

#[tokio::test]
async fn body_exactly_at_the_limit_is_kept() {
    let server = answering(ResponseTemplate::new(200).set_body_string("z".repeat(1024))).await;
    match send_to(&server).await {
        AttemptOutcome::Success { body, .. } => assert_eq!(body.len(), 1024),
        other => panic!("expected success, got {other:?}"),
    }
}

#[tokio::test]
async fn oversized_error_body_is_truncated_and_classified_by_status() {
    let server = answering(ResponseTemplate::new(400).set_body_string("e".repeat(5000))).await;
    match send_to(&server).await {
        AttemptOutcome::Final { status: 400, body } => assert_eq!(body.len(), 1024),
        other => panic!("expected final 400, got {other:?}"),
    }
}

#[tokio::test]
async fn invalid_utf8_body_is_decoded_lossily() {
    let server = answering(ResponseTemplate::new(200).set_body_bytes(vec![b'o', 0xff, b'k'])).await;
    assert_eq!(
        send_to(&server).await,
        AttemptOutcome::Success {
            status: 200,
            body: "o\u{fffd}k".into()
        }
    );
}

// --- forwarding and headers ---------------------------------------------------------

#[tokio::test]
async fn payload_is_forwarded_byte_for_byte() {
    let server = answering(ResponseTemplate::new(200)).await;
    send_to(&server).await;
    let received = only_request(&server).await;
    assert_eq!(received.body, PAYLOAD.as_bytes());
    assert_eq!(header(&received, "content-type"), Some("application/json"));
}

#[tokio::test]
async fn sends_objective_message_headers_fairness_and_trace_context() {
    let server = answering(ResponseTemplate::new(200)).await;
    let c = client();
    let request = request_json(
        r#","headers":{"x-custom":"v1","X-Gateway-Inference-Objective":"from-message","x-llm-d-inference-fairness-id":"overridden"},
           "metadata":{"userid":"tenant-7",
                       "traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                       "tracestate":"vendor=abc"}"#,
    );
    let prepared = c
        .prepare(&target(&server, Some("batch-objective")), &request)
        .expect("prepares");
    assert_eq!(c.send(&prepared, soon()).await.label(), "success");
    let received = only_request(&server).await;
    assert_eq!(header(&received, "x-custom"), Some("v1"));
    // Per-message headers override the objective (later wins) ...
    assert_eq!(
        header(&received, "x-gateway-inference-objective"),
        Some("from-message")
    );
    // ... and the fairness id from metadata overrides per-message headers.
    assert_eq!(
        header(&received, "x-llm-d-inference-fairness-id"),
        Some("tenant-7")
    );
    assert_eq!(
        header(&received, "traceparent"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(header(&received, "tracestate"), Some("vendor=abc"));
}

#[tokio::test]
async fn objective_goes_in_the_configured_header() {
    let server = MockServer::start().await;
    let c = GatewayClient::new(GatewaySettings {
        objective_header: "x-llm-d-inference-objective".into(),
        ..settings()
    })
    .expect("valid settings");
    let prepared = c
        .prepare(&target(&server, Some("obj")), &request_json(""))
        .expect("prepares");
    let headers = prepared.headers();
    assert_eq!(
        headers
            .get("x-llm-d-inference-objective")
            .map(|v| v.as_bytes()),
        Some(&b"obj"[..])
    );
    assert!(headers.get("x-gateway-inference-objective").is_none());
}

#[tokio::test]
async fn bad_fairness_ids_and_trace_context_are_skipped_not_fatal() {
    let server = MockServer::start().await;
    let c = client();
    let long = "u".repeat(257);
    for userid in ["", long.as_str(), "a\u{7f}b", "tab\u{0}null"] {
        let extra = format!(
            r#","metadata":{{"userid":{},"traceparent":"not-a-trace","tracestate":"x=1"}}"#,
            serde_json::to_string(userid).expect("string")
        );
        let prepared = c
            .prepare(&target(&server, None), &request_json(&extra))
            .expect("still prepares");
        let headers = prepared.headers();
        assert!(headers.get("x-llm-d-inference-fairness-id").is_none());
        assert!(headers.get("traceparent").is_none());
        assert!(headers.get("tracestate").is_none());
    }
    let exactly = "u".repeat(256);
    let extra = format!(r#","metadata":{{"userid":"{exactly}"}}"#);
    let prepared = c
        .prepare(&target(&server, None), &request_json(&extra))
        .expect("prepares");
    assert!(
        prepared
            .headers()
            .get("x-llm-d-inference-fairness-id")
            .is_some()
    );
}

#[tokio::test]
async fn fairness_attribute_is_configurable_and_can_be_off() {
    let server = MockServer::start().await;
    let extra = r#","metadata":{"userid":"u1","tenant":"t1"}"#;
    let by_tenant = GatewayClient::new(GatewaySettings {
        fairness_attribute: Some("tenant".into()),
        ..settings()
    })
    .expect("valid");
    let prepared = by_tenant
        .prepare(&target(&server, None), &request_json(extra))
        .expect("prepares");
    assert_eq!(
        prepared
            .headers()
            .get("x-llm-d-inference-fairness-id")
            .map(|v| v.as_bytes()),
        Some(&b"t1"[..])
    );
    let off = GatewayClient::new(GatewaySettings {
        fairness_attribute: None,
        ..settings()
    })
    .expect("valid");
    let prepared = off
        .prepare(&target(&server, None), &request_json(extra))
        .expect("prepares");
    assert!(
        prepared
            .headers()
            .get("x-llm-d-inference-fairness-id")
            .is_none()
    );
}

fn prepare_with_headers(c: &GatewayClient, headers: &str) -> Result<PreparedRequest, PrepareError> {
    let target = Target::new("http://gw.local:8080", "/v1/completions", None).expect("target");
    c.prepare(&target, &request_json(&format!(r#","headers":{headers}"#)))
}

#[test]
fn header_injection_is_refused() {
    let c = client();
    let cases = [
        (r#"{"x-a":"b\r\nx-evil: 1"}"#, "value"),
        (r#"{"x-a":"b\nx-evil: 1"}"#, "value"),
        (r#"{"x-a":"b\u0000"}"#, "value"),
        (r#"{"x-a\r\nx-evil":"1"}"#, "name"),
        (r#"{"bad name":"1"}"#, "name"),
        (r#"{"x-a:":"1"}"#, "name"),
        (r#"{"":"1"}"#, "name"),
        (r#"{"Host":"evil.com"}"#, "forbidden"),
        (r#"{"Content-Length":"0"}"#, "forbidden"),
        (r#"{"Transfer-Encoding":"chunked"}"#, "forbidden"),
        (r#"{"Connection":"close"}"#, "forbidden"),
        (r#"{"Proxy-Authorization":"x"}"#, "forbidden"),
        (r#"{"Upgrade":"h2c"}"#, "forbidden"),
    ];
    for (headers, kind) in cases {
        let result = prepare_with_headers(&c, headers);
        let matched = matches!(
            (&result, kind),
            (Err(PrepareError::InvalidHeaderValue { .. }), "value")
                | (Err(PrepareError::InvalidHeaderName { .. }), "name")
                | (Err(PrepareError::ForbiddenHeader { .. }), "forbidden")
        );
        assert!(matched, "{headers}: {result:?}");
        if let Err(error) = result {
            assert_eq!(error.error_code().as_str(), "INVALID_REQUEST");
            assert!(!error.to_string().contains("evil.com"), "{error}");
        }
    }
}

#[tokio::test]
async fn bearer_token_is_sent_and_cannot_be_replaced() {
    let server = answering(ResponseTemplate::new(200)).await;
    let c = GatewayClient::new(GatewaySettings {
        bearer_token: Some("tok-123".into()),
        ..settings()
    })
    .expect("valid settings");
    assert!(matches!(
        prepare_with_headers(&c, r#"{"Authorization":"Bearer other"}"#),
        Err(PrepareError::ForbiddenHeader { .. })
    ));
    let prepared = c
        .prepare(&target(&server, None), &request_json(""))
        .expect("prepares");
    assert!(!format!("{prepared:?}").contains("tok-123"));
    c.send(&prepared, soon()).await;
    let received = only_request(&server).await;
    assert_eq!(header(&received, "authorization"), Some("Bearer tok-123"));
}

#[test]
fn message_authorization_is_allowed_without_a_configured_token() {
    let c = client();
    let prepared =
        prepare_with_headers(&c, r#"{"Authorization":"Bearer mine"}"#).expect("prepares");
    assert!(!format!("{prepared:?}").contains("mine"));
    assert!(prepared.headers().get("authorization").is_some());
}

// --- endpoints ----------------------------------------------------------------------

#[test]
fn endpoints_off_the_gateway_are_refused() {
    let c = client();
    let target = Target::new("http://gw.local:8080", "/v1/completions", None).expect("target");
    for endpoint in [
        "http://evil.com/v1/completions",
        "http://gw.local:9999/v1/completions",
        "https://gw.local:8080/v1/completions",
        "//evil.com/x",
        "/../x",
        "/v1/../../x",
        "/v1/%2e%2e/x",
        "/\\evil.com",
        "relative/path",
    ] {
        let request = request_json(&format!(
            r#","endpoint":"{}""#,
            endpoint.replace('\\', "\\\\")
        ));
        match c.prepare(&target, &request) {
            Err(PrepareError::Endpoint(
                EndpointError::OffHost { .. }
                | EndpointError::SchemeRelative
                | EndpointError::DotSegment
                | EndpointError::IllegalCharacter
                | EndpointError::NotAPath,
            )) => {}
            other => panic!("{endpoint}: expected an endpoint error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn endpoint_on_the_gateway_is_used() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(ResponseTemplate::new(200).set_body_string("chat"))
        .mount(&server)
        .await;
    let c = client();
    let t = target(&server, None);
    let relative = c
        .prepare(&t, &request_json(r#","endpoint":"/v1/chat/completions""#))
        .expect("relative endpoint");
    let absolute = c
        .prepare(
            &t,
            &request_json(&format!(
                r#","endpoint":"{}/v1/chat/completions""#,
                server.uri()
            )),
        )
        .expect("absolute endpoint on the same origin");
    for prepared in [relative, absolute] {
        assert_eq!(
            c.send(&prepared, soon()).await,
            AttemptOutcome::Success {
                status: 200,
                body: "chat".into()
            }
        );
    }
}

/// A minimal HTTP/1.1 keep-alive server answering `200 ok` to every
/// request; returns its address and a counter of accepted connections.
async fn counting_server() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut pending = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    // Answer every complete request (headers + declared body).
                    while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&pending[..end]).to_ascii_lowercase();
                        let body_len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if pending.len() < end + 4 + body_len {
                            break;
                        }
                        pending.drain(..end + 4 + body_len);
                        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if socket.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => pending.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    (addr, connections)
}

#[tokio::test]
async fn clones_share_one_connection_pool() {
    let (addr, connections) = counting_server().await;
    let c = client();
    let clone = c.clone();
    let t = Target::new(&format!("http://{addr}"), "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    for client in [&c, &clone, &c, &clone] {
        assert_eq!(
            client.send(&prepared, soon()).await,
            AttemptOutcome::Success {
                status: 200,
                body: "ok".into()
            }
        );
    }
    assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// `http2_prior_knowledge` speaks HTTP/2 to a gateway that only accepts
/// HTTP/2 with prior knowledge (h2c), and many requests share one
/// connection.
#[tokio::test]
async fn http2_prior_knowledge_multiplexes_requests_over_one_connection() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = connections.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let service = hyper::service::service_fn(|request: hyper::Request<_>| async move {
                let version = format!("{:?}", request.version());
                Ok::<_, std::convert::Infallible>(hyper::Response::new(axum::body::Body::from(
                    version,
                )))
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service),
            );
        }
    });
    let c = GatewayClient::new(GatewaySettings {
        http2_prior_knowledge: true,
        ..settings()
    })
    .expect("valid settings");
    let t = Target::new(&format!("http://{addr}"), "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    let answers = futures_util::future::join_all((0..20).map(|_| c.send(&prepared, soon()))).await;
    for answer in answers {
        match answer {
            AttemptOutcome::Success { status, body } => {
                assert_eq!(status, 200);
                assert_eq!(body, "HTTP/2.0");
            }
            other => panic!("expected an HTTP/2 answer, got {other:?}"),
        }
    }
    assert_eq!(
        connections.load(Ordering::SeqCst),
        1,
        "one shared connection"
    );
}

/// A raw HTTP/1.1 server on loopback for the client's own framing and
/// keep-alive: the n-th accepted connection answers its requests with the
/// n-th list of scripted answers (raw bytes, sent whole; an empty one
/// closes the connection after reading the request), then closes.
/// Returns the base URL and the number of connections accepted.
async fn scripted(connections: Vec<Vec<&'static str>>) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        for answers in connections {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                for answer in answers {
                    // An empty answer reads the request and closes unanswered.
                    if read_request(&mut socket).await.is_none() || answer.is_empty() {
                        return;
                    }
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
                // Dropping the socket closes the connection.
            });
        }
    });
    (url, accepted)
}

/// Reads one request (head and `content-length` body); `None` at the end.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&bytes[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if bytes.len() >= end + 4 + length {
                return Some(bytes);
            }
        }
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
}

async fn send_plain(c: &GatewayClient, url: &str) -> AttemptOutcome {
    let t = Target::new(url, "/v1/completions", None).expect("target");
    let prepared = c.prepare(&t, &request_json("")).expect("prepares");
    c.send(&prepared, soon()).await
}

fn success(body: &str) -> AttemptOutcome {
    AttemptOutcome::Success {
        status: 200,
        body: body.to_owned(),
    }
}

const OK_ANSWER: &str = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

#[tokio::test]
async fn keep_alive_connections_are_reused_and_a_close_is_honoured() {
    let closing = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok";
    let (url, accepted) =
        scripted(vec![vec![OK_ANSWER, OK_ANSWER, closing], vec![OK_ANSWER]]).await;
    let c = client();
    for _ in 0..4 {
        assert_eq!(send_plain(&c, &url).await, success("ok"));
    }
    // Three requests on the first connection (the third said close), the
    // fourth on a new one.
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// The keep-alive race: the server closed a pooled connection while it
/// was idle. The request goes out again on a new connection instead of
/// failing as a reset (which would hold the pool as congestion).
#[tokio::test]
async fn a_pooled_connection_the_server_closed_is_replaced_not_failed() {
    let (url, accepted) = scripted(vec![vec![OK_ANSWER], vec![OK_ANSWER]]).await;
    let c = client();
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    // Let the server's close reach us; the pooled socket is now stale.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// The race the liveness check cannot see: the server closes a pooled
/// connection just as the request goes out, so not one answer byte comes.
/// That exchange is made once more on a new connection.
#[tokio::test]
async fn a_pooled_connection_closed_under_the_request_is_retried_once() {
    let (url, accepted) = scripted(vec![vec![OK_ANSWER, ""], vec![OK_ANSWER]]).await;
    let c = client();
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn interim_answers_chunked_bodies_and_bodies_until_close_are_read() {
    let (url, _) = scripted(vec![
        vec![
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4;x=y\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\nx-trailer: t\r\n\r\n",
            OK_ANSWER,
        ],
        vec!["HTTP/1.1 200 OK\r\n\r\nuntil the end"],
    ])
    .await;
    let c = client();
    assert_eq!(send_plain(&c, &url).await, success("{\"a\":1}"));
    // The chunked answer ended cleanly, so its connection serves the next.
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    // Then the server closes that connection; the next answer has no
    // length and ends with its connection.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send_plain(&c, &url).await, success("until the end"));
}

#[tokio::test]
async fn a_garbled_answer_is_a_reset_and_its_connection_is_dropped() {
    let (url, accepted) =
        scripted(vec![vec!["SSH-2.0-OpenSSH_9.2\r\n\r\n"], vec![OK_ANSWER]]).await;
    let c = client();
    match send_plain(&c, &url).await {
        AttemptOutcome::Retryable {
            failure: AttemptFailure::Reset(reason),
            ..
        } => assert!(reason.contains("invalid answer head"), "{reason}"),
        other => panic!("expected a reset, got {other:?}"),
    }
    assert_eq!(send_plain(&c, &url).await, success("ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// A gateway may refuse before it reads a large body (a 413, a 429 from
/// the endpoint picker) and stop reading. The answer is taken as it
/// comes, not after a body write that can never finish.
#[tokio::test]
async fn an_answer_before_the_body_is_read_is_taken() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut first = [0u8; 1024];
        let _ = socket.read(&mut first).await;
        let _ = socket
            .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo long")
            .await;
        // Keep the connection open, reading nothing more, until the client
        // gives up on it.
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let c = client();
    let t = Target::new(&url, "/v1/completions", None).expect("target");
    let big: Request = serde_json::from_value(serde_json::json!({
        "id": "big",
        "deadline": 4_000_000_000u64,
        "payload": {"model": "m", "prompt": "p".repeat(16 << 20)}
    }))
    .expect("valid request");
    let prepared = c.prepare(&t, &big).expect("prepares");
    let outcome = tokio::time::timeout(Duration::from_secs(20), c.send(&prepared, soon()))
        .await
        .expect("the answer is taken before the body is written");
    assert_eq!(
        outcome,
        AttemptOutcome::Final {
            status: 413,
            body: "too long".into()
        }
    );
    server.abort();
}
