#!/usr/bin/env bash
# The chaos soak (issue 36, part 6; docs/operations.md, "Chaos soak"): a
# release build of `sluicegate bench soak`, 200 000 messages on Redis by
# default. Arguments go to `bench soak` (e.g. --seed 2, --messages 50000,
# --transport sql|pubsub). Needs redis-server and prometheus on PATH (and
# PostgreSQL's server binaries for sql, gcloud's Pub/Sub emulator for
# pubsub); starts and stops everything it uses.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin sluicegate
mkdir -p target/soak
log="target/soak/soak-$(date -u +%Y%m%dT%H%M%SZ).log"
target/release/sluicegate bench soak "$@" 2>&1 | tee "$log"
echo "account written to $log"
