//! A `redis-server` with the append-only file fsynced on every write (a
//! SIGKILL loses nothing it acknowledged), on a free 127.0.0.1 port with
//! its files in a scratch directory; killed by PID (on drop too) and
//! restartable on the same port and files. (The tests' own
//! `tests/it/support/redis.rs` adds passwords and TLS.)

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{ScratchDir, free_port};
use crate::redis::{RedisConfig, RedisMode};
use crate::secret::EndpointUrl;

/// A running `redis-server`.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
    binary: PathBuf,
    dir: ScratchDir,
}

impl RedisServer {
    /// Starts `binary` and waits (up to 20 s) until it takes connections.
    pub fn start(binary: &Path) -> Result<Self, String> {
        let port = free_port()?;
        let dir = ScratchDir::new("redis")?;
        let server = Self {
            child: spawn(binary, dir.path(), port)?,
            port,
            binary: binary.to_owned(),
            dir,
        };
        server.wait_ready()?;
        Ok(server)
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

    /// SIGKILL, then the same port and directory again 1 s later (it
    /// replays the append-only file).
    pub async fn restart(&mut self) -> Result<(), String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.child = spawn(&self.binary, self.dir.path(), self.port)?;
        self.wait_ready()
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A standalone connection's configuration.
    pub fn config(&self) -> RedisConfig {
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

fn spawn(binary: &Path, dir: &Path, port: u16) -> Result<Child, String> {
    Command::new(binary)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--appendonly", "yes", "--appendfsync", "always"])
        .args(["--save", ""])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", binary.display()))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
