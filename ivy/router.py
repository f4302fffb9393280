"""Split packed token batches into chunks, send them to replicas concurrently with one
retry on another replica (and a hedge when a replica stalls), and reassemble the answers
in input order."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
from protos import tracing
from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import pack_token_batch, unpack_tensor

__all__ = [
    "RETRYABLE",
    "cancel_all",
    "gather_or_cancel",
    "Chunk",
    "Claim",
    "EmbedOutputs",
    "RaggedOutput",
    "Router",
    "no_replica_error",
    "note_refusal",
    "split_chunks",
    "translate",
]

log = logging.getLogger("ivy")

# Statuses a call is retried on, on another replica: the replica is stopping or gone
# (UNAVAILABLE; CANCELLED when a call reaches a listener that is closing) or full.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
)
# A chunk is hedged after this many times what such a chunk has taken lately.
_HEDGE_FACTOR = 4.0
# A replica's speed before this worker saw it answer: a slow CPU's (hedging waits longer).
_UNMEASURED_SECONDS_PER_TOKEN = 1e-3
# Admitted work refused for capacity is sent again after about this long.
_REFILL_SECONDS = 0.05
# A lone request is split over idle replicas only into chunks worth at least this much
# replica time: a finer split costs more in round trips and batching than it saves.
_MIN_CHUNK_SECONDS = 0.005
# A request's `normalize` on the wire (None: the model's default).
_T = TypeVar("_T")
_NORMALIZE = {None: pb.NORMALIZE_DEFAULT, True: pb.NORMALIZE_ON, False: pb.NORMALIZE_OFF}


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


@dataclass(frozen=True, eq=False)
class RaggedOutput:
    """Per-input variable-length results: input i owns the next ``counts[i]`` entries of
    ``values`` ([N] sparse weights or [N, D] vectors) and of ``indices`` (sparse token ids)."""

    counts: np.ndarray
    values: np.ndarray
    indices: np.ndarray | None = None

    def split(self) -> list[tuple[np.ndarray | None, np.ndarray]]:
        """(indices or None, values) of each input, in order."""
        ends = np.cumsum(self.counts, dtype=np.int64)
        starts = ends - self.counts
        return [
            (None if self.indices is None else self.indices[a:b], self.values[a:b])
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ]

    @staticmethod
    def join(parts: Sequence[RaggedOutput]) -> RaggedOutput:
        indices = [p.indices for p in parts if p.indices is not None]
        return RaggedOutput(
            np.concatenate([p.counts for p in parts]),
            np.concatenate([p.values for p in parts], axis=0),
            np.concatenate(indices) if len(indices) == len(parts) else None,
        )


@dataclass(frozen=True, eq=False)
class EmbedOutputs:
    """The output kinds an Embed call asked for, every input's in input order (None: not
    asked for)."""

    dense: np.ndarray | None = None
    sparse: RaggedOutput | None = None
    multi_vectors: RaggedOutput | None = None
    token_states: RaggedOutput | None = None

    @classmethod
    def from_response(cls, response: pb.EmbedResponse) -> EmbedOutputs:
        def vectors(field: str) -> RaggedOutput | None:
            if not response.HasField(field):
                return None
            tv = getattr(response, field)
            return _checked(RaggedOutput(_counts(tv.counts), unpack_tensor(tv.vectors)), field)

        sparse = None
        if response.HasField("sparse"):
            sp = response.sparse
            sparse = _checked(
                RaggedOutput(
                    _counts(sp.counts),
                    np.frombuffer(sp.values, dtype="<f4").astype(np.float32),
                    np.frombuffer(sp.indices, dtype="<u4").astype(np.int64),
                ),
                "sparse",
            )
        return cls(
            unpack_tensor(response.embeddings) if response.HasField("embeddings") else None,
            sparse,
            vectors("multi_vectors"),
            vectors("token_states"),
        )

    @staticmethod
    def join(parts: Sequence[EmbedOutputs]) -> EmbedOutputs:
        def each(name: str) -> Any:
            found = [getattr(p, name) for p in parts]
            if any(f is None for f in found):
                return None
            if name == "dense":
                return np.concatenate(found, axis=0)
            return RaggedOutput.join(found)

        return EmbedOutputs(*(each(f.name) for f in dataclasses.fields(EmbedOutputs)))


def _counts(counts: Sequence[int]) -> np.ndarray:
    return np.asarray(counts, dtype=np.int64)


def _checked(out: RaggedOutput, field: str) -> RaggedOutput:
    total = int(out.counts.sum())
    if out.values.shape[0] != total or (out.indices is not None and out.indices.size != total):
        raise UpstreamError(f"A replica answered a malformed `{field}` output.")
    return out


class Claim:
    """A request's claim on its pool's capacity: while held, its tokens count in the
    pool's ``committed_tokens``, which `Router` weighs before admitting another large
    request. Held from admission (before tokenizing) until the request is answered; a
    context manager so that every way out of a request lets go of it."""

    __slots__ = ("pool", "tokens")

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.tokens = 0

    def hold(self, tokens: int) -> None:
        """Hold `tokens` from now on (0: let go)."""
        self.pool.committed_tokens += tokens - self.tokens
        self.tokens = tokens

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.hold(0)


class Router:
    """Sends work for one worker to the pools of its served models.

    Policy, for every chunk of every request:
      * a chunk goes to the least-loaded healthy replica (`ReplicaPool.pick`) and, when
        that one fails with a retryable status, once to another;
      * a replica is marked suspect only for failures it caused (its stream broke, it is
        stopping, or it stalled while another answered); a capacity refusal marks it
        saturated instead, and a failure Ivy caused (a cancelled caller) marks nothing. A
        suspect replica is avoided only while another serving one can take the chunk: with
        every replica suspect (say two hedges won in opposite directions under load), a
        chunk still goes to one of them rather than being answered 503;
      * a chunk still unanswered after its hedging delay (several times what such a chunk
        has taken lately, at least ``hedge_after_s``) is sent to a second replica too, the
        first answer wins and the other call is cancelled: a frozen replica delays its
        chunks by that delay, not by the whole deadline;
      * a request's chunks are in flight at most two per healthy replica at a time; a
        chunk refused for capacity while others of its request are in flight waits for
        one of them and is sent again. Once one chunk was answered the request counts as
        admitted: its later chunks travel marked ``admitted``, which replicas queue
        whenever they can finish in time (their queue-time limit refuses only new work),
        so an admitted request finishes and overload cannot leave many requests half
        done. A request none of whose chunks was taken answers 429.
    """

    def __init__(
        self,
        pools: dict[str, ReplicaPool],
        metrics: Metrics,
        chunk_tokens: int,
        hedge_after_s: float = 2.0,
    ) -> None:
        self.pools = pools
        self.metrics = metrics
        self.chunk_tokens = chunk_tokens
        self.hedge_after_s = hedge_after_s

    def admit(self, model: str, deadline: float, tokens_hint: int = 0) -> Claim:
        """Admit a request before any tokenizing is spent on it, or refuse it (429) when
        every healthy replica of `model` is refusing work, or when a request of at least
        `tokens_hint` tokens would find no room (`_check_room`). The claim holds the hint
        until the request's chunks are known (`_fan_out`)."""
        pool = self.pools[model]
        if pool.saturated():
            self.metrics.shed.labels(model=model).inc()
            raise OverloadedError("Every replica is at capacity; retry shortly.")
        claim = Claim(pool)
        if tokens_hint > self.chunk_tokens:
            self._check_room(model, pool, tokens_hint, deadline)
            claim.hold(tokens_hint)
        return claim

    async def embed(
        self,
        model: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        *,
        dimensions: int,
        normalize: bool | None = None,
        spans: tuple[np.ndarray, np.ndarray] | None = None,
        deadline: float,
        claim: Claim,
    ) -> tuple[np.ndarray, int, float]:
        """Embeddings [inputs, dims] float32 in input order, the chunk count and the
        replicas' own time (queue + inference, seconds; the slowest chunk). With `spans`
        (spans per input [inputs], each span's [start, end) within its input [spans, 2])
        one vector per span, in order (late chunking: an input never splits over chunks)."""
        first_span = None if spans is None else np.concatenate(([0], np.cumsum(spans[0])))

        def request(chunk: Chunk) -> pb.EmbedRequest:
            message = pb.EmbedRequest(
                inputs=pack_token_batch(
                    ids[chunk.token_start : chunk.token_stop], lengths[chunk.start : chunk.stop]
                ),
                normalize=_NORMALIZE[normalize],
                dimensions=dimensions,
            )
            if spans is not None and first_span is not None:
                counts, bounds = spans
                message.span_counts.extend(counts[chunk.start : chunk.stop].tolist())
                cut = bounds[first_span[chunk.start] : first_span[chunk.stop]]
                message.spans.extend(cut.reshape(-1).tolist())
            return message

        return await self._fan_out(model, "embed", lengths, request, deadline, claim)

    async def embed_outputs(
        self,
        model: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        outputs: Sequence[int],
        *,
        deadline: float,
        claim: Claim,
        dimensions: int = 0,
        normalize: bool | None = None,
        dtype: int = pb.DTYPE_FLOAT32,
    ) -> tuple[EmbedOutputs, int, float]:
        """The `outputs` (``pb.Output`` values) of every input, in input order, the chunk
        count and the replicas' own time (seconds, the slowest chunk)."""

        def request(chunk: Chunk) -> pb.EmbedRequest:
            return pb.EmbedRequest(
                inputs=pack_token_batch(
                    ids[chunk.token_start : chunk.token_stop], lengths[chunk.start : chunk.stop]
                ),
                normalize=_NORMALIZE[normalize],
                dimensions=dimensions,
                dtype=dtype,  # type: ignore[arg-type]
                outputs=list(outputs),  # type: ignore[arg-type]
            )

        return await self._fan_out(
            model,
            "embed",
            lengths,
            request,
            deadline,
            claim,
            unpack=EmbedOutputs.from_response,
            join=EmbedOutputs.join,
        )

    async def score(
        self,
        model: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        first_segment_lengths: np.ndarray,
        *,
        deadline: float,
        claim: Claim,
        activation: bool | None = None,
    ) -> tuple[np.ndarray, int, float]:
        """Pair scores [pairs, num_labels] in input order, the chunk count and the
        replicas' own time (seconds, the slowest chunk). `activation` False: raw logits;
        None: the model's own activation (its sentence-transformers configuration)."""
        act = pb.ACTIVATION_NONE if activation is False else pb.ACTIVATION_DEFAULT

        def request(chunk: Chunk) -> pb.ScoreRequest:
            return pb.ScoreRequest(
                pairs=pack_token_batch(
                    ids[chunk.token_start : chunk.token_stop], lengths[chunk.start : chunk.stop]
                ),
                first_segment_lengths=[
                    int(x) for x in first_segment_lengths[chunk.start : chunk.stop]
                ],
                activation=act,
            )

        return await self._fan_out(model, "score", lengths, request, deadline, claim)

    def chunk_tokens_for(self, pool: ReplicaPool, lengths: np.ndarray) -> int:
        """Tokens per chunk for this request: `chunk_tokens`, unless several replicas are
        idle, in which case the request is spread evenly over them (a lone request uses
        the whole cluster, not one replica while the others wait), in chunks worth at
        least `_MIN_CHUNK_SECONDS` of replica time (splitting finer costs more round trips
        than it saves). While replicas are busy nothing is split further, so concurrent
        requests keep their first-come order."""
        cap = self.chunk_tokens
        if len(lengths) < 2:
            return cap
        idle = sum(
            1
            for r in pool.healthy()
            if not r.outstanding_tokens and not r.suspect and not r.saturated
        )
        rate = pool.seconds_per_token()
        if idle < 2 or rate is None:
            return cap  # unmeasured replicas: no basis to judge what a split saves
        total = int(lengths.sum(dtype=np.int64))
        floor = math.ceil(_MIN_CHUNK_SECONDS / rate)
        return max(1, min(cap, max(floor, math.ceil(total / idle))))

    async def _fan_out(
        self,
        model: str,
        method: str,
        lengths: np.ndarray,
        make_request: Callable[[Chunk], pb.EmbedRequest | pb.ScoreRequest],
        deadline: float,
        claim: Claim,
        *,
        unpack: Callable[[Any], Any] | None = None,
        join: Callable[[list[Any]], Any] | None = None,
    ) -> tuple[Any, int, float]:
        """Split into chunks, send them (a window at a time), and reassemble the result
        rows in input order; also the chunk count and the slowest chunk's replica time.
        `unpack` reads a chunk's answer (default: its result tensor) and `join` puts the
        chunks' together (default: rows concatenated)."""
        with tracing.span("inference", inputs=len(lengths)):  # its context goes with each chunk
            chunks = split_chunks(lengths, self.chunk_tokens_for(self.pools[model], lengths))
            field = _RESULT_FIELD[method]
            if unpack is None:
                unpack = functools.partial(_unpack_field, field)
            if len(chunks) == 1:  # the common small request: no window, no extra task
                response = await self._call(
                    model, method, make_request(chunks[0]), chunks[0].tokens, deadline
                )
                timing = response.timing
                return (
                    unpack(response),
                    1,
                    (timing.queue_us + timing.inference_us) / 1e6,
                )
            pool = self.pools[model]
            total = sum(c.tokens for c in chunks)
            if not claim.tokens:  # not admitted by its size yet
                self._check_room(model, pool, total, deadline)
            claim.hold(total)
            parts: list[Any] = [None] * len(chunks)
            waiting = collections.deque(range(len(chunks)))
            running: dict[asyncio.Task[Any], int] = {}
            replica_us = 0
            answered = 0
            blocked = False  # a chunk was refused: send nothing new until one is answered
            try:
                while waiting or running:
                    window = 0 if blocked else max(1, 2 * len(pool.healthy()))
                    while waiting and len(running) < window:
                        index = waiting.popleft()
                        chunk = chunks[index]
                        task = asyncio.ensure_future(
                            self._call(
                                model,
                                method,
                                make_request(chunk),
                                chunk.tokens,
                                deadline,
                                admitted=answered > 0,
                            )
                        )
                        running[task] = index
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise DeadlineError("The request timed out.")
                    if running:
                        done, _ = await asyncio.wait(
                            running, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                        )
                    else:
                        # Admitted work whose remaining chunks found no room: wait a little
                        # (the replicas' queues drain), then send them again.
                        await asyncio.sleep(
                            min(remaining, _REFILL_SECONDS * (0.5 + random.random()))
                        )
                        done, blocked = set(), False
                    refused: list[int] = []
                    for task in done:
                        index = running.pop(task)
                        error = task.exception()
                        if error is None:
                            response = task.result()
                            parts[index] = unpack(response)
                            timing = response.timing
                            replica_us = max(replica_us, timing.queue_us + timing.inference_us)
                            answered += 1
                            blocked = False
                            claim.hold(claim.tokens - chunks[index].tokens)
                        elif isinstance(error, OverloadedError):
                            refused.append(index)
                        else:
                            raise error
                    if refused:
                        if not running and not answered:
                            raise OverloadedError("Every replica is at capacity; retry shortly.")
                        waiting.extendleft(sorted(refused, reverse=True))
                        blocked = True
            finally:
                claim.hold(0)
                await cancel_all(running)
            rows = join(parts) if join is not None else np.concatenate(parts, axis=0)
            return rows, len(chunks), replica_us / 1e6

    def _check_room(self, model: str, pool: ReplicaPool, tokens: int, deadline: float) -> None:
        """Admit a request of several chunks only when the pool can finish it, with the
        admitted requests already in progress, within half its time: else 429 now, not
        504 later. Replicas admit chunks, but only a request as a whole can finish."""
        if not pool.committed_tokens:
            return  # nothing else in progress: this request goes alone
        rate = pool.seconds_per_token()
        replicas = max(1, len(pool.healthy()))
        # Unmeasured replicas (no answer yet): one multi-chunk request at a time.
        expected = math.inf if rate is None else (pool.committed_tokens + tokens) * rate / replicas
        if expected > 0.5 * (deadline - time.monotonic()):
            self.metrics.shed.labels(model=model).inc()
            raise OverloadedError(
                "The replicas are busy with earlier requests; retry shortly.",
                retry_after_seconds=random.randint(1, 3)
                if math.isinf(expected)
                else max(1, min(30, round(expected / 2))),
            )

    async def _call(
        self,
        model: str,
        method: str,
        request: object,
        tokens: int,
        deadline: float,
        *,
        admitted: bool = False,
    ) -> pb.EmbedResponse | pb.ScoreResponse:
        """One chunk on one replica's `Calls` stream, under the one policy (`call`)."""

        async def attempt(
            replica: Replica, timeout: float, admitted: bool
        ) -> pb.EmbedResponse | pb.ScoreResponse:
            sent = time.monotonic()
            response = await getattr(replica.calls, method)(request, timeout, admitted)
            replica.observe(tokens, time.monotonic() - sent)
            return response  # type: ignore[no-any-return]

        response, _ = await self.call(model, attempt, tokens, deadline, admitted=admitted)
        return response

    async def call(
        self,
        model: str,
        attempt: Callable[[Replica, float, bool], Awaitable[_T]],
        tokens: int,
        deadline: float,
        *,
        hedge: bool = True,
        param: str = "input",
        keep: bool = False,
        admitted: bool = False,
    ) -> tuple[_T, Replica]:
        """The one upstream policy, for every kind of call: `attempt(replica, seconds
        left, admitted)` on the replica `pick` chooses; a retryable refusal (`RETRYABLE`)
        is noted (`note_refusal`) and tried once on another replica; any other failure is
        translated (`translate`, naming `param`); past `deadline` it is a 504. With
        `hedge`, an attempt unanswered for `_hedge_delay` is also sent to a second
        replica, the first answer wins and the stalled one is marked suspect. `tokens`
        count on the replica from launch until the attempt ends, or, with `keep`, until
        the caller releases the winner's (a stream it goes on reading). Attempts still
        running when this returns or fails are cancelled and awaited.

        `admitted` tells the replica the call is part of work already taken (its
        queue-time limit, which refuses new work, does not apply). A call whose replica
        failed it (went away or is stopping: `lost`) is sent on as admitted too: Ivy took
        the request, and a replica's crash must not become a capacity refusal of work it
        had been holding, while the one replica left absorbs its share. The deadline
        still bounds it: the replica refuses what it cannot finish in time."""
        pool = self.pools[model]
        tried: set[Replica] = set()
        refusals: list[grpc.StatusCode] = []
        attempts: dict[asyncio.Task[Any], tuple[Replica, float]] = {}
        hedged = not hedge

        def launch(replica: Replica) -> None:
            tried.add(replica)
            # Counted at once, not when the task first runs: the next chunk's `pick` (of
            # this request too) must see this one on the replica.
            replica.acquire(tokens)
            lost = any(code in LOST for code in refusals)
            seconds_left = max(0.0, deadline - time.monotonic())
            task = asyncio.ensure_future(attempt(replica, seconds_left, admitted or lost))
            task.add_done_callback(functools.partial(_release, replica, tokens, keep))
            attempts[task] = (replica, time.monotonic())

        try:
            while True:
                if not attempts:
                    replica = pool.pick(exclude=tried) if len(tried) < 2 else None
                    if replica is None:
                        raise no_replica_error(model, refusals)
                    launch(replica)
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    raise DeadlineError("The request timed out.")
                timeout = remaining
                if not hedged and len(attempts) == 1:
                    ((first, sent),) = attempts.values()
                    hedge_at = sent + self._hedge_delay(first, tokens)
                    timeout = min(timeout, max(0.0, hedge_at - now))
                done, _ = await asyncio.wait(
                    attempts, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    if time.monotonic() >= deadline:
                        raise DeadlineError("The request timed out.")
                    other = pool.pick(exclude=tried, unsaturated=True)
                    hedged = True  # one hedge per chunk, whether or not a replica was free
                    if other is not None:
                        self.metrics.hedges.labels(model=model).inc()
                        launch(other)
                    continue
                for task in done:
                    replica, _sent = attempts.pop(task)
                    error = task.exception()
                    if error is None:
                        for slow, _ in attempts.values():
                            slow.mark_suspect()  # it stalled while another answered
                        return task.result(), replica
                    if not isinstance(error, CallFailed):
                        raise error
                    code = error.code()
                    if code not in RETRYABLE:
                        raise translate(code, error.details(), model=model, param=param)
                    note_refusal(replica, code)
                    refusals.append(code)
                    self.metrics.retries.labels(model=model, reason=code.name).inc()
        finally:
            await cancel_all(attempts)

    def _hedge_delay(self, replica: Replica, tokens: int) -> float:
        """How long a chunk may go unanswered before a second replica gets it too."""
        per_token = replica.seconds_per_token
        if per_token is None:
            per_token = _UNMEASURED_SECONDS_PER_TOKEN
        expected = per_token * tokens
        return max(self.hedge_after_s, _HEDGE_FACTOR * expected)


def _unpack_field(field: str, response: Any) -> np.ndarray:
    return unpack_tensor(getattr(response, field))


def _release(replica: Replica, tokens: int, keep: bool, task: asyncio.Future[Any]) -> None:
    """Return an attempt's tokens to its replica, counting how the attempt ended (also
    when it was cancelled before it ever ran); with `keep`, a successful attempt's tokens
    stay with whoever goes on using the replica (it releases them)."""
    if task.cancelled():
        outcome = "CANCELLED"
    else:
        error = task.exception()
        if error is None:
            if keep:
                return
            outcome = "OK"
        elif isinstance(error, CallFailed):
            outcome = error.code().name
        else:
            outcome = "CANCELLED"
    replica.release(tokens, outcome)


# The retryable failures that say the replica itself failed the call (gone, or stopping),
# as opposed to a capacity refusal (RESOURCE_EXHAUSTED); also what ends a generation's
# stream when its replica dies (`ivy.generation.ReplicaLost`).
LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


def no_replica_error(model: str, refusals: list[grpc.StatusCode]) -> IvyError:
    """The answer when no replica took the call: 429 when any refused for capacity (the
    client should retry), else 503."""
    if refusals and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refusals):
        return OverloadedError("Every replica is at capacity; retry shortly.")
    if grpc.StatusCode.RESOURCE_EXHAUSTED in refusals:
        return OverloadedError("The remaining replicas are at capacity; retry shortly.")
    return UnavailableError(f"No healthy replica serves model `{model}` right now.")


def note_refusal(replica: Replica, code: grpc.StatusCode) -> None:
    """What a retryable refusal says about the replica: full (saturated for a moment) or
    stopping / gone (suspect: routed around for a while)."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        replica.mark_saturated()
    else:
        replica.mark_suspect()


# The wire field a replica's INVALID_ARGUMENT starts with → the request field it came from,
# where that is not the request's main input (the `param` translate is given).
_FIELD_PARAMS = {"sampling.response_format": "response_format"}


def translate(code: grpc.StatusCode, details: str, *, model: str, param: str) -> IvyError:
    """The one table from a replica's failure to the client's error. Only the client's own
    mistakes (INVALID_ARGUMENT) are passed on in the replica's words; the rest get a
    generic message, and the details go to the log."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # a replica names the wire field it refused; a few are one request field of their own
        field = next((f for f in _FIELD_PARAMS if details.startswith(f)), None)
        param = _FIELD_PARAMS[field] if field is not None else param
        return ValidationError(details or "invalid input", param=param)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineError("The request timed out.")
    log.warning("ivy: a replica of %s failed a call: %s: %s", model, code.name, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError("The replica ran out of capacity for this request; retry shortly.")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return UnavailableError("The replica serving this request went away.")
    return UpstreamError("A replica failed to process the request.")


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel every task still running and wait for them, retrieving their outcomes (no
    "exception was never retrieved" for work nobody waits for any more)."""
    tasks = list(tasks)
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


async def gather_or_cancel(
    aws: Sequence[Awaitable[_T]], discard: Callable[[_T], None] | None = None
) -> list[_T]:
    """Run `aws` concurrently; their results in order. When one fails, or the caller is
    cancelled, the others are cancelled and awaited, the results that did arrive go to
    `discard` (to close what they opened), and the error is raised."""
    if len(aws) == 1:
        return [await aws[0]]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_all(tasks)
        if discard is not None:
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    discard(task.result())
        raise
