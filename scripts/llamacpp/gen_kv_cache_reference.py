#!/usr/bin/env python3
"""llama.cpp's q8_0 KV cache on the embedded model: the reference for `engine.kv_cache_type`.

Run on demand, never in CI (llama-cpp-python takes ~10 min to compile here):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_kv_cache_reference.py

The long-context sequence of tests/fixtures/llamacpp-smollm2/teacher_forced/long_context.json
(1,314 tokens) is evaluated teacher-forced three times by llama.cpp: its default (f16 cache,
flash attention off — what Custody's f16 cache follows), f16 with flash attention, and
`--cache-type-k q8_0 --cache-type-v q8_0` (which llama.cpp runs only with flash attention).
Written to tests/fixtures/kv-cache/:
  q8_0.npy    float32 [rows, vocab]: llama.cpp's q8_0-cache logits at the fixture's saved rows
  q8_0.json   the rows, and what the q8_0 cache costs llama.cpp itself over every position
              (against its f16 cache with flash attention, so that only the cache type
              differs): mean and max |dlogit|, top-1 agreement, mean KL(f16 || q8_0)
"""
import hashlib, json, os, sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "tests/fixtures/llamacpp-smollm2/teacher_forced/long_context.json"
OUT = ROOT / "tests/fixtures/kv-cache"
MODEL = os.environ.get("CUSTODY_MODEL", str(Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"))
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGML_TYPE_Q8_0 = 8


def logits(ids, **kw):
    llm = Llama(MODEL, n_ctx=2048, n_batch=512, n_threads=2, logits_all=True, verbose=False, **kw)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    del llm
    return out


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def compare(base, other):
    d = np.abs(base.astype(np.float64) - other)
    lp, lq = log_softmax(base), log_softmax(other)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    return {
        "mean_abs_dlogit": float(d.mean()),
        "max_abs_dlogit": float(d.max()),
        "top1_agreement": float((base.argmax(axis=1) == other.argmax(axis=1)).mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
    }


def main():
    digest = hashlib.sha256(Path(MODEL).read_bytes()).hexdigest()
    if digest != SHA256:
        sys.exit(f"model digest {digest} != {SHA256}")
    src = json.loads(SRC.read_text())
    ids, rows = src["ids"], src["saved_rows"]
    plain = logits(ids, flash_attn=False)
    fa16 = logits(ids, flash_attn=True)
    q8 = logits(ids, flash_attn=True, type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0)
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(OUT / "q8_0.npy", q8[rows])
    meta = {
        "generator": "scripts/llamacpp/gen_kv_cache_reference.py",
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "source": str(SRC.relative_to(ROOT)),
        "n_tokens": len(ids),
        "saved_rows": rows,
        "llamacpp_q8_0_vs_f16_flash_attn": compare(fa16, q8),
        "llamacpp_f16_flash_attn_vs_f16": compare(plain, fa16),
        "llamacpp_q8_0_vs_f16": compare(plain, q8),
    }
    (OUT / "q8_0.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
