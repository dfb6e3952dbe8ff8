//! One request at a time through the gate (`docs/flex.md`): OpenAI's flex
//! tier (`service_tier: "flex"`) and background responses
//! (`background: true`) on the inference endpoints.
//!
//! A flex request becomes one queue message, like a batch line: the same
//! gate, window, tenant fairness and quotas apply. Its connection is held
//! on a reply route ([`super::replies`]) until the collector reads its
//! result. Not taken by a dispatcher within `serve.flex_max_wait`, it is
//! withdrawn from the queue and answered 429; a client that disconnects
//! cancels its message (a waiting one leaves the queue; a leased one is
//! flagged, and the dispatcher stops it).
//!
//! A background request is stored (`super::background`), enqueued and
//! answered at once `queued` (`super::responses`, which also serves it
//! afterwards).
//!
//! Requests with neither are refused 400, or with `serve.passthrough`
//! forwarded straight to the gateway, outside the window
//! (`super::passthrough`).
//!
//! This file: classifying a request (pure), the flex path and its probe,
//! the answer's shape, the routes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use serde_json::{Map, Value, json};

use super::http::{ApiError, AppState, Tenant};
use super::replies::{Bound, Replies, Ticket};
use super::sink::Sink;
use super::store::{Store, StoreError};
use crate::clock::unix_secs;
use crate::endpoint::Endpoint;
use crate::queue::ClientError;
use crate::relay::local::{LocalRelay, Subscription};
use crate::relay::{Event, Follow, Step, error_event};
use crate::request::{Message, parse_message};
use crate::result::{ErrorCode, ResultRecord};
use crate::telemetry::FlexMetrics;

/// The tiers OpenAI names; only `flex` is queued, the others are
/// interactive traffic.
pub const SERVICE_TIERS: [&str; 5] = ["auto", "default", "flex", "scale", "priority"];
/// How often the probe asks the queue which held flex requests a
/// dispatcher has taken (one round trip for all of them).
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// A background response's queue deadline: it orders the queue (earliest
/// first) and is the longest it may wait, as a batch's default window.
pub(super) const BACKGROUND_WINDOW_SECS: i64 = 24 * 3600;
/// How long past a flex request's queue deadline its connection still
/// waits for the answer before giving up (the collector's delay, with a
/// wide margin).
const GIVE_UP_SLACK: Duration = Duration::from_secs(60);
/// How long a flex result collected by a replica that does not hold its
/// connection is kept for the one that does.
const PARKED_REPLY_TTL: Duration = Duration::from_secs(600);
/// Longest `Retry-After` the server suggests.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// How a background response is answered at once, and a flex one at its end.
const FLEX: &str = "flex";

/// Whether a queue message id is a flex request's (the relay's rule,
/// which a dispatcher below `serve` applies too).
pub fn is_flex_id(id: &str) -> bool {
    crate::relay::is_flex_id(id)
}

/// How one inference request is to be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Queued, answered on the held connection.
    Flex,
    /// Stored, queued, answered at once `queued`; `flex` when asked with
    /// the flex tier too.
    Background {
        /// Asked with `service_tier: "flex"`.
        flex: bool,
    },
    /// Neither: refused, or passed through.
    Interactive,
}

/// Reads `service_tier`, `background` and `stream` of a body for
/// `endpoint`: how to serve it, or the typed 400.
pub fn classify(endpoint: Endpoint, body: &Map<String, Value>) -> Result<Kind, ApiError> {
    let tier = match body.get("service_tier") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) if SERVICE_TIERS.contains(&t.as_str()) => Some(t.as_str()),
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "Invalid value for 'service_tier': {other}; allowed: {}",
                    SERVICE_TIERS.join(", ")
                ),
                Some("service_tier"),
            ));
        }
    };
    let background = match body.get("background") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'background': expected a boolean",
                Some("background"),
            ));
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'stream': expected a boolean",
                Some("stream"),
            ));
        }
    };
    if background {
        if !matches!(endpoint, Endpoint::Responses | Endpoint::ChatCompletions) {
            return Err(ApiError::invalid(
                format!(
                    "'background' is not supported on {}; allowed on: /v1/responses, /v1/chat/completions",
                    endpoint.as_str()
                ),
                Some("background"),
            ));
        }
        if stream {
            return Err(ApiError::invalid(
                "'background' with 'stream' is not supported: poll GET /v1/responses/{id} instead",
                Some("stream"),
            ));
        }
    }
    if stream && endpoint == Endpoint::Embeddings {
        return Err(ApiError::invalid(
            "'stream' is not supported on /v1/embeddings",
            Some("stream"),
        ));
    }
    if let Err(e) = endpoint.check_body(body) {
        return Err(ApiError::invalid(e.message, Some(e.param)));
    }
    Ok(match (background, tier) {
        (true, t) => Kind::Background {
            flex: t == Some(FLEX),
        },
        (false, Some(FLEX)) => Kind::Flex,
        (false, _) => Kind::Interactive,
    })
}

/// `Retry-After` for a refused flex request: the recent time a flex
/// request waited for a dispatcher, when one was taken within the last
/// `max_wait` (the gate is moving at that pace); else the gate has taken
/// none for that long, and the suggestion is the longest one, but never
/// over `max_wait`: the next attempt itself waits up to `max_wait` in the
/// queue, where it is taken as soon as the gate opens.
pub fn retry_after(
    recent_wait: Option<Duration>,
    since_last: Option<Duration>,
    max_wait: Duration,
) -> Duration {
    match (recent_wait, since_last) {
        (Some(wait), Some(since)) if since <= max_wait => {
            wait.clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
        }
        _ => MAX_RETRY_AFTER.min(max_wait).max(Duration::from_secs(1)),
    }
}

/// Configured bounds and behaviour.
#[derive(Debug, Clone)]
pub struct FlexSettings {
    /// `serve.flex_max_wait`.
    pub max_wait: Duration,
    /// `gateway.attempt_timeout`: added to a flex request's queue
    /// deadline, so one taken at `max_wait` still has its attempt.
    pub attempt_grace: Duration,
    /// `serve.background_max_total`.
    pub background_total: u64,
    /// `serve.background_max_per_tenant`.
    pub background_per_tenant: u64,
    /// `serve.file_retention` in seconds (0: kept until deleted): how
    /// long a finished background response is kept.
    pub keep_secs: i64,
    /// The request metadata key the tenant is written under (fairness).
    pub fairness: Option<String>,
    /// `serve.passthrough`: the gateway's base URL, when on.
    pub passthrough: Option<String>,
    /// Largest request body.
    pub max_body: usize,
}

/// Pace of the gate as flex requests see it.
#[derive(Debug, Default)]
struct Pace {
    /// Moving average of recent waits for a dispatcher.
    wait: Option<Duration>,
    /// When a dispatcher last took a flex request.
    last: Option<Instant>,
}

/// The flex and background front of one server.
#[derive(Debug)]
pub struct Flex {
    pub(super) sink: Sink,
    /// The held connections' reply routes (the collector delivers).
    pub replies: Arc<Replies>,
    pub(super) settings: FlexSettings,
    pub(super) metrics: FlexMetrics,
    pace: Mutex<Pace>,
    pub(super) http: reqwest::Client,
    /// The streamed requests held here, whose answers are relayed as they
    /// arrive (`crate::relay`).
    relay: Arc<LocalRelay>,
}

/// Cancels a held request's message when its handler is dropped before
/// it answered: the client went away (axum drops the handler with the
/// connection).
struct CancelOnDrop {
    sink: Sink,
    id: Option<String>,
    waiting: prometheus_client::metrics::gauge::Gauge,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.waiting.dec();
        let Some(id) = self.id.take() else {
            return;
        };
        let sink = self.sink.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                match sink.cancel(vec![id.clone()]).await {
                    Ok(()) => tracing::info!(request = %id, "flex client disconnected; request cancelled"),
                    Err(error) => tracing::warn!(request = %id, %error, "flex client disconnected; cancel failed"),
                }
            });
        }
    }
}

impl Flex {
    /// The front on `sink`, bounded by `replies`.
    pub fn new(
        sink: Sink,
        replies: Arc<Replies>,
        relay: Arc<LocalRelay>,
        settings: FlexSettings,
        metrics: FlexMetrics,
    ) -> Self {
        Self {
            sink,
            replies,
            settings,
            metrics,
            pace: Mutex::new(Pace::default()),
            http: reqwest::Client::new(),
            relay,
        }
    }

    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        self.pace.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn retry_after(&self) -> Duration {
        let pace = self.pace();
        retry_after(
            pace.wait,
            pace.last.map(|t| t.elapsed()),
            self.settings.max_wait,
        )
    }

    /// A 429 in OpenAI's shape with a `Retry-After`, counted by `cause`.
    pub(super) fn refuse(&self, cause: &'static str, message: String) -> Response {
        self.metrics.refused(cause);
        let secs = self.retry_after().as_secs().max(1);
        let error = ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message,
            kind: "rate_limit_exceeded",
            param: None,
            code: Some("resource_unavailable"),
        };
        let mut response = error.into_response();
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }

    /// The queue message of a request body: the tier fields OpenAI reads
    /// are ours, not the engine's, and are taken out.
    pub(super) fn message(
        &self,
        id: &str,
        tenant: &str,
        endpoint: Endpoint,
        mut body: Map<String, Value>,
        deadline: i64,
    ) -> Result<Message, ApiError> {
        body.remove("service_tier");
        body.remove("background");
        let model = body.get("model").and_then(Value::as_str).map(str::to_owned);
        let mut metadata = Map::new();
        if let Some(key) = &self.settings.fairness {
            metadata.insert(key.clone(), json!(tenant));
        }
        let request = json!({
            "id": id,
            "deadline": deadline,
            "payload": body,
            "endpoint": endpoint.as_str(),
            "model": model,
            "metadata": metadata,
        });
        parse_message(request.to_string().as_bytes()).map_err(|f| ApiError::invalid(f.reason, None))
    }

    /// Every probe period, which held flex requests a dispatcher has taken:
    /// their time to dispatch, and the pace `Retry-After` is read from.
    /// Stops probing on a transport that cannot tell.
    pub async fn probe(self: Arc<Self>, store: Store, stop: tokio_util::sync::CancellationToken) {
        let mut can_tell = true;
        while crate::tasks::sleep_unless(&stop, PROBE_EVERY).await {
            if store.shares_replies() {
                self.collect_parked(&store).await;
            }
            let ids = self.replies.undispatched();
            if ids.is_empty() || !can_tell {
                continue;
            }
            let leased = match self.sink.leased(ids.clone()).await {
                Ok(leased) => leased,
                Err(ClientError::Unsupported { .. }) => {
                    can_tell = false;
                    continue;
                }
                Err(error) => {
                    tracing::debug!(%error, "flex probe failed");
                    continue;
                }
            };
            let taken: Vec<String> = (ids.into_iter().zip(leased))
                .filter_map(|(id, l)| l.then_some(id))
                .collect();
            for waited in self.replies.mark_dispatched(&taken) {
                self.observe_dispatch(waited);
            }
        }
    }

    /// Delivers the results another replica's collector read for the
    /// connections this one holds ([`Self::deliver`] parked them).
    async fn collect_parked(&self, store: &Store) {
        let held = self.replies.held_ids();
        if held.is_empty() {
            return;
        }
        match store.take_replies(&held).await {
            Ok(texts) => {
                for text in texts {
                    if let Ok(result) = serde_json::from_str::<ResultRecord>(&text) {
                        self.replies.deliver(result);
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "cannot read parked flex replies"),
        }
    }

    /// Hands a flex result to the connection this server holds for it; on
    /// a store replicas share, a result no connection here waits for is
    /// parked there for the replica that holds it (kept
    /// [`PARKED_REPLY_TTL`]; nobody takes it when its client left).
    pub async fn deliver(&self, store: &Store, result: ResultRecord) -> Result<(), StoreError> {
        let id = result.id.clone();
        let text = serde_json::to_string(&result).unwrap_or_default();
        if !self.replies.deliver(result) && store.shares_replies() {
            store.park_reply(&id, &text, PARKED_REPLY_TTL).await?;
        }
        Ok(())
    }

    fn observe_dispatch(&self, waited: Duration) {
        self.metrics.dispatch.observe(waited.as_secs_f64());
        let mut pace = self.pace();
        pace.last = Some(Instant::now());
        pace.wait = Some(match pace.wait {
            // A moving average over about the last 8 dispatches.
            Some(w) => w.mul_f64(0.875) + waited.mul_f64(0.125),
            None => waited,
        });
    }

    /// A flex request: enqueue, hold, answer (see the module docs).
    async fn flex(
        self: &Arc<Self>,
        tenant: &str,
        endpoint: Endpoint,
        body: Map<String, Value>,
    ) -> Response {
        let id = super::model::new_id("flex_");
        let mut ticket: Ticket = match self.replies.hold(tenant, id.clone()) {
            Ok(t) => t,
            Err(bound) => {
                let cause = match bound {
                    Bound::Total => "held_total",
                    Bound::Tenant => "held_tenant",
                };
                return self.refuse(
                    cause,
                    format!("Resource Unavailable: too many flex requests are waiting ({} reached); retry later", bound.key()),
                );
            }
        };
        let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
        let grace = i64::try_from(
            self.settings
                .max_wait
                .saturating_add(self.settings.attempt_grace)
                .as_secs(),
        )
        .unwrap_or(i64::MAX);
        // Subscribed before the message exists, so no piece of its answer
        // can come before its route.
        let mut subscription = stream.then(|| self.relay.subscribe(&id));
        let mut follow = Follow::default();
        let message = match self.message(
            &id,
            tenant,
            endpoint,
            body,
            unix_secs().saturating_add(grace),
        ) {
            Ok(m) => m,
            Err(e) => return e.into_response(),
        };
        if let Err(error) = self.sink.enqueue_one(message).await {
            return ApiError::internal(error).into_response();
        }
        let enqueued = Instant::now();
        self.metrics.waiting.inc();
        let mut guard = CancelOnDrop {
            sink: self.sink.clone(),
            id: Some(id.clone()),
            waiting: self.metrics.waiting.clone(),
        };
        let max_wait = tokio::time::sleep(self.settings.max_wait);
        tokio::pin!(max_wait);
        // The dispatcher answers by the queue deadline at the latest, and
        // the collector reads that within seconds: a connection still
        // without an answer well past it lost its reply (a result that
        // another replica collected), and is not held forever.
        // Boxed: a stream that begins takes it along.
        let mut give_up = Box::pin(tokio::time::sleep(
            (self.settings.max_wait + self.settings.attempt_grace).saturating_add(GIVE_UP_SLACK),
        ));
        let mut past_max_wait = false;
        let result = loop {
            tokio::select! {
                result = ticket.answer() => break result,
                event = next_event(&mut subscription) => {
                    // The first piece of a streamed answer: the stream
                    // begins (anything else before it changes nothing;
                    // the record still answers whole).
                    if let Step::Send(first) = follow.event(event) {
                        if let Some(waited) = self.replies.mark_dispatched(std::slice::from_ref(&id)).pop() {
                            self.observe_dispatch(waited);
                        }
                        self.metrics.first_chunk.observe(enqueued.elapsed().as_secs_f64());
                        let Some(subscription) = subscription.take() else {
                            continue;
                        };
                        let relayed = Relayed {
                            ticket: Some(ticket),
                            subscription,
                            follow,
                            guard,
                            give_up,
                            first: Some(first),
                            done: false,
                            metrics: self.metrics.clone(),
                        };
                        return relayed.into_response();
                    }
                }
                () = give_up.as_mut() => {
                    let _ = self.sink.cancel(vec![id.clone()]).await;
                    guard.disarm();
                    return ApiError {
                        status: StatusCode::GATEWAY_TIMEOUT,
                        message: "no answer reached this server by the request's deadline (serve.flex_max_wait + gateway.attempt_timeout)".into(),
                        kind: "server_error",
                        param: None,
                        code: Some("timeout"),
                    }
                    .into_response();
                }
                () = &mut max_wait, if !past_max_wait => {
                    past_max_wait = true;
                    match self.sink.withdraw(vec![id.clone()]).await {
                        Ok(w) if w.first() == Some(&true) => {
                            guard.disarm();
                            return self.refuse("max_wait", format!(
                                "Resource Unavailable: no capacity for this flex request within {:?} (serve.flex_max_wait); retry later",
                                self.settings.max_wait
                            ));
                        }
                        // Taken by a dispatcher (or answered meanwhile):
                        // its answer comes.
                        Ok(_) => {
                            if let Some(waited) = self.replies.mark_dispatched(std::slice::from_ref(&id)).pop() {
                                self.observe_dispatch(waited);
                            }
                        }
                        // A transport that cannot tell waiting from taken
                        // (not the embedded queue or Redis, the two serve
                        // runs on) stops it either way.
                        Err(ClientError::Unsupported { .. }) => {
                            guard.disarm();
                            let _ = self.sink.cancel(vec![id.clone()]).await;
                            return self.refuse("max_wait", format!(
                                "Resource Unavailable: no answer for this flex request within {:?} (serve.flex_max_wait); retry later",
                                self.settings.max_wait
                            ));
                        }
                        Err(error) => tracing::warn!(request = %id, %error, "flex withdraw failed; still waiting"),
                    }
                }
            }
        };
        guard.disarm();
        if let Some(waited) = self
            .replies
            .mark_dispatched(std::slice::from_ref(&id))
            .pop()
        {
            self.observe_dispatch(waited);
        }
        drop(guard);
        answer(result, stream)
    }
}

/// The next relayed event of a held streamed request; pending forever for
/// one that is not streamed.
async fn next_event(subscription: &mut Option<Subscription>) -> Event {
    match subscription {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// A streamed flex answer being relayed to its client: what the body
/// stream owns. Dropped with the connection (the client left), its guard
/// cancels the message, which aborts the request at the gateway, and its
/// subscription's drop stops a dispatcher in this process at once.
struct Relayed {
    /// Taken when the relay completed the stream before the record came
    /// (`Self::keep_route`).
    ticket: Option<Ticket>,
    subscription: Subscription,
    follow: Follow,
    guard: CancelOnDrop,
    /// The connection's last moment, as before the stream began.
    give_up: std::pin::Pin<Box<tokio::time::Sleep>>,
    first: Option<Bytes>,
    done: bool,
    metrics: FlexMetrics,
}

impl Relayed {
    /// The next bytes for the client, `None` once the stream ended.
    async fn next(&mut self) -> Option<Bytes> {
        if let Some(first) = self.first.take() {
            return Some(first);
        }
        if self.done {
            return None;
        }
        loop {
            // From the record the message is settled: nothing to cancel.
            let record = async {
                match self.ticket.as_mut() {
                    Some(ticket) => ticket.answer().await,
                    None => std::future::pending().await,
                }
            };
            let (step, settled) = tokio::select! {
                result = record => {
                    let success = result.status_code.is_some_and(|s| (200..300).contains(&s));
                    let error = record_error(&result);
                    (self.follow.record(success, &result.payload, &error), true)
                }
                event = self.subscription.next() => (self.follow.event(event), false),
                () = self.give_up.as_mut() => (Step::Fail(
                    "no answer reached this server by the request's deadline (serve.flex_max_wait + gateway.attempt_timeout)".into(),
                ), false),
            };
            match step {
                Step::Send(bytes) => return Some(bytes),
                Step::Skip | Step::Stall => {}
                Step::Finish(rest) => {
                    self.done = true;
                    self.guard.disarm();
                    if !settled {
                        self.keep_route();
                    }
                    self.metrics.streamed("complete");
                    return (!rest.is_empty()).then_some(rest);
                }
                Step::Fail(message) => {
                    self.done = true;
                    if settled {
                        self.guard.disarm();
                    }
                    // Otherwise the guard's drop cancels the message: an
                    // attempt still running (a second one, or one past
                    // the deadline) is aborted at the gateway.
                    self.metrics.streamed("interrupted");
                    return Some(error_event(&message));
                }
            }
        }
    }
}

impl Relayed {
    /// The relay completed the stream; the record is still on its way
    /// (the collector reads it within seconds). Its route is kept until
    /// it comes, at most [`GIVE_UP_SLACK`], so the collector finds it and
    /// drops it, instead of parking it in a shared store for another
    /// replica that does not hold it either.
    fn keep_route(&mut self) {
        if let Some(mut ticket) = self.ticket.take() {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(GIVE_UP_SLACK, ticket.answer()).await;
            });
        }
    }
}

impl IntoResponse for Relayed {
    fn into_response(self) -> Response {
        let body = futures_util::stream::unfold(self, |mut relayed| async move {
            let bytes = relayed.next().await?;
            Some((Ok::<Bytes, std::convert::Infallible>(bytes), relayed))
        });
        let mut response = Response::new(Body::from_stream(body));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        response
    }
}

/// What a record that is not a success says, for the error event.
fn record_error(result: &ResultRecord) -> String {
    match (&result.error_message, result.status_code) {
        (Some(message), _) => message.clone(),
        (None, Some(status)) => format!("the gateway answered {status}: {}", result.payload),
        (None, None) => "no answer from the gateway".into(),
    }
}

/// The held connection's answer: the gateway's status and body, a JSON
/// object marked `service_tier: "flex"`; a stream as the event stream the
/// gateway sent; no HTTP answer as an OpenAI error.
fn answer(result: ResultRecord, stream: bool) -> Response {
    let Some(status) = result.status_code else {
        let (status, code) = match result.error_code {
            Some(ErrorCode::DeadlineExceeded) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            Some(ErrorCode::Cancelled) => (StatusCode::SERVICE_UNAVAILABLE, "cancelled"),
            _ => (StatusCode::BAD_GATEWAY, "server_error"),
        };
        return ApiError {
            status,
            message: result
                .error_message
                .unwrap_or_else(|| "no answer from the gateway".into()),
            kind: "server_error",
            param: None,
            code: Some(code),
        }
        .into_response();
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    if stream && status.is_success() {
        let mut response = Response::new(Body::from(result.payload));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        return response;
    }
    let body = match serde_json::from_str::<Value>(&result.payload) {
        Ok(Value::Object(mut o)) => {
            if status.is_success() {
                o.insert("service_tier".into(), json!(FLEX));
            }
            Value::Object(o)
        }
        Ok(other) => other,
        Err(_) => {
            json!({"error": {"message": result.payload, "type": "server_error", "param": null, "code": null}})
        }
    };
    (status, axum::Json(body)).into_response()
}

/// One inference endpoint: parse, classify, serve.
async fn infer(
    endpoint: Endpoint,
    state: Arc<AppState>,
    flex: Arc<Flex>,
    tenant: String,
    bytes: Bytes,
) -> Response {
    let body = match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(o)) => o,
        Ok(_) => {
            return ApiError::invalid("the request body must be a JSON object", None)
                .into_response();
        }
        Err(e) => {
            return ApiError::invalid(format!("the request body is not valid JSON: {e}"), None)
                .into_response();
        }
    };
    let kind = match classify(endpoint, &body) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    match kind {
        Kind::Flex => flex.flex(&tenant, endpoint, body).await,
        Kind::Background { flex: tier } => {
            match flex.background(&state.engine.store, &tenant, endpoint, body, tier).await {
                Ok(r) => r,
                Err(e) => e.into_response(),
            }
        }
        Kind::Interactive => match &flex.settings.passthrough {
            Some(base) => flex.pass_through(base, endpoint, bytes).await,
            None => ApiError {
                status: StatusCode::BAD_REQUEST,
                message: "This server queues requests: set service_tier to \"flex\" (or background: true on /v1/responses); serve.passthrough is off, so interactive requests are not forwarded".into(),
                kind: "invalid_request_error",
                param: Some("service_tier"),
                code: Some("flex_required"),
            }
            .into_response(),
        },
    }
}

macro_rules! endpoint_handler {
    ($name:ident, $endpoint:expr) => {
        async fn $name(
            State(state): State<Arc<AppState>>,
            Extension(flex): Extension<Arc<Flex>>,
            Tenant(tenant): Tenant,
            bytes: Bytes,
        ) -> Response {
            infer($endpoint, state, flex, tenant, bytes).await
        }
    };
}

endpoint_handler!(chat_completions, Endpoint::ChatCompletions);
endpoint_handler!(completions, Endpoint::Completions);
endpoint_handler!(embeddings, Endpoint::Embeddings);
endpoint_handler!(responses_create, Endpoint::Responses);

/// The inference endpoints and the background responses' own.
pub fn router(state: Arc<AppState>, flex: Arc<Flex>) -> Router {
    let limit = flex.settings.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses_create))
        .merge(super::responses::routes())
        .layer(Extension(flex))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_tier_and_background_decide_how_a_request_is_served() {
        let chat = |v| classify(Endpoint::ChatCompletions, &body(v));
        assert_eq!(chat(json!({"service_tier": "flex"})).ok(), Some(Kind::Flex));
        assert_eq!(chat(json!({})).ok(), Some(Kind::Interactive));
        assert_eq!(
            chat(json!({"service_tier": "auto"})).ok(),
            Some(Kind::Interactive)
        );
        assert_eq!(
            chat(json!({"background": true, "service_tier": "flex"})).ok(),
            Some(Kind::Background { flex: true })
        );
        let responses = classify(
            Endpoint::Responses,
            &body(json!({"model": "m", "input": "hi", "background": true})),
        );
        assert_eq!(responses.ok(), Some(Kind::Background { flex: false }));
    }

    #[test]
    fn bad_fields_get_a_typed_400_naming_them() {
        let refused = |endpoint, v| classify(endpoint, &body(v)).expect_err("refused");
        let e = refused(Endpoint::ChatCompletions, json!({"service_tier": "cheap"}));
        assert_eq!(
            (e.status, e.param),
            (StatusCode::BAD_REQUEST, Some("service_tier"))
        );
        assert!(e.message.contains("flex"), "{}", e.message);
        let e = refused(
            Endpoint::Responses,
            json!({"model": "m", "input": "x", "background": true, "stream": true}),
        );
        assert_eq!(e.param, Some("stream"));
        let e = refused(Endpoint::Completions, json!({"background": true}));
        assert_eq!(e.param, Some("background"));
        let e = refused(Endpoint::ChatCompletions, json!({"background": "yes"}));
        assert_eq!(e.param, Some("background"));
        let e = refused(
            Endpoint::Embeddings,
            json!({"service_tier": "flex", "model": "m"}),
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn retry_after_follows_the_gates_recent_pace() {
        let max_wait = Duration::from_secs(600);
        let s = Duration::from_secs;
        assert_eq!(retry_after(None, None, max_wait), MAX_RETRY_AFTER);
        assert_eq!(retry_after(Some(s(5)), Some(s(10)), max_wait), s(5));
        assert_eq!(
            retry_after(Some(Duration::from_millis(10)), Some(s(1)), max_wait),
            s(1)
        );
        assert_eq!(
            retry_after(Some(s(300)), Some(s(1)), max_wait),
            MAX_RETRY_AFTER
        );
        // Nothing taken for longer than max_wait: the gate is shut.
        assert_eq!(
            retry_after(Some(s(5)), Some(s(700)), max_wait),
            MAX_RETRY_AFTER
        );
    }
}
