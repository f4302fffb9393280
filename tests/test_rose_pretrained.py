"""ROSE on the real embedding models against `transformers` and `sentence-transformers`
(same weights, fp32, CPU).

Bars (issue 4): vs transformers (padded batch, attention-masked mean pooling, L2 normalize)
max abs diff <= 1e-4 and cosine >= 0.99999 per row; vs sentence-transformers encode()
cosine >= 0.9999 per row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer

from rose import Engine, EngineConfig, RaggedBatch
from rose.assets import ensure_model

TEXTS = [
    "how much protein should a female eat",
    "Le chat est assis sur le tapis et regarde les oiseaux par la fenêtre.",
    "Ein kurzer Satz.",
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。",
    "Definition of summit for English Language Learners: the highest point of a mountain; "
    "the top of a mountain. A meeting between leaders of governments to discuss important "
    "matters, often held over several days with long sessions of negotiation and many "
    "statements to the press afterwards, which are reported around the world.",
    "ok",
    "Привет, как дела? Это тестовое предложение для проверки модели на русском языке.",
    "x " * 150,
]


@pytest.fixture(scope="module", params=["multilingual-e5-small", "all-minilm-l6-v2"])
def model(request: pytest.FixtureRequest) -> tuple[str, Path, Engine]:
    path = ensure_model(request.param)
    return request.param, path, Engine.load(path, EngineConfig(device="cpu"))


def _texts(name: str) -> list[str]:
    if name == "multilingual-e5-small":  # e5 expects its prompts; tokens are what matters here
        return [("query: " if i % 2 else "passage: ") + t for i, t in enumerate(TEXTS)]
    return TEXTS


def _rose(engine: Engine, path: Path, texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(texts, truncation=True, max_length=engine.info.max_input_tokens)["input_ids"]
    return engine.step(RaggedBatch.from_lists(ids)).numpy(), ids


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_info(model: tuple[str, Path, Engine]) -> None:
    name, _, engine = model
    info = engine.info
    assert (info.kind, info.dimensions, info.default_pooling, info.default_normalize) == (
        "embedding",
        384,
        "mean",
        True,
    )
    if name == "multilingual-e5-small":
        assert (info.query_prompt, info.document_prompt, info.max_input_tokens) == (
            "query: ",
            "passage: ",
            512,
        )
    else:
        assert info.max_input_tokens == 256


def test_matches_transformers(model: tuple[str, Path, Engine]) -> None:
    name, path, engine = model
    texts = _texts(name)
    got, ids = _rose(engine, path, texts)
    ref = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    width = max(len(r) for r in ids)
    pad = ref.config.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    with torch.no_grad():
        hidden = ref(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
    want = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    assert np.abs(got - want).max() <= 1e-4
    assert _cos(got, want).min() >= 0.99999


def test_matches_sentence_transformers(model: tuple[str, Path, Engine]) -> None:
    name, path, engine = model
    texts = _texts(name)
    got, _ = _rose(engine, path, texts)
    st = SentenceTransformer(str(path), device="cpu")
    want = st.encode(texts, batch_size=4, convert_to_numpy=True)
    assert want.shape == got.shape
    assert _cos(got, want).min() >= 0.9999


def test_matryoshka_and_normalize_off(model: tuple[str, Path, Engine]) -> None:
    from rose.pooling import truncate_dimensions

    name, path, engine = model
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(_texts(name)[:3])["input_ids"]
    raw = engine.step(RaggedBatch.from_lists(ids, normalize=[False] * 3)).numpy()
    unit = engine.step(RaggedBatch.from_lists(ids)).numpy()
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=-1, keepdims=True), atol=1e-6)
    cut = truncate_dimensions(unit, 128, normalize=True)
    np.testing.assert_allclose(
        cut, raw[:, :128] / np.linalg.norm(raw[:, :128], axis=-1, keepdims=True), atol=1e-6
    )
