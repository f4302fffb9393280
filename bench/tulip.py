"""Tulip: what a gRPC round trip adds over calling ROSE in-process, and throughput by
concurrency.

    python -m bench tulip [--seconds=S] [--threads=N] [--model=NAME_OR_DIR]

(`python -m bench` passes only the arguments that start with "-", so write `--flag=value`.)

Cases are data, each with its expected answer: every gRPC response is compared with the
in-process engine's output for the same inputs, so a fast but wrong run fails. In-process
and gRPC samples are taken alternately (A, B, A, B, ...) so that load from other jobs on
the machine hits both sides alike. Results (p50/p99, ratios, versions, machine notes) go to
bench/results/tulip.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.report import machine, percentile
from tulip.client import TulipClient
from tulip.process import TulipProcess

if TYPE_CHECKING:
    from rose import ModelInfo

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results" / "tulip.md"
ATOL = 1e-4
MAX_SAMPLES = 200


@dataclass(frozen=True)
class Shape:
    """A request of `rows` inputs of `tokens` tokens each."""

    name: str
    rows: int
    tokens: int


LATENCY_CASES = (Shape("1 row x 16 tokens", 1, 16), Shape("32 rows x 512 tokens", 32, 512))
THROUGHPUT_REQUEST = Shape("1 row x 64 tokens, a query", 1, 64)
CONCURRENCY = (1, 4, 16)


@dataclass
class Samples:
    seconds: list[float] = field(default_factory=list)

    def p(self, q: float) -> float:
        return percentile(self.seconds, q)


@dataclass
class Latency:
    """Alternating samples of one request shape."""

    local: Samples = field(default_factory=Samples)
    remote: Samples = field(default_factory=Samples)
    overhead: Samples = field(default_factory=Samples)
    """Per gRPC request: client wall time minus the engine time the server reports."""


@dataclass(frozen=True)
class Throughput:
    clients: int
    requests_per_s: float
    latency: Samples
    requests_per_batch: float


def _rows(shape: Shape, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [0, *(rng.randrange(5, vocab - 1) for _ in range(shape.tokens - 2)), 2]
        for _ in range(shape.rows)
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


async def _latency(
    target: str,
    in_process: Callable[[list[list[int]]], np.ndarray],
    rows: list[list[int]],
    expected: np.ndarray,
    budget: float,
) -> Latency:
    result = Latency()
    async with TulipClient(target) as client:
        await client.embed(rows)  # connect and warm this shape up on both sides
        began = time.perf_counter()
        while len(result.remote.seconds) < MAX_SAMPLES and (
            len(result.remote.seconds) < 3 or time.perf_counter() - began < budget
        ):
            start = time.perf_counter()
            in_process(rows)
            result.local.seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            answer = await client.embed(rows)
            wall = time.perf_counter() - start
            result.remote.seconds.append(wall)
            result.overhead.seconds.append(wall - answer.inference_us / 1e6)
            if not np.allclose(answer.embeddings, expected, atol=ATOL):
                raise AssertionError(f"gRPC answer for {len(rows)} rows differs from ROSE")
    return result


async def _closed_loop(
    target: str,
    rows: list[list[int]],
    expected: np.ndarray,
    stop_at: float,
    latencies: list[float],
) -> None:
    """One client with one request in flight until `stop_at`; raises on a wrong answer."""
    async with TulipClient(target) as client:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            result = await client.embed(rows)
            latencies.append(time.perf_counter() - start)
            if not np.allclose(result.embeddings, expected, atol=ATOL):
                raise AssertionError("concurrent answer differs from ROSE in-process")


async def _throughput(
    server: TulipProcess, rows: list[list[int]], expected: np.ndarray, clients: int, budget: float
) -> Throughput:
    before = server.metrics()
    latencies: list[float] = []
    began = time.perf_counter()
    await asyncio.gather(
        *(
            _closed_loop(server.target, rows, expected, began + budget, latencies)
            for _ in range(clients)
        )
    )
    elapsed = time.perf_counter() - began
    after = server.metrics()
    total, count = ("tulip_batch_requests_sum", ()), ("tulip_batch_requests_count", ())
    batches = after[count] - before.get(count, 0.0)
    per_batch = (after[total] - before.get(total, 0.0)) / max(batches, 1.0)
    return Throughput(clients, len(latencies) / elapsed, Samples(latencies), per_batch)


def _report(
    info: ModelInfo,
    budget: float,
    threads: int,
    latency: dict[Shape, Latency],
    throughput: list[Throughput],
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    import torch

    lines = [
        "# Tulip benchmark",
        "",
        f"Model `{info.name}` ({info.kind}, {info.dimensions}-d) on `{info.device}` "
        f"({info.dtype}); client, server and in-process engine on one "
        f"machine, gRPC over loopback. Up to {budget:g} s per case (at least 3 samples). "
        f"Every gRPC answer is checked against the in-process engine (atol {ATOL:g}).",
        "",
        "## Round trip vs in-process",
        "",
        "In-process = `engine.step(RaggedBatch.from_lists(rows)).wait()` in the client's "
        "process; gRPC = `TulipClient.embed(rows)` wall time (pack, send, admit, queue, "
        "engine, pack, receive, unpack). Samples alternate between the two. *Added* = gRPC "
        "p50 − in-process p50; *overhead* = per request, gRPC wall time − the engine time "
        "the server reports in `Timing.inference_us` (so it does not depend on how fast the "
        "engine happened to run).",
        "",
        "| request | samples | in-process p50 / p99 ms | gRPC p50 / p99 ms | added p50 ms "
        "| gRPC / in-process | overhead p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, result in latency.items():
        local, remote, extra = result.local, result.remote, result.overhead
        lines.append(
            f"| {shape.name} | {len(remote.seconds)} | {_ms(local.p(50))} / {_ms(local.p(99))} "
            f"| {_ms(remote.p(50))} / {_ms(remote.p(99))} | {_ms(remote.p(50) - local.p(50))} "
            f"| {remote.p(50) / local.p(50):.2f}x | {_ms(extra.p(50))} / {_ms(extra.p(99))} |"
        )
    base = throughput[0].requests_per_s
    lines += [
        "",
        f"## Throughput by concurrency ({THROUGHPUT_REQUEST.name})",
        "",
        "Each client keeps one request in flight on its own channel for the time budget. "
        "Requests per batch come from the server's `tulip_batch_requests` histogram.",
        "",
        "| clients | requests | req/s | tokens/s | p50 ms | p99 ms | requests/batch | vs 1 client |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in throughput:
        lines.append(
            f"| {row.clients} | {len(row.latency.seconds)} | {row.requests_per_s:.1f} | "
            f"{row.requests_per_s * THROUGHPUT_REQUEST.tokens:.0f} | {_ms(row.latency.p(50))} | "
            f"{_ms(row.latency.p(99))} | {row.requests_per_batch:.2f} | "
            f"{row.requests_per_s / base:.2f}x |"
        )
    (b1, b5, b15), (a1, a5, a15) = load
    lines += [
        "",
        "## Machine and versions",
        "",
        f"- CPU: {machine()}; torch intra-op threads {threads} in the "
        "benchmark process and in the server (`--threads`)",
        f"- load average (1/5/15 min): {b1:.1f}/{b5:.1f}/{b15:.1f} at start, "
        f"{a1:.1f}/{a5:.1f}/{a15:.1f} at end. Other jobs share this machine, so absolute "
        "times are noisy; the alternating samples keep the two columns comparable.",
        f"- Python {platform.python_version()}, torch {torch.__version__}, grpcio "
        f"{version('grpcio')}, protobuf {version('protobuf')}, numpy {np.__version__}",
        f"- {platform.platform()}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench tulip")
    parser.add_argument("--model", default="multilingual-e5-small")
    parser.add_argument("--seconds", type=float, default=15.0, help="time budget per case")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    import torch

    from rose import Engine, EngineConfig, RaggedBatch
    from tulip.backend import resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    load_before = os.getloadavg()
    engine = Engine.load(model_dir, EngineConfig(device="cpu"))
    vocab = engine.info.vocab_size

    def in_process(rows: list[list[int]]) -> np.ndarray:
        return engine.step(RaggedBatch.from_lists(rows)).wait().numpy()

    cases = {shape: _rows(shape, seed, vocab) for seed, shape in enumerate(LATENCY_CASES)}
    query = _rows(THROUGHPUT_REQUEST, 99, vocab)
    expected_query = in_process(query)
    server_args = ["--model", str(model_dir), "--device", "cpu", "--threads", str(args.threads)]
    server_args += ["--max-batch-tokens", "16384", "--max-batch-rows", "256"]
    with TulipProcess(server_args) as server:
        server.wait_serving()

        async def measure() -> tuple[dict[Shape, Latency], list[Throughput]]:
            latency: dict[Shape, Latency] = {}
            for shape, rows in cases.items():
                expected = in_process(rows)
                latency[shape] = await _latency(
                    server.target, in_process, rows, expected, args.seconds
                )
                print(f"{shape.name}: gRPC p50 {_ms(latency[shape].remote.p(50))} ms", flush=True)
            throughput = []
            for clients in CONCURRENCY:
                row = await _throughput(server, query, expected_query, clients, args.seconds)
                print(f"{clients} clients: {row.requests_per_s:.1f} req/s", flush=True)
                throughput.append(row)
            return latency, throughput

        latency, throughput = asyncio.run(measure())
    report = _report(
        engine.info,
        args.seconds,
        args.threads,
        latency,
        throughput,
        (load_before, os.getloadavg()),
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)
    print(f"wrote {RESULTS}")
    return 0
