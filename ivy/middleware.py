"""Ivy's pure-ASGI middleware, each with one job, outermost first:

* `RequestId`: names every request (``X-Request-Id``, kept from the client when it is a
  short token) and puts the id in `ivy.errors.request_id` for error bodies and the log;
* `Authenticate`: checks the API key from the headers before a byte of the body is read
  (a keyless client cannot make Ivy buffer a body);
* `CancelOnDisconnect`: once the request's body has arrived, a client that disconnects
  cancels its request, so replicas drop the work (nothing is computed for nobody).

Invariant: none of them reads the body for the app; `CancelOnDisconnect` only watches
for the disconnect after the app has read the whole body, and hands that message to the
app when it asks for more.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import uuid
from collections.abc import Collection, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ivy.errors import AuthenticationError, request_id

__all__ = ["Authenticate", "CancelOnDisconnect", "RequestId", "send_json"]

_JSON = b"application/json"
_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


async def send_json(send: Send, status: int, body: bytes, headers: Mapping[str, str]) -> None:
    """Answer with a complete JSON `body` and extra `headers` (no response started yet)."""
    raw = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestId:
    """Gives each HTTP request an id: the client's ``X-Request-Id`` when it is a short
    token, else a new one; echoed on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = b""
        for name, value in scope["headers"]:
            if name == b"x-request-id" and _CLIENT_ID.match(value):
                rid = value
                break
        if not rid:
            rid = uuid.uuid4().hex.encode()
        token = request_id.set(rid.decode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


class Authenticate:
    """Refuses (401) requests without a valid ``Authorization: Bearer KEY`` when keys are
    configured; `public` paths (health, metrics, the API document) need none."""

    def __init__(self, app: ASGIApp, keys: Collection[str], public: Collection[str]) -> None:
        self.app = app
        self.keys = [k.encode("latin-1", "replace") for k in keys]
        self.public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"] not in self.public:
            header = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                    break
            error = self.check(header)
            if error is not None:
                await send_json(send, error.status, error.body(), error.headers)
                return
        await self.app(scope, receive, send)

    def check(self, header: bytes) -> AuthenticationError | None:
        """None when `header` (raw bytes, any encoding) carries a configured key."""
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return AuthenticationError(
                "You didn't provide an API key. Send it as `Authorization: Bearer KEY`."
            )
        # Compare every key (constant time each), so timing tells nothing about which.
        matches = [hmac.compare_digest(token, key) for key in self.keys]
        if not any(matches):
            return AuthenticationError("Incorrect API key provided.")
        return None


class CancelOnDisconnect:
    """Cancels the request's task when its client disconnects after sending its body
    (before the response is complete); the cancellation ends here, so the server sees a
    request that simply produced no response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        disconnect: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        watcher: asyncio.Task[None] | None = None
        finished = cancelled = False

        async def watch() -> None:
            nonlocal cancelled
            message = await receive()
            while message["type"] != "http.disconnect":  # stray body frames: ignore them
                message = await receive()
            if not disconnect.done():
                disconnect.set_result(message)
            if not finished:
                cancelled = True
                task.cancel()

        async def guarded_receive() -> Message:
            nonlocal watcher
            if watcher is not None:
                return await asyncio.shield(disconnect)
            message = await receive()
            if message["type"] == "http.disconnect":
                if not disconnect.done():
                    disconnect.set_result(message)
            elif not message.get("more_body", False):
                # The body is complete: from now on, only a disconnect can arrive.
                watcher = asyncio.ensure_future(watch())
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except asyncio.CancelledError:
            if not cancelled or getattr(task, "cancelling", lambda: 1)() > 1:
                raise  # cancelled by someone else (too): server shutdown, pass it on
            if hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
            # Ours, for a client that left: nobody is left to answer.
        finally:
            finished = True
            if watcher is not None and not watcher.done():
                watcher.cancel()
