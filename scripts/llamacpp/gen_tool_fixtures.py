"""Tool-calling renderings of reference: each template Custody runs tools with, rendered by
llama-cpp-python's Jinja2ChatFormatter (the `tools` it passes to the template, Jinja2's
`tojson`), over a conversation with a tool call and its result.

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_tool_fixtures.py

Writes tests/fixtures/tools/<case>.json: the model file, the template file (null: the GGUF's
own), bos/eos, messages, tools, `rendered` (add_generation_prompt true) and `ids` (llama.cpp's
tokenization of `rendered` with the tiny model's vocabulary: no BOS added, special tokens
parsed), for the first turn (no call yet) and for the follow-up (the call and its result in the
history). Checked by e2e::arch_models::tool_chats_render_as_llama_cpp_python_does and, through
the HTTP API, by e2e::serve::tool_calling_loop_on_each_architectures_tiny_model. CI never runs
this script.
"""
import json
import pathlib
import sys

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "llamacpp"))
from gen_arch_fixtures import QWEN25_TEMPLATE, QWEN3_TEMPLATE  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "tools"
ARCH = ROOT / "tests" / "fixtures" / "arch"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city <with 'quotes' & ampersands>",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
FIRST = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Oslo?"},
]
FOLLOW_UP = FIRST + [
    # As Custody hands history to templates: content "" for a call-only turn, arguments parsed.
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 4, \"sky\": \"rain\"}"},
]

CASES = [
    # (case, arch model whose bos/eos and vocabulary it uses, template file or None, template)
    ("qwen2", "qwen2", None, QWEN25_TEMPLATE),
    ("qwen3", "qwen3", None, QWEN3_TEMPLATE),
    ("llama3", "llama3", "llama3-tools.jinja", None),
    ("mistral", "llama-spm", "mistral-tools.jinja", None),
]


def main():
    for case, model, template_file, template in CASES:
        chat = json.loads((ARCH / f"{model}.chat.json").read_text())
        if template_file:
            template = (OUT / template_file).read_text()
        fmt = Jinja2ChatFormatter(template=template, eos_token=chat["eos_token"],
                                  bos_token=chat["bos_token"], add_generation_prompt=True)
        llm = Llama(str(ARCH / chat["file"]), vocab_only=True, verbose=False)
        turns = []
        for messages in (FIRST, FOLLOW_UP):
            rendered = fmt(messages=messages, tools=TOOLS).prompt
            ids = llm.tokenize(rendered.encode(), add_bos=False, special=True)
            turns.append({"messages": messages, "rendered": rendered, "ids": ids})
        del llm
        out = {"generator": "scripts/llamacpp/gen_tool_fixtures.py",
               "llama_cpp_python": llama_cpp.__version__, "file": chat["file"],
               "template_file": template_file, "bos_token": chat["bos_token"],
               "eos_token": chat["eos_token"], "tools": TOOLS, "turns": turns}
        (OUT / f"{case}.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(case, [(len(t["rendered"]), len(t["ids"])) for t in turns])


if __name__ == "__main__":
    main()
