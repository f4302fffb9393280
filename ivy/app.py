"""The FastAPI application of one Ivy worker.

Bodies are read as bytes (with a size cap), parsed with orjson and validated with the
strict models in `ivy.schemas`; responses are serialized with orjson. The same models
are attached to /openapi.json so it documents exactly what is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ivy.config import WORKER_CONFIG_ENV, IvyConfig
from ivy.errors import (
    CLIENT_CLOSED,
    BodyTooLargeError,
    InternalError,
    IvyError,
    ValidationError,
    error_body,
    request_id,
)
from ivy.gateway import Gateway, Timings
from ivy.generation_api import CHAT_ROUTE, COMPLETIONS_ROUTE, add_generation_routes
from ivy.hot_routes import Answer, HotHandler, HotRoutes
from ivy.metrics import Metrics
from ivy.middleware import Authenticate, CancelOnDisconnect, RequestId
from ivy.models import ServedModel
from ivy.replicas import ReplicaPool
from ivy.schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelList,
    RerankRequest,
    RerankResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from ivy.tokenization import TokenizationError

__all__ = ["create_app", "create_app_from_env"]

log = logging.getLogger("ivy")

_JSON = "application/json"
_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
_ERRORS = {
    str(status): {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Body too large"),
        (429, "Every replica is at capacity"),
        (503, "No healthy replica or shutting down"),
    )
}
# Served without an API key: probes, metrics and the API's own description.
_PUBLIC_PATHS = (
    "/health/live",
    "/health/ready",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
)
_ROUTES = {
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/models",
    "/tokenize",
    "/health/live",
    "/health/ready",
    "/metrics",
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
}


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(payload, option=_ORJSON_OPTS), status, headers=headers, media_type=_JSON
    )


def _error_response(exc: IvyError) -> Response:
    return Response(exc.body(), exc.status, headers=exc.headers, media_type=_JSON)


class _MetricsMiddleware:
    """Counts requests by route and status and times them (pure ASGI: no body copies)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        status = 500
        started = False
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if not started:
                status = CLIENT_CLOSED  # the client left (`CancelOnDisconnect`)
            raise
        finally:
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.request_seconds.labels(route=route).observe(time.perf_counter() - start)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(f"The request body exceeds {max_bytes} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLargeError(f"The request body exceeds {max_bytes} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes, model: type[pydantic.BaseModel]) -> Any:
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValidationError(
            "We could not parse the JSON body of your request. Send valid JSON."
        ) from None
    if not isinstance(raw, dict):
        raise ValidationError("The request body must be a JSON object.")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: pydantic.ValidationError) -> ValidationError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if param == "input" and len(errors) > 1:
        message = (
            "Invalid 'input': expected a non-empty string, an array of non-empty strings, "
            "an array of token ids or an array of arrays of token ids."
        )
    else:
        where = ".".join(str(p) for p in first["loc"])
        message = f"Invalid '{where}': {first['msg']}." if where else f"{first['msg']}."
    return ValidationError(message, param=param)


def create_app(config: IvyConfig) -> FastAPI:
    """A new app for this config; pools connect at startup and close at shutdown."""
    metrics = Metrics.create()
    api_keys = config.all_api_keys()
    state: dict[str, Gateway] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        models = {
            name: ServedModel.load(name, d, config.tokenizer_word_cache)
            for name, d in config.models.items()
        }
        pools: dict[str, ReplicaPool] = {}
        gateway = Gateway(
            models,
            pools,
            metrics,
            chunk_tokens=config.chunk_tokens,
            max_inputs=config.max_inputs,
            request_timeout_s=config.request_timeout_seconds,
            max_input_chars=config.max_input_chars,
            hedge_after_s=config.hedge_after_seconds,
        )
        for name in models:
            pool = ReplicaPool(
                name, metrics, gateway.on_replica_info, config.health_interval_seconds
            )
            pools[name] = pool
            if name in config.replicas:
                pool.set_addresses(config.replicas[name])
            else:
                pool.start_dns(config.replicas_dns[name], config.dns_refresh_seconds)
        state["gateway"] = gateway
        app.state.ivy_gateway = gateway  # read by ivy.__main__'s server to flag draining
        try:
            yield
        finally:
            gateway.draining = True
            for pool in pools.values():
                await pool.close()

    app = FastAPI(
        title="Trellis Ivy",
        version="0.1.0",
        description="OpenAI-compatible embeddings and Cohere/Jina-compatible rerank.",
        lifespan=lifespan,
    )

    def gateway() -> Gateway:
        return state["gateway"]

    @app.exception_handler(IvyError)
    async def _ivy_error(request: Request, exc: IvyError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, None, None)
        return Response(body, exc.status_code, headers=exc.headers, media_type=_JSON)

    @app.exception_handler(RequestValidationError)
    async def _request_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(ValidationError(str(exc.errors()[0].get("msg", "invalid"))))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error(
            "ivy: unexpected error on %s (request id %s)",
            request.url.path,
            request_id.get(),
            exc_info=exc,
        )
        return _error_response(InternalError())

    hot: dict[str, HotHandler] = {}

    def endpoint(
        model: type[pydantic.BaseModel],
        run: Callable[[Any, Timings], Awaitable[dict[str, Any]]],
        route: str,
    ) -> Callable[[Request], Awaitable[Response]]:
        tokenize_seconds = metrics.tokenize_seconds.labels(route=route)
        inference_seconds = metrics.inference_seconds.labels(route=route)
        chunks_per_request = metrics.chunks_per_request.labels(route=route)

        async def answer(body: bytes) -> Answer:
            req = _parse(body, model)
            timings = Timings()
            try:
                payload = await run(req, timings)
            except TokenizationError as exc:
                raise ValidationError(f"The input could not be tokenized: {exc}") from None
            tokenize_seconds.observe(timings.tokenize_s)
            inference_seconds.observe(timings.inference_s)
            chunks_per_request.observe(timings.chunks)
            return Answer(
                200,
                orjson.dumps(payload, option=_ORJSON_OPTS),
                {"Server-Timing": timings.header()},
            )

        # Requests reach `answer` through `HotRoutes`; this FastAPI twin serves the same
        # answer to in-process callers of the bare app and documents the route.
        async def handle(request: Request) -> Response:
            body = await _read_body(request, config.max_body_bytes)
            result = await answer(body)
            return Response(result.body, result.status, dict(result.headers), media_type=_JSON)

        hot[route] = answer
        return handle

    def add_post(
        path: str, handle: Callable[..., Any], req: type, resp: type, summary: str
    ) -> None:
        app.add_api_route(
            path,
            handle,
            methods=["POST"],
            summary=summary,
            response_model=None,
            responses={"200": {"model": resp, "description": "OK"}, **_ERRORS},
            openapi_extra={"x-ivy-request-model": req.__name__},
        )

    async def run_embeddings(req: EmbeddingRequest, timings: Timings) -> dict[str, Any]:
        return await gateway().embeddings(req, timings)

    async def run_rerank(req: RerankRequest, timings: Timings) -> dict[str, Any]:
        return await gateway().rerank(req, timings)

    async def run_tokenize(req: TokenizeRequest, timings: Timings) -> dict[str, Any]:
        return await gateway().tokenize(req)

    add_post(
        "/v1/embeddings",
        endpoint(EmbeddingRequest, run_embeddings, "/v1/embeddings"),
        EmbeddingRequest,
        EmbeddingResponse,
        "Create embeddings (OpenAI)",
    )
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        add_post(
            path,
            endpoint(RerankRequest, run_rerank, path),
            RerankRequest,
            RerankResponse,
            "Rerank documents (Cohere v2 / Jina)",
        )
    add_post(
        "/tokenize",
        endpoint(TokenizeRequest, run_tokenize, "/tokenize"),
        TokenizeRequest,
        TokenizeResponse,
        "Token ids and character offsets",
    )

    @app.get(
        "/v1/models",
        response_model=None,
        responses={"200": {"model": ModelList, "description": "OK"}, "401": _ERRORS["401"]},
    )
    async def list_models() -> Response:
        return _json(gateway().list_models())

    @app.get("/health/live", response_model=None)
    async def live() -> Response:
        return _json({"status": "ok"})

    @app.get(
        "/health/ready",
        response_model=None,
        responses={"503": {"description": "Not ready"}},
    )
    async def ready() -> Response:
        ok, healthy = gateway().ready()
        status = "ready" if ok else ("draining" if gateway().draining else "not_ready")
        return _json({"status": status, "healthy_replicas": healthy}, 200 if ok else 503)

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    schema_models = {m.__name__: m for m in (EmbeddingRequest, RerankRequest, TokenizeRequest)}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path_item in schema["paths"].values():
            for operation in path_item.values():
                name = operation.pop("x-ivy-request-model", None)
                if name is None:
                    continue
                model_schema = schema_models[name].model_json_schema(
                    ref_template="#/components/schemas/{model}"
                )
                for def_name, definition in model_schema.pop("$defs", {}).items():
                    components.setdefault(def_name, definition)
                # Only the served names are accepted (others answer 404 model_not_found).
                model_schema["properties"]["model"]["enum"] = sorted(config.models)
                components[name] = model_schema
                operation["requestBody"] = {
                    "required": True,
                    "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{name}"}}},
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    add_generation_routes(
        app,
        gateway=gateway,
        metrics=metrics,
        read_body=lambda request: _read_body(request, config.max_body_bytes),
        parse=_parse,
        timeout_seconds=config.generation_timeout_seconds,
        served_models=sorted(config.models),
    )
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    # Hot POSTs skip the rest of the stack.
    app.add_middleware(
        HotRoutes, handlers=hot, metrics=metrics, max_body_bytes=config.max_body_bytes
    )
    # Outermost: each request gets an id, then its key is checked before its body is read,
    # and a client that leaves cancels its request.
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(Authenticate, keys=api_keys, public=_PUBLIC_PATHS)
    app.add_middleware(RequestId)
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn factory for worker processes: the config travels serialized in the env."""
    return create_app(IvyConfig.from_json(os.environ[WORKER_CONFIG_ENV]))
