"""Shared pytest fixtures.

``model_path(name)`` returns the Hugging Face directory of a model asset, pulling,
converting and verifying it on first use (``make test`` pulls them all beforehand)::

    def test_something(model_path):
        tokenizer_json = model_path("xlmr-tokenizer") / "tokenizer.json"
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    from rose.assets import ensure_model

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = ensure_model(name)
        return cache[name]

    return get
