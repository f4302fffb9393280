"""Request and response shapes. Requests are parsed with orjson and validated with these
models (strict: no coercion of JSON types); the same models document /openapi.json."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "UINT32_MAX",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ErrorResponse",
    "ModelList",
    "RerankRequest",
    "RerankResponse",
    "TokenizeRequest",
    "TokenizeResponse",
]

# Numeric fields are bounded to the protobuf type that carries them to Tulip (or, for
# fields Ivy applies itself, to the same uint32 range), so an out-of-range number is a 400
# naming the field here, never an overflow while the gRPC request is built.
UINT32_MAX = 2**32 - 1

NonEmptyStr = Annotated[str, Field(min_length=1)]
# A token id travels as a little-endian uint32; ids at or over the model's vocabulary size
# are refused once the model is known.
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A count of at least one (uint32 on the wire: EmbedRequest.dimensions).
PositiveUInt32 = Annotated[int, Field(ge=1, le=UINT32_MAX)]
InputType = Literal["search_query", "search_document", "query", "document", "passage", "none"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, plus `input_type` (prompt selection) and `truncate`."""

    input: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(
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
    truncate: bool = Field(
        default=False,
        description="Trellis extension: cut inputs over the model's limit instead of failing.",
    )


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    """Cohere v2 and Jina rerank requests."""

    model: str
    query: NonEmptyStr
    documents: Annotated[list[str | RerankDocument], Field(min_length=1)]
    top_n: PositiveUInt32 | None = None
    return_documents: bool | None = None
    max_tokens_per_doc: PositiveUInt32 | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class ApiVersion(BaseModel):
    version: str


class BilledUnits(BaseModel):
    search_units: int


class RerankMeta(BaseModel):
    api_version: ApiVersion
    billed_units: BilledUnits


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: Usage
    meta: RerankMeta


class TokenizeRequest(_Strict):
    model: str
    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    add_special_tokens: bool = True


class TokenizedInput(BaseModel):
    index: int
    ids: list[int]
    offsets: list[tuple[int, int]]


class TokenizeResponse(BaseModel):
    model: str
    data: list[TokenizedInput]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody
