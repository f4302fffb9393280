"""Per-sequence block table: which pages hold a sequence's tokens in one cache."""

from __future__ import annotations

import torch

from rose.kv.allocator import PageAllocator
from rose.kv.prefix import chain_key

__all__ = ["BlockTable"]


class BlockTable:
    """The pages of one sequence in one cache.

    pages: page ids in token order; token ``i`` lives in ``pages[i // page_size]`` at
        offset ``i % page_size``, i.e. flat slot ``pages[i // ps] * ps + i % ps``.
    length: tokens whose K/V are written (valid prefix); ``len(pages) * page_size >= length``.
    keys: prefix-cache keys of the first ``len(keys)`` pages (full pages of committed
        tokens, `rose.kv.prefix`); only a target table has them (`adopt`, `commit`).

    Only these methods change ``pages``; `slots` reads from a tensor of every reserved
    token's slot, rebuilt (never modified in place, so slices handed out stay valid) the
    first time it is asked for after the pages changed.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.pages: list[int] = []
        self.length = 0
        self.keys: list[bytes] = []
        self._slots: torch.Tensor | None = None  # [capacity] int64, None when stale

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """Extra pages required to hold ``num_tokens`` tokens in total."""
        want = -(-num_tokens // self.page_size)
        return max(0, want - len(self.pages))

    def reserve(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens in total (raises `OutOfPages`, taking nothing)."""
        need = self.pages_needed(num_tokens)
        if need:
            self.pages.extend(self.allocator.allocate(need))
            self._slots = None

    def adopt(self, pages: list[int], keys: list[bytes]) -> None:
        """Start an empty table on cached pages (`PrefixCache.lookup`): they hold its first
        ``len(pages) * page_size`` tokens, so its prefill starts after them."""
        if self.pages:
            raise ValueError("adopt needs an empty table")
        self.allocator.share(pages)
        self.pages = list(pages)
        self.keys = list(keys)
        self.length = len(pages) * self.page_size
        self._slots = None

    def commit(self, tokens: list[int]) -> None:
        """Register, in the allocator's prefix cache, every page filled with committed
        tokens (``tokens[: length]``) since the last call."""
        prefix = self.allocator.prefix
        if prefix is None:
            return
        ps = self.page_size
        # A request that stopped inside an accepted chain holds fewer tokens than its
        # table wrote; only its tokens count.
        for i in range(len(self.keys), min(self.length, len(tokens)) // ps):
            parent = self.keys[-1] if self.keys else b""
            key = chain_key(parent, tokens[i * ps : (i + 1) * ps])
            prefix.register(key, self.pages[i])
            self.keys.append(key)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; pages past them go back to the pool."""
        if num_tokens > self.length:
            raise ValueError(f"cannot truncate to {num_tokens} > length {self.length}")
        self.length = num_tokens
        del self.keys[num_tokens // self.page_size :]
        keep = -(-num_tokens // self.page_size)
        if keep < len(self.pages):
            self.allocator.free(self.pages[keep:])
            del self.pages[keep:]
            self._slots = None

    def release(self) -> None:
        """Free every page (sequence finished)."""
        self.allocator.free(self.pages)
        self.pages = []
        self.keys = []
        self.length = 0
        self._slots = None

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Flat cache slots of tokens ``[start, end)`` as int64 ``[end - start]``."""
        if end > self.capacity:
            raise ValueError(f"tokens up to {end} exceed reserved capacity {self.capacity}")
        if self._slots is None:
            pages = torch.tensor(self.pages, dtype=torch.int64)  # [P]
            offsets = torch.arange(self.page_size, dtype=torch.int64)  # [page_size]
            self._slots = (pages[:, None] * self.page_size + offsets).flatten()  # [capacity]
        return self._slots[start:end]
