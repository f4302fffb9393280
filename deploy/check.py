"""Validate the deployment files offline with the real tools (see `deploy.tools`).

* every Kubernetes overlay renders with ``kustomize build`` and the output passes
  ``kubernetes-validate --strict`` against `deploy.tools.KUBERNETES_VERSION`;
* ``docker-compose.yml`` passes the Compose binary's ``config -q`` for each profile set;
* the Dockerfile passes hadolint (with ``deploy/docker/.hadolint.yaml``).

The functions return parsed results for the invariant tests (``tests/test_deploy*.py``);
``python -m deploy.check`` runs everything and exits non-zero on the first kind of failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.tools import Tools, ToolsError, ensure_tools

__all__ = [
    "COMPOSE_FILE",
    "COMPOSE_PROFILE_SETS",
    "DEPLOY_DIR",
    "DOCKERFILE",
    "CheckError",
    "Overlay",
    "compose_config",
    "compose_validate",
    "context_files",
    "dockerfile_instructions",
    "hadolint",
    "kubernetes_validate",
    "main",
    "overlays",
    "render_overlay",
]

DEPLOY_DIR = Path(__file__).resolve().parent
REPO_ROOT = DEPLOY_DIR.parent
COMPOSE_FILE = DEPLOY_DIR / "docker-compose.yml"
DOCKERFILE = DEPLOY_DIR / "docker" / "Dockerfile"
HADOLINT_CONFIG = DEPLOY_DIR / "docker" / ".hadolint.yaml"
# Profile sets a user runs: the default (COMPOSE_PROFILES=cpu from deploy/.env), the GPU
# profile, and each with Prometheus.
COMPOSE_PROFILE_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("gpu",),
    ("cpu", "metrics"),
    ("gpu", "metrics"),
)


class CheckError(RuntimeError):
    """A validator rejected a deployment file; the message carries the tool's output."""


@dataclass(frozen=True)
class Overlay:
    name: str
    path: Path


def _run(cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=None if env is None else dict(env),
    )
    if done.returncode != 0:
        raise CheckError(f"{what} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def overlays() -> list[Overlay]:
    """The kustomize overlays under deploy/k8s/overlays, by name."""
    root = DEPLOY_DIR / "k8s" / "overlays"
    return [
        Overlay(p.name, p) for p in sorted(root.iterdir()) if (p / "kustomization.yaml").is_file()
    ]


def render_overlay(tools: Tools, overlay: Overlay) -> str:
    """``kustomize build`` of one overlay: a multi-document YAML stream."""
    return _run([tools.kustomize, "build", overlay.path], f"kustomize build {overlay.name}")


def kubernetes_validate(tools: Tools, rendered: str, label: str) -> str:
    """Strict schema validation of rendered manifests; raises `CheckError` on any failure."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{label}.yaml"
        path.write_text(rendered, encoding="utf-8")
        return _run(
            [
                tools.kubernetes_validate,
                "--strict",
                "--kubernetes-version",
                tools.kubernetes_version,
                path,
            ],
            f"kubernetes-validate --strict ({label})",
        )


def _compose_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # The profile default must come from deploy/.env, not from the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env["HOME"] = os.environ.get("HOME", "/tmp")
    env.update(extra or {})
    return env


def _compose_cmd(tools: Tools, profiles: Sequence[str]) -> list[str]:
    cmd = [str(tools.compose), "-f", str(COMPOSE_FILE)]
    for profile in profiles:
        cmd += ["--profile", profile]
    return cmd


def compose_validate(tools: Tools, profiles: Sequence[str]) -> None:
    """``docker compose config -q`` with the given ``--profile`` flags (none: the default)."""
    _run(
        [*_compose_cmd(tools, profiles), "config", "-q"],
        f"compose config -q (profiles {list(profiles) or 'default'})",
        _compose_env(),
    )


def compose_config(
    tools: Tools, profiles: Sequence[str], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The Compose binary's resolved model (anchors merged, variables interpolated), with
    ``env`` added to the variables the file interpolates."""
    out = _run(
        [*_compose_cmd(tools, profiles), "config", "--format", "json"],
        f"compose config (profiles {list(profiles) or 'default'})",
        _compose_env(env),
    )
    return json.loads(out)


def hadolint(tools: Tools, dockerfile: Path = DOCKERFILE) -> str:
    """hadolint at its default failure threshold (info): any finding fails."""
    return _run(
        [tools.hadolint, "--config", HADOLINT_CONFIG, "--no-color", dockerfile],
        f"hadolint {dockerfile.name}",
    )


_PARSE = """
import dataclasses, json, sys
import dockerfile
print(json.dumps([dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c._asdict()
                  for c in dockerfile.parse_file(sys.argv[1])]))
"""


def dockerfile_instructions(tools: Tools, dockerfile: Path = DOCKERFILE) -> list[dict[str, Any]]:
    """The Dockerfile as BuildKit's parser sees it: one dict per instruction."""
    return json.loads(_run([tools.python, "-c", _PARSE, dockerfile], "dockerfile parse"))


def context_files(tools: Tools, root: Path = REPO_ROOT) -> list[str]:
    """Files of the build context at ``root`` that its ``.dockerignore`` lets through."""
    return _run([tools.contextfiles, root], "contextfiles").splitlines()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.check", description=__doc__.splitlines()[0]
    )
    parser.parse_args(argv)
    try:
        tools = ensure_tools()
        for overlay in overlays():
            rendered = render_overlay(tools, overlay)
            kubernetes_validate(tools, rendered, overlay.name)
            print(
                f"k8s overlay {overlay.name}: renders, valid for Kubernetes {tools.kubernetes_version}"
            )
        for profiles in COMPOSE_PROFILE_SETS:
            compose_validate(tools, profiles)
            print(f"compose profiles {list(profiles) or 'default'}: valid")
        hadolint(tools)
        print(f"hadolint {DOCKERFILE.relative_to(REPO_ROOT)}: clean")
    except (ToolsError, CheckError) as exc:
        print(f"deploy.check: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
