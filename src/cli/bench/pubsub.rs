//! `sluicegate bench drain-pubsub`: `bench drain` on Pub/Sub, against the
//! emulator or a real project: fresh topics and subscriptions per run,
//! requests published and results read back through the queue's client.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use clap::Args;

use super::measure::{
    Stopwatch, bench_requests, drain_config, instant_gateway, print_drain_figures, start_dispatcher,
};
use crate::cli::args::PubSubArgs;
use crate::cli::output::bar;
use crate::queue::pubsub::{DEFAULT_MAX_DELIVERY_ATTEMPTS, PubSubClient, SetupPlan, setup};
use crate::queue::{Client, Cursor};

/// Messages per publish batch (Pub/Sub allows 1000 per request).
const PUBLISH_CHUNK: usize = 1000;

/// `sluicegate bench drain-pubsub`.
#[derive(Debug, Args)]
pub(crate) struct DrainArgs {
    #[command(flatten)]
    pubsub: PubSubArgs,
    /// Messages to drain.
    #[arg(long, default_value_t = 5_000)]
    messages: usize,
    /// Window (`max_sys` of the constant gate).
    #[arg(long, default_value_t = 512.0)]
    max_sys: f64,
}

/// Creates fresh topics and subscriptions (named after the time, so runs
/// never share a backlog), publishes N requests, runs the dispatcher on an
/// instant gateway and reads the results back in this process until all
/// N are in.
pub(super) async fn drain(args: DrainArgs) -> Result<(), String> {
    let client = args.pubsub.client().await?;
    let tag = format!(
        "bench-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let plan = SetupPlan {
        request_topic: format!("{tag}-requests"),
        subscription: format!("{tag}-work"),
        dead_letter_topic: None,
        max_delivery_attempts: DEFAULT_MAX_DELIVERY_ATTEMPTS,
        min_backoff: Duration::from_secs(1),
        max_backoff: Duration::from_secs(60),
        ack_deadline_secs: 30,
        exactly_once: false,
        result_topic: format!("{tag}-results"),
        result_subscription: Some(format!("{tag}-results-sub")),
    };
    setup(&client, &plan).await.map_err(|e| e.to_string())?;
    let (gateway, _gateway_task) = instant_gateway().await.map_err(|e| e.to_string())?;
    let deadline = crate::clock::unix_secs() + 3600;
    let fill = Instant::now();
    let queue = PubSubClient::new(
        &client,
        Some(plan.request_topic.clone()),
        plan.result_subscription.clone(),
    );
    for start in (0..args.messages).step_by(PUBLISH_CHUNK) {
        let requests = bench_requests(
            start..(start + PUBLISH_CHUNK).min(args.messages),
            deadline,
            1,
        );
        (queue.enqueue(requests, None).await).map_err(|e| e.to_string())?;
    }
    let fill_secs = fill.elapsed().as_secs_f64();
    let emulator = args
        .pubsub
        .pubsub_emulator_host
        .as_ref()
        .map(|h| format!("emulator_host = \"{h}\"\n"))
        .unwrap_or_default();
    let credentials = args
        .pubsub
        .pubsub_credentials_file
        .as_ref()
        .map(|p| format!("credentials_file = \"{}\"\n", p.display()))
        .unwrap_or_default();
    let transport = format!(
        r#"transport = "pubsub"
[pubsub]
project_id = "{project}"
result_topic_id = "{results}"
{emulator}{credentials}"#,
        project = args.pubsub.pubsub_project.clone().unwrap_or_default(),
        results = plan.result_topic,
    );
    let queue_table = format!("subscriber_id = \"{}\"", plan.subscription);
    let config = drain_config(&transport, &gateway, &queue_table, args.max_sys)?;
    let bar = bar(Some(args.messages as u64), "results");
    let stopwatch = Stopwatch::start();
    let (running, shutdown) = start_dispatcher(&config).await?;
    let mut seen = HashSet::new();
    while seen.len() < args.messages {
        let page = (queue
            .results(Cursor::default(), crate::queue::pubsub::MAX_PULL)
            .await)
            .map_err(|e| e.to_string())?;
        seen.extend((page.results.iter()).filter_map(|r| r.record.as_ref().map(|r| r.id.clone())));
        (queue.confirm(page.results, Vec::new()).await).map_err(|e| e.to_string())?;
        bar.set_position(seen.len() as u64);
    }
    let (secs, cpu) = stopwatch.stop();
    bar.finish_and_clear();
    shutdown.cancel();
    running.wait().await.map_err(|e| e.to_string())?;
    println!(
        "pubsub drain benchmark: {} messages, window {}, subscription {}",
        args.messages, args.max_sys, plan.subscription
    );
    println!("  publish (1000 per batch, confirmed): {fill_secs:.2}s");
    print_drain_figures(
        args.messages,
        secs,
        cpu,
        "dispatcher + in-process gateway + result reader; the emulator's own CPU is not counted",
    );
    Ok(())
}
