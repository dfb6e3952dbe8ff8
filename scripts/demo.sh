#!/usr/bin/env bash
# The demo: a simulated vLLM pool with interactive background load, and a
# batch of 200 requests dispatched into it through a gate. Needs nothing
# but this repository (no network, no external service).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet
bin=target/debug/sluicegate
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

"$bin" sim serve --listen "127.0.0.1:$port" --interactive waves --replicas 2 --time-scale 5 \
  2>"$work/sim.log" &
sim_pid=$!
trap 'kill $sim_pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.1
done
echo "simulated pool (2 replicas, interactive waves) on http://127.0.0.1:$port"

python3 - "$work/requests.jsonl" <<'PY'
import json, sys, time
deadline = int(time.time()) + 3600
with open(sys.argv[1], "w") as f:
    for i in range(200):
        f.write(json.dumps({"id": f"demo-{i}", "deadline": deadline,
            "payload": {"model": "sim-model", "prompt": "Summarise document %d." % i, "max_tokens": 64}}) + "\n")
PY
echo "dispatching 200 batch requests (gate: local-max-concurrency, 16 in flight)..."

start=$(date +%s.%N)
SLUICEGATE_TRANSPORT=memory \
SLUICEGATE_QUEUE=demo \
SLUICEGATE_GATEWAY_URL="http://127.0.0.1:$port" \
SLUICEGATE_GATE_TYPE=local-max-concurrency \
SLUICEGATE_GATE_PARAMS='{"limit": 16, "gating_mode": "blocking"}' \
SLUICEGATE_LISTEN=127.0.0.1:0 \
SLUICEGATE_LOG_LEVEL=warn \
  "$bin" run --input "$work/requests.jsonl" --output "$work/results.jsonl" --exit-when-done
end=$(date +%s.%N)

python3 - "$work/results.jsonl" "$start" "$end" <<'PY'
import collections, json, sys
results = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = collections.Counter(str(r.get("status_code") or r.get("error_code")) for r in results)
tokens = 0
for r in results:
    if r.get("status_code") == 200:
        tokens += json.loads(r["payload"]).get("usage", {}).get("completion_tokens", 0)
secs = float(sys.argv[3]) - float(sys.argv[2])
print(f"results: {len(results)} ({dict(by)}), {tokens} completion tokens in {secs:.1f} s")
print("first result:", json.dumps(results[0])[:240], "...")
PY
echo "pool metrics after the batch:"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)\{' | head -6
