//! The real-time front: an OpenAI-compatible server over a simulated pool.
//!
//! One driver task owns the clock: it advances the [`Pool`] to "now" (real
//! elapsed time × `time_scale`), injects background load, hands tokens to
//! waiting HTTP handlers, then sleeps until the next step ends or a request
//! arrives. Handlers only parse, submit under the lock and wait on a bounded
//! channel, so the pure engine never sees I/O.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, LogNormal};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::bad_request::{BadRequest, bad_request};
use super::config::{LoadMode, SimConfig};
use super::endpoints::{
    EmbedRequest, ResponseIds, embed_request, embeddings_body, response_body,
    response_prompt_tokens,
};
use super::engine::{EngineEvent, Outcome, RequestClass, RequestRecord, SimRequest, SimTime};
use super::error::SimError;
use super::load::{Arrival, LoadGenerator};
use super::metrics::{ExpositionLabels, LaggedView, MetricsSnapshot, ViewConfig, render};
use super::pool::{Admission, Pool, PoolConfig};

/// Background interactive load chosen on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InteractiveArg {
    /// No background load.
    Off,
    /// Saturating bursts alternating with near-idle periods.
    Waves,
    /// Poisson with diurnal wave and bursts.
    Poisson,
    /// Replay of a CSV trace.
    Trace(PathBuf),
}

/// A `--interactive` value that is none of the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected off, waves, poisson or trace:FILE, got {0:?}")]
pub struct InteractiveArgError(String);

impl FromStr for InteractiveArg {
    type Err = InteractiveArgError;

    fn from_str(s: &str) -> Result<Self, InteractiveArgError> {
        match s {
            "off" => Ok(Self::Off),
            "waves" => Ok(Self::Waves),
            "poisson" => Ok(Self::Poisson),
            _ => match s.strip_prefix("trace:") {
                Some(p) if !p.is_empty() => Ok(Self::Trace(PathBuf::from(p))),
                _ => Err(InteractiveArgError(s.to_owned())),
            },
        }
    }
}

/// `sluicegate sim serve` options; each overrides the config file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: the config's `listen`, else 127.0.0.1:8000].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Simulator config file (TOML; unknown keys are errors).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Pool name, the `name` / `inference_pool` metric label [default: sim-pool].
    #[arg(long)]
    pub pool_name: Option<String>,
    /// Background interactive load: off, waves, poisson or trace:FILE.
    #[arg(long, value_parser = InteractiveArg::from_str)]
    pub interactive: Option<InteractiveArg>,
    /// Number of replicas.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Seed for all random draws.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Simulated seconds per real second (10 = the pool runs ten times faster).
    #[arg(long)]
    pub time_scale: Option<f64>,
}

impl ServeArgs {
    /// The config file (or defaults) with command-line overrides applied, validated.
    pub fn into_config(self) -> Result<SimConfig, SimError> {
        let mut cfg = match &self.config {
            Some(path) => SimConfig::from_file(path)?,
            None => SimConfig::default(),
        };
        cfg.listen = Some(
            self.listen
                .or(cfg.listen)
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8000))),
        );
        if let Some(p) = self.pool_name {
            cfg.pool_name = p;
        }
        match self.interactive {
            None => {}
            Some(InteractiveArg::Off) => cfg.interactive.mode = LoadMode::Off,
            Some(InteractiveArg::Waves) => cfg.interactive.mode = LoadMode::Waves,
            Some(InteractiveArg::Poisson) => cfg.interactive.mode = LoadMode::Poisson,
            Some(InteractiveArg::Trace(p)) => {
                cfg.interactive.mode = LoadMode::Trace;
                cfg.interactive.trace_file = Some(p);
            }
        }
        if let Some(r) = self.replicas {
            cfg.replicas = r;
        }
        if let Some(s) = self.seed {
            cfg.seed = s;
        }
        if let Some(t) = self.time_scale {
            cfg.time_scale = t;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Runs the simulator front until `shutdown` resolves.
pub async fn serve(
    args: ServeArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let cfg = args.into_config()?;
    let handle = spawn_http(cfg).await?;
    tracing::info!(addr = %handle.addr(), "simulator listening");
    shutdown.await;
    handle.shutdown().await
}

/// One request of the built-in interactive load generator, as recorded
/// by [`SimHandle::record_interactive`]: enough for its TTFT.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InteractiveTiming {
    /// Position among the generator's arrivals (0 = first). Two fronts
    /// with the same seed and load draw the same arrivals, so equal
    /// indexes are the same request in both (pairing a pool with its twin).
    pub index: u64,
    /// Arrival at the gateway, simulated seconds since the front started.
    pub arrival: SimTime,
    /// First token, if one was produced yet.
    pub first_token_at: Option<SimTime>,
    /// Refused by the gateway (429/503): it has no TTFT.
    pub rejected: bool,
}

/// A running simulator front; dropping it stops the server.
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<(), SimError>>>,
    /// Read by [`Self::interactive_arrivals`] (the demo charts the load).
    shared: Arc<Shared>,
}

impl SimHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests the built-in interactive load generator has submitted so
    /// far (requests sent over HTTP are not counted), as of the last time
    /// the simulator advanced.
    pub fn interactive_arrivals(&self) -> u64 {
        self.shared.lock().background_arrivals
    }

    /// Simulated seconds since the front started.
    pub fn sim_time(&self) -> SimTime {
        self.shared.now()
    }

    /// From now on, records every arrival of the built-in interactive
    /// load generator and its first token ([`Self::interactive_timings`]).
    /// Off by default: a long-running `sim serve` would keep them all.
    pub fn record_interactive(&self) {
        let mut live = self.shared.lock();
        if live.interactive_log.is_none() {
            live.interactive_log = Some(InteractiveLog::default());
        }
    }

    /// The current simulated time and the interactive requests recorded
    /// since [`Self::record_interactive`], in arrival order.
    pub fn interactive_timings(&self) -> (SimTime, Vec<InteractiveTiming>) {
        let mut live = self.shared.lock();
        let now = self.shared.now();
        // Bring the pool to `now` so first tokens emitted until now count.
        live.advance(now);
        let timings = live
            .interactive_log
            .as_ref()
            .map(|l| l.timings.clone())
            .unwrap_or_default();
        (now, timings)
    }

    /// Stops the server and waits for it (in-flight requests end with 503 or a
    /// truncated stream).
    pub async fn shutdown(mut self) -> Result<(), SimError> {
        self.cancel.cancel();
        match self.task.take() {
            Some(task) => task.await.unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts the front on `config.listen` (default 127.0.0.1 on a free port).
pub async fn spawn_http(config: SimConfig) -> Result<SimHandle, SimError> {
    config.validate()?;
    let addr = config
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Bind { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| SimError::Bind { addr, source })?;
    let shared = Arc::new(Shared::new(config)?);
    let cancel = CancellationToken::new();

    let driver = tokio::spawn(drive(shared.clone(), cancel.clone()));
    let app = router(shared.clone());
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .map_err(SimError::Serve);
        // The driver ends on the same token; a panic there is already logged.
        let _ = driver.await;
        served
    });
    Ok(SimHandle {
        addr,
        cancel,
        task: Some(task),
        shared,
    })
}

/// What a handler waits for.
#[derive(Debug)]
enum Ev {
    Token(u32),
    Done(Box<RequestRecord>),
}

/// Background interactive requests being recorded (see
/// [`SimHandle::record_interactive`]).
#[derive(Debug, Default)]
struct InteractiveLog {
    timings: Vec<InteractiveTiming>,
    /// Position in `timings` of each request still waiting for its first
    /// token or its end, by request id.
    open: HashMap<u64, usize>,
}

impl InteractiveLog {
    fn first_token(&mut self, id: u64, at: SimTime) {
        if let Some(t) = self.open.get(&id).and_then(|&i| self.timings.get_mut(i)) {
            t.first_token_at.get_or_insert(at);
        }
    }

    fn finished(&mut self, r: &RequestRecord) {
        if let Some(t) = self
            .open
            .remove(&r.id)
            .and_then(|i| self.timings.get_mut(i))
        {
            if let Some(at) = r.first_token_at {
                t.first_token_at.get_or_insert(at);
            }
            t.rejected = matches!(r.outcome, Outcome::Rejected429 | Outcome::Rejected503);
        }
    }
}

/// Mutable simulator state, behind one lock.
#[derive(Debug)]
struct Live {
    pool: Pool,
    /// Handlers waiting for their request, by request id.
    waiters: HashMap<u64, mpsc::Sender<Ev>>,
    next_id: u64,
    background: Option<LoadGenerator>,
    next_background: Option<Arrival>,
    /// Background arrivals submitted so far (see
    /// [`SimHandle::interactive_arrivals`]).
    background_arrivals: u64,
    /// Background requests with their first tokens, when recording.
    interactive_log: Option<InteractiveLog>,
    /// Lagged `/metrics` history (only when `metrics.lag_s > 0`).
    history: Option<LaggedView<MetricsSnapshot>>,
    events: Vec<EngineEvent>,
    released: Vec<(SimRequest, Admission)>,
    output_rng: Xoshiro256PlusPlus,
}

impl Live {
    fn deliver(&mut self, id: u64, ev: Ev) {
        let finished = matches!(ev, Ev::Done(_));
        if let Some(tx) = self.waiters.get(&id) {
            // Capacity covers every token plus the end, so only a gone
            // receiver fails here; then the client left and work is wasted.
            if tx.try_send(ev).is_err() && !finished {
                self.waiters.remove(&id);
                self.pool.abort(id);
            }
        }
        if finished {
            self.waiters.remove(&id);
        }
    }

    fn flush(&mut self) {
        let events = std::mem::take(&mut self.events);
        for e in events {
            if let Some(log) = &mut self.interactive_log {
                match &e {
                    EngineEvent::Token { id, index: 0, at } => log.first_token(*id, *at),
                    EngineEvent::Token { .. } => {}
                    EngineEvent::Finished(r) => log.finished(r),
                }
            }
            match e {
                EngineEvent::Token { id, index, .. } => self.deliver(id, Ev::Token(index)),
                EngineEvent::Finished(r) => self.deliver(r.id, Ev::Done(r)),
            }
        }
        let released = std::mem::take(&mut self.released);
        for (req, a) in released {
            if let Admission::Rejected(code) = a {
                let outcome = if code == 429 {
                    Outcome::Rejected429
                } else {
                    Outcome::Rejected503
                };
                let record = RequestRecord::rejected(&req, outcome);
                if let Some(log) = &mut self.interactive_log {
                    log.finished(&record);
                }
                self.deliver(req.id, Ev::Done(Box::new(record)));
            }
        }
    }

    /// Advances the pool to `now`, interleaving background arrivals exactly.
    fn advance(&mut self, now: SimTime) {
        while let Some(a) = self.next_background.filter(|a| a.at <= now) {
            self.pool
                .advance_to(a.at, &mut self.events, &mut self.released);
            let id = self.next_id;
            self.next_id += 1;
            let index = self.background_arrivals;
            self.background_arrivals += 1;
            if let Some(log) = &mut self.interactive_log {
                log.open.insert(id, log.timings.len());
                log.timings.push(InteractiveTiming {
                    index,
                    arrival: a.at,
                    first_token_at: None,
                    rejected: false,
                });
            }
            // A recorded request streams, so its first token is seen
            // before it ends; nobody waits on the events otherwise.
            let admission = self.pool.submit(SimRequest {
                id,
                class: RequestClass::Interactive,
                arrival: a.at,
                prompt_tokens: a.prompt_tokens,
                output_tokens: a.output_tokens,
                max_tokens: a.max_tokens,
                priority: a.priority,
                stream: self.interactive_log.is_some(),
            });
            if let (Admission::Rejected(_), Some(log)) = (admission, &mut self.interactive_log)
                && let Some(t) = log.open.remove(&id).and_then(|i| log.timings.get_mut(i))
            {
                t.rejected = true;
            }
            self.next_background = self
                .background
                .as_mut()
                .and_then(LoadGenerator::next_arrival);
        }
        self.pool
            .advance_to(now, &mut self.events, &mut self.released);
        if let Some(h) = &mut self.history
            && h.scrape_due(now)
        {
            h.scrape(now, self.pool.snapshot());
        }
        self.flush();
    }

    /// Earliest simulated time something happens without outside input.
    fn next_wake(&self) -> Option<SimTime> {
        let mut t = self.pool.next_event_time();
        let mut take = |x: Option<SimTime>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t: f64| t.min(x)));
            }
        };
        take(self.next_background.map(|a| a.at));
        take(self.history.as_ref().map(LaggedView::next_scrape));
        t
    }
}

#[derive(Debug)]
struct Shared {
    cfg: SimConfig,
    labels: ExpositionLabels,
    blackouts: ViewConfig,
    live: Mutex<Live>,
    wake: Notify,
    origin: Instant,
    created: u64,
}

impl Shared {
    fn new(cfg: SimConfig) -> Result<Self, SimError> {
        let pool = Pool::new(
            &PoolConfig {
                replicas: cfg.replicas,
                engine: cfg.engine.clone(),
                gateway: cfg.gateway.clone(),
            },
            cfg.seed,
        );
        let mut background = match cfg.interactive.mode {
            LoadMode::Off => None,
            _ => Some(LoadGenerator::new(
                &cfg.interactive,
                cfg.replicas,
                cfg.engine.max_model_len,
                cfg.seed ^ 0x5EED_0001,
            )?),
        };
        let next_background = background.as_mut().and_then(LoadGenerator::next_arrival);
        let history = (cfg.metrics.lag_s > 0.0).then(|| {
            LaggedView::new(ViewConfig {
                scrape_interval_s: (cfg.metrics.lag_s / 10.0).clamp(0.05, 1.0),
                extra_lag_s: cfg.metrics.lag_s,
                blackouts: Vec::new(),
            })
        });
        let labels = ExpositionLabels {
            pool: cfg.pool_name.clone(),
            model: cfg.model_name.clone(),
            block_size: cfg.engine.block_size,
            num_gpu_blocks: cfg.engine.num_gpu_blocks,
            legacy_vllm_names: cfg.metrics.legacy_vllm_names,
        };
        let blackouts = ViewConfig {
            blackouts: cfg.metrics.blackouts.clone(),
            ..ViewConfig::direct()
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            live: Mutex::new(Live {
                pool,
                waiters: HashMap::new(),
                next_id: 1 << 40, // leaves room below for background ids
                background,
                next_background,
                background_arrivals: 0,
                interactive_log: None,
                history,
                events: Vec::new(),
                released: Vec::new(),
                output_rng: Xoshiro256PlusPlus::seed_from_u64(cfg.seed ^ 0x5EED_0003),
            }),
            labels,
            blackouts,
            wake: Notify::new(),
            origin: Instant::now(),
            created,
            cfg,
        })
    }

    fn now(&self) -> SimTime {
        self.origin.elapsed().as_secs_f64() * self.cfg.time_scale
    }

    fn lock(&self) -> MutexGuard<'_, Live> {
        // A panic while holding the lock leaves plain data behind; serving
        // on beats wedging every later request.
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

async fn drive(shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        let wake_at = {
            let mut live = shared.lock();
            live.advance(shared.now());
            live.next_wake()
        };
        let sleep = async {
            match wake_at {
                Some(t) => {
                    let real =
                        std::time::Duration::from_secs_f64((t / shared.cfg.time_scale).max(0.0));
                    tokio::time::sleep_until(shared.origin + real).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = cancel.cancelled() => break,
            () = shared.wake.notified() => {}
            () = sleep => {}
        }
    }
    // Dropping the senders ends every waiting handler.
    shared.lock().waiters.clear();
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/sim/state", get(state))
        .fallback(not_found)
        .with_state(shared)
}

/// An OpenAI-style error response.
fn error(
    status: StatusCode,
    message: impl Into<String>,
    kind: &str,
    param: Option<&str>,
) -> Response {
    let body = json!({
        "error": {
            "message": message.into(),
            "type": kind,
            "param": param,
            "code": status.as_u16(),
        }
    });
    (status, axum::Json(body)).into_response()
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        error(
            StatusCode::BAD_REQUEST,
            self.message,
            "invalid_request_error",
            self.param,
        )
    }
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not found", "not_found_error", None)
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "sluicegate-sim",
            "root": s.cfg.model_name,
            "max_model_len": s.cfg.engine.max_model_len,
        }]
    }))
    .into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let now = s.now();
    if s.blackouts.blacked_out(now) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics blackout (simulated)\n",
        )
            .into_response();
    }
    let text = {
        let mut live = s.lock();
        live.advance(now);
        match &live.history {
            Some(h) => match h.observe(now) {
                Some((_, snap)) => render(snap, &s.labels),
                None => {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "metrics not yet available (lag)\n",
                    )
                        .into_response();
                }
            },
            None => render(&live.pool.snapshot(), &s.labels),
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn state(State(s): State<Arc<Shared>>) -> Response {
    let now = s.now();
    let mut live = s.lock();
    live.advance(now);
    let (r429, r503) = live.pool.rejections();
    axum::Json(json!({
        "now": now,
        "observation": live.pool.observe(),
        "rejected_429": r429,
        "rejected_503": r503,
    }))
    .into_response()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
    Embeddings,
    Responses,
}

/// A parsed and validated OpenAI request.
#[derive(Debug)]
struct Parsed {
    model: String,
    prompt_tokens: u32,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    priority: i32,
    /// Embeddings only: the vectors to answer with.
    embed: Option<EmbedRequest>,
}

fn text_tokens(text: &str, chars_per_token: f64) -> u64 {
    ((text.chars().count() as f64 / chars_per_token).ceil() as u64).max(1)
}

fn parse(api: Api, body: &[u8], cfg: &SimConfig) -> Result<Parsed, BadRequest> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(format!("invalid JSON body: {e}"), None))?;
    let Some(obj) = v.as_object() else {
        return Err(bad_request("request body must be a JSON object", None));
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => cfg.model_name.clone(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(bad_request("model must be a string", Some("model"))),
    };
    let cpt = cfg.http.chars_per_token;
    let mut embed = None;
    let prompt_tokens: u64 = match api {
        Api::Embeddings => {
            let e = embed_request(obj, |s| text_tokens(s, cpt))?;
            let n = e.tokens;
            embed = Some(e);
            n
        }
        Api::Responses => response_prompt_tokens(obj, |s| text_tokens(s, cpt))?,
        Api::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => text_tokens(s, cpt),
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut n = 0u64;
                for it in items {
                    n += match it {
                        Value::String(s) => text_tokens(s, cpt),
                        Value::Number(_) => 1,
                        Value::Array(ids) if ids.iter().all(Value::is_number) => ids.len() as u64,
                        _ => {
                            return Err(bad_request(
                                "prompt must be a string, an array of strings or token ids",
                                Some("prompt"),
                            ));
                        }
                    };
                }
                n.max(1)
            }
            _ => {
                return Err(bad_request(
                    "prompt is required (string, array of strings or token ids)",
                    Some("prompt"),
                ));
            }
        },
        Api::Chat => {
            let Some(Value::Array(msgs)) = obj.get("messages") else {
                return Err(bad_request(
                    "messages is required and must be an array",
                    Some("messages"),
                ));
            };
            if msgs.is_empty() {
                return Err(bad_request("messages must not be empty", Some("messages")));
            }
            let mut n = 0u64;
            for m in msgs {
                let Some(m) = m.as_object() else {
                    return Err(bad_request(
                        "each message must be an object",
                        Some("messages"),
                    ));
                };
                if !m.get("role").is_some_and(Value::is_string) {
                    return Err(bad_request(
                        "each message needs a string role",
                        Some("messages"),
                    ));
                }
                // A few tokens of chat template per message, as real templates add.
                n += 4;
                n += match m.get("content") {
                    None | Some(Value::Null) => 0,
                    Some(Value::String(s)) => text_tokens(s, cpt),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(|s| text_tokens(s, cpt))
                        .sum(),
                    Some(_) => {
                        return Err(bad_request(
                            "message content must be a string or an array of parts",
                            Some("messages"),
                        ));
                    }
                };
            }
            n
        }
    };
    let max_key = match api {
        Api::Chat if obj.contains_key("max_completion_tokens") => "max_completion_tokens",
        Api::Responses => "max_output_tokens",
        _ => "max_tokens",
    };
    let max_tokens = match obj.get(max_key) {
        // An embedding is its prefill: the one token the engine emits at
        // the end of the prefill step ends it, and no decode step runs.
        _ if api == Api::Embeddings => 1,
        None | Some(Value::Null) => cfg.http.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX),
            _ => {
                return Err(bad_request(
                    format!("{max_key} must be an integer >= 1"),
                    Some(max_key),
                ));
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        _ if api == Api::Embeddings => false,
        Some(Value::Bool(true)) if api == Api::Responses => {
            return Err(bad_request(
                "stream is not supported on /v1/responses by the simulator",
                Some("stream"),
            ));
        }
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad_request("stream must be a boolean", Some("stream"))),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => cfg.http.default_priority,
        Some(v) => match v.as_i64().and_then(|p| i32::try_from(p).ok()) {
            Some(p) => p,
            None => return Err(bad_request("priority must be an integer", Some("priority"))),
        },
    };
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(_) => return Err(bad_request("only n = 1 is supported", Some("n"))),
    }
    let max_len = u64::from(cfg.engine.max_model_len);
    if prompt_tokens + u64::from(max_tokens) > max_len {
        return Err(bad_request(
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). Please reduce the length of the prompt or completion.",
                prompt_tokens + u64::from(max_tokens)
            ),
            None,
        ));
    }
    Ok(Parsed {
        model,
        prompt_tokens: prompt_tokens as u32, // < max_model_len, checked above
        max_tokens,
        stream,
        include_usage,
        priority,
        embed,
    })
}

async fn completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Completions, body).await
}

async fn chat_completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Chat, body).await
}

async fn embeddings(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Embeddings, body).await
}

async fn responses(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    handle(s, Api::Responses, body).await
}

/// Aborts the simulated request if the handler (or stream) goes away early.
struct AbortGuard {
    shared: Arc<Shared>,
    id: u64,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            let mut live = self.shared.lock();
            live.waiters.remove(&self.id);
            live.pool.abort(self.id);
        }
    }
}

const FILLER: [&str; 10] = [
    " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
];

fn filler(n: u32) -> String {
    (0..n).map(|i| FILLER[i as usize % FILLER.len()]).collect()
}

async fn handle(s: Arc<Shared>, api: Api, body: Bytes) -> Response {
    let p = match parse(api, &body, &s.cfg) {
        Ok(p) => p,
        Err(bad) => return bad.into_response(),
    };
    let (id, target, rx, admission) = {
        let mut live = s.lock();
        let now = s.now();
        live.advance(now);
        let cap = p.max_tokens.min(s.cfg.http.max_output_tokens);
        let output = if s.cfg.http.draw_output {
            // Validated mean >= 1; cv 0.6 like the load generators.
            match LogNormal::from_mean_cv(s.cfg.http.output_mean, 0.6) {
                Ok(d) => (d.sample(&mut live.output_rng).round() as u32).clamp(1, cap),
                Err(_) => cap,
            }
        } else {
            cap
        };
        let req = SimRequest {
            id: live.next_id,
            class: RequestClass::Interactive,
            arrival: now,
            prompt_tokens: p.prompt_tokens,
            output_tokens: output,
            max_tokens: p.max_tokens,
            priority: p.priority,
            stream: p.stream,
        };
        live.next_id += 1;
        let target = req.target_output();
        let (tx, rx) = mpsc::channel(target as usize + 2);
        live.waiters.insert(req.id, tx);
        let id = req.id;
        let admission = live.pool.submit(req);
        if let Admission::Rejected(_) = admission {
            live.waiters.remove(&id);
        }
        (id, target, rx, admission)
    };
    match admission {
        Admission::Rejected(429) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "the pool is saturated; retry later",
                "rate_limit_error",
                None,
            );
        }
        Admission::Rejected(_) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is overloaded; retry later",
                "server_error",
                None,
            );
        }
        Admission::Routed(_) | Admission::Held => {}
    }
    s.wake.notify_one();
    let guard = AbortGuard {
        shared: s.clone(),
        id,
        done: false,
    };
    let replica = match admission {
        Admission::Routed(i) => Some(i),
        _ => None,
    };
    let ids = ResponseIds {
        id: match api {
            Api::Completions => format!("cmpl-{id}"),
            Api::Chat => format!("chatcmpl-{id}"),
            Api::Embeddings => format!("embd-{id}"),
            Api::Responses => format!("resp_{id}"),
        },
        created: s.created,
        model: p.model.clone(),
    };
    let mut resp = if p.stream {
        stream_response(api, ids, p, target, rx, guard)
    } else {
        unary_response(api, ids, p, rx, guard).await
    };
    if let Some(i) = replica
        && let Ok(v) = HeaderValue::from_str(&format!("{}-{i}", s.cfg.pool_name))
    {
        resp.headers_mut().insert("x-sim-replica", v);
    }
    resp
}

fn usage(prompt: u32, completion: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

fn finish_reason(generated: u32, max_tokens: u32) -> &'static str {
    if generated >= max_tokens {
        "length"
    } else {
        "stop"
    }
}

fn refused(rec: &RequestRecord) -> Option<Response> {
    match rec.outcome {
        Outcome::Rejected429 => Some(error(
            StatusCode::TOO_MANY_REQUESTS,
            "the pool is saturated; retry later",
            "rate_limit_error",
            None,
        )),
        Outcome::Rejected503 | Outcome::Aborted | Outcome::Unfinished => Some(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is overloaded; retry later",
            "server_error",
            None,
        )),
        Outcome::Completed => None,
    }
}

async fn unary_response(
    api: Api,
    ids: ResponseIds,
    p: Parsed,
    mut rx: mpsc::Receiver<Ev>,
    mut guard: AbortGuard,
) -> Response {
    let rec = loop {
        match rx.recv().await {
            Some(Ev::Token(_)) => {}
            Some(Ev::Done(rec)) => break rec,
            None => {
                guard.done = true;
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "simulator shutting down",
                    "server_error",
                    None,
                );
            }
        }
    };
    guard.done = true;
    if let Some(resp) = refused(&rec) {
        return resp;
    }
    let text = filler(rec.output_tokens);
    let reason = finish_reason(rec.output_tokens, p.max_tokens);
    let choice = match api {
        Api::Completions => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
        }
        Api::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": reason,
        }),
        Api::Embeddings => {
            let Some(embed) = &p.embed else {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "embeddings request without its vectors",
                    "server_error",
                    None,
                );
            };
            return axum::Json(embeddings_body(&ids.model, embed, rec.prompt_tokens))
                .into_response();
        }
        Api::Responses => {
            let body = response_body(
                &ids,
                &text,
                rec.prompt_tokens,
                rec.output_tokens,
                p.max_tokens,
            );
            return axum::Json(body).into_response();
        }
    };
    axum::Json(json!({
        "id": ids.id,
        "object": if api == Api::Chat { "chat.completion" } else { "text_completion" },
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "usage": usage(rec.prompt_tokens, rec.output_tokens),
    }))
    .into_response()
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response(
    api: Api,
    ids: ResponseIds,
    p: Parsed,
    target: u32,
    rx: mpsc::Receiver<Ev>,
    guard: AbortGuard,
) -> Response {
    let object = if api == Api::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |ids: &ResponseIds, choice: Value| {
        sse(&json!({
            "id": ids.id,
            "object": object,
            "created": ids.created,
            "model": ids.model,
            "choices": [choice],
        }))
    };
    struct St {
        rx: mpsc::Receiver<Ev>,
        guard: AbortGuard,
        ids: ResponseIds,
        p: Parsed,
        target: u32,
        started: bool,
        finished: bool,
    }
    let st = St {
        rx,
        guard,
        ids,
        p,
        target,
        started: false,
        finished: false,
    };
    let body = futures_util::stream::unfold(st, move |mut st| async move {
        if st.finished {
            return None;
        }
        if api == Api::Chat && !st.started {
            st.started = true;
            let c = chunk(
                &st.ids,
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            );
            return Some((Ok::<Bytes, Infallible>(c), st));
        }
        st.started = true;
        match st.rx.recv().await {
            Some(Ev::Token(i)) => {
                let word = FILLER[i as usize % FILLER.len()];
                let last = i + 1 >= st.target;
                let reason = if last {
                    json!(finish_reason(st.target, st.p.max_tokens))
                } else {
                    Value::Null
                };
                let choice = match api {
                    // `parse` refuses streaming for responses and ignores
                    // it for embeddings: only completions and chat stream.
                    Api::Completions | Api::Embeddings | Api::Responses => {
                        json!({"index": 0, "text": word, "logprobs": null, "finish_reason": reason})
                    }
                    Api::Chat => {
                        json!({"index": 0, "delta": {"content": word}, "logprobs": null, "finish_reason": reason})
                    }
                };
                Some((Ok(chunk(&st.ids, choice)), st))
            }
            Some(Ev::Done(rec)) => {
                st.guard.done = true;
                st.finished = true;
                let mut out = Vec::new();
                if rec.outcome != Outcome::Completed {
                    out.extend_from_slice(&sse(&json!({"error": {"message": "request refused or aborted by the pool", "type": "server_error", "code": 503}})));
                } else if st.p.include_usage {
                    out.extend_from_slice(&sse(&json!({
                        "id": st.ids.id,
                        "object": object,
                        "created": st.ids.created,
                        "model": st.ids.model,
                        "choices": [],
                        "usage": usage(rec.prompt_tokens, rec.output_tokens),
                    })));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                Some((Ok(Bytes::from(out)), st))
            }
            // Server shutting down: end the stream without [DONE].
            None => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot build stream",
                "server_error",
                None,
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waves(seed: u64) -> SimConfig {
        let mut cfg = SimConfig {
            seed,
            ..SimConfig::default()
        };
        cfg.interactive.mode = LoadMode::Waves;
        cfg
    }

    fn record(live: &mut Live) {
        live.interactive_log = Some(InteractiveLog::default());
    }

    #[test]
    fn recorded_interactive_requests_pair_by_index_across_fronts_of_one_seed() {
        // Driven in simulated time, no clock: a front and its twin, the
        // twin recording from t = 0 and the front only from t = 5.
        let (a, b) = (
            Shared::new(waves(7)).unwrap(),
            Shared::new(waves(7)).unwrap(),
        );
        let (mut a, mut b) = (a.lock(), b.lock());
        record(&mut b);
        a.advance(5.0);
        record(&mut a);
        let skipped = a.background_arrivals;
        assert!(skipped > 0);
        a.advance(40.0);
        b.advance(40.0);
        let (ta, tb) = (
            &a.interactive_log.as_ref().unwrap().timings,
            &b.interactive_log.as_ref().unwrap().timings,
        );
        assert_eq!(tb.len() as u64, b.background_arrivals);
        assert_eq!(ta.len() as u64, a.background_arrivals - skipped);
        assert_eq!(ta.first().map(|t| t.index), Some(skipped));
        // The same requests with the same first tokens: nothing else ran.
        for t in ta {
            assert_eq!(Some(t), tb.get(t.index as usize));
        }
        // Requests got first tokens before they finished (they stream
        // while recorded), and TTFTs are positive.
        assert!(ta.iter().filter(|t| t.first_token_at.is_some()).count() > ta.len() / 2);
        for t in ta.iter().chain(tb) {
            if let Some(at) = t.first_token_at {
                assert!(at > t.arrival, "{t:?}");
            }
        }
    }

    #[test]
    fn interactive_requests_are_not_recorded_unless_asked() {
        let s = Shared::new(waves(7)).unwrap();
        let mut live = s.lock();
        live.advance(20.0);
        assert!(live.background_arrivals > 0);
        assert!(live.interactive_log.is_none());
    }

    #[test]
    fn parses_interactive_arg() {
        assert_eq!("waves".parse::<InteractiveArg>(), Ok(InteractiveArg::Waves));
        assert_eq!(
            "trace:/x.csv".parse::<InteractiveArg>(),
            Ok(InteractiveArg::Trace("/x.csv".into()))
        );
        assert!("trace:".parse::<InteractiveArg>().is_err());
        assert!("busy".parse::<InteractiveArg>().is_err());
    }

    #[test]
    fn args_override_config() {
        let cfg = ServeArgs {
            pool_name: Some("p".into()),
            replicas: Some(3),
            interactive: Some(InteractiveArg::Poisson),
            ..Default::default()
        }
        .into_config()
        .unwrap();
        assert_eq!(cfg.pool_name, "p");
        assert_eq!(cfg.replicas, 3);
        assert_eq!(cfg.interactive.mode, LoadMode::Poisson);
        assert_eq!(cfg.listen, Some(SocketAddr::from(([127, 0, 0, 1], 8000))));
    }

    #[test]
    fn parse_estimates_tokens_and_rejects_bad_input() {
        let cfg = SimConfig::default();
        let p = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"abcdefgh","max_tokens":5}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens, p.stream), (2, 5, false));
        let p = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"abcd"}],"stream":true}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!(p.prompt_tokens, 5);
        assert!(p.stream);
        for bad in [
            &br#"{"prompt": 3"#[..],
            br#"[1,2]"#,
            br#"{"max_tokens": 5}"#,
            br#"{"prompt": "x", "max_tokens": 0}"#,
            br#"{"prompt": "x", "stream": "yes"}"#,
            br#"{"prompt": "x", "max_tokens": 100000}"#,
        ] {
            let r = parse(Api::Completions, bad, &cfg)
                .unwrap_err()
                .into_response();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        }
        assert!(parse(Api::Chat, br#"{"messages": []}"#, &cfg).is_err());
    }

    #[test]
    fn embeddings_are_prefill_only_and_responses_take_max_output_tokens() {
        let cfg = SimConfig::default();
        // `max_tokens` and `stream` mean nothing to embeddings: one token,
        // the prefill's, ends them.
        let p = parse(
            Api::Embeddings,
            br#"{"model":"e","input":["abcd","efgh"],"max_tokens":50,"stream":true}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens, p.stream), (2, 1, false));
        assert_eq!(p.embed.map(|e| e.seeds.len()), Some(2));
        let p = parse(
            Api::Responses,
            br#"{"input":"abcdefgh","max_output_tokens":7,"max_tokens":99}"#,
            &cfg,
        )
        .unwrap();
        assert_eq!((p.prompt_tokens, p.max_tokens), (2, 7));
        for bad in [
            &br#"{"input":"x","stream":true}"#[..],
            br#"{"input":[]}"#,
            br#"{"input":"x","max_output_tokens":0}"#,
        ] {
            let r = parse(Api::Responses, bad, &cfg)
                .unwrap_err()
                .into_response();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        }
        assert!(parse(Api::Embeddings, br#"{"input":[]}"#, &cfg).is_err());
    }
}
