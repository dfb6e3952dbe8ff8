//! `sluicegate bench drain`: N messages through a real Redis and a gateway
//! that answers instantly; prints messages/s, CPU seconds per 1 000
//! messages, peak RSS, peak in flight and Redis commands per 1 000
//! messages (docs/benchmarks.md).

use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::measure::{
    Stopwatch, bench_requests, drain_config, instant_gateway, peak_until_drained,
    print_drain_figures, start_dispatcher,
};
use crate::cli::args::RedisArgs;
use crate::queue::Client;
use crate::queue::redis::{Keys, RedisClient};

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

pub(super) async fn drain(args: DrainArgs) -> Result<(), String> {
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
        .arg(&keys.lanes)
        .arg(keys.lane(""))
        .arg(&keys.lane_cursor)
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

    let queue_table = format!(
        "queue_name = \"{}\"\nresult_queue_name = \"{results}\"",
        args.queue
    );
    let mut config = drain_config(
        r#"transport = "redis""#,
        &gateway,
        &queue_table,
        args.max_sys,
    )?;
    config.redis = Some(redis_config);
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
    let redis_cpu_before = redis_cpu_seconds(&mut conn).await?;
    let stopwatch = Stopwatch::start();
    let (running, shutdown) = start_dispatcher(&config).await?;
    let peak_in_flight = peak_until_drained(&running, &args.queue, async || {
        let n: u64 = redis::cmd("LLEN")
            .arg(&results)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("redis: {e}"))?;
        bar.set_position(n);
        Ok(n >= args.messages as u64)
    })
    .await?;
    let (secs, cpu) = stopwatch.stop();
    let redis_cpu = redis_cpu_seconds(&mut conn).await? - redis_cpu_before;
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
    // Redis shares the machine's cores with the dispatcher: its CPU is
    // what separates this drain from the in-memory one (docs/benchmarks.md).
    println!(
        "  redis-server used {:.3} CPU s per 1000 messages (INFO cpu, its polls included)",
        redis_cpu / args.messages as f64 * 1000.0
    );
    println!("  in flight: at most {peak_in_flight} (sampled every 10 ms)");
    println!(
        "  Redis commands per 1000 messages (scripts and the commands they call; the benchmark's own polls left out): {}",
        commands_per_thousand(&stats, args.messages)
    );
    Ok(())
}

/// CPU seconds (user + system, its threads included) the Redis server has
/// used since it started, from `INFO cpu`.
async fn redis_cpu_seconds(conn: &mut impl redis::aio::ConnectionLike) -> Result<f64, String> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .map_err(|e| format!("redis: {e}"))?;
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Ok(field("used_cpu_user") + field("used_cpu_sys"))
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
