"""`bench/gpu_run.sh --dry-run` on the CPU: it walks every stage's setup (each pytest stage's
selection collects, gpu_check imports, split wheels join into whole ones) and prints the plan
and its time budget, so a lent GPU's minutes are not spent finding a typo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["env", "torch-tests", "hazards", "fi-install", "flashinfer", "gpu-check"]
FLASHINFER = "flashinfer_python-0.7.4-py3-none-any.whl"
TVM_FFI = "apache_tvm_ffi-0.1.9-py3-none-any.whl"


def _dry_run(
    wheels: Path, *args: str, python: str | None = sys.executable, path_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The dry run with ``PYTHON=python`` (None: unset) and ``path_first`` ahead on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT", "GPU_RESULTS")}
    env["GPU_WHEELS"] = str(wheels)
    if python is not None:
        env["PYTHON"] = python
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "bench/gpu_run.sh", "--dry-run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _wheel(path: Path) -> bytes:
    with zipfile.ZipFile(path, "w") as z:
        for i in range(20):
            z.writestr(f"pkg/m{i}.py", os.urandom(2000).hex())
    return path.read_bytes()


def _split(data: bytes, stem: Path, parts: int) -> None:
    step = -(-len(data) // parts)
    for i in range(parts):
        Path(f"{stem}.part-a{chr(ord('a') + i)}").write_bytes(data[i * step : (i + 1) * step])


def _plan(out: str) -> list[tuple[str, int]]:
    return [(m[1], int(m[2])) for m in re.finditer(r"^plan \d+ (\S+)\s+(\d+)s", out, re.M)]


def test_dry_run_walks_every_stage_and_joins_split_wheels(tmp_path: Path) -> None:
    whole = _wheel(tmp_path / FLASHINFER)
    (tmp_path / FLASHINFER).unlink()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _split(whole, wheels / FLASHINFER, 3)
    _wheel(wheels / TVM_FFI)
    before = sorted(p.name for p in wheels.iterdir())
    run = _dry_run(wheels)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    plan = _plan(out)
    assert [name for name, _ in plan] == STAGES
    assert sum(t for _, t in plan) <= 600
    assert re.search(r"^gpu_run dry run: part all, .* budget (\d+)s of 600s", out, re.M)
    assert f"join 3 parts -> {FLASHINFER}" in out
    assert re.search(rf"would install: .*{re.escape(FLASHINFER)}", out)
    assert TVM_FFI in out
    collected = re.findall(r"collects: (\d+)(?:/\d+)? tests? collected", out)
    assert len(collected) == 3 and all(int(n) > 0 for n in collected)  # three pytest stages
    assert "imports: bench.gpu_check" in out
    assert out.rstrip().endswith("gpu_run dry run: ok")
    assert sorted(p.name for p in wheels.iterdir()) == before  # a dry run writes nothing there


@pytest.mark.parametrize(
    "part,stages",
    [
        ("1", ["env", "torch-tests", "hazards"]),
        ("2", ["env", "fi-install", "flashinfer", "gpu-check"]),
    ],
)
def test_two_part_variant_plans(tmp_path: Path, part: str, stages: list[str]) -> None:
    run = _dry_run(tmp_path, f"--part={part}", "--no-collect")
    assert run.returncode == 0, run.stdout + run.stderr
    plan = _plan(run.stdout)
    assert [name for name, _ in plan] == stages
    assert sum(t for _, t in plan) <= 600
    if part == "2":
        assert "would install: nothing (no wheels; the stage would skip)" in run.stdout


def test_dry_run_refuses_a_wheel_with_a_part_missing(tmp_path: Path) -> None:
    whole = _wheel(tmp_path / "whole.whl")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _split(whole, wheels / FLASHINFER, 3)
    (wheels / f"{FLASHINFER}.part-ab").unlink()
    run = _dry_run(wheels, "--part=2", "--no-collect")
    assert run.returncode != 0
    assert "do not make a whole wheel" in run.stdout + run.stderr


def test_dry_run_without_python_uses_the_checkouts_venv_where_python3_lacks_torch(
    tmp_path: Path,
) -> None:
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv in this checkout (`make install` makes it)")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")  # a python3 that imports nothing
    (fake / "python3").chmod(0o755)
    run = _dry_run(tmp_path / "wheels", "--part=1", python=None, path_first=fake)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"gpu_run dry run: part 1, python {venv_python}," in run.stdout
    collected = re.findall(r"collects: (\d+)(?:/\d+)? tests? collected", run.stdout)
    assert len(collected) == 2 and all(int(n) > 0 for n in collected)
