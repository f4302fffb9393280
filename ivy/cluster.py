"""`trellis up`: a local cluster of Tulip replicas behind one Ivy gateway.

Resolves the model once (a directory, a bundled asset, or a Hub id ``owner/name[@revision]``
downloaded through `rose.hub`), divides the cores among the replicas (see `ClusterConfig`),
starts every process, waits until Ivy reports ready, prints example requests, and on Ctrl-C or
SIGTERM drains and stops everything (Ivy first so no new work arrives, then replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tulip.process import free_port

__all__ = ["Cluster", "ClusterConfig", "add_parser", "main"]

_DEFAULT_MODEL = "multilingual-e5-small"


@dataclass(frozen=True)
class ClusterConfig:
    """A local cluster: one model, ``replicas`` Tulip processes, one Ivy."""

    model: str = _DEFAULT_MODEL
    # One replica with every core: with the replicas' torch threads summing to more than
    # the cores, their OpenMP workers spin at barriers for partners that are not running;
    # on the 2-core machine 2 replicas x 2 threads served 4 concurrent clients at 2.2 req/s
    # against 27.6 for 1 x 2 (bench/results/serving-xeon.md). So `threads` divides the
    # cores among the replicas unless told otherwise, and one replica is the default: a
    # lone request gets the whole machine, concurrent ones are batched by its scheduler.
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    threads_per_replica: int = 0  # 0: the cores divided among the replicas (at least 1)
    ivy_workers: int = 1
    chunk_tokens: int = 8192
    ready_timeout_seconds: float = 600.0
    drain_seconds: float = 10.0
    max_batch_tokens: int = 0  # 0: Tulip's default
    extra_ivy_args: tuple[str, ...] = ()
    # Tulip flags for every replica (`trellis up ... --spec ngram`), checked by `tulip_flags`
    tulip_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must name a model directory, an asset or a Hub id")
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        if self.threads_per_replica < 0:
            raise ValueError("threads-per-replica: must be >= 0")
        if self.ivy_workers < 1:
            raise ValueError("ivy-workers: must be >= 1")
        if self.ready_timeout_seconds <= 0:
            raise ValueError("ready-timeout-seconds: must be > 0")

    def threads(self) -> int:
        """Torch threads per replica: ``threads_per_replica``, else the cores divided
        among the replicas (at least 1 each)."""
        if self.threads_per_replica:
            return self.threads_per_replica
        return max(1, _cores() // self.replicas)

    def oversubscribed(self) -> bool:
        """More torch threads in all replicas than cores (passes stall one another)."""
        return self.replicas * self.threads() > _cores()


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _die_with_parent() -> None:
    """Children get SIGTERM if `trellis up` itself dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Cluster:
    """The processes of one local cluster; `start` then `wait_ready`, finally `stop`."""

    config: ClusterConfig
    name: str = ""
    directory: Path = Path()
    replica_addresses: list[str] = field(default_factory=list)
    replica_metrics_ports: list[int] = field(default_factory=list)
    tulips: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ivy: subprocess.Popen[bytes] | None = None
    log_dir: Path | None = None
    # SIGTERM to exit for this Ivy: its drain (derived from its timeouts) + exit time
    ivy_stop_seconds: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _spawn(
        self, argv: list[str], env: dict[str, str], log_name: str
    ) -> subprocess.Popen[bytes]:
        out: int | object = None
        if self.log_dir is not None:
            out = open(self.log_dir / f"{log_name}.log", "wb")  # noqa: SIM115 - child owns it
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
            preexec_fn=_die_with_parent,
        )
        if out is not None:
            out.close()  # type: ignore[attr-defined]
        return proc

    def start_replica(self, index: int) -> subprocess.Popen[bytes]:
        cfg = self.config
        threads = cfg.threads()
        host, _, port = self.replica_addresses[index].rpartition(":")
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        argv = [
            sys.executable,
            "-m",
            "tulip",
            "--model",
            str(self.directory),
            "--model-name",
            self.name,
            "--host",
            host,
            "--port",
            port,
            "--metrics-port",
            str(self.replica_metrics_ports[index]),
            "--device",
            "cpu",
            "--threads",
            str(threads),
            "--drain-seconds",
            str(cfg.drain_seconds),
        ]
        if cfg.max_batch_tokens:
            argv += ["--max-batch-tokens", str(cfg.max_batch_tokens)]
        argv += cfg.tulip_args
        proc = self._spawn(argv, env, f"tulip-{index}")
        if index < len(self.tulips):
            self.tulips[index] = proc
        else:
            self.tulips.append(proc)
        return proc

    def start(self) -> None:
        from rose.hub import resolve_model

        cfg = self.config
        # Resolved (and downloaded) once here: replicas and Ivy get the directory.
        model = resolve_model(cfg.model)
        self.name, self.directory = model.name, model.path
        self.replica_addresses = [f"127.0.0.1:{free_port()}" for _ in range(cfg.replicas)]
        self.replica_metrics_ports = [free_port() for _ in range(cfg.replicas)]
        for i in range(cfg.replicas):
            self.start_replica(i)
        env = dict(os.environ)
        # Ivy tokenizes; leave the cores to the replicas' math libraries.
        env.update(OMP_NUM_THREADS="1", RAYON_NUM_THREADS=env.get("RAYON_NUM_THREADS", "2"))
        argv = [
            sys.executable,
            "-m",
            "ivy",
            "--host",
            cfg.host,
            "--port",
            str(cfg.port),
            "--workers",
            str(cfg.ivy_workers),
            "--model",
            f"{self.name}={self.directory}",
            "--replicas",
            f"{self.name}={','.join(self.replica_addresses)}",
            "--chunk-tokens",
            str(cfg.chunk_tokens),
            *cfg.extra_ivy_args,
        ]
        self.ivy_stop_seconds = _ivy_stop_seconds(argv[3:], env)
        self.ivy = self._spawn(argv, env, "ivy")

    def wait_ready(self) -> None:
        """Block until /health/ready answers 200; raise if a process exits or time runs out."""
        deadline = time.monotonic() + self.config.ready_timeout_seconds
        while time.monotonic() < deadline:
            for proc in [self.ivy, *self.tulips]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(proc.args[1:4])} exited with {proc.returncode}")  # type: ignore[index]
            try:
                with urllib.request.urlopen(f"{self.base_url}/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the cluster was not ready after {self.config.ready_timeout_seconds}s")

    def stop(self) -> None:
        """Ivy first (finishes in-flight requests), then the replicas (drain), then kill."""
        if self.ivy is not None:
            _terminate([self.ivy], timeout=self.ivy_stop_seconds)
        _terminate(self.tulips, timeout=self.config.drain_seconds + 15.0)


def _ivy_stop_seconds(argv: Sequence[str], env: dict[str, str]) -> float:
    """How long the Ivy started with ``argv`` may take to drain and exit after SIGTERM."""
    from ivy.config import ConfigError, parse_config
    from ivy.serve import EXIT_SECONDS

    try:
        drain = parse_config(argv, env).shutdown_seconds
    except (ConfigError, SystemExit):  # argparse exits on an unknown flag
        drain = 0.0  # Ivy refuses this configuration itself and exits 2 at once
    return drain + EXIT_SECONDS


def _terminate(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _chat_examples(base: str, name: str) -> str:
    return f"""
Trellis is up: Ivy on {base}, model `{name}`.

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 64}}'

  curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Write a haiku about search."}}], "max_tokens": 64, "stream": true}}'

Metrics: {base}/metrics   API: {base}/docs   Stop: Ctrl-C
"""


def _examples(base: str, name: str, directory: Path | None = None) -> str:
    """Example requests for the served model: chat for generators, rerank for
    cross-encoders, else embeddings and rerank."""
    embeddings = f"""
  curl -s {base}/v1/embeddings -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "input": ["how do plants grow?"], "input_type": "search_query"}}'
"""
    if directory is not None:
        from ivy.models import CROSS_ENCODER, GENERATOR, read_model_spec

        kind = read_model_spec(directory, 0).kind
        if kind == GENERATOR:
            return _chat_examples(base, name)
        if kind == CROSS_ENCODER:
            embeddings = ""
    return f"""
Trellis is up: Ivy on {base}, model `{name}`.
{embeddings}
  curl -s {base}/v1/rerank -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "query": "how do plants grow?", "documents": ["Plants grow from seeds.", "Paris is in France."], "top_n": 2}}'

Metrics: {base}/metrics   API: {base}/docs   Stop: Ctrl-C
"""


def run(config: ClusterConfig) -> int:
    from rose.hub import ModelSpecError

    cluster = Cluster(config)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"trellis up: preparing model {config.model} ...", flush=True)
        try:
            cluster.start()
        except ModelSpecError as exc:
            print(f"trellis up: {exc}", file=sys.stderr, flush=True)
            return 2
        print(
            f"trellis up: {config.replicas} Tulip replica(s) x {config.threads()} thread(s) "
            f"at {', '.join(cluster.replica_addresses)}; Ivy on {cluster.base_url}",
            flush=True,
        )
        if config.oversubscribed():
            print(
                f"trellis up: warning: {config.replicas} x {config.threads()} threads on "
                f"{_cores()} cores; replicas sharing cores stall each other's passes under "
                "load (leave --threads-per-replica at 0 to divide the cores)",
                file=sys.stderr,
                flush=True,
            )
        failure: list[BaseException] = []

        def wait() -> None:
            try:
                cluster.wait_ready()
            except BaseException as exc:  # noqa: BLE001 - reported below
                failure.append(exc)

        ready = threading.Thread(target=wait, daemon=True)
        ready.start()
        while ready.is_alive() and not stop.is_set():
            ready.join(0.2)
        if stop.is_set():
            print("trellis up: interrupted, stopping", flush=True)
            return 130
        if failure:
            print(f"trellis up: {failure[0]}", file=sys.stderr, flush=True)
            return 1
        print(_examples(cluster.base_url, cluster.name, cluster.directory), flush=True)
        while not stop.is_set():
            if cluster.ivy is not None and cluster.ivy.poll() is not None:
                print(f"trellis up: Ivy exited ({cluster.ivy.returncode}); stopping", flush=True)
                return 1
            for i, proc in enumerate(cluster.tulips):
                if proc.poll() is not None and not stop.is_set():
                    # Ivy routes around it meanwhile and picks it up again once healthy.
                    print(
                        f"trellis up: replica {cluster.replica_addresses[i]} exited "
                        f"({proc.returncode}); restarting it",
                        flush=True,
                    )
                    cluster.start_replica(i)
            stop.wait(0.5)
        print("trellis up: draining and stopping ...", flush=True)
        return 0
    finally:
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("trellis up: stopped", flush=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # No abbreviations: --threads is Tulip's (and refused), not --threads-per-replica.
    parser = subparsers.add_parser(
        "up", help="start a local cluster (Tulip replicas + Ivy)", allow_abbrev=False
    )
    parser.add_argument(
        "--model",
        default=_DEFAULT_MODEL,
        help="model directory, asset name or Hub id owner/name[@revision]",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=ClusterConfig.replicas,
        help=f"Tulip processes (default {ClusterConfig.replicas})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Ivy's listen address")
    parser.add_argument("--port", type=int, default=8000, help="Ivy's port (default 8000)")
    parser.add_argument(
        "--threads-per-replica",
        type=int,
        default=0,
        help="0: the cores divided among the replicas (default)",
    )
    parser.add_argument("--ivy-workers", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=ClusterConfig.chunk_tokens)
    parser.epilog = (
        "Other options go to every Tulip replica as given, e.g. --spec ngram, --spec mtp "
        "--mtp-head DIR, --dtype bfloat16 (see python -m tulip --help); trellis up sets "
        f"{', '.join(_SET_BY_UP)} itself."
    )
    parser.set_defaults(handler=main, forwards_unknown=True)


# Tulip flags `trellis up` chooses per replica: a forwarded one would contradict them.
_SET_BY_UP = (
    "--model",
    "--model-name",
    "--host",
    "--port",
    "--metrics-port",
    "--device",
    "--threads",
    "--drain-seconds",
)


def tulip_flags(forwarded: Sequence[str], model: str) -> tuple[str, ...]:
    """``forwarded`` once Tulip's own parser and checks accept it for ``model`` (`ValueError`
    if not; e.g. ``--spec mtp`` needs ``--mtp-head`` unless a head ships for the model)."""
    from tulip.config import ConfigError, TulipConfig

    for arg in forwarded:
        flag = arg.partition("=")[0]
        if flag in _SET_BY_UP:
            raise ValueError(f"{flag} is set by trellis up for each replica")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            TulipConfig.from_args(["--model", model, *forwarded], environ={})
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    except SystemExit:  # argparse's usage, then "error: unrecognized arguments: ..."
        error = said.getvalue().strip().splitlines()[-1].partition("error: ")[2]
        raise ValueError(f"{error} (neither trellis up's nor Tulip's options)") from None
    return tuple(forwarded)


def main(args: argparse.Namespace) -> int:
    try:
        config = ClusterConfig(
            model=args.model,
            replicas=args.replicas,
            host=args.host,
            port=args.port,
            threads_per_replica=args.threads_per_replica,
            ivy_workers=args.ivy_workers,
            chunk_tokens=args.chunk_tokens,
            tulip_args=tulip_flags(args.forwarded, args.model),
        )
    except ValueError as exc:
        print(f"trellis up: {exc}", file=sys.stderr)
        return 2
    return run(config)
