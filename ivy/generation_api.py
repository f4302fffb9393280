"""HTTP side of generation: the /v1/chat/completions and /v1/completions routes, their
OpenAI response and chunk shapes, and their entries in /openapi.json.

A streamed request answers with an HTTP error status when it fails before its first
token (validation, no replica, every replica at capacity); once the first message is in,
the status is 200 and a later failure arrives as an SSE ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ivy import sse
from ivy.errors import CLIENT_CLOSED, IvyError, ValidationError
from ivy.gateway import Gateway
from ivy.generation import (
    Generation,
    GenerationMetrics,
    GenerationService,
    Outcome,
    Prepared,
    collect,
    finish_reason,
    merge,
)
from ivy.generation_schemas import (
    MAX_STOP_CHARS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    StreamError,
)
from ivy.metrics import Metrics
from ivy.schemas import ErrorResponse

__all__ = ["CHAT_ROUTE", "COMPLETIONS_ROUTE", "add_generation_routes"]

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
_JSON = "application/json"
_PROMPT_FORMS = (
    "Invalid 'prompt': expected a string, an array of strings, an array of token ids or "
    "an array of arrays of token ids."
)
# The union's first failing branch says little; these name the accepted forms instead.
_FORMS = {
    "prompt": _PROMPT_FORMS,
    "stop": (
        f"Invalid 'stop': expected a string or an array of at most 4 strings, each of 1 to "
        f"{MAX_STOP_CHARS} characters."
    ),
}
_REQUEST_MODEL_KEY = "x-ivy-generation-request-model"
_REQUEST_MODELS: dict[str, type[pydantic.BaseModel]] = {
    m.__name__: m for m in (ChatCompletionRequest, CompletionRequest)
}
_ERRORS = {
    str(status): {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "Invalid request (also: not a generator, prompt over the context length)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Body too large"),
        (429, "Every replica is at capacity"),
        (503, "No healthy replica or shutting down"),
    )
}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _timing_header(prepared: Prepared) -> dict[str, str]:
    first = (time.perf_counter() - prepared.started) * 1e3
    return {
        "Server-Timing": f"tokenize;dur={prepared.tokenize_s * 1e3:.3f}, first-token;dur={first:.3f}"
    }


def _error_event(exc: BaseException) -> bytes:
    if isinstance(exc, IvyError):
        return sse.raw_event(exc.body())
    return sse.event(
        {
            "error": {
                "message": "The server had an error while generating.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    )


async def _chat_events(
    prepared: Prepared, generations: list[Generation], head: dict[str, Any]
) -> AsyncGenerator[bytes, None]:
    usage_field = {"usage": None} if prepared.include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse.event({**head, "choices": [choice], **usage_field})

    (generation,) = generations
    yield chunk({"role": "assistant", "content": ""}, None)
    try:
        async for _, message in merge(generations):
            if message.text:
                yield chunk({"content": message.text}, None)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which then ends
        yield _error_event(exc)
        return
    outcome = generation.outcome("")
    yield chunk({}, outcome.finish_reason)
    if prepared.include_usage:
        usage = _usage(outcome.prompt_tokens, outcome.completion_tokens)
        yield sse.event({**head, "choices": [], "usage": usage})
    yield sse.DONE


async def _completion_events(
    prepared: Prepared, generations: list[Generation], head: dict[str, Any]
) -> AsyncGenerator[bytes, None]:
    usage_field = {"usage": None} if prepared.include_usage else {}
    try:
        async for index, message in merge(generations):
            finish = finish_reason(message)  # this message's own, not the generation's
            if message.text or finish is not None:
                choice = {
                    "index": index,
                    "text": message.text,
                    "logprobs": None,
                    "finish_reason": finish,
                }
                yield sse.event({**head, "choices": [choice], **usage_field})
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which then ends
        yield _error_event(exc)
        return
    if prepared.include_usage:
        outcomes = [g.outcome("") for g in generations]
        usage = _usage(
            sum(o.prompt_tokens for o in outcomes), sum(o.completion_tokens for o in outcomes)
        )
        yield sse.event({**head, "choices": [], "usage": usage})
    yield sse.DONE


def _closer(generations: Sequence[Generation]) -> Callable[[], None]:
    def close() -> None:
        for g in generations:
            g.close()

    return close


async def _collect_unless_gone(
    request: Request, generations: list[Generation]
) -> list[Outcome] | None:
    """The outcomes; None when the client disconnected first, in which case the
    generations were cancelled (so the replicas free their sequences)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect(generations))
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))  # its cleanup cancels the replicas' sequences
    if work.cancelled():
        return None
    return work.result()


async def _chat(
    service: GenerationService, request: Request, req: ChatCompletionRequest
) -> Response:
    prepared = await service.prepare_chat(req)
    generations = await service.open(prepared)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model,
    }
    headers = _timing_header(prepared)
    if prepared.stream:
        events = _chat_events(prepared, generations, head)
        return sse.response(events, headers, _closer(generations))
    outcomes = await _collect_unless_gone(request, generations)
    if outcomes is None:
        return Response(status_code=CLIENT_CLOSED)
    (outcome,) = outcomes
    body = {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": outcome.text},
                "logprobs": None,
                "finish_reason": outcome.finish_reason,
            }
        ],
        "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens),
    }
    return Response(orjson.dumps(body), headers=headers, media_type=_JSON)


async def _completion(
    service: GenerationService, request: Request, req: CompletionRequest
) -> Response:
    prepared = await service.prepare_completion(req)
    generations = await service.open(prepared)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
    }
    headers = _timing_header(prepared)
    if prepared.stream:
        events = _completion_events(prepared, generations, head)
        return sse.response(events, headers, _closer(generations))
    outcomes = await _collect_unless_gone(request, generations)
    if outcomes is None:
        return Response(status_code=CLIENT_CLOSED)
    body = {
        **head,
        "choices": [
            {"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
            for i, o in enumerate(outcomes)
        ],
        "usage": _usage(
            sum(o.prompt_tokens for o in outcomes), sum(o.completion_tokens for o in outcomes)
        ),
    }
    return Response(orjson.dumps(body), headers=headers, media_type=_JSON)


def add_generation_routes(
    app: FastAPI,
    *,
    gateway: Callable[[], Gateway],
    metrics: Metrics,
    read_body: Callable[[Request], Awaitable[bytes]],
    parse: Callable[[bytes, type[pydantic.BaseModel]], Any],
    timeout_seconds: float,
    served_models: list[str],
) -> None:
    """Register both routes on ``app`` and document them in its /openapi.json (call after
    the app's own ``openapi`` is installed; this wraps it)."""
    service = GenerationService(
        gateway, GenerationMetrics.create(metrics.registry), timeout_seconds
    )

    def parse_request(body: bytes, model: type[pydantic.BaseModel]) -> Any:
        try:
            return parse(body, model)
        except ValidationError as exc:
            forms = _FORMS.get(exc.param or "")
            if forms is None:
                raise
            raise ValidationError(forms, param=exc.param) from None

    async def chat_completions(request: Request) -> Response:
        req = parse_request(await read_body(request), ChatCompletionRequest)
        return await _chat(service, request, req)

    async def completions(request: Request) -> Response:
        req = parse_request(await read_body(request), CompletionRequest)
        return await _completion(service, request, req)

    for path, handle, req_model, resp_model, chunk_model, summary in (
        (
            CHAT_ROUTE,
            chat_completions,
            ChatCompletionRequest,
            ChatCompletionResponse,
            ChatCompletionChunk,
            "Create a chat completion (OpenAI)",
        ),
        (
            COMPLETIONS_ROUTE,
            completions,
            CompletionRequest,
            CompletionResponse,
            CompletionChunk,
            "Create a completion (OpenAI, legacy)",
        ),
    ):
        app.add_api_route(
            path,
            handle,
            methods=["POST"],
            summary=summary,
            description=(
                f"With `stream: true` the answer is `text/event-stream`: `data:` events of "
                f"`{chunk_model.__name__}`, then `data: [DONE]`; a failure after the first "
                f"event is sent as a `{StreamError.__name__}` event instead of `[DONE]`."
            ),
            response_model=None,
            responses={"200": {"model": resp_model, "description": "OK"}, **_ERRORS},
            openapi_extra={_REQUEST_MODEL_KEY: req_model.__name__},
        )

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = base_openapi()
        _document(schema, served_models)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(schema: dict[str, Any], served_models: list[str]) -> None:
    """Attach the request models (and the stream's chunk/error shapes) to the operations
    that name one; idempotent, since the marker is removed once applied."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            name = operation.pop(_REQUEST_MODEL_KEY, None)
            if name is None:
                continue
            for model in (_REQUEST_MODELS[name], ChatCompletionChunk, CompletionChunk, StreamError):
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for def_name, definition in model_schema.pop("$defs", {}).items():
                    components.setdefault(def_name, definition)
                components.setdefault(model.__name__, model_schema)
            request_schema = components[name]
            request_schema["properties"]["model"]["enum"] = sorted(served_models)
            operation["requestBody"] = {
                "required": True,
                "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
            ok = operation.get("responses", {}).get("200", {})
            chunk = ChatCompletionChunk if name == "ChatCompletionRequest" else CompletionChunk
            ok.setdefault("content", {})["text/event-stream"] = {
                "schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}
            }
