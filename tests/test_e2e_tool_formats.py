"""Tool-call formats other than Hermes end to end: a real Tulip process behind one real Ivy.

For each format a tiny random decoder saved with `transformers`, a byte-level BPE
``tokenizer.json`` built here with HF `tokenizers`, and a chat template written here in
its family's style (what `ivy.tools` knows the format by):

- ``llama3_json`` (a ``LlamaForCausalLM``): tools in a system turn, an assistant's call
  written as ``{"name": ..., "parameters": {...}}``, a tool's answer under the ``ipython``
  header;
- ``mistral`` (a ``MistralForCausalLM``): tools in ``[AVAILABLE_TOOLS]``, calls as
  ``[TOOL_CALLS]`` then a JSON list, a tool's answer in ``[TOOL_RESULTS]``; the tag is a
  special token, so the decoded answer is the list alone.

``tool_choice: auto`` reads such an answer as calls (vLLM's parser of that name): the
answer is held to the calls' shape here by a ``response_format`` (a tiny random model
writes no call of its own), whole and streamed, and a conversation with an earlier call
and its answer reaches the model as `transformers`' template renders it, its greedy
answer content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_configs
import torch
import transformers
from ivy_process import serve_dirs

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_TEMPLATE = """
{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}
{{- 'To use a function, answer with {"name": ..., "parameters": ...} alone. Functions:\\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
MISTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
MISTRAL_TEMPLATE = """
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] ' + ({"content": message.content, "call_id": message.tool_call_id} | tojson) + '[/TOOL_RESULTS]' }}
{%- elif message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{{- ({"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson) }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- else %}
{{- message.content + eos_token }}
{%- endif %}
{%- endfor %}
"""
CORPUS = [
    "What is the weather in Oslo? It is sunny and cold.",
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather."}}',
    "Environment: ipython. To use a function, answer with JSON alone.",
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, -3 C."},
]
ARGUMENTS = TOOLS[0]["function"]["parameters"]


def _call_schema(key: str) -> dict[str, Any]:
    """A get_weather call's shape, its arguments under ``key``."""
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["get_weather"]}, key: ARGUMENTS},
        "required": ["name", key],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Format:
    """A family's model and template, and the shape its calling answers are held to."""

    config: type
    specials: list[str]
    template: str
    bos: str
    eos: str
    calls: dict[str, Any]


FORMATS = {
    "llama3_json": Format(
        transformers.LlamaConfig,
        LLAMA3_SPECIALS,
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        "<|eot_id|>",
        _call_schema("parameters"),
    ),
    "mistral": Format(
        transformers.MistralConfig,
        MISTRAL_SPECIALS,
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        {"type": "array", "items": _call_schema("arguments"), "minItems": 1, "maxItems": 1},
    ),
}
MAX_TOKENS = 96


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt(request: pytest.FixtureRequest) -> Format:
    return FORMATS[request.param]


@pytest.fixture(scope="module")
def model_dir(fmt: Format, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools")
    vocab = tiny_configs.byte_bpe(
        path,
        CORPUS,
        fmt.specials,
        400,
        chat_template=fmt.template,
        bos_token=fmt.bos,
        eos_token=fmt.eos,
        model_max_length=2048,
    )
    torch.manual_seed(3)
    ids = {"bos_token_id": fmt.specials.index(fmt.bos), "eos_token_id": fmt.specials.index(fmt.eos)}
    model = tiny_configs.chat_decoder(fmt.config, vocab, **ids)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def held_to_calls(fmt: Format) -> dict[str, object]:
    """The response_format that holds an answer to this format's calls."""
    return {"type": "json_schema", "json_schema": {"name": "calls", "schema": fmt.calls}}


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    """(transformers tokenizer, model) on the same directory."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer, transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def base(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp(f"{model_dir.name}-logs")
    with serve_dirs({"tools": model_dir}, logs) as url:
        yield url


def _body(messages: list[dict[str, Any]], **extra: object) -> dict[str, object]:
    return {
        "model": "tools",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def test_auto_reads_a_calling_answer_as_calls(base: str, held_to_calls: dict[str, object]) -> None:
    """An answer that is a call (held to the shape by response_format) comes back as
    tool_calls with no content and finish_reason tool_calls; its arguments validate."""
    import jsonschema

    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=_body(ASK, response_format=held_to_calls))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ARGUMENTS)


def test_streamed_auto_sends_the_call_and_no_content(
    base: str, held_to_calls: dict[str, object]
) -> None:
    body = _body(ASK, response_format=held_to_calls, stream=True)
    with httpx.Client(base_url=base, timeout=120) as http:
        whole = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert all(not c["delta"].get("content") for c in choices)
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    assert [d["function"]["name"] for d in deltas if d["function"].get("name")] == ["get_weather"]
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    [want] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(arguments) == json.loads(want["function"]["arguments"])
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_an_answered_call_reaches_the_model_as_transformers_renders_it(
    base: str, reference: tuple[Any, Any]
) -> None:
    """The tools, the earlier call and the tool's answer give the prompt transformers'
    template gives; the free answer after them is transformers' greedy text, read as
    content (it is no call)."""
    tokenizer, model = reference
    ids = tokenizer.apply_chat_template(
        tiny_configs.template_messages(ANSWERED),
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if "input_ids" in ids else ids)
    _, text, _ = tiny_configs.greedy(model, tokenizer, ids, 24)
    assert not text.lstrip().startswith(("{", "["))  # the reference answer is no call
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={**_body(ANSWERED), "max_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    message = body["choices"][0]["message"]
    assert message["content"] == text and message.get("tool_calls") is None
