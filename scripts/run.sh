#!/usr/bin/env bash
# The main job: a chat generation with the embedded model on CPU. Extra arguments are passed to
# `custody generate` (e.g. --prompt "..." --max-tokens 64 --temperature 0.7 --seed 1).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Without the `forensics` feature: DataFusion would add ~25 min to this release build on 2 cores
# (`cargo build --release -p custody` builds the full binary with `query` and `forensics`).
cargo build --quiet --release -p custody --no-default-features
case " $* " in *" --prompt "*) ;; *) set -- --prompt "What is the capital of France? Answer in one sentence." "$@" ;; esac
exec "${CARGO_TARGET_DIR:-target}/release/custody" generate --config configs/single-node.toml --chat "$@"
