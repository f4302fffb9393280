"""Model families, one module each (plain PyTorch, weights through explicit name maps)."""

from __future__ import annotations

__all__: list[str] = []
