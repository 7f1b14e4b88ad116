#!/usr/bin/env python3
"""Generate llama.cpp reference fixtures for the embedded model (teacher-forced logits).

Run on demand, never in CI (llama-cpp-python takes ~10 min to compile here):

    python3 -m venv /opt/llamaref/venv && /opt/llamaref/venv/bin/pip install numpy llama-cpp-python==0.3.36
    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_reference.py

For each prompt: llama.cpp (flash attention off, its CPU default numerics) generates a greedy
continuation; then the whole sequence (prompt + continuation) is evaluated teacher-forced with
logits at every position. Written to tests/fixtures/llamacpp-smollm2/teacher_forced/:
  <name>.json  ids, n_prompt, llama.cpp's argmax at every position, the positions of saved rows
  <name>.npy   float32 [rows, vocab]: full logits at the saved positions
"""
import hashlib, json, os, sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/llamacpp-smollm2/teacher_forced"
MODEL = os.environ.get("CUSTODY_MODEL", str(Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"))
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SAVED_ROWS = 8

PARAGRAPHS = [
    "Custody is an inference runtime that keeps a record of every page of attention memory it "
    "hands out. When a request arrives, the scheduler checks that the whole prompt fits before it "
    "allocates anything, and each page it allocates carries a generation number and an owner.",
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern room "
    "he could see the fishing boats returning, their wakes drawing white lines across the grey "
    "water, and beyond them the dark shape of the island where his sister still lived.",
    "In 1869 the Suez Canal opened, shortening the sea route between Europe and Asia by thousands "
    "of kilometres. Ships no longer had to sail around the Cape of Good Hope, and trade between "
    "the Mediterranean and the Indian Ocean grew quickly in the decades that followed.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, "
    "water is split, oxygen is released, and carbon dioxide is fixed into sugars through the Calvin "
    "cycle, which runs on the ATP and NADPH produced by the light reactions.",
]


def chat(user):
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            "<|im_end|>\n<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n")


def prompts():
    long_doc = "\n\n".join(PARAGRAPHS * 4)
    return {
        "chat_explain_tcp": (chat("Explain in a few sentences how TCP retransmission works."), 96),
        "raw_story": ("The lighthouse keeper climbed the spiral stairs", 96),
        "raw_code": ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n", 96),
        "long_context": (long_doc + "\n\nSummary of the text above:", 64),
    }


def main():
    digest = hashlib.sha256(Path(MODEL).read_bytes()).hexdigest()
    if digest != SHA256:
        sys.exit(f"model digest {digest} != {SHA256}")
    OUT.mkdir(parents=True, exist_ok=True)
    llm = Llama(MODEL, n_ctx=4096, n_batch=512, n_threads=2, logits_all=True, flash_attn=False, verbose=False)
    vocab = llm.n_vocab()
    for name, (text, n_gen) in prompts().items():
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        gen = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            gen.append(int(tok))
            if len(gen) == n_gen:
                break
        seq = list(ids) + gen
        llm.reset()
        llm.eval(seq)
        logits = np.array(llm.scores[: len(seq)], dtype=np.float32)
        assert logits.shape == (len(seq), vocab)
        argmax = logits.argmax(axis=1).astype(int).tolist()
        # Saved full rows: spread over the continuation positions (where top-1 is compared).
        first = len(ids) - 1
        rows = sorted(set(int(x) for x in np.linspace(first, len(seq) - 2, SAVED_ROWS)))
        np.save(OUT / f"{name}.npy", logits[rows])
        meta = {
            "generator": "scripts/llamacpp/gen_reference.py",
            "llama_cpp_python": __import__("llama_cpp").__version__,
            "flash_attn": False,
            "text": text,
            "ids": seq,
            "n_prompt": len(ids),
            "llamacpp_argmax": argmax,
            "saved_rows": rows,
        }
        (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name}: {len(ids)} prompt + {len(gen)} generated tokens, rows {rows}")


if __name__ == "__main__":
    main()
