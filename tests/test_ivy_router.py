"""Routing around suspect replicas, without taking live replicas out of service, and the gRPC
keepalive policy Ivy's channels and Tulip's server share. Fast and deterministic: fake
replica calls, no network, no sleeping.

The failure these guard against (tests/test_overload.py, about once in ten runs): under
overload two hedged chunks were won in opposite directions within a second, each marking
the slower replica suspect; with both replicas suspect the pool had no "healthy" replica,
so admission let a small request through and `pick` found nobody: 503 "no healthy replica"
while both replicas were alive and serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

import ivy.replicas as replicas_module
from ivy.calls import CallFailed
from ivy.errors import OverloadedError, UnavailableError
from ivy.metrics import Metrics
from ivy.replicas import Replica, ReplicaPool
from ivy.router import Router
from protos import grpc_options
from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import pack_tensor

MODEL = "m"
DIMS = 4


class FakeCalls:
    """A replica's `CallMux` stand-in: answers every Embed at once with its own number."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.sent = 0

    async def embed(
        self, request: pb.EmbedRequest, timeout: float, admitted: bool = False
    ) -> pb.EmbedResponse:
        self.sent += 1
        rows = len(request.inputs.lengths)
        return pb.EmbedResponse(
            embeddings=pack_tensor(np.full((rows, DIMS), self.value, dtype=np.float32))
        )

    async def close(self, grace: float | None = None) -> None:
        pass


def run(make: Callable[[ReplicaPool, Router, list[Replica]], Awaitable[Any]]) -> Any:
    """Run `make(pool, router, replicas)` on a pool of two serving replicas."""

    async def main() -> Any:
        metrics = Metrics.create()
        pool = ReplicaPool(MODEL, metrics, on_info=lambda _r: None)
        replicas = []
        for i, address in enumerate(("127.0.0.1:1", "127.0.0.1:2")):
            replica = Replica(MODEL, address, metrics)  # its channel never connects
            replica.calls = FakeCalls(float(i + 1))  # type: ignore[assignment]
            replica.watched_serving = True
            pool.replicas[address] = replica
            replicas.append(replica)
        router = Router({MODEL: pool}, metrics, chunk_tokens=64)
        try:
            return await make(pool, router, replicas)
        finally:
            for replica in replicas:
                await replica.channel.close()

    return asyncio.run(main())


async def embed_rows(router: Router, rows: int, tokens: int) -> np.ndarray:
    """A request of `rows` inputs of `tokens` tokens each."""
    deadline = time.monotonic() + 10
    claim = router.admit(MODEL, deadline)
    with claim:
        out, _, _ = await router.embed(
            MODEL,
            np.ones(rows * tokens, dtype=np.int64),
            np.full(rows, tokens, dtype=np.int64),
            dimensions=0,
            deadline=deadline,
            claim=claim,
        )
    return out


async def embed_one(pool: ReplicaPool, router: Router) -> np.ndarray:
    return await embed_rows(router, 1, 3)


def test_a_pool_whose_replicas_are_all_suspect_still_routes() -> None:
    async def scenario(pool: ReplicaPool, router: Router, replicas: list[Replica]) -> None:
        for replica in replicas:
            replica.mark_suspect()  # e.g. two hedges won in opposite directions
        assert not any(r.healthy for r in replicas)  # neither is "healthy" for a while
        # Alive replicas stay in service: sent work (not a 503), counted, ready.
        rows = await embed_one(pool, router)
        assert rows.shape == (1, DIMS)
        assert sum(r.calls.sent for r in replicas) == 1  # type: ignore[attr-defined]
        assert pool.pick() in replicas
        assert len(pool.healthy()) == 2  # /health/ready's healthy_replicas
        assert not pool.saturated()

    run(scenario)


def test_a_suspect_replica_is_avoided_while_another_can_take_the_work() -> None:
    async def scenario(pool: ReplicaPool, router: Router, replicas: list[Replica]) -> None:
        a, b = replicas
        a.mark_suspect()
        for _ in range(20):
            assert pool.pick() is b
            assert (await embed_one(pool, router))[0, 0] == 2.0
        assert a.calls.sent == 0  # type: ignore[attr-defined]
        # ... also when the other one just refused for capacity (a quick refusal there
        # beats a possibly frozen suspect one; the retry then goes to the suspect one).
        b.mark_saturated()
        assert pool.pick() is b
        assert pool.pick(exclude={b}) is a
        # A hedge is optional work: never to a suspect (or refusing) replica.
        assert pool.pick(exclude={b}, unsaturated=True) is None
        # Not serving (health) is out, whatever else.
        a.watched_serving = False
        assert pool.pick(exclude={b}) is None
        assert len(pool.healthy()) == 1

    run(scenario)


def test_all_suspect_and_all_refusing_is_shed_with_429_not_503() -> None:
    async def scenario(pool: ReplicaPool, router: Router, replicas: list[Replica]) -> None:
        for replica in replicas:
            replica.mark_suspect()
            replica.mark_saturated()
        with pytest.raises(OverloadedError):
            router.admit(MODEL, time.monotonic() + 10)
        for replica in replicas:
            replica.watched_serving = False
        # Nothing serving at all: that, and only that, is "unavailable".
        router.admit(MODEL, time.monotonic() + 10)
        with pytest.raises(UnavailableError):
            await embed_one(pool, router)

    run(scenario)


class _Gone(FakeCalls):
    """A replica that dies (or is stopping) with the call: the stream broke under it."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(0.0)
        self.code = code

    async def embed(
        self, request: pb.EmbedRequest, timeout: float, admitted: bool = False
    ) -> pb.EmbedResponse:
        self.sent += 1
        raise CallFailed(self.code, "Calls stream broke")


class _QueueBound(FakeCalls):
    """A busy replica past its queue-time limit: refuses new work, queues admitted work
    (Tulip's `Scheduler.submit`)."""

    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.admitted: list[bool] = []

    async def embed(
        self, request: pb.EmbedRequest, timeout: float, admitted: bool = False
    ) -> pb.EmbedResponse:
        self.admitted.append(admitted)
        if not admitted:
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: about 2.0s ahead")
        return await super().embed(request, timeout, admitted)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_call_lost_with_its_replica_is_not_refused_by_the_survivors_queue_limit(
    code: grpc.StatusCode,
) -> None:
    """A replica killed under load: the calls it held are retried on the one left, which is
    busy past its queue-time limit. They were admitted work, so they travel as admitted
    and are answered, instead of turning a crash into 429s."""

    async def scenario(pool: ReplicaPool, router: Router, replicas: list[Replica]) -> None:
        a, b = replicas
        a.calls = _Gone(code)  # type: ignore[assignment]
        b.calls = survivor = _QueueBound(2.0)  # type: ignore[assignment]
        b.acquire(1000)  # a is the less loaded one: the request goes there first
        rows = await embed_one(pool, router)
        assert rows[0, 0] == 2.0
        assert a.calls.sent == 1  # type: ignore[attr-defined]
        assert survivor.admitted == [True]
        # A capacity refusal is not a loss: the retry is new work, refused alike (429).
        a.calls = _QueueBound(1.0)  # type: ignore[assignment]
        a.saturated_until = b.saturated_until = 0.0
        survivor.admitted.clear()
        with pytest.raises(OverloadedError):
            await embed_one(pool, router)
        assert a.calls.admitted == [False]  # type: ignore[attr-defined]
        assert survivor.admitted == [False]
        b.release(1000, "OK")

    run(scenario)


# ---- the health watch ----------------------------------------------------------------------
class _Broken(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeHealth:
    """Health stub stand-in: the first Watch says SERVING, then breaks as a GOAWAY
    "too_many_pings" does; the second says SERVING and stays open."""

    def __init__(self, _channel: object) -> None:
        self.watches = 0

    def Watch(self, _request: object) -> Any:  # noqa: N802 (gRPC's name)
        FakeHealth.instance = self
        self.watches += 1
        first = self.watches == 1

        async def stream() -> Any:
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            if first:
                raise _Broken(grpc.StatusCode.UNAVAILABLE, "Too many pings")
            FakeHealth.rewatched.set()
            await asyncio.Event().wait()  # open until cancelled

        return stream()

    instance: FakeHealth
    rewatched: asyncio.Event


def test_a_broken_health_watch_is_reopened_at_once_without_calling_the_replica_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replicas_module.health_pb2_grpc, "HealthStub", FakeHealth)

    async def main() -> list[bool]:
        FakeHealth.rewatched = asyncio.Event()
        replica = Replica(MODEL, "127.0.0.1:1", Metrics.create())
        replica.info = pb.InfoResponse()  # learned already: no Info call
        states: list[bool] = []
        set_serving = replica._set_serving

        def record(serving: bool) -> None:
            states.append(serving)
            set_serving(serving)

        replica._set_serving = record  # type: ignore[method-assign]
        # retry_seconds=0: the broken watch was up "long enough" to be reopened at once.
        replica.start(lambda _r: None, retry_seconds=0.0)
        await asyncio.wait_for(FakeHealth.rewatched.wait(), 5)
        await replica.close()
        return states

    states = asyncio.run(main())
    assert FakeHealth.instance.watches == 2
    assert False not in states, states  # never reported not serving in between


# ---- keepalive policy ----------------------------------------------------------------------
# gRPC core's server default (chttp2): pings closer than this while the server sends no
# data are strikes; a few of them → GOAWAY "too_many_pings".
_DEFAULT_MIN_RECV_PING_INTERVAL_MS = 300_000


def test_ivy_and_tulip_agree_on_grpc_keepalive() -> None:
    """Ivy pings every 10 s; a Tulip on gRPC's default policy (one ping per 5 min without
    data) answered an idle connection (only the health watch open) with GOAWAY
    "too_many_pings" after about 80 s, breaking the watch and the `Calls` stream of both
    replicas at once (their channels ping in step)."""
    import tulip.client
    import tulip.server

    client = dict(replicas_module._CHANNEL_OPTIONS)
    server = dict(grpc_options.SERVER_OPTIONS)
    assert tulip.server.SERVER_OPTIONS is grpc_options.SERVER_OPTIONS
    assert tulip.client.CLIENT_OPTIONS is grpc_options.CLIENT_OPTIONS
    for key, value in grpc_options.CLIENT_OPTIONS:
        assert client[key] == value, key  # Ivy's channels use the shared client options

    interval = client["grpc.keepalive_time_ms"]
    accepted = server.get(
        "grpc.http2.min_ping_interval_without_data_ms", _DEFAULT_MIN_RECV_PING_INTERVAL_MS
    )
    assert accepted < interval, (accepted, interval)  # with slack: timers jitter
    if client.get("grpc.keepalive_permit_without_calls", 0):
        assert server.get("grpc.keepalive_permit_without_calls", 0) == 1
    # Both ends accept the largest message the other may send.
    for key in ("grpc.max_receive_message_length", "grpc.max_send_message_length"):
        assert client[key] == server[key] == grpc_options.MAX_MESSAGE_BYTES


def test_a_lone_request_is_spread_over_the_idle_replicas() -> None:
    async def scenario(pool: ReplicaPool, router: Router, replicas: list[Replica]) -> None:
        router.chunk_tokens = 8192  # the default: one chunk would hold the whole request
        a, b = replicas
        # Unmeasured replicas: no basis for a split, one chunk.
        rows = await embed_rows(router, 4, 100)
        assert rows.shape == (4, DIMS)
        assert a.calls.sent + b.calls.sent == 1  # type: ignore[attr-defined]
        for replica in replicas:
            replica.observe(1000, 0.1)  # 0.1 ms per token: 400 tokens are 40 ms of work
            replica.calls.sent = 0  # type: ignore[attr-defined]
        # Both idle: two chunks of 200 tokens, one on each, rows back in input order.
        rows = await embed_rows(router, 4, 100)
        assert (a.calls.sent, b.calls.sent) == (1, 1)  # type: ignore[attr-defined]
        assert sorted(rows[:, 0].tolist()) == [1.0, 1.0, 2.0, 2.0]
        assert rows[0, 0] == rows[1, 0] and rows[2, 0] == rows[3, 0]
        # Never finer than 5 ms of work per chunk: 4 x 10 tokens (4 ms) stay together.
        a.calls.sent = b.calls.sent = 0  # type: ignore[attr-defined]
        await embed_rows(router, 4, 10)
        assert a.calls.sent + b.calls.sent == 1  # type: ignore[attr-defined]
        # One replica busy with other work: no split, the request goes whole (FIFO).
        b.acquire(500)
        a.calls.sent = b.calls.sent = 0  # type: ignore[attr-defined]
        await embed_rows(router, 4, 100)
        assert (a.calls.sent, b.calls.sent) == (1, 0)  # type: ignore[attr-defined]
        b.release(500, "OK")

    run(scenario)
