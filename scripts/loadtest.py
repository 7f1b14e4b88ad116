#!/usr/bin/env python3
"""Bounded load test of an OpenAI-compatible server from a separate process (the official
`openai` client, streaming): several tenants (one API key each), a fixed number of concurrent
streams and a fixed total of requests. Reports throughput, time to first token (TTFT) and
inter-token latency (ITL) percentiles, and errors, as one JSON object on stdout.

    python3 scripts/loadtest.py --url http://127.0.0.1:8080 \
        --keys sk-demo-acme,sk-demo-globex,sk-demo-initech --concurrency 6 --requests 36

Tokens are counted from `usage` when the server sends it with the stream
(`stream_options.include_usage`), else as content chunks. ITL is the gap between consecutive
content chunks of one stream. Used by scripts/bench-serve.sh (custody vs llama-cpp-python).
"""
import argparse
import asyncio
import json
import os
import platform
import statistics
import time

import openai
from openai import AsyncOpenAI

PROMPTS = [
    "Write a short paragraph about the history of the printing press.",
    "Explain in a few sentences how a refrigerator works.",
    "List some good habits for writing maintainable software, with a sentence on each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a lake and a sea?",
    "Give three tips for a first visit to a big city.",
]


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            name = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def one(client, model, i, max_tokens, usage_ok):
    t0 = time.perf_counter()
    first, last, itl, chunks, usage, finish = None, None, [], 0, None, None
    kwargs = {"stream_options": {"include_usage": True}} if usage_ok else {}
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        **kwargs,
    )
    async for chunk in stream:
        if getattr(chunk, "usage", None):
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            finish = c.finish_reason or finish
            if c.delta and c.delta.content:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    end = time.perf_counter()
    if finish is None:
        # A stream cut short (interrupted, or the server gave up) is an error, not a result.
        raise RuntimeError("stream ended without a finish_reason")
    return {
        "ttft_s": (first or end) - t0,
        "itl_s": itl,
        "tokens": usage if usage is not None else chunks,
        "total_s": end - t0,
    }


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--keys", default="none", help="comma-separated API keys, one per tenant")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--concurrency", type=int, default=6, help="streams in flight at once")
    ap.add_argument("--requests", type=int, default=36, help="total requests (bounded run)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-usage", action="store_true", help="do not ask for usage in the stream")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    keys = a.keys.split(",")
    clients = [AsyncOpenAI(base_url=a.url + "/v1", api_key=k, max_retries=0, timeout=600) for k in keys]
    model = a.model or (await clients[0].models.list()).data[0].id
    queue = asyncio.Queue()
    for i in range(a.requests):
        queue.put_nowait(i)
    results, errors = [], {}

    async def worker(w):
        client = clients[w % len(clients)]
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                r = await one(client, model, i, a.max_tokens, not a.no_usage)
                r["tenant"] = w % len(clients)
                results.append(r)
            except openai.APIStatusError as e:
                errors[str(e.status_code)] = errors.get(str(e.status_code), 0) + 1
            except Exception as e:  # noqa: BLE001 - every failure is counted, by type
                kind = str(e) if isinstance(e, RuntimeError) else type(e).__name__
                errors[kind] = errors.get(kind, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(a.concurrency)))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in results]
    itl = [x for r in results for x in r["itl_s"]]
    tokens = sum(r["tokens"] for r in results)
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    print(json.dumps({
        "label": a.label,
        "url": a.url,
        "model": model,
        "machine": machine(),
        "tenants": len(keys),
        "concurrency": a.concurrency,
        "requests": a.requests,
        "ok": len(results),
        "errors": errors,
        "max_tokens": a.max_tokens,
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
        "requests_per_s": round(len(results) / wall, 3),
        "ttft_ms_p50": ms(pct(ttft, 50)),
        "ttft_ms_p99": ms(pct(ttft, 99)),
        "itl_ms_p50": ms(pct(itl, 50)),
        "itl_ms_p99": ms(pct(itl, 99)),
        "itl_ms_mean": ms(statistics.mean(itl)) if itl else None,
    }))


if __name__ == "__main__":
    asyncio.run(main())
