//! A real `redis-server` on a free 127.0.0.1 port, in its own directory,
//! killed by PID (on drop too). Restartable on the same port and data.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use super::free_port;

use sluicegate::config::{EndpointUrl, RedisConfig, Secret};
use sluicegate::queue::redis::{Submission, enqueue};
use sluicegate::redis::connection;
use sluicegate::request::parse_message;

/// How to run the server.
#[derive(Debug, Clone, Default)]
pub(crate) struct RedisOptions {
    /// `requirepass`.
    pub(crate) password: Option<String>,
    /// Append-only file with `appendfsync always`.
    pub(crate) aof: bool,
    /// Port to use (a free one when absent).
    pub(crate) port: Option<u16>,
    /// TLS only (`rediss://`), with a certificate from a private CA made
    /// with `openssl` (see [`RedisServer::ca_file`]).
    pub(crate) tls: bool,
}

/// A running (or stopped) `redis-server`.
#[derive(Debug)]
pub(crate) struct RedisServer {
    child: Option<Child>,
    /// Its port.
    pub(crate) port: u16,
    dir: PathBuf,
    options: RedisOptions,
}

impl RedisServer {
    /// Waits (up to 30 s) until `list` holds at least `n` entries, then
    /// returns them all, parsed as JSON (result records).
    pub(crate) async fn wait_for_len(&self, list: &str, n: i64) -> Vec<serde_json::Value> {
        self.wait_for_len_within(list, n, Duration::from_secs(30))
            .await
    }

    /// [`Self::wait_for_len`], waiting up to `within`.
    pub(crate) async fn wait_for_len_within(
        &self,
        list: &str,
        n: i64,
        within: Duration,
    ) -> Vec<serde_json::Value> {
        let what = format!("{list} reaching {n} entries");
        super::wait_until(within, &what, || self.int(&["LLEN", list]) >= n).await;
        self.cli(&["LRANGE", list, "0", "-1"])
            .lines()
            .map(|l| serde_json::from_str(l).expect("result is JSON"))
            .collect()
    }

    /// Starts a server without persistence or password.
    pub(crate) fn start() -> Self {
        Self::start_with(RedisOptions::default())
    }

    /// Starts a server with `options` and waits until it answers.
    pub(crate) fn start_with(options: RedisOptions) -> Self {
        let port = options.port.unwrap_or_else(free_port);
        let dir =
            std::env::temp_dir().join(format!("sluicegate-redis-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut server = Self {
            child: None,
            port,
            dir,
            options,
        };
        server.spawn();
        server
    }

    /// A server that is not running yet on a reserved port (for
    /// "Redis down at startup"); call [`Self::restart`] to start it.
    pub(crate) fn not_started() -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("sluicegate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        Self {
            child: None,
            port,
            dir,
            options: RedisOptions::default(),
        }
    }

    /// The private CA's certificate (TLS servers), for `SSL_CERT_FILE`.
    pub(crate) fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn make_certificates(&self) {
        let run = |args: &[&str]| {
            let ok = Command::new("openssl")
                .args(args)
                .current_dir(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("openssl runs")
                .success();
            assert!(ok, "openssl {args:?}");
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=sluicegate-test-ca",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "srv.key",
            "-out",
            "srv.csr",
            "-subj",
            "/CN=127.0.0.1",
        ]);
        std::fs::write(self.dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        if self.options.tls {
            if !self.ca_file().exists() {
                self.make_certificates();
            }
            cmd.args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(self.dir.join("srv.pem"))
                .arg("--tls-key-file")
                .arg(self.dir.join("srv.key"))
                .arg("--tls-ca-cert-file")
                .arg(self.ca_file())
                .args(["--tls-auth-clients", "no"]);
        } else {
            cmd.arg("--port").arg(self.port.to_string());
        }
        cmd.arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.options.aof {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if let Some(p) = &self.options.password {
            cmd.arg("--requirepass").arg(p);
        }
        self.child = Some(
            cmd.spawn()
                .expect("redis-server runs (apt-get install redis-server)"),
        );
        let give_up = Instant::now() + Duration::from_secs(20);
        loop {
            if self.cli(&["PING"]).trim() == "PONG" {
                return;
            }
            assert!(Instant::now() < give_up, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://127.0.0.1:<port>/0` (`rediss://` with TLS; no credentials).
    pub(crate) fn url(&self) -> String {
        let scheme = if self.options.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    /// Runs `redis-cli` against the server; its standard output.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("redis-cli");
        cmd.arg("-p").arg(self.port.to_string());
        if self.options.tls {
            cmd.arg("--tls").arg("--cacert").arg(self.ca_file());
        }
        if let Some(p) = &self.options.password {
            cmd.arg("--no-auth-warning").arg("-a").arg(p);
        }
        let out = cmd.args(args).output().expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// An integer answer of `redis-cli`.
    pub(crate) fn int(&self, args: &[&str]) -> i64 {
        let text = self.cli(args);
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{args:?} answered {text:?}"))
    }

    /// SIGKILLs the server (by PID).
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data directory.
    pub(crate) fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis-transport config for the in-process application with fast
/// timings (100 ms polls and retries): `extra_dispatch` adds `[dispatch]`
/// keys, `queue` is the body of the one `[[queue]]`.
pub(crate) fn fast_app_toml(gateway: &str, extra_dispatch: &str, queue: &str) -> String {
    format!(
        r#"
transport = "redis"
[gateway]
url = "{gateway}"
[dispatch]
poll_interval = "100ms"
receive_wait = "100ms"
retry_initial_backoff = "100ms"
retry_max_backoff = "200ms"
{extra_dispatch}
[telemetry]
listen = "127.0.0.1:0"
[[queue]]
{queue}
"#
    )
}

/// `[redis]` pointing at `server`, with its password.
pub fn redis_config(server: &RedisServer) -> RedisConfig {
    RedisConfig {
        url: EndpointUrl::new(url::Url::parse(&server.url()).expect("url")),
        username: None,
        password: server.options.password.clone().map(Secret::new),
        password_file: None,
        cluster: false,
        ..RedisConfig::default()
    }
}

/// Submits `lines` to `queue` through our producer.
pub async fn submit(server: &RedisServer, queue: &str, lines: &[String]) {
    submit_as(&redis_config(server), queue, lines).await;
}

/// Submits `lines` to `queue` through our producer, each also filed in its
/// tenant's lane (metadata `userid`, the default fairness attribute).
pub async fn submit_in_lanes(server: &RedisServer, queue: &str, lines: &[String]) {
    submit_filed(&redis_config(server), queue, lines, Some("userid")).await;
}

/// Submits `lines` to `queue` through our producer, connecting with
/// `redis` (a config loaded as a deployment's is, say).
pub async fn submit_as(redis: &RedisConfig, queue: &str, lines: &[String]) {
    submit_filed(redis, queue, lines, None).await;
}

async fn submit_filed(redis: &RedisConfig, queue: &str, lines: &[String], attribute: Option<&str>) {
    let mut conn = connection(redis).expect("connection");
    let now_ms = sluicegate::clock::unix_millis();
    let batch: Vec<Submission> = lines
        .iter()
        .map(|l| {
            let message = parse_message(l.as_bytes()).expect("valid");
            let tenant =
                attribute.map(|a| message.request.metadata.get(a).cloned().unwrap_or_default());
            Submission::new(message, queue, now_ms).in_lane(tenant)
        })
        .collect();
    enqueue(&mut conn, queue, &batch).await.expect("enqueued");
}
