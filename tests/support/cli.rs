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
