//! sluicegate: lets LLM batch work use the idle capacity of an inference
//! pool without hurting its interactive users.
//!
//! Batch requests wait in a queue; sluicegate pulls them only as fast as a
//! [`gate`] says the pool has slack, sends them to the inference gateway,
//! and writes exactly one result per submission before acknowledging it.
//!
//! # Layout
//!
//! The data flow, one module per step:
//!
//! - [`queue`]: the [`queue::Queue`] contract (lease, ack with result,
//!   nack with delay, extend lease, dead letter, close) and its transports:
//!   in-memory (`src/queue/memory.rs`), [`queue::redis`] (Redis sorted
//!   sets, `src/queue/redis/`), [`queue::embedded`] (the durable SQLite
//!   store, `src/queue/embedded/`), [`queue::pubsub`] (Google Cloud
//!   Pub/Sub, `src/queue/pubsub/`), [`queue::sql`] (PostgreSQL,
//!   `src/queue/sql/`); [`queue::open`] builds the configured one. Beside
//!   it the client face, [`queue::Client`] (enqueue, cancel, results after
//!   a cursor, active ids), one per transport, opened by
//!   [`queue::open_client`]: what the producer commands and `serve` use.
//! - [`request`]: parsing queue bytes into validated request messages.
//! - [`gate`]: [`gate::DispatchGate`] (budget `D`, baseline `B`, admission
//!   verdicts), the gates, and the staleness / fail-closed wrappers.
//! - [`source`]: metric sources the gates read (PromQL, `/metrics` scrape
//!   with our own text-format parser, a Redis key) and their single-flight
//!   TTL cache.
//! - [`dispatch`]: window arithmetic and request costs (pure), the
//!   congestion hold after 429/503 (pure, shared by the queues of one
//!   pool), pools whose queues share one window (pure, `pool.rs`) and
//!   take turns at it by a merge policy (pure, `merge.rs`), the
//!   shared window across replicas (a Redis lease semaphore,
//!   `shared_window.rs`), the retry policy (pure), fair shares among
//!   tenants (pure, `fair.rs`), the inert-gate detector (pure,
//!   `inert.rs`), settings from the typed config, and the dispatch loop
//!   split by task (receive, send, settle, observe) over the state they
//!   share (`state.rs`).
//! - [`gateway`]: the HTTP client, endpoint and header rules, and response
//!   classification.
//! - [`result`]: result records and error codes.
//! - [`telemetry`]: the metrics registry, `/metrics` `/healthz` `/readyz`,
//!   logging, and OTLP trace export (off by default,
//!   `src/telemetry/traces.rs`).
//! - [`config`]: file + environment + flags into a typed configuration.
//! - [`batch`]: the batch-file runner (OpenAI batch files through a
//!   catalogue gate, resumable through an embedded store), the one
//!   OpenAI-line converter.
//! - [`chart`]: SVG line charts (stacked panels over a shared time axis,
//!   drawn with `plotters`) for the demo and `eval`.
//! - [`relay`]: a streamed flex request's event stream from the
//!   dispatcher to the `serve` holding its client, as it arrives (in
//!   process, or a Redis Stream per request); the record still goes
//!   whole through the queue.
//! - [`serve`]: the OpenAI Files and Batches API (`sluicegate serve`):
//!   batches become queue messages (in file order, or grouped by model
//!   and shared prompt prefix, `serve::order`), their results output
//!   files; records in SQLite (embedded) or Redis (replicas).
//! - [`app`]: wiring ([`app::run`]) and the shutdown order;
//!   [`cli`]: the subcommands (parse flags, call `app`; shared connection
//!   flags in `args.rs`, output formats in `output.rs`, benchmarks in
//!   `bench/`).
//! - [`sim`]: the vLLM-like pool simulator (virtual time and HTTP front).
//! - [`servers`]: real servers the benchmarks and the integration tests
//!   start for themselves (Prometheus, PostgreSQL, the Pub/Sub emulator,
//!   `redis-server`), each on a free loopback port, stopped by PID.
//! - [`eval`]: gate quality in virtual time (`sluicegate eval`): the
//!   production gates, window and congestion hold driving the simulator,
//!   scored against a batch-free twin run; and on a real engine in real
//!   time (`eval --live URL`, `eval/live/`).
//!
//! Under all of them, the ground floor: [`tasks`] (the task tree: every
//! long-lived task named, a panic stops the run), [`redis`] (one Redis
//! server or a cluster, for transports, gates, sources, the shared window
//! and `serve`), [`postgres`] (one PostgreSQL connection and the `sql`
//! tables, for the `sql` transport and the `sql-quota` gate), [`clock`]
//! (Unix time), [`headers`] (the header rules the gateway client, the
//! config and `serve` share), [`prompt`] (a request body's prompt text and
//! block identities, the tokenization proxy the simulator's prefix cache
//! and `serve`'s prefix order share), [`secret`] (secrets and URLs that
//! may carry a password: never printed, masked when shown), [`values`]
//! (loose settings values to typed ones, duration text and the keyed
//! [`values::ConfigError`], for the config and the gates' parameters),
//! [`batch_status`] (the OpenAI batch states `serve` moves batches through
//! and the telemetry counts), [`endpoint`] (the endpoints a batch may name,
//! their body checks, and the configured list `serve` and `batch` take). `docs/architecture.md`,
//! "Code layout", draws the layers.

/// The database clock in Unix milliseconds, for the statement text of the
/// `sql` transport and the `sql-quota` gate: every lease and quota window
/// is timed by it, so dispatchers on hosts with skewed clocks agree.
/// Defined before the modules so both see it.
macro_rules! now_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

pub mod app;
pub mod batch;
pub mod batch_status;
pub mod chart;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dispatch;
pub mod endpoint;
pub mod eval;
pub mod gate;
pub mod gateway;
pub mod headers;
pub mod postgres;
pub mod prompt;
pub mod queue;
pub mod redis;
pub mod relay;
pub mod request;
pub mod result;
pub mod secret;
pub mod serve;
pub mod servers;
pub mod sim;
pub mod source;
pub mod tasks;
pub mod telemetry;
pub mod values;
