"""A fixed pool of KV pages handed out by id; one allocator serves target and drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rose.kv.prefix import PrefixCache

__all__ = ["KVCacheConfig", "OutOfPages", "PageAllocator"]


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free.

    Callers treat it as backpressure: keep the request waiting (or answer
    RESOURCE_EXHAUSTED), never crash.
    """

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(
            f"kv cache: out of pages (requested {requested}, free {free}, total {total})"
        )
        self.requested = requested
        self.free = free
        self.total = total


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of the paged KV cache.

    num_pages: pages in the shared pool (every model's storage holds this many).
    page_size: tokens per page.
    """

    num_pages: int = 512
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"kv.num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"kv.page_size must be >= 1, got {self.page_size}")


class PageAllocator:
    """Hands out page ids from ``range(num_pages)``.

    Invariant: every id is in exactly one state: free, held by one or more block tables
    (its reference count: tables share pages only through the prefix cache,
    `rose.kv.prefix`), or idle in the prefix cache (held by none, kept for its contents).
    Free pages are reused LIFO (recently touched memory first); idle ones count as free and
    are evicted, least recently released first, only when no free page is left.
    """

    def __init__(self, num_pages: int, prefix: PrefixCache | None = None) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.prefix = prefix
        # Stack of free ids; pop() from the end, lowest ids handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}  # held page -> tables holding it

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and idle cached ones."""
        return len(self._free) + (self.prefix.num_idle if self.prefix is not None else 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises `OutOfPages` (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(n, self.num_free, self.num_pages)
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            assert self.prefix is not None
            pages.append(self.prefix.evict())
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Hold ``pages`` once more: pages held by another table, or idle cached ones."""
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            elif self.prefix is not None and self.prefix.is_idle(p):
                self.prefix.revive(p)
                self._refs[p] = 1
            else:
                raise ValueError(f"page {p} is neither held nor cached")

    def free(self, pages: list[int]) -> None:
        """Let go of pages; a page no table holds any more goes back to the pool (idle in
        the prefix cache when it is registered there). Freeing a page that is not held is
        an error."""
        for p in pages:
            refs = self._refs.get(p)
            if refs is None:
                raise ValueError(f"page {p} is not allocated")
            if refs > 1:
                self._refs[p] = refs - 1
                continue
            del self._refs[p]
            if self.prefix is not None and self.prefix.holds(p):
                self.prefix.park(p)
            else:
                self._free.append(p)
