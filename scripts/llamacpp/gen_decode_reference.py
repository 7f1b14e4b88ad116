#!/usr/bin/env python3
"""llama.cpp's decode-path logits on the committed architecture fixtures, as SHA-256 per row.

Run on demand, never in CI (it needs llama-cpp-python, ~10 min to compile here):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_decode_reference.py

For every quantized file of tests/fixtures/arch/ (gen_arch_fixtures.py): the fixture's prompt
evaluated in one batch with only its last row's logits wanted (llama.cpp's default), then each
token of llama.cpp's own greedy continuation (the fixture's ids) evaluated alone — the path a
served request takes, one decode step per token (its GEMV / `vec_dot` K-quant kernels, its
single-token attention). Written to tests/fixtures/arch/decode.json: per file, the SHA-256 of
each row's logits (f32, little-endian) — the prompt's last row, then one per decoded token —
and their argmax. `e2e::arch_models` recomputes the rows and compares the hashes: bit for bit.
"""
import hashlib, json
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "tests/fixtures/arch"
# Every quantized fixture (the F32 ones differ from llama.cpp in the last bits: its own SIMD
# order over short rows, tests/tests/e2e/arch_models.rs).
NAMES = ["llama-spm.Q8_0", "llama3.Q6_K", "qwen2.Q5_0", "llama-spm.Q5_K_M", "llama-spm.Q4_K_M",
         "llama3.Q4_K_M", "qwen2.Q4_K_M", "qwen3.Q4_K_M", "llama-spm.Q3_K_M", "llama-spm.Q2_K"]


def last_logits(llm):
    n_vocab = llm.n_vocab()
    ptr = llm._ctx.get_logits()
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype("<f4").copy()


def main():
    out = {"generator": "scripts/llamacpp/gen_decode_reference.py",
           "llama_cpp_python": llama_cpp.__version__, "files": {}}
    for name in NAMES:
        meta = json.loads((ARCH / f"{name}.json").read_text())
        path = ARCH / f"{name}.gguf"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"], name
        llm = Llama(str(path), n_ctx=256, n_batch=256, n_threads=2, logits_all=False,
                    flash_attn=False, verbose=False)
        ids, n_prompt = meta["ids"], meta["n_prompt"]
        llm.eval(ids[:n_prompt])
        rows = [last_logits(llm)]
        for tok in ids[n_prompt:-1]:
            llm.eval([tok])
            rows.append(last_logits(llm))
        out["files"][name] = {
            "sha256": meta["sha256"],
            "n_prompt": n_prompt,
            "rows_sha256": [hashlib.sha256(r.tobytes()).hexdigest() for r in rows],
            "argmax": [int(r.argmax()) for r in rows],
        }
        # The continuation is llama.cpp's greedy choice at each of these rows.
        assert out["files"][name]["argmax"] == ids[n_prompt:], name
        print(f"{name}: {len(rows)} rows")
        del llm
    (ARCH / "decode.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
