#!/usr/bin/env bash
# The effect of each CPU speed change, one run: `custody bench` (512 prompt ids, 128 greedy steps,
# median of 3) for each given binary at 1 and 2 threads, alternating binaries, ROUNDS rounds; and
# decode after a 2,048-token prompt at 1 thread. Binaries are release builds of the commits being
# compared (build each in its own worktree: `git worktree add /tmp/w REV && cd /tmp/w &&
# cargo build --release -p custody`). Prints one line per (round, binary, threads).
#   scripts/bench-cpu-steps.sh ROUNDS NAME=BINARY [NAME=BINARY ...]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=$1; shift
P=tests/fixtures/llamacpp-smollm2/bench_prompt.json
field() { python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(f\"prefill {d['prefill_tok_s']:.1f} decode {d['decode_tok_s']:.1f}\")"; }
for r in $(seq "$rounds"); do
  for nb in "$@"; do
    name=${nb%%=*}; bin=${nb#*=}
    for t in 1 2; do
      echo "round $r $name threads $t short: $("$bin" bench --threads $t --prompt-tokens 512 --gen-tokens 128 --reps 3 --prompt-ids $P --json 2>/dev/null | field)"
    done
    echo "round $r $name threads 1 long: $("$bin" bench --threads 1 --prompt-tokens 2048 --gen-tokens 64 --reps 1 --prompt-ids $P --json 2>/dev/null | field)"
  done
done
