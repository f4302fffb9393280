"""/openapi.json, generated from the route table and nothing else.

Each `ivy.routes.Route` becomes one operation: its request model (validation schema) is
the request body, its response dataclass (serialization schema) the 200, its stream event
the 200's ``text/event-stream``, and each status in its `errors` the shared error
envelope. Schemas come from pydantic's generator; nested shapes land in
``components/schemas`` under their class names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import TypeAdapter

from ivy.routes import Route, path_parameter
from ivy.schemas import ErrorResponse

__all__ = ["document"]

_REF = "#/components/schemas/{model}"
_JSON = "application/json"
_STATUS_TEXT = {
    400: "Invalid request",
    401: "Missing or wrong API key",
    404: "Unknown model",
    405: "Method not allowed",
    413: "Body too large",
    429: "Every replica is at capacity (see Retry-After)",
    500: "Bug in the gateway (the message names the request id)",
    502: "A replica failed",
    503: "No healthy replica, or shutting down",
    504: "The request's deadline passed",
}
# Any route may answer these, whatever it documents besides.
_ALWAYS = (405, 500)


class _Components:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def ref(self, kind: Any, mode: Literal["validation", "serialization"]) -> dict[str, str]:
        """A reference to `kind`'s schema, adding it (and what it nests) when new; a
        generic type such as ``list[list[float]]`` is written inline."""
        named = dataclasses.is_dataclass(kind) or isinstance(kind, type)
        name = kind.__name__ if named else ""
        if named and name in self.schemas:
            return {"$ref": _REF.format(model=name)}
        schema = TypeAdapter(kind).json_schema(ref_template=_REF, mode=mode)
        defs = schema.pop("$defs", {})
        if mode == "serialization":
            # orjson writes every field of a dataclass, defaults included.
            for shape in (schema, *defs.values()):
                if "properties" in shape:
                    shape["required"] = list(shape["properties"])
        for nested, definition in defs.items():
            self.schemas.setdefault(nested, definition)
        if not named:
            return schema  # written inline
        self.schemas[name] = schema
        return {"$ref": _REF.format(model=name)}


def _operation(route: Route, components: _Components, served: list[str]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": route.method.lower()
        + route.path.replace("/", "_").replace("{", "").replace("}", ""),
    }
    if route.description:
        op["description"] = route.description
    template = path_parameter(route.path)
    if template:  # the last segment: a served model's name
        op["parameters"] = [
            {"name": template[1], "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    if route.request is not None:
        ref = components.ref(route.request, "validation")
        # Only the served names are accepted (others answer 404 model_not_found).
        schema = components.schemas[route.request.__name__]
        model = schema.get("properties", {}).get("model")
        if model is not None:
            optional = {"type": "null"} in model.get("anyOf", ())
            model["enum"] = [*served, None] if optional else served
        op["requestBody"] = {"required": True, "content": {_JSON: {"schema": ref}}}
    if route.response is None:
        ok = {route.media_type: {"schema": {"type": "string"}}}
    else:
        ok = {_JSON: {"schema": components.ref(route.response, "serialization")}}
    if route.stream is not None:
        ok["text/event-stream"] = {"schema": components.ref(route.stream, "serialization")}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    error = components.ref(ErrorResponse, "serialization")
    for status in sorted({*route.errors, *_ALWAYS}):
        responses[str(status)] = {
            "description": _STATUS_TEXT[status],
            "content": {_JSON: {"schema": error}},
        }
    op["responses"] = responses
    if not route.public:
        op["security"] = [{"bearer": []}, {}]  # a key is needed when keys are configured
    return op


def document(
    routes: Iterable[Route],
    served_models: Sequence[str],
    *,
    title: str,
    version: str,
    description: str,
    extra_schemas: Iterable[Any] = (),
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes` (`extra_schemas`: shapes to list besides,
    such as a stream's error event)."""
    components = _Components()
    served = sorted(served_models)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(
            route, components, served
        )
    for kind in extra_schemas:
        components.ref(kind, "serialization")
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {
            "schemas": components.schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
