//! Suites written against the official Python clients (`openai`,
//! `google-cloud-pubsub`), run with the venv `scripts/test.sh` makes in
//! `target/py-venv`. Without it a suite fails and says how to make it
//! (`SLUICEGATE_SKIP_PYTHON_SUITE=1` skips it knowingly).

use std::path::PathBuf;
use std::process::Command;

/// The venv's Python, or `None` when `SLUICEGATE_SKIP_PYTHON_SUITE` is set
/// and it is missing (the suite `what` is then skipped, and says so).
pub fn venv_python(what: &str) -> Option<PathBuf> {
    let python = root().join("target/py-venv/bin/python");
    if python.is_file() {
        return Some(python);
    }
    if std::env::var_os("SLUICEGATE_SKIP_PYTHON_SUITE").is_some() {
        eprintln!("SKIPPED: {what} (SLUICEGATE_SKIP_PYTHON_SUITE is set)");
        return None;
    }
    panic!(
        "{} is missing: run `bash scripts/test.sh` (it creates the venv with the pinned clients), or set SLUICEGATE_SKIP_PYTHON_SUITE=1 to skip this suite",
        python.display()
    );
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs pytest on `path` (relative to the checkout) with `env` and no
/// OpenAI settings from the caller's environment; asserts it passed with
/// exactly `passed` tests, so a test that stopped being collected fails.
pub async fn run_pytest(
    python: PathBuf,
    path: &str,
    env: Vec<(&'static str, String)>,
    passed: usize,
) {
    let path = path.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", &path])
            .current_dir(root())
            .envs(env)
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
    assert!(output.status.success(), "the Python suite failed:\n{text}");
    assert!(
        text.contains(&format!("{passed} passed")),
        "every Python test ran:\n{text}"
    );
}
