//! `sluicegate bench drain`: N messages through a real Redis and a gateway
//! that answers instantly; prints messages/s, CPU seconds per 1 000
//! messages and peak RSS (docs/benchmarks.md). `bench drain-memory` is in
//! `bench_memory.rs`, `bench hold` in `bench_hold.rs`; `bench
//! drain-pubsub` drains through Pub/Sub (`src/cli/pubsub.rs`), `bench
//! drain-sql` through PostgreSQL (`bench_sql.rs`).

use std::process::ExitCode;
use std::ops::Range;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use super::args::RedisArgs;
use crate::config::Config;
use crate::queue::redis::{Keys, RedisClient};
use crate::queue::{Client, Outgoing};

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Drain N messages from Redis through an instant gateway.
    Drain(DrainArgs),
    /// Drain N messages from the in-memory queue through an instant
    /// gateway: the dispatch core without a transport.
    DrainMemory(super::bench_memory::DrainMemoryArgs),
    /// Hold N concurrent slow requests in one dispatcher process.
    Hold(super::bench_hold::HoldArgs),
    /// Drain N messages from a Pub/Sub subscription (the emulator or a
    /// real project) through an instant gateway.
    DrainPubsub(super::pubsub::DrainArgs),
    /// Drain N messages from PostgreSQL (the `sql` transport) through an
    /// instant gateway.
    DrainSql(super::bench_sql::DrainSqlArgs),
    /// 1, 2, 4 replicas on one Redis queue with the shared window, against
    /// the simulator: global in flight against the window, throughput.
    Replicas(super::bench_replicas::ReplicasArgs),
}

#[derive(Debug, Args)]
pub(crate) struct DrainArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Messages to drain.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Queue name (its keys are deleted first).
    #[arg(long, default_value = "bench-drain")]
    queue: String,
    /// Window (`max_sys` of the constant gate).
    #[arg(long, default_value_t = 512.0)]
    max_sys: f64,
}

pub(super) async fn run(command: BenchCommand) -> ExitCode {
    let (name, outcome) = match command {
        BenchCommand::Drain(args) => ("drain", drain(args).await),
        BenchCommand::DrainMemory(args) => (
            "drain-memory",
            super::bench_memory::drain_memory(args).await,
        ),
        BenchCommand::Hold(args) => ("hold", super::bench_hold::hold(args).await),
        BenchCommand::DrainPubsub(args) => ("drain-pubsub", super::pubsub::drain(args).await),
        BenchCommand::DrainSql(args) => ("drain-sql", super::bench_sql::drain_sql(args).await),
        BenchCommand::Replicas(args) => ("replicas", super::bench_replicas::replicas(args).await),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench {name}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// CPU seconds (user + system) so far of process `pid` (`self` for this
/// one), from /proc.
pub(super) fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // USER_HZ is 100 on Linux.
    Some((utime + stime) / 100.0)
}

/// Wall time and this process's CPU since [`Stopwatch::start`]: what every
/// in-process drain benchmark reports.
pub(super) struct Stopwatch {
    started: Instant,
    cpu_before: f64,
}

impl Stopwatch {
    pub(super) fn start() -> Self {
        Self {
            started: Instant::now(),
            cpu_before: cpu_seconds("self").unwrap_or(0.0),
        }
    }

    /// Seconds elapsed and CPU seconds used since the start.
    pub(super) fn stop(&self) -> (f64, f64) {
        (
            self.started.elapsed().as_secs_f64(),
            cpu_seconds("self").unwrap_or(0.0) - self.cpu_before,
        )
    }
}

/// The figures every drain benchmark prints, in the form
/// `scripts/bench-compare.sh` reads: messages/s, CPU seconds per 1 000
/// messages (`counted`: whose CPU that is) and this process's peak RSS.
pub(super) fn print_drain_figures(messages: usize, secs: f64, cpu: f64, counted: &str) {
    println!(
        "  drained in {secs:.2}s: {:.0} messages/s",
        messages as f64 / secs
    );
    println!(
        "  CPU: {:.3}s per 1000 messages ({counted})",
        cpu / messages as f64 * 1000.0
    );
    println!("  peak RSS: {:.1} MiB", peak_rss_mib("self").unwrap_or(0.0));
}

/// Peak resident set size of process `pid` in MiB, from /proc.
pub(super) fn peak_rss_mib(pid: &str) -> Option<f64> {
    status_kib(pid, "VmHWM:").map(|kib| kib / 1024.0)
}

/// A `kB` line (`VmHWM:`, `VmRSS:`) of /proc/<pid>/status.
pub(super) fn status_kib(pid: &str, key: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The requests `bench-<i>` for `ids`, with `deadline` (Unix seconds),
/// each asking for `max_tokens` tokens: what every drain enqueues.
pub(super) fn bench_requests(ids: Range<usize>, deadline: i64, max_tokens: u32) -> Vec<Outgoing> {
    ids.map(|i| Outgoing {
        body: format!(
            r#"{{"id":"bench-{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hello","max_tokens":{max_tokens}}}}}"#
        )
        .into(),
        deadline,
    })
    .collect()
}

pub(super) async fn instant_gateway() -> std::io::Result<(String, tokio::task::JoinHandle<()>)> {
    use axum::routing::post;
    let app = axum::Router::new().fallback(post(|| async {
        (
            [("content-type", "application/json")],
            r#"{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#,
        )
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("http://{addr}"), task))
}

async fn drain(args: DrainArgs) -> Result<(), String> {
    let redis_config = args.redis.config()?;
    let mut conn = args.redis.connect()?;
    let results = format!("{}-results", args.queue);
    let keys = Keys::new(&args.queue, false);
    redis::cmd("DEL")
        .arg(&args.queue)
        .arg(&results)
        .arg(&keys.claimed)
        .arg(&keys.owners)
        .arg(&keys.idx)
        .arg(&keys.scores)
        .arg(&keys.dead)
        .query_async::<()>(&mut conn)
        .await
        .map_err(|e| format!("redis: {e}"))?;
    let (gateway, _gateway_task) = instant_gateway().await.map_err(|e| e.to_string())?;

    let deadline = crate::clock::unix_secs() + 3600;
    let fill = Instant::now();
    // The queue's result list is configured below: messages name none.
    let client = RedisClient::new(conn.clone(), args.queue.clone(), None, None);
    for start in (0..args.messages).step_by(1000) {
        let requests = bench_requests(start..(start + 1000).min(args.messages), deadline, 1);
        (client.enqueue(requests, None).await).map_err(|e| e.to_string())?;
    }
    let fill_secs = fill.elapsed().as_secs_f64();

    let toml = format!(
        r#"
transport = "redis"
[gateway]
url = "{gateway}"
[dispatch]
receive_wait = "50ms"
[telemetry]
listen = "127.0.0.1:0"
log_level = "warn"
[[queue]]
queue_name = "{queue}"
result_queue_name = "{results}"
max_sys = {max_sys}
gate_type = "constant"
"#,
        queue = args.queue,
        max_sys = args.max_sys,
    );
    let mut config =
        Config::from_toml_str(&toml, &Default::default()).map_err(|e| e.to_string())?;
    config.redis = Some(redis_config);
    let shutdown = CancellationToken::new();
    let bar = ProgressBar::new(args.messages as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} results {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // Redis counts every command it serves from here on: the round trips
    // the drain costs per message, whatever this machine's speed.
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await
        .map_err(|e| format!("redis: {e}"))?;
    let stopwatch = Stopwatch::start();
    let running = crate::app::start(
        &config,
        crate::app::RunOptions::default(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(|e| e.to_string())?;
    // The window's in flight, sampled: how wide it really opened, and so
    // how many gateway connections were open at once.
    let window = running.metrics.queue(&args.queue);
    let mut peak_in_flight = 0;
    loop {
        peak_in_flight = peak_in_flight.max(window.in_flight.get());
        let n: u64 = redis::cmd("LLEN")
            .arg(&results)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("redis: {e}"))?;
        bar.set_position(n);
        if n >= args.messages as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (secs, cpu) = stopwatch.stop();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("redis: {e}"))?;
    bar.finish_and_clear();
    shutdown.cancel();
    running.wait().await.map_err(|e| e.to_string())?;
    println!(
        "drain benchmark: {} messages, window {}",
        args.messages, args.max_sys
    );
    println!("  enqueue (pipelined, 1000 per round trip): {fill_secs:.2}s");
    print_drain_figures(args.messages, secs, cpu, "dispatcher + in-process gateway");
    println!("  in flight: at most {peak_in_flight} (sampled every 10 ms)");
    println!(
        "  Redis commands per 1000 messages (scripts and the commands they call; the benchmark's own polls left out): {}",
        commands_per_thousand(&stats, args.messages)
    );
    Ok(())
}

/// `INFO commandstats` as `total (name calls, ...)` per 1 000 messages,
/// busiest first, without the benchmark's own `llen` polling.
fn commands_per_thousand(stats: &str, messages: usize) -> String {
    let mut calls: Vec<(String, f64)> = stats
        .lines()
        .filter_map(|line| {
            // cmdstat_evalsha:calls=123,usec=...
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let n: f64 = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            (name != "llen" && name != "config" && name != "info")
                .then(|| (name.to_owned(), n / messages.max(1) as f64 * 1000.0))
        })
        .collect();
    calls.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = calls.iter().map(|(_, n)| n).sum();
    let each: Vec<String> = calls
        .iter()
        .map(|(name, n)| format!("{name} {n:.1}"))
        .collect();
    format!("{total:.1} ({})", each.join(", "))
}
