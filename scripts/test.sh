#!/usr/bin/env bash
# All tests: formatting, lints, and the whole workspace's tests on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every test that finds its input missing appends a line to the skip log (custody_test_skip:
# `test<TAB>reason<TAB>required|optional`; a `required` one fails under CI=true). The summary
# is printed at the end of the run, passed or failed.
target="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target"
export CUSTODY_SKIP_LOG="$PWD/$target/test-skips.txt"
[[ $target = /* ]] && CUSTODY_SKIP_LOG="$target/test-skips.txt"
: >"$CUSTODY_SKIP_LOG"
skip_summary() {
  local n
  n=$(grep -c . "$CUSTODY_SKIP_LOG" 2>/dev/null || true)
  echo "== skipped tests: ${n:-0} (log: $CUSTODY_SKIP_LOG)"
  if [[ ${n:-0} -gt 0 ]]; then
    sort "$CUSTODY_SKIP_LOG" | uniq -c | while read -r count line; do
      IFS=$'\t' read -r test reason need <<<"$line"
      printf '  %s [%s on CI]%s: %s\n' "$test" "$need" "$([[ $count -gt 1 ]] && echo " ×$count")" "$reason"
    done
  fi
}
trap skip_summary EXIT
./scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
./scripts/check-boundaries.sh
# The binary with its default features (what run.sh builds), kept aside for the symbol test
# (e2e `symbols`): the workspace test build below unifies the test crate's `fault-injection`
# and `test-oracle` features into every binary it builds.
cargo build --quiet -p custody
mkdir -p "$target/default-features"
cp "$target/debug/custody" "$target/default-features/custody"
cargo test --workspace
# The independent Python verifier of proofs and receipts (no code shared with the Rust).
(cd verifier && python3 -m unittest discover -s tests)
# The `rdma` feature (real verbs through rdma-sys) must compile, lint clean, and report "no
# device" clearly on machines without RDMA (these): its bindgen needs libclang <= 15.
export LIBCLANG_PATH="${LIBCLANG_PATH:-/usr/lib/llvm-14/lib}"
cargo clippy -p custody-transport -p custody-runtime --features rdma --all-targets --quiet -- -D warnings
cargo test -p custody-transport --features rdma --lib verbs
# The `cuda` feature (cudarc, loaded at run time) must compile, lint clean, and on machines
# without a GPU (these) answer `engine.backend = "cuda"` with a typed error naming libcuda.
cargo clippy -p custody-cuda --features cuda --all-targets --quiet -- -D warnings
cargo test -p custody-cuda --features cuda --lib
# The forensics without the Ballista cluster (`--no-default-features --features forensics`).
cargo clippy -p custody --no-default-features --features forensics --all-targets --quiet -- -D warnings
# The GPU check's binary (scripts/gpu-check.sh --build: release, no DataFusion) must compile.
cargo clippy -p custody --no-default-features --features cuda --all-targets --quiet -- -D warnings
