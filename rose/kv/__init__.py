"""Paged KV cache: a page allocator shared by every model of a deployment, per-sequence
block tables, per-model page storage, and the attention metadata one forward pass needs.

Main types:

- `PageAllocator`: a fixed pool of page ids; `allocate` raises `OutOfPages` (backpressure).
- `BlockTable`: the pages one sequence holds in one cache, and how many tokens are written.
- `PagedKVCache`: K/V storage ``[layers, pages * page_size, kv_heads, head_dim]``.
- `AttentionMetadata`: slot mapping + padded gather indices + mask for a ragged batch.

Example::

    alloc = PageAllocator(num_pages=64)
    table = BlockTable(alloc, page_size=16)
    table.reserve(40)                      # 3 pages
    meta = AttentionMetadata.build([(table, 0, 40)], page_size=16)
"""

from __future__ import annotations

from rose.kv.allocator import KVCacheConfig, OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.cache import PagedKVCache
from rose.kv.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "BlockTable",
    "KVCacheConfig",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
]
