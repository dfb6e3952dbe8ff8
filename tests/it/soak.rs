//! The chaos soak in small (issue 36, part 6): `sluicegate bench soak`
//! with its own redis-server (AOF), three replicas sharing the window,
//! the simulator behind a fault gateway, and faults on a seeded schedule
//! (replica kills and pauses past the lease, 429 / 503 / reset storms,
//! two Redis restarts). The long run is `scripts/soak.sh`
//! (docs/operations.md, "Chaos soak").

use std::process::Command;

#[test]
fn a_small_soak_on_redis_answers_every_id_once_within_the_window() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluicegate"))
        .args(["bench", "soak", "--messages", "1500", "--seed", "7"])
        .args(["--fault-every-ms", "500", "--max-faults", "5"])
        .args(["--faults-until", "0.9", "--stall-secs", "90"])
        .output()
        .expect("sluicegate runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The account the soak checks, as printed.
    assert!(
        stdout.contains("1500 ids answered, 0 lost, 0 answered more than once"),
        "{stdout}"
    );
    let faults = stdout
        .lines()
        .find(|l| l.starts_with("faults: "))
        .expect("a faults line");
    // Five faults: one of each kind (the schedule deals every kind once
    // per round), and both Redis restarts.
    assert_eq!(
        faults,
        "faults: 1 replica kills, 1 replica pauses past the lease, 3 gateway storms, 2 Redis restarts"
    );
}
