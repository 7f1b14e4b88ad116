#!/usr/bin/env python3
"""The CUDA kernels' compile tier: compile every kernels/cuda/*.cu with NVRTC for sm_90 to a
CUBIN (NVRTC runs ptxas itself, `--ptxas-options=-v`) and check ptxas's report against
kernels/cuda/budgets.json: no error, no register spills, registers and static shared memory within
each kernel's budget, every budgeted kernel present. No GPU needed: NVRTC and the headers come
from PyPI wheels (scripts/setup.sh installs them into the cache).

Usage: scripts/nvrtc-check.py [--cuda-dir DIR] [--json] [--unit FILE]   (exit 1 on any violation)

--unit FILE: instead of each .cu, compile FILE — the kernels as one translation unit, exactly as
`custody_cuda::CudaDevice` hands them to NVRTC at run time (`custody_cuda::module_source()`, no
include path, `--fmad=false`) — against the same budgets.
"""
import argparse
import ctypes
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels" / "cuda"


def default_cuda_dir():
    cache = os.environ.get("CUSTODY_CACHE_DIR") or os.path.join(os.environ.get("HOME", ""), ".cache/custody")
    return Path(cache) / "cuda-13.0"


def load_nvrtc(cuda_dir):
    lib = cuda_dir / "nvidia" / "cu13" / "lib"
    builtins = sorted(lib.glob("libnvrtc-builtins.so.13*"))
    nvrtc = lib / "libnvrtc.so.13"
    if not nvrtc.exists() or not builtins:
        sys.exit(f"nvrtc-check: NVRTC not found under {lib} (run scripts/setup.sh)")
    # libnvrtc.so.13 of 13.0.88 has no $ORIGIN rpath: load its builtins by absolute path first.
    ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(nvrtc))


def compile_one(nv, path, unit=False, defines=()):
    prog = ctypes.c_void_p()
    src = path.read_bytes()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src, path.name.encode(), 0, None, None)
    if rc != 0:
        return None, f"nvrtcCreateProgram failed ({rc})", 0
    opts = [b"-arch=sm_90", b"--ptxas-options=-v", b"-std=c++17", b"-default-device"]
    opts += [b"--fmad=false"] if unit else [b"-I" + str(KERNELS).encode()]
    opts += [d.encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    cubin = ctypes.c_size_t(0)
    if rc == 0:
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(cubin))
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log, cubin.value


def parse(log):
    """ptxas's report: per entry function, registers, shared memory, spills, stack."""
    kernels = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"Function properties for ([\w$]+)", line)
        if m:
            cur = kernels.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["shared_bytes"] = int(s.group(1)) if s else 0
    return kernels


# sm_90 (H100/H200) per-SM limits: what bounds how many blocks of a kernel run at once.
SM90_REGS = 65536
SM90_SHARED_BYTES = 233472  # 228 KiB per SM
SM90_SHARED_RESERVED_PER_BLOCK = 1024
SM90_MAX_THREADS = 2048
SM90_MAX_BLOCKS = 32
SM90_MAX_WARPS = 64


def occupancy(registers, shared_bytes, threads):
    """Resident warps / the SM's 64, as the CUDA occupancy calculator computes it for sm_90:
    registers allocated per warp in units of 256, shared memory plus 1 KiB reserved per block."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = SM90_REGS // (regs_per_warp * warps)
    by_shared = SM90_SHARED_BYTES // (shared_bytes + SM90_SHARED_RESERVED_PER_BLOCK)
    by_threads = SM90_MAX_THREADS // threads
    blocks = min(by_regs, by_shared, by_threads, SM90_MAX_BLOCKS)
    return blocks * warps / SM90_MAX_WARPS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda-dir", type=Path, default=default_cuda_dir())
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--unit", type=Path)
    a = ap.parse_args()
    nv = load_nvrtc(a.cuda_dir)
    major, minor = ctypes.c_int(), ctypes.c_int()
    nv.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    budgets = {k: v for k, v in json.loads((KERNELS / "budgets.json").read_text()).items() if not k.startswith("_")}
    report = {"nvrtc": f"{major.value}.{minor.value}", "arch": "sm_90", "kernels": {}, "errors": []}
    for cu in [a.unit] if a.unit else sorted(KERNELS.glob("*.cu")):
        rc, log, cubin = compile_one(nv, cu, unit=a.unit is not None)
        if rc != 0:
            report["errors"].append(f"{cu.name}: NVRTC error {rc}:\n{log}")
            continue
        if cubin == 0:
            report["errors"].append(f"{cu.name}: no CUBIN")
        for name, k in parse(log).items():
            if "registers" not in k:
                continue  # a device function's properties, not an entry
            k["file"] = cu.name
            k["cubin_bytes"] = cubin
            report["kernels"][name] = k
    if not a.unit:
        # The speed check's second module (the tag check compiled out) must compile too.
        bench = "-DCUSTODY_BENCH_NO_TAG_CHECK"
        rc, log, _ = compile_one(nv, KERNELS / "attention.cu", defines=[bench])
        if rc != 0:
            report["errors"].append(f"attention.cu with {bench}: NVRTC error {rc}:\n{log}")
    for name, b in budgets.items():
        k = report["kernels"].get(name)
        if k is None:
            report["errors"].append(f"{name}: budgeted but not compiled")
            continue
        if k.get("spill_stores", 0) or k.get("spill_loads", 0):
            report["errors"].append(f"{name}: register spills ({k['spill_stores']} B stores, {k['spill_loads']} B loads)")
        if k["registers"] > b["registers"]:
            report["errors"].append(f"{name}: {k['registers']} registers > budget {b['registers']}")
        if k["shared_bytes"] > b["shared_bytes"]:
            report["errors"].append(f"{name}: {k['shared_bytes']} B shared > budget {b['shared_bytes']}")
        k["threads"] = b["threads"]
        k["occupancy"] = occupancy(k["registers"], k["shared_bytes"], b["threads"])
        if k["occupancy"] < b["min_occupancy"]:
            report["errors"].append(
                f"{name}: occupancy {k['occupancy']:.3f} < budget {b['min_occupancy']} "
                f"({k['registers']} registers, {k['shared_bytes']} B shared, {b['threads']} threads)")
    for name in report["kernels"]:
        if name not in budgets:
            report["errors"].append(f"{name}: no budget in kernels/cuda/budgets.json")
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"NVRTC {report['nvrtc']}, {report['arch']}")
        print(f"{'kernel':36} {'regs':>5} {'smem B':>7} {'stack B':>8} {'spills':>7} {'occupancy':>9}")
        for name, k in sorted(report["kernels"].items()):
            occ = f"{100 * k['occupancy']:.1f} %" if "occupancy" in k else "-"
            print(f"{name:36} {k['registers']:>5} {k['shared_bytes']:>7} {k.get('stack_bytes', 0):>8} "
                  f"{k.get('spill_stores', 0) + k.get('spill_loads', 0):>7} {occ:>9}")
        for e in report["errors"]:
            print("ERROR", e)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
