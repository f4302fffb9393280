"""One rooted error hierarchy; each class knows its HTTP status and OpenAI error type.

Responses use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import random
from contextvars import ContextVar
from typing import Any, ClassVar

import orjson

__all__ = [
    "CLIENT_CLOSED",
    "AuthenticationError",
    "BodyTooLargeError",
    "DeadlineError",
    "InternalError",
    "IvyError",
    "MethodNotAllowedError",
    "ModelNotFoundError",
    "NotFoundError",
    "OverloadedError",
    "UnavailableError",
    "UpstreamError",
    "ValidationError",
    "error_body",
    "request_id",
]

# The status counted (and answered to nobody) when a client disconnected before its answer.
CLIENT_CLOSED = 499

# The id of the request being served (set by Ivy's request-id middleware; "" outside a
# request). Server errors name it, so a client can quote it and the log has the details.
request_id: ContextVar[str] = ContextVar("ivy_request_id", default="")


class IvyError(Exception):
    """Base of every error Ivy answers with; subclasses set status and type."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        message = self.message
        if self.status >= 500 and request_id.get():
            message = f"{message} (request id {request_id.get()})"
        return error_body(message, self.type, self.param, self.code)


class ValidationError(IvyError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(IvyError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(
            message,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


class NotFoundError(IvyError):
    status = 404
    type = "invalid_request_error"


class MethodNotAllowedError(IvyError):
    status = 405
    type = "invalid_request_error"

    def __init__(self, method: str, allowed: list[str]) -> None:
        super().__init__(
            f"Method {method} is not allowed here; use {' or '.join(allowed)}.",
            headers={"Allow": ", ".join(allowed)},
        )


class ModelNotFoundError(NotFoundError):
    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class BodyTooLargeError(IvyError):
    status = 413
    type = "invalid_request_error"


class OverloadedError(IvyError):
    """Every replica refused the work (their queues are full). ``Retry-After`` is
    jittered (1-3 s unless given) so refused clients do not come back in step."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_seconds: int | None = None) -> None:
        if retry_after_seconds is None:
            retry_after_seconds = random.randint(1, 3)
        super().__init__(
            message,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_seconds)},
        )


class UnavailableError(IvyError):
    """No healthy replica, or Ivy is draining."""

    status = 503
    type = "service_unavailable"


class UpstreamError(IvyError):
    """A replica failed in a way that is not the client's fault."""

    status = 502
    type = "server_error"


class InternalError(IvyError):
    """A bug in Ivy: the client gets a generic message and the request id, the log the
    traceback."""

    status = 500
    type = "server_error"

    def __init__(self) -> None:
        super().__init__("The server had an error processing your request.")


class DeadlineError(IvyError):
    status = 504
    type = "timeout"


def error_body(message: str, type_: str, param: str | None, code: str | None) -> bytes:
    payload: dict[str, Any] = {
        "error": {"message": message, "type": type_, "param": param, "code": code}
    }
    return orjson.dumps(payload)
