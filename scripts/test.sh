#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what a fresh machine
# lacks, then runs formatting, lints and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the test suites spawn (real servers on loopback).
packages=()
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v prometheus >/dev/null 2>&1 || packages+=(prometheus)
# promtool (tests/it/ops_monitoring.rs) ships in the same Debian package.
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v redis-cli >/dev/null 2>&1 || packages+=(redis-tools)
# The rediss:// test makes a private CA and a server certificate.
command -v openssl >/dev/null 2>&1 || packages+=(openssl)
# scripts/bench-compare.sh (run by tests/it/bench_smoke.rs): redis-benchmark
# (redis-tools), curl for the emulator's readiness, pgrep for its CPU.
command -v redis-benchmark >/dev/null 2>&1 || packages+=(redis-tools)
command -v curl >/dev/null 2>&1 || packages+=(curl)
command -v pgrep >/dev/null 2>&1 || packages+=(procps)
# The Pub/Sub emulator (tests/it/pubsub_transport.rs) runs on Java 17.
command -v java >/dev/null 2>&1 || packages+=(openjdk-17-jre-headless)
# The sql transport and sql-quota suites (tests/it/support/postgres.rs) run
# initdb and the postgres server binary directly; Debian keeps them in
# /usr/lib/postgresql/<version>/bin, off PATH. setpriv (util-linux) runs
# them as the postgres user when the tests run as root.
if ! command -v initdb >/dev/null 2>&1 &&
  ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  packages+=(postgresql)
fi
command -v setpriv >/dev/null 2>&1 || packages+=(util-linux)
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${packages[@]}"
  else
    echo "missing packages: ${packages[*]} (run as root to install them)" >&2
    exit 1
  fi
fi

# The official Python clients, pinned, in target/py-venv: openai for the
# Batch API suite (tests/it/batch_api_python.rs), google-cloud-pubsub for the
# Pub/Sub suite's producer (tests/it/pubsub_transport.rs). Made once; a venv
# from before a pin was added or changed is topped up (the stamp file
# records the pins it holds).
py_pins="openai==1.109.1 pytest==8.4.2 google-cloud-pubsub==2.31.1"
if [ ! -x target/py-venv/bin/python ]; then
  if ! python3 -m venv target/py-venv; then
    rm -rf target/py-venv
    if [ "$(id -u)" = 0 ]; then
      apt-get update
      DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
    else
      echo "python3 -m venv failed; install python3-venv (run as root to install it)" >&2
      exit 1
    fi
    python3 -m venv target/py-venv
  fi
fi
if [ "$(cat target/py-venv/.pins 2>/dev/null)" != "$py_pins" ]; then
  # shellcheck disable=SC2086 # one word per pin
  target/py-venv/bin/pip install --quiet $py_pins || {
    rm -rf target/py-venv
    echo "cannot install the pinned Python clients ($py_pins) into target/py-venv" >&2
    exit 1
  }
  echo "$py_pins" >target/py-venv/.pins
fi

# The Pub/Sub emulator itself is not a Debian package: it comes from
# Google's apt repository (packages.cloud.google.com), which this script
# does not add. Fail early and say so rather than in the middle of the run.
if ! command -v gcloud >/dev/null 2>&1 ||
  [ ! -d "$(gcloud info --format='value(installation.sdk_root)' 2>/dev/null)/platform/pubsub-emulator" ]; then
  echo "the Pub/Sub emulator is missing: install google-cloud-cli and google-cloud-cli-pubsub-emulator from Google's apt repository (https://cloud.google.com/sdk/docs/install#deb), then re-run" >&2
  exit 1
fi

# A real vLLM (the CPU build, ~6 GB) for tests/it/real_engine.rs: installed
# once per machine into a cache keyed by its pins, outside the checkout, so
# a fresh clone reuses it (docs/real-engine.md).
bash scripts/vllm.sh install

# Dockerfile and helm chart, with hadolint and helm (installed on first use;
# the deploy_lint suite renders the chart with the same helm).
bash scripts/lint-deploy.sh

cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
# nextest runs the suites with the groups of .config/nextest.toml (many
# waiting tests at a time, the CPU-heavy ones and the real engine alone).
# It is required: `cargo test` would run every suite of the one test binary
# in one process, two at a time, with no groups.
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install --locked cargo-nextest
fi
cargo nextest run --locked --no-fail-fast
cargo test --doc --locked
