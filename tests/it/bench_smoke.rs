//! The benchmarks at tiny sizes, so their code paths do not rot: `bench
//! drain` on a real `redis-server`, `bench drain-memory`, `bench hold`,
//! `bench drain-pubsub` on the Pub/Sub emulator, `bench drain-sql` on a
//! real PostgreSQL, and
//! `scripts/bench-compare.sh` running all of them side by side (this
//! build on both sides, its own Redis and emulator). Each checks what the
//! benchmark reports, never how fast: speed is only ever a ratio measured
//! by the compare script, not a test threshold.

use crate::support;

use std::path::Path;
use std::process::Command;

use crate::support::TempDir;
use crate::support::cli::{BIN, output, sluicegate, text};
use crate::support::postgres::Postgres;
use crate::support::pubsub::Emulator;
use crate::support::redis::RedisServer;

/// Runs a bench command and returns its standard output; fails the test
/// with both streams if it did not succeed.
fn run(mut cmd: Command) -> String {
    let out = output(&mut cmd);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

#[test]
fn bench_drain_empties_a_real_redis_queue() {
    let redis = RedisServer::start();
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let stdout = run(sluicegate(&[
        "bench",
        "drain",
        "--messages",
        "300",
        "--max-sys",
        "16",
        "--redis-url",
        &url,
    ]));
    assert!(stdout.contains("drain benchmark: 300 messages"), "{stdout}");
    assert!(stdout.contains("messages/s"), "{stdout}");
    assert!(stdout.contains("peak RSS"), "{stdout}");
    // Every message got its one result, and nothing is left claimed.
    assert_eq!(redis.int(&["LLEN", "bench-drain-results"]), 300);
    assert_eq!(redis.int(&["ZCARD", "bench-drain"]), 0);
}

#[test]
fn bench_drain_memory_answers_every_message() {
    let stdout = run(sluicegate(&[
        "bench",
        "drain-memory",
        "--messages",
        "300",
        "--max-sys",
        "16",
    ]));
    assert!(
        stdout.contains("in-memory drain benchmark: 300 messages (300 ok)"),
        "{stdout}"
    );
    assert!(stdout.contains("CPU:"), "{stdout}");
}

#[test]
fn bench_hold_holds_every_request_and_answers_it() {
    let stdout = run(sluicegate(&[
        "bench",
        "hold",
        "--requests",
        "20",
        "--delay",
        "300ms",
    ]));
    assert!(stdout.contains("peak 20 in flight at once"), "{stdout}");
    assert!(stdout.contains("20 ok, 0 errors, 0 missing"), "{stdout}");
}

#[test]
fn bench_drain_pubsub_reads_back_every_result() {
    let emulator = Emulator::start();
    let stdout = run(sluicegate(&[
        "bench",
        "drain-pubsub",
        "--messages",
        "50",
        "--pubsub-project",
        support::pubsub::PROJECT,
        "--pubsub-emulator-host",
        &emulator.host(),
    ]));
    assert!(
        stdout.contains("pubsub drain benchmark: 50 messages"),
        "{stdout}"
    );
    assert!(stdout.contains("messages/s"), "{stdout}");
}

#[test]
fn bench_drain_sql_empties_a_real_postgres_queue() {
    let pg = Postgres::start();
    let stdout = run(sluicegate(&[
        "bench",
        "drain-sql",
        "--messages",
        "200",
        "--max-sys",
        "16",
        "--sql-url",
        &pg.url(),
    ]));
    assert!(
        stdout.contains("drain-sql benchmark: 200 messages"),
        "{stdout}"
    );
    assert!(stdout.contains("messages/s"), "{stdout}");
    assert!(stdout.contains("peak RSS"), "{stdout}");
    // Every message got its one result, and no row is left.
    assert_eq!(
        pg.psql("SELECT COUNT(*) FROM async_results WHERE route = 'bench-drain-sql-results'"),
        "200"
    );
    assert_eq!(
        pg.psql("SELECT COUNT(*) FROM async_requests WHERE queue = 'bench-drain-sql'"),
        "0"
    );
}

/// A side that cannot be built stops the script with an error instead of
/// empty tables and exit 0 (a revision that does not exist, and a
/// prebuilt directory without a binary).
#[test]
fn bench_compare_stops_when_a_side_cannot_be_built() {
    let work = TempDir::new("bench-compare-bad");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench-compare.sh");
    let bad_rev = output(
        Command::new("bash")
            .arg(&script)
            .args(["no-such-revision", "HEAD"])
            .env("BENCH_COMPARE_DIR", &work.0),
    );
    assert!(!bad_rev.status.success(), "{}", text(&bad_rev.stdout));
    assert!(!text(&bad_rev.stdout).contains("| benchmark |"));
    let empty = work.0.join("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    let no_binary = output(
        Command::new("bash")
            .arg(&script)
            .args(["a", "b"])
            .env("BENCH_COMPARE_DIR", &work.0)
            .env("BENCH_COMPARE_BIN_A", &empty)
            .env("BENCH_COMPARE_BIN_B", &empty),
    );
    assert!(!no_binary.status.success(), "{}", text(&no_binary.stdout));
    assert!(
        text(&no_binary.stderr).contains("no sluicegate binary"),
        "{}",
        text(&no_binary.stderr)
    );
}

/// The compare script end to end with this build on both sides: it starts
/// its own Redis and emulator, runs every benchmark in pairs (A B, B A) and prints
/// one row per figure with both medians and the ratio, the within-build
/// ratios and the yardstick.
#[test]
fn bench_compare_prints_medians_and_ratios_for_every_benchmark() {
    let work = TempDir::new("bench-compare");
    let bin_dir = Path::new(BIN).parent().expect("binary directory");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench-compare.sh");
    let out = output(
        Command::new("bash")
            .arg(&script)
            .args([
                "--pairs",
                "2",
                "--messages",
                "200",
                "--window",
                "16",
                "--pubsub-messages",
                "30",
                "--sql-messages",
                "200",
                "--hold-requests",
                "10",
                "--hold-delay",
                "200ms",
                "--yardstick-requests",
                "2000",
                "this-build",
                "this-build",
            ])
            .env("BENCH_COMPARE_DIR", &work.0)
            .env("BENCH_COMPARE_BIN_A", bin_dir)
            .env("BENCH_COMPARE_BIN_B", bin_dir),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for row in [
        "| redis | messages/s |",
        "| redis | CPU s/1000 |",
        "| redis | peak RSS MiB |",
        "| memory | messages/s |",
        "| hold | RSS all held MiB |",
        "| pubsub | messages/s |",
        "| pubsub | emulator CPU s/1000 |",
        "| sql | messages/s |",
        "| sql | CPU s/1000 |",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no row `{row}` in\n{stdout}\n{stderr}"));
        // | bench | figure | A median | B median | B/A | A runs | B runs |
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let ratio: f64 = cells[5]
            .parse()
            .unwrap_or_else(|_| panic!("ratio in `{line}`"));
        assert!(ratio > 0.0, "{line}");
        // Two pairs: two runs per side.
        assert_eq!(cells[6].split(", ").count(), 2, "{line}");
        assert_eq!(cells[7].split(", ").count(), 2, "{line}");
    }
    assert!(
        stdout.contains("Redis drain / in-memory drain = "),
        "{stdout}"
    );
    assert!(
        stdout.contains("Pub/Sub drain / Redis drain = "),
        "{stdout}"
    );
    assert!(stdout.contains("SQL drain / Redis drain = "), "{stdout}");
    assert!(stdout.contains("LPUSH -P 16: median"), "{stdout}");
    assert!(stdout.contains("ZADD: median"), "{stdout}");
}
