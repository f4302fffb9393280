"""Causal attention of a decoder pass over its paged K/V cache, read in place.

The decoder's default path (`rose.models.llama.Attention`) gathers every sequence's keys
and values through ``AttentionMetadata.kv_slots`` into a padded ``[B, Lk]`` view and runs
SDPA on it: right on any device, and what the CPU uses. A paged kernel instead reads the
cache's pages where they lie, given each sequence's page list in CSR form (`PagedLayout`);
on CUDA that is FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, which covers prefill,
decode, verification of draft chains (causal) and of draft trees (a custom mask) alike.

A kernel is planned once per pass (`PagedKernel.plan`, host-side index work) and run once
per layer (`PagedPlan.run`). `ReferencePagedAttention` implements the same contract in
plain PyTorch: it is the definition the FlashInfer path must match, and it lets the CPU
test the layout and the decoder's kernel plumbing end to end.

Cache pages: ``[num_pages, page_size, kv_heads, head_dim]`` per layer (`PagedKVCache.pages`,
FlashInfer's "NHD" layout). Sequence ``b``'s token ``i`` lives in page
``kv_indices[kv_indptr[b] + i // page_size]`` at offset ``i % page_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rose.attention.flashinfer import import_flashinfer
from rose.kv.metadata import AttentionMetadata

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
    """One pass's batch over a paged cache, in FlashInfer's CSR form (int32 tensors).

    qo_indptr ``[B + 1]``: sequence ``b``'s new tokens are rows
        ``qo_indptr[b]:qo_indptr[b + 1]`` of ``q``.
    kv_indptr ``[B + 1]``: its pages are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    kv_indices ``[P]``: page ids, in token order per sequence.
    kv_last_page_len ``[B]``: tokens in each sequence's last page (1 .. page_size).
    custom_mask: None for the causal mask, aligned bottom-right (new token ``i`` of a
        sequence with ``q`` new tokens and ``k`` keys sees keys ``0 .. k - q + i``); else
        the flattened bool masks ``[q_b, k_b]`` of every sequence, concatenated.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    custom_mask: torch.Tensor | None

    @staticmethod
    def from_metadata(meta: AttentionMetadata, page_size: int) -> PagedLayout:
        """The layout of ``meta``'s batch. A sequence's pages are read off its key slots:
        the key at index ``p * page_size`` lies at offset 0 of the ``p``-th page."""
        kv_lens = meta.kv_lens.tolist()
        q_lens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).tolist()
        pages, masks = [], []
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            pages.append(meta.kv_slots[b, 0:kv_len:page_size] // page_size)
            if not meta.causal:
                assert meta.mask is not None, "a non-causal pass carries its mask"
                masks.append(meta.mask[b, 0, :q_len, :kv_len].reshape(-1))
        counts = torch.tensor([p.numel() for p in pages])
        kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(counts, 0)
        last = torch.tensor([n - (-(-n // page_size) - 1) * page_size for n in kv_lens])
        device = meta.kv_slots.device
        return PagedLayout(
            qo_indptr=meta.cu_seqlens.to(device=device, dtype=torch.int32),
            kv_indptr=kv_indptr.to(device),
            kv_indices=torch.cat(pages).to(torch.int32),
            kv_last_page_len=last.to(device=device, dtype=torch.int32),
            custom_mask=torch.cat(masks) if masks else None,
        )


class PagedPlan(Protocol):
    """A kernel planned for one pass."""

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq, D]``, pages ``[num_pages, page_size, Hkv, D]`` → ``[T, Hq, D]``."""
        ...


class PagedKernel(Protocol):
    """Plans a paged-attention kernel for each pass of a decoder."""

    def plan(self, meta: AttentionMetadata, page_size: int) -> PagedPlan: ...


@dataclass(frozen=True)
class _ReferencePlan:
    layout: PagedLayout
    page_size: int

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        qo, kvp = lay.qo_indptr.tolist(), lay.kv_indptr.tolist()
        last = lay.kv_last_page_len.tolist()
        out = torch.empty_like(q)
        mask_at = 0
        for b in range(len(qo) - 1):
            pages = lay.kv_indices[kvp[b] : kvp[b + 1]].long()
            kv_len = (len(pages) - 1) * self.page_size + last[b]
            k = k_pages[pages].flatten(0, 1)[:kv_len]  # [Lk, Hkv, D]
            v = v_pages[pages].flatten(0, 1)[:kv_len]
            qb = q[qo[b] : qo[b + 1]]  # [Lq, Hq, D]
            q_len = qb.shape[0]
            if lay.custom_mask is None:
                i = torch.arange(q_len, device=q.device)[:, None]
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + i
            else:
                mask = lay.custom_mask[mask_at : mask_at + q_len * kv_len].view(q_len, kv_len)
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

    def plan(self, meta: AttentionMetadata, page_size: int) -> PagedPlan:
        return _ReferencePlan(PagedLayout.from_metadata(meta, page_size), page_size)


@dataclass(frozen=True)
class _FlashInferPlan:
    wrapper: Any

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (k_pages, v_pages))


class FlashInferPagedAttention:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` over the decoder's pages (CUDA,
    fp16/bf16): causal passes of any shape, and custom-masked ones for draft trees."""

    def __init__(
        self,
        flashinfer: Any,
        device: torch.device,
        dtype: torch.dtype,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self._dtype = dtype
        self._heads = (num_qo_heads, num_kv_heads, head_dim)
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, meta: AttentionMetadata, page_size: int) -> PagedPlan:
        lay = PagedLayout.from_metadata(meta, page_size)
        self._wrapper.plan(
            lay.qo_indptr,
            lay.kv_indptr,
            lay.kv_indices,
            lay.kv_last_page_len,
            *self._heads,
            page_size,
            causal=lay.custom_mask is None,
            custom_mask=lay.custom_mask,
            q_data_type=self._dtype,
            kv_data_type=self._dtype,
        )
        return _FlashInferPlan(self._wrapper)


def paged_kernel_for(
    device: torch.device, dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[PagedKernel | None, str]:
    """FlashInfer's paged kernel where it applies (CUDA, fp16/bf16, the package imports),
    else ``(None, why)``; the reason is empty on the CPU, where SDPA is simply the path."""
    if device.type != "cuda":
        return None, ""
    if dtype not in (torch.float16, torch.bfloat16):
        return None, f"FlashInfer's kernels take fp16/bf16, the model is {dtype}"
    flashinfer, why = import_flashinfer()
    if flashinfer is None:
        return None, f"flashinfer does not import: {why}"
    kernel = FlashInferPagedAttention(
        flashinfer, device, dtype, num_qo_heads, num_kv_heads, head_dim
    )
    return kernel, ""
