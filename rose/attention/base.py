"""The attention backend interface.

A backend computes attention over a ragged batch: q is [T, heads, head_dim] and k, v are
[T, kv_heads, head_dim] (grouped-query attention when kv_heads < heads: query head h reads kv
head h // (heads / kv_heads)), the rows' tokens concatenated; a token attends only to the
tokens of its own row, and with `causal` set only to those at or before its own position.

Per forward pass it works in three steps so the middle of the pass can be captured in a CUDA
graph:
    plan(host_cu_seqlens, slot)      host side, before the pass (or before a graph replay)
    prepare(plan, inputs)            device ops only, once per pass (inside a captured graph)
    attend(q, k, v, state)           once per layer
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["AttentionBackend", "AttentionInputs"]


@dataclass(frozen=True)
class AttentionInputs:
    """Device-side description of a ragged batch, valid inside a captured graph.

    cu_seqlens: [B+1] int32; seg_ids: [T] int64, the row of each token (padding tokens of a
    graph bucket carry a row id of their own so they never mix with real rows).
    """

    cu_seqlens: torch.Tensor
    seg_ids: torch.Tensor


class AttentionBackend(ABC):
    """Ragged attention, causal or not (fixed per backend). `graph_safe` backends may run
    inside CUDA graphs."""

    name: str = "abstract"
    graph_safe: bool = False
    causal: bool = False

    @abstractmethod
    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> Any:
        """Host-side work for one pass; `slot` names a CUDA graph whose buffers it must reuse."""

    def prepare(self, plan: Any, inputs: AttentionInputs) -> Any:
        """Device-side work shared by all layers of one pass (default: none)."""
        return plan

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        """q: [T, heads, head_dim], k, v: [T, kv_heads, head_dim] → [T, heads, head_dim]
        (contiguous)."""

    def release(self, slot: Hashable) -> None:
        """Forget whatever was kept for a graph slot that was evicted (default: nothing)."""
        del slot

    def describe(self) -> str:
        return self.name
