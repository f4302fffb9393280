"""Request and response shapes of the embedding, rerank and tokenize routes.

Requests are parsed with orjson and validated with the pydantic models (strict: no
coercion of JSON types). Responses are plain dataclasses that orjson serializes as they
are (numpy rows included), so no handler builds a dict by hand; the same classes, through
pydantic's schema generation, document /openapi.json (`ivy.openapi`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "RERANK_META",
    "VERSION",
    "ApiVersion",
    "CohereBilledUnits",
    "CohereEmbedRequest",
    "CohereEmbedResponse",
    "CohereMeta",
    "ContextualizedData",
    "ContextualizedEmbeddingRequest",
    "ContextualizedEmbeddingResponse",
    "SparseEmbedding",
    "TeiEmbedAllRequest",
    "TeiEmbedRequest",
    "TeiEmbedSparseRequest",
    "TeiDecodeRequest",
    "TeiInfo",
    "TeiPredictRequest",
    "TeiPrediction",
    "TeiSimilarityRequest",
    "TeiToken",
    "TeiRank",
    "TeiRankWithText",
    "TeiSparseValue",
    "CLOSED",
    "MAX_TOOLS",
    "UINT32_MAX",
    "ChatMessage",
    "ClassifyData",
    "ClassifyRequest",
    "ClassifyResponse",
    "FunctionCall",
    "FunctionSpec",
    "ChatTemplateOptions",
    "TextPart",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ErrorBody",
    "ErrorResponse",
    "Health",
    "ModelCard",
    "ModelList",
    "Readiness",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "RerankResultWithDocument",
    "RerankText",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizedInput",
    "Tool",
    "ToolCall",
    "Usage",
    "activation_asked",
]

# Numeric fields are bounded to the protobuf type that carries them to Tulip (or, for
# fields Ivy applies itself, to the same uint32 range), so an out-of-range number is a 400
# naming the field here, never an overflow while the gRPC request is built.
UINT32_MAX = 2**32 - 1
MAX_TOOLS = 128  # OpenAI's limit on tools per request
VERSION = "0.1.0"  # the API's, in /openapi.json and TEI's /info

NonEmptyStr = Annotated[str, Field(min_length=1)]
# A token id travels as a little-endian uint32; ids at or over the model's vocabulary size
# are refused once the model is known.
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A count of at least one (uint32 on the wire: EmbedRequest.dimensions).
PositiveUInt32 = Annotated[int, Field(ge=1, le=UINT32_MAX)]
InputType = Literal["search_query", "search_document", "query", "document", "passage", "none"]
Direction = Literal["left", "right", "Left", "Right"]
# vLLM's truncate_prompt_tokens: -1 (the model's limit) or a count of tokens
TruncateTokens = Annotated[int, Field(ge=-1, le=UINT32_MAX)]
# Text, texts, token ids or lists of token ids (OpenAI's and TEI's input forms).
EmbedInput = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


# Message objects are documented closed: the schema lists what Ivy reads. Other keys are
# still ignored at runtime (clients echo assistant messages back with `refusal`,
# `tool_calls`, ...). Closed nested objects also keep schemathesis from drawing arbitrary
# JSON for them: with `--workers 2` that intermittently fails inside Hypothesis with
# CPython 3.11's "AST constructor recursion depth mismatch" (python/cpython#106905).
CLOSED = ConfigDict(json_schema_extra={"additionalProperties": False})


class TextPart(_Strict):
    """One part of a message's content; only text parts are accepted."""

    model_config = CLOSED

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    model_config = CLOSED

    name: Annotated[str, Field(min_length=1)]
    arguments: str = Field(description="The arguments, a JSON object as text.")


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    model_config = CLOSED

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Strict):
    model_config = CLOSED

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON Schema of the arguments (an object)."
    )
    strict: bool | None = None


class Tool(_Strict):
    model_config = CLOSED

    type: Literal["function"]
    function: FunctionSpec


class ChatMessage(_Strict):
    """A message of the conversation. ``developer`` is OpenAI's newer name for
    ``system`` and is rendered as one. An assistant turn may carry ``tool_calls`` (its
    content then may be null); a ``tool`` message answers one by ``tool_call_id``."""

    model_config = CLOSED

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        default=None, description="Absent or null only for an assistant turn with tool_calls."
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(
        default=None,
        description="An assistant turn's thought, as a reasoning model's answer returned it "
        "(handed to the chat template, which may render it: Qwen3's does within a turn).",
    )


class ChatTemplateOptions(_Strict):
    """vLLM's chat-template fields, shared by chat completions and /tokenize's messages."""

    add_generation_prompt: bool = Field(
        default=True, description="vLLM: end the prompt with the template's assistant opening."
    )
    continue_final_message: bool = Field(
        default=False,
        description="vLLM: leave the final (assistant) message open, for the model to "
        "continue it (transformers' apply_chat_template); not with add_generation_prompt.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="vLLM: more variables for the chat template (e.g. Qwen3's enable_thinking).",
    )


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, plus `input_type` (prompt selection) and `truncate`."""

    input: EmbedInput = Field(
        description="Text, texts, token ids or lists of token ids (at most `--max-inputs`, default 2048)."
    )
    model: str
    encoding_format: Literal["float", "base64", "base64_int8", "base64_binary"] = Field(
        default="float",
        description="float; base64 (little-endian float32, OpenAI); base64_int8 (signed int8 "
        "per dimension, round(127 * x / max|x|) per vector); base64_binary (1 bit per "
        "dimension, 1 where x > 0, packed LSB first), as Perplexity's API defines them.",
    )
    dimensions: PositiveUInt32 | None = Field(
        default=None, description="Keep the first N values (at most the model's size)."
    )
    user: str | None = None
    input_type: InputType | None = Field(
        default=None,
        description="Trellis extension: apply the model's query or document prompt.",
    )
    truncate: bool | None = Field(
        default=None,
        description="Trellis extension: cut inputs over the model's limit instead of failing "
        "(default: the server's `--auto-truncate`).",
    )
    truncation_direction: Direction = Field(
        default="right",
        description="Trellis extension: cut from the end (right) or the start (left); "
        "special tokens stay.",
    )
    truncate_prompt_tokens: TruncateTokens | None = Field(
        default=None,
        description="vLLM: cut each input to this many tokens, special tokens included "
        "(-1: the model's limit).",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="vLLM's name of `truncation_direction` (wins if both)."
    )
    use_activation: bool | None = Field(
        default=None, description="vLLM: false gives vectors without the model's normalization."
    )
    instruction: NonEmptyStr | None = Field(
        default=None,
        description="Trellis extension: a task for instruction-following embedders, put in "
        "the model's own query prompt format (Qwen3-Embedding's `Instruct: <task>\\nQuery:`); "
        "a 400 for models whose prompts have no task.",
    )
    output: Literal["dense", "sparse"] = Field(
        default="dense",
        description="Trellis extension: `sparse` gives each item's `embedding` as "
        "`{indices, values}` (token id -> weight, nonzero weights only, ids ascending) from "
        "a model with a sparse output (BGE-M3's sparse head, SPLADE); `encoding_format` "
        "must be `float` and `dimensions` unset.",
    )


@dataclass(slots=True)
class SparseEmbedding:
    """A sparse vector: token ids (ascending) and their weights."""

    indices: list[int]
    values: list[float]


@dataclass(slots=True)
class EmbeddingData:
    object: Literal["embedding"] = field(default="embedding", init=False)
    index: int
    # A numpy row at run time (orjson writes it as this JSON array), base64 text, or a
    # sparse vector (`output: sparse`).
    embedding: list[float] | str | SparseEmbedding


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    total_tokens: int


@dataclass(slots=True)
class EmbeddingResponse:
    object: Literal["list"] = field(default="list", init=False)
    data: list[EmbeddingData]
    model: str
    usage: Usage


class ContextualizedEmbeddingRequest(_Strict):
    """Perplexity's contextualized (late-chunking) embeddings request: each document is a
    list of chunks, encoded together in one sequence; each chunk's vector is pooled over
    its own tokens."""

    input: Annotated[
        list[Annotated[list[NonEmptyStr], Field(min_length=1)]], Field(min_length=1)
    ] = Field(
        description="Documents, each a list of its chunks in order (no empty strings; at "
        "most --max-documents documents, --max-chunks chunks in all, --max-document-tokens "
        "tokens per document and --max-request-tokens per request: by default Perplexity's "
        "512, 16,000, 32K and 120,000)."
    )
    model: str
    encoding_format: Literal["base64_int8", "base64_binary", "float", "base64"] = Field(
        default="base64_int8",
        description="As /v1/embeddings; Perplexity's API takes base64_int8 (its default) and "
        "base64_binary, float and base64 are Trellis extensions.",
    )
    dimensions: PositiveUInt32 | None = Field(
        default=None, description="Keep the first N values (at most the model's size)."
    )
    input_type: InputType | None = Field(
        default=None,
        description="Trellis extension: the model's prompt before each document (none by "
        "default); it belongs to no chunk.",
    )


@dataclass(slots=True)
class ContextualizedData:
    object: Literal["list"] = field(default="list", init=False)
    index: int
    data: list[EmbeddingData]


@dataclass(slots=True)
class ContextualizedEmbeddingResponse:
    object: Literal["list"] = field(default="list", init=False)
    data: list[ContextualizedData]
    model: str
    usage: Usage


class TeiEmbedAllRequest(_Strict):
    """TEI's /embed_all request (every token's last hidden state); the fields TEI's other
    embedding requests share (TEI 1.7.1's published OpenAPI document, docs/openapi.json).
    Errors use Ivy's one envelope and statuses."""

    inputs: EmbedInput = Field(description="Text, texts, token ids or lists of token ids.")
    truncate: bool | None = Field(
        default=None, description="Default: the server's `--auto-truncate`."
    )
    truncation_direction: Direction = "Right"
    prompt_name: str | None = Field(
        default=None,
        description="A prompt of the model's sentence-transformers config, by name (e.g. "
        "`query`, `document`); default: the model's `default_prompt_name`, if any.",
    )
    model: str | None = Field(
        default=None,
        description="Trellis extension: the served model (default: the first that embeds).",
    )


class TeiEmbedRequest(TeiEmbedAllRequest):
    """TEI's /embed request."""

    normalize: bool = True
    dimensions: PositiveUInt32 | None = None


class TeiEmbedSparseRequest(TeiEmbedAllRequest):
    """TEI's /embed_sparse request."""

    model: str | None = Field(
        default=None,
        description="Trellis extension: the served model (default: the first with a sparse "
        "output).",
    )


@dataclass(slots=True)
class TeiSparseValue:
    index: int
    value: float


class SimilarityInput(_Strict):
    source_sentence: NonEmptyStr
    sentences: Annotated[list[NonEmptyStr], Field(min_length=1)]


class SimilarityParameters(_Strict):
    prompt_name: str | None = None
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class TeiSimilarityRequest(_Strict):
    """TEI's /similarity request (TEI 1.7.1): cosine of the source with each sentence."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
    model: str | None = Field(
        default=None,
        description="Trellis extension: the served model (default: the first that embeds).",
    )


class TeiDecodeRequest(_Strict):
    """TEI's /decode request (TEI 1.7.1): token ids back to text."""

    ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    skip_special_tokens: bool = True
    model: str | None = Field(
        default=None, description="Trellis extension: the served model (default: the first)."
    )


PairOrSingle = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=2)]


class TeiPredictRequest(_Strict):
    """TEI's /predict request (TEI 1.7.1): a text, a list of one text or two (a pair), or
    a batch of [text] / [text, text] lists, classified by a sequence-classification model.
    As TEI reads them: `["a"]` is the text "a" (answered as one, not as a batch) and
    `["a", "b", "c"]` is refused."""

    inputs: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=2)]
        | (Annotated[list[PairOrSingle], Field(min_length=1)])
    )
    raw_scores: bool = Field(default=False, description="Logits instead of probabilities.")
    truncate: bool | None = Field(
        default=None, description="Default: the server's `--auto-truncate`."
    )
    truncation_direction: Direction = "Right"
    model: str | None = Field(
        default=None,
        description="Trellis extension: the served model (default: the first classifier).",
    )


CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereEmbedRequest(_Strict):
    """Cohere's v2 embed request (texts only)."""

    model: str
    texts: Annotated[list[NonEmptyStr], Field(min_length=1)]
    input_type: Literal["search_document", "search_query", "classification", "clustering"]
    embedding_types: Annotated[list[CohereEmbeddingType], Field(min_length=1)] = Field(
        default=["float"],
        description="float; int8 (round(127 * x / max|x|) per vector) and uint8 (int8 + 128); "
        "binary and ubinary (sign bits packed most significant first, as signed "
        "(value - 128) or unsigned bytes: sentence-transformers' scheme); base64 "
        "(little-endian float32).",
    )
    truncate: Literal["NONE", "START", "END"] = "END"
    output_dimension: PositiveUInt32 | None = None
    max_tokens: PositiveUInt32 | None = Field(
        default=None,
        description="Tokens embedded per text, at most (cut as `truncate` says; NONE: a 400 "
        "for a longer text).",
    )
    images: list[Any] | None = Field(default=None, description="Not supported: texts only.")
    inputs: list[Any] | None = Field(default=None, description="Not supported: texts only.")


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    """Cohere v2 and Jina rerank requests (`documents`), and TEI's (`texts`, TEI 1.7.1):
    the shape of the answer follows the shape of the request. Exactly one of the two is
    required (checked with the model, `Gateway.rerank`, so the 400 names the field)."""

    model: str | None = Field(
        default=None, description="Required by Cohere's shape; TEI's: the first reranker."
    )
    query: NonEmptyStr
    documents: Annotated[list[str | RerankDocument], Field(min_length=1)] | None = None
    top_n: PositiveUInt32 | None = None
    return_documents: bool | None = None
    max_tokens_per_doc: PositiveUInt32 | None = None
    texts: Annotated[list[str], Field(min_length=1)] | None = Field(
        default=None, description="TEI's shape: answered as a list of {index, score, text}."
    )
    raw_scores: bool = Field(default=False, description="TEI: logits instead of sigmoid.")
    return_text: bool = Field(default=False, description="TEI: each text in its rank.")
    truncate: bool | None = Field(
        default=None,
        description="TEI: cut pairs over the model's limit (default `--auto-truncate`); "
        "Cohere's shape always fits documents (`max_tokens_per_doc`).",
    )
    truncation_direction: Direction = "Right"
    truncate_prompt_tokens: TruncateTokens | None = Field(
        default=None, description="vLLM: cut each pair to this many tokens (-1: the limit)."
    )
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="vLLM's name of `truncation_direction` (wins if both)."
    )
    use_activation: bool | None = Field(
        default=None, description="vLLM: false gives a cross-encoder's logits (TEI: raw_scores)."
    )
    activation: bool | None = Field(default=None, description="vLLM's older use_activation.")
    softmax: bool | None = Field(default=None, description="vLLM's oldest use_activation.")
    instruction: NonEmptyStr | None = Field(
        default=None,
        description="Trellis extension, sentence-transformers' `prompt`: the system message "
        "of rerankers that read pairs through their chat template (Qwen3-Reranker's "
        "`<Instruct>`), else text before the query (embedders: the model's query prompt "
        "format, as /v1/embeddings).",
    )


def activation_asked(req: RerankRequest | ScoreRequest | ClassifyRequest) -> bool | None:
    """vLLM's `use_activation`, read as vLLM reads it: its older names `softmax`, then
    `activation`, win when sent."""
    for value in (req.softmax, req.activation):
        if value is not None:
            return value
    return req.use_activation


def cuts_left(req: EmbeddingRequest | RerankRequest) -> bool:
    """Whether the request cuts texts at their start: vLLM's `truncation_side`, else
    TEI's and Trellis' `truncation_direction`."""
    return (req.truncation_side or req.truncation_direction).lower() == "left"


ScoreTexts = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]


class ScoreRequest(_Strict):
    """vLLM's /score request: the texts of one side against the other's, 1:1, 1:N or N:N,
    under any of vLLM's pairs of names (`queries`/`documents`, `queries`/`items`,
    `data_1`/`data_2`, `text_1`/`text_2`), exactly one pair (checked in `Gateway.score`,
    so the 400 names the field)."""

    model: str | None = Field(default=None, description="Default: the first reranker.")
    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    truncate_prompt_tokens: TruncateTokens | None = Field(
        default=None,
        description="Cut each pair to this many tokens, longest first (-1: the model's "
        "limit); default: a pair over the limit is a 400.",
    )
    truncation_side: Literal["left", "right"] | None = None
    use_activation: bool | None = Field(
        default=None, description="false: a cross-encoder's logits instead of its sigmoid."
    )
    activation: bool | None = Field(default=None, description="vLLM's older use_activation.")
    softmax: bool | None = Field(default=None, description="vLLM's oldest use_activation.")
    user: str | None = None


@dataclass(slots=True)
class ScoreData:
    index: int
    score: float
    object: str = "score"


@dataclass(slots=True)
class ScoreUsage:
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


@dataclass(slots=True)
class ScoreResponse:
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: str = "list"


class ClassifyRequest(_Strict):
    """vLLM's /classify request: texts through a sequence classifier (a cross-encoder's
    model read one text at a time)."""

    model: str | None = Field(default=None, description="Default: the first cross-encoder.")
    input: ScoreTexts
    truncate_prompt_tokens: TruncateTokens | None = Field(
        default=None,
        description="Cut each text to this many tokens (-1: the model's limit); default: a "
        "text over the limit is a 400.",
    )
    truncation_side: Literal["left", "right"] | None = None
    use_activation: bool | None = Field(
        default=None, description="false: the logits instead of the probabilities."
    )
    activation: bool | None = Field(default=None, description="vLLM's older use_activation.")
    softmax: bool | None = Field(default=None, description="vLLM's oldest use_activation.")


@dataclass(slots=True)
class ClassifyData:
    index: int
    label: str
    probs: list[float]
    num_classes: int


@dataclass(slots=True)
class ClassifyResponse:
    id: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: Usage
    object: str = "list"


@dataclass(slots=True)
class ApiVersion:
    version: str


@dataclass(slots=True)
class CohereBilledUnits:
    input_tokens: int


@dataclass(slots=True)
class CohereMeta:
    api_version: ApiVersion
    billed_units: CohereBilledUnits


@dataclass(slots=True)
class CohereEmbedResponse:
    id: str
    # embedding type -> one vector per text (float, int8/uint8/binary/ubinary integers, or
    # base64 text), for the requested types only
    embeddings: dict[CohereEmbeddingType, list[list[float]] | list[list[int]] | list[str]]
    texts: list[str]
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


@dataclass(slots=True)
class TeiInfo:
    """TEI's /info (the fields its clients read)."""

    model_id: str
    model_dtype: str
    model_type: dict[str, dict[str, str]]
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    model_sha: str | None = None


@dataclass(slots=True)
class RerankResult:
    index: int
    relevance_score: float


@dataclass(slots=True)
class RerankText:
    text: str


@dataclass(slots=True)
class RerankResultWithDocument(RerankResult):
    document: RerankText


@dataclass(slots=True)
class BilledUnits:
    search_units: int


@dataclass(slots=True)
class RerankMeta:
    api_version: ApiVersion
    billed_units: BilledUnits


# Cohere's (and Jina's) answer: the documents come back unless `return_documents: false`.
RERANK_META = RerankMeta(ApiVersion("2"), BilledUnits(1))


@dataclass(slots=True)
class RerankResponse:
    id: str
    model: str
    results: list[RerankResultWithDocument | RerankResult]
    usage: Usage
    meta: RerankMeta


class TokenizeRequest(ChatTemplateOptions):
    """Trellis' tokenize request (`model`, `input`: ids and offsets), TEI's (`inputs`,
    TEI 1.7.1: a list of {id, text, special, start, stop} per input) or vLLM's (`prompt`,
    or `messages` with its chat-template options); the answer follows the shape of the
    request. Exactly one of `input`, `inputs`, `prompt` and `messages` is required."""

    model: str | None = Field(
        default=None, description="Required with `input`; TEI's shape: the first model."
    )
    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        default=None,
        description="Default true; with `messages` false (the chat template places them).",
    )
    inputs: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    prompt_name: str | None = Field(
        default=None, description="TEI: the model's prompt of that name."
    )
    prompt: NonEmptyStr | None = Field(
        default=None,
        description="vLLM's shape: one text, answered as {count, max_model_len, tokens, "
        "token_strs}.",
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        default=None,
        description="vLLM's chat shape: a conversation, tokenized as chat completions "
        "would generate from it; answered as `prompt` is.",
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        default=None, description="vLLM, with `messages`: the tools, through the template."
    )
    return_token_strs: bool = Field(
        default=False, description="vLLM: each token's string in `token_strs`."
    )


@dataclass(slots=True)
class TeiRank:
    index: int
    score: float


@dataclass(slots=True)
class TeiRankWithText(TeiRank):
    text: str


@dataclass(slots=True)
class TeiPrediction:
    score: float
    label: str


@dataclass(slots=True)
class TeiToken:
    """One token as TEI's /tokenize shows it: special tokens have no offsets and their
    own text; the others the characters [start, stop) of the input they cover."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


@dataclass(slots=True)
class VllmTokenizeResponse:
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize request: one row of token ids back to text (special tokens
    kept, as `tokenizer.decode` has it)."""

    model: str | None = Field(default=None, description="Default: the first served model.")
    tokens: list[TokenId]


@dataclass(slots=True)
class DetokenizeResponse:
    prompt: str


@dataclass(slots=True)
class TokenizedInput:
    index: int
    ids: list[int]
    offsets: list[tuple[int, int]]


@dataclass(slots=True)
class TokenizeResponse:
    model: str
    data: list[TokenizedInput]
    usage: Usage


@dataclass(slots=True)
class ModelCard:
    object: Literal["model"] = field(default="model", init=False)
    id: str
    created: int
    owned_by: str


@dataclass(slots=True)
class ModelList:
    object: Literal["list"] = field(default="list", init=False)
    data: list[ModelCard]


@dataclass(slots=True)
class Health:
    status: str


@dataclass(slots=True)
class Readiness:
    status: Literal["ready", "draining", "not_ready"]
    healthy_replicas: dict[str, int]


@dataclass(slots=True)
class ErrorBody:
    message: str
    type: str
    param: str | None
    code: str | None


@dataclass(slots=True)
class ErrorResponse:
    error: ErrorBody
