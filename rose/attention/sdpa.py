"""Attention through `torch.nn.functional.scaled_dot_product_attention` without padding.

Two ways to keep padding out of a ragged batch:
  per-sequence    one SDPA call per row on its own [heads, L, head_dim] slice; cost
                  ~ sum(L_i^2) plus one call overhead per row and layer.
  block-diagonal  one SDPA call over all T tokens with a mask that keeps rows apart; cost
                  ~ T^2 (the off-diagonal blocks are wasted) plus one call. Needs no host
                  knowledge in the pass, so it is the only form usable inside CUDA graphs.
"auto" picks per batch: on CPU from a cost model whose constant comes from bench/engine.py's
attention sweep (see bench/results/engine.md); on CUDA block-diagonal up to 8192 tokens.

Memory: the block-diagonal mask is [T, T], so no strategy, "auto" or asked for, takes that form
above `block_diagonal_max_tokens` (outside a CUDA graph, whose token buckets bound it). A row
alone goes through SDPA with no mask (`is_causal` at most), 4-D, matching dtypes and
grouped-query attention in a form the fused kernel takes, so PyTorch dispatches to its flash
kernel (on CPU `_scaled_dot_product_flash_attention_for_cpu`) and attention memory grows
linearly with the row: a 32K-token row never materializes a [L, L] score matrix.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend, AttentionInputs

__all__ = ["SdpaBackend", "SdpaPlan", "block_diagonal_max_tokens", "choose_sdpa_strategy"]

# Cost model for "auto" (CPU, fp32): one extra SDPA call costs about as much as this many
# wasted query-key pairs in a masked call. Measured with bench/engine.py's sweep (12 heads x 32):
# a call ~35 us, a masked pair ~0.1 us over all heads; the masked CPU kernel is slow, so the
# block-diagonal form only wins for a few very short rows.
CALL_COST_IN_PAIRS = 400


# On CUDA, launches are what costs: one masked call unless the [T, T] mask grows too big.
CUDA_BLOCK_DIAGONAL_MAX_TOKENS = 8192

# On CPU the cost model above already keeps block-diagonal to a few hundred tokens; this caps
# the [T, T] mask (4 MiB as bool) whatever the constant or the configured strategy says.
CPU_BLOCK_DIAGONAL_MAX_TOKENS = 2048


def block_diagonal_max_tokens(device_type: str) -> int:
    """The most tokens a block-diagonal call may cover on this device: its [T, T] mask (and the
    masked scores a kernel without a fused mask path makes of it) grows with T²."""
    if device_type == "cuda":
        return CUDA_BLOCK_DIAGONAL_MAX_TOKENS
    return CPU_BLOCK_DIAGONAL_MAX_TOKENS


def choose_sdpa_strategy(lengths: np.ndarray, device_type: str = "cpu") -> str:
    """Per-sequence unless the rows are so many and short that call overhead dominates, and
    never block-diagonal over more than `block_diagonal_max_tokens` tokens."""
    rows = int(lengths.size)
    if rows == 1:
        return "per-sequence"
    total = int(lengths.sum())
    if total > block_diagonal_max_tokens(device_type):
        return "per-sequence"
    if device_type == "cuda":
        return "block-diagonal"
    wasted_pairs = total * total - int(np.square(lengths.astype(np.int64)).sum())
    return "block-diagonal" if (rows - 1) * CALL_COST_IN_PAIRS > wasted_pairs else "per-sequence"


@functools.cache
def fused_kernel_takes_gqa(device_type: str) -> bool:
    """Whether this PyTorch's fused (flash) SDPA kernel accepts fewer key/value heads than query
    heads with ``enable_gqa``; where it does not, SDPA would fall back to its math kernel,
    which materializes the [heads, L, L] scores, so `SdpaBackend` repeats the k/v heads
    itself (a [heads, L, D] copy) instead. Probed once with two tiny tensors."""
    if device_type != "cpu":
        return True  # only CPU is probed (no device needed); its long-row guarantee is CPU's
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 2, 4, 8)  # [1, heads, L, D]
    kv = torch.zeros(1, 1, 4, 8)  # [1, kv_heads, L, D]
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class SdpaPlan:
    strategy: str
    bounds: tuple[tuple[int, int], ...]  # (start, end) per row, per-sequence only


class SdpaBackend(AttentionBackend):
    """SDPA on any device; `strategy` is "auto", "per-sequence" or "block-diagonal" (taken
    per-sequence for batches over `block_diagonal_max_tokens`, except inside a CUDA graph);
    `causal` keeps each token to the tokens at or before it in its row; `compute_dtype`, when
    given, is the dtype the kernel computes in whatever its operands' (they are cast to it and
    the output back: an fp32 engine attending in bf16 where that kernel is faster, AMX CPUs,
    `rose.attention.select_backend`)."""

    name = "sdpa"

    def __init__(
        self,
        strategy: str = "auto",
        device_type: str = "cpu",
        causal: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.strategy = strategy
        self.device_type = device_type
        self.causal = causal
        self.compute_dtype = compute_dtype
        # Inside a graph (plan with a slot) the block-diagonal form is always used.
        self.graph_safe = True

    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> SdpaPlan:
        strategy = self.strategy
        if slot is not None:
            strategy = "block-diagonal"
        elif strategy == "auto":
            strategy = choose_sdpa_strategy(np.diff(host_cu_seqlens), self.device_type)
        elif int(host_cu_seqlens[-1]) > block_diagonal_max_tokens(self.device_type):
            strategy = "per-sequence"  # a [T, T] mask this big would not fit: see the module
        bounds: tuple[tuple[int, int], ...] = ()
        if strategy == "per-sequence":
            cu = host_cu_seqlens.tolist()
            bounds = tuple(zip(cu[:-1], cu[1:], strict=True))
        return SdpaPlan(strategy, bounds)

    def prepare(self, plan: SdpaPlan, inputs: AttentionInputs) -> Any:
        if plan.strategy == "per-sequence":
            return plan
        seg = inputs.seg_ids
        mask = seg.unsqueeze(1) == seg.unsqueeze(0)  # [T, T] bool, True where same row
        if self.causal:  # rows are contiguous: within a row, key index <= query index
            mask = mask.tril_()
        return mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        wanted = self.compute_dtype
        if wanted is not None and q.dtype != wanted:
            o = self._attend(q.to(wanted), k.to(wanted), v.to(wanted), state)
            return o.to(q.dtype)  # [T, heads, head_dim]
        return self._attend(q, k, v, state)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any
    ) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if isinstance(state, SdpaPlan):
            if gqa and not fused_kernel_takes_gqa(q.device.type):
                group = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(group, dim=1)  # [T, heads, head_dim]
                v = v.repeat_interleave(group, dim=1)
                gqa = False
            out = torch.empty_like(q)  # [T, heads, head_dim]
            for start, end in state.bounds:
                # No mask and 4-D operands: the fused kernels' form (linear memory in L).
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1).unsqueeze(0),  # [1, heads, L, head_dim]
                    k[start:end].transpose(0, 1).unsqueeze(0),  # [1, kv_heads, L, head_dim]
                    v[start:end].transpose(0, 1).unsqueeze(0),
                    is_causal=self.causal,
                    enable_gqa=gqa,
                )  # [1, heads, L, head_dim]
                out[start:end] = o.squeeze(0).transpose(0, 1)
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
        notes = ", causal" if self.causal else ""
        if self.compute_dtype is not None:
            notes += f", in {str(self.compute_dtype).removeprefix('torch.')}"
        return f"sdpa ({self.strategy}{notes})"
