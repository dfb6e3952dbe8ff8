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
    /// core), as a crash; returns once every process of it is gone (a
    /// worker of 2 GB takes seconds to exit on a loaded machine).
    pub fn kill(&mut self) {
        let pid = self.pid;
        assert!(
            self.signal("KILL", Duration::from_secs(60)),
            "the engine's process group {pid:?} outlived SIGKILL for 60 s"
        );
    }

    /// SIGTERM, and SIGKILL if it has not exited within 20 s.
    pub fn stop(&mut self) {
        self.signal("TERM", Duration::from_secs(20));
        self.signal("KILL", Duration::from_secs(10));
    }

    /// Sends `signal` to the group and waits up to `wait` for it to be
    /// gone; whether it is (true when it was already).
    fn signal(&mut self, signal: &str, wait: Duration) -> bool {
        let Some(pid) = self.pid else { return true };
        // A group, never "every process": kill(-1) as root ends the machine.
        assert!(pid > 1, "not an engine's process group: {pid}");
        // `--` before the negative id: procps-ng 4.0.2 reads `kill -KILL
        // -18068` as kill(-1, SIGKILL) (it keeps the first digit, strace
        // shows), every process the user may signal: as root, the whole
        // machine; `-4660` as kill(-4), which missed the engine. With `--`
        // it is kill(-18068).
        let _ = Command::new("kill")
            .args([format!("-{signal}"), "--".to_owned(), format!("-{pid}")])
            .status();
        let give_up = std::time::Instant::now() + wait;
        while std::time::Instant::now() < give_up {
            if !group_alive(pid) {
                self.pid = None;
                let _ = std::fs::remove_file(&self.log);
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

/// Whether a process of the group `pgid` still runs. The engine's
/// processes are orphans once the group leader dies, and their zombies
/// wait for init to reap them (seconds on these machines); a zombie holds
/// no memory, port or core, so it does not count.
fn group_alive(pgid: u32) -> bool {
    let Ok(out) = Command::new("pgrep")
        .args(["-g", &pgid.to_string()])
        .output()
    else {
        return false;
    };
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|pid| {
            // /proc/<pid>/stat: "pid (comm) state ..."; comm may hold spaces
            // and parentheses, so the state follows the last ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let state = stat
                        .rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .next()?
                        .to_owned();
                    Some(state != "Z" && state != "X")
                })
                .unwrap_or(false)
        })
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.stop();
    }
}
