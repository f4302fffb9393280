"""A real Ivy process in front of real Tulip processes, as end-to-end test modules start it.

    with ivy_over({"name": (model_spec, tulip.target)}, log_path, env) as url:
        httpx.post(f"{url}/v1/embeddings", ...)

Ivy runs on a free port, serving each name from its model (a directory or a Hub id) and
its one replica; the URL is yielded once `/health/ready` answers 200 (the replicas must be
serving by then: `TulipProcess.wait_serving`). On the way out Ivy is stopped with SIGTERM
and must exit 0 (a drain that fails shows as the test's failure, with Ivy's log).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from tulip.process import free_port

__all__ = ["ivy_over", "serve_dirs", "wait_ready"]

_READY_SECONDS = 120


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until Ivy at `url` says ready; fails with its log if it exits or takes too long."""
    deadline = time.monotonic() + _READY_SECONDS
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, "ivy not ready"
        time.sleep(0.2)


@contextlib.contextmanager
def ivy_over(
    models: Mapping[str, tuple[str | Path, str]],
    log: Path,
    env: Mapping[str, str],
    args: Sequence[str] = (),
) -> Iterator[str]:
    """Ivy serving ``name -> (model, replica target)``; yields its base URL when ready."""
    port = free_port()
    argv = [sys.executable, "-m", "ivy", "--port", str(port), *args]
    for name, (model, target) in models.items():
        argv += ["--model", f"{name}={model}", "--replicas", f"{name}={target}"]
    with log.open("wb") as out:
        ivy = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, ivy, log)
            yield url
        finally:
            ivy.terminate()
            assert ivy.wait(60) == 0, log.read_text()[-4000:]


@contextlib.contextmanager
def serve_dirs(dirs: Mapping[str, Path], logs: Path) -> Iterator[str]:
    """One CPU Tulip (one thread) per model directory, named by its key, behind one Ivy;
    yields Ivy's base URL once everything is ready. Logs go to `logs`."""
    from tulip.process import TulipProcess

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tulips = {
        name: TulipProcess(
            ["--model", str(path), "--model-name", name, "--device", "cpu", "--threads", "1"],
            log_path=logs / f"{name}.log",
            env=env,
        )
        for name, path in dirs.items()
    }
    with contextlib.ExitStack() as stack:
        for tulip in tulips.values():
            stack.enter_context(tulip)
        for tulip in tulips.values():
            tulip.wait_serving()
        served = {name: (path, tulips[name].target) for name, path in dirs.items()}
        yield stack.enter_context(ivy_over(served, logs / "ivy.log", env))
