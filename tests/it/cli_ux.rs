//! One spelling per concept across subcommands, and no silent duplicate
//! submissions (issue 16, items 9 and 5), run through the real binary as
//! a user would: the new flag spellings and the old ones kept as hidden
//! aliases, `results --embedded` / `cancel --embedded`, `gate probe --help`
//! listing only what applies, and `submit` refusing ids repeated inside a
//! file and warning about ids already submitted (embedded store and a real
//! `redis-server`).

use std::path::Path;

use crate::support::TempDir;
use crate::support::cli::{output, sluicegate, text};
use crate::support::redis::RedisServer;

fn openai_line(id: &str) -> String {
    serde_json::json!({
        "custom_id": id, "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi"}
    })
    .to_string()
}

fn write_lines(path: &Path, ids: &[&str]) {
    let lines: Vec<String> = ids.iter().map(|id| openai_line(id)).collect();
    std::fs::write(path, lines.join("\n")).expect("input");
}

fn help(args: &[&str]) -> String {
    let out = output(&mut sluicegate(args));
    assert!(out.status.success(), "{out:?}");
    text(&out.stdout)
}

/// Submits `ids` into a new embedded store and returns its path.
fn embedded_store(tmp: &TempDir, ids: &[&str]) -> std::path::PathBuf {
    let db = tmp.0.join("sluicegate.db");
    let input = tmp.0.join("batch.jsonl");
    write_lines(&input, ids);
    let out = output(sluicegate(&["submit", "--embedded"]).arg(&db).arg(&input));
    assert!(out.status.success(), "{out:?}");
    db
}

#[test]
fn cancel_embedded_answers_waiting_messages_cancelled_and_results_embedded_reads_them() {
    let tmp = TempDir::new("ux-cancel-embedded");
    let db = embedded_store(&tmp, &["r-1", "r-2", "r-3"]);
    let cancelled = output(
        sluicegate(&["cancel", "--embedded"])
            .arg(&db)
            .args(["r-1", "unknown"]),
    );
    assert!(cancelled.status.success(), "{cancelled:?}");
    let stdout = text(&cancelled.stdout);
    assert!(stdout.contains("r-1: cancelled"), "{stdout}");
    assert!(stdout.contains("unknown: not active"), "{stdout}");
    assert!(stdout.contains("1 cancelled, 1 not active"), "{stdout}");
    let store =
        sluicegate::queue::embedded::EmbeddedQueue::open(&db, "request-sortedset").expect("open");
    assert_eq!(store.unsettled_count().expect("count"), 2);

    // Native records on standard output.
    let native = output(sluicegate(&["results", "--embedded"]).arg(&db));
    assert!(native.status.success(), "{native:?}");
    let lines: Vec<serde_json::Value> = text(&native.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["id"], "r-1");
    assert_eq!(lines[0]["error_code"], "CANCELLED");

    // OpenAI batch output lines into a file, as for Redis.
    let file = tmp.0.join("out.jsonl");
    let openai = output(
        sluicegate(&["results", "--embedded"])
            .arg(&db)
            .args(["--format", "openai", "--output"])
            .arg(&file),
    );
    assert!(openai.status.success(), "{openai:?}");
    assert!(text(&openai.stdout).contains("collected 1 results"));
    let written = std::fs::read_to_string(&file).expect("output file");
    let line: serde_json::Value =
        serde_json::from_str(written.lines().next().expect("a line")).expect("JSON");
    assert_eq!(line["custom_id"], "r-1");
    assert!(line["response"].is_null(), "{line}");
    assert!(!line["error"].is_null(), "{line}");
}

#[test]
fn cancel_and_results_embedded_never_create_a_store() {
    let tmp = TempDir::new("ux-missing-store");
    let db = tmp.0.join("nonexist.db");
    for args in [
        &["cancel", "x", "--embedded"][..],
        &["results", "--embedded"][..],
    ] {
        let out = output(sluicegate(args).arg(&db));
        assert!(!out.status.success(), "{out:?}");
        assert!(text(&out.stderr).contains("does not exist"), "{out:?}");
        assert!(!db.exists());
    }
}

#[test]
fn results_embedded_alias_is_hidden_deprecated_and_prints_the_same() {
    let tmp = TempDir::new("ux-alias");
    let db = embedded_store(&tmp, &["a", "b"]);
    let cancelled = output(
        sluicegate(&["cancel", "--embedded"])
            .arg(&db)
            .args(["a", "b"]),
    );
    assert!(cancelled.status.success(), "{cancelled:?}");
    let new = output(sluicegate(&["results", "--embedded"]).arg(&db));
    let old = output(sluicegate(&["results-embedded", "--embedded"]).arg(&db));
    assert!(old.status.success(), "{old:?}");
    assert_eq!(text(&old.stdout), text(&new.stdout));
    assert_eq!(text(&old.stdout).lines().count(), 2);
    let notice = text(&old.stderr);
    assert!(notice.contains("deprecated"), "{notice}");
    assert!(notice.contains("results --embedded"), "{notice}");
    assert_eq!(notice.lines().count(), 1, "one line: {notice}");
    assert!(!help(&["--help"]).contains("results-embedded"));
}

#[test]
fn results_out_is_the_old_spelling_of_output() {
    let tmp = TempDir::new("ux-out-alias");
    let db = embedded_store(&tmp, &["a"]);
    let _ = output(sluicegate(&["cancel", "--embedded"]).arg(&db).arg("a"));
    let file = tmp.0.join("old.jsonl");
    let old = output(
        sluicegate(&["results", "--embedded"])
            .arg(&db)
            .arg("--out")
            .arg(&file),
    );
    assert!(old.status.success(), "{old:?}");
    assert_eq!(
        std::fs::read_to_string(&file)
            .expect("file")
            .lines()
            .count(),
        1
    );
    let results_help = help(&["results", "--help"]);
    assert!(results_help.contains("--output"), "{results_help}");
    assert!(results_help.contains("--embedded"), "{results_help}");
    assert!(!results_help.contains("--out "), "{results_help}");
}

#[test]
fn batch_takes_gateway_url_and_deadline_and_still_the_old_spellings() {
    let tmp = TempDir::new("ux-batch-flags");
    // One unusable line: answered at once, nothing is sent to the
    // (closed) gateway port, so the run only exercises the flags.
    let input = tmp.0.join("in.jsonl");
    std::fs::write(&input, "{not json\n").expect("input");
    let run = |out: &str, flags: &[&str]| {
        output(
            sluicegate(&["batch", "--quiet", "--input"])
                .arg(&input)
                .arg("--output")
                .arg(tmp.0.join(out))
                .args(flags),
        )
    };
    let new = run(
        "new.jsonl",
        &["--gateway-url", "http://127.0.0.1:9", "--deadline", "1h"],
    );
    assert!(new.status.success(), "{new:?}");
    let old = run(
        "old.jsonl",
        &["--gateway", "http://127.0.0.1:9", "--deadline-secs", "3600"],
    );
    assert!(old.status.success(), "{old:?}");
    let both = run(
        "both.jsonl",
        &[
            "--gateway-url",
            "http://127.0.0.1:9",
            "--deadline",
            "1h",
            "--deadline-secs",
            "5",
        ],
    );
    assert!(!both.status.success(), "{both:?}");
    let batch_help = help(&["batch", "--help"]);
    assert!(batch_help.contains("--gateway-url"), "{batch_help}");
    assert!(batch_help.contains("--deadline <"), "{batch_help}");
    assert!(!batch_help.contains("--deadline-secs"), "{batch_help}");
    assert!(!batch_help.contains("--gateway <"), "{batch_help}");
    // One default request path: the gateway's.
    let request_path = batch_help
        .lines()
        .find(|l| l.contains("--request-path"))
        .expect("--request-path in the help");
    assert!(
        request_path.ends_with("[default: /v1/completions]"),
        "{request_path}"
    );
}

#[test]
fn gate_probe_help_lists_only_the_flags_it_uses() {
    let probe = help(&["gate", "probe", "--help"]);
    for flag in ["--config", "--queue", "--json", "--watch", "--interval"] {
        assert!(probe.contains(flag), "{flag} missing: {probe}");
    }
    for flag in [
        "--transport",
        "--gateway-url",
        "--request-path",
        "--listen",
        "--log-format",
        "--log-level",
    ] {
        assert!(!probe.contains(flag), "{flag} listed: {probe}");
    }
}

#[test]
fn demo_short_duration_in_help_matches_the_readme() {
    let demo = help(&["demo", "--help"]);
    assert!(demo.contains("~15 s"), "{demo}");
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README");
    let flat = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("`cargo run -- demo --short` takes about 15 s"),
        "README disagrees with `demo --help`"
    );
}

#[test]
fn submit_embedded_refuses_ids_repeated_in_the_file_unless_allowed() {
    let tmp = TempDir::new("ux-dup-embedded");
    let db = tmp.0.join("sluicegate.db");
    let input = tmp.0.join("batch.jsonl");
    write_lines(&input, &["a", "b", "a", "c", "b"]);
    let refused = output(sluicegate(&["submit", "--embedded"]).arg(&db).arg(&input));
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let stderr = text(&refused.stderr);
    assert!(
        stderr.contains("line 3: duplicate custom_id `a` (first on line 1)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 5: duplicate custom_id `b` (first on line 2)"),
        "{stderr}"
    );
    assert!(stderr.contains("nothing submitted"), "{stderr}");
    assert!(stderr.contains("--allow-duplicates"), "{stderr}");
    assert!(!db.exists(), "a refused file must enqueue nothing");

    let allowed = output(
        sluicegate(&["submit", "--allow-duplicates", "--embedded"])
            .arg(&db)
            .arg(&input),
    );
    assert!(allowed.status.success(), "{allowed:?}");
    assert!(text(&allowed.stderr).contains("submitted anyway"));
    let store =
        sluicegate::queue::embedded::EmbeddedQueue::open(&db, "request-sortedset").expect("open");
    assert_eq!(store.unsettled_count().expect("count"), 5);
}

#[test]
fn submit_embedded_warns_about_ids_already_waiting() {
    let tmp = TempDir::new("ux-resubmit-embedded");
    let db = embedded_store(&tmp, &["a", "b"]);
    let input = tmp.0.join("again.jsonl");
    write_lines(&input, &["b", "c"]);
    let again = output(sluicegate(&["submit", "--embedded"]).arg(&db).arg(&input));
    assert!(again.status.success(), "{again:?}");
    let stderr = text(&again.stderr);
    assert!(stderr.contains("1 ids are already waiting"), "{stderr}");
    assert!(stderr.contains("`b`"), "{stderr}");
    assert!(!stderr.contains("`c`"), "{stderr}");
}

#[test]
fn submit_and_batch_word_a_bad_line_alike() {
    let tmp = TempDir::new("ux-one-wording");
    let input = tmp.0.join("in.jsonl");
    // Line 1 blank (skipped, still counted), line 2 unusable: nothing is
    // sent to the (closed) gateway port.
    std::fs::write(
        &input,
        "\n{\"custom_id\":\"x\",\"method\":\"GET\",\"url\":\"/v1/models\",\"body\":{}}\n",
    )
    .expect("input");
    let out = tmp.0.join("out.jsonl");
    let batch = output(
        sluicegate(&[
            "batch",
            "--quiet",
            "--gateway-url",
            "http://127.0.0.1:9",
            "--input",
        ])
        .arg(&input)
        .arg("--output")
        .arg(&out),
    );
    assert!(batch.status.success(), "{batch:?}");
    let lines = std::fs::read_to_string(&out).unwrap_or_default();
    let batch_message = lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["custom_id"] == "x")
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .expect("batch answered the GET line");
    let submit = output(
        sluicegate(&["submit", "--embedded"])
            .arg(tmp.0.join("db"))
            .arg(&input),
    );
    let stderr = text(&submit.stderr);
    assert!(
        stderr.contains(&batch_message),
        "{batch_message} / {stderr}"
    );
    assert!(
        batch_message.starts_with("line 2: method GET"),
        "{batch_message}"
    );
}

#[test]
fn submit_to_redis_warns_about_active_ids_and_refuses_repeated_ones() {
    let server = RedisServer::start();
    let tmp = TempDir::new("ux-dup-redis");
    let input = tmp.0.join("batch.jsonl");
    write_lines(&input, &["a", "b"]);
    let submit = |file: &Path, extra: &[&str]| {
        output(
            sluicegate(&["submit", "--redis-url", &server.url(), "--queue", "q"])
                .args(extra)
                .arg(file),
        )
    };
    let first = submit(&input, &[]);
    assert!(first.status.success(), "{first:?}");
    assert!(!text(&first.stderr).contains("warning"), "{first:?}");
    assert_eq!(server.int(&["ZCARD", "q"]), 2);

    let again = submit(&input, &[]);
    assert!(again.status.success(), "{again:?}");
    let stderr = text(&again.stderr);
    assert!(stderr.contains("2 ids are already active"), "{stderr}");
    assert!(stderr.contains("`a`") && stderr.contains("`b`"), "{stderr}");

    let repeated = tmp.0.join("repeated.jsonl");
    write_lines(&repeated, &["c", "d", "c"]);
    let before = server.int(&["ZCARD", "q"]);
    let refused = submit(&repeated, &[]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        text(&refused.stderr).contains("line 3: duplicate custom_id `c` (first on line 1)"),
        "{refused:?}"
    );
    assert_eq!(server.int(&["ZCARD", "q"]), before, "nothing enqueued");
    assert_eq!(server.int(&["EXISTS", "request-active:d"]), 0);

    let allowed = submit(&repeated, &["--allow-duplicates"]);
    assert!(allowed.status.success(), "{allowed:?}");
    assert!(
        text(&allowed.stdout).contains("submitted 3 requests"),
        "{allowed:?}"
    );
}
