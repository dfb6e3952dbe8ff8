//! `sluicegate pubsub setup` (the producer tools reach Pub/Sub through the
//! queue's client like every transport: `submit --pubsub-topic`, `results
//! --pubsub-subscription`; `bench drain-pubsub` is in `bench/pubsub.rs`).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::args::PubSubArgs;
use crate::config::parse_duration;
use crate::queue::pubsub::{DEFAULT_MAX_DELIVERY_ATTEMPTS, SetupPlan, setup};

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
