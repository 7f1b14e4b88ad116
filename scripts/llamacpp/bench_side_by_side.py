#!/usr/bin/env python3
"""Side-by-side throughput: llama.cpp (llama-cpp-python) and `custody bench`, same model, same
prompt ids, same threads, same prompt/generation lengths, in the same run; writes the ratios
into BENCHMARKS.md between the BEGIN/END markers. Run on demand (not in CI):

    /opt/llamaref/venv/bin/python scripts/llamacpp/bench_side_by_side.py [--threads 1 2] [--reps 3]
"""
import argparse, json, os, platform, statistics, subprocess, time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("CUSTODY_MODEL", str(Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"))
PROMPT = ROOT / "tests/fixtures/llamacpp-smollm2/bench_prompt.json"


def run_llama_cpp(threads, ids, n_gen, reps, fa):
    llm = Llama(MODEL, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, flash_attn=fa, verbose=False)
    vocab = llm.n_vocab()

    def last_argmax():
        # The last evaluated position's logits, read through the C API (no Python-side copies).
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(vocab,)).argmax())

    pre, dec = [], []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        tok = last_argmax()
        t2 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([tok])
            tok = last_argmax()
        t3 = time.perf_counter()
        pre.append(len(ids) / (t1 - t0))
        dec.append(n_gen / (t3 - t2))
    return statistics.median(pre), statistics.median(dec)


def custody(threads, n_prompt, n_gen, reps):
    exe = ROOT / "target/release/custody"
    out = subprocess.run(
        [str(exe), "bench", "--model", MODEL, "--threads", str(threads), "--prompt-tokens", str(n_prompt),
         "--gen-tokens", str(n_gen), "--reps", str(reps), "--prompt-ids", str(PROMPT), "--json"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "custody"], cwd=ROOT, check=True)
    ids = json.loads(PROMPT.read_text())["all_ids"][: a.prompt_tokens]
    rows = []
    for t in a.threads:
        c = custody(t, a.prompt_tokens, a.gen_tokens, a.reps)
        for fa in (False, True):
            lp, ld = run_llama_cpp(t, ids, a.gen_tokens, a.reps, fa)
            rows.append((t, fa, lp, ld, c))
            print(f"threads {t} fa={int(fa)}: llama.cpp prefill {lp:.1f} decode {ld:.1f} | custody prefill {c['prefill_tok_s']:.1f} "
                  f"decode {c['decode_tok_s']:.1f} | ratio {c['prefill_tok_s']/lp:.2f} / {c['decode_tok_s']/ld:.2f} "
                  f"| tag check {100*c['tag_check_fraction_of_decode_step']:.3f} % of a decode step")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    table = [f"Measured {time.strftime('%Y-%m-%d')} on {cpu}, {os.cpu_count()} cores; prompt {a.prompt_tokens} tokens "
             f"(`tests/fixtures/llamacpp-smollm2/bench_prompt.json`), then {a.gen_tokens} greedy decode steps, median of "
             f"{a.reps}; llama.cpp = llama-cpp-python {llama_cpp.__version__} with flash attention off (the arithmetic custody "
             f"reproduces) and on (its fastest CPU path).", "",
             "| threads | llama.cpp flash attn | llama.cpp prefill tok/s | custody prefill tok/s | ratio | llama.cpp decode tok/s | custody decode tok/s | ratio | tag check (% of decode step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t, fa, lp, ld, c in rows:
        table.append(f"| {t} | {'on' if fa else 'off'} | {lp:.1f} | {c['prefill_tok_s']:.1f} | **{c['prefill_tok_s']/lp:.2f}×** | {ld:.1f} | "
                     f"{c['decode_tok_s']:.1f} | **{c['decode_tok_s']/ld:.2f}×** | {100*c['tag_check_fraction_of_decode_step']:.3f} % |")
    bm = ROOT / "BENCHMARKS.md"
    text = bm.read_text()
    begin, end = "<!-- BEGIN side-by-side -->", "<!-- END side-by-side -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    bm.write_text(head + begin + "\n" + "\n".join(table) + "\n" + end + tail)
    print("BENCHMARKS.md updated")


if __name__ == "__main__":
    main()
