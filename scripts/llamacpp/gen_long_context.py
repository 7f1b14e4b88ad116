#!/usr/bin/env python3
"""Long-context fixtures: two tiny models with a 40,960-token context and llama.cpp's logits at
the end of a 32,800-token prompt (issue 38: "a long-context e2e test on a small shape (>= 32k
tokens) that checks the last position's logits against llama.cpp's").

Run on demand, never in CI (llama-cpp-python 0.3.36 and the PyPI `gguf` package; ~1 min):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_long_context.py

The models are the mini F32 siblings of `gen_arch_fixtures.py` (same writer, vocabulary, seeds
and kinds of tensors) with only the context length raised to 40,960:
  llama3-long  arch llama, 4 heads / 1 kv head x 16, Llama 3 RoPE frequency factors, base 5e5,
               tied output (GQA 4:1, normal-style RoPE pairs)
  qwen2-long   arch qwen2, 4 heads / 2 kv heads x 16, Q/K/V biases, NeoX RoPE, base 1e6
Every matrix is F32, so llama.cpp multiplies in F32 with no activation quantization: what can
differ at depth is the attention (32,800 positions of the default F16 KV cache, scores and
softmax over up to 32,800 slots) and RoPE at positions near 2^15 — exactly what a long context
adds over the short fixtures.

The prompt: BOS, then ids drawn uniformly (numpy default_rng(38), fixed) from the vocabulary's
ordinary tokens (controls and byte tokens excluded), committed as `<model>.ids.npy` (int32) so
the test does not depend on this generator. llama.cpp evaluates it in ubatches of 512 with flash
attention off (the default F16 KV cache), and the logits of the last LAST positions are kept:

  tests/fixtures/long/<model>.F32.gguf   the model (~450 KB)
  tests/fixtures/long/<model>.ids.npy    the prompt, int32 [N_PROMPT]
  tests/fixtures/long/<model>.npy        llama.cpp's logits, float32 [LAST, vocab]
  tests/fixtures/long/<model>.json       sha256 of the model, n_ctx, n_prompt, n_batch, flash_attn,
                                         llama.cpp's argmax and top-1 - top-2 margin per kept position
"""
import hashlib, json, sys, time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_arch_fixtures as arch  # noqa: E402  (the same model writer and vocabularies)
import llama_cpp  # noqa: E402
from llama_cpp import Llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/long"
GENERATOR = "scripts/llamacpp/gen_long_context.py"
N_CTX = 40960
N_PROMPT = 32800
LAST = 16
N_BATCH = 512
MODELS = ["llama3", "qwen2"]


def prompt_ids(llm):
    """BOS + N_PROMPT - 1 ordinary tokens (no control, byte or unknown pieces)."""
    n_vocab = llm.n_vocab()
    ordinary = [t for t in range(n_vocab)
                if llama_cpp.llama_token_get_attr(llm._model.vocab, t) == llama_cpp.LLAMA_TOKEN_ATTR_NORMAL
                and not llm.detokenize([t]).startswith(b"<")]
    rng = np.random.default_rng(38)
    body = rng.choice(np.array(ordinary, dtype=np.int32), size=N_PROMPT - 1)
    return np.concatenate([[llm.token_bos()], body]).astype(np.int32)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    arch.N_CTX = N_CTX  # the only change from the arch minis
    for name in MODELS:
        cfg = arch.MODELS[name]
        path = OUT / f"{name}-long.F32.gguf"
        arch.write_base(name, cfg, path, mini=True)
        llm = Llama(str(path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2,
                    logits_all=True, flash_attn=False, verbose=False)
        ids = prompt_ids(llm)
        t0 = time.time()
        llm.eval(ids.tolist())
        secs = time.time() - t0
        logits = np.array(llm.scores[N_PROMPT - LAST: N_PROMPT], dtype=np.float32)
        top2 = np.sort(logits, axis=1)[:, -2:]
        np.save(OUT / f"{name}-long.ids.npy", ids)
        np.save(OUT / f"{name}-long.npy", logits)
        meta = {
            "generator": GENERATOR,
            "llama_cpp_python": llama_cpp.__version__,
            "file": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "n_ctx": N_CTX,
            "n_prompt": N_PROMPT,
            "n_batch": N_BATCH,
            "flash_attn": False,
            "first_position": N_PROMPT - LAST,
            "llamacpp_argmax": logits.argmax(axis=1).astype(int).tolist(),
            "margin": [round(float(m), 5) for m in top2[:, 1] - top2[:, 0]],
            "llamacpp_eval_s": round(secs, 2),
        }
        arch.dump(OUT / f"{name}-long.json", meta)
        print(f"{name}-long: {path.stat().st_size} bytes, {N_PROMPT} ids, eval {secs:.1f} s")
        del llm


if __name__ == "__main__":
    main()
