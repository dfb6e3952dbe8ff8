//! `sluicegate bench replicas`: 1, 2, 4, … `sluicegate run` processes on
//! one Redis queue with the shared window on, against the simulator with a
//! metric gate (`endpoint-scrape` of its running requests). For each
//! replica count it prints the global batch in flight, sampled at the
//! simulator and from the semaphore, against the window, and the
//! throughput (docs/benchmarks.md).

use std::process::Child;
use std::time::{Duration, Instant};

use crate::redis::RedisConnection;
use clap::Args;

use super::measure::{bench_requests, pool_in_flight};
use crate::cli::args::RedisArgs;
use crate::dispatch::shared_window::Keys as WindowKeys;
use crate::queue::Client;
use crate::queue::redis::{Keys, RedisClient};
use crate::sim::{SimConfig, SimHandle, spawn_http};

#[derive(Debug, Args)]
pub(crate) struct ReplicasArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// Replica counts to run, one after the other.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    replicas: Vec<usize>,
    /// Messages per run.
    #[arg(long, default_value_t = 600)]
    messages: usize,
    /// `max_tokens` of each request (the simulator takes ~10 ms a token).
    #[arg(long, default_value_t = 50)]
    max_tokens: u32,
    /// Running requests per pod the gate counts as full (`max_count_per_pod`).
    #[arg(long, default_value_t = 24.0)]
    max_count: f64,
    /// Baseline B: the window is `max_count × (1 − B)`.
    #[arg(long, default_value_t = 0.25)]
    baseline: f64,
    /// `shared_window`: `redis` (default) or `off`, to see what it prevents.
    #[arg(long, default_value = "redis")]
    shared_window: String,
    /// Queue name (its keys are deleted before each run).
    #[arg(long, default_value = "bench-replicas")]
    queue: String,
}

/// One `sluicegate run` child, killed (by PID) on drop.
struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one run measured.
struct RunStats {
    secs: f64,
    max_pool: f64,
    max_held: i64,
    max_total: i64,
    samples: usize,
}

pub(super) async fn replicas(args: ReplicasArgs) -> Result<(), String> {
    let mut conn = args.redis.connect()?;
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        replicas: 2,
        ..SimConfig::default()
    };
    // Every request runs at once: what runs there is what was sent.
    cfg.engine.max_num_seqs = 1024;
    let sim = spawn_http(cfg).await.map_err(|e| e.to_string())?;
    let window = (args.max_count * (1.0 - args.baseline)).floor();
    println!(
        "replicas benchmark: {} messages of {} tokens per run, endpoint-scrape gate, window {window} (max_count {} × (1 − {})), shared_window {}",
        args.messages, args.max_tokens, args.max_count, args.baseline, args.shared_window
    );
    println!(
        "| replicas | max in flight at the simulator | max units held (semaphore) | max semaphore total | window | drain time | messages/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &count in &args.replicas {
        let stats = run_once(&args, &sim, &mut conn, count.max(1)).await?;
        println!(
            "| {count} | {} | {} | {} | {window} | {:.1} s | {:.1} |",
            stats.max_pool,
            stats.max_held,
            stats.max_total,
            stats.secs,
            args.messages as f64 / stats.secs
        );
        tracing::debug!(samples = stats.samples, "run sampled");
    }
    Ok(())
}

async fn run_once(
    args: &ReplicasArgs,
    sim: &SimHandle,
    conn: &mut RedisConnection,
    count: usize,
) -> Result<RunStats, String> {
    let pool = sim.base_url().trim_end_matches('/').to_owned();
    let window_keys = WindowKeys::new(&pool);
    let keys = Keys::new(&args.queue, false);
    let results = format!("{}-results", args.queue);
    let mut del = redis::cmd("DEL");
    del.arg(&args.queue)
        .arg(&results)
        .arg(&keys.claimed)
        .arg(&keys.owners)
        .arg(&keys.idx)
        .arg(&keys.scores)
        .arg(&keys.dead);
    for key in window_keys.all() {
        del.arg(key);
    }
    del.query_async::<()>(conn).await.map_err(redis_error)?;
    let deadline = crate::clock::unix_secs() + 3600;
    // The replicas' queue names the result list: messages name none.
    let client = RedisClient::new(conn.clone(), args.queue.clone(), None, None);
    let requests = bench_requests(0..args.messages, deadline, args.max_tokens);
    (client.enqueue(requests, None).await).map_err(|e| e.to_string())?;

    let started = Instant::now();
    let children: Vec<Replica> = (0..count)
        .map(|_| spawn_replica(args, sim, &results))
        .collect::<Result<_, _>>()?;
    let http = reqwest::Client::new();
    let mut stats = RunStats {
        secs: 0.0,
        max_pool: 0.0,
        max_held: 0,
        max_total: 0,
        samples: 0,
    };
    // Bounded: a run that makes no progress for a minute is an error.
    let mut last_progress = (0u64, Instant::now());
    loop {
        stats.max_pool = stats
            .max_pool
            .max(pool_in_flight(&http, &format!("{}/metrics", sim.base_url())).await?);
        let held: Vec<i64> = redis::cmd("HVALS")
            .arg(window_keys.held())
            .query_async(conn)
            .await
            .map_err(redis_error)?;
        stats.max_held = stats.max_held.max(held.iter().sum());
        let total: Option<i64> = redis::cmd("GET")
            .arg(window_keys.total())
            .query_async(conn)
            .await
            .map_err(redis_error)?;
        stats.max_total = stats.max_total.max(total.unwrap_or(0));
        stats.samples += 1;
        let done: u64 = redis::cmd("LLEN")
            .arg(&results)
            .query_async(conn)
            .await
            .map_err(redis_error)?;
        if done >= args.messages as u64 {
            break;
        }
        if done > last_progress.0 {
            last_progress = (done, Instant::now());
        } else if last_progress.1.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "no progress for a minute at {done}/{} results",
                args.messages
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stats.secs = started.elapsed().as_secs_f64();
    drop(children);
    Ok(stats)
}

fn spawn_replica(args: &ReplicasArgs, sim: &SimHandle, results: &str) -> Result<Replica, String> {
    let redis = args.redis.config()?;
    super::measure::replica_command(&super::measure::ReplicaSpec {
        redis_url: redis.url.expose().as_str(),
        queue: &args.queue,
        results,
        gateway: &sim.base_url(),
        gate: super::measure::ReplicaGate::endpoint_scrape(
            format!("{}/metrics", sim.base_url()),
            args.max_count,
            args.baseline,
        ),
        max_count: args.max_count,
        shared_window: &args.shared_window,
        lease: "3s".to_owned(),
    })?
    .env("SLUICEGATE_LOG_LEVEL", "warn")
    .spawn()
    .map(Replica)
    .map_err(|e| format!("spawn a replica: {e}"))
}

fn redis_error(e: redis::RedisError) -> String {
    format!("redis: {e}")
}
