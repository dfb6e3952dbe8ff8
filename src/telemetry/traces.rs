//! Traces: OTLP/HTTP (protobuf) export of one span per dispatch step,
//! continuing each message's W3C `traceparent`.
//!
//! Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set ([`TraceSettings::from_env`],
//! called once by config loading with the same environment map the config
//! layers read). When off there is no exporter, no provider, and the
//! dispatcher holds `None` instead of a [`Traces`], so the hot path neither
//! parses `traceparent` nor builds spans.
//!
//! Spans of one delivery (names and attribute keys are in
//! `docs/operations.md`, "Traces"): [`RECEIVE`], whose parent is the
//! message's `traceparent` (a new trace when it has none), then
//! [`ADMIT`], [`SEND`] and [`SETTLE`] as children of `receive`.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

/// The generic OTLP endpoint; `/v1/traces` is appended for traces.
pub const ENV_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The traces endpoint, used as given; wins over [`ENV_ENDPOINT`].
pub const ENV_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The generic OTLP protocol; only `http/protobuf` is supported.
pub const ENV_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
/// The traces protocol; wins over [`ENV_PROTOCOL`].
pub const ENV_TRACES_PROTOCOL: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
/// The `service.name` resource attribute (default `sluicegate`).
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
/// Every variable [`TraceSettings::from_env`] reads.
pub const TRACE_ENV_VARS: [&str; 5] = [
    ENV_ENDPOINT,
    ENV_TRACES_ENDPOINT,
    ENV_PROTOCOL,
    ENV_TRACES_PROTOCOL,
    ENV_SERVICE_NAME,
];

/// Span of a message pulled from the queue (parsed and checked).
pub const RECEIVE: &str = "receive";
/// Span of one question to the gate.
pub const ADMIT: &str = "admit";
/// Span of one attempt at the gateway.
pub const SEND: &str = "send";
/// Span of a final result, from hand-off to the result writer to its ack.
pub const SETTLE: &str = "settle";

/// Attribute: the queue's name (every span).
pub const ATTR_QUEUE: &str = "sluicegate.queue";
/// Attribute: the request id (every span).
pub const ATTR_REQUEST_ID: &str = "sluicegate.request.id";
/// Attribute (`receive`): redeliveries of this message so far.
pub const ATTR_RETRY_COUNT: &str = "sluicegate.delivery.retry_count";
/// Attribute (`admit`): the gate's verdict (`continue`, `wait`, `refuse`,
/// `drop`), as in `sluicegate_gate_decisions_total`.
pub const ATTR_VERDICT: &str = "sluicegate.gate.verdict";
/// Attribute (`admit`): the verdict's reason label.
pub const ATTR_REASON: &str = "sluicegate.gate.reason";
/// Attribute (`admit`): the latest budget `D` the gate read.
pub const ATTR_BUDGET: &str = "sluicegate.gate.budget";
/// Attribute (`admit`): the reserved baseline `B`.
pub const ATTR_BASELINE: &str = "sluicegate.gate.baseline";
/// Attribute (`admit`): units the window lets through now.
pub const ATTR_WINDOW_AVAILABLE: &str = "sluicegate.window.available";
/// Attribute (`admit`): this dispatcher's units in flight.
pub const ATTR_WINDOW_IN_FLIGHT: &str = "sluicegate.window.in_flight";
/// Attribute (`send`): the attempt number, 1 for the first.
pub const ATTR_ATTEMPT: &str = "sluicegate.attempt";
/// Attribute (`send`): the attempt's outcome label, as in
/// `sluicegate_attempts_total`, or `abandoned` at shutdown.
pub const ATTR_ATTEMPT_OUTCOME: &str = "sluicegate.attempt.outcome";
/// Attribute (`send`, `settle`): the gateway's HTTP status, when it answered.
pub const ATTR_HTTP_STATUS: &str = "http.response.status_code";
/// Attribute (`settle`): the result's outcome label, as in
/// `sluicegate_outcomes_total`.
pub const ATTR_OUTCOME: &str = "sluicegate.result.outcome";
/// Attribute (`settle`): the result's error code, when it has one.
pub const ATTR_ERROR_CODE: &str = "sluicegate.result.error_code";
/// Attribute (`settle`): `written` once the result writer acknowledged it,
/// `not_written` when it gave up (the message will be redelivered).
pub const ATTR_ACK: &str = "sluicegate.ack";

/// Protocols other than this are refused at load.
const HTTP_PROTOBUF: &str = "http/protobuf";

/// Where and how spans are exported: present only when an OTLP endpoint
/// variable is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    /// The full URL spans are POSTed to (`…/v1/traces`).
    pub endpoint: String,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

/// Why the OTEL variables cannot be used; the variable's name is the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {message}")]
pub struct TraceSettingsError {
    /// The offending variable.
    pub var: &'static str,
    /// What is wrong, lowercase.
    pub message: String,
}

impl TraceSettings {
    /// Reads the OTEL variables from `env` (the map config loading uses):
    /// `None` when neither endpoint variable is set (or both are empty);
    /// an error for a protocol other than `http/protobuf` or an endpoint
    /// that is not an http(s) URL.
    pub fn from_env(env: &BTreeMap<String, String>) -> Result<Option<Self>, TraceSettingsError> {
        let get = |name: &str| env.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
        let (var, endpoint) = match (get(ENV_TRACES_ENDPOINT), get(ENV_ENDPOINT)) {
            (Some(traces), _) => (ENV_TRACES_ENDPOINT, traces.to_owned()),
            (None, Some(base)) => (
                ENV_ENDPOINT,
                format!("{}/v1/traces", base.trim_end_matches('/')),
            ),
            (None, None) => return Ok(None),
        };
        let protocol = get(ENV_TRACES_PROTOCOL)
            .map(|p| (ENV_TRACES_PROTOCOL, p))
            .or_else(|| get(ENV_PROTOCOL).map(|p| (ENV_PROTOCOL, p)));
        if let Some((protocol_var, protocol)) = protocol
            && protocol != HTTP_PROTOBUF
        {
            return Err(TraceSettingsError {
                var: protocol_var,
                message: format!(
                    "protocol `{protocol}` is not supported; sluicegate exports traces over http/protobuf only"
                ),
            });
        }
        match url::Url::parse(&endpoint) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            _ => {
                return Err(TraceSettingsError {
                    var,
                    message: format!("`{endpoint}` is not an http(s) URL"),
                });
            }
        }
        let service_name = get(ENV_SERVICE_NAME).unwrap_or("sluicegate").to_owned();
        Ok(Some(Self {
            endpoint,
            service_name,
        }))
    }
}

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("traces: cannot build the OTLP exporter: {0}")]
pub struct TraceStartError(#[source] opentelemetry_otlp::ExporterBuildError);

/// The installed tracer provider; owned by the application, shut down
/// (flushing every span) in its drain.
#[derive(Debug)]
pub struct TraceExport {
    /// Flushes and stops the batch processor at shutdown.
    provider: SdkTracerProvider,
    /// Handed to every dispatcher.
    traces: Traces,
}

impl TraceExport {
    /// Builds the exporter and the batch processor (on the current tokio
    /// runtime). Must be called inside a runtime.
    pub fn start(settings: &TraceSettings) -> Result<Self, TraceStartError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(settings.endpoint.clone())
            .build()
            .map_err(TraceStartError)?;
        // The async-runtime processor: the reqwest client it drives needs
        // the tokio reactor, which the SDK's own thread would not have.
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(settings.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let traces = Traces {
            tracer: provider.tracer("sluicegate"),
        };
        Ok(Self { provider, traces })
    }

    /// The handle dispatchers make spans with.
    pub fn traces(&self) -> Traces {
        self.traces.clone()
    }

    /// Exports what is buffered and stops, waiting at most `grace`.
    pub async fn shutdown(self, grace: Duration) {
        // The SDK blocks the calling thread until its processor task (on
        // this runtime) has exported: run it off the async threads.
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(grace));
        match tokio::time::timeout(grace, done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "trace export did not finish cleanly"),
            Ok(Err(error)) => tracing::warn!(%error, "trace shutdown task failed"),
            Err(_) => tracing::warn!(
                ?grace,
                "trace export did not finish within the grace period"
            ),
        }
    }
}

/// Makes the spans of each message (cheap to clone).
#[derive(Debug, Clone)]
pub struct Traces {
    /// The provider's tracer.
    tracer: SdkTracer,
}

/// Reads `traceparent`/`tracestate` from message metadata.
struct Metadata<'a>(&'a BTreeMap<String, String>);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

impl Traces {
    /// Records the `receive` span of a delivery (from `received` to now),
    /// continuing the `traceparent` in `metadata`; returns the context the
    /// message's later spans hang under.
    pub fn receive(
        &self,
        metadata: &BTreeMap<String, String>,
        received: SystemTime,
        attributes: Vec<KeyValue>,
    ) -> MessageTrace {
        let parent = TraceContextPropagator::new().extract(&Metadata(metadata));
        let span = self
            .tracer
            .span_builder(RECEIVE)
            .with_kind(SpanKind::Consumer)
            .with_start_time(received)
            .with_attributes(attributes.clone())
            .start_with_context(&self.tracer, &parent);
        let context = parent.with_span(span);
        context.span().end();
        MessageTrace {
            tracer: self.tracer.clone(),
            context,
            common: attributes
                .into_iter()
                .filter(|kv| kv.key.as_str() != ATTR_RETRY_COUNT)
                .collect(),
        }
    }
}

/// The trace of one delivery: the ended `receive` span as parent of the
/// rest.
#[derive(Debug, Clone)]
pub struct MessageTrace {
    /// The provider's tracer.
    tracer: SdkTracer,
    /// Holds the `receive` span.
    context: Context,
    /// Queue and request id, repeated on every span.
    common: Vec<KeyValue>,
}

/// An open span of one step; ended by [`StepSpan::end`] (or on drop).
#[derive(Debug)]
pub struct StepSpan(opentelemetry_sdk::trace::Span);

impl MessageTrace {
    /// Starts span `name` now, under `receive`.
    pub fn start(&self, name: &'static str, kind: SpanKind) -> StepSpan {
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(self.common.clone())
            .start_with_context(&self.tracer, &self.context);
        StepSpan(span)
    }
}

impl StepSpan {
    /// Adds attributes.
    pub fn set(&mut self, attributes: impl IntoIterator<Item = KeyValue>) {
        self.0.set_attributes(attributes);
    }

    /// Marks the step failed (`description` is a bounded label).
    pub fn fail(&mut self, description: &'static str) {
        self.0.set_status(Status::error(description));
    }

    /// Ends the span now.
    pub fn end(mut self) {
        self.0.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn off_without_an_endpoint_variable() {
        assert_eq!(TraceSettings::from_env(&env(&[])), Ok(None));
        assert_eq!(
            TraceSettings::from_env(&env(&[(ENV_ENDPOINT, " "), (ENV_PROTOCOL, "grpc")])),
            Ok(None)
        );
    }

    #[test]
    fn generic_endpoint_gets_the_traces_path() {
        let s = TraceSettings::from_env(&env(&[(ENV_ENDPOINT, "http://collector:4318/")]))
            .unwrap()
            .unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(s.service_name, "sluicegate");
    }

    #[test]
    fn traces_endpoint_is_used_as_given_and_wins() {
        let s = TraceSettings::from_env(&env(&[
            (ENV_ENDPOINT, "http://a:4318"),
            (ENV_TRACES_ENDPOINT, "http://b:4318/custom"),
            (ENV_SERVICE_NAME, "batch"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint, "http://b:4318/custom");
        assert_eq!(s.service_name, "batch");
    }

    #[test]
    fn refuses_protocols_other_than_http_protobuf() {
        let e = TraceSettings::from_env(&env(&[
            (ENV_ENDPOINT, "http://a:4317"),
            (ENV_PROTOCOL, "grpc"),
        ]))
        .unwrap_err();
        assert_eq!(e.var, ENV_PROTOCOL);
        assert!(e.message.contains("http/protobuf"), "{e}");
        let e = TraceSettings::from_env(&env(&[
            (ENV_ENDPOINT, "http://a:4318"),
            (ENV_PROTOCOL, "http/protobuf"),
            (ENV_TRACES_PROTOCOL, "http/json"),
        ]))
        .unwrap_err();
        assert_eq!(e.var, ENV_TRACES_PROTOCOL);
        assert!(
            TraceSettings::from_env(&env(&[
                (ENV_ENDPOINT, "http://a:4318"),
                (ENV_PROTOCOL, "http/protobuf"),
            ]))
            .unwrap()
            .is_some()
        );
    }

    #[test]
    fn docs_list_every_variable_span_and_attribute() {
        let config = include_str!("../../docs/configuration.md");
        for var in TRACE_ENV_VARS {
            assert!(config.contains(&format!("`{var}`")), "{var}");
        }
        let operations = include_str!("../../docs/operations.md");
        for name in [
            RECEIVE,
            ADMIT,
            SEND,
            SETTLE,
            ATTR_QUEUE,
            ATTR_REQUEST_ID,
            ATTR_RETRY_COUNT,
            ATTR_VERDICT,
            ATTR_REASON,
            ATTR_BUDGET,
            ATTR_BASELINE,
            ATTR_WINDOW_AVAILABLE,
            ATTR_WINDOW_IN_FLIGHT,
            ATTR_ATTEMPT,
            ATTR_ATTEMPT_OUTCOME,
            ATTR_HTTP_STATUS,
            ATTR_OUTCOME,
            ATTR_ERROR_CODE,
            ATTR_ACK,
        ] {
            assert!(operations.contains(&format!("`{name}`")), "{name}");
        }
    }

    #[test]
    fn refuses_an_endpoint_that_is_not_a_url() {
        let e =
            TraceSettings::from_env(&env(&[(ENV_TRACES_ENDPOINT, "collector:4318")])).unwrap_err();
        assert_eq!(e.var, ENV_TRACES_ENDPOINT);
    }
}
