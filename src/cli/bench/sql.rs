//! `sluicegate bench drain-sql`: `bench drain` on the `sql` transport: N
//! messages through a real PostgreSQL (`--sql-url`) and a gateway that
//! answers instantly; the same figures (messages/s, CPU seconds per 1 000
//! messages, peak RSS) so `scripts/bench-compare.sh` sets it beside the
//! Redis drain.

use std::time::{Duration, Instant};

use clap::Args;

use super::measure::{
    Stopwatch, bench_requests, drain_config, instant_gateway, peak_until_drained,
    print_drain_figures, start_dispatcher,
};
use crate::config::EndpointUrl;
use crate::queue::Client;
use crate::queue::sql::{SqlClient, SqlQueueClient};

#[derive(Debug, Args)]
pub(crate) struct DrainSqlArgs {
    /// PostgreSQL URL (`postgres://user@host:port/db`); its bench queue's
    /// rows and results are deleted first.
    #[arg(long, env = "SLUICEGATE_SQL_URL")]
    sql_url: String,
    /// Messages to drain.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Queue name (the `queue` column).
    #[arg(long, default_value = "bench-drain-sql")]
    queue: String,
    /// Window (`max_sys` of the constant gate).
    #[arg(long, default_value_t = 512.0)]
    max_sys: f64,
    /// `[sql] batch_size`: rows one claim statement leases (upstream's
    /// default 10 would make the claim the bottleneck of a drain).
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
    /// The dispatcher's `[gateway] fairness_attribute` (tenant lanes);
    /// `""`: none, claims in deadline order as upstream's.
    #[arg(long, default_value = crate::config::DEFAULT_FAIRNESS_ATTRIBUTE)]
    fairness_attribute: String,
    /// Enqueue as our producers do, each row filed in its tenant's lane
    /// by the attribute; without it the rows are written as upstream's
    /// producer writes them (no lane: the claims file every one, the
    /// worst case).
    #[arg(long)]
    filed: bool,
}

pub(super) async fn drain_sql(args: DrainSqlArgs) -> Result<(), String> {
    let url = url::Url::parse(&args.sql_url).map_err(|e| format!("--sql-url: {e}"))?;
    let url = EndpointUrl::new(url);
    let client = SqlClient::open(&url, Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    let route = format!("{}-results", args.queue);
    client
        .purge(&args.queue, &route)
        .await
        .map_err(|e| format!("sql: {e}"))?;
    let (gateway, _gateway_task) = instant_gateway().await.map_err(|e| e.to_string())?;
    let deadline = crate::clock::unix_secs() + 3600;
    let requests = bench_requests(0..args.messages, deadline, 1);
    let fill = Instant::now();
    let attribute = Some(args.fairness_attribute.clone()).filter(|a| !a.is_empty());
    let queue = SqlQueueClient::new(client.clone(), args.queue.clone(), route.clone())
        .in_lanes(attribute.clone().filter(|_| args.filed));
    (queue.enqueue(requests, None).await).map_err(|e| e.to_string())?;
    let fill_secs = fill.elapsed().as_secs_f64();

    let transport = format!(
        r#"transport = "sql"
[sql]
url = "{url}"
poll_interval = "50ms"
batch_size = {batch}
result_queue_name = "{route}""#,
        url = url.expose(),
        batch = args.batch_size,
    );
    let queue_table = format!("queue_name = \"{}\"", args.queue);
    let mut config = drain_config(&transport, &gateway, &queue_table, args.max_sys)?;
    config.gateway.fairness_attribute = attribute.clone();
    let stopwatch = Stopwatch::start();
    let (running, shutdown) = start_dispatcher(&config).await?;
    let peak_in_flight = peak_until_drained(&running, &args.queue, async || {
        // An ack deletes the row and writes its result in one statement:
        // no row left means every result is written. (A count of the
        // results every 10 ms would cost PostgreSQL more than the drain.)
        let left = (client.any_left(&args.queue).await).map_err(|e| format!("sql: {e}"))?;
        Ok(!left)
    })
    .await?;
    let (secs, cpu) = stopwatch.stop();
    shutdown.cancel();
    running.wait().await.map_err(|e| e.to_string())?;
    let written = (client.result_count(&route).await).map_err(|e| format!("sql: {e}"))?;
    if written != args.messages as u64 {
        return Err(format!(
            "{written} results for {} messages (expected one each)",
            args.messages
        ));
    }
    let lanes = match (&attribute, args.filed) {
        (None, _) => "no lanes".to_owned(),
        (Some(a), true) => format!("lanes by `{a}`, filed at insert"),
        (Some(a), false) => format!("lanes by `{a}`, filed by the claims"),
    };
    println!(
        "drain-sql benchmark: {} messages, window {}, batch_size {}, {lanes}",
        args.messages, args.max_sys, args.batch_size
    );
    println!("  enqueue (1000 rows per statement): {fill_secs:.2}s");
    print_drain_figures(args.messages, secs, cpu, "dispatcher + in-process gateway");
    println!("  in flight: at most {peak_in_flight} (sampled every 10 ms)");
    println!("  PostgreSQL's CPU is not counted (another process)");
    Ok(())
}
