#!/usr/bin/env python3
"""The router's added latency (on demand, never in CI): one decode node and one prefill node on
loopback, and in front of the same prefill node, in one run, (A) `custody serve --prefill` (a
pair's front, no routing) and (B) `custody serve` with `[fleet]` (the router, with its own
signed audit log: three `route` rows per request). Requests alternate A, B, A, B, … one at a
time (no queueing), greedy, so both see the same machine state; the difference of the
distributions is what routing adds: the registry lock and choice, the minted route, the
route rows, the route checks on both nodes.

    python3 scripts/bench-router.py [--bin target/release/custody] [--n 200] [--max-tokens 4]

Prints one JSON object and a markdown row per front.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from openai import OpenAI

from loadtest import machine, pct  # scripts/loadtest.py, beside this file

KEY = "sk-bench-router"
ENGINE = "[engine]\ncontext_length = 2048\nkv_budget_mib = 64\nthreads = {threads}\n"
TLS = "[tls]\ninsecure_loopback = true\n"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def tenant():
    return (f'[[serve.tenants]]\nid = "bench"\nkeys_sha256 = ["{hashlib.sha256(KEY.encode()).hexdigest()}"]\n'
            "max_concurrent = 8\n")


def serve_section(port, extra=""):
    # /metrics: the operator's own listener (never the API port), one per server.
    return (f'[serve]\nlisten = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{port + 100}"\nmodel_name = "bench"\ncanary_interval_s = 0\n'
            f"prefill_anomaly_factor = 0.0\n{extra}{tenant()}")


def spawn(binary, work, name, args):
    log = open(os.path.join(work, f"{name}.log"), "w")
    return subprocess.Popen([binary, *args], stderr=log, stdout=subprocess.DEVNULL), log


def wait_http(url, proc, name, work):
    for _ in range(1200):
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit(f"{name} exited: see {os.path.join(work, name + '.log')}")
        time.sleep(0.25)
    sys.exit(f"{name} did not come up")


def one(url, prompt, max_tokens):
    c = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    t0 = time.perf_counter()
    r = c.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return time.perf_counter() - t0, r.choices[0].text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/custody")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-front-audit", action="store_true",
                    help="the two fronts keep no log of their own (the nodes still do)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="custody-bench-router-")
    eng = ENGINE.format(threads=a.threads)
    write(f"{work}/decode.toml", eng + TLS + '[disagg]\ndecode_control = "127.0.0.1:17171"\n'
          'decode_transport = "127.0.0.1:17172"\n[audit]\nnode = 2\n')
    write(f"{work}/prefill.toml", eng + TLS + '[disagg]\nprefill_listen = "127.0.0.1:17170"\n'
          '[[disagg.decode]]\nnode = 2\ncontrol = "127.0.0.1:17171"\n[audit]\nnode = 1\n')
    # Without their own logs, the fronts run with --no-audit, which their configs must allow.
    consent = "[audit]\nallow_no_audit = true\n" if a.no_front_audit else ""
    write(f"{work}/front.toml", eng + TLS + consent + serve_section(17180, 'prefill = "http://127.0.0.1:17170"\n'))
    write(f"{work}/router.toml", eng + TLS + consent + serve_section(17181) +
          '[fleet]\nprobe_interval_ms = 250\n[[fleet.prefill]]\nnode = 1\nurl = "http://127.0.0.1:17170"\n'
          '[[fleet.decode]]\nnode = 2\nurl = "http://127.0.0.1:17171"\n')
    key = f"{work}/audit.key"
    subprocess.run([a.bin, "audit", "keygen", "--out", key], check=True, capture_output=True)
    audit = ["--audit-dir", f"{work}/audit", "--audit-key", key]
    procs = []
    try:
        procs.append(spawn(a.bin, work, "decode", ["decode", "--config", f"{work}/decode.toml", *audit, "--node", "2"]))
        procs.append(spawn(a.bin, work, "prefill", ["prefill", "--config", f"{work}/prefill.toml", *audit, "--node", "1"]))
        own = ["--no-audit"] if a.no_front_audit else audit
        procs.append(spawn(a.bin, work, "front", ["serve", "--config", f"{work}/front.toml", *own, "--node", "8"]))
        procs.append(spawn(a.bin, work, "router", ["serve", "--config", f"{work}/router.toml", *own, "--node", "9"]))
        fronts = {"pair front (no routing)": "http://127.0.0.1:17180", "router (1 x 1 fleet)": "http://127.0.0.1:17181"}
        for (name, url), (p, _) in zip(fronts.items(), procs[2:]):
            wait_http(url + "/health/ready", p, name.split()[0], work)
        prompt = "Summarise in one sentence: the quarterly roadmap, the migration, the on-call rotation."
        for url in fronts.values():  # warm-up
            for _ in range(5):
                one(url, prompt, a.max_tokens)
        lat = {k: [] for k in fronts}
        texts = {k: set() for k in fronts}
        for i in range(a.n):
            for name, url in (fronts.items() if i % 2 == 0 else reversed(list(fronts.items()))):
                s, text = one(url, prompt, a.max_tokens)
                lat[name].append(s)
                texts[name].add(text)
        if texts[list(fronts)[0]] != texts[list(fronts)[1]]:
            sys.exit(f"the two fronts answered differently: {texts}")
        out = {"machine": machine(), "n": a.n, "max_tokens": a.max_tokens, "threads_per_node": a.threads,
               "front_audit": not a.no_front_audit}
        for name, xs in lat.items():
            out[name] = {"p50_ms": round(1e3 * pct(xs, 50), 2), "p99_ms": round(1e3 * pct(xs, 99), 2),
                         "mean_ms": round(1e3 * statistics.mean(xs), 2)}
        a_, b_ = (lat[k] for k in fronts)
        out["added_p50_ms"] = round(1e3 * (pct(b_, 50) - pct(a_, 50)), 2)
        out["added_p99_ms"] = round(1e3 * (pct(b_, 99) - pct(a_, 99)), 2)
        print(json.dumps(out))
        print("| front | p50 ms | p99 ms | mean ms |")
        print("|---|--:|--:|--:|")
        for name in fronts:
            r = out[name]
            print(f"| {name} | {r['p50_ms']} | {r['p99_ms']} | {r['mean_ms']} |")
        print(f"| added by routing | {out['added_p50_ms']} | {out['added_p99_ms']} | |")
    finally:
        for p, log in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()


if __name__ == "__main__":
    main()
