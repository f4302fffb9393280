"""A pure-ASGI front for Ivy's hot POST routes (embeddings, rerank, tokenize).

For a small request, FastAPI's per-request machinery (its middleware layers, the
`Request`/`Response` objects, dependency solving, the exception-handler wrappers) costs
more CPU than everything else Ivy does: tokenizing, routing and the gRPC call together.
These routes need none of it: their bodies are read as bytes and parsed with orjson
anyway. `HotRoutes` answers them straight from the ASGI scope with the very same
handlers, so status codes, bodies, error envelopes and metrics are identical; every
other request (GETs, unknown paths, the OpenAPI document) passes through to FastAPI,
which still declares the hot routes so /openapi.json documents them.

Invariant: a hot route's answer depends only on its body, exactly the input
`Answer`-returning handlers receive on both paths (the API key was checked by
`ivy.middleware.Authenticate` before the body was read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from ivy.errors import CLIENT_CLOSED, BodyTooLargeError, InternalError, IvyError, request_id
from ivy.metrics import Metrics
from ivy.middleware import send_json

__all__ = ["Answer", "HotHandler", "HotRoutes"]

log = logging.getLogger("ivy")


@dataclass(frozen=True)
class Answer:
    """A complete JSON response: status, body and extra headers."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


# raw body -> the answer; raises IvyError for client errors.
HotHandler = Callable[[bytes], Awaitable[Answer]]


class _Disconnected(Exception):
    """The client went away before its body arrived: nobody is left to answer."""


class HotRoutes:
    """Serves ``POST`` on the paths of ``handlers`` itself; the rest goes to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        handlers: Mapping[str, HotHandler],
        metrics: Metrics,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.handlers = dict(handlers)
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        handler = self.handlers.get(path)
        if handler is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
                break
        try:
            body = await self._read_body(receive, declared)
            answer = await handler(body)
        except IvyError as exc:
            answer = Answer(exc.status, exc.body(), exc.headers or {})
        except _Disconnected:
            self._count(path, CLIENT_CLOSED, start)
            return
        except asyncio.CancelledError:
            self._count(path, CLIENT_CLOSED, start)  # the client left (`CancelOnDisconnect`)
            raise
        except Exception:
            log.exception("ivy: unexpected error on %s (request id %s)", path, request_id.get())
            answer = Answer(500, InternalError().body())
        try:
            await send_json(send, answer.status, answer.body, answer.headers)
        finally:
            self._count(path, answer.status, start)

    async def _read_body(self, receive: Receive, declared: bytes | None) -> bytes:
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLargeError(f"The request body exceeds {limit} bytes.")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLargeError(f"The request body exceeds {limit} bytes.")
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _count(self, route: str, status: int, start: float) -> None:
        self.metrics.requests.labels(route=route, status=str(status)).inc()
        self.metrics.request_seconds.labels(route=route).observe(time.perf_counter() - start)
