#!/usr/bin/env bash
# Batch API intake and cancel, measured (docs/batch-api.md, "Measured"):
# an N-line chat-completions file (default 50,000, ~14 MB) uploaded to
# `sluicegate serve` (embedded transport) whose gate stays closed, so
# nothing is dispatched; prints upload time, validation + enqueue time,
# the server's peak RSS, then cancel-to-cancelled time.
# Usage: [N=50000] [PORT=18611] [BIN=target/debug/sluicegate] scripts/measure-batch-api.sh
set -euo pipefail
N=${N:-50000}
PORT=${PORT:-18611}
BIN=$(realpath "${BIN:-target/debug/sluicegate}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
python3 - "$N" <<'PY'
import json, sys
with open("in.jsonl", "w") as f:
    for i in range(int(sys.argv[1])):
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 16}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
PY
cat > cfg.toml <<TOML
transport = "embedded"
[embedded]
path = "$WORK/queue.db"
[gateway]
url = "http://127.0.0.1:9"
[telemetry]
listen = "127.0.0.1:$((PORT + 1))"
[[queue]]
queue_name = "q"
gate_type = "endpoint-scrape"
[queue.gate_params]
url = "http://127.0.0.1:9/metrics"
metric = "m"
max_count_per_pod = 4
[serve]
listen = "127.0.0.1:$PORT"
data_dir = "$WORK/data"
TOML
"$BIN" serve --config cfg.toml > serve.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; rm -rf "$WORK"' EXIT
API=http://127.0.0.1:$PORT/v1
for _ in $(seq 50); do curl -sf "$API/batches" >/dev/null && break; sleep 0.2; done
status() { curl -s "$API/batches/$1" | jq -r .status; }
t0=$(date +%s.%N)
FILE=$(curl -s -F purpose=batch -F file=@in.jsonl "$API/files" | jq -r .id)
t1=$(date +%s.%N)
BATCH=$(curl -s -H 'content-type: application/json' \
  -d "{\"input_file_id\":\"$FILE\",\"endpoint\":\"/v1/chat/completions\",\"completion_window\":\"24h\"}" \
  "$API/batches" | jq -r .id)
while [ "$(status "$BATCH")" = validating ]; do sleep 0.1; done
t2=$(date +%s.%N)
echo "lines=$N bytes=$(stat -c %s in.jsonl) upload_s=$(echo "$t1 - $t0" | bc) validate_enqueue_s=$(echo "$t2 - $t1" | bc)"
grep VmHWM /proc/$PID/status
t3=$(date +%s.%N)
curl -s -X POST "$API/batches/$BATCH/cancel" >/dev/null
while [ "$(status "$BATCH")" != cancelled ]; do sleep 0.2; done
t4=$(date +%s.%N)
ERRORS=$(curl -s "$API/batches/$BATCH" | jq -r .error_file_id)
echo "cancel_to_cancelled_s=$(echo "$t4 - $t3" | bc) error_lines=$(curl -s "$API/files/$ERRORS/content" | wc -l)"
grep VmHWM /proc/$PID/status
