"""The packed wire format round-trips and rejects inconsistent messages."""

from __future__ import annotations

import numpy as np
import pytest

from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import (
    WireError,
    pack_tensor,
    pack_token_batch,
    unpack_tensor,
    unpack_token_batch,
)


def test_token_batch_round_trip_is_little_endian() -> None:
    rows = [[0, 35378, 4, 2], [0, 250001, 2], [7]]
    batch = pack_token_batch(rows)
    assert batch.ids[:8] == bytes([0, 0, 0, 0, 0x32, 0x8A, 0, 0])  # 35378 = 0x8A32
    ids, lengths = unpack_token_batch(pb.TokenBatch.FromString(batch.SerializeToString()))
    assert lengths.tolist() == [4, 3, 1]
    assert ids.tolist() == [i for row in rows for i in row]
    flat = pack_token_batch(np.array([1, 2, 3], dtype=np.uint32), np.array([2, 1], dtype=np.uint32))
    assert unpack_token_batch(flat)[0].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "batch",
    [
        pb.TokenBatch(ids=b"\x00\x00\x00", lengths=[1]),
        pb.TokenBatch(ids=b"\x00" * 8, lengths=[1]),
        pb.TokenBatch(ids=b"\x00" * 4, lengths=[1, 1]),
    ],
)
def test_inconsistent_token_batch_is_rejected(batch: pb.TokenBatch) -> None:
    with pytest.raises(WireError):
        unpack_token_batch(batch)


def test_pack_rejects_bad_ids() -> None:
    with pytest.raises(WireError):
        pack_token_batch([[-1]])
    with pytest.raises(WireError):
        pack_token_batch(np.array([1, 2]), [3])


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16])
def test_tensor_round_trip(dtype: int) -> None:
    array = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    back = unpack_tensor(pack_tensor(array, dtype))
    assert back.shape == (3, 5) and back.dtype == np.float32
    np.testing.assert_allclose(back, array, atol=0 if dtype == pb.DTYPE_FLOAT32 else 2e-3)


def test_tensor_size_mismatch_is_rejected() -> None:
    with pytest.raises(WireError):
        unpack_tensor(pb.Tensor(data=b"\x00" * 12, shape=[2, 2], dtype=pb.DTYPE_FLOAT32))
