#!/usr/bin/env bash
# Forensics on a Ballista cluster (BENCHMARKS.md, "Forensics on a cluster"): the exposure query
# on a synthetic log of N events (`custody audit synth`), in one run: the local session, then a
# fresh cluster of one scheduler and two executors (`custody cluster`, loopback, one vcore
# each) — wall time, peak RSS of every process (the client's from GNU time, each cluster
# process's VmHWM), both answers checked equal and against the injected truth. The cluster's
# plan (stages and their partitioning) is kept from the scheduler's log.
#
#   scripts/bench-cluster.sh [ROOT] [EVENTS] [VCORES]
#     ROOT default /tmp/custody-synth-1e7; EVENTS default 10^7 (the log is generated once);
#     VCORES per executor, default 1 (two executors on a 2-core machine).
#
# Needs `cargo build --release -p custody` and GNU time. Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-/tmp/custody-synth-1e7}"
events="${2:-10000000}"
vcores="${3:-1}"
bin=$PWD/target/release/custody
[ -x "$bin" ] || { echo "build first: cargo build --release -p custody" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs GNU time (apt-get install time)" >&2; exit 2; }
work="$(mktemp -d /tmp/custody-bench-cluster.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

if [ ! -f "$root/synth-truth.json" ]; then
  echo "# generating $events events into $root"
  "$bin" audit synth --out "$root" --events "$events" --fault-rate 0.001 --cache-hit-rate 0.3
fi
key="$root/synth-key.pub"

echo "# local session (nproc=$(nproc))"
/usr/bin/time -f "local: %e s wall, %M KB peak RSS" \
  "$bin" forensics exposure "$root" --public-key "$key" --format csv >"$work/local.csv"

echo "# cluster: 1 scheduler + 2 executors ($vcores vcore each), loopback"
"$bin" cluster scheduler --port 50050 >"$work/scheduler.log" 2>&1 & pids+=($!); sched=$!
sleep 1
"$bin" cluster executor --vcores "$vcores" --work-dir "$work" \
  >"$work/executor-1.log" 2>&1 & pids+=($!); ex1=$!
"$bin" cluster executor --vcores "$vcores" --work-dir "$work" \
  --port 50061 --grpc-port 50062 --health-port 50063 >"$work/executor-2.log" 2>&1 & pids+=($!); ex2=$!
for _ in $(seq 100); do
  curl -sf localhost:50053/readyz >/dev/null && curl -sf localhost:50063/readyz >/dev/null && break
  sleep 0.2
done
/usr/bin/time -f "cluster client: %e s wall, %M KB peak RSS" \
  "$bin" forensics exposure "$root" --public-key "$key" --format csv \
  --cluster df://127.0.0.1:50050 --scratch "$work/scratch" >"$work/cluster.csv"
for p in "scheduler $sched" "executor-1 $ex1" "executor-2 $ex2"; do
  set -- $p
  echo "$1: $(grep VmHWM /proc/$2/status | awk '{print $2, $3}') peak RSS"
done
if cmp -s "$work/local.csv" "$work/cluster.csv"; then
  echo "answers: EQUAL (local and cluster, byte for byte)"
else
  echo "answers: DIFFERENT"; diff "$work/local.csv" "$work/cluster.csv" | head; exit 1
fi
python3 scripts/check-exposure-truth.py "$root/synth-truth.json" "$work/cluster.csv"
echo "# jobs and stages (scheduler log: $work/scheduler.log)"
grep -E "planning took|Job .* (completed|success|finished)" "$work/scheduler.log" | head -20 || true
grep -cE "Execute task" "$work/executor-1.log" "$work/executor-2.log" | sed 's/^/tasks run: /'
