"""uvicorn's httptools protocol with a read timeout: a client gets ``read_timeout``
seconds to send a request's headers, and as long again for its body.

uvicorn times out only idle keep-alive connections; a client that sends its headers or
its body a byte at a time would hold a connection (and, past its headers, a request
task) for as long as it likes. Here the timer starts when the connection opens or a new
request's first byte arrives, restarts when the headers are complete, and stops when the
body is complete. When it fires before the headers are complete the client gets a bare
``408`` and the connection closes; during the body the connection just closes (the app
sees a disconnect and drops the request).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["READ_TIMEOUT_ATTR", "TimedHttpProtocol"]

# Attribute of uvicorn's Config carrying the timeout (it travels to worker processes with
# the Config, which a class made per value would not).
READ_TIMEOUT_ATTR = "ivy_read_timeout_seconds"

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class TimedHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` plus the header and body read timeout."""

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._read_timeout = float(getattr(config, READ_TIMEOUT_ATTR, 30.0))
        self._read_timer: asyncio.TimerHandle | None = None
        self._in_headers = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(in_headers=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(in_headers=True)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(in_headers=False)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def _arm(self, *, in_headers: bool) -> None:
        self._disarm()
        self._in_headers = in_headers
        self._read_timer = self.loop.call_later(self._read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        idle = self.cycle is None or self.cycle.response_complete
        if self._in_headers and idle:
            self.transport.write(_408)
        self.transport.close()
