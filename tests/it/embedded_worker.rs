//! `run` with the embedded transport, fed by `submit --embedded`: two worker
//! processes on one store file answer every message exactly once.

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluicegate::queue::embedded::EmbeddedQueue;
use sluicegate::sim::{SimConfig, spawn_http};

const BIN: &str = env!("CARGO_BIN_EXE_sluicegate");

fn worker(config: &Path, db: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--config"])
        .arg(config)
        .env("SLUICEGATE_EMBEDDED_PATH", db)
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_LOG_LEVEL", "warn")
        .stdin(Stdio::null());
    cmd
}

#[tokio::test(flavor = "multi_thread")]
async fn two_workers_on_one_file_answer_every_submission_once() {
    let sim = spawn_http(SimConfig {
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .expect("sim");
    let tmp = support::TempDir::new("embedded-two");
    let dir = &tmp.0;
    let db = dir.join("store.db");
    let config = dir.join("embedded.toml");
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/embedded.toml"))
            .expect("example config");
    std::fs::write(
        &config,
        example.replace("http://127.0.0.1:8000", &sim.base_url()),
    )
    .expect("config");
    let n = 80;
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({
                "custom_id": format!("s-{i}"), "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
            })
            .to_string()
        })
        .collect();
    let file = dir.join("in.jsonl");
    std::fs::write(&file, lines.join("\n")).expect("input");
    let submitted = Command::new(BIN)
        .args(["submit", "--embedded"])
        .arg(&db)
        .arg(&file)
        .output()
        .expect("submit");
    assert!(submitted.status.success(), "{submitted:?}");
    assert!(String::from_utf8_lossy(&submitted.stdout).contains("submitted 80 messages"));

    let mut a = worker(&config, &db).spawn().expect("worker a");
    let mut b = worker(&config, &db).spawn().expect("worker b");
    let store = EmbeddedQueue::open(&db, "request-sortedset").expect("open");
    let give_up = Instant::now() + Duration::from_secs(40);
    while store.result_count().expect("count") < n {
        assert!(Instant::now() < give_up, "workers did not finish");
        assert!(a.try_wait().expect("a").is_none(), "worker a exited early");
        assert!(b.try_wait().expect("b").is_none(), "worker b exited early");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for child in [&mut a, &mut b] {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    assert!(a.wait().expect("a").success());
    assert!(b.wait().expect("b").success());

    let results = Command::new(BIN)
        .args(["results-embedded", "--embedded"])
        .arg(&db)
        .output()
        .expect("results");
    let text = String::from_utf8_lossy(&results.stdout);
    let mut ids: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            assert_eq!(v["status_code"], 200, "{v}");
            v["id"].as_str().expect("id").to_owned()
        })
        .collect();
    assert_eq!(ids.len(), n as usize);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n as usize, "no duplicate results");
    assert_eq!(store.unsettled_count().expect("count"), 0);
}
