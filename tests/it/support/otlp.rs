//! An OTLP/HTTP trace receiver on a free loopback port: accepts
//! `POST /v1/traces` (protobuf `ExportTraceServiceRequest`), decodes it
//! and records every span.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

/// One received span, decoded.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    /// Span name.
    pub name: String,
    /// Trace id, lowercase hex.
    pub trace_id: String,
    /// Span id, lowercase hex.
    pub span_id: String,
    /// Parent span id, lowercase hex; empty for a root span.
    pub parent_span_id: String,
    /// Attributes, values as text (ints and doubles formatted, strings as is).
    pub attributes: Vec<(String, String)>,
    /// The `service.name` of the resource that sent it.
    pub service_name: Option<String>,
}

impl ReceivedSpan {
    /// The value of attribute `key`, as text.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The running receiver; stops when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    /// `http://127.0.0.1:PORT` (the `OTEL_EXPORTER_OTLP_ENDPOINT` value).
    pub endpoint: String,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<usize>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Shared {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<usize>>,
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn traces(State(shared): State<Shared>, body: Bytes) -> (StatusCode, Vec<u8>) {
    *shared.requests.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service_name = resource_spans.resource.as_ref().and_then(|r| {
            r.attributes
                .iter()
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
        });
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.push(ReceivedSpan {
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                text(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                            )
                        })
                        .collect(),
                    service_name: service_name.clone(),
                });
            }
        }
    }
    shared
        .spans
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(received);
    (
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

impl OtlpReceiver {
    /// Starts the receiver on a free 127.0.0.1 port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("local address");
        let shared = Shared {
            spans: Arc::default(),
            requests: Arc::default(),
        };
        let app = axum::Router::new()
            .route("/v1/traces", post(traces))
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            endpoint: format!("http://{addr}"),
            spans: shared.spans,
            requests: shared.requests,
            task,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many export requests arrived (decodable or not).
    pub fn requests(&self) -> usize {
        *self.requests.lock().unwrap_or_else(|p| p.into_inner())
    }
}
