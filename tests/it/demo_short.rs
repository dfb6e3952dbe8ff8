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
    // rho is measured on the waves' own interactive requests, paired with
    // the twin's, not on probes (issue 23 item 7).
    let rho_line = stdout
        .lines()
        .find(|l| l.contains("interactive TTFT p99:"))
        .unwrap_or_else(|| panic!("no TTFT line:\n{stdout}"));
    assert!(
        rho_line.contains("requests that arrived while the batch ran, paired by arrival"),
        "{rho_line}"
    );
    assert!(!stdout.contains("probe"), "{stdout}");
    let rho: f64 = number_after(rho_line, "(rho ");
    assert!(rho.is_finite() && rho > 0.0, "{rho_line}");
    let requests: f64 = number_after(rho_line, "the waves' own ");
    assert!(requests > 0.0, "{rho_line}");
    // H as the demo defines it, and time the gate held the batch back.
    assert!(stdout.contains("batch output tokens/s ("), "{stdout}");
    assert!(stdout.contains("held back by the gate "), "{stdout}");
    // The gate's real parameters: the demo's growth step and max_sys, and
    // the defaults the built gate resolved (SLOs, cut thresholds).
    let gate_line = stderr
        .lines()
        .find(|l| l.starts_with("batch: "))
        .unwrap_or_else(|| panic!("no gate line:\n{stderr}"));
    for text in [
        "gate: feedback",
        "max_sys 48",
        "AIMD window in [0, 48] from 2.4:",
        "+3 (",
        "×0.5 on 429/503",
        "attainment < 0.986",
        "TTFT <= 0.5 s and ITL <= 0.05 s",
    ] {
        assert!(gate_line.contains(text), "lacks {text:?}: {gate_line}");
    }
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
        "waves&apos;",
        "batch tokens/s",
        &format!("rho {rho:.2}"),
    ] {
        assert!(svg.contains(text), "chart lacks {text:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The number right after `marker` in `line`.
fn number_after(line: &str, marker: &str) -> f64 {
    let rest = &line[line
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?}: {line}"))
        + marker.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("{marker:?} in {line}: {e}"))
}
