#!/usr/bin/env python3
"""Side-by-side throughput: llama.cpp (llama-cpp-python) and `custody bench`, same model, same
prompt ids, same threads, same prompt/generation lengths, in the same run; writes the table
into BENCHMARKS.md between the BEGIN/END markers. Run on demand (not in CI):

    /opt/llamaref/venv/bin/python scripts/llamacpp/bench_side_by_side.py [--threads 1 2] [--reps 3]

Scenarios (each at every thread count):
  short    512 prompt ids, then 128 greedy decode steps, one sequence;
  long     2,048 prompt ids, then 128 steps (attention dominates decode there);
  batched  8 sequences, each the 512 prompt ids then 128 steps, decoding together
           (llama.cpp: one `llama_batch` of 8 sequences per step, per-sequence KV streams);
  deep     8,192 prompt ids (the fixture's 2,888 repeated), then the steps: decode at depth.
llama.cpp runs with flash attention off (the arithmetic custody reproduces) and on; each
figure's ratio is against the faster of the two. custody runs with the tag check (always on)
and the audit writer recording every event (`--audit-cost`: its audited figures).
"""
import argparse, ctypes, json, os, platform, statistics, subprocess, tempfile, time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama, _internals as internals

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("CUSTODY_MODEL", str(Path.home() / ".cache/custody/SmolLM2-135M-Instruct.Q4_1.gguf"))
MODEL_LABEL = Path(MODEL).name
SHAPES_DIR = Path.home() / ".cache/custody/shapes"  # scripts/llamacpp/gen_shapes.py
PROMPT = ROOT / "tests/fixtures/llamacpp-smollm2/bench_prompt.json"
N_BATCH = 512
SCENARIOS = {"short": (512, 1), "long": (2048, 1), "batched": (512, 8), "deep": (8192, 1)}


def argmax_ith(ctx, i, vocab):
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    return int(np.ctypeslib.as_array(ptr, shape=(vocab,)).argmax())


def fill(batch, tokens, pos0, seq, want_last):
    """One sequence's tokens into `batch` (cleared first)."""
    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i] = t
        batch.pos[i] = pos0 + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if (want_last and i == len(tokens) - 1) else 0


def run_llama_cpp(threads, ids, n_gen, reps, fa, n_seq):
    """Prefill every sequence (512-token chunks), then n_gen steps of one token per sequence."""
    per_seq = len(ids) + n_gen + 16
    n_ctx = -(-per_seq // 256) * 256 * n_seq  # a whole stream per sequence
    llm = Llama(MODEL, n_ctx=n_ctx, n_batch=N_BATCH, n_threads=threads, n_threads_batch=threads,
                flash_attn=fa, verbose=False)
    vocab = llm.n_vocab()
    params = llm.context_params
    params.n_seq_max = n_seq
    params.kv_unified = False
    ctx_obj = internals.LlamaContext(model=llm._model, params=params, verbose=False)
    ctx = ctx_obj.ctx
    batch = llama_cpp.llama_batch_init(N_BATCH, 0, n_seq)
    mem = llama_cpp.llama_get_memory(ctx)
    pre, dec = [], []
    try:
        for _ in range(reps):
            llama_cpp.llama_memory_clear(mem, True)
            t0 = time.perf_counter()
            toks = []
            for s in range(n_seq):
                for c0 in range(0, len(ids), N_BATCH):
                    chunk = ids[c0:c0 + N_BATCH]
                    last = c0 + N_BATCH >= len(ids)
                    fill(batch, chunk, c0, s, last)
                    if llama_cpp.llama_decode(ctx, batch) != 0:
                        raise RuntimeError("llama_decode failed (prefill)")
                toks.append(argmax_ith(ctx, len(chunk) - 1, vocab))
            t1 = time.perf_counter()
            for step in range(n_gen):
                batch.n_tokens = n_seq
                for s in range(n_seq):
                    batch.token[s] = toks[s]
                    batch.pos[s] = len(ids) + step
                    batch.n_seq_id[s] = 1
                    batch.seq_id[s][0] = s
                    batch.logits[s] = 1
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed (decode)")
                toks = [argmax_ith(ctx, s, vocab) for s in range(n_seq)]
            t2 = time.perf_counter()
            pre.append(n_seq * len(ids) / (t1 - t0))
            dec.append(n_seq * n_gen / (t2 - t1))
    finally:
        llama_cpp.llama_batch_free(batch)
        ctx_obj.close()
        llm.close()
    return statistics.median(pre), statistics.median(dec)


def in_child(f, *args):
    """`f(*args)` in a forked child: its result and the child's peak resident set (MiB)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            payload = json.dumps({"ok": f(*args)})
        except BaseException as e:  # reported to the parent, which raises it
            payload = json.dumps({"error": repr(e)})
        with os.fdopen(w, "w") as out:
            out.write(payload)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as inp:
        data = json.loads(inp.read() or '{"error": "child died"}')
    _, _, usage = os.wait4(pid, 0)
    if "error" in data:
        raise RuntimeError(f"llama.cpp run failed: {data['error']}")
    return data["ok"], usage.ru_maxrss / 1024


def custody(threads, ids, n_gen, reps, n_seq):
    """`custody bench`'s JSON and its peak resident set (MiB)."""
    exe = ROOT / "target/release/custody"
    prompt = Path(tempfile.mkstemp(suffix=".json")[1])
    prompt.write_text(json.dumps({"all_ids": ids}))
    p = subprocess.Popen(
        [str(exe), "bench", "--model", MODEL, "--threads", str(threads), "--prompt-tokens", str(len(ids)),
         "--gen-tokens", str(n_gen), "--reps", str(reps), "--prompt-ids", str(prompt), "--batch", str(n_seq),
         "--audit-cost", "--json"],
        stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    prompt.unlink()
    if status != 0:
        raise RuntimeError(f"custody bench exited with status {status}")
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss / 1024


def pbound_cells(r):
    """The prefill-bound cells of a row: where the machine has no int8 peak measured, '–'."""
    if not r.get("pbound"):
        return "– | –"
    best = r["ref"][r["fa_p"]][0]
    return f"{r['pbound']:.1f} ({r['peak']:.0f}) | {100 * best / r['pbound']:.0f} % / {100 * r['cp'] / r['pbound']:.0f} %"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--no-build", action="store_true", help="use target/release/custody as it is")
    ap.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    ap.add_argument("--shape", help="a model of scripts/llamacpp/gen_shapes.py (e.g. llama-1b); with --type")
    ap.add_argument("--type", default="Q4_K_M", help="with --shape: the file's type (Q4_K_M, Q4_0, ...)")
    ap.add_argument("--marker", default="side-by-side",
                    help="the BENCHMARKS.md section to write: between <!-- BEGIN MARKER --> and <!-- END MARKER -->")
    a = ap.parse_args()
    if a.shape:
        global MODEL, MODEL_LABEL
        MODEL = str(SHAPES_DIR / f"{a.shape}.{a.type}.gguf")
        MODEL_LABEL = f"{a.shape}.{a.type}.gguf (scripts/llamacpp/gen_shapes.py)"
        assert Path(MODEL).exists(), f"{MODEL}: run scripts/llamacpp/gen_shapes.py --shape {a.shape} --types {a.type}"
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "custody", "--no-default-features"], cwd=ROOT, check=True)
    all_ids = json.loads(PROMPT.read_text())["all_ids"]
    rows = []
    for name in a.scenarios:
        n_prompt, n_seq = SCENARIOS[name]
        ids = (all_ids * -(-n_prompt // len(all_ids)))[:n_prompt]
        for t in a.threads:
            c, c_rss = custody(t, ids, a.gen_tokens, a.reps, n_seq)
            cp, cd = c["audited_prefill_tok_s"], c["audited_decode_tok_s"]
            runs = {fa: in_child(run_llama_cpp, t, ids, a.gen_tokens, a.reps, fa, n_seq) for fa in (False, True)}
            ref = {fa: tuple(v[0]) for fa, v in runs.items()}
            l_rss = max(v[1] for v in runs.values())
            fa_p = max(ref, key=lambda fa: ref[fa][0])
            fa_d = max(ref, key=lambda fa: ref[fa][1])
            row = dict(name=name, threads=t, n_prompt=n_prompt, n_seq=n_seq, ref=ref, fa_p=fa_p, fa_d=fa_d,
                       cp=cp, cd=cd, check=c["tag_check_fraction_of_decode_step"], c_rss=c_rss, l_rss=l_rss,
                       bound=c["decode_bound_tok_s"], bw=c["read_bandwidth_gb_s"],
                       pbound=c.get("prefill_bound_tok_s"), peak=c.get("int8_peak_gmac_s"))
            rows.append(row)
            print(f"{name} threads {t}: llama.cpp prefill {ref[False][0]:.1f}/{ref[True][0]:.1f} (fa off/on) "
                  f"decode {ref[False][1]:.1f}/{ref[True][1]:.1f} | custody prefill {cp:.1f} decode {cd:.1f} | "
                  f"ratio vs best {cp / ref[fa_p][0]:.2f} / {cd / ref[fa_d][1]:.2f} | bound {row['bound']:.1f} tok/s "
                  f"({row['bw']:.1f} GB/s) | peak RSS custody {c_rss:.0f} MiB, llama.cpp {l_rss:.0f} MiB", flush=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    table = [f"Measured {time.strftime('%Y-%m-%d')} on {cpu}, {os.cpu_count()} cores; prompt ids from "
             f"`tests/fixtures/llamacpp-smollm2/bench_prompt.json`, then {a.gen_tokens} greedy decode steps, median of "
             f"{a.reps}; llama.cpp = llama-cpp-python {llama_cpp.__version__}, flash attention off and on, each ratio "
             f"against the faster (its setting in brackets); custody with the tag check and the audit log on. Batched: "
             f"aggregate tok/s over the sequences.", "",
             f"Model: `{MODEL_LABEL}`. Bound: decode tok/s if each step only waited for its weight and K/V bytes, at the "
             f"read bandwidth `custody bench` measured in the same run (its weights streamed, same threads). Peak RSS: each "
             f"engine's process (llama.cpp: the larger of its two runs). Prefill bound: prompt tok/s if each token only "
             f"waited for its multiply-accumulates (matrices + attention at mean depth) at the int8 dot-product peak "
             f"(512-bit `vpdpbusd`, 16 chains per thread) `custody bench` measured in the same run; the share of it each "
             f"engine reaches (llama.cpp's faster setting).", "",
             "| scenario | threads | llama.cpp prefill tok/s (fa off / on) | custody prefill tok/s | ratio vs best | "
             "llama.cpp decode tok/s (fa off / on) | custody decode tok/s | ratio vs best | bound tok/s (GB/s) | custody of bound | "
             "peak RSS MiB custody / llama.cpp | tag check (% of decode step) | prefill bound tok/s (GMAC/s) | "
             "llama.cpp / custody of it |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r["ref"]
        label = f"{r['name']} ({r['n_prompt']} prompt{', ' + str(r['n_seq']) + ' sequences' if r['n_seq'] > 1 else ''})"
        table.append(
            f"| {label} | {r['threads']} | {ref[False][0]:.1f} / {ref[True][0]:.1f} | {r['cp']:.1f} | "
            f"**{r['cp'] / ref[r['fa_p']][0]:.2f}×** ({'on' if r['fa_p'] else 'off'}) | {ref[False][1]:.1f} / {ref[True][1]:.1f} | "
            f"{r['cd']:.1f} | **{r['cd'] / ref[r['fa_d']][1]:.2f}×** ({'on' if r['fa_d'] else 'off'}) | "
            f"{r['bound']:.1f} ({r['bw']:.1f}) | {100 * r['cd'] / r['bound']:.0f} % | {r['c_rss']:.0f} / {r['l_rss']:.0f} | "
            f"{100 * r['check']:.3f} % | {pbound_cells(r)} |")
    print("\n".join(table))
    if a.no_write:
        return
    bm = ROOT / "BENCHMARKS.md"
    text = bm.read_text()
    begin, end = f"<!-- BEGIN {a.marker} -->", f"<!-- END {a.marker} -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    bm.write_text(head + begin + "\n" + "\n".join(table) + "\n" + end + tail)
    print("BENCHMARKS.md updated")


if __name__ == "__main__":
    main()
