"""Ragged SDPA attention with additive biases and windows, for families whose attention the
`AttentionBackend` interface cannot express (MPNet's relative bias, DeBERTa's disentangled
bias, ModernBERT's sliding window).

These families number positions 0, 1, 2, ... within each row (see each family's
`position_ids`), so the row structure of a batch follows from the positions alone: a row starts
wherever the position is 0. `RowLayout` derives it once per pass, on the device (graph-safe,
block-diagonal) or on the host (one SDPA call per row), in the same two forms as
`rose.attention.sdpa`; `attend` then runs one layer's attention over it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend
from rose.attention.sdpa import CUDA_BLOCK_DIAGONAL_MAX_TOKENS, SdpaBackend, choose_sdpa_strategy
from rose.errors import EngineError
from rose.models.family import FamilyOptions

__all__ = ["Bias", "Block", "RowLayout", "attend", "log_sdpa_fallback", "require_bidirectional"]

log = logging.getLogger("rose.models")

# (index of the block in its layout, the block) → an additive bias [heads, L, L] for the
# block's scores, already scaled.
Bias = Callable[[int, "Block"], torch.Tensor]


def log_sdpa_fallback(family: str, why: str) -> None:
    log.info("rose %s: attention through SDPA, not the engine's backend (%s)", family, why)


def require_bidirectional(options: FamilyOptions, family: str) -> None:
    """The engine options these bidirectional encoders (no LM head) cannot honour."""
    if options.attention_mode == "causal":
        raise EngineError(
            f"EngineConfig.attention_mode='causal': {family} encoders attend bidirectionally only"
        )
    if options.score_tokens is not None:
        raise EngineError(
            f"modules.json: a LogitScore module needs a causal LM; {family} has no LM head here"
        )


@dataclass(frozen=True)
class Block:
    """One SDPA call: the tokens `span`, their relative positions and which pairs share a row."""

    span: slice
    rel: torch.Tensor  # [L, L] int64, position_q - position_k
    same_row: torch.Tensor | None  # [L, L] bool; None when the block is a single row


@dataclass(frozen=True)
class RowLayout:
    """The rows of a ragged batch as SDPA blocks: one per row, or one block-diagonal block."""

    blocks: tuple[Block, ...]

    @classmethod
    def build(cls, positions: torch.Tensor, backend: AttentionBackend | None = None) -> RowLayout:
        """positions: [T] int64, 0..L-1 within each row. The strategy follows the engine's SDPA
        backend when it is one ("per-sequence", "block-diagonal", "auto"); "auto" picks as
        `rose.attention.sdpa` does, and always block-diagonal while a CUDA graph is captured."""
        strategy = backend.strategy if isinstance(backend, SdpaBackend) else "auto"
        tokens = positions.shape[0]
        bounds: np.ndarray | None = None
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            strategy = "block-diagonal"
        elif strategy == "auto" and positions.is_cuda:
            fits = tokens <= CUDA_BLOCK_DIAGONAL_MAX_TOKENS
            strategy = "block-diagonal" if fits else "per-sequence"
        elif strategy == "auto":
            bounds = _host_bounds(positions)
            strategy = choose_sdpa_strategy(np.diff(bounds), "cpu")
        if strategy == "block-diagonal":
            rows = torch.cumsum(positions == 0, dim=0)  # [T] row of each token (1-based)
            same_row = rows.unsqueeze(1) == rows.unsqueeze(0)  # [T, T]
            rel = positions.unsqueeze(1) - positions.unsqueeze(0)  # [T, T]
            return cls((Block(slice(0, tokens), rel, same_row),))
        cu = (_host_bounds(positions) if bounds is None else bounds).tolist()
        blocks = []
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            local = positions[start:end]  # [L]
            rel = local.unsqueeze(1) - local.unsqueeze(0)  # [L, L]
            blocks.append(Block(slice(start, end), rel, None))
        return cls(tuple(blocks))


def _host_bounds(positions: torch.Tensor) -> np.ndarray:
    """[B+1] row boundaries (cu_seqlens) read back from the positions."""
    starts = torch.nonzero(positions == 0).flatten().cpu().numpy()  # [B]
    return np.append(starts, positions.shape[0]).astype(np.int64)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RowLayout,
    scale: float,
    bias: Bias | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q, k, v: [T, heads, D] → [T, heads, D]; softmax(q·k * scale + bias) v within each row,
    over keys at most `window` positions away when a window is given."""
    out = torch.empty_like(q)  # [T, heads, D]
    for i, block in enumerate(layout.blocks):
        s = block.span
        allowed = block.same_row  # [L, L] or None
        if window is not None:
            near = block.rel.abs() <= window  # [L, L]
            allowed = near if allowed is None else allowed & near
        mask: torch.Tensor | None = allowed
        if bias is not None:
            mask = bias(i, block).to(q.dtype)  # [heads, L, L]
            if allowed is not None:
                mask = mask.masked_fill(~allowed, float("-inf"))
        o = F.scaled_dot_product_attention(
            q[s].transpose(0, 1),  # [heads, L, D]
            k[s].transpose(0, 1),
            v[s].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )  # [heads, L, D]
        out[s] = o.transpose(0, 1)  # [L, heads, D]
    return out
