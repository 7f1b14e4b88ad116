#!/usr/bin/env python3
"""llama.cpp's tokenization of a corpus under each byte-level BPE pre-tokenizer custody reads.

Run on demand, never in CI (llama-cpp-python, ~10 min to compile here; the PyPI `gguf` package):

    /opt/llamaref/venv/bin/pip install gguf==0.17.1
    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_pretokenizer_reference.py

For each `tokenizer.ggml.pre` value, a vocabulary-only GGUF is written (the embedded model's
vocabulary and merges, its metadata with only `tokenizer.ggml.pre` changed, no tensors) and
llama.cpp tokenizes the corpus with it (`vocab_only`, no BOS, special tokens as text). The same
vocabulary under different pre-tokenizers splits text differently (digit runs, contractions,
whitespace before digits), which is what the fixture pins down. Written to
tests/fixtures/pretokenizer/<pre>.json; e2e `tokenizers` compares custody's ids.
"""
import json, tempfile
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/pretokenizer"
SRC = Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"
PRES = ["llama-bpe", "qwen2", "smollm"]
CORPUS = [
    "Hello world 12345 it's 3.14159 and 1,000,000.",
    "I'M here; you'RE there, they'VE gone, we'LL see, she'D know, don't.",
    "  leading spaces\n\nnew lines\t\ttabs   trailing   ",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(12))",
    "Ünïcödé naïve café — Straße, façade, jalapeño.",
    "東京は2024年に 1234567 人。 Привет, мир! مرحبا بالعالم",
    "emoji 🙂👍🏽 and symbols ©®™ ±×÷ ∑∫√ <<>> !!! ???",
    "MixedCASE camelCase snake_case kebab-case SHOUTING123abc",
    "\r\n windows\r\nline endings \r\n\r\n",
    "numbers: 0 00 000 0000 00000 9999999999",
]


def vocab_only(pre, path):
    r = GGUFReader(SRC)
    w = GGUFWriter(path, arch="llama")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = pre if name == "tokenizer.ggml.pre" else f.contents()
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(name, val, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, val, f.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRES:
            path = f"{tmp}/{pre}.gguf"
            vocab_only(pre, path)
            llm = Llama(path, vocab_only=True, verbose=False)
            ids = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in CORPUS]
            meta = {"generator": "scripts/llamacpp/gen_pretokenizer_reference.py",
                    "pre": pre, "texts": CORPUS, "ids": ids}
            (OUT / f"{pre}.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n")
            print(pre, sum(map(len, ids)), "ids")
            del llm


if __name__ == "__main__":
    main()
