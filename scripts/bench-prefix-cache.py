#!/usr/bin/env python3
"""Prefix-cache benchmark (on demand, never in CI): `custody serve` with the prefix cache off and
on, in one run, on the same machine, driven by the official `openai` client from this process.

    python3 scripts/bench-prefix-cache.py [--bin target/release/custody] [--threads 2]

Scenarios (greedy, streaming; TTFT = time to the first content chunk, measured by the client):
- shared system prompt: a ~1,024-token system prompt declared as a public scope
  (`[[prefix_cache.public]]`), short distinct questions from three tenants;
- multi-turn chat: one tenant, 8 turns, each turn's prompt = the whole conversation so far;
- all-miss: distinct 512-token prompts (nothing to reuse): the namespace/hash/share machinery's
  cost on a miss;
- load: 6 concurrent clients (2 per tenant), 4-turn chats under the shared system prompt;
  the server's own `custody_prefix_cache_hit_rate{tenant}` afterwards.
Prints one JSON object (every figure) and a markdown summary.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from openai import OpenAI

from loadtest import machine  # scripts/loadtest.py, beside this file

KEYS = {"acme": "sk-bench-acme", "globex": "sk-bench-globex", "initech": "sk-bench-initech"}
WORDS = ("ledger harbor quartz meadow signal copper lantern orbit velvet summit canyon ember "
         "falcon glacier juniper marble river thunder pocket violet anchor basket cobalt "
         "dolphin engine forest garden helmet island jacket kettle ladder mirror nickel").split()


def words(seed, n):
    x = (seed + 1) * 0x9E3779B97F4A7C15 % (1 << 64)
    out = []
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) % (1 << 64)
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
        out.append(WORDS[(z ^ (z >> 31)) % len(WORDS)])
    return " ".join(out)


def config(path, cache, system_prompt):
    tenants = "".join(
        f'\n[[serve.tenants]]\nid = "{t}"\nkeys_sha256 = ["{hashlib.sha256(k.encode()).hexdigest()}"]\n'
        f"max_concurrent = 8\n"
        for t, k in KEYS.items()
    )
    with open(path, "w") as f:
        f.write(
            f"[engine]\ncontext_length = 4096\nkv_budget_mib = 256\nprefix_cache = {str(cache).lower()}\n"
            f'\n[serve]\nmodel_name = "bench"\ncanary_interval_s = 0\ndefault_max_tokens = 64\n'
            f'\n[[prefix_cache.public]]\nscope = "bench-system"\nsystem_prompt = "{system_prompt}"\n'
            f"{tenants}"
        )


class Server:
    def __init__(self, binary, work, cache, system_prompt, threads, port):
        self.url = f"http://127.0.0.1:{port}"
        # /metrics is served on the operator's listener only, never on the API's port.
        self.metrics_url = f"http://127.0.0.1:{port + 100}"
        cfg = os.path.join(work, f"serve-{cache}.toml")
        config(cfg, cache, system_prompt)
        key = os.path.join(work, f"node-{cache}.key")
        subprocess.run([binary, "audit", "keygen", "--out", key], check=True, capture_output=True)
        self.log = open(os.path.join(work, f"serve-{cache}.log"), "w")
        self.p = subprocess.Popen(
            [binary, "serve", "--config", cfg, "--listen", f"127.0.0.1:{port}",
             "--metrics-listen", f"127.0.0.1:{port + 100}", "--threads",
             str(threads), "--audit-dir", os.path.join(work, f"audit-{cache}"), "--audit-key", key],
            stderr=self.log,
        )
        for _ in range(1200):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.p.poll() is not None:
                    sys.exit(f"custody serve exited: see {self.log.name}")
                time.sleep(0.5)
        sys.exit("custody serve did not come up")

    def metrics(self):
        return urllib.request.urlopen(self.metrics_url + "/metrics", timeout=10).read().decode()

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=120)
        self.log.close()


def chat(url, tenant, messages, max_tokens=8):
    """One streamed chat: (TTFT s, prompt tokens, cached tokens, text)."""
    c = OpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=600)
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    for ch in c.chat.completions.create(
        model="bench", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        if ch.choices and ch.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    if ttft is None:
        ttft = time.perf_counter() - t0
    cached = (usage.prompt_tokens_details.cached_tokens
              if usage and usage.prompt_tokens_details else 0) or 0
    return ttft, usage.prompt_tokens, cached, "".join(text)


def summary(rows):
    t = [r[0] for r in rows]
    return {
        "n": len(rows),
        "ttft_ms_median": round(1e3 * statistics.median(t), 1),
        "prompt_tokens_median": statistics.median(r[1] for r in rows),
        "cached_tokens_median": statistics.median(r[2] for r in rows),
        # Prompt tokens per second of time to first token (prefill throughput as the client sees it).
        "prefill_tok_s_median": round(statistics.median(r[1] / r[0] for r in rows), 1),
    }


def shared_system(url, sys_prompt, n):
    tenants = list(KEYS)
    rows = []
    for i in range(n + 1):
        r = chat(url, tenants[i % 3], [
            {"role": "system", "content": sys_prompt},
            {"role": "user", "content": f"Question {i}: {words(500 + i, 12)}?"},
        ])
        if i > 0:  # the first one computes the public prefix (cache on) or is a warm-up
            rows.append(r)
    return summary(rows)


def multi_turn(url, turns, seed):
    msgs = [{"role": "system", "content": "You are a concise assistant."}]
    rows = []
    for k in range(turns):
        msgs.append({"role": "user", "content": words(seed + k, 45)})
        r = chat(url, "acme", msgs, max_tokens=24)
        msgs.append({"role": "assistant", "content": r[3]})
        if k > 0:
            rows.append(r)
    return summary(rows)


def all_miss(url, n):
    rows = [chat(url, "globex", [{"role": "user", "content": words(9000 + i, 380)}]) for i in range(n)]
    return summary(rows[1:])


def load(url, sys_prompt, clients, turns):
    out, lock = [], threading.Lock()

    def run(c):
        tenant = list(KEYS)[c % 3]
        msgs = [{"role": "system", "content": sys_prompt}]
        for k in range(turns):
            msgs.append({"role": "user", "content": words(7000 + 100 * c + k, 20)})
            r = chat(url, tenant, msgs, max_tokens=16)
            msgs.append({"role": "assistant", "content": r[3]})
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    th = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    s = summary(out)
    t = sorted(r[0] for r in out)
    s["ttft_ms_p99"] = round(1e3 * t[min(len(t) - 1, round(0.99 * (len(t) - 1)))], 1)
    s["requests_per_s"] = round(len(out) / wall, 2)
    s["cached_share_of_prompt_tokens"] = round(sum(r[2] for r in out) / sum(r[1] for r in out), 3)
    return s


def hit_rates(metrics):
    rates = {}
    for line in metrics.splitlines():
        if line.startswith("custody_prefix_cache_hit_rate{"):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            rates[tenant] = round(float(line.rsplit(" ", 1)[1]), 3)
    return rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/custody")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--requests", type=int, default=9)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="custody-bench-cache-")
    # A 1,024-token system prompt (SmolLM2's tokenizer: about 1.1 tokens per word here, and
    # the chat template's own tokens).
    sys_prompt = words(1, 952)
    result = {"machine": machine(), "threads": a.threads, "runs": {"off": {}, "on": {}}}
    # Both servers up at once (an idle one costs nothing), each scenario run on one then the
    # other: drift in the machine's state hits both alike.
    servers = {"off": Server(a.bin, work, False, sys_prompt, a.threads, 18090),
               "on": Server(a.bin, work, True, sys_prompt, a.threads, 18091)}
    try:
        scenarios = [
            ("shared_system_prompt", lambda u: shared_system(u, sys_prompt, a.requests)),
            ("multi_turn_chat", lambda u: multi_turn(u, 8, 300)),
            ("all_miss", lambda u: all_miss(u, a.requests + 1)),
            ("load", lambda u: load(u, sys_prompt, 6, 4)),
        ]
        for name, run in scenarios:
            for which in ("off", "on"):
                result["runs"][which][name] = run(servers[which].url)
        for which, srv in servers.items():
            result["runs"][which]["load"]["server_hit_rate_by_tenant"] = hit_rates(srv.metrics())
    finally:
        for srv in servers.values():
            srv.stop()
    on, off = result["runs"]["on"], result["runs"]["off"]
    ratios = {}
    for s in ("shared_system_prompt", "multi_turn_chat", "all_miss", "load"):
        ratios[s] = round(off[s]["ttft_ms_median"] / on[s]["ttft_ms_median"], 2)
    result["ttft_speedup_on_vs_off"] = ratios
    print(json.dumps(result))
    print(f"\n| scenario | TTFT off (ms) | TTFT on (ms) | speedup | prompt tok | cached tok (on) "
          f"| prefill tok/s off | on |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for s in ratios:
        print(f"| {s} | {off[s]['ttft_ms_median']} | {on[s]['ttft_ms_median']} | {ratios[s]}x | "
              f"{on[s]['prompt_tokens_median']} | {on[s]['cached_tokens_median']} | "
              f"{off[s]['prefill_tok_s_median']} | {on[s]['prefill_tok_s_median']} |", file=sys.stderr)


if __name__ == "__main__":
    main()
