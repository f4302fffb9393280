"""Sentence pooling over ragged hidden states, L2 normalization, Matryoshka truncation and
cross-encoder score activations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rose.errors import EngineError

if TYPE_CHECKING:
    from rose.loading import DenseLayer

__all__ = [
    "ACTIVATIONS",
    "POOL_CLS",
    "POOL_CODES",
    "POOL_LAST",
    "POOL_MEAN",
    "apply_activation",
    "dense_projection",
    "pool_ragged",
    "truncate_dimensions",
]

POOL_MEAN, POOL_CLS, POOL_LAST = 0, 1, 2
POOL_CODES = {"mean": POOL_MEAN, "cls": POOL_CLS, "last": POOL_LAST}
ACTIVATIONS = ("none", "sigmoid", "default")

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)


def pool_ragged(
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seg_ids: torch.Tensor,
    modes: torch.Tensor,
    normalize: torch.Tensor,
    present: frozenset[int] | None = None,
    project: nn.Module | None = None,
) -> torch.Tensor:
    """Pool each row of a ragged batch to one float32 vector.

    hidden: [T, H]; cu_seqlens: [B+1] int64; seg_ids: [T] int64 (row of each token);
    modes: [B] int64 pooling code per row (`POOL_CODES`); normalize: [B] bool.
    present: the codes that occur in `modes` (computes only those); None computes all three
    and selects per row, which needs no host knowledge (CUDA-graph safe).
    project: the model's sentence-transformers Dense layers (`dense_projection`), applied
    to the pooled rows before normalization, [B, H] → [B, D].
    Returns [B, D] float32 (D = H without `project`). Rows with no tokens (graph padding)
    pool to zeros (then to the projection of zeros).
    """
    rows = modes.shape[0]
    x = hidden.float()  # [T, H]
    starts = cu_seqlens[:-1]  # [B]
    lengths = cu_seqlens[1:] - starts  # [B]
    todo = present if present is not None else frozenset(POOL_CODES.values())
    out: torch.Tensor | None = None
    for code in (POOL_MEAN, POOL_CLS, POOL_LAST):
        if code not in todo:
            continue
        if code == POOL_MEAN:
            sums = x.new_zeros(rows, x.shape[1]).index_add_(0, seg_ids, x)  # [B, H]
            pooled = sums / lengths.clamp(min=1).unsqueeze(1).to(x.dtype)
        elif code == POOL_CLS:
            pooled = x[starts.clamp(max=x.shape[0] - 1)]  # [B, H]
        else:
            pooled = x[(cu_seqlens[1:] - 1).clamp(min=0)]  # [B, H]
        if len(todo) == 1:
            out = pooled
        elif out is None:
            out = pooled * (modes == code).unsqueeze(1)
        else:
            out = torch.where((modes == code).unsqueeze(1), pooled, out)
    assert out is not None
    if project is not None:
        out = project(out)  # [B, D]
    return torch.where(normalize.unsqueeze(1), F.normalize(out, p=2.0, dim=-1), out)


def dense_projection(layers: Sequence[DenseLayer], device: torch.device) -> nn.Module | None:
    """The Dense layers as one float32 module on `device` (None when there are none)."""
    if not layers:
        return None
    parts: list[nn.Module] = []
    for layer in layers:
        out_features, in_features = layer.weight.shape
        linear = nn.Linear(in_features, out_features, bias=layer.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(layer.weight)
            if layer.bias is not None:
                linear.bias.copy_(layer.bias)
        parts.append(linear)
        if layer.activation == "tanh":
            parts.append(nn.Tanh())
    return nn.Sequential(*parts).to(device).eval().requires_grad_(False)


def truncate_dimensions(x: ArrayT, dims: int, normalize: bool) -> ArrayT:
    """Matryoshka: keep the first `dims` components of each row, then L2-normalize if asked."""
    size = x.shape[-1]
    if not isinstance(dims, int) or dims < 1 or dims > size:
        raise EngineError(f"dimensions must be an integer in 1..{size}, got {dims!r}")
    cut = x[..., :dims]
    if not normalize:
        return cut
    if isinstance(cut, torch.Tensor):
        return F.normalize(cut, p=2.0, dim=-1)
    norms = np.linalg.norm(cut, axis=-1, keepdims=True)
    return cut / np.maximum(norms, 1e-12).astype(cut.dtype)


def apply_activation(logits: ArrayT, activation: str, num_labels: int) -> ArrayT:
    """Turn cross-encoder logits into scores: "none" keeps them, "sigmoid" squashes them,
    "default" squashes iff the model has one label."""
    if activation not in ACTIVATIONS:
        raise EngineError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    squash = activation == "sigmoid" or (activation == "default" and num_labels == 1)
    if not squash:
        return logits
    if isinstance(logits, torch.Tensor):
        return torch.sigmoid(logits)
    return (1.0 / (1.0 + np.exp(-logits))).astype(logits.dtype, copy=False)
