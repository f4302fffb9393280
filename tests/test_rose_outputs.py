"""ROSE's output kinds beside dense vectors (`rose.heads`), against their references.

* BGE-M3 (tiny random XLM-R + random sparse_linear.pt / colbert_linear.pt): dense, sparse and
  multi-vector outputs of one pass equal FlagEmbedding's formulas on `transformers` hidden
  states; token states equal `transformers`' last hidden states.
* SPLADE (tiny random BertForMaskedLM or DistilBertForMaskedLM saved as a
  sentence-transformers SparseEncoder): the sparse output equals SparseEncoder.encode.
* Rows asking for different kinds share one batch; batched == single; fp32 within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from output_models import (
    TEXTS,
    bge_m3_reference,
    encode,
    make_bge_m3,
    make_splade,
    splade_reference,
)

from rose import Engine, EngineConfig, EngineError, RaggedBatch
from rose.engine import pass_groups
from rose.lazy import RaggedRows

ALL = frozenset({"dense", "sparse", "multi_vector", "token_states"})
TOL = 1e-4


@pytest.fixture(scope="module")
def bge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bge_m3(tmp_path_factory.mktemp("outputs") / "bge-m3")


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_splade(tmp_path_factory.mktemp("outputs") / "splade")


@pytest.fixture(scope="module")
def splade_distil(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_splade(tmp_path_factory.mktemp("outputs") / "splade-distil", layout="distilbert")


def _sparse_dicts(rows: RaggedRows) -> list[dict[int, float]]:
    out = []
    for i in range(rows.counts.size):
        ids, values = rows.row(i)
        assert ids is not None
        assert np.all(np.diff(ids) > 0), "indices ascend within a row"
        out.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    return out


def _assert_sparse_equal(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in w], [w[k] for k in w], atol=TOL, rtol=0)


def test_bge_m3_offers_its_heads(bge: Path) -> None:
    engine = Engine.load(bge, EngineConfig(device="cpu"))
    assert engine.info.outputs == ("dense", "sparse", "multi_vector", "token_states")


def test_bge_m3_three_outputs_equal_flagembedding_formulas(bge: Path) -> None:
    engine = Engine.load(bge, EngineConfig(device="cpu"))
    rows = encode(bge, TEXTS)
    out = engine.step_outputs(RaggedBatch.from_lists(rows, kinds=[ALL] * len(rows)))
    dense, sparse, colbert = bge_m3_reference(bge, rows)
    np.testing.assert_allclose(out.dense.numpy(), dense, atol=TOL, rtol=0)
    _assert_sparse_equal(_sparse_dicts(out.sparse), sparse)
    assert out.multi_vector is not None
    assert out.multi_vector.counts.tolist() == [len(r) - 1 for r in rows]
    for i, want in enumerate(colbert):
        np.testing.assert_allclose(out.multi_vector.row(i)[1], want, atol=TOL, rtol=0)
    hf = transformers.XLMRobertaModel.from_pretrained(bge, add_pooling_layer=False).eval()
    assert out.token_states is not None
    with torch.no_grad():
        for i, ids in enumerate(rows):
            want_h = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
            np.testing.assert_allclose(out.token_states.row(i)[1], want_h, atol=TOL, rtol=0)


def test_rows_asking_different_kinds_share_a_batch_and_equal_single_rows(bge: Path) -> None:
    engine = Engine.load(bge, EngineConfig(device="cpu"))
    rows = encode(bge, TEXTS)
    kinds = [
        frozenset({"sparse"}),
        frozenset(),
        ALL,
        frozenset({"multi_vector", "dense"}),
        frozenset({"token_states"}),
    ]
    batched = engine.step_outputs(RaggedBatch.from_lists(rows, kinds=kinds))
    dense = batched.dense.numpy()
    for i, ids in enumerate(rows):
        alone = engine.step_outputs(RaggedBatch.from_lists([ids], kinds=[ALL]))
        np.testing.assert_allclose(dense[i], alone.dense.numpy()[0], atol=TOL, rtol=0)
        for kind, got in batched.extras().items():
            want = alone.extras()[kind]
            if kind not in kinds[i]:
                assert got.counts[i] == 0
                continue
            g_ids, g_values = got.row(i)
            w_ids, w_values = want.row(0)
            if g_ids is not None:
                assert g_ids.tolist() == w_ids.tolist()  # type: ignore[union-attr]
            np.testing.assert_allclose(g_values, w_values, atol=TOL, rtol=0)
    assert batched.sparse is not None and batched.sparse.counts[1] == 0


@pytest.mark.parametrize("layout", ["bert", "distilbert"])
def test_splade_equals_sentence_transformers_sparse_encoder(
    request: pytest.FixtureRequest, layout: str
) -> None:
    splade = request.getfixturevalue("splade" if layout == "bert" else "splade_distil")
    engine = Engine.load(splade, EngineConfig(device="cpu"))
    assert "sparse" in engine.info.outputs and "multi_vector" not in engine.info.outputs
    rows = encode(splade, TEXTS)
    want = splade_reference(splade, TEXTS)
    out = engine.step_outputs(RaggedBatch.from_lists(rows, kinds=[frozenset({"sparse"})] * 5))
    _assert_sparse_equal(_sparse_dicts(out.sparse), want)
    for i, ids in enumerate(rows):  # batched == single
        alone = engine.step_outputs(RaggedBatch.from_lists([ids], kinds=[frozenset({"sparse"})]))
        _assert_sparse_equal(_sparse_dicts(alone.sparse), [want[i]])


def test_a_kind_the_model_lacks_is_refused_by_name(splade: Path, bge: Path) -> None:
    engine = Engine.load(splade, EngineConfig(device="cpu"))
    with pytest.raises(EngineError, match="multi_vector"):
        engine.step_outputs(
            RaggedBatch.from_lists([[1, 5, 2]], kinds=[frozenset({"multi_vector"})])
        )
    with pytest.raises(EngineError, match="step_outputs"):
        engine.step(RaggedBatch.from_lists([[1, 5, 2]], kinds=[frozenset({"sparse"})]))
    with pytest.raises(EngineError, match="unknown output kind"):
        RaggedBatch.from_lists([[1, 5, 2]], kinds=[frozenset({"colbert"})])


def test_plain_step_is_unchanged_by_heads(bge: Path) -> None:
    engine = Engine.load(bge, EngineConfig(device="cpu"))
    rows = encode(bge, TEXTS)
    plain = engine.step(RaggedBatch.from_lists(rows)).numpy()
    dense, _, _ = bge_m3_reference(bge, rows)
    np.testing.assert_allclose(plain, dense, atol=TOL, rtol=0)


def test_head_files_are_checked_by_key_set_and_shape(bge: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bge, broken)
    torch.save({"weight": torch.zeros(1, 16), "bias": torch.zeros(1)}, broken / "sparse_linear.pt")
    with pytest.raises(EngineError, match="sparse_linear.pt"):
        Engine.load(broken, EngineConfig(device="cpu"))
    torch.save({"weight": torch.zeros(1, 32)}, broken / "sparse_linear.pt")
    with pytest.raises(EngineError, match="keys"):
        Engine.load(broken, EngineConfig(device="cpu"))


# -- CPU passes in groups of rows (EngineConfig.cpu_pass_tokens) -------------------------------


def test_pass_groups_cover_every_row_once_within_the_limit() -> None:
    cu = np.array([0, 512, 1024, 1536, 2048, 2560, 5560, 5570])
    assert pass_groups(cu, 2048) == [(0, 4), (4, 5), (5, 6), (6, 7)]  # 3000 tokens alone
    assert pass_groups(cu, 10**6) == [(0, 7)]
    assert pass_groups(np.array([0, 3]), 1) == [(0, 1)]
    assert pass_groups(np.array([0, 10, 20, 30]), 20) == [(0, 2), (2, 3)]


def test_grouped_cpu_passes_give_the_outputs_of_one_pass(bge: Path) -> None:
    """Every output kind, spans included, is the same whether the encoder sees the batch
    at once or in groups of rows (and the groups really are separate encoder calls)."""
    rows = encode(bge, TEXTS)
    kinds = [ALL, frozenset({"sparse"}), frozenset(), frozenset({"multi_vector"}), ALL]
    whole = Engine.load(bge, EngineConfig(device="cpu", cpu_pass_tokens=10**6))
    limit = max(len(r) for r in rows)
    grouped = Engine.load(bge, EngineConfig(device="cpu", cpu_pass_tokens=limit))
    calls: list[int] = []
    grouped._model.encoder.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))

    batch = RaggedBatch.from_lists(rows, kinds=kinds)
    want, got = whole.step_outputs(batch), grouped.step_outputs(batch)
    assert len(calls) >= 3 and sum(calls) == sum(len(r) for r in rows), calls
    np.testing.assert_allclose(got.dense.numpy(), want.dense.numpy(), atol=TOL, rtol=0)
    for kind, w in want.extras().items():
        g = got.extras()[kind]
        assert g.counts.tolist() == w.counts.tolist()
        for i in range(len(rows)):
            g_ids, g_values = g.row(i)
            w_ids, w_values = w.row(i)
            if w_ids is not None:
                assert g_ids.tolist() == w_ids.tolist()  # type: ignore[union-attr]
            np.testing.assert_allclose(g_values, w_values, atol=TOL, rtol=0)

    plain = RaggedBatch.from_lists(rows)
    spans = RaggedBatch(
        plain.input_ids,
        plain.cu_seqlens,
        span_counts=np.array([1] * len(rows)),
        spans=np.array([(1, len(r) - 1) for r in rows]),
    )
    np.testing.assert_allclose(
        grouped.step(spans).numpy(), whole.step(spans).numpy(), atol=TOL, rtol=0
    )
