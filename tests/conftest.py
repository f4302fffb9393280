"""Shared pytest fixtures.

``model_path(name)`` returns the Hugging Face directory of a model asset, pulling,
converting and verifying it on first use (``make test`` pulls them all beforehand)::

    def test_something(model_path):
        tokenizer_json = model_path("xlmr-tokenizer") / "tokenizer.json"

``e5_dir`` / ``e5_engine``: multilingual-e5-small's directory and a CPU ROSE engine on it,
the in-process reference of the Tulip suites.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from rose import Engine


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    from rose.assets import ensure_model

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = ensure_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def e5_dir() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model("multilingual-e5-small"))


@pytest.fixture(scope="session")
def e5_engine(e5_dir: Path) -> Engine:
    from rose import Engine, EngineConfig

    return Engine.load(e5_dir, EngineConfig(device="cpu"))
