"""ROSE: the Trellis inference engine.

Encoders (BERT, XLM-RoBERTa, Qwen3 embedders: `rose.models.FAMILIES`) and cross-encoders
run on ragged batches (tokens of all rows concatenated, no padding) and return lazy results::

    from rose import Engine, EngineConfig, RaggedBatch

    engine = Engine.load(model_dir, EngineConfig(device="cpu"))
    lazy = engine.step(RaggedBatch.from_lists([[0, 35378, 2], [0, 83, 99942, 2]]))
    vectors = lazy.wait()  # [2, D] float32 on the CPU

Importing this package is cheap: the public names below load their modules (and torch) on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rose.batch import RaggedBatch
    from rose.config import EngineConfig
    from rose.engine import Engine
    from rose.errors import EngineError
    from rose.lazy import LazyTensor
    from rose.loading import ModelInfo

__all__ = ["Engine", "EngineConfig", "EngineError", "LazyTensor", "ModelInfo", "RaggedBatch"]

_HOMES = {
    "Engine": "rose.engine",
    "EngineConfig": "rose.config",
    "EngineError": "rose.errors",
    "LazyTensor": "rose.lazy",
    "ModelInfo": "rose.loading",
    "RaggedBatch": "rose.batch",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rose' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)
