#!/usr/bin/env bash
# All tests: formatting, lints, and the whole workspace's tests on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace
