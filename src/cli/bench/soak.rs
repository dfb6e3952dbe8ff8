//! `sluicegate bench soak`: a chaos soak on Redis (issue 36, part 6).
//! Real servers throughout: its own `redis-server` (AOF on, fsync always),
//! the simulator as the pool, `sluicegate run` replicas sharing the window,
//! and a fault gateway in front of the pool. Faults follow a seeded
//! schedule until most of the work is answered: replicas SIGKILLed and
//! restarted, replicas SIGSTOPped past their shared-window lease and
//! resumed, 429 / 503 / connection-reset storms at the gateway, and Redis
//! itself SIGKILLed and restarted. Then it prints an account: every id
//! answered exactly once (results counted against submissions), the most
//! in flight at the pool against the window, attempts/s at the gateway
//! during each storm, and the time from the last fault to the last result.
//! It fails (exit 1) when an id is lost or answered twice, or the window
//! was exceeded. `scripts/soak.sh` runs the long version; figures in
//! docs/operations.md.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::measure::{bench_requests, metric_sum, metrics_page, pool_in_flight};
use crate::queue::Client;
use crate::queue::redis::RedisClient;
use crate::redis::{RedisConfig, RedisConnection, RedisMode, connection};
use crate::secret::EndpointUrl;
use crate::sim::{SimConfig, SimHandle, spawn_http};

#[derive(Debug, Args)]
pub(crate) struct SoakArgs {
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
    /// Redis restarts still come at their share of the results).
    #[arg(long)]
    max_faults: Option<u64>,
    /// Redis SIGKILLed and restarted this many times, evenly spread over
    /// the faulty part of the run.
    #[arg(long, default_value_t = 2)]
    redis_restarts: usize,
    /// `max_tokens` of each request (the simulator takes ~10 ms a token at
    /// time scale 1).
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Running requests the gate counts as full (`max_count_per_pod`).
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

/// The shared-window lease of the replicas: a pause of a few seconds
/// outlasts it.
const LEASE: Duration = Duration::from_secs(3);
/// The replicas' attempt timeout: how long a dead replica's units stay
/// held (docs/scale-out.md), short so that kills every few seconds do
/// not shrink the window for long.
const ATTEMPT_TIMEOUT: &str = "10s";
const QUEUE: &str = "soak";
/// Replica kill, replica pause, 429 storm, 503 storm, reset storm.
const FAULT_KINDS: u8 = 5;
const RESULTS: &str = "soak-results";

pub(super) async fn soak(args: SoakArgs) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("sluicegate-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut redis = RedisServer::start(&args.redis_server, &dir)?;
    let conn = connection(&redis.config()).map_err(|e| e.to_string())?;
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        ..SimConfig::default()
    };
    // Every request runs at once: what runs there is what was sent.
    cfg.engine.max_num_seqs = 1024;
    let sim = spawn_http(cfg).await.map_err(|e| e.to_string())?;
    let gateway = FaultGateway::start(sim.base_url()).await?;
    let window = (args.max_count * (1.0 - args.baseline)).floor() as u64;

    let deadline = crate::clock::unix_secs() + 24 * 3600;
    let client = RedisClient::new(conn.clone(), QUEUE.to_owned(), None, None);
    for start in (0..args.messages).step_by(10_000) {
        let end = (start + 10_000).min(args.messages);
        (client
            .enqueue(bench_requests(start..end, deadline, args.max_tokens), None)
            .await)
            .map_err(|e| format!("enqueue: {e}"))?;
    }
    println!(
        "soak: {} messages on Redis, {} replicas with the shared window (lease {LEASE:?}, attempt timeout {ATTEMPT_TIMEOUT}), window {window}, seed {}",
        args.messages, args.replicas, args.seed
    );

    let started = Instant::now();
    let mut replicas: Vec<Replica> = (0..args.replicas)
        .map(|_| Replica::spawn(&args, &redis.url(), &gateway.url(), &sim))
        .collect::<Result<_, _>>()?;
    let sampler = PoolSampler::start(&sim);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
    let mut faults = Faults::default();
    let mut progress = Progress::new(conn.clone());
    let faulty = (args.messages as f64 * args.faults_until) as u64;
    let restart_at: Vec<u64> = (1..=args.redis_restarts)
        .map(|k| faulty * k as u64 / (args.redis_restarts as u64 + 1))
        .collect();
    let mut restarts_done = 0;
    // Every kind of fault once in each round of five, in a seeded order.
    let mut deck: Vec<u8> = Vec::new();
    // Faults while the faulty part lasts, one at a time.
    loop {
        let done = progress.look().await;
        if done >= faulty {
            break;
        }
        progress.check_stall(args.stall_secs)?;
        let random_left = args.max_faults.is_none_or(|m| faults.random() < m);
        if restarts_done < restart_at.len() && done >= restart_at[restarts_done] {
            redis.restart(&args.redis_server, &dir).await?;
            faults.redis_restarts += 1;
            restarts_done += 1;
        } else if !random_left {
            if restarts_done == restart_at.len() {
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
                    replicas[i] = Replica::spawn(&args, &redis.url(), &gateway.url(), &sim)?;
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
        if progress.look().await >= args.messages as u64 {
            break;
        }
        progress.check_stall(args.stall_secs)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last_result = Instant::now();
    // Stragglers (a second answer of an id) would come within a lease.
    tokio::time::sleep(LEASE).await;
    let max_in_flight = sampler.stop().await;
    drop(replicas);
    let account = Account::read(&conn, args.messages).await?;
    let finished_at_pool = requests_finished(&sim).await?;
    let elapsed = started.elapsed();
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "faults: {} replica kills, {} replica pauses past the lease, {} gateway storms, {} Redis restarts",
        faults.kills,
        faults.stops,
        faults.storms.len(),
        faults.redis_restarts
    );
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
    if account.lost > 0 || account.twice > 0 || max_in_flight > window {
        return Err("an id was lost or answered twice, or the window was exceeded".into());
    }
    Ok(())
}

/// Our own `redis-server`, with the append-only file fsynced on every
/// write: a SIGKILL loses nothing it acknowledged.
struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    fn start(binary: &Path, dir: &Path) -> Result<Self, String> {
        let port = free_port()?;
        Self::start_on(binary, dir, port)
    }

    fn start_on(binary: &Path, dir: &Path, port: u16) -> Result<Self, String> {
        let server = Self {
            child: Self::spawn(binary, dir, port)?,
            port,
        };
        server.wait_ready()?;
        Ok(server)
    }

    fn spawn(binary: &Path, dir: &Path, port: u16) -> Result<Child, String> {
        Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start {}: {e}", binary.display()))
    }

    fn wait_ready(&self) -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("redis-server on port {} did not start", self.port))
    }

    /// SIGKILL, then the same port and directory again (it replays the
    /// append-only file).
    async fn restart(&mut self, binary: &Path, dir: &Path) -> Result<(), String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.child = Self::spawn(binary, dir, self.port)?;
        self.wait_ready()
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn config(&self) -> RedisConfig {
        RedisConfig {
            url: EndpointUrl::new(url::Url::parse(&self.url()).expect("a redis URL")),
            username: None,
            password: None,
            password_file: None,
            cluster: false,
            mode: RedisMode::Standalone,
            addrs: Vec::new(),
            master_name: None,
            sentinel_username: None,
            sentinel_password: None,
            sentinel_password_file: None,
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `0..n` in a seeded random order (Fisher–Yates).
fn shuffled(rng: &mut Xoshiro256PlusPlus, n: u8) -> Vec<u8> {
    let mut deck: Vec<u8> = (0..n).collect();
    for i in (1..deck.len()).rev() {
        deck.swap(i, rng.random_range(0..=i));
    }
    deck
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// One `sluicegate run` replica, killed (by PID) on drop.
struct Replica(Child);

impl Replica {
    fn spawn(args: &SoakArgs, redis: &str, gateway: &str, sim: &SimHandle) -> Result<Self, String> {
        super::measure::replica_command(&super::measure::ReplicaSpec {
            redis_url: redis,
            queue: QUEUE,
            results: RESULTS,
            gateway,
            metrics_url: format!("{}/metrics", sim.base_url()),
            max_count: args.max_count,
            baseline: args.baseline,
            shared_window: "redis",
            lease: format!("{}s", LEASE.as_secs()),
        })?
        .env("SLUICEGATE_GATEWAY_ATTEMPT_TIMEOUT", ATTEMPT_TIMEOUT)
        .env("SLUICEGATE_LOG_LEVEL", "error")
        .env("SLUICEGATE_DISPATCH_CONGESTION_MAX_BACKOFF", "4s")
        .spawn()
        .map(Self)
        .map_err(|e| format!("spawn a replica: {e}"))
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Sends `SIG<name>` (STOP, CONT) by PID.
    fn signal(&self, name: &str) -> Result<(), String> {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.0.id().to_string())
            .status()
            .map_err(|e| format!("kill -{name}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill -{name} {} failed", self.0.id()))
        }
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

/// What the fault gateway does with a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Forwarded to the pool.
    Pass = 0,
    /// Answered 429 without `Retry-After`.
    TooMany = 1,
    /// Answered 503.
    Unavailable = 2,
    /// Reset (closed with RST) before any answer.
    Reset = 3,
}

impl Mode {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::TooMany,
            2 => Self::Unavailable,
            3 => Self::Reset,
            _ => Self::Pass,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Pass => "none",
            Self::TooMany => "429",
            Self::Unavailable => "503",
            Self::Reset => "reset",
        }
    }
}

/// One storm: how long, and the attempts it met.
struct Storm {
    mode: Mode,
    lasted: Duration,
    attempts: u64,
}

/// A TCP gateway in front of the pool that forwards, or refuses every
/// request of a storm: each connection is decided when it opens, and a
/// storm also cuts the connections it finds open (a gateway restart), so
/// kept-alive connections cannot bypass it.
struct FaultGateway {
    addr: std::net::SocketAddr,
    mode: Arc<AtomicU8>,
    refused: Arc<AtomicU64>,
    cut: watch::Sender<u64>,
}

impl FaultGateway {
    async fn start(pool: String) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let pool_addr = url::Url::parse(&pool)
            .ok()
            .and_then(|u| u.socket_addrs(|| None).ok()?.into_iter().next())
            .ok_or_else(|| format!("pool address {pool}"))?;
        let mode = Arc::new(AtomicU8::new(Mode::Pass as u8));
        let refused = Arc::new(AtomicU64::new(0));
        let (cut, _) = watch::channel(0u64);
        let gateway = Self {
            addr,
            mode: mode.clone(),
            refused: refused.clone(),
            cut: cut.clone(),
        };
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let mode = Mode::from_u8(mode.load(Ordering::SeqCst));
                let refused = refused.clone();
                let mut cut = cut.subscribe();
                tokio::spawn(async move {
                    match mode {
                        Mode::Pass => {
                            let Ok(mut upstream) = TcpStream::connect(pool_addr).await else {
                                return;
                            };
                            let mut conn = conn;
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream) => {}
                                _ = cut.changed() => {}
                            }
                        }
                        Mode::Reset => {
                            refused.fetch_add(1, Ordering::SeqCst);
                            let _ = conn.set_zero_linger();
                        }
                        Mode::TooMany | Mode::Unavailable => {
                            refused.fetch_add(1, Ordering::SeqCst);
                            refuse(conn, mode).await;
                        }
                    }
                });
            }
        });
        Ok(gateway)
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Refuses everything for `lasted` in `mode`, then forwards again.
    async fn storm(&self, mode: Mode, lasted: Duration) -> Storm {
        let before = self.refused.load(Ordering::SeqCst);
        self.mode.store(mode as u8, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
        tokio::time::sleep(lasted).await;
        self.mode.store(Mode::Pass as u8, Ordering::SeqCst);
        Storm {
            mode,
            lasted,
            attempts: self.refused.load(Ordering::SeqCst) - before,
        }
    }
}

/// Reads one request head and answers it `mode`'s status, then closes.
async fn refuse(mut conn: TcpStream, mode: Mode) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut len = 0;
    loop {
        let Ok(n) = conn.read(&mut buf[len..]).await else {
            return;
        };
        if n == 0 {
            return;
        }
        len += n;
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => break,
            Ok(httparse::Status::Partial) if len < buf.len() => {}
            _ => return,
        }
    }
    let status = if mode == Mode::TooMany {
        "429 Too Many Requests"
    } else {
        "503 Service Unavailable"
    };
    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = conn.write_all(answer.as_bytes()).await;
    let _ = conn.shutdown().await;
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

/// Requests the simulator finished (`vllm:request_success_total`).
async fn requests_finished(sim: &SimHandle) -> Result<u64, String> {
    let page = metrics_page(
        &reqwest::Client::new(),
        &format!("{}/metrics", sim.base_url()),
    )
    .await?;
    Ok(metric_sum(&page, &["vllm:request_success_total{"]) as u64)
}

#[derive(Default)]
struct Faults {
    kills: u64,
    stops: u64,
    redis_restarts: u64,
    storms: Vec<Storm>,
    last_at: Option<Instant>,
}

impl Faults {
    /// Replica and gateway faults so far.
    fn random(&self) -> u64 {
        self.kills + self.stops + self.storms.len() as u64
    }
}

/// Results so far, and when they last grew.
struct Progress {
    conn: RedisConnection,
    done: u64,
    grew_at: Instant,
}

impl Progress {
    fn new(conn: RedisConnection) -> Self {
        Self {
            conn,
            done: 0,
            grew_at: Instant::now(),
        }
    }

    /// The length of the result list (the last one seen while Redis is
    /// down).
    async fn look(&mut self) -> u64 {
        let len: Result<u64, _> = redis::cmd("LLEN")
            .arg(RESULTS)
            .query_async(&mut self.conn)
            .await;
        if let Ok(len) = len
            && len > self.done
        {
            self.done = len;
            self.grew_at = Instant::now();
        }
        self.done
    }

    fn check_stall(&self, stall_secs: u64) -> Result<(), String> {
        if self.grew_at.elapsed() > Duration::from_secs(stall_secs) {
            return Err(format!(
                "no result for {stall_secs} s at {} results",
                self.done
            ));
        }
        Ok(())
    }
}

/// Results counted against submissions.
struct Account {
    results: u64,
    answered: u64,
    lost: u64,
    twice: u64,
    extra: u64,
}

impl Account {
    async fn read(conn: &RedisConnection, messages: usize) -> Result<Self, String> {
        let mut conn = conn.clone();
        let mut seen = vec![0u32; messages];
        let mut results = 0u64;
        let mut foreign = 0u64;
        let mut start = 0isize;
        loop {
            let chunk: Vec<String> = redis::cmd("LRANGE")
                .arg(RESULTS)
                .arg(start)
                .arg(start + 9_999)
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("read results: {e}"))?;
            if chunk.is_empty() {
                break;
            }
            start += chunk.len() as isize;
            for text in chunk {
                results += 1;
                let index = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v["id"].as_str()?.strip_prefix("bench-")?.parse().ok())
                    .filter(|i: &usize| *i < messages);
                match index {
                    Some(i) => seen[i] += 1,
                    None => foreign += 1,
                }
            }
        }
        let answered = seen.iter().filter(|n| **n > 0).count() as u64;
        let twice = seen.iter().filter(|n| **n > 1).count() as u64;
        let extra = seen
            .iter()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum::<u64>()
            + foreign;
        Ok(Self {
            results,
            answered,
            lost: messages as u64 - answered,
            twice,
            extra,
        })
    }
}
