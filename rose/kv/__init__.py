"""Paged KV cache: a page allocator shared by every model of a deployment, per-sequence
block tables and per-model page storage. The attention metadata a pass builds from the
tables is `rose.attention.metadata`.

Main types:

- `PageAllocator`: a fixed pool of page ids; `allocate` raises `OutOfPages` (backpressure).
- `BlockTable`: the pages one sequence holds in one cache, and how many tokens are written.
- `PagedKVCache`: K/V storage ``[layers, pages * page_size, kv_heads, head_dim]``.
- `PrefixCache`: full pages of committed tokens found again by content (prefix caching).

Example::

    alloc = PageAllocator(num_pages=64)
    table = BlockTable(alloc, page_size=16)
    table.reserve(40)                      # 3 pages
    table.slots(0, 40)                     # flat cache slot of each token
"""

from __future__ import annotations

from rose.kv.allocator import KVCacheConfig, OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.cache import PagedKVCache
from rose.kv.prefix import PrefixCache

__all__ = [
    "BlockTable",
    "KVCacheConfig",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "PrefixCache",
]
