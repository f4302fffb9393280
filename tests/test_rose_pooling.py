"""Pooling over ragged hidden states, Matryoshka truncation, score activations and the
batch layout helpers, against direct per-row computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rose import EngineError, RaggedBatch
from rose.pooling import (
    POOL_CLS,
    POOL_LAST,
    POOL_MEAN,
    apply_activation,
    pool_ragged,
    truncate_dimensions,
)


def _ragged(lengths: list[int], dim: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(lengths), dim, generator=gen)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return hidden, cu, seg


def test_pool_modes_per_row_and_normalize() -> None:
    lengths = [3, 1, 5, 2]
    hidden, cu, seg = _ragged(lengths)
    modes = torch.tensor([POOL_MEAN, POOL_CLS, POOL_LAST, POOL_MEAN])
    norm = torch.tensor([False, True, False, True])
    chunks = torch.split(hidden, lengths)
    want = torch.stack([chunks[0].mean(0), chunks[1][0], chunks[2][-1], chunks[3].mean(0)])
    want[1] /= want[1].norm()
    want[3] /= want[3].norm()
    for present in (frozenset({POOL_MEAN, POOL_CLS, POOL_LAST}), None):
        torch.testing.assert_close(pool_ragged(hidden, cu, seg, modes, norm, present), want)


@pytest.mark.parametrize("code", [POOL_MEAN, POOL_CLS, POOL_LAST])
def test_single_mode_fast_path_equals_select_all(code: int) -> None:
    hidden, cu, seg = _ragged([4, 2, 7])
    modes = torch.full((3,), code)
    norm = torch.zeros(3, dtype=torch.bool)
    torch.testing.assert_close(
        pool_ragged(hidden, cu, seg, modes, norm, frozenset({code})),
        pool_ragged(hidden, cu, seg, modes, norm, None),
    )


def test_empty_rows_pool_to_zero_without_nan() -> None:
    hidden, _, _ = _ragged([3])
    cu = torch.tensor([0, 3, 3])  # row 1 is empty (a graph bucket's spare row)
    seg = torch.zeros(3, dtype=torch.long)
    out = pool_ragged(
        hidden, cu, seg, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool), None
    )
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0


def test_truncate_dimensions_numpy_and_torch() -> None:
    x = np.array([[3.0, 4.0, 12.0], [1.0, 0.0, 5.0]], dtype=np.float32)
    cut = truncate_dimensions(x, 2, normalize=True)
    np.testing.assert_allclose(cut, [[0.6, 0.8], [1.0, 0.0]], atol=1e-7)
    assert cut.dtype == np.float32
    np.testing.assert_array_equal(truncate_dimensions(x, 2, normalize=False), x[:, :2])
    torch.testing.assert_close(
        truncate_dimensions(torch.from_numpy(x), 2, normalize=True), torch.from_numpy(cut)
    )
    for bad in (0, 4):
        with pytest.raises(EngineError, match="dimensions must be an integer in 1..3"):
            truncate_dimensions(x, bad, normalize=True)


def test_apply_activation() -> None:
    logits = np.array([[0.0], [2.0]], dtype=np.float32)
    np.testing.assert_allclose(
        apply_activation(logits, "default", 1), [[0.5], [1 / (1 + np.exp(-2.0))]], rtol=1e-6
    )
    two = np.array([[0.0, 2.0]], dtype=np.float32)
    np.testing.assert_array_equal(apply_activation(two, "default", 2), two)
    np.testing.assert_allclose(
        apply_activation(two, "sigmoid", 2), [[0.5, 1 / (1 + np.exp(-2.0))]], rtol=1e-6
    )
    np.testing.assert_array_equal(apply_activation(logits, "none", 1), logits)
    torch.testing.assert_close(
        apply_activation(torch.zeros(2, 1), "default", 1), torch.full((2, 1), 0.5)
    )
    with pytest.raises(EngineError, match="activation"):
        apply_activation(logits, "softmax", 1)


def test_batch_layouts() -> None:
    batch = RaggedBatch.from_lists([[5, 6, 7], [8]], pooling=["cls", None], normalize=[None, False])
    np.testing.assert_array_equal(batch.input_ids, [5, 6, 7, 8])
    np.testing.assert_array_equal(batch.cu_seqlens, [0, 3, 4])
    assert batch.input_ids.dtype == np.int64 and batch.cu_seqlens.dtype == np.int32
    assert (batch.rows, batch.tokens, batch.pooling, batch.normalize) == (
        2,
        4,
        ("cls", None),
        (None, False),
    )
    packed = RaggedBatch.from_packed(
        np.array([5, 6, 7, 8], dtype=np.uint32),
        np.array([3, 1], dtype=np.uint32),
        first_segment_lengths=[1, 1],
    )
    np.testing.assert_array_equal(packed.input_ids, batch.input_ids)
    np.testing.assert_array_equal(packed.cu_seqlens, batch.cu_seqlens)
    np.testing.assert_array_equal(packed.token_type_ids, [0, 1, 1, 0])
    with pytest.raises(EngineError, match="lengths sum to 5"):
        RaggedBatch.from_packed(np.array([1, 2], dtype=np.uint32), np.array([5], dtype=np.uint32))
    with pytest.raises(EngineError, match="normalize has 1 entries for 2 rows"):
        RaggedBatch.from_lists([[1], [2]], normalize=[True])
