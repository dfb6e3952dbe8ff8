//! Flex requests and background responses driven by the official
//! `openai` Python client, unchanged (`tests/python/flex_client.py`),
//! against real servers and our simulator as the pool. The client lives
//! in `target/py-venv`, which `scripts/test.sh` creates; without it this
//! test fails and says how to make it (set `SLUICEGATE_SKIP_PYTHON_SUITE=1`
//! to skip it knowingly).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::support::serve::{ServeSpec, start};
use crate::support::sim::small_pool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_drives_flex_and_background_responses() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/py-venv/bin/python");
    if !python.is_file() {
        if std::env::var_os("SLUICEGATE_SKIP_PYTHON_SUITE").is_some() {
            eprintln!(
                "SKIPPED: the openai Python flex suite (SLUICEGATE_SKIP_PYTHON_SUITE is set)"
            );
            return;
        }
        panic!(
            "{} is missing: run `bash scripts/test.sh` (it creates the venv with the pinned openai client), or set SLUICEGATE_SKIP_PYTHON_SUITE=1 to skip this suite",
            python.display()
        );
    }
    let sim = small_pool().await;
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.keys = Some("alice:key-alice,bob:key-bob".into());
    let open = start(&spec, None).await;
    spec.closed_gate = true;
    spec.flex_max_wait = Some(Duration::from_secs(1));
    let closed = start(&spec, None).await;
    let (open_base, closed_base) = (open.base.clone(), closed.base.clone());
    let closed_metrics = format!("http://{}/metrics", closed.server.telemetry_addr);
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/python/flex_client.py",
            ])
            .current_dir(root)
            .env("SLUICEGATE_FLEX_BASE", open_base)
            .env("SLUICEGATE_FLEX_CLOSED", closed_base)
            .env("SLUICEGATE_FLEX_CLOSED_METRICS", closed_metrics)
            .env("SLUICEGATE_KEY_A", "key-alice")
            .env("SLUICEGATE_KEY_B", "key-bob")
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .expect("pytest runs")
    })
    .await
    .expect("pytest task");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{text}");
    assert!(
        output.status.success(),
        "the Python flex suite failed:\n{text}"
    );
    assert!(text.contains("8 passed"), "every Python test ran:\n{text}");
    open.stop().await;
    closed.stop().await;
    sim.shutdown().await.expect("simulator stops");
}
