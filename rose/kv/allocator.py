"""A fixed pool of KV pages handed out by id; one allocator serves target and drafter."""

from __future__ import annotations

from dataclasses import dataclass

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

    Invariant: every id is either in the free list or owned by exactly one block table.
    Freed pages are reused LIFO (recently touched memory first).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Stack of free ids; pop() from the end, lowest ids handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises `OutOfPages` (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), self.num_pages)
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; freeing a page that is not in use is an error."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)
