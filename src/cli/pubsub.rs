//! The Pub/Sub side of the producer tools: `submit --pubsub-topic`,
//! `results --pubsub-subscription`, and `sluicegate pubsub setup`.

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::results::{Format, Sink, openai_line};
use crate::batch::input::ParsedInput;
use crate::config::{PubSubConfig, parse_duration};
use crate::queue::pubsub::{
    DEFAULT_MAX_DELIVERY_ATTEMPTS, SetupPlan, connect, publish_confirmed, pubsub_message, setup,
};
use crate::result::ResultRecord;

/// Messages per publish batch (Pub/Sub allows 1000 per request).
const PUBLISH_CHUNK: usize = 1000;
/// Messages per Pull of the results reader.
const PULL: i32 = 1000;

/// Which project and credentials (shared by the Pub/Sub tools).
#[derive(Debug, Args)]
pub(super) struct PubSubArgs {
    /// GCP project (the config's `pubsub.project_id`).
    #[arg(long, env = "SLUICEGATE_PUBSUB_PROJECT_ID")]
    pubsub_project: Option<String>,
    /// Emulator `host:port` (anonymous); `PUBSUB_EMULATOR_HOST` works too.
    #[arg(long, env = "SLUICEGATE_PUBSUB_EMULATOR_HOST")]
    pubsub_emulator_host: Option<String>,
    /// Service-account key file; default: application default credentials.
    #[arg(long, env = "SLUICEGATE_PUBSUB_CREDENTIALS_FILE")]
    pubsub_credentials_file: Option<std::path::PathBuf>,
}

impl PubSubArgs {
    async fn client(&self) -> Result<gcloud_pubsub::client::Client, String> {
        let project_id = self
            .pubsub_project
            .clone()
            .ok_or("--pubsub-project (or SLUICEGATE_PUBSUB_PROJECT_ID) is required")?;
        let config = PubSubConfig {
            project_id,
            result_topic_id: None,
            emulator_host: self.pubsub_emulator_host.clone(),
            credentials_file: self.pubsub_credentials_file.clone(),
            ..PubSubConfig::default()
        };
        connect(&config).await.map_err(|e| e.to_string())
    }
}

fn bar(len: Option<u64>, what: &str) -> ProgressBar {
    let bar = len.map_or_else(ProgressBar::new_spinner, ProgressBar::new);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{bar:40}} {{pos}}/{{len}} {what} {{per_sec}} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// Publishes the valid lines of `parsed` to `topic`, each as the plain
/// request JSON (upstream's Pub/Sub format: messages carry the bare request),
/// every publish confirmed before the count moves.
pub(super) async fn submit(args: &PubSubArgs, topic: &str, parsed: &ParsedInput) -> ExitCode {
    let client = match args.client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let publisher = client.topic(topic).new_publisher(None);
    let bar = bar(Some(parsed.valid.len() as u64), "lines");
    let started = Instant::now();
    let mut submitted = 0usize;
    for chunk in parsed.valid.chunks(PUBLISH_CHUNK) {
        let messages = chunk
            .iter()
            .map(|l| pubsub_message(l.body.to_vec(), HashMap::new()))
            .collect();
        for (line, outcome) in chunk
            .iter()
            .zip(publish_confirmed(&publisher, messages).await)
        {
            if let Err(status) = outcome {
                bar.abandon();
                eprintln!(
                    "pubsub: {status}; {submitted} lines submitted before the failure (line {} onwards not confirmed)",
                    line.line
                );
                return ExitCode::FAILURE;
            }
            submitted += 1;
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "submitted {submitted} requests to topic `{topic}` in {secs:.2}s ({:.0}/s); {} bad lines",
        submitted as f64 / secs,
        parsed.invalid.len()
    );
    if parsed.invalid.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What `results --pubsub-subscription` reads.
pub(super) struct ResultsRead<'a> {
    pub(super) subscription: &'a str,
    pub(super) expect: Option<u64>,
    pub(super) timeout: Option<Duration>,
    pub(super) format: Format,
}

/// Pulls results from a subscription on the result topic into `out`,
/// writing and flushing each batch before acknowledging it (a crash
/// re-reads, never loses). A result whose `(id, request_token)` this run
/// already wrote is skipped: the raw topic can repeat one after a
/// dispatcher died between publishing and acknowledging
/// (`docs/transports.md`).
pub(super) async fn results(args: &PubSubArgs, read: ResultsRead<'_>, mut out: Sink) -> ExitCode {
    let client = match args.client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let sub = client.subscription(read.subscription);
    let bar = bar(read.expect, "results");
    let started = Instant::now();
    let mut seen: HashSet<(String, Option<String>)> = HashSet::new();
    let (mut got, mut errors, mut unparsable, mut duplicates) = (0u64, 0u64, 0u64, 0u64);
    loop {
        if read.expect.is_some_and(|n| got >= n)
            || read.timeout.is_some_and(|t| started.elapsed() >= t)
        {
            break;
        }
        let pulled = match sub.pull(PULL, None).await {
            Ok(p) => p,
            Err(status) => {
                bar.suspend(|| eprintln!("pubsub: {status}; retrying"));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        if pulled.is_empty() {
            if read.expect.is_none() {
                break;
            }
            continue;
        }
        let mut ack_ids = Vec::with_capacity(pulled.len());
        for m in pulled {
            ack_ids.push(m.ack_id.clone());
            let text = String::from_utf8_lossy(&m.message.data).into_owned();
            let line = match serde_json::from_str::<ResultRecord>(&text) {
                Ok(record) => {
                    if !seen.insert((record.id.clone(), record.request_token.clone())) {
                        duplicates += 1;
                        continue;
                    }
                    if record.status_code.is_none_or(|s| !(200..300).contains(&s)) {
                        errors += 1;
                    }
                    match read.format {
                        Format::Native => text,
                        Format::Openai => openai_line(&record, got + 1).to_string(),
                    }
                }
                Err(_) => {
                    unparsable += 1;
                    text
                }
            };
            got += 1;
            if let Err(e) = out.line(&line) {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
            bar.inc(1);
        }
        if let Err(e) = out.flush() {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        if let Err(status) = sub.ack(ack_ids).await {
            bar.suspend(|| eprintln!("pubsub ack: {status}; these results may be read again"));
        }
    }
    bar.finish_and_clear();
    out.summary(&format!(
        "collected {got} results from subscription `{}` into {} ({errors} not 2xx, {unparsable} unparsable, {duplicates} repeated results skipped) in {:.1}s",
        read.subscription,
        out.name(),
        started.elapsed().as_secs_f64()
    ));
    match read.expect {
        Some(n) if got < n => {
            eprintln!("expected {n} results, got {got}");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
}

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
    use super::bench::{Stopwatch, instant_gateway, print_drain_figures};
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
    let deadline = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3600;
    let fill = Instant::now();
    let publisher = client.topic(&plan.request_topic).new_publisher(None);
    for start in (0..args.messages).step_by(PUBLISH_CHUNK) {
        let messages = (start..(start + PUBLISH_CHUNK).min(args.messages))
            .map(|i| {
                let line = format!(
                    r#"{{"id":"bench-{i}","deadline":{deadline},"payload":{{"model":"m","prompt":"hello","max_tokens":1}}}}"#
                );
                pubsub_message(line.into_bytes(), HashMap::new())
            })
            .collect();
        for outcome in publish_confirmed(&publisher, messages).await {
            outcome.map_err(|e| format!("publish: {e}"))?;
        }
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
    let reader = client.subscription(plan.result_subscription.as_deref().unwrap_or_default());
    let mut seen = HashSet::new();
    while seen.len() < args.messages {
        let pulled = reader
            .pull(PULL, None)
            .await
            .map_err(|e| format!("pull results: {e}"))?;
        let ids: Vec<String> = pulled.iter().map(|m| m.ack_id.clone()).collect();
        for m in pulled {
            if let Some(id) = m.message.attributes.get("id") {
                seen.insert(id.clone());
            }
        }
        if !ids.is_empty() {
            reader
                .ack(ids)
                .await
                .map_err(|e| format!("ack results: {e}"))?;
        }
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
