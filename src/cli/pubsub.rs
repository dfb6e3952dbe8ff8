//! `sluicegate pubsub setup` and `sluicegate bench drain-pubsub` (the
//! producer tools reach Pub/Sub through the queue's client like every
//! transport: `submit --pubsub-topic`, `results --pubsub-subscription`).

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;

use super::args::PubSubArgs;
use super::output::bar;
use crate::config::parse_duration;
use crate::queue::pubsub::{DEFAULT_MAX_DELIVERY_ATTEMPTS, PubSubClient, SetupPlan, setup};
use crate::queue::{Client, Cursor};

/// Messages per publish batch (Pub/Sub allows 1000 per request).
const PUBLISH_CHUNK: usize = 1000;

/// `sluicegate pubsub setup`.
#[derive(Debug, Args)]
pub(crate) struct SetupArgs {
    #[command(flatten)]
    pubsub: PubSubArgs,
    /// Request topic submitters publish to.
    #[arg(long)]
    topic: String,
    /// The dispatcher's subscription on it (the queue's `subscriber_id`).
    #[arg(long)]
    subscription: String,
    /// Result topic (`pubsub.result_topic_id`).
    #[arg(long)]
    result_topic: String,
    /// Subscription on the result topic for `sluicegate results`.
    #[arg(long)]
    result_subscription: Option<String>,
    /// Dead-letter topic (a subscription `<topic>-sub` is made on it);
    /// without it the subscription has no dead-letter policy.
    #[arg(long)]
    dead_letter_topic: Option<String>,
    /// Deliveries before the broker dead-letters a message (5..=100). The
    /// default is the ceiling: broker dead-letters publish no result, so
    /// they are a last resort behind `dispatch.max_attempts` (a delivery at
    /// the limit is answered by the dispatcher first).
    #[arg(long, default_value_t = DEFAULT_MAX_DELIVERY_ATTEMPTS, value_parser = clap::value_parser!(i32).range(5..=100))]
    max_delivery_attempts: i32,
    /// Retry policy: the broker's first redelivery backoff after a nack.
    #[arg(long, default_value = "1s")]
    min_backoff: String,
    /// Retry policy: the longest redelivery backoff (at most 600s).
    #[arg(long, default_value = "60s")]
    max_backoff: String,
    /// The subscription's ack deadline (10s..=600s); match `dispatch.lease`
    /// to save one deadline change per Pull.
    #[arg(long, default_value = "30s")]
    ack_deadline: String,
    /// Exactly-once delivery on the request subscription.
    #[arg(long)]
    exactly_once: bool,
}

fn duration_in(flag: &str, text: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(text).map_err(|e| format!("--{flag}: {e}"))?;
    if d < min || d > max {
        return Err(format!("--{flag}: {text} is outside {min:?}..={max:?}"));
    }
    Ok(d)
}

fn plan(args: &SetupArgs) -> Result<SetupPlan, String> {
    let ten_minutes = Duration::from_secs(600);
    let min_backoff = duration_in(
        "min-backoff",
        &args.min_backoff,
        Duration::ZERO,
        ten_minutes,
    )?;
    let max_backoff = duration_in("max-backoff", &args.max_backoff, min_backoff, ten_minutes)?;
    let ack = duration_in(
        "ack-deadline",
        &args.ack_deadline,
        Duration::from_secs(10),
        ten_minutes,
    )?;
    Ok(SetupPlan {
        request_topic: args.topic.clone(),
        subscription: args.subscription.clone(),
        dead_letter_topic: args.dead_letter_topic.clone(),
        max_delivery_attempts: args.max_delivery_attempts,
        min_backoff,
        max_backoff,
        ack_deadline_secs: i32::try_from(ack.as_secs()).unwrap_or(600),
        exactly_once: args.exactly_once,
        result_topic: args.result_topic.clone(),
        result_subscription: args.result_subscription.clone(),
    })
}

/// Creates the topics and subscriptions; prints one line per resource.
pub(super) async fn run_setup(args: SetupArgs) -> ExitCode {
    let plan = match plan(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let client = match args.pubsub.client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match setup(&client, &plan).await {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

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
    use super::bench::{Stopwatch, bench_requests, instant_gateway, print_drain_figures};
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
        let requests = bench_requests(start..(start + PUBLISH_CHUNK).min(args.messages), deadline, 1);
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
    let toml = format!(
        r#"
transport = "pubsub"
[gateway]
url = "{gateway}"
[dispatch]
receive_wait = "50ms"
[telemetry]
listen = "127.0.0.1:0"
log_level = "warn"
[pubsub]
project_id = "{project}"
result_topic_id = "{results}"
{emulator}{credentials}
[[queue]]
subscriber_id = "{sub}"
max_sys = {max_sys}
gate_type = "constant"
"#,
        project = args.pubsub.pubsub_project.clone().unwrap_or_default(),
        results = plan.result_topic,
        sub = plan.subscription,
        max_sys = args.max_sys,
    );
    let config = crate::config::Config::from_toml_str(&toml, &Default::default())
        .map_err(|e| e.to_string())?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let bar = bar(Some(args.messages as u64), "results");
    let stopwatch = Stopwatch::start();
    let running = crate::app::start(
        &config,
        crate::app::RunOptions::default(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut seen = HashSet::new();
    while seen.len() < args.messages {
        let page = (queue.results(Cursor::default(), crate::queue::pubsub::MAX_PULL).await)
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        setup: SetupArgs,
    }

    #[test]
    fn setup_makes_broker_dead_lettering_a_last_resort_by_default() {
        let cli = Cli::try_parse_from(["setup", "--topic", "t", "--subscription", "s"])
            .err()
            .map(|e| e.to_string());
        assert!(cli.is_some_and(|e| e.contains("--result-topic")));
        let cli = Cli::try_parse_from([
            "setup",
            "--topic",
            "t",
            "--subscription",
            "s",
            "--result-topic",
            "r",
            "--dead-letter-topic",
            "d",
        ])
        .expect("parses");
        let plan = plan(&cli.setup).expect("a plan");
        assert_eq!(plan.max_delivery_attempts, 100);
        assert_eq!(plan.max_delivery_attempts, DEFAULT_MAX_DELIVERY_ATTEMPTS);
        assert!(
            Cli::try_parse_from([
                "setup",
                "--topic",
                "t",
                "--subscription",
                "s",
                "--result-topic",
                "r",
                "--max-delivery-attempts",
                "101",
            ])
            .is_err(),
            "Pub/Sub allows at most 100"
        );
    }
}
