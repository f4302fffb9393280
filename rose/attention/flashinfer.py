"""Ragged prefill through FlashInfer (GPU only), causal or not, grouped-query heads allowed,
and what every FlashInfer wrapper of ROSE shares: the head dims it is used for, the rule
for planning a wrapper again, and the check that a GPU test really ran FlashInfer.

FlashInfer is optional: `import_flashinfer()` returns None when it is not installed or fails
to import (no CUDA, wrong build), and the engine falls back to SDPA. It is used only for
head dims in `FLASHINFER_HEAD_DIMS` (`head_dim_unsupported` says why not, before anything
is compiled): FA2's prefill kernels reject fewer than 4 MMA tiles of 16 on the value dim
(``NUM_MMA_D_VO < 4`` in ``KernelTraits::IsInvalid``, so head_dim < 64) and FA3 (Hopper)
instantiates 64, 128 and 256 only (``is_fa3_prefill_head_dim_supported``).

Re-planning (`PlanRing`): ``plan()`` writes the schedule into the wrapper's page-locked
buffer and queues an asynchronous copy of it to the device. Planning the same wrapper again
before the GPU reached that copy would overwrite what it is about to read, and the earlier
pass would run with the later pass's schedule: Tulip enqueues the next batch while the
previous one is still queued on the GPU. So every plan records an event after itself, and
a wrapper is planned again only after its previous plan's event completed; eager passes
take turns between two wrappers, so that wait is nearly always already over.

One `BatchPrefillWithRaggedKVCacheWrapper` pair serves eager passes; each CUDA graph slot
gets its own wrapper created in CUDA-graph mode, whose index buffers stay fixed so `plan()`
before a replay updates what the captured kernels read (a ring of one: a slot replayed back
to back waits for the GPU to reach the previous replay's plan copy).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from rose.attention.base import AttentionBackend

__all__ = [
    "FLASHINFER_HEAD_DIMS",
    "FlashInferBackend",
    "PlanRing",
    "flashinfer_coverage",
    "head_dim_unsupported",
    "import_flashinfer",
]

_WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_HEAD_DIMS = frozenset({64, 128, 256})
EAGER_WRAPPERS = 2  # eager passes alternate between this many wrappers (see `PlanRing`)


def import_flashinfer() -> tuple[ModuleType | None, str]:
    """(module, "") when FlashInfer imports, else (None, why not)."""
    try:
        return importlib.import_module("flashinfer"), ""
    except Exception as exc:  # ImportError, or a broken build raising anything at import
        return None, f"{type(exc).__name__}: {exc}"


def head_dim_unsupported(head_dim: int) -> str:
    """ "" when FlashInfer's prefill kernels take ``head_dim`` on every GPU (FA2 and FA3),
    else the reason, for the log line of the SDPA fallback."""
    if head_dim in FLASHINFER_HEAD_DIMS:
        return ""
    dims = "/".join(str(d) for d in sorted(FLASHINFER_HEAD_DIMS))
    return f"FlashInfer takes head_dim {dims}, the model has {head_dim}"


def flashinfer_coverage(
    backend_name: str, imported: tuple[ModuleType | None, str] | None = None
) -> str | None:
    """For a check that claims to test FlashInfer, given the name of the backend it ran
    (``engine.attention.name``, ``paged_kernel.name``): None when that is FlashInfer; the
    skip reason when FlashInfer does not import here (the check must report itself
    skipped, never passed); AssertionError when FlashInfer imports yet the backend is
    another, a silent fallback (the ``rose.attention`` log line says why).

    imported: `import_flashinfer()`'s answer (taken here when None)."""
    if backend_name == "flashinfer":
        return None
    module, why = import_flashinfer() if imported is None else imported
    if module is None:
        return f"FlashInfer unavailable ({why})"
    raise AssertionError(
        f"FlashInfer imports but the backend under test is {backend_name!r}: it fell back "
        "(see the rose.attention log for why), so this check would compare SDPA with SDPA"
    )


class PlanRing:
    """``depth`` FlashInfer wrappers planned in turn; a wrapper is planned again only after
    the device copy its previous plan queued has run (see the module doc).

    make_wrapper: builds one wrapper (called ``depth`` times, now). new_event: a CUDA event
    factory (``torch.cuda.Event``; tests pass a recorder), one event per wrapper, recorded
    on the current stream right after each plan."""

    def __init__(
        self, make_wrapper: Callable[[], Any], depth: int, new_event: Callable[[], Any]
    ) -> None:
        if depth < 1:
            raise ValueError(f"PlanRing depth must be >= 1, got {depth}")
        self.wrappers = [make_wrapper() for _ in range(depth)]
        self._events = [new_event() for _ in range(depth)]
        self._recorded = [False] * depth  # events[i] marks wrappers[i]'s last plan
        self._next = 0

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """Plan the next wrapper in turn with these arguments and return it."""
        i = self._next
        self._next = (i + 1) % len(self.wrappers)
        if self._recorded[i]:
            self._events[i].synchronize()  # its previous plan's copy has run
        wrapper = self.wrappers[i]
        wrapper.plan(*args, **kwargs)
        self._events[i].record()
        self._recorded[i] = True
        return wrapper

    def drain(self) -> None:
        """Wait for every queued plan copy: before the wrappers (and the page-locked buffers
        those copies read) are dropped, for the host allocator does not know of them."""
        for i, recorded in enumerate(self._recorded):
            if recorded:
                self._events[i].synchronize()


class FlashInferBackend(AttentionBackend):
    """FlashInfer ragged prefill; q [T, heads, head_dim], k, v [T, kv_heads, head_dim] in
    fp16/bf16 on CUDA (kv_heads defaults to heads).

    new_event: the event factory of its `PlanRing`s (``torch.cuda.Event``; a recorder in
    CPU tests, with a fake ``flashinfer`` module)."""

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
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        self._fi = flashinfer
        self.causal = causal
        self._num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self._device = device
        self._dtype = dtype
        self._num_heads = num_heads
        self._head_dim = head_dim
        self._new_event = torch.cuda.Event if new_event is None else new_event
        # one float workspace for every wrapper: their passes run one at a time on one stream
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = PlanRing(
            lambda: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD"),
            EAGER_WRAPPERS,
            self._new_event,
        )
        self._slots: dict[Hashable, PlanRing] = {}

    def _ring(self, slot: Hashable | None, rows: int) -> PlanRing:
        if slot is None:
            return self._eager
        ring = self._slots.get(slot)
        if ring is None:

            def make() -> Any:
                indptr = torch.empty(rows + 1, dtype=torch.int32, device=self._device)
                return self._fi.BatchPrefillWithRaggedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_cuda_graph=True,
                    qo_indptr_buf=indptr,
                    kv_indptr_buf=indptr.clone(),
                )

            # a captured graph reads one wrapper's buffers: a ring of one
            ring = self._slots[slot] = PlanRing(make, 1, self._new_event)
        return ring

    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> Any:
        indptr = torch.from_numpy(np.ascontiguousarray(host_cu_seqlens, dtype=np.int32))
        return self._ring(slot, indptr.numel() - 1).plan(
            indptr,
            indptr,
            self._num_heads,
            self._num_kv_heads,
            self._head_dim,
            causal=self.causal,
            q_data_type=self._dtype,
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        return state.run(q.contiguous(), k.contiguous(), v.contiguous())  # [T, heads, head_dim]

    def release(self, slot: Hashable) -> None:
        ring = self._slots.pop(slot, None)
        if ring is not None:
            ring.drain()
