//! The chaos soak in small (issue 36, part 6): `sluicegate bench soak`
//! with its own servers (redis-server with AOF for the shared window, the
//! transport's store, a real Prometheus scraping the simulator for the
//! `prometheus-budget` gate), three replicas sharing the window, the
//! simulator behind a fault gateway, and faults on a seeded schedule: one
//! of each kind (replica kill, pause past the lease, 429 / 503 / reset
//! storms) and two restarts of the store's server. One test per
//! transport. The long runs are `scripts/soak.sh` (docs/operations.md,
//! "Chaos soak").

use std::process::Command;

/// Runs a small soak on `transport` and returns its account as printed;
/// fails the test when the soak says it failed.
fn soak(transport: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sluicegate"))
        .args(["bench", "soak", "--transport", transport])
        // 300 ms requests: the work outlasts the five faults (about 20 s).
        .args(["--messages", "1500", "--max-tokens", "30", "--seed", "7"])
        .args(["--fault-every-ms", "500", "--max-faults", "5"])
        .args(["--faults-until", "1.0", "--stall-secs", "90"])
        .output()
        .expect("sluicegate runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The window the soak checks (it fails past it), as printed.
    assert!(stdout.contains("(window 18)"), "{stdout}");
    assert!(
        stdout.contains("gate prometheus-budget through a real Prometheus"),
        "{stdout}"
    );
    stdout
}

/// The faults line: five faults, one of each kind (the schedule deals
/// every kind once per round), and both restarts of `server`.
fn assert_every_fault(stdout: &str, server: &str) {
    let faults = stdout
        .lines()
        .find(|l| l.starts_with("faults: "))
        .expect("a faults line");
    assert_eq!(
        faults,
        format!(
            "faults: 1 replica kills, 1 replica pauses past the lease, 3 gateway storms, 2 {server} restarts"
        )
    );
}

#[test]
fn a_small_soak_on_redis_answers_every_id_once_within_the_window() {
    let stdout = soak("redis");
    assert!(
        stdout.contains("1500 ids answered, 0 lost, 0 answered more than once"),
        "{stdout}"
    );
    assert_every_fault(&stdout, "Redis");
}

#[test]
fn a_small_soak_on_sql_answers_every_id_once_within_the_window() {
    let stdout = soak("sql");
    assert!(
        stdout.contains("1500 ids answered, 0 lost, 0 answered more than once"),
        "{stdout}"
    );
    assert_every_fault(&stdout, "PostgreSQL");
}

#[test]
fn a_small_soak_on_pubsub_answers_every_id_within_the_window() {
    let stdout = soak("pubsub");
    // Every id answered, none lost. Pub/Sub delivers at least once: a
    // replica killed between publishing a result and acking its request
    // publishes that result again when the request comes back, so repeats
    // of one submission's result are allowed (and printed); the soak
    // fails on a lost id or the window either way.
    assert!(stdout.contains("1500 ids answered, 0 lost,"), "{stdout}");
    assert_every_fault(&stdout, "shared-window Redis");
}
