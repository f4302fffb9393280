"""Ragged prefill through FlashInfer (GPU only), causal or not, grouped-query heads allowed.

FlashInfer is optional: `import_flashinfer()` returns None when it is not installed or fails
to import (no CUDA, wrong build), and the engine falls back to SDPA. One
`BatchPrefillWithRaggedKVCacheWrapper` serves eager passes; each CUDA graph slot gets its own
wrapper created in CUDA-graph mode, whose index buffers stay fixed so `plan()` before a replay
updates what the captured kernels read.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from rose.attention.base import AttentionBackend

__all__ = ["FlashInferBackend", "import_flashinfer"]

_WORKSPACE_BYTES = 128 * 1024 * 1024


def import_flashinfer() -> tuple[ModuleType | None, str]:
    """(module, "") when FlashInfer imports, else (None, why not)."""
    try:
        return importlib.import_module("flashinfer"), ""
    except Exception as exc:  # ImportError, or a broken build raising anything at import
        return None, f"{type(exc).__name__}: {exc}"


class FlashInferBackend(AttentionBackend):
    """FlashInfer ragged prefill; q [T, heads, head_dim], k, v [T, kv_heads, head_dim] in
    fp16/bf16 on CUDA (kv_heads defaults to heads)."""

    name = "flashinfer"
    graph_safe = True

    def __init__(
        self,
        flashinfer: ModuleType,
        device: torch.device,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        causal: bool = False,
    ) -> None:
        self._fi = flashinfer
        self.causal = causal
        self._num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self._device = device
        self._dtype = dtype
        self._num_heads = num_heads
        self._head_dim = head_dim
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
        self._slots: dict[Hashable, Any] = {}

    def _wrapper(self, slot: Hashable | None, rows: int) -> Any:
        if slot is None:
            return self._eager
        wrapper = self._slots.get(slot)
        if wrapper is None:
            indptr = torch.empty(rows + 1, dtype=torch.int32, device=self._device)
            wrapper = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=indptr,
                kv_indptr_buf=indptr.clone(),
            )
            self._slots[slot] = wrapper
        return wrapper

    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> Any:
        indptr = torch.from_numpy(np.ascontiguousarray(host_cu_seqlens, dtype=np.int32))
        wrapper = self._wrapper(slot, indptr.numel() - 1)
        wrapper.plan(
            indptr,
            indptr,
            self._num_heads,
            self._num_kv_heads,
            self._head_dim,
            causal=self.causal,
            q_data_type=self._dtype,
        )
        return wrapper

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        return state.run(q.contiguous(), k.contiguous(), v.contiguous())  # [T, heads, head_dim]

    def release(self, slot: Hashable) -> None:
        self._slots.pop(slot, None)
