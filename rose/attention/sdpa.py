"""Attention through `torch.nn.functional.scaled_dot_product_attention` without padding.

Two ways to keep padding out of a ragged batch:
  per-sequence    one SDPA call per row on its own [heads, L, head_dim] slice; cost
                  ~ sum(L_i^2) plus one call overhead per row and layer.
  block-diagonal  one SDPA call over all T tokens with a mask that keeps rows apart; cost
                  ~ T^2 (the off-diagonal blocks are wasted) plus one call. Needs no host
                  knowledge in the pass, so it is the only form usable inside CUDA graphs.
"auto" picks per batch: on CPU from a cost model whose constant comes from bench/engine.py's
attention sweep (see bench/results/engine.md); on CUDA block-diagonal up to 8192 tokens.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend, AttentionInputs

__all__ = ["SdpaBackend", "choose_sdpa_strategy"]

# Cost model for "auto" (CPU, fp32): one extra SDPA call costs about as much as this many
# wasted query-key pairs in a masked call. Measured with bench/engine.py's sweep (12 heads x 32):
# a call ~35 us, a masked pair ~0.1 us over all heads; the masked CPU kernel is slow, so the
# block-diagonal form only wins for a few very short rows.
CALL_COST_IN_PAIRS = 400


# On CUDA, launches are what costs: one masked call unless the [T, T] mask grows too big.
CUDA_BLOCK_DIAGONAL_MAX_TOKENS = 8192


def choose_sdpa_strategy(lengths: np.ndarray, device_type: str = "cpu") -> str:
    """Per-sequence unless the rows are so many and short that call overhead dominates."""
    rows = int(lengths.size)
    if rows == 1:
        return "per-sequence"
    total = int(lengths.sum())
    if device_type == "cuda":
        return "block-diagonal" if total <= CUDA_BLOCK_DIAGONAL_MAX_TOKENS else "per-sequence"
    wasted_pairs = total * total - int(np.square(lengths.astype(np.int64)).sum())
    return "block-diagonal" if (rows - 1) * CALL_COST_IN_PAIRS > wasted_pairs else "per-sequence"


@dataclass(frozen=True)
class _Plan:
    strategy: str
    bounds: tuple[tuple[int, int], ...]  # (start, end) per row, per-sequence only


class SdpaBackend(AttentionBackend):
    """SDPA on any device; `strategy` is "auto", "per-sequence" or "block-diagonal"; `causal`
    keeps each token to the tokens at or before it in its row."""

    name = "sdpa"

    def __init__(
        self, strategy: str = "auto", device_type: str = "cpu", causal: bool = False
    ) -> None:
        self.strategy = strategy
        self.device_type = device_type
        self.causal = causal
        # Inside a graph (plan with a slot) the block-diagonal form is always used.
        self.graph_safe = True

    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> _Plan:
        strategy = self.strategy
        if slot is not None:
            strategy = "block-diagonal"
        elif strategy == "auto":
            strategy = choose_sdpa_strategy(np.diff(host_cu_seqlens), self.device_type)
        bounds: tuple[tuple[int, int], ...] = ()
        if strategy == "per-sequence":
            cu = host_cu_seqlens.tolist()
            bounds = tuple(zip(cu[:-1], cu[1:], strict=True))
        return _Plan(strategy, bounds)

    def prepare(self, plan: _Plan, inputs: AttentionInputs) -> Any:
        if plan.strategy == "per-sequence":
            return plan
        seg = inputs.seg_ids
        mask = seg.unsqueeze(1) == seg.unsqueeze(0)  # [T, T] bool, True where same row
        if self.causal:  # rows are contiguous: within a row, key index <= query index
            mask = mask.tril_()
        return mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if isinstance(state, _Plan):
            out = torch.empty_like(q)  # [T, heads, head_dim]
            for start, end in state.bounds:
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1),  # [heads, L, head_dim]
                    k[start:end].transpose(0, 1),  # [kv_heads, L, head_dim]
                    v[start:end].transpose(0, 1),
                    is_causal=self.causal,
                    enable_gqa=gqa,
                )  # [heads, L, head_dim]
                out[start:end] = o.transpose(0, 1)
            return out
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, heads, T, head_dim]
            k.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, T, head_dim]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=state,  # [T, T] broadcast over heads (causal within rows when causal)
            enable_gqa=gqa,
        )  # [1, heads, T, head_dim]
        return o.squeeze(0).transpose(0, 1).contiguous()  # [T, heads, head_dim]

    def describe(self) -> str:
        return f"sdpa ({self.strategy}{', causal' if self.causal else ''})"
