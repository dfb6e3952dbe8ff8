//! The README's first command, in its short mode: runs to completion with
//! no network or service, and leaves results and a chart behind.

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

#[test]
fn demo_short_mode_runs_to_completion_with_report_and_chart() {
    let dir = std::env::temp_dir().join(format!("sluicegate-demo-{}", std::process::id()));
    let out = Command::new(BIN)
        .args(["demo", "--short", "--dir"])
        .arg(&dir)
        .stdin(Stdio::null())
        .output()
        .expect("demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("demo report"), "{stdout}");
    assert!(stdout.contains("interactive TTFT p99"), "{stdout}");
    // A full window is reported as such, apart from time the gate held
    // the batch back (issue 16); the harvest sits next to the interactive
    // cost against the batch-free twin (issue 11).
    assert!(stdout.contains("window full"), "{stdout}");
    assert!(stdout.contains("batch harvest: 60/60 lines"), "{stdout}");
    assert!(stdout.contains("on the batch-free twin (rho "), "{stdout}");
    assert!(stderr.contains("time by state:"), "{stderr}");
    let results = std::fs::read_to_string(dir.join("results.jsonl")).expect("results");
    assert_eq!(results.lines().count(), 60);
    let svg = std::fs::read_to_string(dir.join("demo.svg")).expect("chart");
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    // The chart's panels, with their legends.
    for text in [
        "interactive load on the pool (waves)",
        "twin pool without batch (baseline)",
        "batch requests in flight",
        "gate window",
        "gate (feedback)",
        "budget D",
        "baseline B",
    ] {
        assert!(svg.contains(text), "chart lacks {text:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
