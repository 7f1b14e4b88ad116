"""The official `openai` client against a running `custody serve` (tests/tests/e2e/serve.rs).

Environment: CUSTODY_URL (http://host:port), CUSTODY_KEY (a tenant's key), CUSTODY_KEY_TINY
(a tenant with max_concurrent = 1), CUSTODY_MODEL_ID, CUSTODY_CONTEXT (tokens).
Prints one JSON object (request ids by case, for the audit check) on the last line of stdout;
any failed expectation raises (exit code 1) with the reason.
"""
import json
import os
import urllib.error
import urllib.request

import openai
from openai import OpenAI

URL = os.environ["CUSTODY_URL"]
KEY = os.environ["CUSTODY_KEY"]
KEY_TINY = os.environ["CUSTODY_KEY_TINY"]
MODEL = os.environ["CUSTODY_MODEL_ID"]
CONTEXT = int(os.environ["CUSTODY_CONTEXT"])

# No retries: a 429 or 5xx must surface here, not be hidden by the client's retry loop.
client = OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300)
ids = {}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# Models.
models = client.models.list()
check([m.id for m in models.data] == [MODEL], f"models: {models}")

# Chat, whole: greedy, with usage, finish_reason and the request id header.
messages = [{"role": "user", "content": "Name three rivers in Europe."}]
raw = client.chat.completions.with_raw_response.create(
    model=MODEL, messages=messages, max_tokens=24, temperature=0
)
chat = raw.parse()
ids["chat"] = raw.headers["x-request-id"]
check(ids["chat"].startswith("req-"), f"x-request-id: {ids['chat']}")
text = chat.choices[0].message.content
check(chat.choices[0].message.role == "assistant", "role")
check(len(text) > 0, "chat text is empty")
check(chat.choices[0].finish_reason in ("stop", "length"), chat.choices[0].finish_reason)
check(chat.usage.prompt_tokens > 5 and 0 < chat.usage.completion_tokens <= 24, f"usage {chat.usage}")
check(chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, "total")

# Chat, streamed: the same greedy request yields the same text, piece by piece.
pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
check(len(pieces) > 1, f"stream came in {len(pieces)} pieces")
check("".join(pieces) == text, f"streamed {''.join(pieces)!r} != whole {text!r}")
check(finish == chat.choices[0].finish_reason, f"stream finish {finish}")
check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, f"stream usage {usage}")

# Completions, whole and streamed.
comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
check(len(comp.choices[0].text) > 0 and comp.usage.completion_tokens > 0, f"completion {comp}")
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    if c.choices
)
check(streamed == comp.choices[0].text, f"{streamed!r} != {comp.choices[0].text!r}")

# Stop sequence: cut before it, finish_reason stop.
full = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=16, temperature=0)
full_text = full.choices[0].text
check("," in full_text, f"need a comma to stop at: {full_text!r}")
cut = client.completions.create(
    model=MODEL, prompt="One, two, three, four,", max_tokens=16, temperature=0, stop=[","]
)
check(cut.choices[0].finish_reason == "stop", f"stop finish {cut.choices[0].finish_reason}")
check(cut.choices[0].text == full_text.split(",")[0], f"{cut.choices[0].text!r} vs {full_text!r}")

# Seeded sampling is reproducible; top_p accepted.
a = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
b = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
check(a.choices[0].text == b.choices[0].text, "same seed, different text")

# Wrong key: 401 with OpenAI's error body.
try:
    OpenAI(base_url=URL + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    raise AssertionError("wrong key accepted")
except openai.AuthenticationError as e:
    check(e.status_code == 401, f"status {e.status_code}")
    check(e.body["code"] == "invalid_api_key", f"body {e.body}")
    ids["wrong_key"] = e.response.headers["x-request-id"]

# Over-length prompt: 400 that says what the limit is and what was asked.
long_prompt = "hello " * (CONTEXT + 100)
try:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=long_prompt, max_tokens=8)
    raise AssertionError("over-length prompt accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400, f"status {e.status_code}")
    msg = e.body["message"]
    check(f"maximum context length is {CONTEXT} tokens" in msg, msg)
    check("in the prompt" in msg, msg)
    check(e.body["code"] == "context_length_exceeded", f"code {e.body}")
    ids["over_length"] = e.response.headers["x-request-id"]

# Malformed bodies (sent raw: the client would not produce them): 400 and a JSON error.
for body in [b"{", b"not json", b'{"messages": "nope"}', b"\xff\xfe\xfd", b'{"model": "' + MODEL.encode() + b'"}']:
    req = urllib.request.Request(URL + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60)
        raise AssertionError(f"{body!r} accepted")
    except urllib.error.HTTPError as r:
        text = r.read()
        check(r.code == 400, f"{body!r}: {r.code} {text!r}")
        check(r.headers["content-type"] == "application/json", f"{body!r}: {r.headers}")
        err = json.loads(text)["error"]
        check(isinstance(err["message"], str) and len(err["message"]) > 10, f"{body!r}: {err}")

# Unknown model: 404 model_not_found.
try:
    client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    check(e.body["code"] == "model_not_found", f"{e.body}")

# Per-tenant concurrency limit: while one stream of the tiny tenant is open, a second is 429.
tiny = OpenAI(base_url=URL + "/v1", api_key=KEY_TINY, max_retries=0, timeout=300)
first = tiny.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=48, temperature=0, stream=True)
it = iter(first)
next(it)  # the first chunk arrived: the request holds its slot
try:
    tiny.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    raise AssertionError("second concurrent request of a max_concurrent=1 tenant accepted")
except openai.RateLimitError as e:
    check(e.status_code == 429 and e.body["code"] == "rate_limit_exceeded", f"{e.body}")
    check("retry-after" in e.response.headers, "429 without Retry-After")
for _ in it:
    pass
ok = tiny.completions.create(model=MODEL, prompt="hi", max_tokens=2)
check(ok.usage.completion_tokens >= 1, "slot not released after the stream ended")

# Per-tenant token budget (the tiny tenant has 1000 tokens per minute): prompt + max_tokens
# above it is 429 with a message that says so.
try:
    tiny.completions.create(model=MODEL, prompt="hi", max_tokens=1500)
    raise AssertionError("request above the tenant's token budget accepted")
except openai.RateLimitError as e:
    check("tokens per minute" in e.body["message"], f"{e.body}")

# ... but a prompt longer than the context is the 400 that says so, not a 429 about the budget.
try:
    tiny.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8)
    raise AssertionError("over-length prompt accepted")
except openai.BadRequestError as e:
    check(e.body["code"] == "context_length_exceeded", f"{e.body}")

print(json.dumps(ids))
