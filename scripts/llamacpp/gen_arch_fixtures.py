#!/usr/bin/env python3
"""Tiny synthetic models, one per architecture, and llama.cpp's view of each.

Run on demand, never in CI (it needs llama-cpp-python and the PyPI `gguf` package; ~10 s):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_arch_fixtures.py

Four models, written with the `gguf` package from random weights (fixed seeds: every run writes
byte-identical files), 2 layers, embedding 256, feed-forward 256, context 256, GQA, and a vocabulary
of ~360 tokens learnt by a tiny BPE trainer on the English text below (so most non-ASCII text falls
back to bytes):

  llama-spm  arch llama, SentencePiece vocabulary (<unk> <s> </s>, <0x00>..<0xFF>, merged pieces
             scored -rank, then single characters), add_space_prefix, untied output, 4 heads x 64 /
             2 kv heads, rope base 1e4; an [INST] template modeled on Mistral-7B-Instruct-v0.3's,
             without tools (the system prompt goes into the last user turn). Stands in for
             Mistral / Llama 2 GGUFs.
  llama3     arch llama, byte-level BPE (pre llama-bpe) + Llama 3 control tokens, tied output,
             `rope_freqs.weight`, 4 heads x 64 / 1 kv head, rope base 5e5, the Llama 3 Instruct
             template (as llama-cpp-python's LLAMA3_INSTRUCT_CHAT_TEMPLATE).
  qwen2      arch qwen2, byte-level BPE (pre qwen2) + ChatML control tokens and user-defined
             <tool_call> </tool_call>, Q/K/V biases, tied output, 4 heads x 64 / 2 kv heads, rope
             base 1e6, the Qwen 2.5 Instruct template (default system prompt, tools).
  qwen3      arch qwen3, like qwen2 plus user-defined <think> </think>; per-head Q/K RMSNorm, no
             biases, 8 heads x 64 (Q is 512 wide, embedding 256), 2 kv heads, untied output, rope
             base 1e6, Qwen3-0.6B's template (<think> handling; as in llama.cpp models/templates).
Quantized files (llama.cpp ftype): llama-spm Q4_K_M (15), Q5_K_M (17), Q8_0 (7), Q3_K_M (12),
Q2_K (10); llama3 Q4_K_M, Q6_K (18); qwen2 Q4_K_M, Q5_0 (8); qwen3 Q4_K_M. llama.cpp's mixes on
these 2-layer models (norms F32 throughout): Q4_K_M is Q4_K + Q6_K (output.weight, or token_embd
when the output is tied, and layer 1's attn_v and ffn_down); the llama-spm Q3_K_M is Q3_K
(token_embd, attn_q/k, ffn_gate/up) + Q4_K (attn_output, ffn_down) + Q5_K (attn_v) + Q6_K
(output), its Q2_K is Q2_K (token_embd, attn_q/k, ffn_gate/up) + Q3_K (attn_v, attn_output,
ffn_down) + Q6_K (output).
The BPE vocabularies of llama3 and qwen2/qwen3 come from the same merges (trained on chunks with
digit runs of 1-3, so '12' and '00' exist): the pre-tokenizers differ visibly on digits.

Each model also has a mini sibling, committed in F32 (`<model>.F32.gguf`, no quantization step):
the same architecture, vocabulary, tokenizer metadata, chat template, seed, kinds of tensors
(rope_freqs, Q/K/V biases, Q/K norms + key_length) and tied/untied output, but embedding 64,
head_dim 16 (same head and kv-head counts), 2 layers, and each file under ~450 KB:
  llama-spm  4 heads / 2 kv, feed-forward 96 (untied)
  llama3     4 heads / 1 kv, feed-forward 128, rope_freqs over 8 pairs
  qwen2      4 heads / 2 kv, feed-forward 128, Q/K/V biases
  qwen3      8 heads / 2 kv (Q 128 wide, embedding 64; key_length = value_length = 16), feed-forward
             32 (untied: a narrow FFN keeps it under ~450 KB)
With F32 weights llama.cpp's CPU backend multiplies F32 weights by F32 activations: no activation
quantization (the quantized files' activations are rounded to Q8_0/Q8_K first) and no weight
rounding, only F32 arithmetic and the default F16 KV cache. So an engine that implements the
architecture exactly, with the same summation order, gives llama.cpp's logits bit for bit: the
minis separate architecture bugs from quantization differences. (The F32 bases of the big models
are ~4 MB each, too big to commit.)

Weights: matrices ~N(0, g/sqrt(cols)) with g = 1, except g = 2 for attn_q/attn_k (sharp,
position-dependent attention) and ffn_down, g = 4 for an untied output.weight (logit std ~4, so
greedy margins are clear); norms 1 + N(0, 0.1) (q/k norms 1 + N(0, 0.3)); biases N(0, 0.3).
Embeddings N(0, 1) when untied; when tied N(0, 0.05 * sqrt(256 / n_embd)) (0.05 for the big
models, 0.1 for the minis: the logit std, ~output_norm * std * sqrt(n_embd), stays ~4) with
output_norm ~5 (a tied model with big embeddings keeps predicting its input token, or one fixed
token, over and over). rope_freqs (llama3): 1 for the fastest quarter of the rotary pairs, then
rising linearly to 8.

The F32 base models go to ~/.cache/custody/arch/ (not committed); llama.cpp's own quantizer
(`llama_model_quantize`) writes tests/fixtures/arch/<model>.<TYPE>.gguf, the mini F32 model is
written directly as tests/fixtures/arch/<model>.F32.gguf (TYPE F32, ftype 0), and beside each:
  <model>.<TYPE>.json  sha256, prompt ids (llama.cpp's tokenization, default BOS handling) +
                       llama.cpp's greedy continuation, argmax and top1-top2 margin per position
  <model>.<TYPE>.npy   llama.cpp's teacher-forced logits at every position, float32 [n, vocab]
and per model:
  <model>.tokenize.json  a corpus tokenized by llama.cpp (special tokens parsed), without and
                         with BOS, and llm.detokenize of the no-BOS ids (bytes as int lists)
  <model>.chat.json      the chat template rendered as llama-cpp-python's Jinja2ChatFormatter
                         does (add_generation_prompt) and llama.cpp's ids for the rendered text
                         (qwen3 also: `think_case`, an earlier assistant turn with a <think> block)
The logits are one batch evaluation (`llm.eval(ids)`); the continuation comes from llama.cpp's
token-by-token decoding, whose logits on K-quant files differed from the batch ones by up to ~0.4
here (Q8_0/Q5_0: identical), so a continuation token need not be the batch argmax where margins are
small. The tokenize/chat fixtures come from the first quantized file (the minis share its
vocabulary and template).
"""
import ctypes, hashlib, json, re
from collections import Counter
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGUFWriter
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/arch"
DIR = Path.home() / ".cache/custody/arch"
GENERATOR = "scripts/llamacpp/gen_arch_fixtures.py"
FTYPES = {"F32": 0, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q5_0": 8, "Q3_K_M": 12,
          "Q2_K": 10}
N_CTX = 256
BIG = dict(n_embd=256, n_ff=256, n_layer=2)  # the quantized models' dims (heads: per model)
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern "
          "room he could see")
N_GEN = 16
# Logit scale ~4 so that greedy argmaxes have clear margins: an untied output.weight of std 4/sqrt(256);
# for tied embeddings, small embeddings (so the residual stream is not dominated by the input token's
# own embedding, which makes a tied model predict its input again and again) and a final norm of ~5,
# as trained tied models have.
OUT_GAIN = 4.0
TIED_EMBD_STD, TIED_OUT_NORM = 0.05, 5.0
QK_GAIN, FFN_GAIN = 2.0, 2.0

TRAIN = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern room he
could see the whole bay, the fishing boats coming home, and the long line of the coast. He had
kept the light for thirty years, and in all that time the lamp had never failed. When the storm
came in from the west, the waves broke over the rocks and the wind shook the windows, but the
keeper stayed at his post. He wrote in his log: "Wind from the west, rain, heavy sea. Light
burning well." In the morning the sea was calm again, and the gulls were back on the water.
The children from the village often came to visit him. They asked him about the ships he had
seen and the people he had saved. He told them stories about the old days, when there were no
engines and the boats had only sails and oars. There was the night of the great fog, when a
ship with 120 people on board came too close to the rocks, and the keeper rang the bell for
three hours until she turned away. There was the winter the bay froze and the supply boat could
not come, and he lived on bread, fish and tea for six weeks. The children loved these stories,
and they always wanted to hear them again. "Tell us about the fog," they would say, and he
would smile and begin. He knew that one day the light would be run by a machine, and that no
keeper would be needed. But he did not think about that very often. There was always work to
do: the glass to clean, the brass to polish, the oil to carry up the stairs, and the log to
keep. Each evening, as the sun went down behind the hills, he climbed the stairs and lit the
lamp, and its light went out across the water to the ships at sea. The log for 1923 lists 120
ships, the log for 1924 lists 125, and by 2000 there were 1000 boats a year and 100 ships a day.
"""

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

MODELS = {
    "llama-spm": dict(arch="llama", vocab="spm", n_head=4, n_kv=2, head_dim=64, tied=False,
                      rope_base=10000.0, eps=1e-5, seed=1001, template=MISTRAL_TEMPLATE,
                      types=["Q4_K_M", "Q5_K_M", "Q8_0", "Q3_K_M", "Q2_K"],
                      mini=dict(n_embd=64, n_ff=96, head_dim=16),
                      special_text="<s>[INST] hi [/INST] hello</s>"),
    "llama3": dict(arch="llama", vocab="llama-bpe", n_head=4, n_kv=1, head_dim=64, tied=True,
                   rope_base=500000.0, eps=1e-5, seed=1002, template=LLAMA3_TEMPLATE,
                   rope_freqs=True, types=["Q4_K_M", "Q6_K"],
                   mini=dict(n_embd=64, n_ff=128, head_dim=16),
                   special_text="<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi"
                                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": dict(arch="qwen2", vocab="qwen2", n_head=4, n_kv=2, head_dim=64, tied=True,
                  rope_base=1000000.0, eps=1e-6, seed=1003, template=QWEN25_TEMPLATE, bias=True,
                  types=["Q4_K_M", "Q5_0"],
                  mini=dict(n_embd=64, n_ff=128, head_dim=16),
                  special_text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                               "<tool_call>\n{\"name\": \"f\"}\n</tool_call><|endoftext|>"),
    "qwen3": dict(arch="qwen3", vocab="qwen2", n_head=8, n_kv=2, head_dim=64, tied=False,
                  rope_base=1000000.0, eps=1e-6, seed=1004, template=QWEN3_TEMPLATE, qk_norm=True,
                  think=True, types=["Q4_K_M"],  # Q6_K too would pass the ~6 MB budget
                  # Q stays wider than the embedding (8 x 16 = 128 > 64); the FFN is narrow so
                  # that the untied mini stays under ~450 KB
                  mini=dict(n_embd=64, n_ff=32, head_dim=16),
                  special_text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
                               "hmm\n</think>\n\nhello<|im_end|>"),
}

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces and trailing spaces   ",
    "multiple   spaces\n\nnew lines\tand\t\ttabs\n",
    "digits 12345 3.14159 and 1,000,000 or 0007",
    "don't we'll I'M they've she'd YOU'RE it's",
    "punctuation!!! ... ??? --- ((( ))) <<>> {}[] @#$%^&*",
    "naïve café Ærøskøbing Straße jalapeño",
    "Ελληνικά γράμματα και русский язык",
    "你好，世界",
    "日本語のテキスト、カタカナとひらがな。",
    "emoji 🙂👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈",
    "def f(x):\n    return x ** 2\r\n",
    " ",
    "\n\n\n",
    "",
]

MESSAGES = [
    {"role": "system", "content": "You are a lighthouse keeper."},
    {"role": "user", "content": "What do you see from the lantern room?"},
    {"role": "assistant", "content": "The whole bay, and the boats coming home."},
    {"role": "user", "content": "Tell us about the fog."},
]


def bytes_to_unicode():
    """GPT-2's byte -> printable character map, in GPT-2's vocabulary order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_bpe(words, n_merges):
    """Greedy BPE over {tuple of symbols: count}: most frequent pair first, ties by the pair's
    text. Returns the merges (a, b) in rank order."""
    words = dict(words)
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return merges


def spm_vocab():
    """<unk> <s> </s>, 256 byte tokens, then pieces by score: merged pieces (-rank), then the
    single characters of the training text (lowest scores), as SentencePiece BPE vocabularies are."""
    words = Counter(tuple("▁" + w) for w in TRAIN.split())
    merges = train_bpe(words, 64)
    pieces = []
    for a, b in merges:
        if a + b not in pieces:
            pieces.append(a + b)
    chars = sorted({c for w in words for c in w})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) + len(chars))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    return dict(model="llama", tokens=tokens, scores=scores, types=types, bos=1, eos=2, unk=0,
                add_bos=True)


def bpe_vocab(pre, think=False):
    """Byte-level BPE: the 256 byte characters, merge results in rank order, special tokens."""
    b2u = bytes_to_unicode()
    split = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    words = Counter(tuple(b2u[b] for b in m.encode()) for m in split.findall(TRAIN))
    merges = train_bpe(words, 100)
    tokens = list(b2u.values())
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    n = len(tokens)
    if pre == "llama-bpe":
        special = [("<|begin_of_text|>", 3), ("<|end_of_text|>", 3), ("<|start_header_id|>", 3),
                   ("<|end_header_id|>", 3), ("<|eot_id|>", 3)]
    else:  # Qwen: ChatML control tokens, <tool_call>/<think> are user-defined (special: false)
        special = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3),
                   ("<tool_call>", 4), ("</tool_call>", 4)]
        if think:
            special += [("<think>", 4), ("</think>", 4)]
    tokens += [t for t, _ in special]
    types = [1] * n + [ty for _, ty in special]
    ids = {t: i for i, t in enumerate(tokens)}
    v = dict(model="gpt2", pre=pre, tokens=tokens, types=types,
             merges=[f"{a} {b}" for a, b in merges])
    if pre == "llama-bpe":
        v.update(bos=ids["<|begin_of_text|>"], eos=ids["<|eot_id|>"], add_bos=True)
    else:
        v.update(bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"], pad=ids["<|endoftext|>"],
                 add_bos=False)
    return v


def write_base(name, cfg, path, mini=False):
    """The F32 model: the big base (quantized later), or with mini=True the committed mini
    variant (cfg["mini"]: smaller dims, same vocabulary, template and kinds of tensors)."""
    dims = {**BIG, **{k: cfg[k] for k in ("n_head", "n_kv", "head_dim")}}
    if mini:
        dims.update(cfg["mini"])
    n_embd, n_ff, n_layer = dims["n_embd"], dims["n_ff"], dims["n_layer"]
    hd, nh, nkv = dims["head_dim"], dims["n_head"], dims["n_kv"]
    rng = np.random.default_rng(cfg["seed"])
    v = spm_vocab() if cfg["vocab"] == "spm" else bpe_vocab(cfg["vocab"], cfg.get("think", False))
    arch = cfg["arch"]
    n_vocab = len(v["tokens"])

    def mat(rows, cols, gain=1.0):  # ~N(0, gain/sqrt(cols)): gain-RMS outputs from unit-RMS inputs
        return (gain * rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n, std=0.1):
        return (1.0 + std * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(str(path), arch=arch)
    w.add_name(f"custody-arch-{name}" + ("-mini" if mini else ""))
    w.add_file_type(0)  # ALL_F32
    w.add_context_length(N_CTX)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_rope_dimension_count(hd)
    if nh * hd != n_embd:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "llama":
        w.add_vocab_size(n_vocab)
    w.add_tokenizer_model(v["model"])
    if "pre" in v:
        w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    w.add_token_types(v["types"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    if "unk" in v:
        w.add_unk_token_id(v["unk"])
    if "pad" in v:
        w.add_pad_token_id(v["pad"])
    w.add_add_bos_token(v["add_bos"])
    if v["model"] == "llama":
        w.add_add_space_prefix(True)
    w.add_chat_template(cfg["template"])

    # Tied: the logit std is out_norm * embd_std * sqrt(n_embd), ~4 at every width.
    embd_std, out_norm = ((TIED_EMBD_STD * np.sqrt(BIG["n_embd"] / n_embd), TIED_OUT_NORM)
                          if cfg["tied"] else (1.0, 1.0))
    w.add_tensor("token_embd.weight",
                 (embd_std * rng.standard_normal((n_vocab, n_embd))).astype(np.float32))
    w.add_tensor("output_norm.weight", out_norm * norm(n_embd))
    if not cfg["tied"]:
        w.add_tensor("output.weight", mat(n_vocab, n_embd, OUT_GAIN))
    if cfg.get("rope_freqs"):  # Llama 3 style: 1 for the fastest quarter of pairs, rising to 8
        n_pairs = hd // 2
        n_fast = n_pairs // 4
        w.add_tensor("rope_freqs.weight", np.concatenate(
            [np.ones(n_fast), np.linspace(1.0, 8.0, n_pairs - n_fast)]).astype(np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(n_embd))
        w.add_tensor(p + "attn_q.weight", mat(nh * hd, n_embd, QK_GAIN))
        w.add_tensor(p + "attn_k.weight", mat(nkv * hd, n_embd, QK_GAIN))
        w.add_tensor(p + "attn_v.weight", mat(nkv * hd, n_embd))
        if cfg.get("bias"):
            w.add_tensor(p + "attn_q.bias", (0.3 * rng.standard_normal(nh * hd)).astype(np.float32))
            w.add_tensor(p + "attn_k.bias", (0.3 * rng.standard_normal(nkv * hd)).astype(np.float32))
            w.add_tensor(p + "attn_v.bias", (0.3 * rng.standard_normal(nkv * hd)).astype(np.float32))
        if cfg.get("qk_norm"):
            w.add_tensor(p + "attn_q_norm.weight", norm(hd, 0.3))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd, 0.3))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, nh * hd))
        w.add_tensor(p + "ffn_norm.weight", norm(n_embd))
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff, FFN_GAIN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src, dst, ftype):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize {dst.name}: {rc}"


def dump(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n")


def logits_fixture(name, type_name, path):
    llm = Llama(str(path), n_ctx=256, n_batch=256, n_threads=2, logits_all=True,
                flash_attn=False, verbose=False)
    ids = llm.tokenize(PROMPT.encode())  # llama.cpp's default: BOS if the vocabulary asks for it
    gen = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        gen.append(int(tok))
        if len(gen) == N_GEN:
            break
    seq = list(ids) + gen
    llm.reset()
    llm.eval(seq)
    logits = np.array(llm.scores[: len(seq)], dtype=np.float32)
    top2 = np.sort(logits, axis=1)[:, -2:]
    np.save(OUT / f"{name}.{type_name}.npy", logits)
    meta = {
        "generator": GENERATOR,
        "llama_cpp_python": llama_cpp.__version__,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "ftype": FTYPES[type_name],
        "flash_attn": False,
        "prompt": PROMPT,
        "ids": seq,
        "n_prompt": len(ids),
        "llamacpp_argmax": logits.argmax(axis=1).astype(int).tolist(),
        "margin": [round(float(m), 5) for m in top2[:, 1] - top2[:, 0]],
    }
    dump(OUT / f"{name}.{type_name}.json", meta)
    del llm
    return meta


def text_fixtures(name, cfg, path):
    llm = Llama(str(path), vocab_only=True, verbose=False)
    entries = []
    for text in CORPUS + [cfg["special_text"]]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        entries.append({
            "text": text,
            "ids": ids,
            "ids_bos": llm.tokenize(text.encode(), add_bos=True, special=True),
            "detokenize": list(llm.detokenize(ids)),
            "detokenize_special": list(llm.detokenize(ids, special=True)),
        })
    dump(OUT / f"{name}.tokenize.json", {
        "generator": GENERATOR, "llama_cpp_python": llama_cpp.__version__, "file": path.name,
        "tokenize": "llm.tokenize(text.encode(), add_bos=False|True, special=True)",
        "detokenize": "list(llm.detokenize(ids[, special=True])) of the add_bos=False ids, bytes",
        "texts": entries})

    # As Llama.__init__ builds its Jinja2ChatFormatter from the GGUF's chat template.
    bos = llm._model.token_get_text(llm.token_bos())
    eos = llm._model.token_get_text(llm.token_eos())
    fmt = Jinja2ChatFormatter(template=cfg["template"], eos_token=eos, bos_token=bos,
                              add_generation_prompt=True)
    prompt = fmt(messages=MESSAGES).prompt
    dump(OUT / f"{name}.chat.json", {
        "generator": GENERATOR, "llama_cpp_python": llama_cpp.__version__, "file": path.name,
        "messages": MESSAGES, "add_generation_prompt": True, "bos_token": bos, "eos_token": eos,
        "rendered": prompt,
        "ids": llm.tokenize(prompt.encode(), add_bos=False, special=True),
        **({"think_case": think_case(llm, fmt)} if cfg.get("think") else {})})
    del llm


def think_case(llm, fmt):
    """Qwen 3: an earlier assistant turn's <think> block is dropped by the template."""
    messages = [dict(m) for m in MESSAGES]
    messages[2]["content"] = "<think>\nThey ask about the view.\n</think>\n\n" + messages[2]["content"]
    prompt = fmt(messages=messages).prompt
    return {"messages": messages, "rendered": prompt,
            "ids": llm.tokenize(prompt.encode(), add_bos=False, special=True)}


README = """\
# Synthetic per-architecture fixtures

Generated by `scripts/llamacpp/gen_arch_fixtures.py` (random weights, fixed seeds; see its
docstring). CI never regenerates them; to regenerate (llama-cpp-python needed):

    /opt/llamaref/venv/bin/python scripts/llamacpp/gen_arch_fixtures.py

- `<model>.<TYPE>.gguf`: a 2-layer model quantized by llama.cpp's `llama_model_quantize`:
  llama-spm Q4_K_M, Q5_K_M, Q8_0, Q3_K_M, Q2_K; llama3 Q4_K_M, Q6_K; qwen2 Q4_K_M, Q5_0;
  qwen3 Q4_K_M. The K mixes put other types on some tensors (Q3_K_M: Q3_K, Q4_K, Q5_K, Q6_K;
  Q2_K: Q2_K, Q3_K, Q6_K; Q4_K_M: Q4_K, Q6_K); an untied output.weight is Q6_K and token_embd
  has the mix's base type, a tied token_embd is Q6_K.
- `<model>.F32.gguf` (TYPE F32, ftype 0): a mini sibling of each model, all tensors F32, written
  directly (no quantization): same architecture, vocabulary, tokenizer metadata, chat template,
  kinds of tensors (rope_freqs, Q/K/V biases, Q/K norms) and tied/untied output, but embedding
  64, head_dim 16, 2 layers, ~380-450 KB. llama.cpp multiplies F32 weights by F32 activations
  (no activation quantization, no weight rounding), so an engine that implements the
  architecture exactly gives its logits bit for bit: these separate architecture bugs from
  quantization differences.
- `<model>.<TYPE>.json`: sha256 of the .gguf, prompt + greedy continuation ids (`ids`,
  `n_prompt`), llama.cpp's argmax and top1-top2 margin at every position (flash attention off).
- `<model>.<TYPE>.npy`: llama.cpp's logits at every position of `ids`, float32 [len(ids), vocab].
- `<model>.tokenize.json`: llama.cpp's ids for a corpus (special tokens parsed; without and with
  BOS) and `llm.detokenize` of the no-BOS ids (bytes).
- `<model>.chat.json`: the GGUF's chat template rendered as llama-cpp-python's
  Jinja2ChatFormatter does, and llama.cpp's ids for the rendered text.
"""


def main():
    DIR.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "README.md").write_text(README)
    for name, cfg in MODELS.items():
        base = DIR / f"{name}.F32.gguf"
        write_base(name, cfg, base)
        files = []
        for type_name in cfg["types"]:
            path = OUT / f"{name}.{type_name}.gguf"
            quantize(base, path, FTYPES[type_name])
            meta = logits_fixture(name, type_name, path)
            files.append(path)
            gen = meta["ids"][meta["n_prompt"]:]
            print(f"{name}.{type_name}: {path.stat().st_size} bytes {meta['sha256'][:12]} "
                  f"{meta['n_prompt']}+{len(gen)} tokens, {len(set(gen))} distinct generated, "
                  f"min margin {min(meta['margin']):.3f}")
        text_fixtures(name, cfg, files[0])
        # The committed mini F32 model: written directly, no quantization step.
        path = OUT / f"{name}.F32.gguf"
        write_base(name, cfg, path, mini=True)
        meta = logits_fixture(name, "F32", path)
        gen = meta["ids"][meta["n_prompt"]:]
        print(f"{name}.F32 (mini): {path.stat().st_size} bytes {meta['sha256'][:12]} "
              f"{meta['n_prompt']}+{len(gen)} tokens, {len(set(gen))} distinct generated, "
              f"min margin {min(meta['margin']):.3f}")


if __name__ == "__main__":
    main()
