"""Moved to `rose.attention.metadata`; this name stays for the importers not switched yet
(`rose.models.llama`, `bench.spec`). Import from `rose.attention.metadata`."""

from rose.attention.metadata import AttentionMetadata, PageLists, to_device

__all__ = ["AttentionMetadata", "PageLists", "to_device"]
