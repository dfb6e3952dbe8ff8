#!/usr/bin/env bash
# Side-by-side benchmarks of two revisions, in the same minutes.
#
#   scripts/bench-compare.sh [options] REV_A REV_B
#
# These machines differ by 2x from day to day, so a speed or memory figure
# means something only as a ratio against another build measured in the
# same run. This script builds both revisions in release (each side in its
# own target directory), starts one redis-server (and the Pub/Sub emulator
# when `gcloud` has it, and a PostgreSQL of its own when the server
# binaries are installed) on free 127.0.0.1 ports, and runs every benchmark
# in pairs (--pairs times), A B then B A alternately, so a drift over the
# run weighs on both sides alike (use an even --pairs). Between pairs it runs
# redis-benchmark (LPUSH and ZADD, unpipelined and -P 16) as the machine's
# yardstick. It prints, per benchmark and figure, the median of each side
# and the ratio B/A, and per side the Redis drain against the in-memory
# drain, and the Pub/Sub and SQL drains against the Redis drain.
#
# REV is anything `git rev-parse` takes, or WORKTREE for the checkout as it
# is now (uncommitted changes included).
#
# Options:
#   --pairs N            A/B pairs per benchmark (default 4, at least 1)
#   --only LIST          comma-separated subset of: redis,memory,hold,pubsub,sql
#                        (default all; pubsub is skipped without the emulator,
#                        sql without PostgreSQL's initdb and postgres)
#   --messages N         Redis and in-memory drain size (default 200000)
#   --window N           window (max_sys) of both drains (default 512)
#   --pubsub-messages N  Pub/Sub drain size (default 5000)
#   --sql-messages N     SQL (PostgreSQL) drain size (default 20000)
#   --hold-requests N    bench hold requests (default 10000)
#   --hold-delay D       bench hold gateway delay (default 15s)
#   --yardstick-requests N  redis-benchmark requests per unpipelined test
#                        (default 100000; four times as many with -P 16)
#   --no-yardstick       skip redis-benchmark
#   --keep               keep the Redis, emulator and PostgreSQL logs
#   --sentinel           side B's Redis drain reaches the Redis through Redis
#                        Sentinel (`--redis-mode sentinel`): the script gives
#                        its Redis a replica and three sentinels, so both
#                        sides drain the same replicated master, A directly.
#                        Meant for one binary on both sides
#                        (BENCH_COMPARE_BIN_A = BENCH_COMPARE_BIN_B)
#
# Environment: BENCH_COMPARE_DIR (default /tmp/sluicegate-bench-compare)
# holds the sources, target directories, binaries and run logs; the target
# directories are reused, so a second comparison rebuilds only what changed.
# BENCH_COMPARE_BIN_A / BENCH_COMPARE_BIN_B: a directory holding a built
# `sluicegate` to use for that side instead of building REV.
# A benchmark a revision does not have (e.g. `bench hold` before it
# existed) is reported as n/a for that side.
set -euo pipefail
# `build_side` runs in a command substitution: without this a failed
# build there went unnoticed and the script printed empty tables, exit 0.
shopt -s inherit_errexit

pairs=4
only="redis,memory,hold,pubsub,sql"
messages=200000
window=512
pubsub_messages=5000
sql_messages=20000
hold_requests=10000
hold_delay=15s
yardstick=1
yardstick_requests=100000
keep=0
sentinel=0
revs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) pairs="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --messages) messages="$2"; shift 2 ;;
    --window) window="$2"; shift 2 ;;
    --pubsub-messages) pubsub_messages="$2"; shift 2 ;;
    --sql-messages) sql_messages="$2"; shift 2 ;;
    --hold-requests) hold_requests="$2"; shift 2 ;;
    --hold-delay) hold_delay="$2"; shift 2 ;;
    --yardstick-requests) yardstick_requests="$2"; shift 2 ;;
    --no-yardstick) yardstick=0; shift ;;
    --keep) keep=1; shift ;;
    --sentinel) sentinel=1; shift ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "bench-compare: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) revs+=("$1"); shift ;;
  esac
done
if [ ${#revs[@]} -ne 2 ]; then
  echo "usage: scripts/bench-compare.sh [options] REV_A REV_B (see --help)" >&2
  exit 2
fi
if ! [[ "$pairs" =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-compare: --pairs must be a positive integer, got '$pairs'" >&2
  exit 2
fi
for b in ${only//,/ }; do
  case "$b" in
    redis|memory|hold|pubsub|sql) ;;
    *) echo "bench-compare: --only takes redis,memory,hold,pubsub,sql; got '$b'" >&2; exit 2 ;;
  esac
done
wants() { [[ ",$only," == *",$1,"* ]]; }

root="$(cd "$(dirname "$0")/.." && pwd)"
work="${BENCH_COMPARE_DIR:-/tmp/sluicegate-bench-compare}"
mkdir -p "$work"
run_dir="$work/run-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$run_dir"

# --- build -------------------------------------------------------------------

# Builds one side; prints the directory holding its `sluicegate` binary
# (and, for revisions before `bench drain-memory`, the `drain_memory`
# example that was the in-memory drain then). A revision is exported with
# `git archive` (no worktree to clean up); WORKTREE builds the checkout in
# place. Each side has its own target directory, reused between
# comparisons. BENCH_COMPARE_BIN_A / _B name a directory with a built
# `sluicegate` instead (the test suite runs the script that way).
build_side() {
  local side="$1" rev="$2" src label prebuilt
  prebuilt="BENCH_COMPARE_BIN_${side^^}"
  if [ -n "${!prebuilt:-}" ]; then
    echo "${!prebuilt}" >"$run_dir/label-$side"
    echo "${!prebuilt}"
    return
  fi
  if [ "$rev" = WORKTREE ]; then
    src="$root"
    label="worktree"
  else
    label="$(git -C "$root" rev-parse --short=10 "$rev^{commit}")"
    src="$work/src-$label"
    if [ ! -f "$src/Cargo.toml" ]; then
      rm -rf "$src"
      mkdir -p "$src"
      git -C "$root" archive "$label" | tar -x -C "$src"
    fi
  fi
  local targets=(--bin sluicegate)
  [ -f "$src/examples/drain_memory.rs" ] && targets+=(--example drain_memory)
  echo "building $side = $rev ($label) ..." >&2
  # Cargo keeps the crate's build fresh by the mtimes of the files its
  # dep-info names: those of the source tree it was last built from. When
  # a side's target directory last built another revision whose tree is
  # still here and unchanged, cargo keeps that binary, and the "A" of
  # several comparisons on 2026-12-08 was one old build whatever
  # revision was asked for. So the crate is rebuilt (its dependencies are
  # kept) whenever the source tree is not the one built last.
  local stamp="$work/target-$side/.sluicegate-built-from"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$src" ] && [ -d "$work/target-$side" ]; then
    CARGO_TARGET_DIR="$work/target-$side" cargo clean --release -p sluicegate \
      --manifest-path "$src/Cargo.toml" >&2
  fi
  CARGO_TARGET_DIR="$work/target-$side" cargo build --release --locked \
    --manifest-path "$src/Cargo.toml" "${targets[@]}" >&2
  echo "$src" >"$stamp"
  local bin="$run_dir/bin-$side"
  mkdir -p "$bin"
  cp "$work/target-$side/release/sluicegate" "$bin/"
  if [ -f "$src/examples/drain_memory.rs" ]; then
    cp "$work/target-$side/release/examples/drain_memory" "$bin/"
  fi
  echo "$label" >"$run_dir/label-$side"
  echo "$bin"
}

bin_a="$(build_side a "${revs[0]}")"
bin_b="$(build_side b "${revs[1]}")"
if [ "$sentinel" = 1 ]; then
  echo "$(cat "$run_dir/label-b"), Redis drain via Sentinel" >"$run_dir/label-b"
fi
for side_bin in "$bin_a" "$bin_b"; do
  if [ ! -x "$side_bin/sluicegate" ]; then
    echo "bench-compare: no sluicegate binary in $side_bin" >&2
    exit 1
  fi
done

# --- servers -------------------------------------------------------------------

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

pids=()
cleanup() {
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill -KILL -- "-$p" 2>/dev/null || true
  done
  if [ "$keep" = 0 ]; then rm -rf "$run_dir/redis" "$run_dir/emulator" "$run_dir/postgres"; fi
}
trap cleanup EXIT

redis_port="$(free_port)"
mkdir -p "$run_dir/redis"
setsid redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
  --dir "$run_dir/redis" --logfile "$run_dir/redis/redis.log" &
pids+=($!)
for _ in $(seq 100); do
  redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
  sleep 0.1
done
redis-cli -p "$redis_port" ping >/dev/null
export SLUICEGATE_REDIS_URL="redis://127.0.0.1:$redis_port/0"

# --sentinel: a replica of that Redis and three sentinels watching it; side
# B's drain finds the master through them.
sentinel_flags=()
if [ "$sentinel" = 1 ]; then
  replica_port="$(free_port)"
  mkdir -p "$run_dir/redis/replica"
  setsid redis-server --bind 127.0.0.1 --port "$replica_port" --save "" --appendonly no \
    --replicaof 127.0.0.1 "$redis_port" \
    --dir "$run_dir/redis/replica" --logfile "$run_dir/redis/replica.log" &
  pids+=($!)
  sentinel_addrs=()
  for i in 0 1 2; do
    port="$(free_port)"
    dir="$run_dir/redis/sentinel-$i"
    mkdir -p "$dir"
    printf 'port %s\nbind 127.0.0.1\ndir %s\nlogfile %s/sentinel.log\nsentinel monitor bench 127.0.0.1 %s 2\nsentinel down-after-milliseconds bench 5000\n' \
      "$port" "$dir" "$dir" "$redis_port" >"$dir/sentinel.conf"
    setsid redis-server "$dir/sentinel.conf" --sentinel &
    pids+=($!)
    sentinel_addrs+=("127.0.0.1:$port")
  done
  # Settled: the replica in sync and every sentinel seeing the master, its
  # replica and the two other sentinels.
  for _ in $(seq 600); do
    settled=1
    redis-cli -p "$replica_port" info replication 2>/dev/null | grep -q 'master_link_status:up' || settled=0
    for a in "${sentinel_addrs[@]}"; do
      info="$(redis-cli -p "${a##*:}" sentinel master bench 2>/dev/null | paste -sd' ')"
      [[ "$info" == *"num-slaves 1 "* && "$info" == *"num-other-sentinels 2 "* ]] || settled=0
    done
    [ "$settled" = 1 ] && break
    sleep 0.1
  done
  if [ "$settled" != 1 ]; then
    echo "bench-compare: the sentinels did not settle" >&2
    exit 1
  fi
  sentinel_flags=(--redis-mode sentinel --redis-addrs "$(IFS=,; echo "${sentinel_addrs[*]}")" --redis-master-name bench)
fi

emulator_pid=""
if wants pubsub; then
  if command -v gcloud >/dev/null 2>&1 &&
    [ -d "$(gcloud info --format='value(installation.sdk_root)' 2>/dev/null)/platform/pubsub-emulator" ]; then
    emulator_port="$(free_port)"
    mkdir -p "$run_dir/emulator"
    setsid gcloud beta emulators pubsub start --host-port="127.0.0.1:$emulator_port" \
      --data-dir="$run_dir/emulator" --quiet >"$run_dir/emulator/emulator.log" 2>&1 &
    emulator_pid=$!
    pids+=("$emulator_pid")
    for _ in $(seq 600); do
      curl -fs "http://127.0.0.1:$emulator_port/" >/dev/null 2>&1 && break
      sleep 0.1
    done
    export PUBSUB_EMULATOR_HOST="127.0.0.1:$emulator_port"
    export SLUICEGATE_PUBSUB_PROJECT_ID=bench-compare
  else
    echo "bench-compare: no Pub/Sub emulator (gcloud); skipping the pubsub benchmark" >&2
    only="${only//pubsub/}"
  fi
fi

# PostgreSQL for the sql drain: initdb + the postgres binary in a fresh
# directory on a free port (never the machine's own server). As root it
# runs as the postgres user (PostgreSQL refuses root). fsync is off, as
# the Redis above runs without persistence: both drains measure the
# dispatcher and the store's statements, not the disk.
if wants sql; then
  pg_bin="$(pg_config --bindir 2>/dev/null || true)"
  if [ ! -x "$pg_bin/initdb" ] || [ ! -x "$pg_bin/postgres" ]; then
    pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  fi
  if [ -n "$pg_bin" ] && [ -x "$pg_bin/initdb" ] && [ -x "$pg_bin/postgres" ]; then
    pg_port="$(free_port)"
    mkdir -p "$run_dir/postgres"
    as_pg=()
    if [ "$(id -u)" = 0 ]; then
      chown -R postgres:postgres "$run_dir/postgres"
      as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups)
    fi
    "${as_pg[@]}" "$pg_bin/initdb" -D "$run_dir/postgres/data" -U postgres --auth=trust \
      -E UTF8 --no-sync >"$run_dir/postgres/initdb.log" 2>&1
    setsid "${as_pg[@]}" "$pg_bin/postgres" -D "$run_dir/postgres/data" -p "$pg_port" \
      -k "$run_dir/postgres" -c listen_addresses=127.0.0.1 -c fsync=off \
      >"$run_dir/postgres/postgres.log" 2>&1 &
    pg_pid=$!
    pids+=("$pg_pid")
    for _ in $(seq 300); do
      "$pg_bin/pg_isready" -h 127.0.0.1 -p "$pg_port" -U postgres >/dev/null 2>&1 && break
      sleep 0.1
    done
    pg_url="postgres://postgres@127.0.0.1:$pg_port"
  else
    echo "bench-compare: no PostgreSQL server binaries (initdb, postgres); skipping the sql benchmark" >&2
    only="${only//sql/}"
  fi
fi

# CPU seconds (user + system, children included) of a process group, from
# /proc: the emulator's own CPU, counted apart from the dispatcher's.
group_cpu() {
  local pgid="$1" total=0 p
  for p in $(pgrep -g "$pgid" 2>/dev/null); do
    total=$(awk -v t="$total" '{ sub(/^.*\) /, ""); print t + $12 + $13 }' "/proc/$p/stat" 2>/dev/null || echo "$total")
  done
  echo "$total"
}

# CPU seconds of the PostgreSQL server: its live processes, and the
# backends that have exited (a drain's connections), which the postmaster
# reaped into its children's time.
pg_cpu() {
  local reaped
  reaped=$(awk '{ sub(/^.*\) /, ""); print $14 + $15 }' "/proc/$pg_pid/stat")
  echo $(($(group_cpu "$pg_pid") + reaped))
}

# --- runs --------------------------------------------------------------------

# One run of benchmark $1 on side $2 (binary dir $3), pair $4; its output
# goes to $run_dir/<bench>-<side>-<pair>.log ("n/a" when the side lacks it).
run_one() {
  local bench="$1" side="$2" bin="$3" pair="$4" log="$run_dir/$1-$2-$4.log"
  redis-cli -p "$redis_port" flushall >/dev/null
  case "$bench" in
    redis)
      local through=()
      [ "$side" = b ] && through=("${sentinel_flags[@]}")
      "$bin/sluicegate" bench drain "${through[@]}" --messages "$messages" --max-sys "$window" >"$log" 2>"$log.err" || echo "n/a" >>"$log" ;;
    memory)
      if "$bin/sluicegate" bench drain-memory --help >/dev/null 2>&1; then
        "$bin/sluicegate" bench drain-memory --messages "$messages" --max-sys "$window" >"$log" 2>"$log.err" || echo "n/a" >>"$log"
      else
        "$bin/drain_memory" "$messages" "$window" >"$log" 2>"$log.err" || echo "n/a" >>"$log"
      fi ;;
    hold)
      if "$bin/sluicegate" bench hold --help >/dev/null 2>&1; then
        "$bin/sluicegate" bench hold --requests "$hold_requests" --delay "$hold_delay" >"$log" 2>"$log.err" || echo "n/a" >>"$log"
      else
        echo "n/a" >"$log"
      fi ;;
    pubsub)
      if "$bin/sluicegate" bench drain-pubsub --help >/dev/null 2>&1; then
        local before after
        before="$(group_cpu "$emulator_pid")"
        "$bin/sluicegate" bench drain-pubsub --messages "$pubsub_messages" --max-sys "$window" >"$log" 2>"$log.err" || echo "n/a" >>"$log"
        after="$(group_cpu "$emulator_pid")"
        # USER_HZ ticks -> seconds per 1000 messages.
        awk -v b="$before" -v a="$after" -v n="$pubsub_messages" \
          'BEGIN { printf "  emulator CPU: %.3fs per 1000 messages\n", (a - b) / 100 / n * 1000 }' >>"$log"
      else
        echo "n/a" >"$log"
      fi ;;
    sql)
      if "$bin/sluicegate" bench drain-sql --help >/dev/null 2>&1; then
        # A fresh database each run: both sides' schemas share the server,
        # and a run on tables (and indexes) the other side created, or
        # on the dead rows of the run before, measures neither build.
        local db="drain_${side}_${pair}" before after
        psql -q "$pg_url/postgres" -c "CREATE DATABASE $db" >/dev/null
        before="$(pg_cpu)"
        "$bin/sluicegate" bench drain-sql --sql-url "$pg_url/$db" --messages "$sql_messages" --max-sys "$window" >"$log" 2>"$log.err" || echo "n/a" >>"$log"
        after="$(pg_cpu)"
        psql -q "$pg_url/postgres" -c "DROP DATABASE $db" >/dev/null
        awk -v b="$before" -v a="$after" -v n="$sql_messages" \
          'BEGIN { printf "  PostgreSQL CPU: %.3fs per 1000 messages\n", (a - b) / 100 / n * 1000 }' >>"$log"
      else
        echo "n/a" >"$log"
      fi ;;
  esac
  echo "  $bench $side #$pair: $(grep -E 'messages/s|msg/s|RSS with all' "$log" | head -1 | sed 's/^ *//')" >&2
}

yardstick_run() {
  local log="$run_dir/yardstick-$1.log"
  {
    redis-benchmark -p "$redis_port" -q -n "$yardstick_requests" -t lpush,zadd
    redis-benchmark -p "$redis_port" -q -n "$((yardstick_requests * 4))" -P 16 -t lpush,zadd
  } 2>/dev/null | tr '\r' '\n' | grep 'requests per second' >"$log" || true
  redis-cli -p "$redis_port" flushall >/dev/null
}

for bench in redis memory hold pubsub sql; do
  wants "$bench" || continue
  echo "benchmark $bench: $pairs pairs, A B then B A, alternately" >&2
  for pair in $(seq "$pairs"); do
    # Odd pairs run A first, even pairs B first. Drains slow down over a
    # run (on 2026-11-28, 26 000 to 18 000 messages/s over ten Redis
    # drains of one binary); with A always first, B paid for that drift:
    # the same two builds read 0.91 in A B order and 1.02 swapped.
    if [ $((pair % 2)) = 1 ]; then
      run_one "$bench" a "$bin_a" "$pair"
      run_one "$bench" b "$bin_b" "$pair"
    else
      run_one "$bench" b "$bin_b" "$pair"
      run_one "$bench" a "$bin_a" "$pair"
    fi
    if [ "$yardstick" = 1 ]; then yardstick_run "$bench-$pair"; fi
  done
done

# --- summary -----------------------------------------------------------------

python3 - "$run_dir" "$(cat "$run_dir/label-a")" "$(cat "$run_dir/label-b")" "$pairs" <<'PY'
import glob, os, re, statistics, sys

run_dir, label_a, label_b, pairs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

# (benchmark, figure, regex on its output); the first group is the number.
FIGURES = [
    ("redis", "messages/s", r"drained in [0-9.]+s: ([0-9.]+) messages/s"),
    ("redis", "CPU s/1000", r"CPU: ([0-9.]+)s per 1000"),
    ("redis", "peak RSS MiB", r"peak RSS: ([0-9.]+) MiB"),
    ("redis", "redis-server CPU s/1000", r"redis-server used ([0-9.]+) CPU s per 1000"),
    # `bench drain-memory`, or the drain_memory example of older revisions.
    ("memory", "messages/s", r"(?:: ([0-9.]+) msg/s|drained in [0-9.]+s: ([0-9.]+) messages/s)"),
    ("memory", "CPU s/1000", r"(?:([0-9.]+) CPU s per 1000|CPU: ([0-9.]+)s per 1000)"),
    ("memory", "peak RSS MiB", r"peak RSS:? ([0-9.]+) MiB"),
    ("hold", "RSS all held MiB", r"RSS with all [0-9]+ held: ([0-9.]+) MiB"),
    ("hold", "peak RSS MiB", r"dispatcher peak RSS: ([0-9.]+) MiB"),
    ("hold", "CPU s/1000", r"([0-9.]+)s per 1000 requests"),
    ("pubsub", "messages/s", r"drained in [0-9.]+s: ([0-9.]+) messages/s"),
    ("pubsub", "CPU s/1000", r"  CPU: ([0-9.]+)s per 1000"),
    ("pubsub", "emulator CPU s/1000", r"emulator CPU: ([0-9.]+)s per 1000"),
    ("pubsub", "peak RSS MiB", r"peak RSS: ([0-9.]+) MiB"),
    ("sql", "messages/s", r"drained in [0-9.]+s: ([0-9.]+) messages/s"),
    ("sql", "CPU s/1000", r"  CPU: ([0-9.]+)s per 1000"),
    ("sql", "peak RSS MiB", r"peak RSS: ([0-9.]+) MiB"),
    ("sql", "PostgreSQL CPU s/1000", r"PostgreSQL CPU: ([0-9.]+)s per 1000"),
]

def values(bench, side, pattern):
    out = []
    for pair in range(1, pairs + 1):
        path = os.path.join(run_dir, f"{bench}-{side}-{pair}.log")
        if not os.path.exists(path):
            continue
        m = re.search(pattern, open(path).read())
        if m:
            out.append(float(next(g for g in m.groups() if g is not None)))
    return out

def fmt(xs):
    if not xs:
        return "n/a"
    med = statistics.median(xs)
    return f"{med:.3f}" if med < 10 else f"{med:.1f}"

medians = {}
print(f"\nA = {label_a}, B = {label_b}; {pairs} pairs, run A B, B A, A B ...; logs in {run_dir}\n")
print(f"| benchmark | figure | A median | B median | B/A | A runs | B runs |")
print(f"|---|---|---|---|---|---|---|")
for bench, figure, pattern in FIGURES:
    a, b = values(bench, "a", pattern), values(bench, "b", pattern)
    if not a and not b:
        continue
    medians[(bench, figure, "a")] = statistics.median(a) if a else None
    medians[(bench, figure, "b")] = statistics.median(b) if b else None
    ratio = f"{statistics.median(b) / statistics.median(a):.2f}" if a and b and statistics.median(a) else "n/a"
    runs = lambda xs: ", ".join(f"{x:g}" for x in xs) or "n/a"
    print(f"| {bench} | {figure} | {fmt(a)} | {fmt(b)} | {ratio} | {runs(a)} | {runs(b)} |")

print("\nWithin each build, same minutes:")
for side, label in (("a", label_a), ("b", label_b)):
    r = medians.get(("redis", "messages/s", side))
    m = medians.get(("memory", "messages/s", side))
    p = medians.get(("pubsub", "messages/s", side))
    q = medians.get(("sql", "messages/s", side))
    parts = []
    if r and m:
        parts.append(f"Redis drain / in-memory drain = {r / m:.2f}")
    if r and p:
        parts.append(f"Pub/Sub drain / Redis drain = {p / r:.3f}")
    if r and q:
        parts.append(f"SQL drain / Redis drain = {q / r:.3f}")
    if parts:
        print(f"  {side.upper()} ({label}): " + "; ".join(parts))

yard = {}
for path in sorted(glob.glob(os.path.join(run_dir, "yardstick-*.log"))):
    lines = open(path).read().splitlines()
    # First LPUSH/ZADD pair unpipelined, the second pair with -P 16.
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\w+): ([0-9.]+) requests per second", line)
        if m:
            key = f"{m.group(1)}{'' if i < 2 else ' -P 16'}"
            yard.setdefault(key, []).append(float(m.group(2)))
if yard:
    print("\nYardstick (redis-benchmark on the same Redis, between the runs):")
    for key, xs in yard.items():
        print(f"  {key}: median {statistics.median(xs):.0f} requests/s (min {min(xs):.0f}, max {max(xs):.0f})")
PY
