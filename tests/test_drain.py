"""SIGTERM under load, with real processes on loopback: two Tulip replicas serving
multilingual-e5-small behind Ivy, and client threads posting /v1/embeddings meanwhile.

Each test runs one Ivy (a single worker, then a supervisor with two) and a rolling stop:

1. SIGTERM to one Tulip while the clients keep sending: the work it admitted completes,
   what it refuses while draining (or after it has gone) Ivy retries on the other replica,
   so every request answers 200, and the Tulip exits 0. (The next test starts it again on
   the same port, as a replaced pod keeps its name.)
2. SIGTERM to Ivy: the clients stop sending first, as they do once an orchestrator has taken
   the pod out of its Service (the preStop sleep of the manifests), so SIGTERM arrives while
   the last requests are still being computed. Every one of them answers 200, the port stops
   taking connections, and Ivy exits 0.

A 429 (every replica at capacity) is backpressure, not a dropped request: the clients send
it again, as OpenAI's client does, and it never counts as a failure here. Anything else (a
5xx, a 503, a reset connection) does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from tulip.process import TulipProcess, free_port, scrape_metrics

pytestmark = pytest.mark.timeout(600)

MODEL = "multilingual-e5-small"
CLIENTS = 4  # a bounded load that keeps both replicas busy on a small shared machine
INPUTS = 16  # texts per request while the load runs (about 800 tokens)
LAST_INPUTS = 64  # the requests in flight when Ivy gets SIGTERM: long enough to still run
REQUEST_TIMEOUT_S = 30.0  # Ivy's own limits here; its drain is the longer of two + 5 s
TULIP_DRAIN_S = 30.0
START_TIMEOUT_S = 240.0  # a busy shared machine loads slowly
_WORDS = "the quick brown fox jumps over the lazy dog near a quiet river bank".split()


def _body(inputs: int) -> bytes:
    texts = [" ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(40)) for i in range(inputs)]
    return orjson.dumps({"model": MODEL, "input": texts, "input_type": "search_document"})


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    status: int | str  # the HTTP status, or the name of the transport error
    detail: str = ""  # the start of an error's body


class Load:
    """``CLIENTS`` threads posting embeddings requests back to back until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.inputs = INPUTS
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._sent_last = threading.Semaphore(0)
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def _client(self) -> None:
        headers = {"Content-Type": "application/json"}
        with httpx.Client(timeout=120.0) as client:
            while not self.stopping.is_set():
                inputs = self.inputs
                if inputs == LAST_INPUTS:
                    self._sent_last.release()  # announced just before it goes out
                started = time.monotonic()
                status: int | str
                detail = ""
                try:
                    reply = client.post(self.url, content=_body(inputs), headers=headers)
                    status = reply.status_code
                    if status != 200:
                        detail = reply.text[:200]
                    elif len(reply.json()["data"]) != inputs:
                        status = "short answer"
                except httpx.HTTPError as error:
                    status, detail = type(error).__name__, str(error)[:200]
                with self._lock:
                    self.outcomes.append(Outcome(started, time.monotonic(), status, detail))
                if inputs == LAST_INPUTS:
                    return  # answered, refused or not: nothing more after the last round
                if status == 429:
                    time.sleep(0.1)  # back off, then send it again

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def last_round(self) -> None:
        """Every client sends one long request and then stops; returns once all are sent
        (the pod has left the Service: nothing new arrives after these)."""
        self.inputs = LAST_INPUTS
        for _ in self._threads:
            assert self._sent_last.acquire(timeout=120), "a client is stuck"

    def stop(self) -> list[Outcome]:
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a client is stuck"
        return list(self.outcomes)

    def answered(self) -> int:
        """Requests answered 200 so far."""
        with self._lock:
            return sum(o.status == 200 for o in self.outcomes)

    def wait_for(self, answers: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.answered() < answers:
            assert time.monotonic() < deadline, f"only {self.answered()} answers in {timeout}s"
            time.sleep(0.05)


def _failures(outcomes: list[Outcome]) -> list[tuple[int | str, str]]:
    """Requests that got neither their embeddings nor a capacity refusal to retry."""
    return [(o.status, o.detail) for o in outcomes if o.status not in (200, 429)]


@pytest.fixture(scope="module")
def tulips(e5_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TulipProcess]]:
    logs = tmp_path_factory.mktemp("drain-logs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    args = ["--model", str(e5_dir), "--model-name", MODEL, "--device", "cpu", "--threads", "1"]
    args += ["--drain-seconds", str(TULIP_DRAIN_S)]
    replicas = [
        TulipProcess(args, log_path=logs / f"tulip-{i}.log", env=env).start() for i in range(2)
    ]
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop(timeout=TULIP_DRAIN_S + 15)


class Ivy:
    """``python -m ivy`` in front of the Tulips, on a free loopback port."""

    def __init__(self, e5_dir: Path, tulips: list[TulipProcess], workers: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = log
        argv = [sys.executable, "-m", "ivy", "--host", "127.0.0.1"]
        argv += ["--port", self.base.rpartition(":")[2], "--workers", str(workers)]
        argv += ["--model", f"{MODEL}={e5_dir}"]
        argv += ["--replicas", f"{MODEL}={','.join(t.target for t in tulips)}"]
        argv += ["--request-timeout-seconds", str(REQUEST_TIMEOUT_S)]
        argv += ["--generation-timeout-seconds", str(REQUEST_TIMEOUT_S)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.drain_s = REQUEST_TIMEOUT_S + 5.0

    def wait_ready(self, replicas: int) -> None:
        """Until /health/ready counts ``replicas`` healthy replicas several times running
        (with a supervisor each answer comes from one of the workers)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        streak = 0
        while streak < 4:
            assert self.proc.poll() is None, f"ivy exited {self.proc.returncode}\n{self.tail()}"
            assert time.monotonic() < deadline, f"ivy not ready\n{self.tail()}"
            try:
                reply = httpx.get(f"{self.base}/health/ready", timeout=2.0)
                ok = reply.status_code == 200
                streak = (
                    streak + 1 if ok and reply.json()["healthy_replicas"][MODEL] == replicas else 0
                )
            except httpx.HTTPError:
                streak = 0
            time.sleep(0.1)

    def outstanding(self, replica: TulipProcess) -> bool:
        """Whether (one worker of) Ivy has work at ``replica`` that it has not answered."""
        samples = scrape_metrics(f"{self.base}/metrics", timeout=5.0)
        labels = (("model", MODEL), ("replica", replica.target))
        return samples.get(("ivy_replica_outstanding_tokens", labels), 0.0) > 0

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.mark.parametrize(
    ("workers", "stopped"), [(1, 0), (2, 1)], ids=["one-ivy-worker", "ivy-supervisor"]
)
def test_sigterm_under_load_drops_nothing_and_exits_zero(
    e5_dir: Path, tulips: list[TulipProcess], tmp_path: Path, workers: int, stopped: int
) -> None:
    for replica in tulips:
        if replica.poll() is not None:  # stopped by the previous test
            replica.start()
        replica.wait_serving(START_TIMEOUT_S)
    ivy = Ivy(e5_dir, tulips, workers, tmp_path / "ivy.log")
    replica = tulips[stopped]
    load: Load | None = None
    try:
        ivy.wait_ready(replicas=2)
        load = Load(f"{ivy.base}/v1/embeddings").start()
        load.wait_for(CLIENTS)

        # 1. A Tulip, while it holds admitted work and the clients keep sending.
        deadline = time.monotonic() + 60
        while not ivy.outstanding(replica):
            assert time.monotonic() < deadline, "the replica never had work in flight"
            time.sleep(0.02)
        tulip_sigterm = time.monotonic()
        tulip_code = replica.stop(timeout=TULIP_DRAIN_S + 15)  # SIGTERM, wait (SIGKILL late)
        tulip_exited = time.monotonic()
        load.wait_for(load.answered() + CLIENTS)  # the other replica serves everything

        # 2. Ivy, once the clients have sent their last (long) requests.
        load.last_round()
        time.sleep(0.2)  # Ivy has read them
        ivy_sigterm = time.monotonic()
        ivy.proc.send_signal(signal.SIGTERM)
        outcomes = load.stop()
        ivy_code = ivy.proc.wait(timeout=ivy.drain_s + 15)
        ivy_exited = time.monotonic()
    finally:
        if load is not None:
            load.stopping.set()
        if ivy.proc.poll() is None:
            ivy.proc.kill()
            ivy.proc.wait()

    assert _failures(outcomes) == [], ivy.tail()
    assert tulip_code == 0, f"tulip exited {tulip_code}\n{replica.log_tail()}"
    assert any(
        o.status == 200 and o.started > tulip_sigterm and o.ended < tulip_exited for o in outcomes
    ), "no request was served while the replica drained"
    in_flight = [o for o in outcomes if o.ended > ivy_sigterm]
    assert any(o.status == 200 for o in in_flight), "no request was in flight at Ivy's SIGTERM"
    assert ivy_code == 0, f"ivy exited {ivy_code} after a clean drain\n{ivy.tail()}"
    assert ivy_exited - ivy_sigterm < ivy.drain_s
    # Gone means gone: the port refuses new connections.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{ivy.base}/health/live", timeout=2.0)
