#!/usr/bin/env bash
# Build and test cost of a revision against another, on this machine, one after the other (never
# two builds at once: they share the cores). For each revision, in a scratch worktree with its
# own empty target directory: a clean debug build of the workspace (all targets), then the
# README's test command (scripts/test.sh: fmt, clippy, every test) on that warm build.
# Usage: scripts/bench-build.sh BEFORE_REV AFTER_REV   (defaults: HEAD~1 HEAD)
#        BUILD_ONLY=1 scripts/bench-build.sh …          (the clean builds only: no test command)
set -euo pipefail
cd "$(dirname "$0")/.."
# Resolved here: inside the scratch worktree `HEAD` would name the worktree's own checkout.
before=$(git rev-parse --verify "${1:-HEAD~1}^{commit}")
after=$(git rev-parse --verify "${2:-HEAD}^{commit}")
wt=$(mktemp -d /tmp/custody-bench-build.XXXXXX)
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$wt" "$before" >/dev/null
# Wall seconds of a command, or FAILED (its output is dropped: rerun it by hand to see why).
secs() {
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >/dev/null 2>&1 || { echo FAILED; return; }
  t1=$(date +%s.%N)
  printf '%.0f' "$(echo "$t1 - $t0" | bc)"
}
echo "| revision | clean build (s) | scripts/test.sh (s) |"
echo "|---|---|---|"
for rev in "$before" "$after"; do
  git -C "$wt" checkout -q --detach "$rev"
  rm -rf "$wt/target"
  build=$(cd "$wt" && secs cargo build --workspace --all-targets -q)
  tests=skipped
  [ -n "${BUILD_ONLY:-}" ] || tests=$(cd "$wt" && secs ./scripts/test.sh)
  echo "| $(git rev-parse --short "$rev") | $build | $tests |"
done
