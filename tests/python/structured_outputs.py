"""Structured outputs, log-probabilities, biases and refusals through the official `openai`
client against a running `custody serve` (tests/tests/e2e/serve.rs).

Environment: CUSTODY_URL, CUSTODY_KEY, CUSTODY_MODEL_ID. Prints one JSON object of figures on
the last line of stdout; any failed expectation raises (exit code 1) with the reason.
"""
import json
import math
import os
import re

import jsonschema
import openai
from typing import Annotated

from pydantic import BaseModel, Field

from custody_client import MODEL, check, client

figures = {}


def user(text):
    return [{"role": "user", "content": text}]


# --- The client's own structured-output helper: a pydantic model round-trips. ---------------
# Bounded, as a schema for a 135M model must be: unbounded strings and integers let a small
# model ramble until max_tokens (a `length` finish, which `parse` raises on).
class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)
    rivers: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)


parsed = client.chat.completions.parse(
    model=MODEL, messages=user("Describe Paris."), response_format=City, max_tokens=200, temperature=0
)
check(parsed.choices[0].finish_reason == "stop", f"parse finish {parsed.choices[0].finish_reason}")
city = parsed.choices[0].message.parsed
check(isinstance(city, City), f"parsed: {parsed.choices[0].message}")

# --- json_object: any JSON object. ------------------------------------------------------------
# (A 135M model may nest forever: a cut output says `length`; every finished one is an object.)
finished = 0
for seed in range(6):
    obj = client.chat.completions.create(
        model=MODEL, messages=user("Give me a JSON object about a cat."), max_tokens=160, temperature=0.8,
        seed=seed, response_format={"type": "json_object"},
    )
    c = obj.choices[0]
    check(c.finish_reason in ("stop", "length"), c.finish_reason)
    if c.finish_reason == "stop":
        check(isinstance(json.loads(c.message.content), dict), c.message.content)
        finished += 1
check(finished >= 1, "no json_object output finished")
figures["json_object_finished_of_6"] = finished


# --- A corpus of schemas: every output validates, or says it was cut (`length`). ---------------
def s_str(n=20, **kw):
    return {"type": "string", "maxLength": n, **kw}


def corpus():
    out = []
    for n in range(1, 6):  # flat objects, growing
        props = {f"f{i}": [s_str(), {"type": "integer", "maximum": 999}, {"type": "boolean"}][i % 3] for i in range(n)}
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    for lo, hi in [(0, 10), (-5, 5), (100, 1000), (0, 1)]:  # bounded numbers
        out.append({"type": "object", "properties": {"x": {"type": "integer", "minimum": lo, "maximum": hi}},
                    "required": ["x"], "additionalProperties": False})
        out.append({"type": "object", "properties": {"y": {"type": "number", "minimum": lo, "maximum": hi}},
                    "required": ["y"], "additionalProperties": False})
    for values in [["red", "green", "blue"], ["yes", "no"], [1, 2, 3], ["a", 1, None, True]]:  # enums
        out.append({"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]})
        out.append({"enum": values})
    for lo, hi in [(0, 3), (1, 2), (2, 4)]:  # arrays
        out.append({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": lo, "maxItems": hi})
        out.append({"type": "object", "properties": {"tags": {"type": "array", "items": s_str(8),
                    "minItems": lo, "maxItems": hi}}, "required": ["tags"], "additionalProperties": False})
    for depth in range(1, 5):  # nesting
        s = {"type": "object", "properties": {"leaf": s_str(10)}, "required": ["leaf"], "additionalProperties": False}
        for _ in range(depth):
            s = {"type": "object", "properties": {"child": s}, "required": ["child"], "additionalProperties": False}
        out.append(s)
    person = {"type": "object", "properties": {"name": s_str(), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    out.append({"$defs": {"person": person}, "type": "object",  # $ref
                "properties": {"author": {"$ref": "#/$defs/person"}}, "required": ["author"], "additionalProperties": False})
    out.append({"$defs": {"person": person}, "type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 2})
    out.append({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},  # recursive
                "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}, "required": ["v", "next"],
                "additionalProperties": False}}, "$ref": "#/$defs/node"})
    for alts in [[{"type": "integer", "minimum": -99, "maximum": 99}, s_str()], [{"type": "null"}, {"type": "boolean"}],  # anyOf
                 [person, {"type": "object", "properties": {"id": {"type": "integer", "maximum": 9999}}, "required": ["id"],
                           "additionalProperties": False}]]:
        out.append({"anyOf": alts})
        out.append({"type": "object", "properties": {"a": {"anyOf": alts}}, "required": ["a"], "additionalProperties": False})
    out.append({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False})
    out.append({"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"], "additionalProperties": False})
    out.append({"type": "object", "properties": {"s": s_str(12, minLength=3)}, "required": ["s"], "additionalProperties": False})
    out.append({"type": "object", "properties": {"opt": s_str(), "req": {"type": "boolean"}}, "required": ["req"],
                "additionalProperties": False})
    out.append({"type": "string", "maxLength": 30})
    out.append({"type": "integer", "minimum": 1, "maximum": 6})
    out.append({"type": "boolean"})
    out.append({"type": "null"})
    out.append({"type": "number", "minimum": -1, "maximum": 1})
    out.append({"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3})
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
             "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}
    out.append({"type": "object", "properties": {"points": {"type": "array", "items": point, "maxItems": 3}},
                "required": ["points"], "additionalProperties": False})
    out.append({"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "required": ["date"], "additionalProperties": False})
    return out


schemas = corpus()
check(len(schemas) >= 50, f"{len(schemas)} schemas")
# CUSTODY_SCHEMAS=N: only the first N (a pair's test: the corpus itself is the colocated run's).
schemas = schemas[:int(os.environ.get("CUSTODY_SCHEMAS", len(schemas)))]
valid = cut = 0
for i, schema in enumerate(schemas):
    r = client.chat.completions.create(
        model=MODEL, messages=user("Answer with JSON."), max_tokens=256, temperature=0.7, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": i % 2 == 0}},
    )
    c = r.choices[0]
    if c.finish_reason == "length":
        print(f"schema {i} cut by max_tokens: {c.message.content[:120]!r}")
        cut += 1
        continue
    check(c.finish_reason == "stop", f"schema {i}: finish {c.finish_reason}")
    try:
        jsonschema.validate(json.loads(c.message.content), schema)
    except Exception as e:  # noqa: BLE001 - the reason goes into the failure
        raise AssertionError(f"schema {i} {json.dumps(schema)}: {c.message.content!r}: {e}")
    valid += 1
figures["schemas"] = len(schemas)
figures["schemas_valid"] = valid
figures["schemas_cut_by_length"] = cut
# Every finished output is valid; a cut one says so. A 135M model may still ramble inside a
# schema (a number with endless decimals, a recursive list that never ends): at most 5 here.
check(valid + cut == len(schemas) and cut <= 5, f"{valid} valid, {cut} cut")

# Streamed: the pieces join to a valid document.
schema = schemas[4]
text = "".join(
    ch.choices[0].delta.content or ""
    for ch in client.chat.completions.create(
        model=MODEL, messages=user("Answer with JSON."), max_tokens=256, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    if ch.choices
)
jsonschema.validate(json.loads(text), schema)

# vLLM's structured_outputs extension: regex and choice, text completions too.
raw = client.completions.with_raw_response.create(
    model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0.5, seed=3,
    extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
figures["regex_request"] = raw.headers["x-request-id"]
r = raw.parse()
check(re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text)
r = client.chat.completions.create(model=MODEL, messages=user("Is the sky blue?"), max_tokens=5, temperature=0,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
check(r.choices[0].message.content in ("yes", "no"), r.choices[0].message.content)

# --- logprobs ---------------------------------------------------------------------------------
r = client.chat.completions.create(model=MODEL, messages=user("Say hello."), max_tokens=12, temperature=0,
                                   logprobs=True, top_logprobs=5)
content = r.choices[0].logprobs.content
check(len(content) == r.usage.completion_tokens, f"{len(content)} entries, {r.usage.completion_tokens} tokens")
check("".join(e.token for e in content) == r.choices[0].message.content, "tokens join to the text")
for e in content:
    check(e.logprob <= 0 and len(e.top_logprobs) == 5, f"{e}")
    check(e.top_logprobs[0].token == e.token, "greedy: the top alternative is the sampled token")
    check(all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])), "sorted")
    check(bytes(e.bytes).decode("utf-8", "replace") == e.token, f"bytes {e.bytes} vs {e.token!r}")
    check(sum(math.exp(a.logprob) for a in e.top_logprobs) <= 1.0001, "a distribution")
streamed = []
for ch in client.chat.completions.create(model=MODEL, messages=user("Say hello."), max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=5, stream=True):
    if ch.choices and ch.choices[0].logprobs:
        streamed.extend(ch.choices[0].logprobs.content)
check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], "streamed logprobs")
t = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=3)
lp = t.choices[0].logprobs
check("".join(lp.tokens) == t.choices[0].text, "text tokens join")
check(lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))], f"{lp.text_offset}")
check(all(3 <= len(d) <= 4 and tok in d for d, tok in zip(lp.top_logprobs, lp.tokens)), f"{lp.top_logprobs}")

# --- logit_bias: a banned token never appears. -----------------------------------------------
base = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                 extra_body={"custody_token_ids": True})
first = base.choices[0].model_extra["token_ids"][0]
biased = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                   logit_bias={str(first): -100}, extra_body={"custody_token_ids": True})
check(first not in biased.choices[0].model_extra["token_ids"], "banned token sampled")


# --- Refusals: a 400 whose param names the field. ---------------------------------------------
def refused(param, **kw):
    try:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, **kw)
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{param}: {e.body}")
        return e.body["message"]
    raise AssertionError(f"{param}: accepted {kw}")


refused("n", n=9)  # over serve.max_n (8)
refused("tools", tools=[{"type": "code_interpreter"}])
refused("top_logprobs", logprobs=True, top_logprobs=21)
refused("top_logprobs", top_logprobs=2)
refused("presence_penalty", presence_penalty=3)
refused("logit_bias", logit_bias={"abc": 1})
refused("logit_bias", logit_bias={"1": 500})
refused("frobnicate", extra_body={"frobnicate": 1})
refused("store", store=True)
msg = refused("response_format", response_format={"type": "json_schema", "json_schema": {
    "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}})
check("cannot compile" in msg, msg)
refused("structured_outputs", extra_body={"structured_outputs": {"grammar": "start: nowhere"}})
print(json.dumps(figures))
