"""Tool calling through the official `openai` client against a running `custody serve`
(tests/tests/e2e/serve.rs): a call forced by `tool_choice` (`required`, a named function),
whole and streamed, its arguments validated against the function's schema; the loop's next
turn with the call and its result in the history; and the refusals, each naming its field.

Environment: CUSTODY_URL, CUSTODY_KEY, CUSTODY_MODEL_ID. Prints one JSON object of figures on
the last line of stdout; any failed expectation raises (exit code 1) with the reason.
"""
import json

import jsonschema
import openai

from custody_client import MODEL, check, client

figures = {}

# Bounded, as schemas for small (or random) models must be: unbounded strings and numbers let
# them ramble until max_tokens.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 999},
    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Oslo?"}]


def checked_call(call, want=None):
    check(call.type == "function", call)
    name = call.function.name
    check(name in SCHEMAS and (want is None or name == want), f"called {name}, wanted {want}")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return name, args


# --- A forced call, whole: `required`, then a named function. ---------------------------------
raw = client.chat.completions.with_raw_response.create(
    model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
    max_tokens=120, temperature=0)
figures["required_request"] = raw.headers["x-request-id"]
r = raw.parse()
c = r.choices[0]
check(c.finish_reason == "tool_calls", f"finish {c.finish_reason}: {c.message}")
check(len(c.message.tool_calls) == 1, c.message)
first_call = c.message.tool_calls[0]
name, args = checked_call(first_call)
figures["required"] = {"name": name, "arguments": args}

named = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
    tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
check(named.choices[0].finish_reason == "tool_calls", named.choices[0])
checked_call(named.choices[0].message.tool_calls[0], "add")

# --- The same, streamed: `delta.tool_calls` accumulate into the same call. ---------------------
stream = client.chat.completions.create(
    model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0, stream=True,
    tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
calls, finish, content = {}, None, ""
for chunk in stream:
    for ch in chunk.choices:
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
check(finish == "tool_calls", f"streamed finish {finish}")
check(content == "", f"no text around a forced call: {content!r}")
whole = named.choices[0].message.tool_calls[0].function
check(calls == {0: {"name": whole.name, "arguments": whole.arguments}},
      f"streamed {calls} vs whole {whole}")

# --- The loop's next turn: the call and its result in the history, then an answer. ------------
history = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [first_call.model_dump()]},
    {"role": "tool", "tool_call_id": first_call.id, "content": json.dumps({"temperature": 4, "sky": "rain"})},
]
answer = client.chat.completions.create(
    model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0)
a = answer.choices[0]
check(a.finish_reason in ("stop", "length") and isinstance(a.message.content, str) and not a.message.tool_calls,
      f"answer: {a}")
auto = client.chat.completions.create(
    model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0.7, seed=3)
au = auto.choices[0]
check(au.finish_reason in ("stop", "length", "tool_calls"), au)
if au.message.tool_calls:
    for call in au.message.tool_calls:
        checked_call(call)
figures["auto_finish"] = au.finish_reason


# --- Refusals name their field. ---------------------------------------------------------------
def refused(param, **kw):
    try:
        client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **kw})
    except openai.BadRequestError as e:
        got = (e.body or {}).get("param")
        check(got == param, f"{kw}: param {got!r}, wanted {param!r}: {e}")
        return
    raise AssertionError(f"{kw} was not refused")


refused("tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "absent"}})
refused("tools", tools=[{"type": "function", "function": {
    "name": "bad", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/absent"}}}}}],
    tool_choice="required")
refused("tools", tools=[{"type": "function", "function": {"name": "has space"}}])
refused("response_format", tools=TOOLS, response_format={"type": "json_object"})
refused("messages", messages=[{"role": "tool", "content": "4"}])
print(json.dumps(figures))
