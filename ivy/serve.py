"""Run the gateway under uvicorn with a graceful drain and an exit status that reports it.

SIGTERM (or a first SIGINT) marks the gateway draining (/health/ready answers 503, new work
is refused), closes the listening socket and waits for the requests in flight, up to
`IvyConfig.shutdown_seconds` (the longest a request may live, plus a margin). The process
then exits 0 when every request finished, 1 when the wait ran out and requests were cut (or
a second SIGINT forced the exit). uvicorn itself re-raises the signal after its shutdown,
which ends the process with 128 + SIGTERM = 143 even after a clean drain; Ivy does not.

One worker runs in this process (`DrainingServer`). Several run under `Supervisor`:
spawned processes that share one listening socket, each a `DrainingServer`; the supervisor
passes SIGTERM/SIGINT on, restarts a worker that dies while serving, and exits 0 only when
every worker drained cleanly.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.context import SpawnProcess
from types import FrameType
from typing import Any

import uvicorn
from uvicorn._subprocess import get_subprocess
from uvicorn.config import STARTUP_FAILURE

from ivy.config import WORKER_CONFIG_ENV, IvyConfig
from ivy.http import READ_TIMEOUT_ATTR, TimedHttpProtocol
from ivy.logs import log_config

__all__ = ["EXIT_SECONDS", "DrainingServer", "Supervisor", "serve", "uvicorn_config"]

# After the drain: the app's shutdown (closing replica pools) and the process's exit. A
# supervisor kills a worker this long after its drain limit; an orchestrator's grace period
# must cover the drain plus this (tests/test_deploy_invariants.py checks the manifests).
EXIT_SECONDS = 5.0

_DRAIN_FAILED = 1
_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger("uvicorn.error")


class DrainingServer(uvicorn.Server):
    """uvicorn's server that marks the gateway draining on the first SIGTERM/SIGINT and
    records in `drained` whether every in-flight request finished within the limit."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = getattr(self.config, "loaded_app", None)
        while app is not None:  # uvicorn may wrap the IvyApp in its own middleware
            gateway = getattr(app, "gateway", None)
            if gateway is not None:
                gateway.draining = True
                break
            app = getattr(app, "app", None)
        # uvicorn's own handler, except that the signal is not recorded to be re-raised
        # after the shutdown: the exit status comes from `drained` instead.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn awaits this under timeout_graceful_shutdown and cancels it when the time
        # runs out, so reaching the end means every connection and task finished.
        await super()._wait_tasks_to_complete()
        self.drained = not self.force_exit


def uvicorn_config(config: IvyConfig, app: Any = "ivy.app:create_app_from_env") -> uvicorn.Config:
    """uvicorn's settings for `config` (`app`: the factory's import path, or an app)."""
    uv_config = uvicorn.Config(
        app,
        factory=isinstance(app, str),
        host=config.host,
        port=config.port,
        workers=config.workers,
        log_level="warning",
        log_config=log_config(config.log_format),
        access_log=False,
        timeout_graceful_shutdown=math.ceil(config.shutdown_seconds),
        http=TimedHttpProtocol,  # httptools with a read timeout for headers and body
        limit_concurrency=config.max_connections,
        proxy_headers=False,  # Ivy reads no client address; skip the per-request rewrite
    )
    setattr(uv_config, READ_TIMEOUT_ATTR, config.read_timeout_seconds)
    return uv_config


def serve(config: IvyConfig) -> int:
    """Serve until SIGTERM/SIGINT, drain, and return the exit status (0: clean drain)."""
    # Workers are separate processes; they rebuild the app from this (ivy.app).
    os.environ[WORKER_CONFIG_ENV] = config.to_json()
    uv_config = uvicorn_config(config)
    if config.workers > 1:
        return Supervisor(uv_config, config.shutdown_seconds + EXIT_SECONDS).run()
    server = DrainingServer(uv_config)
    server.run()
    return 0 if server.drained else _DRAIN_FAILED


def _run_worker(config: uvicorn.Config, sockets: list[socket.socket]) -> None:
    """A worker process's body; its exit status says whether it drained cleanly."""
    server = DrainingServer(config)
    server.run(sockets)
    if not server.drained:
        sys.exit(_DRAIN_FAILED)


class Supervisor:
    """``workers`` worker processes on one listening socket (what uvicorn's Multiprocess
    does, with draining workers and an exit status that reports their drains)."""

    def __init__(self, config: uvicorn.Config, stop_seconds: float) -> None:
        self.config = config
        self.stop_seconds = stop_seconds
        self.workers: list[SpawnProcess] = []
        self._socket: socket.socket | None = None
        self._stop = threading.Event()
        self._forced = False

    def _start_worker(self) -> SpawnProcess:
        assert self._socket is not None
        target = functools.partial(_run_worker, self.config)
        process = get_subprocess(self.config, target, [self._socket])
        process.start()
        return process

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self._stop.is_set():
            self._stop.set()
            return
        # A second signal while the workers drain: make them stop now (a second SIGINT
        # forces a DrainingServer out of its wait).
        self._forced = True
        for worker in self.workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signal.SIGINT)

    def run(self) -> int:
        self._socket = self.config.bind_socket()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        status = 0
        try:
            self.workers = [self._start_worker() for _ in range(self.config.workers)]
            while not self._stop.wait(0.5):
                for index, worker in enumerate(self.workers):
                    if worker.is_alive() or self._stop.is_set():
                        continue
                    worker.join()
                    if worker.exitcode == STARTUP_FAILURE:
                        # The app cannot start (a bad model directory, say); every restart
                        # would fail the same way.
                        log.error("ivy: worker %s failed to start; stopping", worker.pid)
                        status = STARTUP_FAILURE
                        self._stop.set()
                        break
                    log.warning(
                        "ivy: worker %s exited (%s); restarting", worker.pid, worker.exitcode
                    )
                    self.workers[index] = self._start_worker()
            drained = self._stop_workers()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._socket.close()
        if status:
            return status
        return 0 if drained and not self._forced else _DRAIN_FAILED

    def _stop_workers(self) -> bool:
        """SIGTERM every worker, wait for their drains, kill what outlives the limit."""
        # This process's copy of the listening socket would keep the port open (the kernel
        # queueing connections nobody accepts) after the workers close theirs.
        assert self._socket is not None
        self._socket.close()
        for worker in self.workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_seconds
        drained = True
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                log.error(
                    "ivy: worker %s did not drain in %.0fs; killing it",
                    worker.pid,
                    self.stop_seconds,
                )
                worker.kill()
                worker.join()
                drained = False
            elif worker.exitcode != 0:
                drained = False
        return drained
