"""End to end: OpenAI chat completions and completions through Ivy to Tulip replicas
running the real SmolLM2-135M-Instruct weights, driven by the official `openai` client and
raw HTTP, checked against `transformers` greedy decoding in this process.

One `trellis up` cluster (2 replicas) serves the module. A second Ivy process, pointed
at the same replicas, also serves an embedding model, for the wrong-kind errors. The test
that kills a replica mid-stream runs last because it changes the cluster.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from up_cluster import UpCluster, start_up, stop_up

from tulip.process import free_port

MODEL = "smollm2-135m-instruct"
EMBEDDER = "multilingual-e5-small"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model(MODEL))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, oracle: Oracle) -> Iterator[UpCluster]:
    """`trellis up` with the chat model: 2 replicas x 1 thread, and Ivy. (The oracle
    fixture comes first so its child process computes while the cluster starts.)"""
    c = start_up(model_dir)
    # A chat model gets chat examples, not embeddings.
    assert f"curl -s {c.base_url}/v1/chat/completions" in c.text, c.text
    assert "/v1/embeddings" not in c.text, c.text
    assert len(c.replicas()) == 2, c.children()
    yield c
    assert stop_up(c) == 0, "".join(c.output[-40:])


@pytest.fixture(scope="module")
def base(cluster: UpCluster) -> str:
    return cluster.base_url


@pytest.fixture(scope="module")
def name(cluster: UpCluster) -> str:
    return cluster.name


@pytest.fixture(scope="module")
def two_model_base(cluster: UpCluster, model_dir: Path) -> Iterator[str]:
    """A second Ivy serving the chat model (same replicas) and an embedding model (its
    replica address is never used: the wrong-kind checks answer before routing)."""
    from rose.assets import ensure_model

    embedder = Path(ensure_model(EMBEDDER))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivy", "--port", str(port)]
        + ["--model", f"{cluster.name}={model_dir}", "--model", f"{EMBEDDER}={embedder}"]
        + ["--replicas", f"{cluster.name}={','.join(cluster.replica_addresses)}"]
        + ["--replicas", f"{EMBEDDER}=127.0.0.1:{free_port()}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, "ivy exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health/live", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


# Greedy decoding by `transformers` in a child process with one intra-op thread, like
# the replicas: on shared cores several threads per process oversubscribe them badly.
_ORACLE_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
directory, budget = sys.argv[1], int(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
eos = int(model.generation_config.eos_token_id)
out = []
with torch.no_grad():
    for ids in json.load(sys.stdin):
        row = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=budget, do_sample=False, pad_token_id=eos,
        )[0, len(ids):].tolist()
        out.append(row)
json.dump({"eos": eos, "generated": out}, sys.stdout)
"""
ORACLE_BUDGET = 24
TWO_PLUS_TWO = [{"role": "user", "content": "What is 2 + 2?"}]


class Oracle:
    """`transformers` as the reference: its chat template and tokenizer (in this process)
    and its greedy continuations of the module's prompts (computed once, up to
    ORACLE_BUDGET tokens; shorter budgets are prefixes of greedy decoding)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.prompts = [self.chat_ids(m) for m in (CHAT, TWO_PLUS_TWO)] + [
            self.tokenizer(p)["input_ids"] for p in PROMPTS
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ORACLE_SCRIPT, str(model_dir), str(ORACLE_BUDGET)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(self.prompts))
        self._proc.stdin.close()
        self._table: dict[tuple[int, ...], list[int]] | None = None
        self._eos = -1

    def _generated(self, ids: list[int]) -> list[int]:
        if self._table is None:
            assert self._proc.stdout is not None
            result = json.loads(self._proc.stdout.read())
            assert self._proc.wait(60) == 0
            self._eos = result["eos"]
            self._table = {
                tuple(p): g for p, g in zip(self.prompts, result["generated"], strict=True)
            }
        return self._table[tuple(ids)]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if "input_ids" in out else out)

    def greedy(self, ids: list[int], max_new_tokens: int) -> tuple[str, int, str]:
        """(text, completion tokens, finish reason) of greedy decoding from ids."""
        assert max_new_tokens <= ORACLE_BUDGET
        new = self._generated(ids)[:max_new_tokens]
        finish = "length"
        if self._eos in new:
            new = new[: new.index(self._eos)]
            finish = "stop"
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new), finish

    def greedy_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The ids greedy decoding emits (cut before EOS)."""
        new = self._generated(ids)[:max_new_tokens]
        return new[: new.index(self._eos)] if self._eos in new else new

    def token_bytes(self, token: int) -> bytes:
        """A token's raw bytes: its byte-level BPE piece through GPT-2's byte table
        (transformers' own copy of it)."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        table = {c: b for b, c in bytes_to_unicode().items()}
        return bytes(table[c] for c in self.tokenizer.convert_ids_to_tokens(token))

    def token_text(self, token: int) -> str:
        """OpenAI's ``token``: the bytes as text, ``bytes:\\xNN`` when not UTF-8 alone."""
        raw = self.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Iterator[Oracle]:
    o = Oracle(model_dir)
    yield o
    o.close()


def openai_client(base: str):  # noqa: ANN201
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    assert all(e.startswith("data: ") for e in events[:-1]), events
    return [e[len("data: ") :] for e in events[:-1]]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


# ---- chat template (no cluster) --------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    CHAT,
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! \u00bfQu\u00e9 tal?"},
        {"role": "user", "content": "\u6771\u4eac\u306f\uff1f"},
    ],
]
# Exercises what transformers' environment offers: loop controls, tojson, the
# {% generation %} block, special-token variables, raise_exception and whitespace control.
CUSTOM_TEMPLATE = """
{%- for m in messages %}
  {%- if m['role'] == 'system' and not loop.first %}{{ raise_exception('system goes first') }}{% endif %}
  {%- if loop.index > 6 %}{% break %}{% endif %}
  {%- if m['role'] == 'assistant' %}
{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{{ eos_token }}
  {%- else %}
{{ bos_token }}{{ m['role'] }}: {{ m['content'] | trim }}
  {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"""


def test_chat_template_renders_like_transformers(model_dir: Path, oracle: Oracle) -> None:
    from ivy.chat_template import ChatTemplate, ChatTemplateError
    from ivy.models import ServedModel

    served = ServedModel.load(MODEL, model_dir)
    assert served.chat_template is not None
    tok = oracle.tokenizer
    for messages in CONVERSATIONS:
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert served.chat_template.render(messages) == want
        # Ivy's tokenizer on the rendered text gives transformers' ids (no specials added).
        ids, _ = served.tokenizer.encode_batch_packed([want], False, None)
        assert ids.tolist() == oracle.chat_ids(messages)
        without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert served.chat_template.render(messages, add_generation_prompt=False) == without
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    custom = ChatTemplate(CUSTOM_TEMPLATE, special)
    for messages in CONVERSATIONS:
        want = tok.apply_chat_template(
            messages,
            chat_template=CUSTOM_TEMPLATE,
            add_generation_prompt=True,
            tokenize=False,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert custom.render(messages) == want
    # vLLM's continue_final_message and chat_template_kwargs, as transformers applies them
    # (CUSTOM_TEMPLATE trims a final user turn, so the tag's space goes; it writes an
    # assistant turn as JSON, whose string the cut leaves open)
    for messages in [*CONVERSATIONS, CONVERSATIONS[2][:3]]:
        for template, kwargs in ((served.chat_template, {}), (custom, special)):
            source = {"chat_template": CUSTOM_TEMPLATE, **special} if kwargs else {}
            want = tok.apply_chat_template(
                messages, continue_final_message=True, tokenize=False, **source
            )
            got = template.render(
                messages, add_generation_prompt=False, continue_final_message=True
            )
            assert got == want, messages
    greeting = "{{ greeting }}|{{ bos_token }}|{{ messages | length }}"
    want = tok.apply_chat_template(
        CHAT, chat_template=greeting, tokenize=False, greeting="yo", bos_token="<b>"
    )
    variables = {"greeting": "yo", "bos_token": "<b>"}
    assert ChatTemplate(greeting, special).render(CHAT, variables=variables) == want == "yo|<b>|2"
    with pytest.raises(ChatTemplateError, match="may not set messages") as reserved:
        custom.render(CHAT, variables={"messages": []})
    assert reserved.value.param == "chat_template_kwargs"
    with pytest.raises(ChatTemplateError, match="cannot both") as both:
        custom.render(CHAT, continue_final_message=True)
    assert both.value.param == "continue_final_message"
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="system goes first"):
        custom.render(bad)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(bad)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% if %}")


# ---- chat completions ------------------------------------------------------------------


def test_chat_matches_transformers_greedy(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    ids = oracle.chat_ids(CHAT)
    want, want_tokens, want_finish = oracle.greedy(ids, 24)
    r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == name
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == want
    assert choice.finish_reason == want_finish
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == want_tokens
    assert r.usage.total_tokens == len(ids) + want_tokens


def test_vllm_tokenize_of_messages_is_the_chat_prompt(base: str, name: str, oracle: Oracle) -> None:
    """vLLM's /tokenize with `messages`: the ids transformers' chat template gives, which
    are the ids chat completions generate from (usage counts them)."""
    ids = oracle.chat_ids(CHAT)
    r = httpx.post(f"{base}/tokenize", json={"model": name, "messages": CHAT}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
    chat = openai_client(base).chat.completions.create(
        model=name, messages=CHAT, max_tokens=1, temperature=0
    )
    assert chat.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_non_stream(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
    ids = oracle.chat_ids(TWO_PLUS_TWO)
    want, want_tokens, want_finish = oracle.greedy(ids, 20)
    whole = client.chat.completions.create(
        model=name, messages=messages, max_completion_tokens=20, temperature=0
    )
    assert whole.choices[0].message.content == want
    stream = client.chat.completions.create(
        model=name,
        messages=messages,
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content == want
    assert [c.choices[0].finish_reason for c in with_choices][-1] == want_finish
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), want_tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_wire_format(base: str, name: str) -> None:
    body = {"model": name, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-cache"
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


def test_max_tokens_finishes_with_length(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    want, _, _ = oracle.greedy(oracle.chat_ids(CHAT), 3)
    assert r.choices[0].message.content == want


def test_seeded_sampling_repeats(base: str, name: str) -> None:
    client = openai_client(base)
    args: dict[str, Any] = {"model": name, "messages": CHAT, "max_tokens": 12}
    a = client.chat.completions.create(**args, temperature=1.0, seed=1234)
    b = client.chat.completions.create(**args, temperature=1.0, seed=1234)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens >= 1


def test_vanishing_temperature_and_top_p_are_greedy_and_spare_the_batch(
    base: str, name: str, oracle: Oracle
) -> None:
    """A temperature of 1e-40 (a float32 subnormal on the wire) once made the replica's
    sampler divide by it, fail the step with NaN probabilities and answer 502 to every
    request in the batch; a top_p of 1e-46 rounded to 0 (= unset) and sampled freely. Both
    are greedy, and greedy neighbours in the same batches are answered."""
    from concurrent.futures import ThreadPoolExecutor

    want, _, _ = oracle.greedy(oracle.chat_ids(CHAT), 12)
    bodies = [{"temperature": 1e-40}, {"temperature": 1e-38}, {"top_p": 1e-46}] + [
        {"temperature": 0}
    ] * 3

    def ask(extra: dict[str, Any]) -> httpx.Response:
        body = {"model": name, "messages": CHAT, "max_tokens": 12, **extra}
        return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(ask, bodies))
    for extra, r in zip(bodies, answers, strict=True):
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == want, extra


# ---- completions -----------------------------------------------------------------------


def test_completions_list_of_prompts_in_order(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    want = [oracle.greedy(oracle.tokenizer(p)["input_ids"], 8) for p in PROMPTS]
    r = client.completions.create(model=name, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w[0] for w in want]
    assert [c.finish_reason for c in r.choices] == [w[2] for w in want]
    prompt_tokens = sum(len(oracle.tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == sum(w[1] for w in want)
    # Token ids give the same answers as the texts they encode.
    ids = [oracle.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [w[0] for w in want[:2]]
    single = client.completions.create(model=name, prompt=ids[1], max_tokens=8, temperature=0)
    assert single.choices[0].text == want[1][0]


def test_completions_echo_puts_the_prompt_before_the_answer(
    base: str, name: str, oracle: Oracle
) -> None:
    """echo: each choice's text is its prompt (as sent, or its ids decoded with special
    tokens kept) then the answer, whole and streamed (the prompt in the first chunk)."""
    client = openai_client(base)
    want = [oracle.greedy(oracle.tokenizer(p)["input_ids"], 6)[0] for p in PROMPTS[:2]]
    r = client.completions.create(
        model=name, prompt=PROMPTS[:2], max_tokens=6, temperature=0, echo=True
    )
    assert [c.text for c in r.choices] == [p + w for p, w in zip(PROMPTS, want, strict=False)]
    ids = oracle.tokenizer(PROMPTS[0])["input_ids"]
    r = client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == oracle.tokenizer.decode(ids) + want[0]
    stream = client.completions.create(
        model=name, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert pieces[0] == PROMPTS[0] and "".join(pieces) == PROMPTS[0] + want[0]


def test_completions_default_max_tokens_is_16(base: str, name: str) -> None:
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": name, "prompt": "1, 2, 3, 4, 5,", "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 16


def test_completions_stream_several_prompts(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    want = [oracle.greedy(oracle.tokenizer(p)["input_ids"], 6)[0] for p in PROMPTS[:2]]
    stream = client.completions.create(
        model=name,
        prompt=PROMPTS[:2],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    finished = [None, None]
    usage = None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert finished[choice.index] is None, "text after the finish"
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason
    assert texts == want
    assert finished == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 12


def test_vllm_continuous_usage_stats(base: str, name: str, oracle: Oracle) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (the prompt counted once, completion tokens growing to the final count)."""
    ids = oracle.chat_ids(TWO_PLUS_TWO)
    _, want_tokens, _ = oracle.greedy(ids, 12)
    body = {
        "model": name,
        "messages": TWO_PLUS_TWO,
        "max_tokens": 12,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    usages = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks]
    assert {p for p, _ in usages} == {len(ids)}
    done = [t for _, t in usages]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 2 * want_tokens
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    comp = {"model": name, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
    comp |= {"stream": True, "stream_options": body["stream_options"]}
    events = [
        json.loads(e)
        for e in sse_events(httpx.post(f"{base}/v1/completions", json=comp, timeout=120))[:-1]
    ]
    assert [e["usage"]["completion_tokens"] for e in events][-1] == 5
    assert all(e["usage"] is not None for e in events)


# ---- n choices per prompt ---------------------------------------------------------------


def test_chat_n_greedy_choices(base: str, name: str, oracle: Oracle) -> None:
    """n greedy choices are n copies of greedy decoding; usage counts the prompt once."""
    client = openai_client(base)
    ids = oracle.chat_ids(CHAT)
    want, want_tokens, want_finish = oracle.greedy(ids, 12)
    r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [want] * 3
    assert [c.finish_reason for c in r.choices] == [want_finish] * 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3 * want_tokens)
    assert r.usage.total_tokens == len(ids) + 3 * want_tokens


def test_chat_n_stream(base: str, name: str, oracle: Oracle) -> None:
    """Streamed, every choice opens with its role, carries its index, and finishes once."""
    ids = oracle.chat_ids(TWO_PLUS_TWO)
    want, want_tokens, want_finish = oracle.greedy(ids, 10)
    stream = openai_client(base).chat.completions.create(
        model=name,
        messages=TWO_PLUS_TWO,
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    texts, finishes = ["", ""], [[], []]
    for c in chunks[2:-1]:
        (choice,) = c.choices
        assert not finishes[choice.index], "a chunk after its choice finished"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [want, want]
    assert finishes == [[want_finish], [want_finish]]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 2 * want_tokens)


def test_completions_n_seeded_choices_are_the_seeds_that_follow(base: str, name: str) -> None:
    """Choice i * n + j answers prompt i sampled with seed + j (vLLM's seeding): each
    equals the n=1 request with that seed, and the choices of one prompt differ."""
    client = openai_client(base)
    args: dict[str, Any] = {"model": name, "max_tokens": 10, "temperature": 1.5}
    r = client.completions.create(**args, prompt=PROMPTS[:2], n=2, seed=41)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [
        client.completions.create(**args, prompt=p, seed=41 + j).choices[0].text
        for p in PROMPTS[:2]
        for j in range(2)
    ]
    assert [c.text for c in r.choices] == singles
    assert singles[0] != singles[1] or singles[2] != singles[3], singles
    tokenizer_prompts = sum(
        client.completions.create(model=name, prompt=p, max_tokens=1).usage.prompt_tokens
        for p in PROMPTS[:2]
    )
    assert r.usage.prompt_tokens == tokenizer_prompts
    # unseeded, the choices draw their own randomness
    hot = client.completions.create(
        model=name, prompt="Once upon a time", max_tokens=16, temperature=2.0, n=4
    )
    assert len({c.text for c in hot.choices}) > 1, [c.text for c in hot.choices]


def test_stop_strings(base: str, name: str, oracle: Oracle) -> None:
    client = openai_client(base)
    prompt = PROMPTS[1]
    full, _, _ = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], 16)
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    assert stop.strip(), full
    expected = full[: full.find(stop)]
    for stops in (stop, [stop, "never-appears"]):
        r = client.completions.create(
            model=name, prompt=prompt, max_tokens=16, temperature=0, stop=stops
        )
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=name, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    chat = client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=24, temperature=0, stop=["blue", "Blue"]
    )
    content = chat.choices[0].message.content
    assert "blue" not in content.lower()
    whole, _, _ = oracle.greedy(oracle.chat_ids(CHAT), 24)
    if "blue" in whole.lower():
        assert chat.choices[0].finish_reason == "stop"
        assert whole.startswith(content)


# ---- logprobs ----------------------------------------------------------------------------

LOGPROB_TOL = 1e-4  # fp32 on both sides; the engine's logits match transformers' to 1e-4


@pytest.fixture(scope="module")
def raw_logits(model_dir: Path) -> Callable[[list[int], list[int]], Any]:
    """`transformers`' fp32 logits at each position that produced an output token:
    ``f(prompt, output) -> [len(output), V]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def logits(prompt: list[int], output: list[int]) -> torch.Tensor:
        with torch.no_grad():
            rows = model(torch.tensor([prompt + output])).logits[0].float()  # [T, V]
        return rows[len(prompt) - 1 : -1]

    return logits


@pytest.fixture(scope="module")
def reference(
    raw_logits: Callable[[list[int], list[int]], Any],
) -> Callable[[list[int], list[int]], Any]:
    """log_softmax of `raw_logits`: ``f(prompt, output) -> [len(output), V]``."""
    import torch

    return lambda prompt, output: torch.log_softmax(raw_logits(prompt, output), dim=-1)


@pytest.mark.parametrize(
    "adjust",
    [
        {"presence_penalty": 0.8, "frequency_penalty": 0.6},
        {"logit_bias": {"28": -100, "378": 3.5}},  # SmolLM2's "," banned, " The" raised
    ],
    ids=["penalties", "logit-bias"],
)
def test_penalties_and_logit_bias_equal_transformers(
    base: str,
    name: str,
    oracle: Oracle,
    reference: Callable[[list[int], list[int]], Any],
    adjust: dict[str, Any],
) -> None:
    """OpenAI's presence and frequency penalties and logit_bias (once 400s) through Ivy
    and Tulip: greedy output equals transformers' greedy loop with OpenAI's formulas
    applied by hand (logit + bias - frequency * count - presence * [count > 0], counts
    over the output so far)."""
    import torch

    budget = 20
    prompt = oracle.tokenizer(PROMPTS[1])["input_ids"]  # a list: its commas repeat
    eos = oracle.tokenizer.eos_token_id
    presence = adjust.get("presence_penalty", 0.0)
    frequency = adjust.get("frequency_penalty", 0.0)
    out: list[int] = []
    while len(out) < budget:
        logits = reference(prompt, [*out, 0])[-1].clone()  # the next token's
        for token, bias in adjust.get("logit_bias", {}).items():
            logits[int(token)] += bias
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel())
        logits -= frequency * counts.float() + presence * (counts > 0).float()
        token = int(logits.argmax())
        if token == eos:
            break
        out.append(token)
    want = oracle.tokenizer.decode(out, skip_special_tokens=True)
    assert want != oracle.greedy(prompt, budget)[0]  # the request changes this answer
    r = openai_client(base).completions.create(
        model=name, prompt=PROMPTS[1], max_tokens=budget, temperature=0, **adjust
    )
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(out) + (len(out) < budget)  # EOS counts


def _vllm_greedy(
    raw_logits: Callable[[list[int], list[int]], Any],
    prompt: list[int],
    budget: int,
    *,
    repetition: float = 1.0,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy decoding by transformers' own logits processors (RepetitionPenalty over
    prompt + output, MinNewTokensLength masking the stop ids), up to a stop id (not kept)."""
    import torch
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    processors = [
        MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, list(stop_ids)),
        RepetitionPenaltyLogitsProcessor(repetition),
    ]
    out: list[int] = []
    while len(out) < budget:
        ids = torch.tensor([prompt + out])
        scores = raw_logits(prompt, [*out, 0])[-1:].clone()  # the next token's, [1, V]
        for process in processors:
            scores = process(ids, scores)
        token = int(scores.argmax())
        if token in stop_ids:
            break
        out.append(token)
    return out


def test_vllm_sampling_extensions_equal_transformers(
    base: str, name: str, oracle: Oracle, raw_logits: Callable[[list[int], list[int]], Any]
) -> None:
    """vLLM's repetition_penalty, min_tokens, ignore_eos and stop_token_ids (silently
    ignored before) through Ivy and Tulip: greedy output equals transformers' greedy loop
    under its own logits processors for the same settings."""
    client = openai_client(base)
    eos = oracle.tokenizer.eos_token_id
    decode = functools.partial(oracle.tokenizer.decode, skip_special_tokens=True)
    # repetition_penalty, over the prompt's tokens too (a list whose commas repeat)
    prompt = oracle.tokenizer(PROMPTS[1])["input_ids"]
    for repetition in (1.3, 0.8):
        out = _vllm_greedy(raw_logits, prompt, 20, repetition=repetition, stop_ids=(eos,))
        assert decode(out) != oracle.greedy(prompt, 20)[0]  # the request changes it
        r = client.completions.create(
            model=name,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            extra_body={"repetition_penalty": repetition},
        )
        assert r.choices[0].text == decode(out), repetition
    # min_tokens holds the EOS back; ignore_eos runs past it to max_tokens
    chat = oracle.chat_ids(TWO_PLUS_TWO)
    short = oracle.greedy_ids(chat, 24)
    assert oracle.greedy(chat, 24)[2] == "stop" and len(short) < 12
    for extra, want in (
        ({"min_tokens": 12}, _vllm_greedy(raw_logits, chat, 24, min_tokens=12, stop_ids=(eos,))),
        ({"ignore_eos": True}, _vllm_greedy(raw_logits, chat, 24)),
    ):
        assert len(want) > len(short) and want[: len(short)] == short, extra
        r = client.chat.completions.create(
            model=name, messages=TWO_PLUS_TWO, max_tokens=24, temperature=0, extra_body=extra
        )
        finish = "length" if len(want) == 24 else "stop"
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
            decode(want),
            finish,
        ), extra
        assert r.usage.completion_tokens == len(want) + (finish == "stop")  # EOS counts
    # stop_token_ids end the answer like EOS, the stop token not shown
    stop = short[2]
    r = client.chat.completions.create(
        model=name,
        messages=TWO_PLUS_TWO,
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
        decode(short[: short.index(stop)]),
        "stop",
    )


def _check_alternatives(
    oracle: Oracle, row: Any, got: list[tuple[str, list[int] | None, float]], k: int
) -> None:
    """``got`` (token, bytes, logprob) equals the reference's ``k`` most likely tokens at
    ``row``: the same values in order; each token the one with its value (two tokens
    within the tolerance of each other may come in either order)."""
    values, ids = row.topk(k + 2)
    assert len(got) == k
    assert [v for _, _, v in got] == pytest.approx(values[:k].tolist(), abs=LOGPROB_TOL)
    for token, raw, value in got:
        near = [int(i) for v, i in zip(values, ids, strict=True) if abs(v - value) <= 2e-4]
        assert token in [oracle.token_text(i) for i in near], (token, value)
        if raw is not None:
            assert bytes(raw) in [oracle.token_bytes(i) for i in near]


def _check_chat_logprobs(
    oracle: Oracle, want: Any, output: list[int], content: list[Any], k: int
) -> None:
    assert len(content) == len(output)
    for t, (token, entry) in enumerate(zip(output, content, strict=True)):
        assert entry.token == oracle.token_text(token), t
        assert bytes(entry.bytes) == oracle.token_bytes(token), t
        assert entry.logprob == pytest.approx(want[t, token].item(), abs=LOGPROB_TOL), t
        alts = [(a.token, a.bytes, a.logprob) for a in entry.top_logprobs]
        _check_alternatives(oracle, want[t], alts, k)
        if k:  # greedy: the token emitted is the most likely one
            assert entry.top_logprobs[0].token == entry.token


def test_chat_logprobs_equal_transformers(
    base: str, name: str, oracle: Oracle, reference: Callable[[list[int], list[int]], Any]
) -> None:
    """logprobs / top_logprobs of greedy chat, whole and streamed, equal log_softmax of
    transformers' logits at every step; the tokens' bytes rebuild the text."""
    client = openai_client(base)
    ids = oracle.chat_ids(CHAT)
    output = oracle.greedy_ids(ids, 12)
    want = reference(ids, output)
    args: dict[str, Any] = {"model": name, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    r = client.chat.completions.create(**args, logprobs=True, top_logprobs=5)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _check_chat_logprobs(oracle, want, output, choice.logprobs.content, 5)
    joined = b"".join(bytes(e.bytes) for e in choice.logprobs.content)
    assert joined.decode() == choice.message.content

    stream = client.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True)
    content: list[Any] = []
    text = ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                content += c.logprobs.content or []
    assert text == choice.message.content
    _check_chat_logprobs(oracle, want, output, content, 2)

    # logprobs without alternatives; none at all when not asked
    bare = client.chat.completions.create(**args, logprobs=True)
    assert bare.choices[0].logprobs is not None
    _check_chat_logprobs(oracle, want, output, bare.choices[0].logprobs.content or [], 0)
    assert client.chat.completions.create(**args).choices[0].logprobs is None


def _check_completion_logprobs(
    oracle: Oracle, want: Any, output: list[int], lp: dict[str, Any], k: int
) -> None:
    tok = oracle.tokenizer
    assert lp["tokens"] == [oracle.token_text(i) for i in output]
    assert lp["token_logprobs"] == pytest.approx(
        [want[t, i].item() for t, i in enumerate(output)], abs=LOGPROB_TOL
    )
    # offsets into the generated text (ASCII here: every token is whole characters)
    assert lp["text_offset"] == [len(tok.decode(output[:t])) for t in range(len(output))]
    for t, (token, top) in enumerate(zip(output, lp["top_logprobs"], strict=True)):
        alts = [(text, None, value) for text, value in top.items()]
        chosen = oracle.token_text(token)
        if len(top) > k:  # the chosen token, added after the k alternatives
            assert list(top)[-1] == chosen
            alts = alts[:-1]
        else:
            assert chosen in top
        _check_alternatives(oracle, want[t], alts, k)


def test_completions_logprobs_equal_transformers(
    base: str, name: str, oracle: Oracle, reference: Callable[[list[int], list[int]], Any]
) -> None:
    client = openai_client(base)
    prompts = [oracle.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    outputs = [oracle.greedy_ids(p, 8) for p in prompts]
    wants = [reference(p, o) for p, o in zip(prompts, outputs, strict=True)]
    r = client.completions.create(
        model=name, prompt=PROMPTS[:2], max_tokens=8, temperature=0, logprobs=3
    )
    for choice, output, want in zip(r.choices, outputs, wants, strict=True):
        assert choice.logprobs is not None
        lp = choice.logprobs.model_dump()
        _check_completion_logprobs(oracle, want, output, lp, 3)
        assert "".join(lp["tokens"]) == choice.text

    body = {"model": name, "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0}
    got: list[dict[str, list[Any]]] = [
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in prompts
    ]
    with httpx.Client(timeout=120) as http:
        events = sse_events(
            http.post(f"{base}/v1/completions", json={**body, "logprobs": 1, "stream": True})
        )
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            assert c["logprobs"] is not None
            for key, values in c["logprobs"].items():
                got[c["index"]][key] += values
    for lp, output, want in zip(got, outputs, wants, strict=True):
        _check_completion_logprobs(oracle, want, output, lp, 1)


def test_completions_echo_with_logprobs_scores_the_prompt(
    base: str, name: str, oracle: Oracle, reference: Callable[[list[int], list[int]], Any]
) -> None:
    """echo with logprobs, as lm-evaluation-harness scores a context and continuation
    (ids, max_tokens 1, logprobs 1, temperature 0): the choice's logprobs cover the
    prompt's tokens then the generated one; the first has none (null), every other token
    its logprob and alternatives under transformers' logits over the whole text, offsets
    run from the prompt's start; whole and streamed alike, and for a text prompt with n=2."""
    client = openai_client(base)
    context = oracle.tokenizer("Question: what is the capital of France? Answer:")["input_ids"]
    continuation = oracle.tokenizer(" Paris, the capital")["input_ids"]
    ids = context + continuation
    generated = int(reference(ids, [0])[0].argmax())  # greedy's token after the prompt
    want = reference(ids[:1], ids[1:] + [generated])  # [len(ids), V]: row t scores token t+1
    args: dict[str, Any] = {
        "model": name,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
    }
    r = client.completions.create(**args, logprobs=1)
    choice = r.choices[0]
    assert choice.text == oracle.tokenizer.decode(ids) + oracle.tokenizer.decode([generated])
    assert choice.logprobs is not None
    lp = choice.logprobs.model_dump()
    every = [*ids, generated]
    assert lp["tokens"] == [oracle.token_text(i) for i in every]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [want[t, i].item() for t, i in enumerate(every[1:])], abs=LOGPROB_TOL
    )
    assert lp["text_offset"] == [len(oracle.tokenizer.decode(every[:t])) for t in range(len(every))]
    for t, (token, top) in enumerate(zip(every[1:], lp["top_logprobs"][1:], strict=True)):
        chosen = oracle.token_text(token)
        alts = [(text, None, value) for text, value in top.items()]
        if len(top) > 1:  # the chosen token, added after the one alternative
            assert list(top)[-1] == chosen
            alts = alts[:-1]
        _check_alternatives(oracle, want[t], alts, 1)
    # lm-evaluation-harness's reading: the continuation's loglikelihood, and whether each
    # of its tokens was the greedy one
    ctxlen = len(context)
    got = sum(lp["token_logprobs"][ctxlen:-1])
    expected = sum(want[t - 1, ids[t]].item() for t in range(ctxlen, len(ids)))
    assert got == pytest.approx(expected, abs=len(continuation) * LOGPROB_TOL)
    greedy = [
        tok == max(top.values())
        for tok, top in zip(
            lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True
        )
    ]
    assert greedy == [int(want[t - 1].argmax()) == ids[t] for t in range(ctxlen, len(ids))]

    with httpx.Client(timeout=120) as http:
        events = sse_events(
            http.post(f"{base}/v1/completions", json={**args, "logprobs": 1, "stream": True})
        )
    streamed: dict[str, list[Any]] = {key: [] for key in lp}
    text = ""
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            text += c["text"]
            for key, values in (c["logprobs"] or {}).items():
                streamed[key] += values
    assert text == choice.text
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)

    # a text prompt, two choices: each echoes the prompt's scores (no alternatives asked)
    r = client.completions.create(
        model=name, prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True, logprobs=0, n=2
    )
    prompt = oracle.tokenizer(PROMPTS[0])["input_ids"]
    want = reference(prompt[:1], prompt[1:])
    for c in r.choices:
        assert c.logprobs is not None
        assert c.logprobs.tokens[: len(prompt)] == [oracle.token_text(i) for i in prompt]
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
            [want[t, i].item() for t, i in enumerate(prompt[1:])], abs=LOGPROB_TOL
        )
        assert len(c.logprobs.tokens) == len(prompt) + 2


def test_completions_echo_with_max_tokens_0_is_the_prompt_alone(
    base: str, name: str, oracle: Oracle, reference: Callable[[list[int], list[int]], Any]
) -> None:
    """OpenAI's legacy scoring call (HELM's, older lm-evaluation-harness'): echo with
    max_tokens 0 answers the prompt alone, its logprobs with `logprobs`, nothing generated
    or counted, whole and streamed; without echo, max_tokens 0 stays a 400."""
    ids = oracle.tokenizer("The capital of France is Paris.")["input_ids"]
    want = reference(ids[:1], ids[1:])
    args = {"model": name, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    with httpx.Client(timeout=120) as http:
        body = http.post(f"{base}/v1/completions", json=args).json()
        [choice] = body["choices"]
        assert choice["text"] == oracle.tokenizer.decode(ids)
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "total_tokens": len(ids),
        }
        lp = choice["logprobs"]
        assert lp["tokens"] == [oracle.token_text(i) for i in ids]
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(
            [want[t, i].item() for t, i in enumerate(ids[1:])], abs=LOGPROB_TOL
        )
        stream = {**args, "stream": True, "stream_options": {"include_usage": True}}
        events = [
            json.loads(e) for e in sse_events(http.post(f"{base}/v1/completions", json=stream))[:-1]
        ]
        refused = http.post(f"{base}/v1/completions", json={**args, "echo": False})
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == choice["text"]
    assert [t for c in choices for t in (c["logprobs"] or {}).get("tokens", [])] == lp["tokens"]
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_logprobs_follow_the_chosen_tokens_when_sampling(
    base: str, name: str, oracle: Oracle, reference: Callable[[list[int], list[int]], Any]
) -> None:
    """Sampled tokens get the model's raw logprob (temperature does not reshape it)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    client = openai_client(base)
    r = client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=8, temperature=1.3, seed=3, logprobs=True
    )
    content = r.choices[0].logprobs.content
    # each token's bytes name its vocabulary piece, so its id
    pieces = ["".join(table[b] for b in e.bytes) for e in content]
    output = oracle.tokenizer.convert_tokens_to_ids(pieces)
    want = reference(oracle.chat_ids(CHAT), output)
    assert [e.logprob for e in content] == pytest.approx(
        [want[t, i].item() for t, i in enumerate(output)], abs=LOGPROB_TOL
    )
    assert all(e.top_logprobs == [] for e in content)


# ---- errors ------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_bad_inputs_get_openai_errors(base: str, name: str) -> None:
    chat = {"model": name, "messages": CHAT, "max_tokens": 2}
    comp = {"model": name, "prompt": "hello", "max_tokens": 2}
    cases: list[tuple[str, Any, str | None, str | None]] = [
        # route, body, param, code  (all 400)
        ("chat", {**chat, "n": 129}, "n", None),
        ("chat", {**chat, "n": 0}, "n", None),
        ("chat", {**chat, "messages": []}, "messages", None),
        ("chat", {**chat, "messages": [{"role": "tool", "content": "x"}]}, "messages", None),
        ("chat", {**chat, "messages": [{"role": "user", "content": 5}]}, "messages", None),
        ("chat", {**chat, "messages": [{"role": "user"}]}, "messages", None),
        ("chat", {**chat, "temperature": "hot"}, "temperature", None),
        ("chat", {**chat, "temperature": 2.5}, "temperature", None),
        ("chat", {**chat, "top_p": 1.5}, "top_p", None),
        ("chat", {**chat, "max_tokens": 0}, "max_tokens", None),
        ("chat", {**chat, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ("chat", {**chat, "stream": "yes"}, "stream", None),
        ("chat", {**chat, "stream_options": {"include_usage": True}}, "stream_options", None),
        ("chat", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
        ("chat", {**chat, "top_logprobs": 2}, "top_logprobs", None),  # without logprobs
        ("chat", {**chat, "logprobs": 1}, "logprobs", None),
        ("comp", {**comp, "logprobs": 6}, "logprobs", None),
        ("comp", {**comp, "logprobs": True}, "logprobs", None),
        ("chat", {**chat, "max_tokens": 10_000}, "messages", "context_length_exceeded"),
        ("comp", {**comp, "n": 129}, "n", None),
        # more choices in all (prompts x n) than a request may have (max_inputs, 2048)
        ("comp", {**comp, "prompt": [[1]] * 17, "n": 128}, "n", None),
        ("comp", {**comp, "prompt": []}, "prompt", None),
        ("comp", {**comp, "prompt": [1.5]}, "prompt", None),
        ("comp", {**comp, "prompt": [[1], "x"]}, "prompt", None),
        (
            "chat",
            {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            None,
        ),
        ("comp", {**comp, "prompt": [49152]}, "prompt", None),
        ("comp", {**comp, "prompt": [1] * 8192}, "prompt", "context_length_exceeded"),
        (
            "comp",
            {**comp, "prompt": [1] * 8000, "max_tokens": 500},
            "prompt",
            "context_length_exceeded",
        ),
        ("comp", {**comp, "prompt": ""}, "prompt", None),
        ("comp", {**comp, "seed": "7"}, "seed", None),
    ]
    with httpx.Client(base_url=base, timeout=60) as http:
        for route, body, param, code in cases:
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            for stream in (False, True):
                sent = dict(body)
                if stream and "stream" not in body and "stream_options" not in body:
                    sent["stream"] = True
                err = _error(http.post(path, json=sent), 400)
                assert err["type"] == "invalid_request_error", (body, err)
                assert err["param"] == param, (body, err)
                assert err["code"] == code, (body, err)
        for path in ("/v1/chat/completions", "/v1/completions"):
            err = _error(http.post(path, content=b"{not json"), 400)
            assert err["type"] == "invalid_request_error"
            err = _error(http.post(path, json={**chat, **comp, "model": "nope"}), 404)
            assert (err["code"], err["param"]) == ("model_not_found", "model")
        # The worker still serves after all of that.
        r = http.post("/v1/completions", json={**comp, "temperature": 0})
        assert r.status_code == 200, r.text


def test_openai_client_errors(base: str, name: str) -> None:
    from openai import BadRequestError, NotFoundError

    client = openai_client(base)
    with pytest.raises(NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert missing.value.code == "model_not_found"
    with pytest.raises(BadRequestError) as many:
        client.chat.completions.create(model=name, messages=CHAT, n=129)
    assert many.value.param == "n"


def test_wrong_model_kind(two_model_base: str, name: str) -> None:
    with httpx.Client(base_url=two_model_base, timeout=60) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": CHAT}),
            ("/v1/completions", {"prompt": "hello"}),
        ):
            err = _error(http.post(path, json={"model": EMBEDDER, **body}), 400)
            assert err["param"] == "model"
            assert "does not generate" in err["message"]
        err = _error(http.post("/v1/embeddings", json={"model": name, "input": "hi"}), 400)
        assert err["param"] == "model"
        # The same gateway generates with the chat model.
        deadline = time.monotonic() + 30
        while True:
            r = http.post(
                "/v1/completions",
                json={"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
            )
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # replicas still being health-checked
        assert r.status_code == 200, r.text


# ---- disconnects, documentation, metrics -------------------------------------------------


def _wait_replicas_idle(cluster: UpCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        texts = cluster.replica_metrics().values()
        active = sum(metric(t, "tulip_active_sequences") for t in texts)
        free = sum(metric(t, "tulip_kv_pages_free") for t in texts)
        pages = sum(metric(t, "tulip_kv_pages") for t in texts)
        if active == 0 and free == pages:
            return
        assert time.monotonic() < deadline, f"replicas still busy: {active} sequences"
        time.sleep(0.2)


def test_disconnecting_clients_cancel_generation(
    base: str,
    name: str,
    cluster: UpCluster,
) -> None:
    _wait_replicas_idle(cluster)
    before = httpx.get(f"{base}/metrics").text
    cancelled0 = metric(before, "ivy_generations_total", model=name, outcome="cancelled")
    body = {"model": name, "prompt": "1, 2, 3,", "max_tokens": 4000, "temperature": 0}
    # A streaming client that reads two events and hangs up.
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break
    # A non-streaming client that gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait_replicas_idle(cluster)
    deadline = time.monotonic() + 10
    while True:
        after = httpx.get(f"{base}/metrics").text
        cancelled = metric(after, "ivy_generations_total", model=name, outcome="cancelled")
        if cancelled >= cancelled0 + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cancelled == cancelled0 + 2
    # The abandoned non-streamed request is logged as 499, not as a server error.
    assert metric(after, "ivy_requests_total", route="/v1/completions", status="499") == 1
    assert metric(after, "ivy_requests_total", status="500") == 0
    assert metric(after, "ivy_replica_outstanding_tokens", model=name) == 0
    # The next request is served normally.
    r = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_openapi_documents_generation(base: str, name: str) -> None:
    schema = httpx.get(f"{base}/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, request in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{request}"
        assert components[request]["properties"]["model"]["enum"] == [name]
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert {"400", "404", "429", "503"} <= set(op["responses"])
    props = components["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream"} <= set(
        props
    )
    assert "ChatCompletionChunk" in components and "StreamError" in components


def test_metrics_count_generation(base: str, name: str) -> None:
    text = httpx.get(f"{base}/metrics").text
    assert metric(text, "ivy_requests_total", route="/v1/chat/completions", status="200") >= 3
    assert metric(text, "ivy_requests_total", route="/v1/completions", status="200") >= 3
    assert metric(text, "ivy_requests_total", route="/v1/completions", status="400") >= 1
    assert metric(text, "ivy_request_duration_seconds_count", route="/v1/chat/completions") >= 3
    assert metric(text, "ivy_time_to_first_token_seconds_count", model=name) >= 6
    assert metric(text, "ivy_generated_tokens_total", model=name) >= 50
    assert metric(text, "ivy_generations_total", model=name, outcome="length") >= 3
    assert metric(text, "ivy_generations_total", model=name, outcome="stop") >= 1


# ---- structured output (response_format) ------------------------------------------------

BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 0, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
BOOK_CHAT = [{"role": "user", "content": "Describe a famous novel as JSON."}]


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "book", "schema": schema, "strict": True},
    }


@pytest.fixture(scope="module")
def constrained_oracle(model_dir: Path, oracle: Oracle) -> Callable[[list[int], str, int], str]:
    """Greedy decoding by `transformers` under xgrammar's own logits processor for
    transformers (the library's reference integration): the text Trellis must produce."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = int(model.generation_config.eos_token_id)
    info = xgr.TokenizerInfo.from_huggingface(
        oracle.tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[eos]
    )
    compiler = xgr.GrammarCompiler(info)

    def run(ids: list[int], schema: str, max_new_tokens: int) -> str:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos,
                logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
            )[0, len(ids) :].tolist()
        if eos in out:
            out = out[: out.index(eos)]
        return oracle.tokenizer.decode(out, skip_special_tokens=True)

    return run


def test_chat_json_schema_is_held_to_the_schema(
    base: str, name: str, oracle: Oracle, constrained_oracle: Callable[[list[int], str, int], str]
) -> None:
    client = openai_client(base)

    def ask(**kwargs: Any) -> Any:  # noqa: ANN401 - the openai client's own types
        return client.chat.completions.create(
            model=name,
            messages=BOOK_CHAT,
            response_format=_json_schema_format(BOOK_SCHEMA),
            **kwargs,
        )

    r = ask(max_tokens=96, temperature=0)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), BOOK_SCHEMA)
    want = constrained_oracle(oracle.chat_ids(BOOK_CHAT), json.dumps(BOOK_SCHEMA), 96)
    assert content == want
    # Streaming gives the same text.
    stream = ask(max_tokens=96, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    # Sampled answers validate too: the schema bounds every string, number and array, so an
    # answer always ends (the grammar's end is EOS) within the token budget.
    for seed in range(3):
        sampled = ask(max_tokens=400, temperature=1.0, seed=seed).choices[0]
        assert sampled.finish_reason == "stop", sampled.message.content
        jsonschema.validate(json.loads(sampled.message.content), BOOK_SCHEMA)


def test_chat_json_object_gives_an_object(base: str, name: str) -> None:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": name,
            "messages": [{"role": "user", "content": "List two colours in JSON."}],
            "max_tokens": 64,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize(
    ("response_format", "said"),
    [
        ({"type": "xml"}, "response_format"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            'Unsupported type "nonsense"',  # the replica's grammar compiler refused it
        ),
        (  # a keyword the grammar would not hold the answer to: refused, never broken
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                },
            },
            "`uniqueItems` at # is not supported",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {}, "required": ["zz"]},
                },
            },
            "`required` property 'zz'",
        ),
    ],
)
def test_bad_response_formats_get_400(
    base: str, name: str, response_format: dict[str, Any], said: str
) -> None:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": name, "messages": CHAT, "max_tokens": 8, "response_format": response_format},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"].startswith("response_format"), error
    assert said in error["message"], error


def test_up_passes_speculation_flags_to_its_replicas(
    model_dir: Path, oracle: Oracle, constrained_oracle: Callable[[list[int], str, int], str]
) -> None:
    """`trellis up --model M --spec ngram --spec-draft-tokens 3`: each replica is started with
    the flags, drafts with n-grams, and answers greedy requests exactly as without them,
    structured output included (drafts are masked by the grammar like every token)."""
    c = start_up(model_dir, args=["--spec", "ngram", "--spec-draft-tokens", "3"])
    try:
        commands = list(c.replicas().values())
        assert len(commands) == 2, c.children()
        assert all("--spec ngram --spec-draft-tokens 3" in cmd for cmd in commands), commands
        client = openai_client(c.base_url)
        want = [oracle.greedy(oracle.tokenizer(p)["input_ids"], 24) for p in PROMPTS]
        r = client.completions.create(model=c.name, prompt=PROMPTS, max_tokens=24, temperature=0)
        assert [ch.text for ch in r.choices] == [w[0] for w in want]
        held = client.chat.completions.create(
            model=c.name,
            messages=BOOK_CHAT,
            max_tokens=96,
            temperature=0,
            response_format=_json_schema_format(BOOK_SCHEMA),
        )
        want_json = constrained_oracle(oracle.chat_ids(BOOK_CHAT), json.dumps(BOOK_SCHEMA), 96)
        assert held.choices[0].message.content == want_json
        drafted = sum(
            metric(text, "tulip_spec_drafted_tokens_total", method="ngram")
            for text in c.replica_metrics().values()
        )
        assert drafted > 0  # "1, 2, 3, 4, 5," repeats itself: n-grams find drafts
    finally:
        assert stop_up(c) == 0, c.text[-4000:]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--spec", "bogus"], "--spec must be one of"),
        (["--spec-tree", "3,2"], "--spec-tree is only used with --spec mtp"),
        (["--metrics-port", "9"], "--metrics-port is set by trellis up"),
        (["--threads", "2"], "--threads is set by trellis up"),  # not --threads-per-replica
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_up_refuses_bad_replica_flags_before_starting(
    model_dir: Path, flags: list[str], said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ivy.cli", "up", "--model", str(model_dir), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr, done.stderr
    assert "preparing model" not in done.stdout  # refused before anything started


# ---- last: changes the cluster -----------------------------------------------------------


def test_replica_dying_mid_stream_sends_an_error_event(
    base: str,
    name: str,
    cluster: UpCluster,
) -> None:
    from openai import APIError

    _wait_replicas_idle(cluster)
    client = openai_client(base)
    stream = client.completions.create(
        model=name, prompt="1, 2, 3,", max_tokens=4000, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    # Kill the replica that holds the sequence.
    busy = [
        pid
        for pid, text in cluster.replica_metrics().items()
        if metric(text, "tulip_active_sequences") > 0
    ]
    assert len(busy) == 1, busy
    os.kill(busy[0], signal.SIGKILL)
    with pytest.raises(APIError) as info:
        for _ in chunks:
            pass
    assert "replica" in str(info.value.message).lower()
    # Requests keep being served: routed (or retried before their first token) to the
    # surviving replica while the dead one is noticed and restarted.
    for _ in range(4):
        r = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2


def test_replica_dying_under_a_non_streamed_generation_loses_nothing(
    base: str,
    name: str,
    cluster: UpCluster,
    oracle: Oracle,
) -> None:
    """The client has seen nothing of a non-streamed answer: when its replica dies, Ivy
    runs the generation again on the other one, and the answer is the one it would have
    got (greedy), not a 503."""
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health/ready").json()["healthy_replicas"].get(name, 0) < 2:
        assert time.monotonic() < deadline, "the replica killed before was not restarted"
        time.sleep(0.2)
    _wait_replicas_idle(cluster)
    prompt = PROMPTS[1]
    body = {"model": name, "prompt": prompt, "max_tokens": 200, "temperature": 0}
    reference = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    assert reference["choices"][0]["finish_reason"] == "length", reference
    want, _, _ = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], ORACLE_BUDGET)
    assert reference["choices"][0]["text"].startswith(want)
    errors0 = metric(httpx.get(f"{base}/metrics").text, "ivy_generations_total", outcome="error")

    generated0 = {
        pid: metric(text, "tulip_generated_tokens_total")
        for pid, text in cluster.replica_metrics().items()
    }
    with ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=120)
        # Killed once its replica has streamed some of it to Ivy (before the first token
        # the router's own retry would take it), long before it ends.
        busy: list[int] = []
        while not busy and not answer.done():
            busy = [
                pid
                for pid, text in cluster.replica_metrics().items()
                if metric(text, "tulip_generated_tokens_total") >= generated0[pid] + 20
            ]
        assert len(busy) == 1, busy  # caught while generating
        os.kill(busy[0], signal.SIGKILL)
        r = answer.result()
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["text"] == reference["choices"][0]["text"]
    assert got["usage"] == reference["usage"]
    # The lost run is counted as an error; the client never saw it.
    errors = metric(httpx.get(f"{base}/metrics").text, "ivy_generations_total", outcome="error")
    assert errors == errors0 + 1, cluster.text[-3000:]
