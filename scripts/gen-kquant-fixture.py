#!/usr/bin/env python3
"""Fixture for the new GGUF block formats (kernels/src/kquant.rs): random blocks of each type,
and their dequantization by an independent reader, the PyPI `gguf` package's reference
dequantizers (`gguf.quants.dequantize`, numpy). Run on demand; the outputs are committed:

    python3 -m pip install --target /tmp/ggufpy gguf==0.17.1 numpy
    PYTHONPATH=/tmp/ggufpy python3 scripts/gen-kquant-fixture.py

Writes tests/fixtures/kquant/<TYPE>.blocks (raw GGUF bytes) and <TYPE>.f32 (little-endian f32,
what gguf-py dequantizes them to). Scale fields are set to random finite f16 values (both signs,
normal and subnormal magnitudes), everything else is random bytes.
"""
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parents[1] / "tests/fixtures/kquant"
# type: (block bytes, elements per block, byte offsets of f16 scale fields)
TYPES = {
    T.Q5_0: (22, 32, [0]),
    T.Q5_1: (24, 32, [0, 2]),
    T.Q4_K: (144, 256, [0, 2]),
    T.Q5_K: (176, 256, [0, 2]),
    T.Q6_K: (210, 256, [208]),
    T.BF16: (2, 1, []),
    # Appended after BF16: the types draw from one random stream in this order, so new types go
    # last and the files of the earlier ones stay byte-identical.
    T.Q2_K: (84, 256, [80, 82]),  # scales[16] qs[64] d dmin
    T.Q3_K: (110, 256, [108]),  # hmask[32] qs[64] scales[12] d
}
N_BLOCKS = {T.BF16: 512}


def main():
    rng = np.random.default_rng(20261202)
    OUT.mkdir(parents=True, exist_ok=True)
    for ty, (bb, elems, scales) in TYPES.items():
        n = N_BLOCKS.get(ty, 8)
        raw = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
        for off in scales:
            mag = rng.choice([1e-2, 1e-3, 3e-6], size=n) * rng.uniform(0.5, 2.0, size=n)
            sign = rng.choice([-1.0, 1.0], size=n)
            raw[:, off:off + 2] = (mag * sign).astype(np.float16).view(np.uint8).reshape(n, 2)
        if ty == T.BF16:
            # finite values only (exponent byte not all ones)
            hi = raw[:, 1]
            raw[:, 1] = np.where((hi & 0x7F) == 0x7F, hi & 0xBF, hi)
        vals = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
        assert vals.size == n * elems and np.isfinite(vals).all()
        (OUT / f"{ty.name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{ty.name}.f32").write_bytes(vals.astype("<f4").tobytes())
        print(ty.name, n, "blocks")


if __name__ == "__main__":
    main()
