"""Split packed token batches into chunks, send them to replicas concurrently with one
retry on another replica, and reassemble the answers in input order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from ivy.calls import CallFailed
from ivy.errors import (
    DeadlineError,
    IvyError,
    OverloadedError,
    UnavailableError,
    UpstreamError,
    ValidationError,
)
from ivy.metrics import Metrics
from ivy.replicas import Replica, ReplicaPool
from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import pack_token_batch, unpack_tensor

__all__ = ["Chunk", "Router", "no_replica_error", "split_chunks"]

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class Chunk:
    """Inputs [start, stop) of a packed batch; tokens [token_start, token_stop)."""

    start: int
    stop: int
    token_start: int
    token_stop: int

    @property
    def tokens(self) -> int:
        return self.token_stop - self.token_start


def split_chunks(lengths: np.ndarray, chunk_tokens: int) -> list[Chunk]:
    """Consecutive inputs grouped while their token total stays within ``chunk_tokens``
    (an input longer than that alone forms a chunk)."""
    n = len(lengths)
    total = int(lengths.sum(dtype=np.int64))
    if n and total <= chunk_tokens:
        return [Chunk(0, n, 0, total)]  # the common small request: one chunk
    chunks: list[Chunk] = []
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    start = 0
    while start < n:
        # Furthest stop with offsets[stop] - offsets[start] <= chunk_tokens.
        stop = int(np.searchsorted(offsets, offsets[start] + chunk_tokens, side="right")) - 1
        stop = max(stop, start + 1)
        chunks.append(Chunk(start, stop, int(offsets[start]), int(offsets[stop])))
        start = stop
    return chunks


# The response field that carries each method's result rows.
_RESULT_FIELD = {"embed": "embeddings", "score": "scores"}


class Router:
    """Sends work for one worker to the pools of its served models."""

    def __init__(self, pools: dict[str, ReplicaPool], metrics: Metrics, chunk_tokens: int) -> None:
        self.pools = pools
        self.metrics = metrics
        self.chunk_tokens = chunk_tokens

    async def embed(
        self,
        model: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        *,
        dimensions: int,
        deadline: float,
    ) -> tuple[np.ndarray, int, float]:
        """Embeddings [inputs, dims] float32 in input order, the chunk count and the
        replicas' own time (queue + inference, seconds; the slowest chunk)."""

        def request(chunk: Chunk) -> pb.EmbedRequest:
            return pb.EmbedRequest(
                inputs=pack_token_batch(
                    ids[chunk.token_start : chunk.token_stop], lengths[chunk.start : chunk.stop]
                ),
                dimensions=dimensions,
            )

        return await self._fan_out(model, "embed", lengths, request, deadline)

    async def score(
        self,
        model: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        first_segment_lengths: np.ndarray,
        *,
        deadline: float,
    ) -> tuple[np.ndarray, int, float]:
        """Pair scores [pairs, num_labels] in input order, the chunk count and the
        replicas' own time (seconds, the slowest chunk)."""

        def request(chunk: Chunk) -> pb.ScoreRequest:
            return pb.ScoreRequest(
                pairs=pack_token_batch(
                    ids[chunk.token_start : chunk.token_stop], lengths[chunk.start : chunk.stop]
                ),
                first_segment_lengths=[
                    int(x) for x in first_segment_lengths[chunk.start : chunk.stop]
                ],
            )

        return await self._fan_out(model, "score", lengths, request, deadline)

    async def _fan_out(
        self,
        model: str,
        method: str,
        lengths: np.ndarray,
        make_request: Callable[[Chunk], pb.EmbedRequest | pb.ScoreRequest],
        deadline: float,
    ) -> tuple[np.ndarray, int, float]:
        """Split into chunks, send them concurrently, and reassemble the result rows in
        input order; also the chunk count and the slowest chunk's replica time (s)."""
        chunks = split_chunks(lengths, self.chunk_tokens)
        replica_us: list[int] = []

        async def one(chunk: Chunk) -> np.ndarray:
            response = await self._call(model, method, make_request(chunk), chunk.tokens, deadline)
            replica_us.append(response.timing.queue_us + response.timing.inference_us)
            return unpack_tensor(getattr(response, _RESULT_FIELD[method]))

        parts = await _gather([one(c) for c in chunks])
        rows = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        return rows, len(chunks), max(replica_us, default=0) / 1e6

    async def _call(
        self, model: str, method: str, request: object, tokens: int, deadline: float
    ) -> pb.EmbedResponse | pb.ScoreResponse:
        pool = self.pools[model]
        tried: set[Replica] = set()
        refusals: list[grpc.StatusCode] = []
        for _attempt in range(2):
            replica = pool.pick(exclude=tried)
            if replica is None:
                break
            tried.add(replica)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineError("the request timed out before it reached a replica")
            replica.acquire(tokens)
            outcome = "OK"
            try:
                return await getattr(replica.calls, method)(request, remaining)
            except CallFailed as exc:
                code = exc.code()
                outcome = code.name
                if code in _RETRYABLE:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        replica.mark_suspect()
                    refusals.append(code)
                    self.metrics.retries.labels(model=model, reason=code.name).inc()
                    continue
                raise _translate(exc) from None
            finally:
                replica.release(tokens, outcome)
        raise no_replica_error(model, refusals)


def no_replica_error(model: str, refusals: list[grpc.StatusCode]) -> IvyError:
    """The answer when no replica took the call: 429 when any refused for capacity (the
    client should retry), else 503."""
    if refusals and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refusals):
        return OverloadedError("Every replica is at capacity; retry shortly.")
    if grpc.StatusCode.RESOURCE_EXHAUSTED in refusals:
        return OverloadedError("The remaining replicas are at capacity; retry shortly.")
    return UnavailableError(f"No healthy replica serves model `{model}` right now.")


def _translate(exc: CallFailed) -> IvyError:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValidationError(exc.details() or "invalid input", param="input")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineError("The request timed out.")
    return UpstreamError(f"A replica failed: {code.name}: {exc.details()}")


async def _gather(coros: list[Coroutine[Any, Any, np.ndarray]]) -> list[np.ndarray]:
    """Run all, cancel the rest on the first failure, re-raise it."""
    if len(coros) == 1:
        # One chunk (the common case): no task to schedule, await it in place.
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
