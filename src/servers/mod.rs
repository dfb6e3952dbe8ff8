//! Real servers that the benchmarks (`sluicegate bench soak`) and the
//! integration tests start for themselves: each on a free 127.0.0.1 port,
//! in a scratch directory of its own, and stopped by the PID (or process
//! group) that started it, on drop too, so a run never touches a server
//! it did not start. One file per server: `prometheus.rs`, `postgres.rs`,
//! `emulator.rs` (the Pub/Sub emulator), `redis.rs`. Errors are
//! sentences for the caller to print or panic with.

pub mod emulator;
pub mod postgres;
pub mod prometheus;
pub mod redis;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub use emulator::Emulator;
pub use postgres::Postgres;
pub use prometheus::{Prometheus, PrometheusSpec, RecordingRule};
pub use redis::RedisServer;

/// A free TCP port on 127.0.0.1 (bound, then released for the server).
pub fn free_port() -> Result<u16, String> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind a free port: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("free port: {e}"))
}

/// A fresh directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates `sluicegate-<tag>-<pid>-<n>`.
    pub fn new(tag: &str) -> Result<Self, String> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluicegate-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(Self(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sends `SIG<name>` to process `pid`, or to process group `-pgid` when
/// `target` starts with `-` (always after `--`: procps `kill` reads a
/// bare `-1234` as a signal or as -1, every process).
pub fn signal(name: &str, target: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg("--")
        .arg(target)
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("kill -{name}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{name} -- {target} failed"))
    }
}

/// Whether process (or `-group`) `target` still exists.
pub fn alive(target: &str) -> bool {
    signal("0", target).is_ok()
}
