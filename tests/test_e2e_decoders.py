"""Granite, Mistral, Mixtral, Phi-3 and Qwen3-MoE decoders chat end to end: a real Tulip
process behind one real Ivy.

For each family a tiny random ``*ForCausalLM`` saved with `transformers`, with a byte-level
BPE ``tokenizer.json`` built here and an ``[INST]`` chat template written here: Mistral with
an explicit head_dim and a sliding window shorter than its positions (as 7B v0.1 has), Phi-3
with its fused projections and LongRoPE over an original context shorter than its positions
(as the 128k models have), Mixtral with routed experts in every layer and a window, Qwen3-MoE
with them in all but one layer, Granite with its four multipliers. Tulip serves
each as a generator whose context is that window or original context (where the model is
what `transformers` computes); chat completions, whole
and streamed, equal `transformers`' greedy ``generate`` on the ids its template gives, and a
prompt past the context is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny_configs
import torch
import transformers
from ivy_process import serve_dirs

SPECIALS = ["<unk>", "<s>", "</s>"]
TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{{- '[INST] ' + m.content + ' [/INST]' }}{%- else %}{{- m.content + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
CORPUS = [
    "[INST] What is the capital of France? [/INST] Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b): return a + b",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "The quick brown fox?"},
    ],
]
CONTEXT = 96  # the served context: Mistral's window, Phi-3's original context, Qwen3-MoE's
FAMILIES: dict[str, tuple[type, dict[str, object]]] = {
    "mistral": (transformers.MistralConfig, {"head_dim": 24, "sliding_window": CONTEXT}),
    "phi3": (
        transformers.Phi3Config,
        {
            "original_max_position_embeddings": CONTEXT,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [3.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
    "granite": (
        transformers.GraniteConfig,
        {
            "max_position_embeddings": CONTEXT,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.4,
            "attention_multiplier": 0.09,
            "logits_scaling": 2.5,
        },
    ),
    "mixtral": (
        transformers.MixtralConfig,
        {"sliding_window": CONTEXT, "num_local_experts": 3, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {
            "head_dim": 16,
            "max_position_embeddings": CONTEXT,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
}
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    vocab = tiny_configs.byte_bpe(
        path,
        CORPUS,
        SPECIALS,
        300,
        chat_template=TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
    )
    torch.manual_seed(11)
    config, family = FAMILIES[request.param]
    model = tiny_configs.chat_decoder(
        config,
        vocab,
        **{
            "max_position_embeddings": 512,
            "bos_token_id": SPECIALS.index("<s>"),
            "eos_token_id": SPECIALS.index("</s>"),
            "pad_token_id": SPECIALS.index("<unk>"),
            **family,
        },
    )
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[tuple[list[int], str, str]]:
    """(prompt ids, greedy text, finish reason) per chat, by transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if "input_ids" in ids else ids)
        assert len(ids) + MAX_TOKENS <= CONTEXT  # what is served: transformers' model
        _, text, finish = tiny_configs.greedy(model, tokenizer, ids, MAX_TOKENS)
        out.append((ids, text, finish))
    assert all(text.strip() for _, text, _ in out)
    return out


@pytest.fixture(scope="module")
def base(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp(f"{model_dir.name}-logs")
    with serve_dirs({"decoder": model_dir}, logs) as url:
        yield url


def _body(chat: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "decoder",
        "messages": chat,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def test_chat_equals_transformers_greedy(base: str, want: list[tuple[list[int], str, str]]) -> None:
    with httpx.Client(base_url=base, timeout=120) as http:
        for chat, (ids, text, finish) in zip(CHATS, want, strict=True):
            r = http.post("/v1/chat/completions", json=_body(chat))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == text
            assert body["choices"][0]["finish_reason"] == finish
            assert body["usage"]["prompt_tokens"] == len(ids)
            with http.stream("POST", "/v1/chat/completions", json=_body(chat, stream=True)) as s:
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            chunks = [json.loads(e) for e in events[:-1]]
            deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
            assert "".join(deltas) == text


def test_the_served_context_is_where_the_model_is_exact(base: str) -> None:
    """The tokenizer route reports the window (Mistral, Mixtral), original context (Phi-3)
    or positions (Granite, Qwen3-MoE) as the model's length, and a prompt that with its answer would pass it is a 400 naming the
    context."""
    with httpx.Client(base_url=base, timeout=120) as http:
        info = http.post("/tokenize", json={"model": "decoder", "prompt": "Paris"}).json()
        assert info["max_model_len"] == CONTEXT
        r = http.post(
            "/v1/completions",
            json={"model": "decoder", "prompt": [5] * (CONTEXT - 4), "max_tokens": 8},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        fits = {"model": "decoder", "prompt": [5] * (CONTEXT - 8), "max_tokens": 8}
        assert http.post("/v1/completions", json=fits).status_code == 200
