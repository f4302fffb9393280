"""HTTP side of generation: the /v1/chat/completions and /v1/completions entries of the
route table, and their OpenAI answers and stream events.

A streamed request answers with an HTTP error status when it fails before its first
token (validation, no replica, every replica at capacity); once the first message is in,
the status is 200 and a later failure arrives as an SSE ``data: {"error": ...}`` event.
A client that leaves cancels its request (`ivy.middleware.CancelOnDisconnect`), which
closes its generations, so the replicas drop the sequences.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace

from ivy import sse
from ivy.errors import IvyError
from ivy.generation import (
    Generation,
    GenerationService,
    Outcome,
    Prepared,
    collect,
    finish_reason,
    merge,
)
from ivy.generation_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkWithUsage,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ContentDelta,
    EndDelta,
    GenerationUsage,
    ReasoningDelta,
    RoleDelta,
    StreamError,
    ToolCallDelta,
    ToolCallOut,
    ToolCallsDelta,
)
from ivy.logprobs import CompletionLogprobsBuilder, TokenPieces, chat_logprobs
from ivy.reasoning import ThoughtStream
from ivy.routes import Reply, Route
from ivy.tools import ToolStream

__all__ = ["CHAT_ROUTE", "COMPLETIONS_ROUTE", "STREAM_SCHEMAS", "generation_routes"]

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
# Documented besides the routes' own shapes: the variants a stream may send.
STREAM_SCHEMAS = (ChatCompletionChunkWithUsage, CompletionChunkWithUsage, StreamError)
_INTERNAL = {
    "error": {
        "message": "The server had an error while generating.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}


def _timing_header(prepared: Prepared) -> dict[str, str]:
    first = (time.perf_counter() - prepared.started) * 1e3
    return {
        "Server-Timing": f"tokenize;dur={prepared.tokenize_s * 1e3:.3f}, first-token;dur={first:.3f}"
    }


def _error_event(exc: BaseException) -> bytes:
    if isinstance(exc, IvyError):
        return sse.raw_event(exc.body())
    return sse.event(_INTERNAL)


def _usage(outcomes: Sequence[Outcome], n: int) -> GenerationUsage:
    """OpenAI's usage of ``outcomes`` (``n`` choices per prompt, in choice order): each
    prompt counted once, every choice's completion."""
    return GenerationUsage.of(
        sum(o.prompt_tokens for o in outcomes[::n]), sum(o.completion_tokens for o in outcomes)
    )


def _running_usage(
    prepared: Prepared, generations: Sequence[Generation]
) -> Callable[[], GenerationUsage | None]:
    """The usage so far, for vLLM's ``stream_options.continuous_usage_stats`` (each chunk
    carries it); a function giving None when the request did not ask."""
    if not prepared.continuous_usage:
        return lambda: None
    prompt = sum(g.prompt_tokens for g in generations[:: prepared.n])
    return lambda: GenerationUsage.of(prompt, sum(g.completion_tokens for g in generations))


def _echoes(prepared: Prepared, choices: int) -> list[str]:
    """Each choice's echoed prompt (completions' ``echo``), or none."""
    if prepared.echo is None:
        return []
    return [prepared.echo[i // prepared.n] for i in range(choices)]


def _usage_field(
    with_usage: bool, running: Callable[[], GenerationUsage | None]
) -> dict[str, GenerationUsage | None]:
    return {"usage": running()} if with_usage else {}


async def _chat_events(
    prepared: Prepared, generations: list[Generation], rid: str, created: int, model: str
) -> AsyncGenerator[bytes, None]:
    with_usage = prepared.include_usage
    kind = ChatCompletionChunkWithUsage if with_usage else ChatCompletionChunk

    pieces = prepared.pieces
    running = _running_usage(prepared, generations)

    def chunk(
        index: int,
        delta: RoleDelta | ContentDelta | ReasoningDelta | ToolCallsDelta | EndDelta,
        finish: str | None,
        logprobs: ChatLogprobs | None = None,
    ) -> bytes:
        choice = ChatChunkChoice(index, delta, finish, logprobs)  # type: ignore[arg-type]
        return sse.event(kind(rid, created, model, [choice], **_usage_field(with_usage, running)))

    # a reasoning model's thought is split off first (`ivy.reasoning.ThoughtStream`); with
    # tools to call, the rest goes through its reader (`ivy.tools.ToolStream`)
    plan = prepared.tools
    calling = plan is not None and plan.mode != "none"
    readers = [ToolStream(plan) if calling else None for _ in generations]  # type: ignore[arg-type]
    thoughts = prepared.thoughts
    thinking = [ThoughtStream(thoughts) if thoughts else None for _ in generations]
    for index in range(len(generations)):
        yield chunk(index, RoleDelta(), None)
    try:
        async for index, message in merge(generations):
            finish = finish_reason(message)
            # a message's first chunk carries the logprobs of its tokens (its text may lag
            # them: a replica holds back text that could still become a stop string)
            logprobs = None
            if pieces is not None and message.token_ids:
                logprobs = chat_logprobs(pieces, message.token_ids, message.logprobs)
            reasoning, text = "", message.text
            stream = thinking[index]
            if stream is not None:
                reasoning, text = stream.feed(text)
                if finish is not None:
                    more_reasoning, more_text = stream.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            calls: list[ToolCallDelta] = []
            reader = readers[index]
            if reader is not None:
                text, calls = reader.feed(text)
                if finish is not None:
                    rest, more, finish = reader.finish(finish)
                    text, calls = text + rest, calls + more
            deltas: list[ReasoningDelta | ContentDelta | ToolCallsDelta] = []
            if reasoning:
                deltas.append(ReasoningDelta(reasoning))
            if text or (logprobs is not None and not reasoning):
                deltas.append(ContentDelta(text))
            if calls:
                deltas.append(ToolCallsDelta(calls))
            for i, delta in enumerate(deltas):
                yield chunk(index, delta, None, logprobs if i == 0 else None)
            if finish is not None:
                yield chunk(index, EndDelta(), finish)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which then ends
        yield _error_event(exc)
        return
    if with_usage:
        usage = _usage([g.outcome("") for g in generations], prepared.n)
        yield sse.event(ChatCompletionChunkWithUsage(rid, created, model, [], usage=usage))
    yield sse.DONE


async def _completion_events(
    prepared: Prepared, generations: list[Generation], rid: str, created: int, model: str
) -> AsyncGenerator[bytes, None]:
    with_usage = prepared.include_usage
    kind = CompletionChunkWithUsage if with_usage else CompletionChunk
    pieces = prepared.pieces
    builders = None if pieces is None else [CompletionLogprobsBuilder(pieces) for _ in generations]
    running = _running_usage(prepared, generations)
    try:
        for index, text in enumerate(_echoes(prepared, len(generations))):
            logprobs = None
            if builders is not None and prepared.sampling.HasField("prompt_logprobs"):
                ids = prepared.prompts[index // prepared.n].tolist()
                scores = generations[index].prompt_logprobs()
                logprobs = builders[index].add_prompt(ids, scores)
            choice = CompletionChoice(index, text, None, logprobs)  # type: ignore[arg-type]
            yield sse.event(
                kind(rid, created, model, [choice], **_usage_field(with_usage, running))
            )
        if prepared.echo_only:  # the prompts alone: each choice ends after its echo
            outcomes = [_prompt_only(o) for o in await collect(generations)]
            usage = _usage(outcomes, prepared.n)
            so_far = _usage_field(with_usage, lambda: usage if prepared.continuous_usage else None)
            for index in range(len(generations)):
                choice = CompletionChoice(index, "", "length")
                yield sse.event(kind(rid, created, model, [choice], **so_far))
            if with_usage:
                yield sse.event(CompletionChunkWithUsage(rid, created, model, [], usage=usage))
            yield sse.DONE
            return
        async for index, message in merge(generations):
            finish = finish_reason(message)  # this message's own, not the generation's
            if message.text or finish is not None or (builders and message.token_ids):
                logprobs = (
                    None
                    if builders is None
                    else builders[index].add(message.token_ids, message.logprobs)
                )
                choice = CompletionChoice(index, message.text, finish, logprobs)  # type: ignore[arg-type]
                yield sse.event(
                    kind(rid, created, model, [choice], **_usage_field(with_usage, running))
                )
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which then ends
        yield _error_event(exc)
        return
    if with_usage:
        usage = _usage([g.outcome("") for g in generations], prepared.n)
        yield sse.event(CompletionChunkWithUsage(rid, created, model, [], usage=usage))
    yield sse.DONE


def _chat_logprobs(pieces: TokenPieces | None, outcome: Outcome) -> ChatLogprobs | None:
    if pieces is None:
        return None
    return chat_logprobs(pieces, outcome.token_ids, outcome.logprobs)


def _chat_choice(prepared: Prepared, index: int, outcome: Outcome) -> ChatChoice:
    """A finished chat choice: its answer, its thought apart (a reasoning model's), the rest
    read for tool calls when the request has tools."""
    content: str | None = outcome.text
    reasoning = None
    calls: list[ToolCallOut] = []
    finish = outcome.finish_reason
    if prepared.thoughts is not None:
        reasoning, content = prepared.thoughts.split(outcome.text)
    if prepared.tools is not None and content is not None:
        content, calls, finish = prepared.tools.read(content, finish)
    message = AssistantMessage(content, tool_calls=calls or None, reasoning_content=reasoning)
    return ChatChoice(index, message, finish, _chat_logprobs(prepared.pieces, outcome))  # type: ignore[arg-type]


def _completion_logprobs(
    prepared: Prepared, index: int, outcome: Outcome
) -> CompletionLogprobs | None:
    """Choice ``index``'s legacy logprobs: its echoed prompt's tokens (when the request
    asked for them), then the generated ones."""
    if prepared.pieces is None:
        return None
    builder = CompletionLogprobsBuilder(prepared.pieces)
    out = CompletionLogprobs([], [], [], [])
    if prepared.sampling.HasField("prompt_logprobs"):
        ids = prepared.prompts[index // prepared.n].tolist()
        out = builder.add_prompt(ids, outcome.prompt_logprobs)
    generated = builder.add(outcome.token_ids, outcome.logprobs)
    out.tokens += generated.tokens
    out.token_logprobs += generated.token_logprobs
    out.top_logprobs += generated.top_logprobs
    out.text_offset += generated.text_offset
    return out


def _prompt_only(outcome: Outcome) -> Outcome:
    """An echo-only choice's outcome (max_tokens 0): the token the replica generated (a
    pass always yields one) is neither shown nor counted."""
    return replace(
        outcome, text="", finish_reason="length", completion_tokens=0, token_ids=[], logprobs=[]
    )


def _closer(generations: Sequence[Generation]) -> Callable[[], None]:
    def close() -> None:
        for g in generations:
            g.close()

    return close


async def _open(
    service: GenerationService, prepared: Prepared, prefix: str
) -> tuple[list[Generation], str, int, dict[str, str]]:
    """The prepared request's generations, past their first message, with the answer's
    id, creation time and headers."""
    generations = await service.open(prepared)
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    return generations, rid, created, _timing_header(prepared)


def generation_routes(service: GenerationService) -> list[Route]:
    """The two routes' entries, served by `service`."""

    async def chat(req: ChatCompletionRequest) -> Reply | sse.Stream:
        prepared = await service.prepare_chat(req)
        generations, rid, created, headers = await _open(service, prepared, "chatcmpl")
        if prepared.stream:
            events = _chat_events(prepared, generations, rid, created, req.model)
            return sse.Stream(events, headers, _closer(generations))
        outcomes = await collect(generations)
        choices = [_chat_choice(prepared, i, o) for i, o in enumerate(outcomes)]
        body = ChatCompletionResponse(
            rid, created, req.model, choices, _usage(outcomes, prepared.n)
        )
        return Reply(body, headers=headers)

    async def completion(req: CompletionRequest) -> Reply | sse.Stream:
        prepared = await service.prepare_completion(req)
        generations, rid, created, headers = await _open(service, prepared, "cmpl")
        if prepared.stream:
            events = _completion_events(prepared, generations, rid, created, req.model)
            return sse.Stream(events, headers, _closer(generations))
        outcomes = await collect(generations)
        if prepared.echo_only:
            outcomes = [_prompt_only(o) for o in outcomes]
        echoes = _echoes(prepared, len(outcomes)) or [""] * len(outcomes)
        choices = [
            CompletionChoice(i, e + o.text, o.finish_reason, _completion_logprobs(prepared, i, o))  # type: ignore[arg-type]
            for i, (e, o) in enumerate(zip(echoes, outcomes, strict=True))
        ]
        body = CompletionResponse(rid, created, req.model, choices, _usage(outcomes, prepared.n))
        return Reply(body, headers=headers)

    def described(chunk: type) -> str:
        return (
            f"With `stream: true` the answer is `text/event-stream`: `data:` events of "
            f"`{chunk.__name__}` (`{chunk.__name__}WithUsage` with "
            f"`stream_options.include_usage`), then `data: [DONE]`; a failure after the "
            f"first event is sent as a `{StreamError.__name__}` event instead of `[DONE]`."
        )

    errors = (400, 401, 404, 413, 429, 502, 503, 504)
    return [
        Route(
            "POST",
            CHAT_ROUTE,
            chat,
            ChatCompletionRequest,
            ChatCompletionResponse,
            "Create a chat completion (OpenAI)",
            described(ChatCompletionChunk),
            stream=ChatCompletionChunk,
            errors=errors,
        ),
        Route(
            "POST",
            COMPLETIONS_ROUTE,
            completion,
            CompletionRequest,
            CompletionResponse,
            "Create a completion (OpenAI, legacy)",
            described(CompletionChunk),
            stream=CompletionChunk,
            errors=errors,
        ),
    ]
