//! `sluicegate bench drain-memory`: the dispatch core alone. N small
//! requests from the in-memory queue through the `constant` gate into a
//! gateway in this process that answers at once; prints messages/s, CPU
//! seconds per 1 000 messages and peak RSS (docs/benchmarks.md).
//!
//! The gateway shares the process and the cores, so the CPU figure
//! includes serving the answers. Set against `bench drain` (the same
//! dispatcher on a real Redis) in the same minutes, it tells what the
//! Redis transport costs (`scripts/bench-compare.sh`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::measure::{Stopwatch, bench_requests, instant_gateway, print_drain_figures};
use crate::dispatch::{DispatchSettings, QueueDispatcher, RetryPolicy};
use crate::gate::{ConstantGate, FailClosed};
use crate::gateway::{GatewayClient, GatewaySettings, Target};
use crate::queue::{Client, MemoryQueue};
use crate::tasks::Tasks;
use crate::telemetry::Metrics;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Args)]
pub(crate) struct DrainMemoryArgs {
    /// Messages to drain.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Window (`max_sys` of the constant gate).
    #[arg(long, default_value_t = 512.0)]
    max_sys: f64,
}

pub(super) async fn drain_memory(args: DrainMemoryArgs) -> Result<(), String> {
    let (gateway, _gateway_task) = instant_gateway().await.map_err(|e| e.to_string())?;
    let queue = Arc::new(MemoryQueue::new("bench-drain-memory"));
    let deadline = crate::clock::unix_secs() + 3600;
    // Every message is in the queue before the clock starts, as the Redis
    // drain enqueues before it starts the dispatcher.
    let requests = bench_requests(0..args.messages, deadline, 1);
    (queue.enqueue(requests, None).await).map_err(|e| e.to_string())?;
    let settings = DispatchSettings {
        max_sys: args.max_sys,
        receive_wait: Duration::from_millis(50),
        ..DispatchSettings::default()
    };
    let metrics = Metrics::new();
    let dispatcher = QueueDispatcher {
        queue: queue.clone(),
        gate: Arc::new(FailClosed::new(
            Box::new(ConstantGate::default()),
            settings.max_staleness,
        )),
        gateway: GatewayClient::new(
            GatewaySettings::default().keeping_idle_for(args.max_sys.ceil() as usize),
        )
        .map_err(|e| e.to_string())?,
        target: Target::new(&gateway, "/v1/completions", None).map_err(|e| e.to_string())?,
        retry: RetryPolicy::default(),
        congestion: Arc::default(),
        pool: Arc::default(),
        settings,
        metrics: metrics.queue("bench-drain-memory"),
        labels: BTreeMap::new(),
        traces: None,
        relay: crate::relay::Relay::default(),
    };
    let shutdown = CancellationToken::new();
    let tasks = Tasks::new();
    let stopwatch = Stopwatch::start();
    let run = tokio::spawn(dispatcher.run(shutdown.clone(), tasks.clone()));
    // The window's in flight, sampled (see `bench drain`).
    let window = metrics.queue("bench-drain-memory");
    let mut peak_in_flight = 0;
    while queue.result_count() < args.messages {
        peak_in_flight = peak_in_flight.max(window.in_flight.get());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (secs, cpu) = stopwatch.stop();
    shutdown.cancel();
    run.await.map_err(|e| e.to_string())?;
    tasks.stop().await;
    let ok = queue
        .results()
        .iter()
        .filter(|r| r.status_code == Some(200))
        .count();
    println!(
        "in-memory drain benchmark: {} messages ({ok} ok), window {}",
        args.messages, args.max_sys
    );
    print_drain_figures(args.messages, secs, cpu, "dispatcher + in-process gateway");
    println!("  in flight: at most {peak_in_flight} (sampled every 5 ms)");
    Ok(())
}
