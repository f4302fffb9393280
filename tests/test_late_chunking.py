"""Late chunking in the engine and its layout in Ivy: with spans, an embedder returns one
vector per span, pooled over the span's tokens after they attended to their whole row.

The reference is `transformers` on the real all-MiniLM-L6-v2 weights: one forward pass over
the whole row, the mean of each span's last hidden states, L2-normalized (the model's
sentence-transformers configuration normalizes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from ivy.gateway import _late_chunks
from rose import Engine, EngineConfig, RaggedBatch
from rose.assets import ensure_model
from rose.errors import EngineError

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Search engines rank passages by relevance to a query.",
]


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, Engine, list[list[int]]]:
    path = ensure_model("all-minilm-l6-v2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rows = tok(TEXTS)["input_ids"]
    return path, Engine.load(path, EngineConfig(device="cpu")), rows


def _span_means(path: Path, row: list[int], spans: list[tuple[int, int]]) -> np.ndarray:
    model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([row])).last_hidden_state[0]
    means = torch.stack([hidden[a:b].mean(0) for a, b in spans])
    return torch.nn.functional.normalize(means, dim=-1).numpy()


def test_spans_pool_their_own_tokens_of_one_pass(minilm) -> None:
    path, engine, rows = minilm
    first = [(1, 4), (4, 9), (9, len(rows[0]) - 1)]
    batch = RaggedBatch.from_lists(rows)
    batch = RaggedBatch(
        batch.input_ids,
        batch.cu_seqlens,
        span_counts=np.array([3, 1]),
        spans=np.array([*first, (0, len(rows[1]))]),
    )
    got = engine.step(batch).numpy()
    assert got.shape == (4, 384)
    np.testing.assert_allclose(got[:3], _span_means(path, rows[0], first), atol=1e-5)
    # A whole-row span is the row's ordinary embedding, batched or alone.
    whole = engine.step(RaggedBatch.from_lists(rows[1:])).numpy()
    np.testing.assert_allclose(got[3], whole[0], atol=1e-5)


def test_spans_with_per_row_pooling_and_normalization(minilm) -> None:
    _, engine, rows = minilm
    batch = RaggedBatch.from_lists(rows, pooling=["cls", None], normalize=[None, False])
    spanned = RaggedBatch(
        batch.input_ids,
        batch.cu_seqlens,
        pooling=batch.pooling,
        normalize=batch.normalize,
        span_counts=np.array([1, 1]),
        spans=np.array([(0, len(rows[0])), (0, len(rows[1]))]),
    )
    np.testing.assert_allclose(engine.step(spanned).numpy(), engine.step(batch).numpy(), atol=1e-6)


@pytest.mark.parametrize(
    ("counts", "spans", "message"),
    [
        ([1], [(0, 2)], "one count >= 1 for each of 2 rows"),
        ([1, 0], [(0, 2)], "one count >= 1"),
        ([1, 1], [(0, 2)], r"must be \[2, 2\]"),
        ([1, 1], [(0, 2), (3, 3)], "is not a non-empty span"),
        ([1, 1], [(0, 2), (0, 99)], "is not a non-empty span of its row"),
    ],
)
def test_bad_spans_are_refused(counts, spans, message) -> None:
    batch = RaggedBatch.from_lists([[1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(EngineError, match=message):
        RaggedBatch(
            batch.input_ids,
            batch.cu_seqlens,
            span_counts=np.array(counts),
            spans=np.array(spans).reshape(-1, 2),
        )


def test_ivy_lays_documents_out_with_their_frame() -> None:
    # Three chunks of 2, 1 and 3 tokens in document 0, one of 2 tokens in document 1.
    ids = np.array([10, 11, 20, 30, 31, 32, 40, 41], dtype=np.uint32)
    lengths = np.array([2, 1, 3, 2])
    packed, doc_lengths, bounds = _late_chunks(
        ids,
        lengths,
        np.array([3, 1]),
        np.array([1, 7], dtype=np.uint32),
        np.array([2], dtype=np.uint32),
    )
    assert packed.tolist() == [1, 7, 10, 11, 20, 30, 31, 32, 2, 1, 7, 40, 41, 2]
    assert doc_lengths.tolist() == [9, 5]
    assert bounds.tolist() == [[2, 4], [4, 5], [5, 8], [2, 4]]
