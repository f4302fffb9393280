"""One multiplexed `Calls` stream per replica: Embed/Score chunks as messages on it.

Why: a unary gRPC call sets up an HTTP/2 stream and a handler on each side, which on a
small request costs about as much again as the message itself (tulip/calls.py). Every
chunk this worker sends to a replica goes instead as one `CallRequest` on a stream that
stays open.

Invariants:
  * At most one stream per replica is open; it is opened on first use and again after
    it ends. Requests are matched to answers by id (`_Stream.pending`).
  * A request ends exactly once: with its answer, with `CallFailed` carrying the status
    the unary call would have had, with DEADLINE_EXCEEDED when its timeout passes (a
    ``cancel`` then tells the replica to drop it), or cancelled with the caller (same).
  * When the stream breaks (the replica died or is stopping), every request on it fails
    with UNAVAILABLE, which the router retries on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc

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
    """One open `Calls` stream, its unanswered requests and the task reading answers."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self.call = stub.Calls()
        self.pending: dict[int, asyncio.Future[Answer]] = {}
        self.write_lock = asyncio.Lock()
        self.ended: CallFailed | None = None
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        failure = CallFailed(grpc.StatusCode.UNAVAILABLE, "the replica closed the Calls stream")
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
                failure = CallFailed(
                    grpc.StatusCode.UNAVAILABLE, f"Calls stream broke: {code.name}"
                )
        except asyncio.CancelledError:
            failure = CallFailed(grpc.StatusCode.UNAVAILABLE, "the Calls stream was closed")
            raise
        finally:
            self.ended = failure
            pending, self.pending = self.pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(failure)

    async def write(self, request: pb.CallRequest) -> None:
        async with self.write_lock:
            if self.ended is not None:
                raise self.ended
            try:
                await self.call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
                raise CallFailed(
                    grpc.StatusCode.UNAVAILABLE, f"could not send on the Calls stream: {error!r}"
                ) from None

    def close(self) -> None:
        self.call.cancel()


class CallMux:
    """Embed/Score calls to one replica over one shared `Calls` stream."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._cancels: set[asyncio.Task[None]] = set()

    async def embed(self, request: pb.EmbedRequest, timeout: float) -> pb.EmbedResponse:
        return await self._send(pb.CallRequest(embed=request), timeout)  # type: ignore[return-value]

    async def score(self, request: pb.ScoreRequest, timeout: float) -> pb.ScoreResponse:
        return await self._send(pb.CallRequest(score=request), timeout)  # type: ignore[return-value]

    async def _send(self, request: pb.CallRequest, timeout: float) -> Answer:
        stream = self._stream
        if stream is None or stream.ended is not None:
            stream = self._stream = _Stream(self._stub)
        call_id = next(self._ids)
        request.id = call_id
        request.timeout_ms = max(1, int(timeout * 1e3))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        stream.pending[call_id] = future
        expiry = loop.call_later(timeout, _expire, future)
        try:
            await stream.write(request)
            return await future
        except BaseException:
            if stream.pending.pop(call_id, None) is not None and stream.ended is None:
                # Expired here, or the caller gave up: the replica can drop the work.
                task = loop.create_task(_cancel(stream, call_id))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)
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


async def _cancel(stream: _Stream, call_id: int) -> None:
    with contextlib.suppress(CallFailed):
        await stream.write(pb.CallRequest(id=call_id, cancel=True))
