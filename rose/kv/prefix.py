"""Prefix caching: full KV pages found again by the content they hold.

A page that a target table filled with ``page_size`` final tokens is *registered* under the
hash of every token up to its end (a chain: a page's key is the hash of its parent page's
key and its own tokens, so equal keys mean equal whole prefixes, not just equal pages). A
new request whose prompt starts with registered pages adopts them (`BlockTable.adopt`) and
its prefill starts after them; RAG prompts that share a system prompt and passages skip
that part of their prefill.

Invariants:

- Only full pages of committed tokens (``tokens[: table.length]``, never a draft) are
  registered, and a table only writes at positions ``>= table.length``: a shared page is
  never written, so sharing needs no copy. The page at the end of a hit is the boundary:
  a request always computes at least its last token (the pass must return its logits), so
  a prompt that is entirely cached recomputes its last page (at most ``page_size`` tokens)
  into a page of its own rather than copying the shared one (vLLM v1 does the same).
- A registered page is in exactly one state: held by one or more tables (the allocator's
  reference count), or idle (no table, kept for its contents, in LRU order). The allocator
  hands out free pages first and evicts idle ones, least recently released first, only
  when the free list runs dry; an evicted page forgets its key.
- Keys are 128-bit BLAKE2b digests of the token ids, so a collision (two prefixes sharing a
  page) is not a practical concern, adversarial inputs included.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixCache", "PrefixStats", "chain_key"]

_ROOT = b""


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a page holding ``tokens`` after the prefix whose last page's key is
    ``parent`` (``b""`` for the first page)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("I", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixStats:
    """Running totals: tokens looked up at admission, tokens found (prefill skipped),
    pages evicted to make room."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0


class PrefixCache:
    """Registered pages by key, and the idle ones in LRU order (see the module docs)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stats = PrefixStats()
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_pages(self) -> int:
        """Registered pages, held or idle."""
        return len(self._key_of)

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[bytes]]:
        """The registered pages that hold the longest start of ``tokens`` of whole pages,
        at most ``limit`` tokens, and their keys (the caller adopts the pages)."""
        ps = self.page_size
        pages: list[int] = []
        keys: list[bytes] = []
        parent = _ROOT
        for end in range(ps, limit + 1, ps):
            key = chain_key(parent, tokens[end - ps : end])
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def register(self, key: bytes, page: int) -> None:
        """Register ``page`` (held by the caller) under ``key``, unless a page with the same
        contents is registered already (two requests computed it at once: the first stays)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def holds(self, page: int) -> bool:
        return page in self._key_of

    def park(self, page: int) -> None:
        """No table holds ``page`` any more: keep it idle, most recently released."""
        self._idle[page] = None

    def revive(self, page: int) -> None:
        """An idle ``page`` is adopted again."""
        del self._idle[page]

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def evict(self) -> int:
        """Forget the least recently released idle page and return it (now free)."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.stats.evicted_pages += 1
        return page
