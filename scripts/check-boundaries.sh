#!/usr/bin/env bash
# The crate boundaries ARCHITECTURE.md states, checked on the dependency graph (Cargo.lock, no
# network): exits 1 naming every violation.
# - custody-probe-abi has no dependencies at all;
# - custody-engine depends (transitively) on no tokio, tonic, hyper or axum: it knows no network;
# - custody-transport depends on no engine and no async runtime;
# - custody-router (the routing policy) depends on no async runtime, network or runtime crate;
# - DataFusion is a direct dependency of custody-query only, Ballista of custody-cluster only,
#   aya of custody-ebpf only, axum of custody-server only (tonic's server links axum internally, so the check is on direct
#   dependencies: no other crate of ours uses it);
# - the custody binary dispatches: it depends directly on no custody-kernels (it imports no
#   kernel type; the benchmarks that measure kernels live in custody-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
fail() { echo "boundary violated: $*" >&2; bad=1; }
tree() { cargo tree --offline -e normal --prefix none "$@" 2>/dev/null; }

n=$(tree -p custody-probe-abi | grep -vc '^custody-probe-abi ' || true)
[ "$n" -eq 0 ] || fail "custody-probe-abi has $n dependencies"
for crate in tokio tonic hyper axum; do
  if tree -p custody-engine | grep -q "^$crate "; then fail "custody-engine depends on $crate"; fi
done
for crate in tokio tonic custody-engine custody-disagg; do
  if tree -p custody-transport | grep -q "^$crate "; then fail "custody-transport depends on $crate"; fi
done
# The routing policy is pure: no async runtime, no network, none of the runtime's crates.
for crate in tokio tonic custody-engine custody-disagg custody-runtime custody-audit; do
  if tree -p custody-router | grep -q "^$crate "; then fail "custody-router depends on $crate"; fi
done
direct_users() { # the workspace crates that depend on $1 directly
  cargo tree --offline -e normal --prefix depth -i "$1" --workspace 2>/dev/null \
    | awk '/^1custody/ {sub(/^1/, ""); print $1}' | sort -u
}
check_only() { # $1 = dependency, $2 = the one crate allowed to use it directly
  local users
  users=$(direct_users "$1" | grep -v "^$2\$" || true)
  [ -z "$users" ] || fail "$1 used directly by: $(echo $users)"
}
check_only datafusion custody-query
for b in ballista-core ballista-scheduler ballista-executor; do check_only "$b" custody-cluster; done
check_only aya custody-ebpf
check_only axum custody-server
# The binary's direct dependencies (depth 1 under it).
if cargo tree --offline -e normal --prefix depth -p custody 2>/dev/null | grep -q '^1custody-kernels '; then
  fail "the custody binary depends directly on custody-kernels"
fi
if [ "$bad" -ne 0 ]; then exit 1; fi
echo "crate boundaries: OK"
