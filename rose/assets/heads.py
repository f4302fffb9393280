"""MTP heads that ship with Trellis, so ``--spec mtp`` works out of the box for their targets.

A bundled head lives in ``rose/assets/bundled/<name>/`` (``config.json`` and a bf16
``model.safetensors``, a few MB) and is tied to one target *asset* (`rose.assets`): it was
trained on that asset's weights, so it is offered only when the served model is that asset,
by name or by its directory. Its bytes are checked against the sha256 declared here before
use, and ``trellis models pull <name>`` copies it, checked, to
``~/.cache/trellis/heads/<name>`` (`rose.spec.train_mtp.default_head_dir`, where ``python -m
bench spec`` looks).

Provenance: a head is the output of ``python -m rose.spec.train_mtp`` (its command, corpus
settings and seed are in its ``config.json`` under ``"trained_with"``), saved in bf16 by
``python -m rose.spec.train_mtp --bf16-copy DIR``. Training is deterministic on the CPU
(same seed, corpus and order give the same fp32 weights, bit for bit) and the bf16 copy is a
pure rounding of them, so the command reproduces the shipped file bit for bit.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from rose.assets.errors import AssetError
from rose.assets.pip import file_sha256

__all__ = ["BUNDLED", "BundledHead", "bundled_head_for", "head_dir", "install_head"]

_ROOT = Path(__file__).parent / "bundled"
_FILES = ("config.json", "model.safetensors")


@dataclass(frozen=True)
class BundledHead:
    """name: the head's asset name; target: the model asset it drafts for; sha256: of its
    ``model.safetensors``; acceptance: what bench/results/mtp_accept.md measured."""

    name: str
    target: str
    sha256: str
    description: str

    @property
    def path(self) -> Path:
        return _ROOT / self.name

    def verified(self) -> Path:
        """The head's directory once its weights hash to ``sha256`` (else `AssetError`)."""
        weights = self.path / "model.safetensors"
        if not weights.is_file():
            raise AssetError(f"{self.name}: {weights} is missing from this installation")
        digest = file_sha256(weights)
        if digest != self.sha256:
            raise AssetError(
                f"{self.name}: {weights} has sha256 {digest}, expected {self.sha256}; "
                "reinstall Trellis"
            )
        return self.path


BUNDLED: dict[str, BundledHead] = {
    h.name: h
    for h in (
        BundledHead(
            name="smollm2-135m-instruct-mtp",
            target="smollm2-135m-instruct",
            sha256="b812eb99c884499ac75802ea60127dafd2afccb6129452d891ee8bd74eab82c5",
            description="MTP draft head for smollm2-135m-instruct (bf16, --spec mtp)",
        ),
    )
}


def bundled_head_for(model: str) -> BundledHead | None:
    """The bundled head for ``model`` (an asset name, or the directory that asset was
    pulled into), or None."""
    from rose.assets import model_dir

    for head in BUNDLED.values():
        if model == head.target:
            return head
        path = Path(model)
        if path.is_dir() and path.resolve() == model_dir(head.target).resolve():
            return head
    return None


def head_dir(name: str) -> Path:
    """Where head ``name`` is kept once pulled or trained: ``~/.cache/trellis/heads/<name>``."""
    return Path.home() / ".cache" / "trellis" / "heads" / name


def install_head(name: str, out_dir: Path | None = None) -> Path:
    """Copy bundled head ``name``, checked, into ``out_dir`` (default `head_dir`), replacing
    what is there."""
    head = BUNDLED[name]
    out_dir = out_dir or head_dir(name)
    source = head.verified()
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in _FILES:
        shutil.copyfile(source / file, out_dir / file)
    if file_sha256(out_dir / "model.safetensors") != head.sha256:
        raise AssetError(f"{name}: the copy in {out_dir} does not match its sha256")
    return out_dir
