"""A Qwen3 decoder chats end to end: real Tulip processes behind one real Ivy.

A tiny random ``Qwen3ForCausalLM`` (tied head, explicit head_dim, no sentence-transformers
modules: Tulip's runner decision makes it a generator), saved with `transformers`, with a
byte-level BPE ``tokenizer.json`` built here with HF `tokenizers` and a ChatML
``chat_template``. Served twice (plain greedy, and ``--spec ngram``), `/v1/chat/completions`
non-streaming, streaming and through the `openai` client equals `transformers` greedy
``generate`` on the ids `transformers`' own chat template gives; Tulip's Generate stream
returns exactly `transformers`' token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tiny_configs
import torch
import transformers
from ivy_process import ivy_over

from protos.trellis.v1 import inference_pb2 as pb
from tulip.client import TulipClient
from tulip.process import TulipProcess

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with Qwen3's tool calling (tools listed in a system turn, Hermes <tool_call>
# blocks for an assistant's calls, <tool_response> for a tool's answers) and its thinking
# switch (thinking off opens the answer with an empty think block), and a switch of this
# test's own, open_thinking, that opens the thought for the model (as DeepSeek-R1's distills
# and QwQ do).
CHATML = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall a function as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' and message.reasoning_content %}
{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- if open_thinking is defined and open_thinking %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 2? It is 4.",
    "Hello, world! Ünïcödé – 日本語 text.",
    "def add(a, b): return a + b",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a fox."},
        {"role": "user", "content": "Jump over the lazy dog, then say hello."},
    ],
    [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "Again: def add(a, b): return a + b"},
    ],
]
MAX_TOKENS = 24
NAMES = ("qwen3", "qwen3-ngram")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-chat")
    vocab = tiny_configs.byte_bpe(
        path,
        CORPUS,
        SPECIALS,
        400,
        chat_template=CHATML,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=2048,
    )
    torch.manual_seed(7)
    model = tiny_configs.chat_decoder(
        transformers.Qwen3Config,
        vocab,
        head_dim=32,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIALS.index("<|im_end|>"),
        pad_token_id=SPECIALS.index("<|endoftext|>"),
    )
    with torch.no_grad():
        # a likelier EOS (tied head: its logit grows with its embedding's length): two of
        # CHATS' answers stop on it, one runs into max_tokens
        model.model.embed_tokens.weight[model.config.eos_token_id] *= 1.5
    model.save_pretrained(path, safe_serialization=True)
    assert not (path / "modules.json").exists()
    return path


class Oracle:
    """`transformers` in this process: its chat template and its greedy continuations."""

    def __init__(self, path: Path) -> None:
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()

    def chat_ids(self, messages: list[dict[str, str]], **options: object) -> list[int]:
        options.setdefault("add_generation_prompt", True)
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return list(out["input_ids"] if "input_ids" in out else out)

    def greedy(self, ids: list[int]) -> tuple[list[int], str, str]:
        """(new ids without the EOS, text, finish reason) of greedy decoding from ids."""
        return tiny_configs.greedy(self.model, self.tokenizer, ids, MAX_TOKENS)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Oracle:
    return Oracle(model_dir)


@pytest.fixture(scope="module")
def want(oracle: Oracle) -> list[tuple[list[int], str, str]]:
    answers = [oracle.greedy(oracle.chat_ids(chat)) for chat in CHATS]
    assert all(text.strip() for _, text, _ in answers)  # every answer has visible text
    assert {finish for _, _, finish in answers} == {"stop", "length"}
    return answers


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """(Ivy's base URL, served name → Tulip's gRPC target)."""
    logs = tmp_path_factory.mktemp("qwen3-chat-logs")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    common = ["--model", str(model_dir), "--device", "cpu", "--threads", "1"]
    tulips = {
        "qwen3": TulipProcess(
            [*common, "--model-name", "qwen3"], log_path=logs / "qwen3.log", env=env
        ),
        "qwen3-ngram": TulipProcess(
            [*common, "--model-name", "qwen3-ngram", "--spec", "ngram"],
            log_path=logs / "qwen3-ngram.log",
            env=env,
        ),
    }
    with contextlib.ExitStack() as stack:
        for tulip in tulips.values():
            stack.enter_context(tulip)
        for tulip in tulips.values():
            tulip.wait_serving()
        served = {name: (model_dir, tulip.target) for name, tulip in tulips.items()}
        url = stack.enter_context(ivy_over(served, logs / "ivy.log", env))
        yield url, {name: tulip.target for name, tulip in tulips.items()}


def _body(name: str, chat: list[dict[str, str]], **extra: object) -> dict[str, object]:
    return {"model": name, "messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


@pytest.mark.parametrize("name", NAMES)
def test_chat_equals_transformers_greedy(
    cluster: tuple[str, dict[str, str]],
    oracle: Oracle,
    want: list[tuple[list[int], str, str]],
    name: str,
) -> None:
    base, _ = cluster
    for chat, (ids, text, finish) in zip(CHATS, want, strict=True):
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(name, chat), timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["message"]["content"] == text
        assert choice["finish_reason"] == finish
        assert body["usage"]["prompt_tokens"] == len(oracle.chat_ids(chat))
        assert body["usage"]["completion_tokens"] == len(ids)  # EOS is not emitted


@pytest.mark.parametrize("name", NAMES)
def test_chat_stream_equals_transformers_greedy(
    cluster: tuple[str, dict[str, str]], want: list[tuple[list[int], str, str]], name: str
) -> None:
    base, _ = cluster
    for chat, (_, text, finish) in zip(CHATS, want, strict=True):
        body = _body(name, chat, stream=True)
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert "".join(deltas) == text
        finishes = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
        assert finishes[-1] == finish


def test_a_thought_the_prompt_opens_is_reasoning_content(
    cluster: tuple[str, dict[str, str]], oracle: Oracle
) -> None:
    """Where the template opens the thought for the model, the answer up to ``</think>``
    is the message's reasoning_content (`ivy.reasoning`): the tiny model never closes it,
    so all of its greedy answer is, and the content is null, whole and streamed. Without
    the open thought the answer is content and reasoning_content null."""
    base, _ = cluster
    ids = oracle.chat_ids(CHATS[0], open_thinking=True)
    _, text, _ = oracle.greedy(ids)
    assert text.strip() and "</think>" not in text
    body = _body("qwen3", CHATS[0], chat_template_kwargs={"open_thinking": True})
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        plain = http.post("/v1/chat/completions", json=_body("qwen3", CHATS[0])).json()
        hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False})
    message = r["choices"][0]["message"]
    left_out = hidden.json()["choices"][0]["message"]  # vLLM's include_reasoning: false
    assert (left_out["reasoning_content"], left_out["content"]) == (None, None)
    assert (message["reasoning_content"], message["content"]) == (text, None)
    assert r["usage"]["prompt_tokens"] == len(ids)
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text
    assert not any(d.get("content") for d in deltas)
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert plain["choices"][0]["message"]["content"]
    # the message sent back with its thought: the template renders that too
    history = [*CHATS[0], {"role": "assistant", "content": "4.", "reasoning_content": "Add."}]
    history.append({"role": "user", "content": "And 3 + 3?"})
    with httpx.Client(base_url=base, timeout=120) as http:
        again = http.post("/v1/chat/completions", json=_body("qwen3", history)).json()
    assert again["usage"]["prompt_tokens"] == len(oracle.chat_ids(history))
    thoughtless = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in history]
    assert len(oracle.chat_ids(history)) > len(oracle.chat_ids(thoughtless))


def test_openai_client_chats(
    cluster: tuple[str, dict[str, str]], want: list[tuple[list[int], str, str]]
) -> None:
    from openai import OpenAI

    base, _ = cluster
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.chat.completions.create(
        model="qwen3", messages=CHATS[1], max_tokens=MAX_TOKENS, temperature=0
    )
    _, text, finish = want[1]
    assert got.choices[0].message.content == text
    assert got.choices[0].finish_reason == finish


@pytest.mark.parametrize("name", NAMES)
def test_tulip_generates_transformers_ids(
    cluster: tuple[str, dict[str, str]],
    oracle: Oracle,
    want: list[tuple[list[int], str, str]],
    name: str,
) -> None:
    """Tulip's own stream, on the ids of `transformers`' chat template: the same token ids."""
    _, targets = cluster

    async def generate(prompt: list[int]) -> list[int]:
        sampling = pb.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0)
        out: list[int] = []
        async with TulipClient(targets[name]) as client:
            async for piece in client.generate(prompt, sampling, timeout=120):
                out.extend(piece.token_ids)
        return out

    for chat, (ids, _, _) in zip(CHATS, want, strict=True):
        got = asyncio.run(generate(oracle.chat_ids(chat)))
        assert got == ids  # a finishing EOS is not emitted


def test_vllm_chat_template_options(cluster: tuple[str, dict[str, str]], oracle: Oracle) -> None:
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) and continue_final_message,
    on /v1/chat/completions and /tokenize's messages: the ids `transformers`' template
    gives with the same options, and its greedy answer from them."""
    base, _ = cluster
    prefill = [*CHATS[0], {"role": "assistant", "content": "It is"}]
    cases = [
        (
            CHATS[0],
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"enable_thinking": False},
        ),
        (
            prefill,
            {"add_generation_prompt": False, "continue_final_message": True},
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ]
    with httpx.Client(base_url=base, timeout=120) as http:
        for chat, fields, options in cases:
            ids = oracle.chat_ids(chat, **options)
            assert ids != oracle.chat_ids(chat[:1])  # the options change the prompt
            r = http.post("/tokenize", json={"model": "qwen3", "messages": chat, **fields})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "count": len(ids),
                "max_model_len": 2048,
                "tokens": ids,
                "token_strs": None,
            }
            r = http.post("/tokenize", json={"messages": chat, "return_token_strs": True, **fields})
            assert r.json()["token_strs"] == oracle.tokenizer.convert_ids_to_tokens(ids)
            text = oracle.tokenizer.decode(ids, skip_special_tokens=False)
            framed = oracle.tokenizer(text, add_special_tokens=True)["input_ids"]
            body = {"messages": chat, "add_special_tokens": True, **fields}
            assert http.post("/tokenize", json=body).json()["tokens"] == framed
            _, answer, finish = oracle.greedy(ids)
            r = http.post("/v1/chat/completions", json=_body("qwen3", chat, **fields))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (answer, finish)
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
        for path in ("/tokenize", "/v1/chat/completions"):
            for fields, param in (
                ({"continue_final_message": True}, "continue_final_message"),
                ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            ):
                r = http.post(path, json={"model": "qwen3", "messages": prefill, **fields})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param, r.text
        r = http.post("/tokenize", json={"messages": CHATS[0], "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


# ---- tool calling ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# an earlier call and its answer, sent back (arguments as JSON text, as OpenAI sends them)
ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
]


def _validate(call: dict) -> None:
    import jsonschema

    spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec["parameters"])
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_tools_reach_the_model_through_its_template(
    cluster: tuple[str, dict[str, str]], oracle: Oracle
) -> None:
    """The tools and a conversation with an earlier call and its answer render as
    transformers' template renders them (arguments parsed to objects, as vLLM passes
    them): the prompt's token count, and with tool_choice auto the greedy answer from
    those ids (a tiny random model calls nothing: content, no tool_calls)."""
    base, _ = cluster
    with httpx.Client(base_url=base, timeout=120) as http:
        for messages in (ASK, ANSWERED):
            ids = oracle.chat_ids(tiny_configs.template_messages(messages), tools=TOOLS)
            assert len(ids) > len(oracle.chat_ids(ASK)) + 20  # the tools are in it
            _, text, finish = oracle.greedy(ids)
            r = http.post("/v1/chat/completions", json=_body("qwen3", messages, tools=TOOLS))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == len(ids)
            choice = body["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish)
            assert choice["message"].get("tool_calls") is None
            # vLLM's /tokenize of the same conversation and tools: the same ids
            body = {"model": "qwen3", "messages": messages, "tools": TOOLS}
            assert http.post("/tokenize", json=body).json()["tokens"] == ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_and_required_tool_choice_give_valid_calls(
    cluster: tuple[str, dict[str, str]], stream: bool
) -> None:
    """A named function or `required`: the answer is held to the tools' schemas, so even
    a random model's calls parse and validate; named finishes `stop` (vLLM), required
    `tool_calls`. Streamed, the deltas join to the same calls as the whole answer."""
    base, _ = cluster
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [(named, "stop", 1), ("required", "tool_calls", None)]
    with httpx.Client(base_url=base, timeout=120) as http:
        for choice, finish, count in cases:
            body = _body("qwen3", ASK, tools=TOOLS, tool_choice=choice, max_tokens=120)
            whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
            assert whole["finish_reason"] == finish, whole
            calls = whole["message"]["tool_calls"]
            assert calls and (count is None or len(calls) == count), whole
            for call in calls:
                _validate(call)
            if choice is named:
                assert calls[0]["function"]["name"] == "get_time"
            if not stream:
                continue
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120
            ) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            joined: dict[int, dict] = {}
            for c in chunks:
                for d in c["delta"].get("tool_calls") or []:
                    call = joined.setdefault(d["index"], {"name": None, "arguments": ""})
                    call["name"] = d["function"].get("name") or call["name"]
                    call["arguments"] += d["function"].get("arguments") or ""
            assert [c["finish_reason"] for c in chunks][-1] == finish
            want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            assert [(c["name"], c["arguments"]) for c in joined.values()] == want
            assert not "".join(c["delta"].get("content") or "" for c in chunks)


def test_openai_client_reads_tool_calls(cluster: tuple[str, dict[str, str]]) -> None:
    from openai import OpenAI

    base, _ = cluster
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="qwen3",
        messages=ANSWERED,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_bad_tool_requests_get_400(cluster: tuple[str, dict[str, str]]) -> None:
    base, _ = cluster
    unknown = {"type": "function", "function": {"name": "nope"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": unknown}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ]
    with httpx.Client(base_url=base, timeout=120) as http:
        for extra, param in cases:
            r = http.post("/v1/chat/completions", json=_body("qwen3", ASK, **extra))
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
        for bad in (
            [{"role": "tool", "content": "x"}],  # no tool_call_id
            [{"role": "user", "content": None}],
            [
                {
                    **ANSWERED[1],
                    "tool_calls": [
                        {
                            **ANSWERED[1]["tool_calls"][0],
                            "function": {"name": "f", "arguments": "{"},
                        }
                    ],
                }
            ],
        ):
            r = http.post("/v1/chat/completions", json=_body("qwen3", bad, tools=TOOLS))
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "messages", r.text
