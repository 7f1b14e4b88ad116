#!/usr/bin/env python3
"""What the API's options cost end to end, against a running `custody serve` (on demand,
never in CI; BENCHMARKS.md, "Structured outputs, tools and n").

  python3 scripts/bench-api.py --url http://127.0.0.1:18080 --key sk-demo-acme [--reps 8]

1. Time to first token of a streamed chat request with a JSON-schema `response_format` (a
   fresh schema each time: it is compiled per request) against the same request without one,
   alternating which goes first; and of a request with two tools and `tool_choice: required`.
2. `n = 4` in one request against four concurrent `n = 1` requests with the same prompt
   (~380 tokens, a fresh one each time) and `max_tokens` 32: wall time and tokens; the
   separate requests' `cached_tokens` says how many prompt tokens they did not compute (the
   `n = 4` request's choices 1–3 are hits on choice 0's pages: its audit log's `prefix_cache`).
Prints one JSON object.
"""
import argparse
import json
import statistics
import threading
import time

from openai import OpenAI

p = argparse.ArgumentParser()
p.add_argument("--url", required=True)
p.add_argument("--key", required=True)
p.add_argument("--model", default=None)
p.add_argument("--reps", type=int, default=8)
a = p.parse_args()
client = OpenAI(base_url=a.url + "/v1", api_key=a.key, max_retries=0, timeout=600)
MODEL = a.model or client.models.list().data[0].id
out = {"model": MODEL, "reps": a.reps}


def ttft(**kw):
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=8, temperature=0, **kw)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def schema(i):
    return {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20, "description": f"variant {i}"},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
        "required": ["city", "population", "rivers"], "additionalProperties": False}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
ttft(messages=msgs)  # warm up
plain, constrained, tools = [], [], []
for i in range(a.reps):
    rf = {"type": "json_schema", "json_schema": {"name": f"city{i}", "schema": schema(i), "strict": True}}
    runs = [("plain", {}), ("constrained", {"response_format": rf}), ("tools", {"tools": TOOLS, "tool_choice": "required"})]
    if i % 2:
        runs.reverse()
    for name, kw in runs:
        {"plain": plain, "constrained": constrained, "tools": tools}[name].append(ttft(messages=msgs, **kw))
ms = lambda xs: round(statistics.median(xs) * 1000, 1)  # noqa: E731
out["ttft_ms_median"] = {"plain": ms(plain), "json_schema": ms(constrained), "tools_required": ms(tools)}

def prompt(tag):
    """~380 tokens, distinct from its first token on (no page of it is cached before)."""
    body = " ".join(f"Line {i}: the keeper logged the ships that passed the lighthouse." for i in range(24))
    return [{"role": "user", "content": f"Run {tag}. {body}"}]


def one(res, i, pm, seed):
    r = client.chat.completions.create(model=MODEL, messages=pm, max_tokens=32, temperature=1.0, seed=seed)
    res[i] = r


n4, sep = [], []
for rep in range(a.reps):
    order = ["n4", "sep"] if rep % 2 == 0 else ["sep", "n4"]
    for what in order:
        t0 = time.perf_counter()
        pm = prompt(f"{what}-{rep}")
        if what == "n4":
            r = client.chat.completions.create(model=MODEL, messages=pm, max_tokens=32, temperature=1.0,
                                               seed=1000 + rep, n=4)
            n4.append((time.perf_counter() - t0, r.usage.prompt_tokens, r.usage.completion_tokens,
                       r.usage.prompt_tokens_details.cached_tokens or 0))
        else:
            res = [None] * 4
            ts = [threading.Thread(target=one, args=(res, i, pm, 2000 + 10 * rep + i)) for i in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            sep.append((time.perf_counter() - t0, sum(x.usage.prompt_tokens for x in res),
                        sum(x.usage.completion_tokens for x in res),
                        sum(x.usage.prompt_tokens_details.cached_tokens or 0 for x in res)))
out["n4"] = {"wall_ms_median": ms([x[0] for x in n4]), "prompt_tokens": n4[0][1],
             "cached_tokens_choice0_median": statistics.median(x[3] for x in n4),
             "completion_tokens_median": statistics.median(x[2] for x in n4)}
out["four_requests"] = {"wall_ms_median": ms([x[0] for x in sep]), "prompt_tokens_sum": sep[0][1],
                        "completion_tokens_median": statistics.median(x[2] for x in sep),
                        "cached_tokens_median": statistics.median(x[3] for x in sep)}
print(json.dumps(out))
