"""Start and stop Tulip server processes (for launchers like ``trellis up``, tests, benches).

`TulipProcess` runs ``python -m tulip`` as a child process, waits until its health
service says SERVING, and stops it the way an orchestrator does (SIGTERM, then wait).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "TulipProcess", "free_port", "scrape_metrics"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to right now, below the kernel's ephemeral range, and
    never one this process handed out before.

    The port is free when this returns, and the child binds it later (seconds, after its
    imports). An ephemeral port can be taken in between by any outgoing connection on the
    machine, since the kernel hands those out of that range; `trellis up` failed to bind that
    way under load. A random port below the range is only ever taken by someone binding
    it on purpose, such as a sibling picked by an earlier call that nothing has bound yet:
    `trellis up` picks every replica's gRPC and metrics port before starting any, and a
    replica failed to bind a metrics port so in CI. Falls back to a kernel-chosen port if
    the range leaves no room below it.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(_LOWEST_PICKED, low) if low > _LOWEST_PICKED + 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        with _HANDED_OUT_LOCK:
            if port in _HANDED_OUT:
                continue
            _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free TCP port found on {host}")


_HANDED_OUT: set[int] = set()  # every port free_port returned in this process
_HANDED_OUT_LOCK = threading.Lock()
_LOWEST_PICKED = 10_000  # below: well-known services and what admins pin by hand


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def scrape_metrics(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of a Prometheus text endpoint, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


class TulipProcess:
    """One ``python -m tulip`` child process on loopback ports picked for it."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        metrics_port: int | None = None,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = free_port(host) if metrics_port is None else metrics_port
        self.log_path = log_path
        self._args = [
            *args,
            "--host",
            host,
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        self._env = dict(os.environ if env is None else env)
        self._log: IO[bytes] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self) -> TulipProcess:
        output: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            self._log = self.log_path.open("ab")
            output = self._log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tulip", *self._args],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=self._env,
        )
        return self

    def wait_serving(self, timeout: float = 300.0) -> None:
        """Block until health says SERVING; raises if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                code = self.poll()
                if code is not None:
                    raise RuntimeError(
                        f"tulip exited with {code} while starting\n{self.log_tail()}"
                    )
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tulip not SERVING after {timeout}s\n{self.log_tail()}")
                time.sleep(0.2)

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        """Send SIGTERM (start a graceful drain) without waiting."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
        if self.process is None:
            return 0
        self.terminate()
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def metrics(self) -> Samples:
        return scrape_metrics(self.metrics_url)

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def __enter__(self) -> TulipProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
