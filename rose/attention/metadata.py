"""Attention metadata for one ragged forward pass over paged caches.

Built from block tables (`rose.kv`) on the host; read by the attention layers and the paged
kernels (`rose.attention.paged`), which live beside it: `rose.kv` holds pages and tables
only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from rose.kv.block_table import BlockTable

if TYPE_CHECKING:
    from rose.attention.paged import PagedPlan

__all__ = ["AttentionMetadata", "PageLists", "to_device"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the work queued there.

    A blocking copy to a GPU synchronizes its stream first (PyTorch's ``copy_`` waits for
    the copy, and the stream runs everything queued before it). A non-blocking copy from
    pageable memory does not promise better: to stage it into pinned memory "the driver may
    synchronize with the stream" (CUDA's notes on asynchronous copies); only a copy from
    page-locked memory is asynchronous for sure. So the tensor is copied
    into page-locked memory first, from PyTorch's caching host allocator, which keeps that
    block until the copy has run; the host tensor may be dropped right away."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PageLists:
    """One pass's pages in FlashInfer's CSR form, as host tensors (int32), recorded with the
    metadata so that a paged kernel is planned without reading anything back from the device.

    qo_indptr ``[B + 1]``: sequence ``b``'s new tokens are rows ``qo_indptr[b]:qo_indptr[b + 1]``.
    kv_indptr ``[B + 1]``: its pages are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    kv_indices ``[P]``: page ids, in token order per sequence.
    kv_last_page_len ``[B]``: tokens in each sequence's last page (1 .. page_size).

    The lists are copied when the pass is built (tables change afterwards); the tensors are
    made on first use, since only paged kernels read them and SDPA passes (every pass on
    the CPU, a draft head's one-token steps among them) would pay four tensors each for
    nothing.
    """

    def __init__(
        self,
        page_size: int,
        qo_indptr: Sequence[int],
        kv_indptr: Sequence[int],
        kv_indices: Sequence[int],
        kv_last_page_len: Sequence[int],
    ) -> None:
        self.page_size = page_size
        self._lists = (list(qo_indptr), list(kv_indptr), list(kv_indices), list(kv_last_page_len))

    @staticmethod
    def of(entries: Sequence[tuple[BlockTable, int, int]]) -> PageLists:
        """entries: ``(table, num_cached, num_new)`` per sequence, as for `AttentionMetadata`."""
        page_size = entries[0][0].page_size
        qo, kv, pages, last = [0], [0], [], []
        for table, cached, new in entries:
            if table.page_size != page_size:
                raise ValueError("every sequence of one pass must use the same page size")
            total = cached + new
            n = -(-total // page_size)
            pages += table.pages[:n]
            qo.append(qo[-1] + new)
            kv.append(kv[-1] + n)
            last.append(total - (n - 1) * page_size)
        return PageLists(page_size, qo, kv, pages, last)

    @cached_property
    def qo_indptr(self) -> torch.Tensor:
        return torch.tensor(self._lists[0], dtype=torch.int32)

    @cached_property
    def kv_indptr(self) -> torch.Tensor:
        return torch.tensor(self._lists[1], dtype=torch.int32)

    @cached_property
    def kv_indices(self) -> torch.Tensor:
        return torch.tensor(self._lists[2], dtype=torch.int32)

    @cached_property
    def kv_last_page_len(self) -> torch.Tensor:
        return torch.tensor(self._lists[3], dtype=torch.int32)

    def new_token_offsets(self) -> list[int]:
        """``qo_indptr`` as a host list: where each sequence's new tokens start in ``[T]``
        (the same numbers as the metadata's device-side ``cu_seqlens``, without reading them)."""
        return list(self._lists[0])

    def lengths(self) -> list[tuple[int, int]]:
        """``(new tokens, keys)`` of every sequence."""
        qo, kv, _, last = self._lists
        return [
            (qo[b + 1] - qo[b], (kv[b + 1] - kv[b] - 1) * self.page_size + last[b])
            for b in range(len(last))
        ]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything the attention layers need for one step, built once and shared by layers.

    The batch is ragged: sequence ``b`` contributes ``q_lens[b]`` new tokens (concatenated
    into ``[T]``) on top of ``cached[b]`` tokens already in its cache. Attention runs on a
    padded view: queries ``[B, Lq]``, keys ``[B, Lk]``.

    positions: ``[T]`` absolute position of each new token.
    slot_mapping: ``[T]`` flat cache slot each new token's K/V is written to.
    q_index: ``[B, Lq]`` index into ``[T]`` per padded query (padding points at token 0).
    out_index: ``[T]`` index into the flattened ``[B * Lq]`` padded output per new token.
        With one sequence (B == 1) the padded view is the ragged one: q_index is
        ``[[0 .. T-1]]`` and out_index ``[0 .. T-1]``, which attention layers rely on to skip
        those two gathers.
    kv_slots: ``[B, Lk]`` cache slot per padded key (padding points at slot 0, masked).
    mask: ``[B, 1, Lq, Lk]`` bool, True where query may attend key; None when every query
        sees every key (single-token decode of equal lengths).
    last_index: ``[B]`` index into ``[T]`` of each sequence's last new token.
    cu_seqlens: ``[B + 1]`` offsets of each sequence's new tokens in ``[T]``.
    pages: the same batch as page lists on the host (`PageLists`), for paged kernels.
    causal: True when ``mask`` is the plain causal mask (query i of a sequence with q new
        tokens and k keys sees keys up to ``k - q + i``); False when something else was put
        there (draft trees, `rose.spec.tree.tree_metadata`).
    kernel: a paged-attention kernel planned for this pass (`rose.attention.paged`), which
        the attention layers then call on the cache's pages; None: SDPA over K/V gathered
        through ``kv_slots``.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    q_index: torch.Tensor
    out_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    last_index: torch.Tensor
    cu_seqlens: torch.Tensor
    pages: PageLists
    causal: bool = True
    kernel: PagedPlan | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(
        entries: Sequence[tuple[BlockTable, int, int]], device: torch.device | str = "cpu"
    ) -> AttentionMetadata:
        """entries: ``(table, num_cached, num_new)`` per sequence; each table must already
        have room (`BlockTable.reserve`) for ``num_cached + num_new`` tokens."""
        if not entries:
            raise ValueError("attention metadata needs at least one sequence")
        q_lens = [n for _, _, n in entries]
        if min(q_lens) < 1:
            raise ValueError("every sequence needs at least one new token")
        if len(entries) == 1:
            return AttentionMetadata._one_sequence(*entries[0], device=device)
        return AttentionMetadata._padded(entries, q_lens, device)

    @staticmethod
    def _padded(
        entries: Sequence[tuple[BlockTable, int, int]],
        q_lens: list[int],
        device: torch.device | str,
    ) -> AttentionMetadata:
        """The general case: ragged sequences on a padded ``[B, Lq]`` x ``[B, Lk]`` view."""
        cached = [c for _, c, _ in entries]
        kv_lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
        b, lq, lk = len(entries), max(q_lens), max(kv_lens)

        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, q_lens, strict=True)])
        slot_mapping = torch.cat([t.slots(c, c + n) for t, c, n in entries])
        kv_slots = torch.zeros(b, lk, dtype=torch.int64)
        for i, (t, _, _) in enumerate(entries):
            kv_slots[i, : kv_lens[i]] = t.slots(0, kv_lens[i])

        q_len_t = torch.tensor(q_lens)
        cu = torch.zeros(b + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(q_len_t, 0)
        ar_q = torch.arange(lq)
        valid_q = ar_q[None, :] < q_len_t[:, None]  # [B, Lq]
        q_index = torch.where(valid_q, cu[:-1, None] + ar_q[None, :], 0)  # [B, Lq]
        out_index = (torch.arange(b)[:, None] * lq + ar_q[None, :])[valid_q]  # [T]

        if lq == 1 and min(kv_lens) == lk:
            mask = None
        else:
            # Query i of sequence b sits at absolute position cached[b] + i and sees keys
            # j <= that position. Padded queries also see key 0, so no row is empty (no NaN).
            qpos = torch.tensor(cached)[:, None] + ar_q[None, :]  # [B, Lq]
            mask = torch.arange(lk)[None, None, :] <= qpos[:, :, None]  # [B, Lq, Lk]
            mask = mask[:, None]  # [B, 1, Lq, Lk]

        return AttentionMetadata(
            positions=to_device(positions, device),
            slot_mapping=to_device(slot_mapping, device),
            q_index=to_device(q_index, device),
            out_index=to_device(out_index, device),
            kv_slots=to_device(kv_slots, device),
            mask=None if mask is None else to_device(mask, device),
            last_index=to_device(cu[1:] - 1, device),
            cu_seqlens=to_device(cu, device),
            pages=PageLists.of(entries),
        )

    @staticmethod
    def _one_sequence(
        table: BlockTable, cached: int, new: int, device: torch.device | str
    ) -> AttentionMetadata:
        """`build` for a batch of one (decode at batch 1 and every draft-head step): the same
        tensors from a handful of ops, since no padding is needed (~4x fewer ops)."""
        total = cached + new
        slots = table.slots(0, total)  # [Lk]
        positions = torch.arange(cached, total)  # [T]
        ar = torch.arange(new)
        if new == 1:
            mask = None
        else:  # query i (position cached + i) sees keys 0 .. cached + i
            mask = (torch.arange(total)[None, :] <= positions[:, None])[None, None]
        return AttentionMetadata(
            positions=to_device(positions, device),
            slot_mapping=to_device(slots[cached:], device),
            q_index=to_device(ar[None], device),
            out_index=to_device(ar, device),
            kv_slots=to_device(slots[None], device),
            mask=None if mask is None else to_device(mask, device),
            last_index=to_device(torch.tensor([new - 1]), device),
            cu_seqlens=to_device(torch.tensor([0, new]), device),
            pages=PageLists.of([(table, cached, new)]),
        )
