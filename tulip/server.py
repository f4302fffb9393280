"""One Tulip process: gRPC + health + metrics around one engine, with a graceful drain.

Life of the process:

1. metrics endpoint and gRPC server start; health says NOT_SERVING;
2. the model loads (on a thread of its own, which ends: `_on_a_thread_that_ends`) and runs
   a warm-up batch; health says SERVING. An encoder (embedding / cross-encoder) is served
   through the batching `Scheduler`; a decoder (Llama, Qwen2, Qwen3 causal LMs:
   `tulip.generation.is_generator`, or ``--runner generate``) through `GenerationBackend`;
3. on SIGTERM/SIGINT health says NOT_SERVING, new work is refused (UNAVAILABLE), queued
   and in-flight work completes within ``drain_seconds``; the process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from protos.grpc_options import SERVER_OPTIONS
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from rose.hub import resolve_model
from tulip.backend import RoseBackend
from tulip.config import ConfigError, TulipConfig
from tulip.generation import GenerationBackend, is_generator
from tulip.metrics import Metrics
from tulip.scheduler import BatchLimits, Scheduler
from tulip.service import InferenceService

__all__ = ["SERVICE_NAME", "load_backend", "serve"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_FLUSH_SECONDS = 2.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger("tulip")

_T = TypeVar("_T")


def _on_a_thread_that_ends(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` on a new thread, returning (or raising) once that thread has ended.

    Why: loading runs torch ops (weight packing, the int8 probe), and each thread that runs
    a parallel op becomes the master of a libgomp (OpenMP) thread team that lives as long
    as the thread. A loader's team kept alive beside the engine thread's puts more OpenMP
    threads in the process than it has CPUs, and libgomp then cuts its spin-wait before
    sleeping from ~300,000 turns to ~100: every parallel op of every pass wakes its workers
    from sleep. With 2 threads per replica on the 2-core machine a 128-token e5-small pass
    took 56-61 ms that way against 33-43 ms with one team (bench/results/serving-xeon.md).
    A thread that ends frees its team, so only the engine thread's is left."""
    # Leaving the block shuts the pool down, which joins its thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tulip-load") as pool:
        return pool.submit(fn, *args).result()


def load_backend(config: TulipConfig) -> RoseBackend | GenerationBackend:
    """Load `config.model` as a generator or an encoder (``--runner``, else by the model
    directory: `is_generator`); blocking."""
    model = resolve_model(config.model)  # a directory, an asset name or a Hub id
    model_dir = model.path
    config = dataclasses.replace(config, model_name=config.model_name or model.name)
    if is_generator(model_dir, config.runner):
        if config.quantize != "none":
            raise ConfigError(
                f"--quantize {config.quantize}: {model.name} is served for generation, and "
                "the int8 path covers encoders and cross-encoders only"
            )
        return GenerationBackend.load(config, model_dir)
    if config.spec != "none":
        raise ConfigError(
            f"--spec {config.spec}: {model.name} is served for pooling, not generation "
            "(--runner generate serves a causal LM as a generator)"
        )
    return RoseBackend.load(config, model)


async def serve(
    config: TulipConfig,
    load: Callable[[TulipConfig], RoseBackend | GenerationBackend] = load_backend,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain; returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    metrics = Metrics()
    endpoint = metrics.serve(config.host, config.metrics_port) if config.metrics_port else None
    health = health_aio.HealthServicer()
    await _set_health(health, _NOT_SERVING)
    service = InferenceService(metrics)
    # Message size and keepalive policy agree with the clients' (protos/grpc_options.py).
    server = grpc.aio.server(options=list(SERVER_OPTIONS))
    pb_grpc.add_InferenceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    log.info("tulip: gRPC on %s:%d, loading %s", config.host, port, config.model)

    backend: RoseBackend | GenerationBackend | None = None
    try:
        loading = asyncio.ensure_future(asyncio.to_thread(_on_a_thread_that_ends, load, config))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            log.info("tulip: stopped while loading")
            return 0
        stopping.cancel()
        backend = loading.result()
        started = time.monotonic()
        close_admission: Callable[[], None]
        drain: Callable[[float], Awaitable[bool]]
        if isinstance(backend, GenerationBackend):
            backend.start(metrics)
            await backend.warm_up()
            service.attach_generator(backend)
            close_admission, drain = backend.close_admission, backend.drain
        else:
            await backend.warm_up()
            scheduler = Scheduler(
                backend,
                BatchLimits(
                    max_batch_tokens=config.max_batch_tokens or backend.default_batch_tokens,
                    max_batch_rows=config.max_batch_rows,
                    max_queued_tokens=config.max_queued_tokens,
                    max_queue_seconds=config.max_queue_seconds or None,
                ),
                metrics,
            )
            await _measure_speed(backend, scheduler)
            scheduler.start()
            service.attach(backend, scheduler)
            close_admission, drain = scheduler.close, scheduler.drain
        log.info("tulip: warmed up in %.2fs", time.monotonic() - started)
        await _set_health(health, _SERVING)
        log.info("tulip: SERVING %s on port %d", backend.served.name, port)

        await stop.wait()
        deadline = time.monotonic() + config.drain_seconds
        log.info("tulip: draining (up to %.1fs)", config.drain_seconds)
        close_admission()  # refuse new work before anyone can observe NOT_SERVING
        await _set_health(health, _NOT_SERVING)
        drained = await drain(max(0.0, deadline - time.monotonic()))
        log.info("tulip: %s", "drained" if drained else "drain timed out")
        # Every admitted request is answered; give the handlers a moment to send their
        # responses, then close the remaining streams (health watchers never end on their own).
        await server.stop(grace=min(_FLUSH_SECONDS, max(0.1, deadline - time.monotonic())))
        return 0
    finally:
        await server.stop(grace=None)
        if backend is not None:
            backend.close()
        if endpoint is not None:
            endpoint.close()


# Batches timed before serving, as (rows, tokens per row), so admission by time knows the
# engine's speed from the first request on: two sizes give its fixed cost per batch and its
# cost per token.
_SPEED_PROBES = ((1, 64), (4, 128))


async def _measure_speed(backend: RoseBackend, scheduler: Scheduler) -> None:
    """Time a small and a larger synthetic batch and teach the scheduler."""
    for rows, length in _SPEED_PROBES:
        scheduler.observe_batch(*await backend.timed_batch(rows, length))
    backend.served.info.seconds_per_token = scheduler.seconds_per_token()


async def _set_health(health: health_aio.HealthServicer, status: int) -> None:
    await health.set("", status)
    await health.set(SERVICE_NAME, status)
