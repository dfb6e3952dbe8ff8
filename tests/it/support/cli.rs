//! The real `sluicegate` binary as a user runs it: a clean environment
//! (only `PATH`), no standard input.

use std::process::{Command, Output, Stdio};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

/// `sluicegate <args>` with only `PATH` set.
pub fn sluicegate(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .args(args)
        .stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to completion.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output().expect("sluicegate runs")
}

/// Lossy text of an output stream.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A background `sluicegate` process (e.g. `run`), SIGKILLed on drop so
/// a failing test leaves nothing running.
pub struct Background(pub std::process::Child);

impl Background {
    /// Spawns `cmd` with its output discarded.
    pub fn spawn(cmd: &mut Command) -> Self {
        Self(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("sluicegate starts"),
        )
    }

    /// SIGKILL, as a crash: nothing is handed back.
    pub fn kill(&mut self) {
        self.0.kill().expect("SIGKILL");
        let _ = self.0.wait();
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
