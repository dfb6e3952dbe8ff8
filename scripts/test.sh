#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what a fresh machine
# lacks, then runs formatting, lints and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the test suites spawn (real servers on loopback).
packages=()
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v prometheus >/dev/null 2>&1 || packages+=(prometheus)
# promtool (tests/ops_monitoring.rs) ships in the same Debian package.
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v redis-cli >/dev/null 2>&1 || packages+=(redis-tools)
# The rediss:// test makes a private CA and a server certificate.
command -v openssl >/dev/null 2>&1 || packages+=(openssl)
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${packages[@]}"
  else
    echo "missing packages: ${packages[*]} (run as root to install them)" >&2
    exit 1
  fi
fi

# Dockerfile and helm chart, with hadolint and helm (installed on first use).
bash scripts/lint-deploy.sh

cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --no-fail-fast
else
  cargo test --locked --no-fail-fast
fi
cargo test --doc --locked
