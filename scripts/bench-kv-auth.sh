#!/usr/bin/env bash
# The authenticated (and encrypted) KV transport against the transport before authentication,
# in one run: `custody bench-disagg` of this checkout and of BASE_REV (default 95580dc, the last
# commit before the pairing proof), alternating ROUNDS times on the same machine. Each run
# reports its transfer throughput vs memcpy and its TTFT vs colocated; this checkout's also the
# encrypted transfer and TTFT by security mode (plaintext control plane / mutual TLS / + KV TLS).
# Usage: scripts/bench-kv-auth.sh [BASE_REV] [ROUNDS] [REPS]   (output: target/bench-kv-auth.log;
# SKIP_BUILD=1 reuses target/custody-kv-auth-{base,new})
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-95580dc}"
rounds="${2:-3}"
reps="${3:-5}"
target="${CARGO_TARGET_DIR:-$PWD/target}"
log="$target/bench-kv-auth.log"
if [[ -z "${SKIP_BUILD:-}" ]]; then
cargo build --quiet --release -p custody --no-default-features
cp "$target/release/custody" "$target/custody-kv-auth-new"
wt="$target/kv-auth-base"
rm -rf "$wt" && git worktree prune
git worktree add -f --detach "$wt" "$base" >/dev/null
# Its own target directory: cargo's artifacts of workspace members do not depend on the
# checkout's path, so a shared one would mix the two revisions' build-script outputs.
(cd "$wt" && CARGO_TARGET_DIR="$target/kv-auth-base-target" cargo build --quiet --release -p custody --no-default-features)
cp "$target/kv-auth-base-target/release/custody" "$target/custody-kv-auth-base"
git worktree remove --force "$wt"
fi
: >"$log"
for i in $(seq "$rounds"); do
  for which in base new; do
    echo "## round $i: $which" | tee -a "$log"
    "$target/custody-kv-auth-$which" bench-disagg --reps "$reps" 2>/dev/null \
      | grep -E "^transfer|^transport_encryption|^prompt|^time to first token" | tee -a "$log"
  done
done
echo "log: $log"
