//! A real vLLM: the CPU build that `scripts/vllm.sh` installs once per
//! machine (the test command installs it), serving a tiny Llama-shaped model
//! with random weights on a free loopback port, its compute pinned to a core
//! of its own; stopped by PID (its process group, on drop too).
//!
//! Each engine takes 25–40 s to start and about 4.7 GB of memory, so the
//! suites that use one run in the nextest group `real-engine`, one at a
//! time, and each test starts one engine and checks everything it can on
//! it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The model name the engine serves.
pub const MODEL: &str = "tiny-llama";

/// The engine's context length (`--max-model-len`): a longer prompt is
/// refused with 400.
pub const MAX_MODEL_LEN: usize = 2048;

/// A running engine.
#[derive(Debug)]
pub struct Vllm {
    pid: Option<u32>,
    port: u16,
    log: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/vllm.sh")
}

impl Vllm {
    /// Starts an engine on a free port and returns once `/health` answers.
    pub fn start() -> Self {
        Self::start_on(None)
    }

    /// Starts an engine on `port` (a restart on the same address), or on a
    /// free port.
    pub fn start_on(port: Option<u16>) -> Self {
        let mut cmd = Command::new("bash");
        cmd.arg(script()).arg("serve");
        if let Some(port) = port {
            cmd.env("VLLM_PORT", port.to_string());
        }
        let out = cmd.output().expect("scripts/vllm.sh runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the real engine did not start (scripts/vllm.sh install installs it; the test command does):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let field = |key: &str| {
            stdout
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {stdout:?}"))
                .to_string()
        };
        Self {
            pid: Some(field("pid=").parse().expect("pid")),
            port: field("port=").parse().expect("port"),
            log: PathBuf::from(field("log=")),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The engine's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGKILL to its whole process group (the API server and the engine
    /// core), as a crash.
    pub fn kill(&mut self) {
        self.signal("KILL", Duration::from_secs(10));
    }

    /// SIGTERM, and SIGKILL if it has not exited within 20 s.
    pub fn stop(&mut self) {
        self.signal("TERM", Duration::from_secs(20));
        self.signal("KILL", Duration::from_secs(10));
    }

    fn signal(&mut self, signal: &str, wait: Duration) {
        let Some(pid) = self.pid else { return };
        let _ = Command::new("kill")
            .args([format!("-{signal}"), format!("-{pid}")])
            .status();
        let give_up = std::time::Instant::now() + wait;
        // The group is gone when no process of it is left.
        while std::time::Instant::now() < give_up {
            let alive = Command::new("pgrep")
                .args(["-g", &pid.to_string()])
                .output()
                .is_ok_and(|o| o.status.success());
            if !alive {
                self.pid = None;
                let _ = std::fs::remove_file(&self.log);
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.stop();
    }
}
