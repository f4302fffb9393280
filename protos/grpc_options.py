"""The gRPC connection settings Ivy (client) and Tulip (server) must agree on, in one place.

Message size: both sides accept the largest batch either may send.

Keepalive: a client pings its connection every ``KEEPALIVE_TIME_MS`` (also while no call
is open, and however long no data has flowed) so that a replica that died or froze
without closing its socket is noticed within ``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS``.
A gRPC server's default policy allows a ping only every 5 minutes while it sends no data;
pings more frequent than that count as strikes, and after ``grpc.http2.max_ping_strikes``
(2) it answers GOAWAY "too_many_pings" and closes the connection, failing every call on it
(Ivy's health watch and `Calls` stream among them) with UNAVAILABLE. The server therefore
accepts pings twice as often as clients send them.
"""

from __future__ import annotations

__all__ = [
    "CLIENT_OPTIONS",
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "MAX_MESSAGE_BYTES",
    "MIN_PING_INTERVAL_MS",
    "SERVER_OPTIONS",
]

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A client pings this often, and gives a ping this long to be answered.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# A server accepts pings this far apart (half the clients' interval: timer slack and a
# ping sent just after data are never taken for abuse).
MIN_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2

_MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    *_MESSAGE_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # 0: keep pinging an idle connection (the default stops after 2 pings without data,
    # which leaves a dead peer on an idle connection unnoticed until the next call).
    ("grpc.http2.max_pings_without_data", 0),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *_MESSAGE_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 2),
)
