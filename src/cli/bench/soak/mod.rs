//! `sluicegate bench soak`: a chaos soak (issue 36, part 6). Real servers
//! throughout, each started and stopped by this bench: its own
//! `redis-server` (AOF on, fsync always) for the shared window, the queue
//! on `--transport` (that Redis, its own PostgreSQL, or the Pub/Sub
//! emulator; `store.rs`), the simulator as the pool with a real
//! Prometheus scraping it for the gate (`--gate prometheus`, the default;
//! `endpoint-scrape` reads the simulator directly), `sluicegate run`
//! replicas sharing the window, and a fault gateway in front of the pool
//! (`faults.rs`). Faults follow a seeded schedule until most of the work
//! is answered: replicas SIGKILLed and restarted, replicas SIGSTOPped
//! past their shared-window lease and resumed, 429 / 503 /
//! connection-reset storms at the gateway, and the store's server
//! SIGKILLed and restarted. Then it prints an account (`tally.rs`): every
//! id answered exactly once (results counted against submissions), the
//! most in flight at the pool against the window, attempts/s at the
//! gateway during each storm, and the time from the last fault to the
//! last result. It fails (exit 1) when an id is lost, answered twice
//! (on Pub/Sub: see [`Verdict`]), or the window was exceeded.
//! `scripts/soak.sh` runs the long version; figures in
//! docs/operations.md.

mod faults;
mod store;
mod tally;

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use tokio::sync::watch;

use super::measure::{ReplicaGate, metric_sum, metrics_page, pool_in_flight};
use crate::servers::{Prometheus, PrometheusSpec, RedisServer};
use crate::sim::{SimConfig, SimHandle, spawn_http};
use faults::{FaultGateway, Faults, Mode, shuffled};
use store::{QUEUE, RESULTS, Store, Transport};
use tally::{Account, Tally};

#[derive(Debug, Args)]
pub(crate) struct SoakArgs {
    /// Where the messages wait: `redis`, `sql` (PostgreSQL) or `pubsub`
    /// (the emulator). The shared window is on Redis for all three.
    #[arg(long, value_enum, default_value_t = Transport::Redis)]
    transport: Transport,
    /// The replicas' gate: `prometheus` (`prometheus-budget` through a
    /// real Prometheus scraping the simulator every second) or
    /// `endpoint-scrape` (the simulator's page read directly).
    #[arg(long, value_enum, default_value_t = GateKind::Prometheus)]
    gate: GateKind,
    /// Messages enqueued before the replicas start.
    #[arg(long, default_value_t = 200_000)]
    messages: usize,
    /// `sluicegate run` replicas sharing the window.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Seed of the fault schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean time between faults, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    fault_every_ms: u64,
    /// Faults stop once this fraction of the messages is answered.
    #[arg(long, default_value_t = 0.8)]
    faults_until: f64,
    /// Replica and gateway faults stop after this many, if sooner (the
    /// server restarts still come at their share of the results).
    #[arg(long)]
    max_faults: Option<u64>,
    /// The store's server SIGKILLed and restarted this many times, evenly
    /// spread over the faulty part of the run (Redis; PostgreSQL for
    /// `sql`; for `pubsub` the shared window's Redis, since the emulator
    /// keeps nothing over a restart).
    #[arg(long, alias = "redis-restarts", default_value_t = 2)]
    server_restarts: usize,
    /// `max_tokens` of each request (the simulator takes ~10 ms a token at
    /// time scale 1).
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Running requests the gate counts as full (`max_count_per_pod`,
    /// `max_concurrency`).
    #[arg(long, default_value_t = 24.0)]
    max_count: f64,
    /// Baseline B: the window is `max_count × (1 − B)`.
    #[arg(long, default_value_t = 0.25)]
    baseline: f64,
    /// The redis-server binary.
    #[arg(long, default_value = "redis-server")]
    redis_server: PathBuf,
    /// Give up when no result arrives for this many seconds.
    #[arg(long, default_value_t = 120)]
    stall_secs: u64,
}

/// `--gate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum GateKind {
    Prometheus,
    EndpointScrape,
}

/// The shared-window lease of the replicas: a pause of a few seconds
/// outlasts it.
const LEASE: Duration = Duration::from_secs(3);
/// The replicas' attempt timeout: how long a dead replica's units stay
/// held (docs/scale-out.md), short so that kills every few seconds do
/// not shrink the window for long.
const ATTEMPT_TIMEOUT: &str = "10s";
/// Replica kill, replica pause, 429 storm, 503 storm, reset storm.
const FAULT_KINDS: u8 = 5;
/// The simulator's pool name (its `inference_pool` label).
const POOL: &str = "p";
/// The simulator's replicas (ready endpoints): `prometheus-budget` counts
/// its capacity per ready endpoint, so each gets `max_count / SIM_PODS`
/// and the window is the same as `endpoint-scrape`'s, which counts the
/// whole pool as one.
const SIM_PODS: usize = 2;

pub(super) async fn soak(args: SoakArgs) -> Result<(), String> {
    let mut redis = RedisServer::start(&args.redis_server)?;
    let mut store = Store::start(args.transport, &redis).await?;
    let mut cfg = SimConfig {
        pool_name: POOL.into(),
        replicas: SIM_PODS,
        ..SimConfig::default()
    };
    // Every request runs at once: what runs there is what was sent.
    cfg.engine.max_num_seqs = 1024;
    let sim = spawn_http(cfg).await.map_err(|e| e.to_string())?;
    let (gate, prometheus) = gate(&args, &sim).await?;
    let gateway = FaultGateway::start(sim.base_url()).await?;
    let window = (args.max_count * (1.0 - args.baseline)).floor() as u64;
    store.enqueue(args.messages, args.max_tokens).await?;
    println!(
        "soak: {} messages on {}, {} replicas with the shared window on Redis (lease {LEASE:?}, attempt timeout {ATTEMPT_TIMEOUT}), gate {}, window {window}, seed {}",
        args.messages,
        store.label(),
        args.replicas,
        gate_label(args.gate),
        args.seed
    );

    let started = Instant::now();
    let (redis_url, gateway_url) = (redis.url(), gateway.url());
    let spawn = |store: &Store| Replica::spawn(&args, &redis_url, &gateway_url, &gate, store);
    let mut replicas: Vec<Replica> = (0..args.replicas)
        .map(|_| spawn(&store))
        .collect::<Result<_, _>>()?;
    let sampler = PoolSampler::start(&sim);
    let load = LoadSampler::start();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
    let mut faults = Faults::default();
    let mut progress = Progress::new(args.messages);
    let faulty = (args.messages as f64 * args.faults_until) as u64;
    let restart_at: Vec<u64> = (1..=args.server_restarts)
        .map(|k| faulty * k as u64 / (args.server_restarts as u64 + 1))
        .collect();
    let mut restarts_done = 0;
    // Replicas that exited on their own (a `sql` replica started while
    // PostgreSQL restarts stops at startup, docs/transports.md), started
    // again as a supervisor would.
    let mut exited = 0u64;
    // Every kind of fault once in each round of five, in a seeded order.
    let mut deck: Vec<u8> = Vec::new();
    // Faults while the faulty part lasts, one at a time.
    loop {
        let done = progress.look(&mut store).await;
        progress.check_stall(args.stall_secs)?;
        exited += restart_exited(&mut replicas, || spawn(&store))?;
        let random_left = args.max_faults.is_none_or(|m| faults.random() < m);
        let restarts_left = restarts_done < restart_at.len();
        // A restart whose share a long fault overtook comes at once: every
        // run restarts its server as often as it was asked to, unless the
        // work is all done.
        if restarts_left
            && (done >= restart_at[restarts_done] || done >= faulty)
            && done < args.messages as u64
        {
            store.restart(&mut redis).await?;
            faults.server_restarts += 1;
            restarts_done += 1;
        } else if done >= faulty {
            break;
        } else if !random_left {
            if !restarts_left {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        } else {
            let pause = args.fault_every_ms as f64 * rng.random_range(0.5..1.5);
            tokio::time::sleep(Duration::from_millis(pause as u64)).await;
            if deck.is_empty() {
                deck = shuffled(&mut rng, FAULT_KINDS);
            }
            let fault = deck.pop().unwrap_or(0);
            let i = rng.random_range(0..replicas.len());
            match fault {
                0 => {
                    replicas[i].kill();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    replicas[i] = spawn(&store)?;
                    faults.kills += 1;
                }
                1 => {
                    replicas[i].signal("STOP")?;
                    tokio::time::sleep(LEASE + Duration::from_secs(2)).await;
                    replicas[i].signal("CONT")?;
                    faults.stops += 1;
                }
                kind => {
                    let mode = match kind {
                        2 => Mode::TooMany,
                        3 => Mode::Unavailable,
                        _ => Mode::Reset,
                    };
                    let secs = rng.random_range(2.0..5.0);
                    let storm = gateway.storm(mode, Duration::from_secs_f64(secs)).await;
                    faults.storms.push(storm);
                }
            }
        }
        faults.last_at = Some(Instant::now());
    }
    // The rest drains without faults.
    loop {
        if progress.look(&mut store).await >= args.messages as u64 {
            break;
        }
        progress.check_stall(args.stall_secs)?;
        exited += restart_exited(&mut replicas, || spawn(&store))?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last_result = Instant::now();
    // Stragglers (a second answer of an id) would come within a lease.
    tokio::time::sleep(LEASE).await;
    progress.look(&mut store).await;
    let max_in_flight = sampler.stop().await;
    let load = load.stop().await;
    drop(replicas);
    let account = progress.tally.account();
    let finished_at_pool = requests_finished(&sim).await?;
    let elapsed = started.elapsed();
    drop(prometheus);
    drop(store);
    drop(redis);

    println!(
        "faults: {} replica kills, {} replica pauses past the lease, {} gateway storms, {} {} restarts",
        faults.kills,
        faults.stops,
        faults.storms.len(),
        faults.server_restarts,
        restarted_label(args.transport),
    );
    println!("replicas that exited on their own and were started again: {exited}");
    println!("| storm | seconds | attempts at the gateway | attempts/s |");
    println!("|---|---|---|---|");
    for s in &faults.storms {
        println!(
            "| {} | {:.1} | {} | {:.1} |",
            s.mode.label(),
            s.lasted.as_secs_f64(),
            s.attempts,
            s.attempts as f64 / s.lasted.as_secs_f64()
        );
    }
    println!(
        "results: {} for {} messages: {} ids answered, {} lost, {} answered more than once ({} extra results)",
        account.results,
        args.messages,
        account.answered,
        account.lost,
        account.twice,
        account.extra
    );
    println!(
        "pool: at most {max_in_flight} in flight (window {window}); {finished_at_pool} requests finished at the simulator for {} messages",
        args.messages
    );
    let recovery = faults.last_at.map_or(0.0, |t| {
        last_result.saturating_duration_since(t).as_secs_f64()
    });
    println!(
        "time from the last fault to the last result: {recovery:.1} s; whole run {:.1} s",
        elapsed.as_secs_f64()
    );
    println!(
        "load average (1 min) during the run: min {:.2}, mean {:.2}, max {:.2} ({} cores)",
        load.min,
        load.mean,
        load.max,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    match Verdict::of(args.transport, &account, max_in_flight, window) {
        Verdict::Pass => Ok(()),
        Verdict::PassRepeated => {
            println!(
                "pubsub: {} result messages repeated a submission already answered (the same request redelivered after its result was published: readers dedupe by id and request_token, docs/transports.md)",
                account.extra
            );
            Ok(())
        }
        Verdict::Fail(why) => Err(why),
    }
}

/// Whether a run kept its guarantees.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    /// Pub/Sub only: every id answered, some result messages repeated.
    /// Pub/Sub delivers at least once: a replica killed between
    /// publishing a result and acking its request leaves the request to
    /// be delivered again, and its second result is a copy of the first
    /// submission's answer (the bench's requests carry no token, so a
    /// repeat can only be of the one submission of its id).
    PassRepeated,
    Fail(String),
}

impl Verdict {
    fn of(transport: Transport, account: &Account, max_in_flight: u64, window: u64) -> Self {
        if account.lost > 0 {
            return Self::Fail(format!("{} ids lost", account.lost));
        }
        if max_in_flight > window {
            return Self::Fail(format!(
                "the window was exceeded: {max_in_flight} in flight for a window of {window}"
            ));
        }
        match (account.extra, transport) {
            (0, _) => Self::Pass,
            (_, Transport::Pubsub) => Self::PassRepeated,
            (extra, _) => Self::Fail(format!(
                "{} ids answered more than once ({extra} extra results)",
                account.twice
            )),
        }
    }
}

fn gate_label(gate: GateKind) -> &'static str {
    match gate {
        GateKind::Prometheus => "prometheus-budget through a real Prometheus (scrape every 1 s)",
        GateKind::EndpointScrape => "endpoint-scrape of the simulator",
    }
}

fn restarted_label(transport: Transport) -> &'static str {
    match transport {
        Transport::Redis => "Redis",
        Transport::Sql => "PostgreSQL",
        Transport::Pubsub => "shared-window Redis",
    }
}

/// The replicas' gate, and the Prometheus it reads (stopped on drop).
async fn gate(
    args: &SoakArgs,
    sim: &SimHandle,
) -> Result<(ReplicaGate, Option<Prometheus>), String> {
    if args.gate == GateKind::EndpointScrape {
        let url = format!("{}/metrics", sim.base_url());
        let gate = ReplicaGate::endpoint_scrape(url, args.max_count, args.baseline);
        return Ok((gate, None));
    }
    // The simulator exports a flow-control queue (0: it has no flow
    // control) and per-endpoint queues, which come first in the gate's
    // cascade and count waiting requests only; dropped, the gate reads the
    // running requests, as the endpoint-scrape gate does.
    let spec = PrometheusSpec {
        targets: vec![sim.addr().to_string()],
        drop_metrics: vec![
            ".*flow_control.*".into(),
            "llm_d_epp_per_endpoint_queue_size".into(),
            "inference_pool_per_pod_queue_size".into(),
        ],
    };
    let prometheus = Prometheus::start(&spec, Duration::from_secs(1), &[], &[]).await?;
    prometheus
        .wait_for_sample("vllm:num_requests_running", Duration::from_secs(30))
        .await?;
    let per_pod = args.max_count / SIM_PODS as f64;
    let gate = ReplicaGate::prometheus_budget(prometheus.url(), POOL, per_pod, args.baseline);
    Ok((gate, Some(prometheus)))
}

/// One `sluicegate run` replica, killed (by PID) on drop.
struct Replica(Child);

impl Replica {
    fn spawn(
        args: &SoakArgs,
        redis: &str,
        gateway: &str,
        gate: &ReplicaGate,
        store: &Store,
    ) -> Result<Self, String> {
        let mut cmd = super::measure::replica_command(&super::measure::ReplicaSpec {
            redis_url: redis,
            queue: QUEUE,
            results: RESULTS,
            gateway,
            gate: gate.clone(),
            max_count: args.max_count,
            shared_window: "redis",
            lease: format!("{}s", LEASE.as_secs()),
        })?;
        cmd.env("SLUICEGATE_GATEWAY_ATTEMPT_TIMEOUT", ATTEMPT_TIMEOUT)
            .env("SLUICEGATE_LOG_LEVEL", "error")
            .env("SLUICEGATE_DISPATCH_CONGESTION_MAX_BACKOFF", "4s");
        store.configure(&mut cmd);
        cmd.spawn()
            .map(Self)
            .map_err(|e| format!("spawn a replica: {e}"))
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Sends `SIG<name>` (STOP, CONT) by PID.
    fn signal(&self, name: &str) -> Result<(), String> {
        crate::servers::signal(name, &self.0.id().to_string())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // A stopped process ignores nothing but SIGKILL; resume it anyway
        // so it is reaped at once.
        let _ = self.signal("CONT");
        self.kill();
    }
}

/// Starts again (with `spawn`) every replica that has exited; how many.
fn restart_exited(
    replicas: &mut [Replica],
    mut spawn: impl FnMut() -> Result<Replica, String>,
) -> Result<u64, String> {
    let mut n = 0;
    for replica in replicas.iter_mut() {
        if matches!(replica.0.try_wait(), Ok(Some(_))) {
            *replica = spawn()?;
            n += 1;
        }
    }
    Ok(n)
}

/// Samples the requests running or waiting at the simulator every 20 ms.
struct PoolSampler {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<u64>,
}

impl PoolSampler {
    fn start(sim: &SimHandle) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let url = format!("{}/metrics", sim.base_url());
        let task = tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut max = 0u64;
            loop {
                if let Ok(n) = pool_in_flight(&http, &url).await {
                    max = max.max(n as u64);
                }
                tokio::select! {
                    _ = stopped.changed() => return max,
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> u64 {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or(u64::MAX)
    }
}

/// The machine's 1-minute load average, sampled every 10 s: what else ran
/// beside the soak (the figures are from a shared machine).
struct LoadSampler {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<f64>>,
}

/// Minimum, mean and maximum of the samples.
struct Load {
    min: f64,
    mean: f64,
    max: f64,
}

impl LoadSampler {
    fn start() -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            loop {
                if let Some(load) = load_average() {
                    samples.push(load);
                }
                tokio::select! {
                    _ = stopped.changed() => return samples,
                    () = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
            }
        });
        Self { stop, task }
    }

    async fn stop(self) -> Load {
        let _ = self.stop.send(true);
        let samples = self.task.await.unwrap_or_default();
        if samples.is_empty() {
            return Load {
                min: 0.0,
                mean: 0.0,
                max: 0.0,
            };
        }
        Load {
            min: samples.iter().copied().fold(f64::INFINITY, f64::min),
            mean: samples.iter().sum::<f64>() / samples.len() as f64,
            max: samples.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// The first field of /proc/loadavg.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Requests the simulator finished (`vllm:request_success_total`).
async fn requests_finished(sim: &SimHandle) -> Result<u64, String> {
    let page = metrics_page(
        &reqwest::Client::new(),
        &format!("{}/metrics", sim.base_url()),
    )
    .await?;
    Ok(metric_sum(&page, &["vllm:request_success_total{"]) as u64)
}

/// Results so far, and when the ids answered last grew.
struct Progress {
    tally: Tally,
    grew_at: Instant,
}

impl Progress {
    fn new(messages: usize) -> Self {
        Self {
            tally: Tally::new(messages),
            grew_at: Instant::now(),
        }
    }

    /// Reads new results; the ids answered so far.
    async fn look(&mut self, store: &mut Store) -> u64 {
        let before = self.tally.answered();
        store.read_new(&mut self.tally).await;
        if self.tally.answered() > before {
            self.grew_at = Instant::now();
        }
        self.tally.answered()
    }

    fn check_stall(&self, stall_secs: u64) -> Result<(), String> {
        if self.grew_at.elapsed() > Duration::from_secs(stall_secs) {
            return Err(format!(
                "no result for {stall_secs} s at {} ids answered; not answered: {:?}",
                self.tally.answered(),
                self.tally.missing(10)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(lost: u64, twice: u64, extra: u64) -> Account {
        Account {
            results: 10 - lost + extra,
            answered: 10 - lost,
            lost,
            twice,
            extra,
        }
    }

    #[test]
    fn a_lost_id_or_an_exceeded_window_fails_every_transport_and_a_repeat_fails_all_but_pubsub() {
        for t in [Transport::Redis, Transport::Sql, Transport::Pubsub] {
            assert_eq!(Verdict::of(t, &account(0, 0, 0), 18, 18), Verdict::Pass);
            assert!(matches!(
                Verdict::of(t, &account(1, 0, 0), 18, 18),
                Verdict::Fail(_)
            ));
            assert!(matches!(
                Verdict::of(t, &account(0, 0, 0), 19, 18),
                Verdict::Fail(_)
            ));
        }
        for t in [Transport::Redis, Transport::Sql] {
            assert!(matches!(
                Verdict::of(t, &account(0, 1, 1), 18, 18),
                Verdict::Fail(_)
            ));
        }
        assert_eq!(
            Verdict::of(Transport::Pubsub, &account(0, 1, 1), 18, 18),
            Verdict::PassRepeated
        );
    }
}
