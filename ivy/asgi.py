"""The ASGI vocabulary Ivy is written in, and the two primitives every answer uses.

Ivy is a plain ASGI application (`ivy.app.IvyApp`) behind a few pure-ASGI middleware
(`ivy.middleware`); nothing here depends on a web framework.

Invariant: `read_body` is the only reader of a request body, and `send_json` starts and
completes a response in two messages (so middleware that watch for the last body message,
like `ivy.middleware.CancelOnDisconnect`, see it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = [
    "ASGIApp",
    "JSON",
    "Disconnected",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "header",
    "read_body",
    "send_body",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"


class Disconnected(Exception):
    """The client went away before its body arrived: nobody is left to answer."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of request header `name` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(receive: Receive) -> bytes:
    """The whole request body (its size is capped by `ivy.middleware.LimitBody`)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_body(
    send: Send, status: int, body: bytes, media_type: bytes, headers: Mapping[str, str]
) -> None:
    """Answer with a complete `body` and extra `headers` (no response started yet)."""
    raw = [(b"content-type", media_type), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, body: bytes, headers: Mapping[str, str]) -> None:
    """Answer with a complete JSON `body` (already serialized)."""
    await send_body(send, status, body, JSON, headers)
