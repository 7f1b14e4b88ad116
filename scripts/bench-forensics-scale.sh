#!/usr/bin/env bash
# Forensics at scale (BENCHMARKS.md, "Forensics at scale"): a synthetic log of N events
# (`custody audit synth`, default 10^8), the exposure query's wall time and peak RSS
# (`custody forensics exposure`, release build), its answer checked against the injected ground
# truth, then DuckDB running the same SQL over the same sealed files (scripts/duckdb-exposure.py).
#
#   scripts/bench-forensics-scale.sh [ROOT] [EVENTS] [FAULT_RATE] [CACHE_HIT_RATE]
#     ROOT default /tmp/custody-synth-1e8; FAULT_RATE (default 0): the fraction of requests with
#     the incident's faults (`audit synth --fault-rate`), for the query's cost in an incident;
#     CACHE_HIT_RATE (default 0): the fraction of requests that start from a cached prefix
#     (`audit synth --cache-hit-rate`: prefix-cache shares, hits and evictions in the log)
#
# Needs `cargo build --release -p custody` (~25 min on 2 cores), GNU time, and PyPI duckdb for the
# comparison (skipped with a note if absent). Not run in CI: ~4 minutes and ~250 MB per 10^8 events.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-/tmp/custody-synth-1e8}"
events="${2:-100000000}"
fault_rate="${3:-0}"
cache_hit_rate="${4:-0}"
bin=./target/release/custody
[ -x "$bin" ] || { echo "build first: cargo build --release -p custody" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs GNU time (apt-get install time)" >&2; exit 2; }

if [ ! -f "$root/synth-truth.json" ]; then
  echo "# generating $events events into $root (fault rate $fault_rate, cache hit rate $cache_hit_rate)"
  /usr/bin/time -f "synth: %e s wall" "$bin" audit synth --out "$root" --events "$events" \
    --fault-rate "$fault_rate" --cache-hit-rate "$cache_hit_rate"
fi
echo "# custody forensics exposure (nproc=$(nproc))"
out="$(mktemp)"
/usr/bin/time -f "custody: %e s wall, %U s user, %S s sys, %M KB peak RSS" \
  "$bin" forensics exposure "$root" --public-key "$root/synth-key.pub" --format csv >"$out"
grep -A7 '^# summary' "$out"
python3 scripts/check-exposure-truth.py "$root/synth-truth.json" "$out"
if python3 -c 'import duckdb' 2>/dev/null; then
  echo "# DuckDB, same SQL, same files"
  /usr/bin/time -f "duckdb: %e s wall, %U s user, %S s sys, %M KB peak RSS" \
    python3 scripts/duckdb-exposure.py "$root" | grep -A3 '^# summary'
else
  echo "# DuckDB comparison skipped: pip install duckdb"
fi
rm -f "$out"
