"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per event, ending
with ``data: [DONE]\\n\\n`` (or, when the stream fails after it started, an event
``data: {"error": {...}}`` and no ``[DONE]``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["DONE", "MEDIA_TYPE", "event", "raw_event", "response"]

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# Proxies must pass events through as they come, not buffer the response.
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: Any) -> bytes:
    """One ``data:`` event. orjson never emits raw newlines, so one line suffices."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def raw_event(json_bytes: bytes) -> bytes:
    """One ``data:`` event of an already serialized single-line JSON document."""
    return b"data: " + json_bytes + b"\n\n"


class _EventStream(StreamingResponse):
    """A streaming response that always cleans up: when the client disconnects Starlette
    stops iterating (possibly before the first event); then the generator is closed and
    ``on_close`` runs, whichever way the response ended."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: dict[str, str],
        on_close: Callable[[], None],
    ) -> None:
        super().__init__(events, media_type=MEDIA_TYPE, headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with contextlib.suppress(Exception):
                    await self._events.aclose()
            finally:
                self._on_close()


def response(
    events: AsyncGenerator[bytes, None],
    headers: dict[str, str] | None = None,
    on_close: Callable[[], None] = lambda: None,
) -> StreamingResponse:
    """A streaming response of encoded events; ``on_close`` runs when it ends, also when
    the client went away before or during the stream."""
    return _EventStream(events, {**_HEADERS, **(headers or {})}, on_close)
