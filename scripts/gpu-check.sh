#!/usr/bin/env bash
# The CUDA backend's first run on a GPU: the one script the GPU verification runs on a lent
# machine (one H200, CUDA 13 / driver 580, no Rust toolchain, no network, 64 MiB carried,
# 10 minutes per command). Everything it needs is carried: a stripped release `custody` built
# here with `--features cuda` and without DataFusion (`--build`); the models are synthetic and
# built by the binary itself. NVRTC and cuBLASLt are found on the machine: /usr/local/cuda, else
# the NVIDIA wheels PyTorch installs (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib, nvidia/cublas/lib).
#
# Usage:
#   scripts/gpu-check.sh --build     # here: build target/gpu-check/custody (release, stripped)
#   scripts/gpu-check.sh [BINARY]    # there: run every stage; default target/gpu-check/custody
#
# Each stage runs under `timeout`, its output tee'd to $OUT/<stage>.log ($OUT: the device tool's
# folder, else a fresh temporary one); the summary table is printed last; exit 1 if any stage
# failed. Without an NVIDIA driver (libcuda.so.1) it says so and fails at once, cleanly.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--build" ]; then
  set -e
  cargo build --release -p custody --no-default-features --features cuda
  mkdir -p target/gpu-check
  strip -o target/gpu-check/custody target/release/custody
  ls -l target/gpu-check/custody
  exit 0
fi

bin="${1:-target/gpu-check/custody}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
STAGE_TIMEOUT_S="${STAGE_TIMEOUT_S:-240}"
names=()
codes=()
secs=()

record() { # name rc seconds
  names+=("$1")
  codes+=("$2")
  secs+=("$3")
}

summary() {
  {
    echo
    echo "gpu-check summary ($(date -u +%FT%TZ), logs in $OUT)"
    printf '%-12s %-6s %8s\n' stage result seconds
    for i in "${!names[@]}"; do
      if [ "${codes[$i]}" = 0 ]; then r=PASS; elif [ "${codes[$i]}" = 124 ]; then r=TIMEOUT; else r=FAIL; fi
      printf '%-12s %-6s %8s\n' "${names[$i]}" "$r" "${secs[$i]}"
    done
  } | tee -a "$OUT/summary.txt"
}

stage() { # name command...
  local name=$1
  shift
  local t0=$SECONDS
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$STAGE_TIMEOUT_S" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  record "$name" "$rc" "$((SECONDS - t0))"
  return "$rc"
}

# --- environment: the driver first (nothing else can run without it).
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && [ ! -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ]; then
  echo "gpu-check: no NVIDIA driver on this machine (libcuda.so.1 not found): nothing to check here" | tee "$OUT/environment.log"
  record environment 1 0
  summary
  exit 1
fi
stage environment sh -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true; uname -r'

# --- NVRTC and cuBLASLt: cudarc loads libnvrtc.so.13 and libcublasLt.so.13 by name, so their
# folders go on the loader path. find_lib FILE WHEEL: the folder holding FILE, from
# /usr/local/cuda, else PyTorch's NVIDIA wheels (nvidia/cu13/lib, or the library's own wheel).
find_lib() {
  local file=$1 wheel=$2
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/$file" ] && echo "$d" && return
  done
  python3 - "$file" "$wheel" <<'EOF' 2>/dev/null
import glob, os, site, sys
file, wheels = sys.argv[1], ["cu13", sys.argv[2]]
for root in site.getsitepackages() + [site.getusersitepackages()]:
    for w in wheels:
        hits = glob.glob(os.path.join(root, "nvidia", w, "lib", file))
        if hits:
            print(os.path.dirname(hits[0]))
            raise SystemExit
EOF
}
for lib in nvrtc:libnvrtc.so.13:cuda_nvrtc cublaslt:libcublasLt.so.13:cublas; do
  IFS=: read -r name file wheel <<<"$lib"
  dir=$(find_lib "$file" "$wheel")
  if [ -z "$dir" ]; then
    echo "gpu-check: $file not found in /usr/local/cuda nor in PyTorch's NVIDIA wheels" | tee "$OUT/$name.log"
    record "$name" 1 0
    summary
    exit 1
  fi
  echo "$file: $dir" | tee "$OUT/$name.log"
  record "$name" 0 0
  export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

if [ ! -x "$bin" ]; then
  echo "gpu-check: no binary at $bin (build it with scripts/gpu-check.sh --build and carry it)" | tee "$OUT/binary.log"
  record binary 1 0
  summary
  exit 1
fi

failed=0
stage device "$bin" gpu-check device || failed=1
if [ "$failed" = 0 ]; then
  stage forward "$bin" gpu-check forward || failed=1
  stage cache "$bin" gpu-check cache || failed=1
  # Both shapes' decode at batch 1/8/64 and prefill, the check in and out: 5 minutes at most.
  STAGE_TIMEOUT_S="${SPEED_TIMEOUT_S:-300}" stage speed "$bin" gpu-check speed || failed=1
fi
summary
exit "$failed"
