"""One multiplexed `Calls` stream per replica: Embed/Score chunks as messages on it.

Why: a unary gRPC call sets up an HTTP/2 stream and a handler on each side, which on a
small request costs about as much again as the message itself (tulip/calls.py). Every
chunk this worker sends to a replica goes instead as one `CallRequest` on a stream that
stays open.

Invariants:
  * At most one stream per replica is open; it is opened on first use and again after
    it ends. Requests are matched to answers by id (`_Stream.pending`).
  * One writer per stream: callers only put messages on the stream's outbox, which
    grpc.aio drains from its own task (the stream's request iterator). A caller that is
    cancelled therefore never cancels the stream, whose other requests belong to other
    callers (grpc.aio cancels the whole RPC when an awaited ``write`` is cancelled).
  * A request ends exactly once: with its answer, with `CallFailed` carrying the status
    the unary call would have had, with DEADLINE_EXCEEDED when its timeout passes (a
    ``cancel`` then tells the replica to drop it), or cancelled with the caller (same).
    Every waiter gets an exception instance of its own.
  * When the stream breaks (the replica died or is stopping), every request on it fails
    with UNAVAILABLE, which the router retries on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import grpc

from protos import tracing
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["CallFailed", "CallMux"]

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

Answer = pb.EmbedResponse | pb.ScoreResponse


class CallFailed(Exception):
    """A multiplexed call failed with a gRPC status (`code()` / `details()` as on
    `grpc.aio.AioRpcError`, so callers handle both alike)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stream:
    """One open `Calls` stream: its outbox, its unanswered requests and the task reading
    answers."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self._outbox: asyncio.Queue[pb.CallRequest | None] = asyncio.Queue()
        self.call = stub.Calls(self._requests())
        self.pending: dict[int, asyncio.Future[Answer]] = {}
        # (code, details) once the stream has ended; each waiter gets its own CallFailed.
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.CallRequest]:
        """The stream's request iterator: grpc.aio writes what it yields, in its own task."""
        while True:
            request = await self._outbox.get()
            if request is None:  # half-close: the replica finishes what it was sent
                return
            yield request

    def send(self, request: pb.CallRequest) -> None:
        """Queue `request` for the writer; never blocks, never cancels the stream."""
        if self.ended is not None:
            raise CallFailed(*self.ended)
        self._outbox.put_nowait(request)

    async def _read(self) -> None:
        failure = (grpc.StatusCode.UNAVAILABLE, "the replica closed the Calls stream")
        try:
            async for response in self.call:
                future = self.pending.pop(response.id, None)
                if future is None or future.done():
                    continue  # expired or cancelled here already
                kind = response.WhichOneof("result")
                if kind == "error":
                    code = _STATUS_BY_NUMBER.get(response.error.code, grpc.StatusCode.UNKNOWN)
                    future.set_exception(CallFailed(code, response.error.message))
                elif kind == "embed":
                    future.set_result(response.embed)
                elif kind == "score":
                    future.set_result(response.score)
                else:
                    future.set_exception(
                        CallFailed(grpc.StatusCode.UNKNOWN, "replica sent an empty answer")
                    )
        except grpc.aio.AioRpcError as error:
            code = error.code()
            if code != grpc.StatusCode.CANCELLED:
                failure = (grpc.StatusCode.UNAVAILABLE, f"Calls stream broke: {code.name}")
        except asyncio.CancelledError:
            failure = (grpc.StatusCode.UNAVAILABLE, "the Calls stream was closed")
            raise
        finally:
            self.ended = failure
            pending, self.pending = self.pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(CallFailed(*failure))

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self.call.cancel()


class CallMux:
    """Embed/Score calls to one replica over one shared `Calls` stream."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    async def embed(
        self, request: pb.EmbedRequest, timeout: float, admitted: bool = False
    ) -> pb.EmbedResponse:
        # The caller's span (Ivy's "inference") travels with the request: one stream
        # carries many requests, so per-call gRPC metadata cannot (protos/tracing.py).
        call = pb.CallRequest(embed=request, admitted=admitted, traceparent=tracing.traceparent())
        return await self._send(call, timeout)  # type: ignore[return-value]

    async def score(
        self, request: pb.ScoreRequest, timeout: float, admitted: bool = False
    ) -> pb.ScoreResponse:
        call = pb.CallRequest(score=request, admitted=admitted, traceparent=tracing.traceparent())
        return await self._send(call, timeout)  # type: ignore[return-value]

    async def _send(self, request: pb.CallRequest, timeout: float) -> Answer:
        stream = self._stream
        if stream is None or stream.ended is not None:
            stream = self._stream = _Stream(self._stub)
        call_id = next(self._ids)
        request.id = call_id
        request.timeout_ms = max(1, int(timeout * 1e3))
        stream.send(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        stream.pending[call_id] = future
        expiry = loop.call_later(timeout, _expire, future)
        try:
            return await future
        except BaseException:
            if stream.pending.pop(call_id, None) is not None and stream.ended is None:
                # Expired here, or the caller gave up: the replica can drop the work.
                stream.send(pb.CallRequest(id=call_id, cancel=True))
            raise
        finally:
            expiry.cancel()
            stream.pending.pop(call_id, None)

    async def close(self, grace: float | None = None) -> None:
        """Close the stream, after up to `grace` seconds for unanswered requests."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if grace and stream.pending:
            await asyncio.wait(list(stream.pending.values()), timeout=grace)
        stream.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stream.reader


def _expire(future: asyncio.Future[Answer]) -> None:
    if not future.done():
        future.set_exception(CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
