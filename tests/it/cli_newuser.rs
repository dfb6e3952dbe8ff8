//! What a new user trips over (issue 16), run through the real binary as a
//! user would: embedded defaults that agree, reading commands that never
//! create stores, a `run` that exits on a signal even when its stderr pipe
//! is closed, `check-config` that refuses what `run` refuses, and logs
//! without colour codes when they do not go to a terminal.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::support::TempDir;
use crate::support::cli::{output, sluicegate, text};

fn openai_lines(path: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({
                "custom_id": format!("r-{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).expect("input");
}

/// The queue `config/embedded.toml` names.
fn example_queue() -> String {
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/embedded.toml"))
            .expect("example config");
    let value: toml::Value = toml::from_str(&example).expect("example is TOML");
    value["queue"][0]["queue_name"]
        .as_str()
        .expect("queue_name")
        .to_owned()
}

#[test]
fn embedded_submit_results_and_example_config_share_one_default_queue() {
    let tmp = TempDir::new("newuser-defaults");
    let db = tmp.0.join("sluicegate.db");
    let input = tmp.0.join("batch.jsonl");
    openai_lines(&input, 3);
    let submitted = output(sluicegate(&["submit", "--embedded"]).arg(&db).arg(&input));
    assert!(submitted.status.success(), "{submitted:?}");
    let queue = example_queue();
    assert!(
        text(&submitted.stdout).contains(&format!("queue `{queue}`")),
        "submit --embedded wrote another queue than config/embedded.toml reads: {}",
        text(&submitted.stdout)
    );
    // The worker of the example config would see them.
    let store = sluicegate::queue::embedded::EmbeddedQueue::open(&db, queue).expect("open");
    assert_eq!(store.unsettled_count().expect("count"), 3);

    // `results-embedded` with no --queue reads the same queue: three
    // messages still waiting, no results yet, and it says so.
    let results = output(sluicegate(&["results-embedded", "--embedded"]).arg(&db));
    assert!(results.status.success(), "{results:?}");
    assert!(text(&results.stdout).is_empty());
    let stderr = text(&results.stderr);
    assert!(stderr.contains("no results yet"), "{stderr}");
    assert!(stderr.contains("3 messages"), "{stderr}");
}

#[test]
fn results_of_a_queue_with_no_messages_and_no_results_say_so() {
    let tmp = TempDir::new("newuser-empty-queue");
    let db = tmp.0.join("sluicegate.db");
    let input = tmp.0.join("batch.jsonl");
    openai_lines(&input, 2);
    let submitted = output(
        sluicegate(&["submit", "--embedded"])
            .arg(&db)
            .args(["--queue", "other"])
            .arg(&input),
    );
    assert!(submitted.status.success(), "{submitted:?}");
    let results = output(sluicegate(&["results-embedded", "--embedded"]).arg(&db));
    assert!(text(&results.stdout).is_empty());
    let stderr = text(&results.stderr);
    assert!(
        stderr.contains("has no messages and no results"),
        "{stderr}"
    );
    // It names the queues the store does hold, so the typo is obvious.
    assert!(stderr.contains("`other`"), "{stderr}");
}

#[test]
fn config_example_comment_names_commands_that_exist() {
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/embedded.toml"))
            .expect("example config");
    assert!(!example.contains("submit-embedded"), "{example}");
    let help = output(&mut sluicegate(&["--help"]));
    for line in example.lines().filter(|l| l.starts_with('#')) {
        for word in line.split('`').skip(1).step_by(2) {
            if let Some(sub) = word.strip_prefix("sluicegate ") {
                let name = sub.split_whitespace().next().unwrap_or_default();
                assert!(
                    text(&help.stdout).contains(name),
                    "`{name}` is not a command"
                );
            }
        }
    }
}

#[test]
fn reading_a_mistyped_store_is_an_error_naming_it_and_creates_nothing() {
    let tmp = TempDir::new("newuser-missing-store");
    let db = tmp.0.join("nonexist.db");
    let results = output(sluicegate(&["results-embedded", "--embedded"]).arg(&db));
    assert!(!results.status.success(), "{results:?}");
    let stderr = text(&results.stderr);
    assert!(stderr.contains("nonexist.db"), "{stderr}");
    assert!(stderr.contains("does not exist"), "{stderr}");
    assert!(!db.exists(), "a reading command created the store");
    let entries: Vec<_> = std::fs::read_dir(&tmp.0).expect("dir").collect();
    assert!(entries.is_empty(), "files left behind: {entries:?}");
}

/// `run` on the memory transport, configured by the environment alone.
fn memory_run(dir: &Path, gateway: &str) -> Command {
    let input = dir.join("requests.jsonl");
    let deadline = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 3600;
    let lines: Vec<String> = (0..5)
        .map(|i| {
            serde_json::json!({"id": format!("q-{i}"), "deadline": deadline, "payload": {"model": "m"}})
                .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).expect("input");
    let mut cmd = sluicegate(&["run", "--input"]);
    cmd.arg(&input)
        .arg("--output")
        .arg(dir.join("results.jsonl"))
        .env("SLUICEGATE_TRANSPORT", "memory")
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_GATE_TYPE", "local-max-concurrency")
        .env("SLUICEGATE_GATE_PARAMS", r#"{"limit":"2"}"#)
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_LOG_LEVEL", "debug")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "50ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "50ms");
    cmd
}

fn signal(child: &std::process::Child, name: &str) {
    let status = Command::new("kill")
        .args([name, &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits up to `secs` for `child` to exit.
fn exits_within(child: &mut std::process::Child, secs: u64) -> Option<std::process::ExitStatus> {
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < give_up {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    None
}

#[test]
fn run_with_a_closed_stderr_pipe_still_drains_and_exits_on_sigint() {
    let tmp = TempDir::new("newuser-closed-stderr");
    // Nothing listens on port 1: every request fails and is retried, so
    // the run logs steadily and has unsettled messages at exit.
    let mut child = memory_run(&tmp.0, "http://127.0.0.1:1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run starts");
    // `2>&1 | head -1`: read one line, then close the pipe.
    let mut stderr = child.stderr.take().expect("stderr");
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut stderr, &mut first).expect("a first log byte");
    drop(stderr);
    drop(child.stdout.take());
    std::thread::sleep(std::time::Duration::from_millis(500));
    signal(&child, "-INT");
    let status = exits_within(&mut child, 15);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("run did not exit after SIGINT with its stderr closed");
    }
    let results = tmp.0.join("results.jsonl");
    assert!(results.exists(), "no results file written");
    let unsettled = tmp.0.join("results.jsonl.unsettled.jsonl");
    let results_n = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .count();
    let unsettled_n = std::fs::read_to_string(&unsettled)
        .unwrap_or_default()
        .lines()
        .count();
    assert_eq!(results_n + unsettled_n, 5, "every message accounted for");
}

#[test]
fn run_exits_on_sigterm_with_a_closed_stderr_pipe() {
    let tmp = TempDir::new("newuser-closed-stderr-term");
    let mut child = memory_run(&tmp.0, "http://127.0.0.1:1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run starts");
    let mut stderr = child.stderr.take().expect("stderr");
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut stderr, &mut first).expect("a first log byte");
    drop(stderr);
    std::thread::sleep(std::time::Duration::from_millis(500));
    signal(&child, "-TERM");
    if exits_within(&mut child, 15).is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("run did not exit after SIGTERM with its stderr closed");
    }
    assert!(
        tmp.0.join("results.jsonl").exists(),
        "no results file written"
    );
}

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    let tmp = TempDir::new("newuser-colour");
    let child = memory_run(&tmp.0, "http://127.0.0.1:1")
        .env("SLUICEGATE_LOG_FORMAT", "text")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run starts");
    std::thread::sleep(std::time::Duration::from_millis(800));
    signal(&child, "-TERM");
    let out = child.wait_with_output().expect("run exits");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("sluicegate started"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI codes in a pipe: {stderr:?}"
    );
}

/// `check-config` and `run` on the same environment.
fn check_and_run(envs: &[(&str, &str)]) -> (Output, Output) {
    let with_env = |args: &[&str]| {
        let mut cmd = sluicegate(args);
        cmd.env("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:1")
            .env("SLUICEGATE_QUEUE", "q")
            .env("SLUICEGATE_LISTEN", "127.0.0.1:0");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd
    };
    let check = output(&mut with_env(&["check-config"]));
    let run = output(&mut with_env(&["run"]));
    (check, run)
}

#[test]
fn check_config_refuses_what_run_refuses() {
    let cases: [&[(&str, &str)]; 2] = [
        &[
            ("SLUICEGATE_TRANSPORT", "pubsub"),
            ("SLUICEGATE_GATE_TYPE", "constant"),
        ],
        &[
            ("SLUICEGATE_TRANSPORT", "memory"),
            ("SLUICEGATE_GATE_TYPE", "redis-quota"),
            (
                "SLUICEGATE_GATE_PARAMS",
                r#"{"address":"127.0.0.1:6379","limit":"5","lease":"0s"}"#,
            ),
        ],
    ];
    for envs in cases {
        let (check, run) = check_and_run(envs);
        assert_eq!(run.status.code(), Some(2), "run: {run:?}");
        let refused = text(&run.stderr);
        assert_eq!(
            check.status.code(),
            Some(2),
            "check-config approved what run refuses ({refused}): {}",
            text(&check.stdout)
        );
        // The same reason, word for word.
        let reason = refused.trim().lines().last().unwrap_or_default().to_owned();
        assert!(
            text(&check.stderr).contains(&reason),
            "{envs:?}: {} vs {reason}",
            text(&check.stderr)
        );
    }
    // What run accepts, check-config still accepts (`run` itself would
    // run until a signal, so only check-config is asked).
    let check = output(
        sluicegate(&["check-config"])
            .env("SLUICEGATE_GATEWAY_URL", "http://127.0.0.1:1")
            .env("SLUICEGATE_QUEUE", "q")
            .envs([
                ("SLUICEGATE_TRANSPORT", "memory"),
                ("SLUICEGATE_GATE_TYPE", "constant"),
            ]),
    );
    assert!(check.status.success(), "{check:?}");
}

#[test]
fn compatibility_metric_mapping_names_only_real_metrics() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/compatibility.md"),
    )
    .expect("docs/compatibility.md");
    // The sections about metrics ("Metric names", "Metric labels and
    // units"), each up to the next heading: elsewhere `sluicegate_` may
    // start another kind of name (a metadata key, say).
    let section: String = doc
        .split("\n#")
        .filter(|part| {
            part.trim_start_matches('#')
                .trim_start()
                .starts_with("Metric ")
        })
        .collect();
    assert!(section.contains("Metric names"), "a metric names section");
    let mut named = 0;
    for word in section.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("sluicegate_") && !word.ends_with('_') {
            named += 1;
            assert!(
                sluicegate::telemetry::METRIC_NAMES.contains(&word),
                "docs/compatibility.md names `{word}`, which sluicegate does not export"
            );
        }
    }
    assert!(named > 10, "the mapping names sluicegate metrics");
    for upstream in [
        "async_request_total",
        "async_inflight_requests",
        "async_dispatch_budget",
        "async_gate_decisions_total",
    ] {
        assert!(section.contains(upstream), "{upstream} is mapped");
    }
}

#[test]
fn license_matches_cargo_and_docs_cite_only_files_in_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo: toml::Value =
        toml::from_str(&std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml"))
            .expect("TOML");
    assert_eq!(cargo["package"]["license"].as_str(), Some("Apache-2.0"));
    let license = std::fs::read_to_string(root.join("LICENSE")).expect("a LICENSE file");
    assert!(license.contains("Apache License"), "Apache text");
    assert!(license.contains("Version 2.0, January 2004"));
    assert!(
        license.contains("END OF TERMS AND CONDITIONS"),
        "the full text"
    );

    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path
                .extension()
                .is_some_and(|e| e == "rs" || e == "md" || e == "toml")
            {
                out.push(path);
            }
        }
    }
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "src", "tests", "config"] {
        walk(&root.join(dir), &mut files);
    }
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for missing in [
            "ARCHITECTURE.md",
            "REFERENCE.md",
            "EVALUATION.md",
            "ARCHITECTURE,",
            "REFERENCE §",
        ] {
            // This test names them; nothing else may.
            if file.ends_with("cli_newuser.rs") {
                continue;
            }
            assert!(
                !text.contains(missing),
                "{} cites {missing}, which is not in the repository",
                file.display()
            );
        }
    }
    assert!(root.join("docs/architecture.md").is_file());
}
