"""Replicas of one served model: a shared gRPC channel each, health watched through
`grpc.health.v1`, and the least-outstanding-tokens / power-of-two-choices pick.

A pool's membership comes from a static address list or a DNS name (a Kubernetes
headless Service) re-resolved periodically; replicas that vanish are closed after a grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ivy.calls import CallMux
from ivy.metrics import Metrics
from protos.grpc_options import CLIENT_OPTIONS
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["SATURATED_SECONDS", "Replica", "ReplicaPool"]

_CHANNEL_OPTIONS = (
    # Message size and keepalive, as Tulip's server expects them (protos/grpc_options.py).
    *CLIENT_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # One HTTP/2 connection per replica carries every request of this worker.
    ("grpc.use_local_subchannel_pool", 1),
)
# After a call fails with UNAVAILABLE (or the replica stalls while another answers) the
# replica is avoided this long while another serving replica can take the work.
_SUSPECT_SECONDS = 1.0
# After a replica refuses work for capacity, new requests avoid it this long; when every
# healthy replica of a pool is refusing, Ivy sheds new requests before tokenizing them.
SATURATED_SECONDS = 0.25
# Weight of the newest answer in a replica's seconds-per-token average (hedging, admission).
# The replica's own start-up measurement counts as one answer of _SEED_TOKENS tokens.
_LATENCY_WEIGHT = 0.2
_SEED_TOKENS = 1024
_HEALTH_SERVICES = ("", "trellis.v1.Inference")


class Replica:
    """One Tulip process: channel, stubs and routing state (owned by the event loop)."""

    def __init__(self, model: str, address: str, metrics: Metrics) -> None:
        self.model = model
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.calls = CallMux(self.stub)  # Embed/Score chunks, on one stream
        self.outstanding_tokens = 0
        self.watched_serving = False
        self.suspect_until = 0.0
        self.saturated_until = 0.0
        # Wall seconds per token of this worker's answered chunks (queue + inference +
        # transport): exponentially decayed sums of seconds over tokens, so big chunks
        # weigh more than small ones; None until the first answer.
        self.seconds_per_token: float | None = None
        self._observed_seconds = self._observed_tokens = 0.0
        self.info: pb.InfoResponse | None = None
        self._metrics = metrics
        self._labels = {"model": model, "replica": address}
        # Label children bound once: the per-chunk path only sets and increments.
        self._outstanding = metrics.replica_outstanding_tokens.labels(**self._labels)
        self._tokens = metrics.replica_tokens.labels(**self._labels)
        self._chunks: dict[str, Any] = {}
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def suspect(self) -> bool:
        return time.monotonic() < self.suspect_until

    @property
    def healthy(self) -> bool:
        """Serving and not suspect: a replica work goes to first."""
        return self.watched_serving and not self.suspect

    @property
    def saturated(self) -> bool:
        return time.monotonic() < self.saturated_until

    def mark_suspect(self) -> None:
        """The replica failed in a way only it can cause (its stream broke, it is stopping,
        or it stalled while another replica answered): route around it for a while, as
        long as another serving replica can take the work (`ReplicaPool.pick`)."""
        self.suspect_until = time.monotonic() + _SUSPECT_SECONDS

    def mark_saturated(self) -> None:
        """The replica refused work for capacity (RESOURCE_EXHAUSTED)."""
        self.saturated_until = time.monotonic() + SATURATED_SECONDS

    def observe(self, tokens: int, seconds: float) -> None:
        """An answered chunk of `tokens` took `seconds` from send to answer (queueing
        included, so the rate grows as the replica gets busier)."""
        keep = 1.0 - _LATENCY_WEIGHT
        self._observed_seconds = keep * self._observed_seconds + seconds
        self._observed_tokens = keep * self._observed_tokens + max(1, tokens)
        self.seconds_per_token = self._observed_seconds / self._observed_tokens

    def acquire(self, tokens: int) -> None:
        self.outstanding_tokens += tokens
        self._outstanding.set(self.outstanding_tokens)

    def release(self, tokens: int, outcome: str) -> None:
        self.outstanding_tokens -= tokens
        self._outstanding.set(self.outstanding_tokens)
        chunks = self._chunks.get(outcome)
        if chunks is None:
            chunks = self._chunks[outcome] = self._metrics.replica_chunks.labels(
                outcome=outcome, **self._labels
            )
        chunks.inc()
        if outcome == "OK":
            self._tokens.inc(tokens)

    def _learn(self, info: pb.InfoResponse) -> None:
        """Take the replica's description; its start-up speed seeds the per-token rate."""
        self.info = info
        if info.seconds_per_token > 0 and self.seconds_per_token is None:
            self.observe(_SEED_TOKENS, _SEED_TOKENS * info.seconds_per_token)

    def _set_serving(self, serving: bool) -> None:
        self.watched_serving = serving
        self._metrics.replica_healthy.labels(**self._labels).set(1 if self.healthy else 0)

    def start(self, on_info: Callable[[Replica], None], retry_seconds: float) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(
            self._watch(on_info, retry_seconds), name=f"ivy-health-{self.address}"
        )

    async def _watch(self, on_info: Callable[[Replica], None], retry_seconds: float) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        service_index = 0
        # The last watch delivered a status: when it breaks, watch again at once (unless
        # it broke within `retry_seconds` of being opened: no tight loop on a flapping one).
        rewatch = False
        while True:
            service = _HEALTH_SERVICES[service_index]
            opened = time.monotonic()
            try:
                call = health.Watch(health_pb2.HealthCheckRequest(service=service))
                async for status in call:
                    rewatch = True
                    if status.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                        service_index = (service_index + 1) % len(_HEALTH_SERVICES)
                        self._set_serving(False)
                        rewatch = False
                        call.cancel()
                        break
                    serving = status.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and self.info is None:
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            self._learn(await self.stub.Info(pb.InfoRequest(), timeout=5.0))
                            on_info(self)
                        if self.info is None:  # serving but not answering: watch again later
                            self._set_serving(False)
                            rewatch = False
                            call.cancel()
                            break
                    self._set_serving(serving)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    # No streaming health: fall back to polling Check.
                    await self._poll(health, service, on_info, retry_seconds)
                    return
                if rewatch and time.monotonic() - opened >= retry_seconds:
                    # A watch that was up broke (a reset connection, a GOAWAY): the replica
                    # is likely alive, so watch again at once and keep its state meanwhile;
                    # only a watch that cannot be opened again says it is gone.
                    rewatch = False
                    continue
                rewatch = False
                self._set_serving(False)
            await asyncio.sleep(retry_seconds)

    async def _poll(
        self,
        health: health_pb2_grpc.HealthStub,
        service: str,
        on_info: Callable[[Replica], None],
        interval: float,
    ) -> None:
        while True:
            try:
                status = await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=interval * 2
                )
                serving = status.status == health_pb2.HealthCheckResponse.SERVING
                if serving and self.info is None:
                    self._learn(await self.stub.Info(pb.InfoRequest(), timeout=5.0))
                    on_info(self)
                self._set_serving(serving and self.info is not None)
            except grpc.aio.AioRpcError:
                self._set_serving(False)
            await asyncio.sleep(interval)

    async def close(self, grace: float | None = None) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        self._metrics.replica_healthy.labels(**self._labels).set(0)
        await self.calls.close(grace)
        await self.channel.close(grace)


class ReplicaPool:
    """The replicas serving one model name."""

    def __init__(
        self,
        model: str,
        metrics: Metrics,
        on_info: Callable[[Replica], None],
        health_retry_seconds: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self.model = model
        self.replicas: dict[str, Replica] = {}
        # Tokens of admitted multi-chunk requests not answered yet (this worker's).
        self.committed_tokens = 0
        self._metrics = metrics
        self._on_info = on_info
        self._retry = health_retry_seconds
        self._rng = rng or random.Random()
        self._dns_task: asyncio.Task[None] | None = None

    def set_addresses(self, addresses: Iterable[str]) -> list[Awaitable[None]]:
        """Add new addresses and drop vanished ones; returns the closes to await."""
        wanted = set(addresses)
        closes: list[Awaitable[None]] = []
        for address in list(self.replicas):
            if address not in wanted:
                closes.append(self.replicas.pop(address).close(grace=5.0))
        for address in sorted(wanted - set(self.replicas)):
            replica = Replica(self.model, address, self._metrics)
            self.replicas[address] = replica
            replica.start(self._on_info, self._retry)
        return closes

    def start_dns(self, target: str, refresh_seconds: float) -> None:
        host, _, port = target.rpartition(":")
        self._dns_task = asyncio.get_running_loop().create_task(
            self._resolve_forever(host, int(port), refresh_seconds), name=f"ivy-dns-{target}"
        )

    async def _resolve_forever(self, host: str, port: int, refresh_seconds: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                infos = None  # keep the current set on a failed lookup
            if infos is not None:
                addresses = {
                    f"[{info[4][0]}]:{port}"
                    if info[0] == socket.AF_INET6
                    else f"{info[4][0]}:{port}"
                    for info in infos
                }
                for close in self.set_addresses(addresses):
                    loop.create_task(close)  # type: ignore[arg-type]
            await asyncio.sleep(refresh_seconds)

    def healthy(self) -> list[Replica]:
        """The replicas health says are serving, suspect ones included: a suspect replica is
        only routed around while another can take its work (`pick`), so it still counts
        for readiness, admission and capacity. One stalled or failed call must not take a
        live replica out of service: were every replica suspect at once (two hedges won in
        opposite directions, a broken stream on each), the pool would refuse everything
        with 503 while every replica is alive."""
        return [r for r in self.replicas.values() if r.watched_serving]

    def seconds_per_token(self) -> float | None:
        """The healthy replicas' mean wall seconds per token lately (None: no answer yet)."""
        rates = [r.seconds_per_token for r in self.healthy() if r.seconds_per_token is not None]
        return sum(rates) / len(rates) if rates else None

    def saturated(self) -> bool:
        """Every serving replica refused work for capacity just now (none is serving:
        False, so the request gets the "no healthy replica" answer instead)."""
        healthy = self.healthy()
        return bool(healthy) and all(r.saturated for r in healthy)

    def pick(
        self,
        exclude: set[Replica] | frozenset[Replica] = frozenset(),
        *,
        unsaturated: bool = False,
    ) -> Replica | None:
        """Least outstanding tokens among two random serving replicas, preferring those not
        suspect, then those that did not just refuse work. With `unsaturated` (a hedge, which
        is optional work) only a replica neither suspect nor refusing will do; otherwise a
        suspect replica is used when no other is left, rather than refusing the call."""
        candidates = [r for r in self.replicas.values() if r.watched_serving and r not in exclude]
        trusted = [r for r in candidates if not r.suspect]
        if trusted or unsaturated:
            candidates = trusted
        free = [r for r in candidates if not r.saturated]
        if free or unsaturated:
            candidates = free
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.outstanding_tokens <= b.outstanding_tokens else b

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        await asyncio.gather(*(r.close() for r in self.replicas.values()))
        self.replicas.clear()
