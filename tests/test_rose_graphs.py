"""The CUDA-graph manager's decisions (bucketing, warm-up → capture → replay, LRU eviction)
on CPU through a capture backend that records them, and the engine's padded static-buffer
path giving the same rows as the eager path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rose import Engine, EngineConfig, RaggedBatch
from rose.graphs import GraphManager, RecordingCaptureBackend, graph_key, row_bucket, token_bucket


def test_token_buckets() -> None:
    assert [token_bucket(n) for n in (1, 64, 65, 128, 1000, 1024)] == [64, 64, 128, 128, 1024, 1024]
    assert [token_bucket(n) for n in (1025, 1280, 1281, 4000)] == [1280, 1280, 1536, 4096]


def test_row_buckets() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 17, 64, 65)] == [1, 2, 4, 4, 8, 32, 64, 128]
    assert graph_key(3, 100) == (4, 128)


class _Counter:
    def __init__(self) -> None:
        self.made = 0
        self.filled: list[int] = []
        self.forwarded: list[int] = []


def _run(
    manager: GraphManager[dict[str, int]], counter: _Counter, key: tuple[int, int], value: int
) -> None:
    """A pass whose "static buffer" is the slot dict: fill writes it, forward reads it, so a
    replayed capture sees the latest fill (as a CUDA graph reads its static inputs)."""

    def make() -> dict[str, int]:
        counter.made += 1
        return {"input": -1}

    def fill(slot: dict[str, int]) -> None:
        slot["input"] = value
        counter.filled.append(value)

    manager.run(key, make, fill, lambda slot: counter.forwarded.append(slot["input"]))


def test_first_hit_warms_up_second_captures_then_replays() -> None:
    rec = RecordingCaptureBackend()
    manager: GraphManager[dict[str, int]] = GraphManager(rec, max_graphs=4)
    counter = _Counter()
    a, b = (1, 64), (2, 128)
    for value, key in enumerate([a, a, a, b, a, b, b]):
        _run(manager, counter, key, value)
    assert rec.events == [
        ("warmup", a),
        ("capture", a),
        ("replay", a),
        ("replay", a),
        ("warmup", b),
        ("replay", a),
        ("capture", b),
        ("replay", b),
        ("replay", b),
    ]
    assert counter.made == 2  # one slot per key, reused
    assert counter.filled == list(range(7))  # inputs refilled before every pass
    assert counter.forwarded == list(range(7))  # every pass ran once with that fill's inputs
    assert manager.captured(a) and manager.captured(b)


def test_lru_eviction_releases_graph_and_restarts_warmup() -> None:
    rec = RecordingCaptureBackend()
    evicted: list[tuple[int, int]] = []
    manager: GraphManager[dict[str, int]] = GraphManager(
        rec, max_graphs=2, on_evict=lambda k, s: evicted.append(k)
    )
    counter = _Counter()
    a, b, c = (1, 64), (1, 128), (1, 192)
    for key in (a, a, b, a, c):  # c evicts b (a was used more recently)
        _run(manager, counter, key, 0)
    assert evicted == [b]
    assert manager.keys() == [a, c]
    assert ("release", b) not in rec.events  # b was only warmed up: nothing captured to free
    _run(manager, counter, b, 0)  # b is back: warm-up again, evicting a (captured → released)
    assert evicted == [b, a]
    assert rec.events[-2:] == [("release", a), ("warmup", b)]
    assert len(manager) == 2


@pytest.fixture(scope="module")
def tiny_xlmr(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(99)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=90,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
    )
    where = tmp_path_factory.mktemp("xlmr") / "tiny"
    transformers.XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(where)
    return where


def test_engine_graph_path_matches_eager(tiny_xlmr: Path) -> None:
    eager = Engine.load(tiny_xlmr, EngineConfig())
    graphed = Engine.load(tiny_xlmr, EngineConfig(max_graphs=2))
    rec = RecordingCaptureBackend()
    graphed.use_capture_backend(rec)
    rng = np.random.default_rng(0)
    batches = []
    for lengths in ([5, 9, 3], [7, 7, 2], [4, 11, 1], [60, 70], [128], [6, 1, 2]):
        rows = [rng.integers(0, 90, n).tolist() for n in lengths]
        pooling = [("mean", "cls", "last", None)[i % 4] for i in range(len(rows))]
        normalize = [i % 2 == 0 for i in range(len(rows))]
        batches.append(RaggedBatch.from_lists(rows, pooling=pooling, normalize=normalize))
    for batch in batches:
        torch.testing.assert_close(
            graphed.step(batch).wait(), eager.step(batch).wait(), atol=1e-5, rtol=0
        )
    k3 = (4, 64)
    assert rec.events == [
        ("warmup", k3),
        ("capture", k3),
        ("replay", k3),
        ("replay", k3),
        ("warmup", (2, 192)),
        ("release", k3),  # max_graphs=2: k3 is the least recently used when (1, 128) arrives
        ("warmup", (1, 128)),
        ("warmup", k3),
    ]


def test_graph_path_cross_encoder_pads_rows(tmp_path: Path) -> None:
    torch.manual_seed(5)
    cfg = transformers.BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=2,
    )
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path)
    eager = Engine.load(tmp_path)
    graphed = Engine.load(tmp_path)
    graphed.use_capture_backend(RecordingCaptureBackend())
    batch = RaggedBatch.from_lists(
        [[2, 5, 9, 3], [2, 7, 3], [2, 3]], token_type_ids=[[0, 0, 1, 1], [0, 0, 1], [0, 1]]
    )
    for _ in range(3):
        torch.testing.assert_close(
            graphed.step(batch).wait(), eager.step(batch).wait(), atol=1e-5, rtol=0
        )
