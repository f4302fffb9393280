"""Ragged SDPA attention with additive biases and windows, for families whose attention the
`AttentionBackend` interface cannot express (MPNet's relative bias, DeBERTa's disentangled
bias, ModernBERT's sliding window).

These families number positions 0, 1, 2, ... within each row (see each family's
`position_ids`), so the row structure of a batch follows from the positions alone: a row starts
wherever the position is 0. `RowLayout` derives it once per pass, on the device (graph-safe,
block-diagonal) or on the host (one SDPA call per row), in the same two forms as
`rose.attention.sdpa`, and under the same token cap on the block-diagonal form; `attend` then
runs one layer's attention over it.

Memory for a long row: relative positions [L, L] are made only when a bias or a short windowed
row asks for them; a row with neither attends with no mask (SDPA's flash kernel, linear in L);
a windowed row longer than `WINDOW_QUERY_BLOCK` attends block of queries by block of queries,
each against only the keys its window reaches ([block, block + 2·window] per call). The bias
families (MPNet, DeBERTa) build their bias as [heads, L, L] and so stay quadratic; their
configs cap rows at 512 tokens (max_position_embeddings), which the engine enforces per row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend
from rose.attention.sdpa import block_diagonal_max_tokens, choose_sdpa_strategy
from rose.errors import EngineError
from rose.models.family import FamilyOptions

__all__ = [
    "WINDOW_QUERY_BLOCK",
    "Bias",
    "Block",
    "RowLayout",
    "attend",
    "log_sdpa_fallback",
    "require_bidirectional",
]

log = logging.getLogger("rose.models")

# Queries per SDPA call when a windowed row is longer than this (see the module docstring).
WINDOW_QUERY_BLOCK = 512

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
    """One SDPA call: the tokens `span`, their positions and which pairs share a row."""

    span: slice
    positions: torch.Tensor  # [L] int64, 0..n-1 within each row
    same_row: torch.Tensor | None  # [L, L] bool; None when the block is a single row
    # Window masks made by the first layer that needs them and reused by the others of the
    # pass (a layout lives for one pass): (window, first query, dtype) → additive mask.
    window_masks: dict[tuple[int, int, torch.dtype], torch.Tensor | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    @functools.cached_property
    def rel(self) -> torch.Tensor:
        """[L, L] int64, position_q - position_k; made on first use (a bias reads it once
        per pass), never for a row that needs neither bias nor mask."""
        return self.positions.unsqueeze(1) - self.positions.unsqueeze(0)


@dataclass(frozen=True)
class RowLayout:
    """The rows of a ragged batch as SDPA blocks: one per row, or one block-diagonal block."""

    blocks: tuple[Block, ...]

    @classmethod
    def build(cls, positions: torch.Tensor, backend: AttentionBackend | None = None) -> RowLayout:
        """positions: [T] int64, 0..L-1 within each row. The strategy follows the engine's SDPA
        backend's when it has one (`SdpaBackend`, and `OnnxRuntimeBackend` after its SDPA
        fallback: "per-sequence", "block-diagonal", "auto"); "auto" picks as
        `rose.attention.sdpa` does, and always block-diagonal while a CUDA graph is captured."""
        strategy = getattr(backend, "strategy", "auto")
        tokens = positions.shape[0]
        bounds: np.ndarray | None = None
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            strategy = "block-diagonal"
        elif tokens > block_diagonal_max_tokens(positions.device.type):
            strategy = "per-sequence"  # whatever was asked: the [T, T] mask would not fit
        elif strategy == "auto" and positions.is_cuda:
            strategy = "block-diagonal"
        elif strategy == "auto":
            bounds = _host_bounds(positions)
            strategy = choose_sdpa_strategy(np.diff(bounds), "cpu")
        if strategy == "block-diagonal":
            rows = torch.cumsum(positions == 0, dim=0)  # [T] row of each token (1-based)
            same_row = rows.unsqueeze(1) == rows.unsqueeze(0)  # [T, T]
            return cls((Block(slice(0, tokens), positions, same_row),))
        cu = (_host_bounds(positions) if bounds is None else bounds).tolist()
        blocks = tuple(
            Block(slice(start, end), positions[start:end], None)
            for start, end in zip(cu[:-1], cu[1:], strict=True)
        )
        return cls(blocks)


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
        if window is not None and bias is None and block.same_row is None:
            _attend_windowed_row(q, k, v, block, scale, window, out)
            continue
        s = block.span
        allowed = block.same_row  # [L, L] or None
        if window is not None:
            near = block.rel.abs() <= window  # [L, L]
            allowed = near if allowed is None else allowed & near
        mask: torch.Tensor | None = allowed
        if bias is not None:
            mask = bias(i, block).to(q.dtype).unsqueeze(0)  # [1, heads, L, L]
            if allowed is not None:
                mask = mask.masked_fill(~allowed, float("-inf"))
        # 4-D operands (and mask): the form SDPA's fused kernels take.
        o = F.scaled_dot_product_attention(
            q[s].transpose(0, 1).unsqueeze(0),  # [1, heads, L, D]
            k[s].transpose(0, 1).unsqueeze(0),
            v[s].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,  # None, [L, L] bool or [1, heads, L, L]
            scale=scale,
        )  # [1, heads, L, D]
        out[s] = o.squeeze(0).transpose(0, 1)  # [L, heads, D]
    return out


def _attend_windowed_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: Block,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    """One row's windowed attention into `out`, `WINDOW_QUERY_BLOCK` queries per call, each
    against the keys at most `window` tokens away (positions run 0..L-1 along the row, so
    key indices and positions agree): memory [block, block + 2·window] per call, not [L, L]."""
    start, end = block.span.start, block.span.stop
    for a in range(start, end, WINDOW_QUERY_BLOCK):
        b = min(a + WINDOW_QUERY_BLOCK, end)
        ka, kb = max(start, a - window), min(end, b + window)
        key = (window, a, q.dtype)
        if key not in block.window_masks:
            block.window_masks[key] = _window_mask(block, a, b, ka, kb, window, q.dtype)
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).unsqueeze(0),  # [1, heads, b - a, D]
            k[ka:kb].transpose(0, 1).unsqueeze(0),  # [1, heads, kb - ka, D]
            v[ka:kb].transpose(0, 1).unsqueeze(0),
            attn_mask=block.window_masks[key],  # [b - a, kb - ka] additive, or None
            scale=scale,
        )  # [1, heads, b - a, D]
        out[a:b] = o.squeeze(0).transpose(0, 1)  # [b - a, heads, D]


def _window_mask(
    block: Block, a: int, b: int, ka: int, kb: int, window: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """Queries a..b-1 against keys ka..kb-1 of one row: 0 within `window` positions, -inf
    beyond ([b - a, kb - ka], in the scores' dtype, so SDPA adds it as it is). None when every
    pair is within the window (a row of at most window + 1 tokens): no mask lets SDPA take
    its unmasked kernel."""
    if max(b - 1 - ka, kb - 1 - a) <= window:
        return None
    pos = block.positions  # [L], 0..L-1 along the row
    start = block.span.start
    rel = pos[a - start : b - start].unsqueeze(1) - pos[ka - start : kb - start].unsqueeze(0)
    return torch.zeros(rel.shape, dtype=dtype, device=rel.device).masked_fill_(
        rel.abs() > window, float("-inf")
    )
