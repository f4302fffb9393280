"""`trellis up` as end-to-end tests run it: start, wait for "Trellis is up", stop with Ctrl-C.

Shared by the embeddings (`test_e2e_ivy.py`) and generation (`test_ivy_generate.py`)
end-to-end suites, which each start one cluster per module.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tulip.process import free_port

__all__ = ["UpCluster", "start_up", "stop_up"]

_READY_SECONDS = 400


@dataclass
class UpCluster:
    """A running `trellis up` process and what it printed."""

    proc: subprocess.Popen[str]
    base_url: str
    name: str
    replica_addresses: list[str]
    output: list[str]

    @property
    def text(self) -> str:
        return "".join(self.output)

    def children(self) -> dict[int, str]:
        """pid -> command line of the processes `trellis up` started."""
        pids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        out = {}
        for pid in pids:
            with contextlib.suppress(FileNotFoundError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                out[int(pid)] = cmd
        return out

    def replicas(self) -> dict[int, str]:
        """pid -> command line of each running Tulip."""
        return {pid: cmd for pid, cmd in self.children().items() if " -m tulip " in cmd}

    def replica_pid(self, address: str) -> int:
        port = address.rpartition(":")[2]
        for pid, cmd in self.replicas().items():
            if f"--port {port} " in cmd:
                return pid
        raise LookupError(address)

    def replica_metrics(self) -> dict[int, str]:
        """pid -> each replica's Prometheus text (ports from the replicas' command lines)."""
        texts = {}
        for pid, cmd in self.replicas().items():
            port = re.search(r"--metrics-port (\d+)", cmd)
            assert port is not None, cmd
            url = f"http://127.0.0.1:{port.group(1)}/metrics"
            texts[pid] = httpx.get(url, timeout=5).text
        return texts


def start_up(
    model_dir: Path, env: dict[str, str] | None = None, args: Sequence[str] = ()
) -> UpCluster:
    """`trellis up --model DIR [args]` with 2 replicas x 1 thread on a free port, once ready."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivy.cli", "up", "--model", str(model_dir), "--port", str(port)]
        + ["--replicas", "2", "--threads-per-replica", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    lines: list[str] = []
    up = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Trellis is up"):
                up.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + _READY_SECONDS
    while not up.is_set() and proc.poll() is None and time.monotonic() < deadline:
        up.wait(0.5)
    if not up.is_set():
        proc.kill()
        pytest.fail("trellis up did not become ready:\n" + "".join(lines[-80:]))
    time.sleep(0.2)  # let the example lines after the banner arrive
    addresses = re.search(r"thread\(s\) at (\S+), (\S+); Ivy", "".join(lines))
    assert addresses is not None, "".join(lines)
    base_url = f"http://127.0.0.1:{port}"
    return UpCluster(proc, base_url, model_dir.name, list(addresses.groups()), lines)


def stop_up(cluster: UpCluster) -> int:
    """Ctrl-C, as a user would; returns the exit code once everything has stopped."""
    cluster.proc.send_signal(signal.SIGINT)
    try:
        return cluster.proc.wait(90)
    except subprocess.TimeoutExpired:
        cluster.proc.kill()
        raise
