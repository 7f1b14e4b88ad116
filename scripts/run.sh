#!/usr/bin/env bash
# The main job: `custody demo` — a prefill/decode pair on loopback with the embedded model (CPU)
# serves a multi-tenant workload with every protection on, then again with the incident's faults
# armed; prints both exposure summaries from the audit log alone and writes a compliance report
# per run (demo-out/). A few minutes; progress shown. Other arguments are passed to `custody`
# instead (e.g. `./scripts/run.sh generate --chat --prompt "Hi"`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The dev profile: the compute crates are optimised even there (Cargo.toml), and it shares the
# test suite's build; a release build with DataFusion (the forensics) takes ~25 min on 2 cores.
cargo build --quiet -p custody
if [ $# -eq 0 ]; then set -- demo; fi
exec "${CARGO_TARGET_DIR:-target}/debug/custody" "$@"
