#!/usr/bin/env python3
"""llama.cpp's own requantizations of the embedded model, and llama.cpp's logits on each.

Run on demand, never in CI (it needs llama-cpp-python, ~10 min to compile here):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_requant_reference.py [TYPE ...]

(no TYPE: every one below; e.g. `Q4_0` regenerates that file's fixture alone.)

1. Requantizes ~/.cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf with `llama_model_quantize`
   (`allow_requantize`) into the types people download — Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q5_0, Q5_1,
   Q4_0, BF16 (and the K mixes below) — under ~/.cache/custody/requant/ (100–270 MB each: too large to commit). SmolLM2's
   576-wide rows are not a whole number of 256-element K-quant blocks, so llama.cpp's "K" mixes
   fall back to Q5_0/Q5_1/Q8_0 for those matrices and use Q4_K/Q5_K/Q6_K where the row allows
   (ffn_down): each file is a mix, as real downloads are.
   Plus the embedded model with a Llama 3 style `rope_freqs.weight` added (ROPE_FREQS): RoPE
   frequency factors, checked the same way.
2. For each file: its SHA-256, and llama.cpp's teacher-forced evaluation (flash attention off)
   of one prompt plus llama.cpp's own greedy continuation: argmax at every position and the full
   logits of a few rows. Written to tests/fixtures/llamacpp-requant/<TYPE>.{json,npy}.

The e2e test `quant_types` compares custody on each file that is present (SHA-256 checked).
"""
import ctypes, hashlib, json, os, sys
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/llamacpp-requant"
CACHE = Path.home() / ".cache/custody"
SRC = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR = CACHE / "requant"
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32,
          "Q3_K_M": 12, "Q2_K": 10, "Q4_K_S": 14, "Q5_K_S": 16, "Q4_0": 2}
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern "
        "room he could see")
N_GEN = 24
SAVED_ROWS = 2


def requantize(name, ftype):
    dst = DIR / f"SmolLM2-135M-Instruct.{name}.gguf"
    if not dst.exists():
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = ftype, True, 2
        rc = llama_cpp.llama_model_quantize(str(SRC).encode(), str(dst).encode(), ctypes.byref(p))
        assert rc == 0, f"llama_model_quantize {name}: {rc}"
    return dst


def with_rope_freqs():
    """The embedded model plus a Llama 3 style `rope_freqs.weight` (one factor per rotated pair:
    1 for the 8 fastest pairs, rising to 8 for the slowest), everything else byte for byte."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    dst = DIR / "SmolLM2-135M-Instruct.rope_freqs.gguf"
    if dst.exists():
        return dst
    r = GGUFReader(SRC)
    w = GGUFWriter(str(dst), arch="llama")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    n_pairs = 32  # rope dims 64 / 2
    w.add_tensor("rope_freqs.weight", np.concatenate([np.ones(8), np.linspace(1.0, 8.0, n_pairs - 8)]).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main():
    DIR.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    files = {name: (lambda n=name, f=ftype: requantize(n, f)) for name, ftype in FTYPES.items()}
    files["ROPE_FREQS"] = with_rope_freqs
    only = sys.argv[1:]
    unknown = [n for n in only if n not in files]
    assert not unknown, f"unknown types {unknown}: want some of {sorted(files)}"
    for name, make in files.items():
        if only and name not in only:
            continue
        ftype = FTYPES.get(name, 0)
        path = make()
        llm = Llama(str(path), n_ctx=256, n_batch=256, n_threads=2, logits_all=True,
                    flash_attn=False, verbose=False)
        ids = llm.tokenize(TEXT.encode(), add_bos=False, special=True)
        gen = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            gen.append(int(tok))
            if len(gen) == N_GEN:
                break
        seq = list(ids) + gen
        llm.reset()
        llm.eval(seq)
        logits = np.array(llm.scores[: len(seq)], dtype=np.float32)
        rows = [len(ids) - 1, len(seq) - 2][:SAVED_ROWS]
        np.save(OUT / f"{name}.npy", logits[rows])
        meta = {
            "generator": "scripts/llamacpp/gen_requant_reference.py",
            "llama_cpp_python": llama_cpp.__version__,
            "file": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "ftype": ftype,
            "flash_attn": False,
            "ids": seq,
            "n_prompt": len(ids),
            "llamacpp_argmax": logits.argmax(axis=1).astype(int).tolist(),
            "saved_rows": rows,
        }
        (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name}: {meta['sha256'][:12]} {len(ids)}+{len(gen)} tokens")
        del llm


if __name__ == "__main__":
    main()
