"""Ivy's pure-ASGI middleware, each with one job, outermost first (`ivy.app` stacks them):

* `RequestId`: names every request (``X-Request-Id``, kept from the client when it is a
  short token) and puts the id in `ivy.errors.request_id` for error bodies and the log;
* `Trace`: an OpenTelemetry server span per request, continuing the client's
  ``traceparent`` (only in the stack when tracing is configured, see `protos.tracing`);
* `Cors`: answers browsers' preflights and marks answers to allowed origins (off unless
  origins are configured);
* `Authenticate`: checks the API key from the headers before a byte of the body is read
  (a keyless client cannot make Ivy buffer a body);
* `CancelOnDisconnect`: once the request's body has arrived, a client that disconnects
  cancels its request, so replicas drop the work (nothing is computed for nobody);
* `CountRequests`: counts and times requests by route and status;
* `LimitBody`: caps the body's size, by its declared length and by the bytes that arrive.

Invariant: none of them reads the body for the app; `CancelOnDisconnect` only watches
for the disconnect after the app has read the whole body, and hands that message to the
app when it asks for more.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import Collection

from ivy.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_json
from ivy.errors import CLIENT_CLOSED, AuthenticationError, BodyTooLargeError, request_id
from ivy.metrics import Metrics
from ivy.routes import match_path
from protos import tracing

__all__ = [
    "Authenticate",
    "CancelOnDisconnect",
    "CountRequests",
    "Cors",
    "LimitBody",
    "RequestId",
    "Trace",
    "route_label",
]

_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def route_label(scope: Scope, routes: frozenset[str]) -> str:
    """The request's route path (a template such as ``/v1/models/{model}`` for the paths it
    takes), else "other": metric labels and span names stay a bounded set, whatever paths
    clients send."""
    matched = match_path(scope["path"], routes)
    return matched[0] if matched else "other"


class RequestId:
    """Gives each HTTP request an id: the client's ``X-Request-Id`` when it is a short
    token, else a new one; echoed on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = header(scope, b"x-request-id") or b""
        if not _CLIENT_ID.match(rid):
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
            error = self.check(header(scope, b"authorization") or b"")
            if error is not None:
                await send_json(send, error.status, error.body(), error.headers)
                return
        await self.app(scope, receive, send)

    def check(self, value: bytes) -> AuthenticationError | None:
        """None when the header `value` (raw bytes, any encoding) carries a configured key."""
        scheme, _, token = value.partition(b" ")
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


class CountRequests:
    """Counts requests by route and status and times them; paths outside `routes` count
    as "other" (so random paths cannot grow the label set)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Collection[str]) -> None:
        self.app = app
        self.requests = metrics.requests
        self.seconds = metrics.request_seconds
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope, self.routes)
        status = CLIENT_CLOSED  # until a response starts: the client left first
        start = time.perf_counter()

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.requests.labels(route=route, status=str(status)).inc()
            self.seconds.labels(route=route).observe(time.perf_counter() - start)


class LimitBody:
    """Refuses a body over `limit` bytes (413): at once when its declared length is over,
    else when the bytes that arrive pass it (the app's read raises `BodyTooLargeError`)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = BodyTooLargeError(f"The request body exceeds {limit} bytes.")
            await send_json(send, error.status, error.body(), error.headers)
            return
        size = 0

        async def limited_receive() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                raise BodyTooLargeError(f"The request body exceeds {limit} bytes.")
            return message

        await self.app(scope, limited_receive, send)


class Cors:
    """CORS for browser clients of the listed origins ("*": any). A preflight (OPTIONS
    with ``Access-Control-Request-Method``) from an allowed origin is answered here,
    before authentication, as browsers send it without credentials; other answers to an
    allowed origin carry ``Access-Control-Allow-Origin``. With no origins it is a no-op."""

    _METHODS = b"GET, POST, OPTIONS"
    _MAX_AGE = b"600"

    def __init__(self, app: ASGIApp, origins: Collection[str]) -> None:
        self.app = app
        self.any = "*" in origins
        self.origins = frozenset(o.encode("latin-1") for o in origins)

    def _allowed(self, origin: bytes | None) -> bool:
        return origin is not None and (self.any or origin in self.origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.origins:
            await self.app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        if not self._allowed(origin):
            await self.app(scope, receive, send)
            return
        assert origin is not None
        allow = [(b"access-control-allow-origin", b"*" if self.any else origin)]
        if not self.any:
            allow.append((b"vary", b"Origin"))
        if scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method"):
            requested = header(scope, b"access-control-request-headers")
            headers = [
                *allow,
                (b"access-control-allow-methods", self._METHODS),
                (b"access-control-max-age", self._MAX_AGE),
                (b"content-length", b"0"),
            ]
            if requested:
                headers.append((b"access-control-allow-headers", requested))
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_allowed(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", ()),
                    *allow,
                    (b"access-control-expose-headers", b"X-Request-Id, Server-Timing, Retry-After"),
                ]
            await send(message)

        await self.app(scope, receive, send_allowed)


class Trace:
    """A server span per HTTP request, named by method and route, child of the client's
    ``traceparent`` when it sends one; the answer's status is recorded on it (5xx marks
    it failed). Spans opened while serving (tokenize, inference) nest under it."""

    def __init__(self, app: ASGIApp, routes: Collection[str]) -> None:
        self.app = app
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope, self.routes)
        parent = (header(scope, b"traceparent") or b"").decode("latin-1")
        attributes = {
            "http.request.method": scope["method"],
            "http.route": route,
            "url.path": scope["path"],
        }
        with tracing.server_span(f"{scope['method']} {route}", parent, **attributes) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(tracing.error_status())
                await send(message)

            await self.app(scope, receive, send_traced)
