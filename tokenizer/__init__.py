"""Trellis Unigram tokenizer (Rust, bound with pyo3)."""

from __future__ import annotations

from . import _native

__all__ = ["_native"]
