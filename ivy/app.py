"""One Ivy worker: the route table, the exception map, and the ASGI app serving them.

`route_table` lists every route once (`ivy.routes.Route`); `IvyApp` serves the table
(body read once, validated by the route's request model, the handler's answer serialized
by orjson), generates /openapi.json from it (`ivy.openapi`), labels metrics by its paths
and lets through its public paths without a key. The middleware stack (`ivy.middleware`)
wraps it, one job per layer.

Invariant: every exception a handler raises becomes an answer in OpenAI's error envelope
through `error_for`, the one exception map; a cancellation (the client left, or shutdown)
is never turned into an answer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import pydantic

from ivy import sse
from ivy.asgi import (
    ASGIApp,
    Disconnected,
    Receive,
    Scope,
    Send,
    read_body,
    send_body,
    send_json,
)
from ivy.config import WORKER_CONFIG_ENV, IvyConfig, context_limits
from ivy.errors import (
    InternalError,
    IvyError,
    MethodNotAllowedError,
    NotFoundError,
    ValidationError,
)
from ivy.gateway import Gateway, Timings
from ivy.generation import GenerationMetrics, GenerationService
from ivy.generation_api import STREAM_SCHEMAS, generation_routes
from ivy.generation_schemas import MAX_STOP_CHARS
from ivy.metrics import Metrics
from ivy.middleware import (
    Authenticate,
    CancelOnDisconnect,
    Cors,
    CountRequests,
    LimitBody,
    RequestId,
    Trace,
)
from ivy.models import ServedModel
from ivy.openapi import document
from ivy.replicas import ReplicaPool
from ivy.routes import Reply, Route, match_path
from ivy.schemas import (
    VERSION,
    ClassifyRequest,
    ClassifyResponse,
    CohereEmbedRequest,
    CohereEmbedResponse,
    ContextualizedEmbeddingRequest,
    ContextualizedEmbeddingResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    Health,
    ModelCard,
    ModelList,
    Readiness,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TeiDecodeRequest,
    TeiEmbedAllRequest,
    TeiEmbedRequest,
    TeiEmbedSparseRequest,
    TeiInfo,
    TeiPrediction,
    TeiPredictRequest,
    TeiRank,
    TeiRankWithText,
    TeiSimilarityRequest,
    TeiSparseValue,
    TeiToken,
    TokenizeRequest,
    TokenizeResponse,
    VllmTokenizeResponse,
)
from ivy.tokenization import TokenizationError
from protos import tracing

__all__ = ["IvyApp", "create_app", "create_app_from_env", "error_for", "route_table"]

log = logging.getLogger("ivy")

_TITLE = "Trellis Ivy"
_DESCRIPTION = "OpenAI-compatible embeddings, chat and completions; Cohere/Jina-compatible rerank."
_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
# A union's first failing branch says little; these name the accepted forms instead (a
# request class's own entry first, then the field's).
_REQUEST_FORMS = {
    (ContextualizedEmbeddingRequest, "input"): (
        "Invalid 'input': expected a non-empty array of documents, each a non-empty array of "
        "non-empty strings (its chunks, in order)."
    ),
    (TokenizeRequest, "input"): (
        "Invalid 'input': expected a non-empty string or an array of non-empty strings."
    ),
    (TokenizeRequest, "inputs"): (
        "Invalid 'inputs': expected a non-empty string or an array of non-empty strings."
    ),
}
_FORMS = {
    "input": (
        "Invalid 'input': expected a non-empty string, an array of non-empty strings, "
        "an array of token ids or an array of arrays of token ids."
    ),
    "prompt": (
        "Invalid 'prompt': expected a string, an array of strings, an array of token ids or "
        "an array of arrays of token ids."
    ),
    "stop": (
        f"Invalid 'stop': expected a string or an array of at most 4 strings, each of 1 to "
        f"{MAX_STOP_CHARS} characters."
    ),
}
_DOCS_PAGE = b"""<!doctype html>
<html><head><title>Trellis Ivy</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head><body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>"""


# ---- the exception map -------------------------------------------------------------------
def error_for(exc: Exception, path: str) -> IvyError:
    """The answer to an exception raised while serving `path`."""
    if isinstance(exc, IvyError):
        return exc
    if isinstance(exc, TokenizationError):
        return ValidationError(f"The input could not be tokenized: {exc}")
    log.error("ivy: unexpected error on %s", path, exc_info=exc)  # the line names the request
    return InternalError()


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_tag(part: object) -> bool:
    """Whether a part of a pydantic error location names a member of a union (``str``,
    ``RerankDocument``, ``list[constrained-int]``) rather than a field or an index."""
    return isinstance(part, str) and (
        part in _UNION_TAGS or "[" in part or "-" in part or part[:1].isupper()
    )


def _validation_error(
    exc: pydantic.ValidationError, request: type[pydantic.BaseModel]
) -> ValidationError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
    forms = _REQUEST_FORMS.get((request, param or ""), _FORMS.get(param or ""))
    if forms is not None and (len(errors) > 1 or param != "input"):
        return ValidationError(forms, param=param)
    # A value that fits no member of a union fails once per member: report the member it
    # got furthest into (the deepest location; then an error past the type check, such as
    # "too short", over "should be a string"), located without the members' names.
    first = max(errors, key=lambda e: (len(e["loc"]), not str(e["type"]).endswith("_type")))
    where = ".".join(str(p) for p in first["loc"] if not _union_tag(p))
    text = first["msg"].removeprefix("Value error, ")  # a validator's own words
    message = f"Invalid '{where}': {text}." if where else f"{text[:1].upper()}{text[1:]}."
    return ValidationError(message, param=param)


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
        raise _validation_error(exc, model) from None


# ---- the route table ---------------------------------------------------------------------
def _timed(
    metrics: Metrics, path: str, run: Callable[[Any, Timings], Awaitable[Any]]
) -> Callable[[Any], Awaitable[Reply]]:
    """A handler that times `run`'s phases into the route's histograms and the answer's
    ``Server-Timing`` header."""
    tokenize_seconds = metrics.tokenize_seconds.labels(route=path)
    inference_seconds = metrics.inference_seconds.labels(route=path)
    chunks_per_request = metrics.chunks_per_request.labels(route=path)

    async def handle(req: Any) -> Reply:
        timings = Timings()
        body = await run(req, timings)
        tokenize_seconds.observe(timings.tokenize_s)
        inference_seconds.observe(timings.inference_s)
        chunks_per_request.observe(timings.chunks)
        return Reply(body, headers={"Server-Timing": timings.header()})

    return handle


def route_table(app: IvyApp) -> list[Route]:
    """Every route Ivy serves; handlers reach the gateway through `app` once started."""
    metrics = app.metrics

    def gateway() -> Gateway:
        assert app.gateway is not None, "the app serves requests only after its startup"
        return app.gateway

    async def embeddings(req: EmbeddingRequest, timings: Timings) -> EmbeddingResponse:
        return await gateway().embeddings(req, timings)

    async def contextualized(
        req: ContextualizedEmbeddingRequest, timings: Timings
    ) -> ContextualizedEmbeddingResponse:
        return await gateway().contextualized(req, timings)

    async def rerank(
        req: RerankRequest, timings: Timings
    ) -> RerankResponse | list[TeiRankWithText] | list[TeiRank]:
        return await gateway().rerank(req, timings)

    async def score(req: ScoreRequest, timings: Timings) -> ScoreResponse:
        return await gateway().score(req, timings)

    async def classify(req: ClassifyRequest, timings: Timings) -> ClassifyResponse:
        return await gateway().classify(req, timings)

    async def tei_embed(req: TeiEmbedRequest, timings: Timings) -> np.ndarray:
        return await gateway().tei_embed(req, timings)

    async def tei_embed_sparse(
        req: TeiEmbedSparseRequest, timings: Timings
    ) -> list[list[TeiSparseValue]]:
        return await gateway().tei_embed_sparse(req, timings)

    async def tei_embed_all(req: TeiEmbedAllRequest, timings: Timings) -> list[np.ndarray]:
        return await gateway().tei_embed_all(req, timings)

    async def cohere_embed(req: CohereEmbedRequest, timings: Timings) -> CohereEmbedResponse:
        return await gateway().cohere_embed(req, timings)

    async def tei_similarity(req: TeiSimilarityRequest, timings: Timings) -> np.ndarray:
        return await gateway().tei_similarity(req, timings)

    async def tei_predict(
        req: TeiPredictRequest, timings: Timings
    ) -> list[TeiPrediction] | list[list[TeiPrediction]]:
        return await gateway().tei_predict(req, timings)

    async def tei_decode(req: TeiDecodeRequest) -> Reply:
        return Reply(gateway().tei_decode(req))

    async def tei_info(_: None) -> Reply:
        return Reply(gateway().tei_info())

    async def tokenize(req: TokenizeRequest) -> Reply:
        only_messages = req.messages is not None and all(
            shape is None for shape in (req.input, req.inputs, req.prompt)
        )
        if only_messages:
            return Reply(await service.tokenize_chat(req))
        return Reply(await gateway().tokenize(req))

    async def detokenize(req: DetokenizeRequest) -> Reply:
        return Reply(gateway().detokenize(req))

    async def models(_: None) -> Reply:
        return Reply(gateway().list_models())

    async def model_card(params: dict[str, str]) -> Reply:
        return Reply(gateway().model_card(params["model"]))

    async def live(_: None) -> Reply:
        return Reply(Health("ok"))

    async def ready(_: None) -> Reply:
        gw = gateway()
        ok, healthy = gw.ready()
        status = "ready" if ok else ("draining" if gw.draining else "not_ready")
        return Reply(Readiness(status, healthy), 200 if ok else 503)

    async def prometheus(_: None) -> Reply:
        return Reply(metrics.render(), media_type=b"text/plain; version=0.0.4; charset=utf-8")

    async def openapi(_: None) -> Reply:
        return Reply(app.openapi())

    async def docs(_: None) -> Reply:
        return Reply(_DOCS_PAGE, media_type=b"text/html; charset=utf-8")

    service = GenerationService(
        gateway, GenerationMetrics.create(metrics.registry), app.config.generation_timeout_seconds
    )
    errors = (400, 401, 404, 413, 429, 502, 503, 504)
    rerank_routes = [
        Route(
            "POST",
            path,
            _timed(metrics, path, rerank),
            RerankRequest,
            RerankResponse | list[TeiRankWithText | TeiRank],
            "Rerank documents (Cohere v2 / Jina; TEI's shape with `texts`)",
            errors=errors,
        )
        for path in ("/v1/rerank", "/v2/rerank", "/rerank")
    ]
    # TEI and Infinity also serve OpenAI's embeddings at /embeddings (a client whose
    # base URL has no /v1)
    embedding_routes = [
        Route(
            "POST",
            path,
            _timed(metrics, path, embeddings),
            EmbeddingRequest,
            EmbeddingResponse,
            "Create embeddings (OpenAI)",
            errors=errors,
        )
        for path in ("/v1/embeddings", "/embeddings")
    ]
    score_routes = [
        Route(
            "POST",
            path,
            _timed(metrics, path, score),
            ScoreRequest,
            ScoreResponse,
            "Score text pairs, 1:1, 1:N or N:N (vLLM)",
            errors=errors,
        )
        for path in ("/score", "/v1/score")
    ]
    return [
        *embedding_routes,
        Route(
            "POST",
            "/v1/contextualizedembeddings",
            _timed(metrics, "/v1/contextualizedembeddings", contextualized),
            ContextualizedEmbeddingRequest,
            ContextualizedEmbeddingResponse,
            "Embed document chunks in their document's context (Perplexity)",
            errors=errors,
        ),
        *rerank_routes,
        *score_routes,
        Route(
            "POST",
            "/classify",
            _timed(metrics, "/classify", classify),
            ClassifyRequest,
            ClassifyResponse,
            "Classify texts: each one's class probabilities and likeliest label (vLLM)",
            errors=errors,
        ),
        Route(
            "POST",
            "/v2/embed",
            _timed(metrics, "/v2/embed", cohere_embed),
            CohereEmbedRequest,
            CohereEmbedResponse,
            "Create embeddings of several types (Cohere v2)",
            errors=errors,
        ),
        Route(
            "POST",
            "/embed",
            _timed(metrics, "/embed", tei_embed),
            TeiEmbedRequest,
            list[list[float]],
            "Create embeddings (Text Embeddings Inference)",
            errors=errors,
        ),
        Route(
            "POST",
            "/embed_sparse",
            _timed(metrics, "/embed_sparse", tei_embed_sparse),
            TeiEmbedSparseRequest,
            list[list[TeiSparseValue]],
            "Sparse embeddings: token id -> weight (TEI; BGE-M3, SPLADE)",
            errors=errors,
        ),
        Route(
            "POST",
            "/embed_all",
            _timed(metrics, "/embed_all", tei_embed_all),
            TeiEmbedAllRequest,
            list[list[list[float]]],
            "Every token's last hidden state (TEI)",
            errors=errors,
        ),
        Route(
            "POST",
            "/similarity",
            _timed(metrics, "/similarity", tei_similarity),
            TeiSimilarityRequest,
            list[float],
            "Cosine similarity of a sentence with others (TEI)",
            errors=errors,
        ),
        Route(
            "POST",
            "/predict",
            _timed(metrics, "/predict", tei_predict),
            TeiPredictRequest,
            list[TeiPrediction] | list[list[TeiPrediction]],
            "Classify texts or pairs (TEI)",
            errors=errors,
        ),
        Route(
            "POST",
            "/decode",
            tei_decode,
            TeiDecodeRequest,
            list[str],
            "Token ids back to text (TEI)",
            errors=(400, 401, 404, 413),
        ),
        Route("GET", "/info", tei_info, None, TeiInfo, "Model facts (TEI)", errors=(400, 401)),
        Route(
            "POST",
            "/tokenize",
            tokenize,
            TokenizeRequest,
            TokenizeResponse | list[list[TeiToken]] | VllmTokenizeResponse,
            "Token ids and character offsets (Trellis; TEI's shape with `inputs`, vLLM's "
            "with `prompt`)",
            errors=(400, 401, 404, 413),
        ),
        Route(
            "POST",
            "/detokenize",
            detokenize,
            DetokenizeRequest,
            DetokenizeResponse,
            "Token ids back to text (vLLM)",
            errors=(400, 401, 404, 413),
        ),
        *generation_routes(service),
        Route("GET", "/v1/models", models, None, ModelList, "Served models", errors=(401,)),
        Route(
            "GET",
            "/v1/models/{model}",
            model_card,
            None,
            ModelCard,
            "One served model (404 model_not_found for others)",
            errors=(401, 404),
        ),
        Route("GET", "/health/live", live, None, Health, "Liveness", public=True, errors=()),
        *(
            Route(
                "GET",
                path,
                ready,
                None,
                Readiness,
                "Readiness: 503 (same shape) while a model has no healthy replica or draining"
                + (" (TEI's, vLLM's and Infinity's probe path)" if path == "/health" else ""),
                public=True,
                errors=(503,),
            )
            for path in ("/health/ready", "/health")
        ),
        Route(
            "GET",
            "/metrics",
            prometheus,
            None,
            None,
            "Prometheus metrics",
            public=True,
            errors=(),
            media_type="text/plain",
        ),
        Route(
            "GET",
            "/openapi.json",
            openapi,
            None,
            dict[str, Any],
            "This document",
            public=True,
            errors=(),
        ),
        Route(
            "GET",
            "/docs",
            docs,
            None,
            None,
            "Interactive API docs (Swagger UI)",
            public=True,
            errors=(),
            media_type="text/html",
        ),
    ]


# ---- the app -----------------------------------------------------------------------------
class IvyApp:
    """The ASGI app of one worker: lifespan (replica pools connect at startup and close at
    shutdown) and the middleware stack around `_serve`."""

    def __init__(self, config: IvyConfig) -> None:
        self.config = config
        self.metrics = Metrics.create()
        self.gateway: Gateway | None = None  # set at startup
        self.routes = route_table(self)
        self._routes = {(r.method, r.path): r for r in self.routes}
        self._methods: dict[str, list[str]] = {}
        for route in self.routes:
            self._methods.setdefault(route.path, []).append(route.method)
            if route.method == "GET":  # RFC 9110: HEAD wherever GET; uvicorn drops the body
                self._routes[("HEAD", route.path)] = route
                self._methods[route.path].append("HEAD")
        self._openapi: dict[str, Any] | None = None
        public = [r.path for r in self.routes if r.public]
        stack: ASGIApp = self._serve
        stack = LimitBody(stack, config.max_body_bytes)
        stack = CountRequests(stack, self.metrics, self._methods)
        stack = CancelOnDisconnect(stack)
        keys = config.all_api_keys()
        if keys:  # layers that would only pass requests on are left out
            stack = Authenticate(stack, keys=keys, public=public)
        if config.cors_allow_origins:
            stack = Cors(stack, config.cors_allow_origins)
        if not tracing.enabled():
            tracing.configure_from_env("ivy")  # the standard OTEL_* variables; off by default
        if tracing.enabled():
            stack = Trace(stack, self._methods)
        self._stack = RequestId(stack)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self._stack(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        if self._openapi is None:
            self._openapi = document(
                self.routes,
                list(self.config.models),
                title=_TITLE,
                version=VERSION,
                description=_DESCRIPTION,
                extra_schemas=STREAM_SCHEMAS,
            )
        return self._openapi

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets: the server closes the connection
        path = scope["path"]
        matched = match_path(path, self._methods)
        route = self._routes.get((scope["method"], matched[0])) if matched else None
        try:
            if route is None:
                if matched is None:
                    raise NotFoundError(f"No route {path}.")
                raise MethodNotAllowedError(scope["method"], self._methods[matched[0]])
            request: Any = matched[1] if matched[1] else None  # path parameters
            if route.request is not None:
                request = _parse(await read_body(receive), route.request)
            reply = await route.handler(request)
        except Disconnected:
            return  # nobody is left to answer
        except Exception as exc:  # noqa: BLE001 - the exception map answers every one
            error = error_for(exc, path)
            await send_json(send, error.status, error.body(), error.headers)
            return
        if isinstance(reply, sse.Stream):
            await sse.send_stream(send, reply)
            return
        body = reply.body
        if not isinstance(body, bytes):
            body = orjson.dumps(body, option=_ORJSON_OPTS)
        await send_body(send, reply.status, body, reply.media_type, reply.headers)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        pools: dict[str, ReplicaPool] = {}
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.gateway = self._start(pools)
                except Exception as exc:  # noqa: BLE001 - reported to the server, which exits
                    log.exception("ivy: startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.gateway is not None:
                    self.gateway.draining = True
                for pool in pools.values():
                    await pool.close()
                tracing.shutdown()  # flush the last spans
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _start(self, pools: dict[str, ReplicaPool]) -> Gateway:
        config = self.config
        models = {
            name: ServedModel.load(name, d, config.tokenizer_word_cache)
            for name, d in config.models.items()
        }
        gateway = Gateway(
            models,
            pools,
            self.metrics,
            chunk_tokens=config.chunk_tokens,
            max_inputs=config.max_inputs,
            request_timeout_s=config.request_timeout_seconds,
            max_input_chars=config.max_input_chars,
            hedge_after_s=config.hedge_after_seconds,
            auto_truncate=config.auto_truncate,
            max_connections=config.max_connections,
            context_limits=context_limits(config),
        )
        for name in models:
            pool = ReplicaPool(
                name, self.metrics, gateway.on_replica_info, config.health_interval_seconds
            )
            pools[name] = pool
            if name in config.replicas:
                pool.set_addresses(config.replicas[name])
            else:
                pool.start_dns(config.replicas_dns[name], config.dns_refresh_seconds)
        return gateway


def create_app(config: IvyConfig) -> IvyApp:
    """A new app for this config (it connects to replicas at its startup)."""
    return IvyApp(config)


def create_app_from_env() -> IvyApp:
    """uvicorn factory for worker processes: the config travels serialized in the env."""
    return create_app(IvyConfig.from_json(os.environ[WORKER_CONFIG_ENV]))
