#!/usr/bin/env python3
"""Models at the sizes people serve, with random weights, quantized by llama.cpp itself.

Run on demand, never in CI (it needs llama-cpp-python and the PyPI `gguf` package; nothing is
downloaded):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_shapes.py --shape llama-1b --types Q4_K_M Q4_0

Speed does not depend on the weights' values, only on the shapes and the types, so each shape's
body (layers, widths, heads, feed-forward, biases, RoPE style) is that of the named model, with
the embedded model's vocabulary (SmolLM2's 49,152 tokens and its tokenizer fields, so `custody`
and llama.cpp tokenize prompts as they do for the embedded model) and random weights from a fixed
seed. The F16 base is written tensor by tensor with the `gguf` package (an 8B base is 16 GB) to
~/.cache/custody/shapes/<shape>.F16.gguf; `llama_model_quantize` (llama.cpp's own quantizer, its
default mixes) writes ~/.cache/custody/shapes/<shape>.<TYPE>.gguf. Nothing is committed.

Shapes (all tied-output, as the named models ship, except llama-8b):
  llama-1b   Llama-3.2-1B:  16 layers, 2,048 wide, 32/8 heads x 64, FFN 8,192, rope 5e5
  llama-3b   Llama-3.2-3B:  28 layers, 3,072 wide, 24/8 heads x 128, FFN 8,192, rope 5e5
  llama-8b   Llama-3.1-8B:  32 layers, 4,096 wide, 32/8 heads x 128, FFN 14,336, rope 5e5 (untied)
  qwen2-1.5b Qwen2.5-1.5B:  28 layers, 1,536 wide, 12/2 heads x 128, FFN 8,960, Q/K/V biases,
             NeoX RoPE (arch qwen2), rope 1e6
"""
import argparse, ctypes
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType

EMBEDDED = Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR = Path.home() / ".cache/custody/shapes"
SHAPES = {
    "llama-1b": dict(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_kv=8, head_dim=64,
                     n_ff=8192, rope=5e5, tied=True, bias=False),
    "llama-3b": dict(arch="llama", n_layer=28, n_embd=3072, n_head=24, n_kv=8, head_dim=128,
                     n_ff=8192, rope=5e5, tied=True, bias=False),
    "llama-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_kv=8, head_dim=128,
                     n_ff=14336, rope=5e5, tied=False, bias=False),
    "qwen2-1.5b": dict(arch="qwen2", n_layer=28, n_embd=1536, n_head=12, n_kv=2, head_dim=128,
                       n_ff=8960, rope=1e6, tied=True, bias=True),
}
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
N_CTX = 131072


def copy_tokenizer(w: GGUFWriter, src: Path):
    """The embedded model's tokenizer fields (and chat template), copied as they are."""
    r = GGUFReader(str(src))
    for name, f in r.fields.items():
        if not (name.startswith("tokenizer.")):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            et = f.types[1]
            if et == GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i][0].item() for i in f.data]
            w.add_array(name, vals)
        elif t == GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[f.data[0]]).decode())
        elif t == GGUFValueType.BOOL:
            w.add_bool(name, bool(f.parts[f.data[0]][0]))
        else:
            w.add_uint32(name, int(f.parts[f.data[0]][0]))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return vocab


def write_base(shape: str, path: Path):
    c = SHAPES[shape]
    rng = np.random.default_rng(38)
    w = GGUFWriter(str(path), arch=c["arch"])
    w.add_name(f"custody-shape-{shape}")
    w.add_file_type(1)  # MOSTLY_F16
    w.add_context_length(N_CTX)
    w.add_embedding_length(c["n_embd"])
    w.add_block_count(c["n_layer"])
    w.add_feed_forward_length(c["n_ff"])
    w.add_head_count(c["n_head"])
    w.add_head_count_kv(c["n_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(c["rope"])
    w.add_rope_dimension_count(c["head_dim"])
    if c["head_dim"] * c["n_head"] != c["n_embd"]:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    n_vocab = copy_tokenizer(w, EMBEDDED)
    d, hd, nh, nkv, ff = c["n_embd"], c["head_dim"], c["n_head"], c["n_kv"], c["n_ff"]

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))).astype(np.float16)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Tensor data is written after the header: register shapes first, then stream each tensor.
    tensors = [("token_embd.weight", lambda: (0.05 * rng.standard_normal((n_vocab, d), dtype=np.float32)).astype(np.float16)),
               ("output_norm.weight", lambda: (5 * norm(d)).astype(np.float32))]
    if not c["tied"]:
        tensors.append(("output.weight", lambda: mat(n_vocab, d, 4.0)))
    for i in range(c["n_layer"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", lambda: norm(d)),
                    (p + "attn_q.weight", lambda: mat(nh * hd, d, 2.0)),
                    (p + "attn_k.weight", lambda: mat(nkv * hd, d, 2.0)),
                    (p + "attn_v.weight", lambda: mat(nkv * hd, d))]
        if c["bias"]:
            tensors += [(p + "attn_q.bias", lambda: (0.3 * rng.standard_normal(nh * hd)).astype(np.float32)),
                        (p + "attn_k.bias", lambda: (0.3 * rng.standard_normal(nkv * hd)).astype(np.float32)),
                        (p + "attn_v.bias", lambda: (0.3 * rng.standard_normal(nkv * hd)).astype(np.float32))]
        tensors += [(p + "attn_output.weight", lambda: mat(d, nh * hd)),
                    (p + "ffn_norm.weight", lambda: norm(d)),
                    (p + "ffn_gate.weight", lambda: mat(ff, d)),
                    (p + "ffn_up.weight", lambda: mat(ff, d)),
                    (p + "ffn_down.weight", lambda: mat(d, ff, 2.0))]
    shapes = {"token_embd.weight": ((n_vocab, d), np.float16), "output.weight": ((n_vocab, d), np.float16),
              "output_norm.weight": ((d,), np.float32)}
    for name, _ in tensors:
        if name in shapes:
            continue
        base = name.split(".", 2)[2]
        dims = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_q.weight": (nh * hd, d),
                "attn_k.weight": (nkv * hd, d), "attn_v.weight": (nkv * hd, d),
                "attn_q.bias": (nh * hd,), "attn_k.bias": (nkv * hd,), "attn_v.bias": (nkv * hd,),
                "attn_output.weight": (d, nh * hd), "ffn_gate.weight": (ff, d),
                "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff)}[base]
        f16 = base.endswith("weight") and len(dims) == 2
        shapes[name] = (dims, np.float16 if f16 else np.float32)
    for name, _ in tensors:
        dims, dt = shapes[name]
        w.add_tensor_info(name, dims, np.dtype(dt), int(np.prod(dims)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make in tensors:
        w.write_tensor_data(make())
    w.close()


def quantize(src: Path, dst: Path, ftype: int):
    import llama_cpp  # only here: the base needs just the `gguf` package

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize {dst.name}: {rc}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--types", nargs="+", choices=sorted(FTYPES), default=["Q4_K_M"])
    ap.add_argument("--keep-base", action="store_true", help="keep the F16 base (GBs) afterwards")
    ap.add_argument("--base-only", action="store_true", help="write the F16 base and stop")
    a = ap.parse_args()
    DIR.mkdir(parents=True, exist_ok=True)
    base = DIR / f"{a.shape}.F16.gguf"
    if not base.exists():
        write_base(a.shape, base)
    if a.base_only:
        return
    for t in a.types:
        dst = DIR / f"{a.shape}.{t}.gguf"
        if not dst.exists():
            quantize(base, dst, FTYPES[t])
        print(dst, dst.stat().st_size)
    if not a.keep_base:
        base.unlink()


if __name__ == "__main__":
    main()
