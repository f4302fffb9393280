"""The `Calls` stream: many Embed/Score requests multiplexed on one gRPC stream.

Why: a unary gRPC call costs a new HTTP/2 stream, a handler task and several wake-ups
on both sides; a message on a stream that is already open costs one frame each way. A
gateway keeps one `Calls` stream per replica and sends every chunk on it.

Each `CallRequest` becomes a task running exactly what the unary handlers run
(`CallHandler.embed` / `score`). Its answer is written under the request's id as soon
as it is ready, so answers leave in completion order. A failure is an answer too: a
`CallError` with the status the unary call would have failed with. ``cancel`` drops a
request without an answer. When the caller closes its side, requests still running are
finished first; when the stream itself ends (caller gone, server stopping), they are
cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from protos.trellis.v1 import inference_pb2 as pb
from tulip.errors import TulipError, status_code
from tulip.metrics import Metrics

__all__ = ["CallHandler", "serve_calls"]

log = logging.getLogger(__name__)

# The request's `call` field → the unary method it stands for (the metrics label).
_METHODS = {"embed": "Embed", "score": "Score"}


class CallHandler(Protocol):
    """The unary handlers' work, without their gRPC context (`InferenceService`)."""

    async def embed(
        self,
        request: pb.EmbedRequest,
        deadline: float | None,
        admitted: bool = False,
        traceparent: str = "",
    ) -> pb.EmbedResponse: ...

    async def score(
        self,
        request: pb.ScoreRequest,
        deadline: float | None,
        admitted: bool = False,
        traceparent: str = "",
    ) -> pb.ScoreResponse: ...


def _error(call_id: int, code: grpc.StatusCode, message: str) -> pb.CallResponse:
    return pb.CallResponse(id=call_id, error=pb.CallError(code=code.value[0], message=message))


async def serve_calls(
    handler: CallHandler,
    requests: AsyncIterator[pb.CallRequest],
    context: grpc.aio.ServicerContext,
    metrics: Metrics,
) -> None:
    """Serve one `Calls` stream until the caller closes it (or it breaks)."""
    write_lock = asyncio.Lock()
    running: dict[int, asyncio.Task[None]] = {}  # unanswered requests by id
    tasks: set[asyncio.Task[None]] = set()  # every answer task still alive (incl. writing)

    async def write(response: pb.CallResponse) -> None:
        async with write_lock:
            try:
                await context.write(response)
            except Exception:  # the stream is gone; its reader ends it
                log.debug("tulip: Calls answer %d not delivered", response.id)

    async def answer(call: pb.CallRequest, kind: str) -> None:
        method = _METHODS[kind]
        deadline = time.monotonic() + call.timeout_ms / 1e3 if call.timeout_ms else None
        try:
            if kind == "embed":
                embedded = await handler.embed(
                    call.embed, deadline, call.admitted, call.traceparent
                )
                response = pb.CallResponse(id=call.id, embed=embedded)
            else:
                scored = await handler.score(call.score, deadline, call.admitted, call.traceparent)
                response = pb.CallResponse(id=call.id, score=scored)
            status = "OK"
        except TulipError as error:
            code = status_code(error)
            response, status = _error(call.id, code, str(error)), code.name
        except asyncio.CancelledError:
            metrics.requests.labels(method=method, status="CANCELLED").inc()
            raise
        except Exception as error:
            log.exception("tulip: %s call %d failed", method, call.id)
            response, status = _error(call.id, grpc.StatusCode.UNKNOWN, repr(error)), "UNKNOWN"
        finally:
            if running.get(call.id) is asyncio.current_task():
                del running[call.id]
        metrics.requests.labels(method=method, status=status).inc()
        await write(response)

    try:
        async for call in requests:
            kind = call.WhichOneof("call")
            if kind == "cancel" and not call.cancel:
                message = "CallRequest cancel must be true (false asks for nothing)"
                await write(_error(call.id, grpc.StatusCode.INVALID_ARGUMENT, message))
            elif kind == "cancel":
                task = running.pop(call.id, None)
                if task is not None:
                    task.cancel()
            elif kind is None:
                await write(
                    _error(call.id, grpc.StatusCode.INVALID_ARGUMENT, "CallRequest has no call")
                )
            elif call.id in running:
                message = f"CallRequest id {call.id} is already in use by an unanswered request"
                await write(_error(call.id, grpc.StatusCode.INVALID_ARGUMENT, message))
            else:
                task = asyncio.create_task(answer(call, kind))
                running[call.id] = task
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:  # the caller closed its side: finish (and deliver) what it asked for
            await asyncio.wait(list(tasks))
    except asyncio.CancelledError:
        # The stream ended under us (the caller left, or the server is stopping): nobody
        # is left to answer. Returning, not raising, keeps gRPC from logging an error.
        return
    finally:
        for task in list(tasks):
            task.cancel()
