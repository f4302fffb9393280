"""What a route is: one entry of Ivy's route table (`ivy.app.route_table`).

An entry names its method and path, the pydantic model its JSON body is validated with
(None: no body; a path whose last segment is a ``{parameter}`` hands the handler that rest
of the path, slashes included, as ``{"parameter": value}`` instead), the handler, the
dataclass its answer serializes from (which documents the 200 in /openapi.json), and, for routes that can stream, the event's dataclass. The
same entries serve requests (`ivy.app.IvyApp`), generate /openapi.json (`ivy.openapi`),
label metrics and say which paths are public. Adding a route is adding an entry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic

from ivy.sse import Stream

__all__ = ["Handler", "Reply", "Route", "match_path", "path_parameter"]


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete answer: a response dataclass (or plain JSON value) that orjson
    serializes, or raw bytes of `media_type`."""

    body: Any
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    media_type: bytes = b"application/json"


# The validated request (None for routes without a body) -> the answer. Client errors
# are raised as `ivy.errors.IvyError`s; `ivy.app` maps every exception to an answer.
Handler = Callable[[Any], Awaitable[Reply | Stream]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    request: type[pydantic.BaseModel] | None
    response: Any  # the 200's dataclass (or type); None: not JSON
    summary: str
    description: str = ""
    stream: Any = None  # the dataclass of one event, for routes that take `stream: true`
    public: bool = False  # served without an API key (probes, metrics, the API document)
    errors: tuple[int, ...] = (400, 401, 404, 413, 429, 503)
    media_type: str = "application/json"  # of the 200, when it is not JSON


def path_parameter(route: str) -> tuple[str, str] | None:
    """``/v1/models/{model}`` -> (``/v1/models/``, ``model``): a template's fixed head and
    its parameter's name; None for a fixed path."""
    head, brace, name = route.partition("{")
    return (head, name.rstrip("}")) if brace else None


def match_path(path: str, paths: Collection[str]) -> tuple[str, dict[str, str]] | None:
    """The route path of ``paths`` that ``path`` is, and its path parameters: ``path`` itself
    with none, or a template such as ``/v1/models/{model}`` whose parameter takes the rest
    of ``path`` (at least one character; a Hub id's slash included); None when neither."""
    if path in paths:
        return path, {}
    for route in paths:
        template = path_parameter(route)
        if template and path.startswith(template[0]) and len(path) > len(template[0]):
            return route, {template[1]: path[len(template[0]) :]}
    return None
