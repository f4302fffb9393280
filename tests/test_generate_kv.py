"""Paged KV cache bookkeeping: allocator, block tables, attention metadata."""

from __future__ import annotations

import pytest
import torch

from rose.attention.metadata import AttentionMetadata
from rose.kv import BlockTable, KVCacheConfig, OutOfPages, PageAllocator


def test_allocator_hands_out_each_page_once_and_refuses_past_capacity() -> None:
    a = PageAllocator(5)
    got = a.allocate(3) + a.allocate(2)
    assert sorted(got) == [0, 1, 2, 3, 4]
    with pytest.raises(OutOfPages, match="requested 1, free 0, total 5"):
        a.allocate(1)
    a.free(got[:2])
    assert a.num_free == 2 and a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([got[0]])
    with pytest.raises(OutOfPages):
        a.allocate(3)
    assert a.num_free == 2  # a refused allocation takes nothing


def test_block_table_slots_reserve_truncate_release() -> None:
    a = PageAllocator(8)
    other = BlockTable(a, 4)
    other.reserve(4)  # interleave so the table's pages are not contiguous
    t = BlockTable(a, 4)
    t.reserve(6)
    assert len(t.pages) == 2
    slots = t.slots(0, 6).tolist()
    assert slots == [t.pages[0] * 4 + i for i in range(4)] + [t.pages[1] * 4 + i for i in range(2)]
    t.length = 6
    t.truncate(3)
    assert len(t.pages) == 1 and a.num_free == 6
    with pytest.raises(ValueError, match="capacity"):
        t.slots(0, 5)
    t.release()
    assert a.num_free == 7 and t.length == 0


def test_block_table_slots_follow_every_page_change() -> None:
    """`slots` reads a cached tensor of every reserved slot: after each reserve, truncate and
    release it must still equal the page formula, and a slice handed out earlier keeps its
    values (the cache is replaced, never written in place)."""
    a = PageAllocator(16)
    t = BlockTable(a, 4)

    def formula(start: int, end: int) -> list[int]:
        return [t.pages[i // 4] * 4 + i % 4 for i in range(start, end)]

    t.reserve(5)
    first = t.slots(0, 5)
    before = first.tolist()
    assert before == formula(0, 5)
    BlockTable(a, 4).reserve(4)  # t's next page is not the one after its last
    t.reserve(13)
    assert t.slots(0, 13).tolist() == formula(0, 13) and t.slots(6, 11).tolist() == formula(6, 11)
    t.length = 13
    t.truncate(6)
    assert t.slots(0, 6).tolist() == formula(0, 6)
    t.reserve(10)
    assert t.slots(0, 10).tolist() == formula(0, 10)
    t.release()
    t.reserve(3)
    assert t.slots(0, 3).tolist() == formula(0, 3)
    assert first.tolist() == before


def test_metadata_masks_ragged_batch() -> None:
    a = PageAllocator(16)
    t1, t2 = BlockTable(a, 2), BlockTable(a, 2)
    t1.reserve(5)
    t2.reserve(2)
    meta = AttentionMetadata.build([(t1, 3, 2), (t2, 0, 2)])
    assert meta.positions.tolist() == [3, 4, 0, 1]
    assert meta.last_index.tolist() == [1, 3]
    assert meta.mask is not None and meta.mask.shape == (2, 1, 2, 5)
    assert meta.mask[0, 0].sum(-1).tolist() == [4, 5]  # sees cache + itself
    assert meta.mask[1, 0, :, 2:].sum() == 0  # second sequence never sees padding keys
    assert meta.q_index.tolist() == [[0, 1], [2, 3]]
    assert torch.equal(meta.slot_mapping[:2], t1.slots(3, 5))


@pytest.mark.parametrize(("cached", "new"), [(0, 1), (0, 5), (7, 1), (7, 4), (16, 3)])
def test_one_sequence_metadata_equals_the_padded_build(cached: int, new: int) -> None:
    a = PageAllocator(16)
    t = BlockTable(a, 4)
    a.allocate(1)  # so the table's pages are not simply 0, 1, 2, ...
    t.reserve(cached + new)
    fast = AttentionMetadata.build([(t, cached, new)])
    full = AttentionMetadata._padded([(t, cached, new)], [new], "cpu")
    for name in ("positions", "slot_mapping", "q_index", "out_index", "kv_slots"):
        assert torch.equal(getattr(fast, name), getattr(full, name)), name
    assert torch.equal(fast.last_index, full.last_index)
    assert torch.equal(fast.cu_seqlens, full.cu_seqlens)
    assert (fast.mask is None) == (full.mask is None)
    if fast.mask is not None:
        assert torch.equal(fast.mask, full.mask)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="kv.page_size"):
        KVCacheConfig(page_size=0)
    with pytest.raises(ValueError, match="kv.num_pages"):
        KVCacheConfig(num_pages=0)
