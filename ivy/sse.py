"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per event, ending
with ``data: [DONE]\\n\\n`` (or, when the stream fails after it started, an event
``data: {"error": {...}}`` and no ``[DONE]``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ivy.asgi import Send

__all__ = ["DONE", "MEDIA_TYPE", "Stream", "event", "raw_event", "send_stream"]

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# Proxies must pass events through as they come, not buffer the response.
_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(payload: Any) -> bytes:
    """One ``data:`` event (a dataclass or plain JSON value). orjson never emits raw
    newlines, so one line suffices."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def raw_event(json_bytes: bytes) -> bytes:
    """One ``data:`` event of an already serialized single-line JSON document."""
    return b"data: " + json_bytes + b"\n\n"


@dataclass
class Stream:
    """A handler's streamed answer: encoded events, extra headers, and `on_close`, which
    runs when the stream ends, however it ends (also when the client left first)."""

    events: AsyncGenerator[bytes, None]
    headers: Mapping[str, str] = field(default_factory=dict)
    on_close: Callable[[], None] = lambda: None


async def send_stream(send: Send, stream: Stream) -> None:
    """Send `stream` as a 200 ``text/event-stream`` response. A client that leaves
    cancels the sending task (`ivy.middleware.CancelOnDisconnect`); the generator is
    closed and `on_close` runs either way."""
    headers = [(b"content-type", MEDIA_TYPE.encode())]
    headers += [(k.encode(), v.encode("latin-1")) for k, v in _HEADERS.items()]
    headers += [(k.lower().encode(), v.encode("latin-1")) for k, v in stream.headers.items()]
    try:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in stream.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        try:
            with contextlib.suppress(Exception):
                await stream.events.aclose()
        finally:
            stream.on_close()
