"""Tulip's error hierarchy and the one table that maps it to gRPC status codes."""

from __future__ import annotations

import grpc

__all__ = [
    "DeadlineExpired",
    "Draining",
    "EngineFailed",
    "InvalidInput",
    "NotReady",
    "Overloaded",
    "TulipError",
    "status_code",
]


class TulipError(Exception):
    """Root of every error Tulip answers a request with."""


class InvalidInput(TulipError):
    """The request is malformed or does not fit the model; the message says which input."""


class Overloaded(TulipError):
    """Admitting the request would exceed the queued-token limit."""


class Draining(TulipError):
    """The server is shutting down and admits no new work."""


class NotReady(TulipError):
    """The model is not loaded and warmed up yet."""


class DeadlineExpired(TulipError):
    """The request's deadline passed before it reached the engine."""


class EngineFailed(TulipError):
    """The engine raised while computing the batch holding this request."""


_CODES: dict[type[TulipError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    EngineFailed: grpc.StatusCode.INTERNAL,
}


def status_code(error: TulipError) -> grpc.StatusCode:
    """The gRPC status a request failing with `error` is answered with."""
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL
