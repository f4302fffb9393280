"""Causal attention of a decoder pass over its paged K/V cache, read in place.

The decoder's default path (`rose.models.llama.Attention`) gathers every sequence's keys
and values through ``AttentionMetadata.kv_slots`` into a padded ``[B, Lk]`` view and runs
SDPA on it: right on any device, and what the CPU uses. A paged kernel instead reads the
cache's pages where they lie, given each sequence's page list in CSR form (`PageLists`,
built on the host with the attention metadata, so planning reads nothing back from the GPU);
on CUDA that is FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, which covers prefill,
decode, verification of draft chains (causal) and of draft trees (a custom mask) alike,
through a wrapper per mask kind (`FlashInferPagedAttention` says why).

A kernel is planned once per pass (`PagedKernel.plan`, host-side index work) and run once
per layer (`PagedPlan.run`). `ReferencePagedAttention` implements the same contract in
plain PyTorch: it is the definition the FlashInfer path must match, and it lets the CPU
test the layout and the decoder's kernel plumbing end to end.

Cache pages: ``[num_pages, page_size, kv_heads, head_dim]`` per layer (`PagedKVCache.pages`,
FlashInfer's "NHD" layout). Sequence ``b``'s token ``i`` lives in page
``kv_indices[kv_indptr[b] + i // page_size]`` at offset ``i % page_size``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rose.attention.flashinfer import (
    EAGER_WRAPPERS,
    PlanRing,
    head_dim_unsupported,
    import_flashinfer,
)
from rose.attention.metadata import AttentionMetadata, PageLists

__all__ = [
    "FlashInferPagedAttention",
    "PagedKernel",
    "PagedLayout",
    "PagedPlan",
    "ReferencePagedAttention",
    "paged_kernel_for",
]

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class PagedLayout:
    """One pass's batch over a paged cache: its page lists (host tensors, `PageLists`; a
    kernel moves what it needs to its device) and, for passes that are not plainly causal
    (draft trees), ``custom_mask``: the flattened bool masks ``[q_b, k_b]`` of every
    sequence, concatenated (on the metadata's device). With no custom mask the mask is
    causal, aligned bottom-right: new token ``i`` of a sequence with ``q`` new tokens and
    ``k`` keys sees keys ``0 .. k - q + i``."""

    pages: PageLists
    custom_mask: torch.Tensor | None

    @staticmethod
    def from_metadata(meta: AttentionMetadata) -> PagedLayout:
        masks = []
        if not meta.causal:
            assert meta.mask is not None, "a non-causal pass carries its mask"
            for b, (q_len, kv_len) in enumerate(meta.pages.lengths()):
                masks.append(meta.mask[b, 0, :q_len, :kv_len].reshape(-1))
        return PagedLayout(meta.pages, torch.cat(masks) if masks else None)


class PagedPlan(Protocol):
    """A kernel planned for one pass."""

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq, D]``, pages ``[num_pages, page_size, Hkv, D]`` → ``[T, Hq, D]``."""
        ...


class PagedKernel(Protocol):
    """Plans a paged-attention kernel for each pass of a decoder; ``name`` says which
    (``"flashinfer"``, ``"reference"``), for checks that claim one (`flashinfer_coverage`)."""

    name: str

    def plan(self, meta: AttentionMetadata) -> PagedPlan: ...


@dataclass(frozen=True)
class _ReferencePlan:
    layout: PagedLayout

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        pages = self.layout.pages
        qo, kvp = pages.qo_indptr.tolist(), pages.kv_indptr.tolist()
        out = torch.empty_like(q)
        mask_at = 0
        for b, (q_len, kv_len) in enumerate(pages.lengths()):
            ids = pages.kv_indices[kvp[b] : kvp[b + 1]].long().to(q.device)
            k = k_pages[ids].flatten(0, 1)[:kv_len]  # [Lk, Hkv, D]
            v = v_pages[ids].flatten(0, 1)[:kv_len]
            qb = q[qo[b] : qo[b + 1]]  # [Lq, Hq, D]
            if self.layout.custom_mask is None:
                i = torch.arange(q_len, device=q.device)[:, None]
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + i
            else:
                flat = self.layout.custom_mask[mask_at : mask_at + q_len * kv_len]
                mask = flat.view(q_len, kv_len).to(q.device)
                mask_at += q_len * kv_len
            rep = qb.shape[1] // k.shape[1]  # query heads per K/V head
            scores = torch.einsum(
                "qhd,khd->hqk", qb.float(), k.repeat_interleave(rep, 1).float()
            ) / math.sqrt(q.shape[-1])
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, 1).float())
            out[qo[b] : qo[b + 1]] = o.to(q.dtype)
        return out


class ReferencePagedAttention:
    """The paged-attention contract in plain PyTorch (any device, one sequence at a time):
    the definition `FlashInferPagedAttention` must match, and how the CPU tests the layout
    and the decoder's kernel path. Slow; not for serving."""

    name = "reference"

    def plan(self, meta: AttentionMetadata) -> PagedPlan:
        return _ReferencePlan(PagedLayout.from_metadata(meta))


@dataclass(frozen=True)
class _FlashInferPlan:
    wrapper: Any

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (k_pages, v_pages))


def _packbits_takes_host_indptr(wrapper_cls: Any) -> bool:
    """Whether this FlashInfer's paged ``plan()`` moves the mask's indptr to the mask's
    device before ``segment_packbits`` (whose kernel checks that both share a device; older
    releases pass the indptr where ``qo_indptr`` lies). Read off its source; when in doubt,
    False: the safe path."""
    try:
        source = inspect.getsource(wrapper_cls.plan)
    except (OSError, TypeError):
        return False
    return "mask_indptr.to(custom_mask.device)" in source


class FlashInferPagedAttention:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` over the decoder's pages (CUDA,
    fp16/bf16): causal passes of any shape, and custom-masked ones for draft trees.

    One set of wrappers per mask kind. A wrapper created with ``backend="auto"`` picks its
    kernel family at its first plan and keeps it: on Hopper a causal first pass fixes it to
    FA3, which has no custom masks ("operation not supported" at the first draft tree). So
    causal passes go to "auto" wrappers (FA3 where it applies) and masked passes to
    ``backend="fa2"`` ones. Each kind is a `PlanRing` of two wrappers, planned in turn, so
    re-planning never overwrites a plan whose copy to the device may not have run.

    wrapper_cls: FlashInfer's wrapper class, or a fake recording what it is given (CPU
    tests); new_event: the rings' event factory (``torch.cuda.Event``)."""

    name = "flashinfer"

    def __init__(
        self,
        flashinfer: Any,
        device: torch.device,
        dtype: torch.dtype,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        self._dtype = dtype
        self._heads = (num_qo_heads, num_kv_heads, head_dim)
        new_event = torch.cuda.Event if new_event is None else new_event
        wrapper_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
        # one float workspace for all: their passes run one at a time on one stream
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.rings = {
            kind: PlanRing(
                lambda backend=backend: wrapper_cls(workspace, "NHD", backend=backend),
                EAGER_WRAPPERS,
                new_event,
            )
            for kind, backend in (("causal", "auto"), ("masked", "fa2"))
        }
        self._host_indptr_ok = _packbits_takes_host_indptr(wrapper_cls)

    def plan(self, meta: AttentionMetadata) -> PagedPlan:
        lay = PagedLayout.from_metadata(meta)
        pages = lay.pages  # host tensors: plan() reads them there and copies the indices over
        indptrs = (pages.qo_indptr, pages.kv_indptr, pages.kv_last_page_len)
        if lay.custom_mask is not None and not self._host_indptr_ok:
            # this FlashInfer packs the mask with an indptr made from qo_indptr, on its
            # device: hand the lists over where the mask is (plan() reads them back, one
            # wait per tree pass, which later releases avoid)
            indptrs = tuple(t.to(lay.custom_mask.device) for t in indptrs)
        qo, kv, last = indptrs
        ring = self.rings["causal" if lay.custom_mask is None else "masked"]
        wrapper = ring.plan(
            qo,
            kv,
            pages.kv_indices,
            last,
            *self._heads,
            pages.page_size,
            causal=lay.custom_mask is None,
            custom_mask=lay.custom_mask,
            q_data_type=self._dtype,
            kv_data_type=self._dtype,
        )
        return _FlashInferPlan(wrapper)


def paged_kernel_for(
    device: torch.device, dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[PagedKernel | None, str]:
    """FlashInfer's paged kernel where it applies (CUDA, fp16/bf16, a head dim its kernels
    take, the package imports), else ``(None, why)``; the reason is empty on the CPU, where
    SDPA is simply the path. The head dim is checked before FlashInfer is imported."""
    if device.type != "cuda":
        return None, ""
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"FlashInfer's kernels take fp16/bf16, the model is {dtype}"
    if why := head_dim_unsupported(head_dim):
        return None, why
    flashinfer, why = import_flashinfer()
    if flashinfer is None:
        return None, f"flashinfer does not import: {why}"
    kernel = FlashInferPagedAttention(
        flashinfer, device, dtype, num_qo_heads, num_kv_heads, head_dim
    )
    return kernel, ""
