"""The root of ROSE's errors."""

from __future__ import annotations

__all__ = ["EngineError"]


class EngineError(Exception):
    """A model the engine cannot load, or a batch it cannot run; the message says which part."""
