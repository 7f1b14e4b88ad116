#!/usr/bin/env bash
# Serving benchmark, on demand (never in CI): the same bounded streaming load test
# (scripts/loadtest.py: several tenants, concurrent streams, the official openai client in a
# second process on loopback) against `custody serve` and against llama-cpp-python's
# OpenAI-compatible server on the same model, threads and machine, in the same run.
#
#   ./scripts/bench-serve.sh [--concurrency 6] [--requests 36] [--max-tokens 64]
#
# CUSTODY_BIN: the custody binary (default: target/release/custody, built if missing).
# LLAMA_PY: a Python with llama-cpp-python[server] (default: /opt/llamaref/venv/bin/python if it
# has llama_cpp, else a venv under ~/.cache/custody/llama-venv, where
# `pip install 'llama-cpp-python[server]==0.3.36'` compiles llama.cpp: ~10 min on 2 cores).
# LLAMA=0 skips the comparison. Prints one JSON line per server.
set -euo pipefail
# pip: no "running as root" or new-version warnings (this machine kind installs as root).
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
ARGS=("$@")
THREADS=${THREADS:-$(nproc)}
MODEL=$(./scripts/fetch-model.sh)
BIN=${CUSTODY_BIN:-target/release/custody}
if [[ ! -x $BIN ]]; then cargo build --release -p custody; fi
command -v python3 >/dev/null && python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai
work=$(mktemp -d); pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
wait_up() { for _ in $(seq 1200); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.5; done; echo "server at $1 did not come up" >&2; exit 1; }

# custody: demo tenants (published keys, loopback only), audit on, canary on (as deployed).
"$BIN" audit keygen --out "$work/node.key" >/dev/null
"$BIN" serve --config configs/serve-demo.toml --listen 127.0.0.1:18080 --metrics-listen 127.0.0.1:18081 --threads "$THREADS" \
  --audit-dir "$work/audit" --audit-key "$work/node.key" 2>"$work/custody.log" &
pids+=($!); cpid=$!
wait_up http://127.0.0.1:18080/health
python3 scripts/loadtest.py --url http://127.0.0.1:18080 --label "custody serve (audit on)" \
  --keys sk-demo-acme,sk-demo-globex,sk-demo-initech "${ARGS[@]}"
kill -TERM "$cpid"; wait "$cpid" || true
"$BIN" audit verify "$work/audit" --public-key "$work/node.key.pub" >/dev/null && echo '{"custody_audit_verify": "OK"}'

[[ ${LLAMA:-1} == 0 ]] && exit 0
PY=${LLAMA_PY:-}
if [[ -z $PY ]]; then
  if /opt/llamaref/venv/bin/python -c 'import llama_cpp' 2>/dev/null; then
    PY=/opt/llamaref/venv/bin/python
  else
    venv=${CUSTODY_CACHE_DIR:-$HOME/.cache/custody}/llama-venv
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    PY=$venv/bin/python
  fi
fi
"$PY" -c 'import llama_cpp.server.app' 2>/dev/null || "$PY" -m pip install --quiet 'llama-cpp-python[server]==0.3.36'
# Same context as serve-demo.toml; flash attention off (the arithmetic custody reproduces);
# --interrupt_requests false: by default a new request cuts the running stream off, which would
# count as throughput what is really lost work. It serves one request at a time (no batching).
"$PY" -m llama_cpp.server --model "$MODEL" --model_alias smollm2 --n_threads "$THREADS" \
  --n_threads_batch "$THREADS" --n_ctx 4096 --n_batch 512 --flash_attn false \
  --interrupt_requests false \
  --host 127.0.0.1 --port 18081 2>"$work/llama.log" &
pids+=($!)
wait_up http://127.0.0.1:18081/v1/models
python3 scripts/loadtest.py --url http://127.0.0.1:18081 --label "llama-cpp-python $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)') server" \
  --keys a,b,c "${ARGS[@]}"
