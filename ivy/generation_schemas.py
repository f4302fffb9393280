"""Request and response shapes of OpenAI's chat completions and (legacy) completions.

Requests are validated strictly like `ivy.schemas` (no coercion of JSON types; unknown
fields are ignored as OpenAI does). Responses and stream events are dataclasses that
orjson serializes as they are and that document /openapi.json (as in `ivy.schemas`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ivy.schemas import CLOSED as _CLOSED
from ivy.schemas import (
    MAX_TOOLS,
    UINT32_MAX,
    ChatMessage,
    ChatTemplateOptions,
    ErrorBody,
    FunctionSpec,
    TextPart,
    Tool,
)

__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkWithUsage",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionChunkWithUsage",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentDelta",
    "EndDelta",
    "FunctionCallDelta",
    "FunctionCallOut",
    "FunctionSpec",
    "GenerationUsage",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "NamedToolChoice",
    "ReasoningDelta",
    "ResponseFormat",
    "RoleDelta",
    "StreamError",
    "StreamOptions",
    "TextFormat",
    "TextPart",
    "Tool",
    "ToolCallDelta",
    "ToolCallOut",
    "ToolCallsDelta",
    "ToolName",
    "TopLogprob",
]

# Numeric fields are bounded to the `SamplingOptions` field that carries them to Tulip
# (uint32 max_tokens and top_k, float temperature and top_p, uint64 seed) or to OpenAI's
# documented range when that is narrower; out of range is a 400 naming the field.
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]  # and < the vocabulary, checked later
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]  # and within the context, later
# A stop string is held back while it may still be forming, so a long one delays text.
MAX_STOP_CHARS = 1024
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = StopString | Annotated[list[StopString], Field(max_length=4)]
# OpenAI's seed is a signed 64-bit integer; Trellis also takes the unsigned range of the
# wire's uint64 (negative seeds are sent as their two's complement).
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
FinishReason = Literal["stop", "length", "tool_calls"]
# OpenAI's limits: alternatives per token in chat (top_logprobs) and legacy (logprobs).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's limit on choices per prompt (n).
MAX_CHOICES = 128
# Most stop_token_ids one request may send (vLLM sets none; this keeps the wire small).
MAX_STOP_TOKEN_IDS = 1024


# Fields Ivy does not implement whose use would change the answer: accepted at their no-op
# values only, else refused with 400 naming the field (never silently ignored; see
# `ivy.generation.unsupported_field`). Unknown fields that change nothing stay ignored.
# OpenAI's presence_penalty and frequency_penalty range
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
_UNSUPPORTED = "Not supported: only its no-op value (absent, null, 0, empty) is accepted."


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False,
        description="vLLM: with include_usage, every chunk carries the usage so far.",
    )


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: OpenAI's named schema. ``strict`` is accepted either
    way: Trellis always holds the output to the schema (the tokens are masked)."""

    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, populate_by_name=True, **_CLOSED
    )

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    json_schema: dict[str, Any] = Field(
        default_factory=dict,
        alias="schema",
        json_schema_extra={"additionalProperties": True},
        description="A JSON Schema; absent: any JSON object.",
    )
    strict: bool | None = None


class TextFormat(_Strict):
    model_config = _CLOSED

    type: Literal["text"]


class JsonObjectFormat(_Strict):
    model_config = _CLOSED

    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    model_config = _CLOSED

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class _Sampling(_Strict):
    """The sampling and stopping parameters both endpoints share."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = Field(
        default=None, description="Default 1.0; 0 is greedy."
    )
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = Field(
        default=None,
        description="Trellis extension: sample among the k likeliest tokens (0: all).",
    )
    seed: Seed | None = None
    stop: StopStrings | None = Field(
        default=None, description=f"Up to 4 strings of at most {MAX_STOP_CHARS} characters."
    )
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        default=None,
        description="Choices per prompt, each sampled on its own; with a seed, choice j "
        "samples with seed + j.",
    )
    presence_penalty: Penalty | None = Field(
        default=None,
        description="Lower a token's logit by this once it appears in the output (OpenAI's).",
    )
    frequency_penalty: Penalty | None = Field(
        default=None,
        description="Lower a token's logit by this times its count in the output (OpenAI's).",
    )
    logit_bias: dict[str, LogitBias] | None = Field(
        default=None,
        description="Token id (as a string) -> bias added to its logit (OpenAI's).",
    )
    # vLLM's sampling extensions
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="vLLM: a token seen in the prompt or output has a positive logit "
        "divided by this, a negative one multiplied (1: off).",
    )
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="vLLM: drop tokens under min_p times the likeliest one's probability.",
    )
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = Field(
        default=None,
        description="vLLM: no EOS, stop token or stop string ends the answer before this "
        "many tokens (at most max_tokens).",
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        default=None, description="vLLM: token ids that end the answer, like EOS."
    )
    ignore_eos: bool | None = Field(
        default=None, description="vLLM: keep generating past the model's EOS."
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ToolName(_Strict):
    model_config = _CLOSED

    name: str


class NamedToolChoice(_Strict):
    model_config = _CLOSED

    type: Literal["function"]
    function: ToolName


class ChatCompletionRequest(ChatTemplateOptions, _Sampling):
    """OpenAI's chat completion request (text only)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = Field(
        default=None, description="Wins over max_tokens when both are given."
    )
    logprobs: bool | None = Field(
        default=None,
        description="Return each output token's log probability (choices[].logprobs).",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = Field(
        default=None,
        description="With logprobs: true, this many most likely tokens at each position.",
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        default=None,
        description="Functions the model may call, shown to it through its chat template.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="auto (the default with tools): the model may answer or call (its "
        "calls read in the Hermes `<tool_call>` format its template writes); required: at "
        "least one call; a named function: that call; none: an answer. required and named "
        "calls are held to the functions' parameter schemas token by token.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call per answer."
    )
    include_reasoning: bool | None = Field(
        default=None,
        description="vLLM: false leaves a reasoning model's thought out of the answer "
        "(no reasoning_content; the content is what follows the thought).",
    )
    functions: list[Any] | None = Field(default=None, description=_UNSUPPORTED)
    function_call: str | dict[str, Any] | None = Field(default=None, description=_UNSUPPORTED)
    response_format: ResponseFormat | None = Field(
        default=None,
        description="text, json_object (the answer is a JSON object) or json_schema (the "
        "answer validates against the schema); generation is constrained token by token.",
    )


class CompletionRequest(_Sampling):
    """OpenAI's legacy completion request; ``max_tokens`` defaults to 16 as there."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="Text, texts, token ids or lists of token ids.")
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = Field(
        default=None,
        description="Default 16. 0 only with `echo`: the prompt alone, nothing generated "
        "(its logprobs with `logprobs`), as in OpenAI's legacy API and vLLM.",
    )
    echo: bool | None = Field(
        default=False,
        description="Each choice's text starts with its prompt; with `logprobs`, so do its "
        "logprobs (the prompt's tokens', the first with none: what scoring a text uses).",
    )
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = Field(
        default=None,
        description="Return each output token's log probability and this many most likely "
        "tokens at each position (the chosen one is always included).",
    )
    suffix: str | None = Field(default=None, description="Not supported: null or absent.")


@dataclass(slots=True)
class GenerationUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> GenerationUsage:
        return cls(prompt, completion, prompt + completion)


@dataclass(slots=True)
class TopLogprob:
    """One of the most likely tokens at a position. ``bytes``: the token's UTF-8 bytes
    (its text is ``bytes:\\x..`` when they are part of a character)."""

    token: str
    logprob: float
    bytes: list[int] | None


@dataclass(slots=True)
class ChatTokenLogprob:
    """A generated token's log probability under the model (raw logits, before
    temperature / top-p; a response_format's mask applied), with the most likely tokens
    at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


@dataclass(slots=True)
class ChatLogprobs:
    content: list[ChatTokenLogprob] | None


@dataclass(slots=True)
class CompletionLogprobs:
    """Legacy completions' logprobs: per token its text, log probability, the most
    likely tokens there (text → logprob, the chosen one included) and its character
    offset in the generated text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@dataclass(slots=True)
class AssistantMessage:
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCallOut] | None = None
    # a reasoning model's thought (`ivy.reasoning`), as vLLM and DeepSeek return it
    reasoning_content: str | None = None


@dataclass(slots=True)
class FunctionCallOut:
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class ToolCallOut:
    id: str
    function: FunctionCallOut
    type: Literal["function"] = "function"


@dataclass(slots=True)
class FunctionCallDelta:
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a streamed tool call: the first of each call carries its id and
    name, the next ones more of its arguments (join them by ``index``)."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: Literal["function"] | None = None


@dataclass(slots=True)
class ToolCallsDelta:
    tool_calls: list[ToolCallDelta]


@dataclass(slots=True)
class ChatChoice:
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


@dataclass(slots=True)
class ChatCompletionResponse:
    object: Literal["chat.completion"] = field(default="chat.completion", init=False)
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: GenerationUsage


@dataclass(slots=True)
class RoleDelta:
    """The first delta of a streamed chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str = ""


@dataclass(slots=True)
class ContentDelta:
    content: str


@dataclass(slots=True)
class ReasoningDelta:
    """A piece of a reasoning model's thought (`ivy.reasoning`)."""

    reasoning_content: str


@dataclass(slots=True)
class EndDelta:
    """The last delta (empty; the choice's finish_reason is set)."""


@dataclass(slots=True)
class ChatChunkChoice:
    index: int
    delta: RoleDelta | ContentDelta | ReasoningDelta | ToolCallsDelta | EndDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


@dataclass(slots=True)
class ChatCompletionChunk:
    """One `data:` event of a streamed chat completion (the stream ends with `[DONE]`)."""

    object: Literal["chat.completion.chunk"] = field(default="chat.completion.chunk", init=False)
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]


@dataclass(slots=True)
class ChatCompletionChunkWithUsage(ChatCompletionChunk):
    """A chunk when `stream_options.include_usage` is set: null until the last event,
    which has no choices and the request's usage (with vLLM's `continuous_usage_stats`,
    every chunk carries the usage so far)."""

    usage: GenerationUsage | None = None


@dataclass(slots=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


@dataclass(slots=True)
class CompletionResponse:
    object: Literal["text_completion"] = field(default="text_completion", init=False)
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: GenerationUsage


@dataclass(slots=True)
class CompletionChunk:
    """One `data:` event of a streamed completion (the stream ends with `[DONE]`)."""

    object: Literal["text_completion"] = field(default="text_completion", init=False)
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]


@dataclass(slots=True)
class CompletionChunkWithUsage(CompletionChunk):
    """A chunk when `stream_options.include_usage` is set (see the chat's)."""

    usage: GenerationUsage | None = None


@dataclass(slots=True)
class StreamError:
    """The event a stream sends, instead of `[DONE]`, when it fails after it started."""

    error: ErrorBody
