"""Configuration of the asset pipeline: one frozen dataclass, read once from the environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rose.assets.errors import AssetError

__all__ = ["AssetsConfig", "DEFAULT_MODELS_DIR"]

_T = TypeVar("_T")

DEFAULT_MODELS_DIR = Path("~/.cache/trellis/models")


@dataclass(frozen=True)
class AssetsConfig:
    """Where assets live and how pip reaches the registry.

    models_dir: cache root; asset NAME lives in ``models_dir / NAME``
        (env ``TRELLIS_MODELS_DIR``, default ``~/.cache/trellis/models``).
    pip_index_url: passed to pip as ``--index-url`` when set (env ``TRELLIS_PIP_INDEX_URL``);
        unset means pip's own configuration decides.
    pip_retries: pip ``--retries`` (env ``TRELLIS_PIP_RETRIES``, default 3).
    pip_timeout_s: pip ``--timeout`` in seconds (env ``TRELLIS_PIP_TIMEOUT``, default 30).
    python: the interpreter whose pip downloads packages (default: this one).
    """

    models_dir: Path
    pip_index_url: str | None = None
    pip_retries: int = 3
    pip_timeout_s: float = 30.0
    python: str = sys.executable

    def __post_init__(self) -> None:
        if not str(self.models_dir):
            raise AssetError("TRELLIS_MODELS_DIR: must not be empty")
        if self.pip_retries < 0:
            raise AssetError(f"TRELLIS_PIP_RETRIES: must be >= 0, got {self.pip_retries}")
        if not self.pip_timeout_s > 0:
            raise AssetError(f"TRELLIS_PIP_TIMEOUT: must be > 0, got {self.pip_timeout_s}")
        if self.pip_index_url is not None and "://" not in self.pip_index_url:
            raise AssetError(
                f"TRELLIS_PIP_INDEX_URL: expected a URL such as https://pypi.org/simple, "
                f"got {self.pip_index_url!r}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AssetsConfig:
        env = os.environ if environ is None else environ
        models_dir = Path(env.get("TRELLIS_MODELS_DIR") or DEFAULT_MODELS_DIR).expanduser()
        return cls(
            models_dir=models_dir,
            pip_index_url=env.get("TRELLIS_PIP_INDEX_URL") or None,
            pip_retries=_parse(env, "TRELLIS_PIP_RETRIES", int, 3),
            pip_timeout_s=_parse(env, "TRELLIS_PIP_TIMEOUT", float, 30.0),
        )


def _parse(env: Mapping[str, str], key: str, kind: Callable[[str], _T], default: _T) -> _T:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise AssetError(
            f"{key}: expected a {getattr(kind, '__name__', 'value')}, got {raw!r}"
        ) from None
