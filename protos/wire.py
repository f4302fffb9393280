"""Packing between numpy arrays and the `trellis.v1` wire messages.

Token ids travel as one little-endian uint32 buffer plus per-input lengths; vectors as
little-endian float32/float16 bytes plus a shape. Both sides (Ivy and Tulip) use these
helpers so the byte layout is defined in exactly one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from protos.trellis.v1 import inference_pb2 as pb

__all__ = [
    "WireError",
    "pack_tensor",
    "pack_token_batch",
    "unpack_tensor",
    "unpack_token_batch",
]

_IDS_DTYPE = np.dtype("<u4")
_TENSOR_DTYPES = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_FLOAT16: np.dtype("<f2")}


class WireError(ValueError):
    """A message whose packed fields are inconsistent (sizes, shapes, dtypes)."""


def pack_token_batch(
    ids: np.ndarray | Sequence[Sequence[int]], lengths: np.ndarray | Sequence[int] | None = None
) -> pb.TokenBatch:
    """Pack either (flat ids, lengths) or a list of id lists into a `TokenBatch`."""
    if lengths is None:
        rows = [list(row) for row in ids]  # type: ignore[union-attr]
        lengths = [len(row) for row in rows]
        flat = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=sum(lengths))
    else:
        flat = np.asarray(ids)
    # uint32 ids (what the tokenizer returns) fit by construction: skip two reductions.
    if (
        flat.dtype != _IDS_DTYPE
        and flat.size
        and (flat.min() < 0 or flat.max() > np.iinfo(np.uint32).max)
    ):
        raise WireError("token ids must fit in uint32")
    packed = np.ascontiguousarray(flat, dtype=_IDS_DTYPE)
    lengths_list = [int(n) for n in np.asarray(lengths).tolist()]
    if sum(lengths_list) != packed.size:
        raise WireError(f"lengths sum to {sum(lengths_list)} but {packed.size} ids were given")
    return pb.TokenBatch(ids=packed.tobytes(), lengths=lengths_list)


def unpack_token_batch(batch: pb.TokenBatch) -> tuple[np.ndarray, np.ndarray]:
    """Return (ids uint32 [T], lengths uint32 [B]); raises WireError when they disagree."""
    if len(batch.ids) % _IDS_DTYPE.itemsize:
        raise WireError(f"ids holds {len(batch.ids)} bytes, not a multiple of 4")
    ids = np.frombuffer(batch.ids, dtype=_IDS_DTYPE)
    lengths = np.asarray(batch.lengths, dtype=np.uint32)
    total = int(lengths.sum(dtype=np.uint64))
    if total != ids.size:
        raise WireError(f"lengths sum to {total} but ids holds {ids.size} tokens")
    return ids, lengths


def pack_tensor(array: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> pb.Tensor:
    """Pack a float array as row-major little-endian bytes of the wire dtype."""
    if dtype not in _TENSOR_DTYPES:
        raise WireError(f"unknown tensor dtype {dtype}")
    data = np.ascontiguousarray(array, dtype=_TENSOR_DTYPES[dtype])
    return pb.Tensor(data=data.tobytes(), shape=list(data.shape), dtype=dtype)


def unpack_tensor(tensor: pb.Tensor) -> np.ndarray:
    """Unpack a `Tensor` to a float32 array of its shape."""
    if tensor.dtype not in _TENSOR_DTYPES:
        raise WireError(f"unknown tensor dtype {tensor.dtype}")
    np_dtype = _TENSOR_DTYPES[tensor.dtype]
    shape = tuple(tensor.shape)
    expected = math.prod(shape) * np_dtype.itemsize  # numpy's prod costs ~10 us here
    if expected != len(tensor.data):
        raise WireError(f"tensor of shape {shape} needs {expected} bytes, got {len(tensor.data)}")
    return np.frombuffer(tensor.data, dtype=np_dtype).reshape(shape).astype(np.float32)
