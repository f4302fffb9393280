"""The work behind each endpoint, independent of HTTP: validate against the model,
template, tokenize (off the event loop for big batches), route, and answer with the
response dataclasses of `ivy.schemas`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivy.config import PERPLEXITY_LIMITS, ContextLimits
from ivy.errors import ModelNotFoundError, UnavailableError, ValidationError
from ivy.metrics import Metrics
from ivy.models import CROSS_ENCODER, EMBEDDING, OUTPUT_KINDS, PairTemplate, ServedModel
from ivy.replicas import Replica, ReplicaPool
from ivy.router import Claim, EmbedOutputs, Router
from ivy.schemas import (
    RERANK_META,
    VERSION,
    ApiVersion,
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    CohereBilledUnits,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
    ContextualizedData,
    ContextualizedEmbeddingRequest,
    ContextualizedEmbeddingResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankResultWithDocument,
    RerankText,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
    SimilarityParameters,
    SparseEmbedding,
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
    TokenizedInput,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    VllmTokenizeResponse,
    activation_asked,
    cuts_left,
)
from ivy.tokenization import TokenizationError
from protos import tracing

__all__ = ["Gateway", "Timings"]

# Batches with more characters than this are tokenized on a worker thread.
_INLINE_CHARS = 4096
_DEFAULT_MAX_TOKENS_PER_DOC = 4096
_NO_PARAMETERS = SimilarityParameters()
# vLLM's /score: its pairs of field names, and how it asks for pairs to be cut
_SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
_SCORE_TRUNCATE = "send `truncate_prompt_tokens`"
# Characters per token are at most this in the served tokenizers' real-world text (a
# token hint from characters under-counts, never over-counts, the tokens to come).
_CHARS_PER_TOKEN_BOUND = 8


@dataclass(frozen=True)
class Fields:
    """How a route's request names what the one embedding path reports errors about: its
    inputs, its dimensions and the way to ask for truncation."""

    input: str = "input"
    dimensions: str = "dimensions"
    truncate: str = "pass `truncate: true`"


OPENAI_FIELDS = Fields()
TEI_FIELDS = Fields(input="inputs")
COHERE_FIELDS = Fields(
    input="texts", dimensions="output_dimension", truncate='pass `truncate: "END"` or "START"'
)


@dataclass
class Timings:
    tokenize_s: float = 0.0
    inference_s: float = 0.0
    replica_s: float = 0.0  # as the replicas report it (queue + inference)
    chunks: int = 0

    def header(self) -> str:
        return (
            f"tokenize;dur={self.tokenize_s * 1e3:.3f}, inference;dur={self.inference_s * 1e3:.3f}"
            f", replica;dur={self.replica_s * 1e3:.3f}"
        )


class Gateway:
    """Served models, their replica pools and the router of one worker."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        pools: dict[str, ReplicaPool],
        metrics: Metrics,
        chunk_tokens: int,
        max_inputs: int,
        request_timeout_s: float,
        max_input_chars: int = 262_144,
        hedge_after_s: float = 2.0,
        auto_truncate: bool = False,
        max_connections: int = 2048,
        context_limits: ContextLimits = PERPLEXITY_LIMITS,
    ) -> None:
        self.models = models
        self.pools = pools
        self.metrics = metrics
        self.router = Router(pools, metrics, chunk_tokens, hedge_after_s)
        self.max_inputs = max_inputs
        self.max_input_chars = max_input_chars
        self.request_timeout_s = request_timeout_s
        self.auto_truncate = auto_truncate
        self.max_connections = max_connections
        self.context_limits = context_limits
        self.draining = False
        self.created = int(time.time())
        # model -> the special tokens the tokenizer puts before and after a text
        self._specials: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # (model, prompt) -> the prompt's token ids, no specials
        self._prompt_ids: dict[tuple[str, str], np.ndarray] = {}

    # ---- state -------------------------------------------------------------------------
    def on_replica_info(self, replica: Replica) -> None:
        model = self.models.get(replica.model)
        if model is not None and replica.info is not None:
            model.spec = model.spec.with_info(replica.info)

    def ready(self) -> tuple[bool, dict[str, int]]:
        healthy = {name: len(pool.healthy()) for name, pool in self.pools.items()}
        ok = not self.draining and all(
            healthy[name] > 0 and self.models[name].spec.confirmed for name in self.models
        )
        return ok, healthy

    def check_count(self, count: int, param: str, what: str = "inputs") -> None:
        """Refuse a request of more than `max_inputs` inputs (or documents, prompts)."""
        if count > self.max_inputs:
            raise ValidationError(
                f"At most {self.max_inputs} {what} per request, got {count}.", param=param
            )

    def served(self, name: str | None, kinds: tuple[str, ...], does: str) -> ServedModel:
        """The named model, which must be of one of `kinds`; None: the first served model
        of the first of `kinds` that has one (TEI's clients name no model). `does` says
        what such a model does, for the refusals ("produce embeddings")."""
        if name is None:
            for kind in kinds:
                name = next((n for n, m in self.models.items() if m.spec.kind == kind), None)
                if name is not None:
                    break
            else:
                raise ValidationError(f"No served model can {does}.", param="model")
        model = self.model(name)
        if model.spec.kind not in kinds:
            raise ValidationError(f"The model `{name}` does not {does}.", param="model")
        return model

    def model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFoundError(name)
        return model

    def _admit(self, model: str, texts: Sequence[str] = ()) -> tuple[float, Claim]:
        """The request's deadline and its claim on the replicas' capacity; refuses at
        once when draining, or when the replicas of `model` have no room for it (judged
        before any tokenizing is spent on `texts`)."""
        if self.draining:
            raise UnavailableError("The gateway is shutting down.")
        deadline = time.monotonic() + self.request_timeout_s
        # At least one token per _CHARS_PER_TOKEN_BOUND characters in every tokenizer here.
        hint = sum(len(t) for t in texts) // _CHARS_PER_TOKEN_BOUND
        return deadline, self.router.admit(model, deadline, hint)

    def _check_chars(self, texts: Sequence[str], param: str) -> None:
        for i, text in enumerate(texts):
            if len(text) > self.max_input_chars:
                raise ValidationError(
                    f"Input {i} has {len(text)} characters, over the limit of "
                    f"{self.max_input_chars}.",
                    param=param,
                )

    # ---- tokenization ------------------------------------------------------------------
    async def _tokenize(
        self,
        model: ServedModel,
        texts: Sequence[str],
        *,
        truncate: bool,
        max_length: int | None = None,
        left: bool = False,
        param: str = "input",
        fix: str = OPENAI_FIELDS.truncate,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Packed ids and lengths; over-long inputs are cut when `truncate` (from the left,
        keeping the leading special tokens, when `left`), else refused with a 400."""
        limit = model.spec.max_input_tokens
        cut = min(limit, max_length) if max_length is not None else limit
        to = cut if truncate else None
        if sum(len(t) for t in texts) > _INLINE_CHARS:
            ids, lengths = await asyncio.to_thread(self._encode, model, texts, to, left)
        else:
            ids, lengths = self._encode(model, texts, to, left)
        if not truncate:
            _check_lengths(lengths, cut, param, fix, "this model's limit" if cut == limit else "")
        return ids, lengths

    def _encode(
        self, model: ServedModel, texts: Sequence[str], cut: int | None, left: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Packed ids and lengths of `texts`, each cut to `cut` tokens (None: not cut): at
        its end, or (`left`) at its start, keeping the leading special tokens."""
        ids, lengths = model.tokenizer.encode_batch_packed(texts, True, None if left else cut)
        if cut is not None and left and lengths.size and int(lengths.max()) > cut:
            ids, lengths = _cut_left(ids, lengths, cut, len(self.special_frame(model)[0]))
        return ids, lengths

    def special_frame(self, model: ServedModel) -> tuple[np.ndarray, np.ndarray]:
        """The special token ids the tokenizer puts before a text (kept by left cuts) and
        after it, found once per model by encoding "a" with and without them."""
        frame = self._specials.get(model.name)
        if frame is None:
            bare, _ = model.tokenizer.encode_batch_packed(["a"], False, None)
            full, _ = model.tokenizer.encode_batch_packed(["a"], True, None)
            lead = next(
                (
                    i
                    for i in range(len(full) - len(bare) + 1)
                    if np.array_equal(full[i : i + len(bare)], bare)
                ),
                0,
            )
            frame = self._specials[model.name] = (full[:lead], full[lead + len(bare) :])
        return frame

    # ---- endpoints ---------------------------------------------------------------------
    def embedder(self, name: str | None) -> ServedModel:
        return self.served(name, (EMBEDDING,), "produce embeddings")

    def embedder_giving(self, name: str | None, kind: str, does: str) -> ServedModel:
        """The named embedder, which must offer output `kind`; None: the first that does."""
        if name is None:
            name = next(
                (
                    n
                    for n, m in self.models.items()
                    if m.spec.kind == EMBEDDING and kind in m.spec.outputs
                ),
                None,
            )
            if name is None:
                raise ValidationError(f"No served model can {does}.", param="model")
        model = self.embedder(name)
        if kind not in model.spec.outputs:
            raise ValidationError(
                f"The model `{name}` does not {does} (it offers "
                f"{', '.join(model.spec.outputs)} output).",
                param="model",
            )
        return model

    async def embed(
        self,
        model: ServedModel,
        inputs: Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        timings: Timings,
        *,
        prompt: str = "",
        truncate: bool | None = None,
        max_length: int | None = None,
        left: bool = False,
        dimensions: int | None = None,
        normalize: bool | None = None,
        fields: Fields = OPENAI_FIELDS,
    ) -> tuple[np.ndarray, int]:
        """The one embedding path of every route: [inputs, dims] float32 vectors and the
        token count. `inputs` are texts (`prompt` goes before each), token ids (one input)
        or lists of them; `truncate` None takes the server's default (`--auto-truncate`),
        cutting to the model's limit or `max_length` tokens, if fewer; errors name the
        route's `fields`."""
        out, tokens = await self.embed_outputs(
            model,
            inputs,
            timings,
            prompt=prompt,
            truncate=truncate,
            max_length=max_length,
            left=left,
            dimensions=dimensions,
            normalize=normalize,
            fields=fields,
        )
        assert out.dense is not None
        return out.dense, tokens

    async def embed_outputs(
        self,
        model: ServedModel,
        inputs: Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        timings: Timings,
        *,
        outputs: tuple[str, ...] = (),
        prompt: str = "",
        truncate: bool | None = None,
        max_length: int | None = None,
        left: bool = False,
        dimensions: int | None = None,
        normalize: bool | None = None,
        fields: Fields = OPENAI_FIELDS,
    ) -> tuple[EmbedOutputs, int]:
        """`embed` for any output kinds (`outputs`, names of `OUTPUT_KINDS`; empty: dense,
        on the unchanged path), each the model must offer (checked by the caller)."""
        spec = model.spec
        if dimensions is not None and spec.dimensions and dimensions > spec.dimensions:
            raise ValidationError(
                f"{fields.dimensions} must be at most {spec.dimensions} for `{model.name}`, "
                f"got {dimensions}.",
                param=fields.dimensions,
            )
        one_row_of_ids = isinstance(inputs[0], int)  # a flat list of token ids is one input
        self.check_count(1 if one_row_of_ids else len(inputs), fields.input)
        cut = self.auto_truncate if truncate is None else truncate
        t0 = time.perf_counter()
        texts_in = isinstance(inputs[0], str)
        deadline, claim = self._admit(model.name, inputs if texts_in else ())  # type: ignore[arg-type]
        with claim:
            with tracing.span("tokenize", inputs=len(inputs)):
                if texts_in:
                    texts = [prompt + t for t in inputs] if prompt else list(inputs)  # type: ignore[operator]
                    ids, lengths = await self._tokenize(
                        model,
                        texts,  # type: ignore[arg-type]
                        truncate=cut,
                        max_length=max_length,
                        left=left,
                        param=fields.input,
                        fix=fields.truncate,
                    )
                else:
                    rows: list[list[int]] = [inputs] if one_row_of_ids else inputs  # type: ignore[assignment,list-item]
                    limit = min(spec.max_input_tokens, max_length or spec.max_input_tokens)
                    ids, lengths = _pack_ids(rows, spec.vocab_size, limit, cut, left, fields)
            timings.tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if outputs:
                result, timings.chunks, timings.replica_s = await self.router.embed_outputs(
                    model.name,
                    ids,
                    lengths,
                    [OUTPUT_KINDS[o] for o in outputs],
                    dimensions=dimensions or 0,
                    normalize=normalize,
                    deadline=deadline,
                    claim=claim,
                )
            else:
                vectors, timings.chunks, timings.replica_s = await self.router.embed(
                    model.name,
                    ids,
                    lengths,
                    dimensions=dimensions or 0,
                    normalize=normalize,
                    deadline=deadline,
                    claim=claim,
                )
                result = EmbedOutputs(dense=vectors)
            timings.inference_s = time.perf_counter() - t1
        tokens = int(ids.size)
        self.metrics.input_tokens.labels(model=model.name).inc(tokens)
        return result, tokens

    async def embeddings(self, req: EmbeddingRequest, timings: Timings) -> EmbeddingResponse:
        model = self.embedder(req.model)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if req.instruction is not None:
            if req.input_type in _DOCUMENT_TYPES:
                raise ValidationError(
                    "An instruction goes with queries; this request's input_type is "
                    f"`{req.input_type}`.",
                    param="instruction",
                )
            prompt = model.instructed_prompt(req.instruction)
        else:
            prompt = model.prompt_for(req.input_type)
        inputs, prompt = _prompted(model, inputs, prompt, "input")
        # vLLM's truncate_prompt_tokens: cut to that many tokens
        max_length = _truncation(model.spec.max_input_tokens, req.truncate_prompt_tokens)
        truncate = True if max_length is not None else req.truncate
        with _cut_named(None if max_length is None else "truncate_prompt_tokens"):
            if req.output == "sparse":
                return await self._sparse_embeddings(
                    req, model, inputs, prompt, truncate, max_length, timings
                )
            vectors, tokens = await self.embed(
                model,
                inputs,
                timings,
                prompt=prompt,
                truncate=truncate,
                max_length=max_length,
                left=cuts_left(req),
                dimensions=req.dimensions,
                normalize=False if req.use_activation is False else None,
            )
        return EmbeddingResponse(
            _embedding_data(vectors, req.encoding_format), req.model, Usage(tokens, tokens)
        )

    async def _sparse_embeddings(
        self,
        req: EmbeddingRequest,
        model: ServedModel,
        inputs: Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        prompt: str,
        truncate: bool | None,
        max_length: int | None,
        timings: Timings,
    ) -> EmbeddingResponse:
        """/v1/embeddings with ``output: sparse``: `{indices, values}` per item."""
        if req.encoding_format != "float":
            raise ValidationError(
                "Sparse embeddings are JSON numbers only: send encoding_format `float`.",
                param="encoding_format",
            )
        if req.dimensions is not None:
            raise ValidationError(
                "dimensions cuts dense vectors; it does not apply to sparse ones.",
                param="dimensions",
            )
        if "sparse" not in model.spec.outputs:
            raise ValidationError(
                f"The model `{model.name}` has no sparse output (it offers "
                f"{', '.join(model.spec.outputs)}).",
                param="output",
            )
        out, tokens = await self.embed_outputs(
            model,
            inputs,
            timings,
            outputs=("sparse",),
            prompt=prompt,
            truncate=truncate,
            max_length=max_length,
            left=cuts_left(req),
        )
        assert out.sparse is not None
        data = [
            EmbeddingData(i, SparseEmbedding(ids.tolist(), values.tolist()))  # type: ignore[union-attr]
            for i, (ids, values) in enumerate(out.sparse.split())
        ]
        return EmbeddingResponse(data, req.model, Usage(tokens, tokens))

    async def tei_embed_sparse(
        self, req: TeiEmbedSparseRequest, timings: Timings
    ) -> list[list[TeiSparseValue]]:
        """TEI's /embed_sparse: per input its nonzero `{index, value}` pairs, ids ascending."""
        model = self.embedder_giving(req.model, "sparse", "produce sparse embeddings")
        out, _ = await self._tei_outputs(model, req, "sparse", timings)
        assert out.sparse is not None
        return [
            [TeiSparseValue(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]  # type: ignore[union-attr]
            for ids, values in out.sparse.split()
        ]

    async def tei_embed_all(self, req: TeiEmbedAllRequest, timings: Timings) -> list[np.ndarray]:
        """TEI's /embed_all: per input the last hidden state of each of its tokens."""
        model = self.embedder_giving(req.model, "token_states", "give token states")
        out, _ = await self._tei_outputs(model, req, "token_states", timings)
        assert out.token_states is not None
        return [values for _, values in out.token_states.split()]

    async def _tei_outputs(
        self,
        model: ServedModel,
        req: TeiEmbedSparseRequest | TeiEmbedAllRequest,
        kind: str,
        timings: Timings,
    ) -> tuple[EmbedOutputs, int]:
        inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        prompt = model.prompt_named(req.prompt_name)
        inputs, prompt = _prompted(model, inputs, prompt, "inputs")
        return await self.embed_outputs(
            model,
            inputs,
            timings,
            outputs=(kind,),
            prompt=prompt,
            truncate=req.truncate,
            left=req.truncation_direction.lower() == "left",
            fields=TEI_FIELDS,
        )

    async def contextualized(
        self, req: ContextualizedEmbeddingRequest, timings: Timings
    ) -> ContextualizedEmbeddingResponse:
        """Perplexity's /v1/contextualizedembeddings (late chunking): each document is one
        sequence, [specials] [prompt] chunk 1 ... chunk n [specials], every chunk tokenized
        on its own (no special tokens); a chunk's vector is pooled over its own tokens only,
        which attended to the whole document."""
        model = self.embedder(req.model)
        spec = model.spec
        limits = self.context_limits
        docs = req.input
        if len(docs) > limits.documents:
            raise ValidationError(
                f"At most {limits.documents} documents per request, got {len(docs)}.",
                param="input",
            )
        counts = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        if int(counts.sum()) > limits.chunks:
            raise ValidationError(
                f"At most {limits.chunks} chunks per request (all documents together), "
                f"got {int(counts.sum())}.",
                param="input",
            )
        if req.dimensions is not None and spec.dimensions and req.dimensions > spec.dimensions:
            raise ValidationError(
                f"dimensions must be at most {spec.dimensions} for `{model.name}`, "
                f"got {req.dimensions}.",
                param="dimensions",
            )
        chunks = [c for d in docs for c in d]
        self._check_chars(chunks, "input")
        t0 = time.perf_counter()
        deadline, claim = self._admit(model.name, chunks)
        with claim:
            with tracing.span("tokenize", inputs=len(chunks)):
                encode = model.tokenizer.encode_batch_packed
                if sum(len(c) for c in chunks) > _INLINE_CHARS:
                    ids, lengths = await asyncio.to_thread(encode, chunks, False, None)
                else:
                    ids, lengths = encode(chunks, False, None)
                head, tail = self._document_frame(model, model.prompt_for(req.input_type))
                ids, doc_lengths, bounds = _late_chunks(ids, lengths, counts, head, tail)
            limit = min(limits.document_tokens, spec.max_input_tokens)
            over = np.flatnonzero(doc_lengths > limit)
            if over.size:
                i = int(over[0])
                raise ValidationError(
                    f"Document {i} has {int(doc_lengths[i])} tokens, over the limit of {limit} "
                    f"tokens per document.",
                    param="input",
                )
            empty = np.flatnonzero(lengths == 0)
            if empty.size:
                j = int(empty[0])
                i = int(np.searchsorted(np.cumsum(counts), j, side="right"))
                raise ValidationError(
                    f"Chunk {j - int(counts[:i].sum())} of document {i} has no tokens.",
                    param="input",
                )
            if ids.size > limits.request_tokens:
                raise ValidationError(
                    f"At most {limits.request_tokens} tokens per request, got {ids.size}.",
                    param="input",
                )
            timings.tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            vectors, timings.chunks, timings.replica_s = await self.router.embed(
                model.name,
                ids,
                doc_lengths,
                dimensions=req.dimensions or 0,
                spans=(counts, bounds),
                deadline=deadline,
                claim=claim,
            )
            timings.inference_s = time.perf_counter() - t1
        tokens = int(ids.size)
        self.metrics.input_tokens.labels(model=model.name).inc(tokens)
        data = _embedding_data(vectors, req.encoding_format)
        starts = np.concatenate(([0], np.cumsum(counts)))
        documents = [
            ContextualizedData(
                i,
                [
                    EmbeddingData(j, row.embedding)
                    for j, row in enumerate(data[starts[i] : starts[i + 1]])
                ],
            )
            for i in range(len(docs))
        ]
        return ContextualizedEmbeddingResponse(documents, req.model, Usage(tokens, tokens))

    def _document_frame(self, model: ServedModel, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids before a late-chunked document's first chunk (the tokenizer's leading
        special tokens, then `prompt`) and after its last (the trailing special tokens)."""
        lead, tail = self.special_frame(model)
        if not prompt:
            return lead, tail
        said = self._prompt_ids.get((model.name, prompt))
        if said is None:  # prompts come from the model's config: a handful per model
            said, _ = model.tokenizer.encode_batch_packed([prompt], False, None)
            self._prompt_ids[(model.name, prompt)] = said
        return np.concatenate((lead, said)), tail

    async def tei_embed(self, req: TeiEmbedRequest, timings: Timings) -> np.ndarray:
        """TEI's /embed: one array of floats per input."""
        model = self.embedder(req.model)
        inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        prompt = model.prompt_named(req.prompt_name)
        inputs, prompt = _prompted(model, inputs, prompt, "inputs")
        vectors, _ = await self.embed(
            model,
            inputs,
            timings,
            prompt=prompt,
            truncate=req.truncate,
            left=req.truncation_direction.lower() == "left",
            dimensions=req.dimensions,
            normalize=req.normalize,
            fields=TEI_FIELDS,
        )
        return vectors

    async def tei_similarity(self, req: TeiSimilarityRequest, timings: Timings) -> np.ndarray:
        """TEI's /similarity: the cosine of the source sentence with each sentence."""
        model = self.embedder(req.model)
        params = req.parameters or _NO_PARAMETERS
        prompt = model.prompt_named(params.prompt_name)
        texts = [req.inputs.source_sentence, *req.inputs.sentences]
        vectors, _ = await self.embed(
            model,
            texts,
            timings,
            prompt=prompt,
            truncate=params.truncate,
            left=params.truncation_direction.lower() == "left",
            fields=TEI_FIELDS,
        )
        return _cosines_to_first(vectors)

    async def cohere_embed(self, req: CohereEmbedRequest, timings: Timings) -> CohereEmbedResponse:
        """Cohere's /v2/embed: the requested embedding types of each text."""
        for param in ("images", "inputs"):
            if getattr(req, param) is not None:
                raise ValidationError(
                    f"'{param}' is not supported: send `texts` (cut by `truncate`).", param=param
                )
        model = self.embedder(req.model)
        with _cut_named(None if req.max_tokens is None else "max_tokens"):
            vectors, tokens = await self.embed(
                model,
                req.texts,
                timings,
                prompt=model.prompt_for(req.input_type),
                truncate=req.truncate != "NONE",
                max_length=req.max_tokens,
                left=req.truncate == "START",
                dimensions=req.output_dimension,
                fields=COHERE_FIELDS,
            )
        kinds = dict.fromkeys(req.embedding_types)  # each once, in the order asked
        embeddings = {kind: _COHERE_TYPES[kind](vectors) for kind in kinds}
        meta = CohereMeta(ApiVersion("2"), CohereBilledUnits(tokens))
        return CohereEmbedResponse(str(uuid.uuid4()), embeddings, list(req.texts), meta)

    async def tei_predict(
        self, req: TeiPredictRequest, timings: Timings
    ) -> list[TeiPrediction] | list[list[TeiPrediction]]:
        """TEI's /predict: each input's labels by score, highest first (probabilities:
        sigmoid for one label, softmax over several; logits with `raw_scores`)."""
        model = self.served(req.model, (CROSS_ENCODER,), "classify text")
        name = model.name
        left = req.truncation_direction.lower() == "left"
        batch = isinstance(req.inputs, list) and isinstance(req.inputs[0], list)
        items: list[list[str]] = (
            req.inputs if batch else [[req.inputs] if isinstance(req.inputs, str) else req.inputs]  # type: ignore[assignment,list-item]
        )
        self.check_count(len(items), "inputs")
        cut = self.auto_truncate if req.truncate is None else req.truncate
        limit = model.spec.max_input_tokens
        template = _pair_template(model, left)
        if template is not None and any(len(item) != 2 for item in items):
            raise ValidationError(
                f"The model `{name}` scores (query, document) pairs through its chat "
                "template: send each input as a pair of texts.",
                param="inputs",
            )
        logits, _ = await self._class_logits(
            model, template, items, limit if cut else None, left, "inputs", timings
        )
        scores = logits if req.raw_scores else _class_probabilities(logits)
        names = _label_names(model, scores.shape[1])
        ranked = [
            [TeiPrediction(float(row[j]), names[j]) for j in np.argsort(-row, kind="stable")]
            for row in scores
        ]
        return ranked if batch else ranked[0]

    async def classify(self, req: ClassifyRequest, timings: Timings) -> ClassifyResponse:
        """vLLM's /classify: each text's class probabilities (a sigmoid for one label, a
        softmax over several; the logits with `use_activation: false`) and its likeliest
        label."""
        model = self.served(req.model, (CROSS_ENCODER,), "classify text")
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        self.check_count(len(texts), "input")
        self._check_chars(texts, "input")
        left = req.truncation_side == "left"
        if _pair_template(model, left, "truncation_side") is not None:
            raise ValidationError(
                f"The model `{model.name}` scores (query, document) pairs through its chat "
                "template; use /score or /rerank.",
                param="model",
            )
        max_length = _truncation(model.spec.max_input_tokens, req.truncate_prompt_tokens)
        asked = "truncate_prompt_tokens" if max_length is not None else None
        with _cut_named(asked):
            logits, tokens = await self._class_logits(
                model,
                None,
                [[t] for t in texts],
                max_length,
                left,
                "input",
                timings,
                fix=_SCORE_TRUNCATE,
            )
        probs = logits if activation_asked(req) is False else _class_probabilities(logits)
        names = _label_names(model, probs.shape[1])
        data = [
            ClassifyData(i, names[int(np.argmax(row))], row.tolist(), probs.shape[1])
            for i, row in enumerate(probs)
        ]
        return ClassifyResponse(
            f"classify-{uuid.uuid4().hex}",
            int(time.time()),
            model.name,
            data,
            Usage(tokens, tokens),
        )

    async def _class_logits(
        self,
        model: ServedModel,
        template: PairTemplate | None,
        items: Sequence[Sequence[str]],
        max_length: int | None,
        left: bool,
        param: str,
        timings: Timings,
        fix: str = OPENAI_FIELDS.truncate,
    ) -> tuple[np.ndarray, int]:
        """A cross-encoder's logits [len(items), labels] (fp64) of `items` (texts or pairs,
        `_pairs`), cut to `max_length` (None: one over the model's limit is a 400 naming
        `param`, saying to `fix` it), and the tokens they took."""
        name, limit = model.name, model.spec.max_input_tokens
        t0 = time.perf_counter()
        deadline, claim = self._admit(name, [t for item in items for t in item])
        with claim:
            with tracing.span("tokenize", inputs=len(items)):
                ids, lengths, first = self._pairs(model, template, items, max_length, left)
                if max_length is None:
                    _check_lengths(lengths, limit, param, fix)
            timings.tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            logits, timings.chunks, timings.replica_s = await self.router.score(
                name, ids, lengths, first, deadline=deadline, claim=claim, activation=False
            )
            timings.inference_s = time.perf_counter() - t1
        self.metrics.input_tokens.labels(model=name).inc(int(ids.size))
        return logits.reshape(len(items), -1).astype(np.float64), int(ids.size)

    def _pairs(
        self,
        model: ServedModel,
        template: PairTemplate | None,
        items: Sequence[Sequence[str]],
        max_length: int | None,
        left: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A cross-encoder's packed ids, lengths and first-segment lengths of `items`, each
        a pair of texts or a single text (its own first segment), cut to `max_length` as
        TEI and `CrossEncoder` cut them: pairs longest first, a chat-template reranker's
        rendered prompt with its tail kept (`_template_pairs`)."""
        parts = []
        for item in items:
            if template is not None:  # as /rerank reads the pair
                ids, lengths = _template_pairs(
                    model, template, item[0], None, item[1:], None, max_length
                )
                parts.append((ids, lengths, lengths))
            elif len(item) == 1:
                ids, lengths = self._encode(model, item, max_length, left)
                parts.append((ids, lengths, lengths))
            else:
                parts.append(
                    model.tokenizer.encode_pairs_packed(item[0], item[1:], max_length, None, left)
                )
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]

    async def score(self, req: ScoreRequest, timings: Timings) -> ScoreResponse:
        """vLLM's /score: each pair's relevance, a cross-encoder's score (its sigmoid,
        logits with `use_activation: false`) or an embedder's cosine of the two texts."""
        present = {n for pair in _SCORE_FIELDS for n in pair if getattr(req, n) is not None}
        sides = [pair for pair in _SCORE_FIELDS if present.issuperset(pair)]
        if len(sides) != 1 or present != set(sides[0]):
            # the field to fix: one too many, or the partner of one sent alone
            if len(sides) == 1:
                param = min(present - set(sides[0]))
            elif sides:  # `queries` with both `documents` and `items`
                param = sides[1][1]
            else:
                sent = [(a, b) for a, b in _SCORE_FIELDS if a in present or b in present]
                param = next(((b if a in present else a) for a, b in sent), "queries")
            raise ValidationError(
                "Send the texts to score as one of vLLM's pairs of fields: `queries` and "
                "`documents`, `queries` and `items`, `data_1` and `data_2`, or `text_1` and "
                "`text_2`.",
                param=param,
            )
        a_name, b_name = sides[0]
        a, b = getattr(req, a_name), getattr(req, b_name)
        a, b = ([a] if isinstance(a, str) else list(a)), ([b] if isinstance(b, str) else list(b))
        if len(a) != 1 and len(a) != len(b):
            raise ValidationError(
                f"`{a_name}` has {len(a)} texts and `{b_name}` {len(b)}: score 1 against 1, "
                "1 against N or N against N.",
                param=b_name,
            )
        self.check_count(len(b), b_name)
        model = self.reranker(req.model)
        name, spec = model.name, model.spec
        limit = spec.max_input_tokens
        max_length = _truncation(limit, req.truncate_prompt_tokens)
        left = req.truncation_side == "left"
        self._check_chars(a, a_name)
        self._check_chars(b, b_name)
        t0 = time.perf_counter()
        deadline, claim = self._admit(name, a + b)
        with claim:
            asked = "truncate_prompt_tokens" if req.truncate_prompt_tokens is not None else None
            with _cut_named(asked), tracing.span("tokenize", inputs=len(a) + len(b)):
                if spec.kind == CROSS_ENCODER:
                    pairs = [(a[0] if len(a) == 1 else a[i], doc) for i, doc in enumerate(b)]
                    template = _pair_template(model, left, "truncation_side")
                    ids, lengths, first = await asyncio.to_thread(
                        self._pairs, model, template, pairs, max_length, left
                    )
                    _check_lengths(lengths, limit, b_name, _SCORE_TRUNCATE)
                else:  # each text embedded once, with the prompt of no prompt chosen
                    prompt = model.prompt_for(None)
                    sides = []
                    for texts, side in ((a, a_name), (b, b_name)):  # 400s name their side
                        sides.append(
                            await self._tokenize(
                                model,
                                [prompt + t for t in texts] if prompt else texts,
                                truncate=max_length is not None,
                                max_length=max_length,
                                left=left,
                                param=side,
                                fix=_SCORE_TRUNCATE,
                            )
                        )
                    ids = np.concatenate([sides[0][0], sides[1][0]])
                    lengths = np.concatenate([sides[0][1], sides[1][1]])
            timings.tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if spec.kind == CROSS_ENCODER:
                raw, timings.chunks, timings.replica_s = await self.router.score(
                    name,
                    ids,
                    lengths,
                    first,
                    deadline=deadline,
                    claim=claim,
                    activation=False if activation_asked(req) is False else None,
                )
                scores = raw[:, 0] if raw.ndim == 2 else raw
            else:
                vectors, timings.chunks, timings.replica_s = await self.router.embed(
                    name, ids, lengths, dimensions=0, deadline=deadline, claim=claim
                )
                # each document's cosine with its query (the one query, 1:N)
                scores = (_unit(vectors[: len(a)]) * _unit(vectors[len(a) :])).sum(axis=1)
            timings.inference_s = time.perf_counter() - t1
        tokens = int(ids.size)
        self.metrics.input_tokens.labels(model=name).inc(tokens)
        data = [ScoreData(i, float(v)) for i, v in enumerate(scores.tolist())]
        return ScoreResponse(
            f"score-{uuid.uuid4().hex}", int(time.time()), name, data, ScoreUsage(tokens, tokens)
        )

    def tei_decode(self, req: TeiDecodeRequest) -> list[str]:
        """TEI's /decode: one string per row of ids."""
        model = self.model(req.model) if req.model is not None else next(iter(self.models.values()))
        rows: list[list[int]] = [req.ids] if isinstance(req.ids[0], int) else req.ids  # type: ignore[assignment,list-item]
        self.check_count(len(rows), "ids")
        return model.decode(rows, req.skip_special_tokens)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of one row of ids, special tokens kept."""
        model = self.model(req.model) if req.model is not None else next(iter(self.models.values()))
        return DetokenizeResponse(model.decode([req.tokens], False, param="tokens")[0])

    def tei_info(self) -> TeiInfo:
        """TEI's /info, of the model /embed serves by default."""
        model = self.embedder(None)
        return TeiInfo(
            model_id=model.name,
            model_dtype="float32",
            model_type={"embedding": {"pooling": "model default"}},
            max_concurrent_requests=self.max_connections,
            max_input_length=model.spec.max_input_tokens,
            max_batch_tokens=self.router.chunk_tokens,
            max_client_batch_size=self.max_inputs,
            auto_truncate=self.auto_truncate,
            tokenization_workers=1,
            version=VERSION,
        )

    def reranker(self, name: str | None) -> ServedModel:
        """Cross-encoders first, then embedding models (cosine of query and document)."""
        return self.served(name, (CROSS_ENCODER, EMBEDDING), "rerank")

    async def rerank(
        self, req: RerankRequest, timings: Timings
    ) -> RerankResponse | list[TeiRankWithText] | list[TeiRank]:
        if req.documents is None and req.texts is None:
            raise ValidationError(
                "Invalid 'documents': Field required (or `texts`, in TEI's shape).",
                param="documents",
            )
        if req.documents is not None and req.texts is not None:
            raise ValidationError(
                "Send `documents` (Cohere, Jina) or `texts` (TEI), not both.", param="texts"
            )
        if req.documents is not None and req.model is None:  # Cohere's shape names it
            raise ValidationError("Invalid 'model': Field required.", param="model")
        model = self.reranker(req.model)
        name = model.name
        t0 = time.perf_counter()
        self._check_chars([req.query], "query")
        tei = req.texts is not None
        param = "texts" if tei else "documents"
        if tei:
            docs = list(req.texts)  # type: ignore[arg-type]
            cut = self.auto_truncate if req.truncate is None else req.truncate
            per_doc = None
        else:
            docs = [d if isinstance(d, str) else d.text for d in req.documents]  # type: ignore[union-attr]
            cut = True  # Cohere's shape fits documents to the room left
            per_doc = req.max_tokens_per_doc or _DEFAULT_MAX_TOKENS_PER_DOC
        left = cuts_left(req)
        self.check_count(len(docs), param, "documents")
        spec = model.spec
        # vLLM's truncate_prompt_tokens: pairs cut to that many tokens
        room = _truncation(spec.max_input_tokens, req.truncate_prompt_tokens)
        cut_param = None if room is None else "truncate_prompt_tokens"
        cut = cut or room is not None
        room = room or spec.max_input_tokens
        # Everything about the request is checked before it is admitted: an embedder's
        # over-long query is a 400 however busy the replicas are.
        if spec.kind == CROSS_ENCODER:
            template = _pair_template(model, left)
            if template is None:
                # sentence-transformers' `prompt` goes before the query.
                query = (req.instruction or "") + req.query
        else:
            q_prompt = (
                model.instructed_prompt(req.instruction) if req.instruction else spec.query_prompt
            )
            # the query is cut only when vLLM's truncate_prompt_tokens asks (Cohere's and
            # TEI's shapes cut documents alone)
            asked = req.truncate_prompt_tokens is not None
            with _cut_named(cut_param):
                q_ids, q_len = await self._tokenize(
                    model,
                    [q_prompt + req.query],
                    truncate=asked,
                    max_length=room if asked else None,
                    left=left,
                    param="query",
                )
        deadline, claim = self._admit(name, docs)
        with claim:
            if spec.kind == CROSS_ENCODER:
                if template is not None:
                    with _cut_named(cut_param), tracing.span("tokenize", inputs=len(docs)):
                        ids, lengths = await asyncio.to_thread(
                            _template_pairs,
                            model,
                            template,
                            req.query,
                            req.instruction,
                            docs,
                            per_doc,
                            room if cut else None,
                        )
                    first = lengths.astype(np.uint32)  # one segment: the rendered prompt
                else:
                    # Pairs as `tokenizer(query, document, truncation=True)` builds them in
                    # sentence-transformers' CrossEncoder, TEI and vLLM: a document is cut to
                    # max_tokens_per_doc of its own tokens, then the pair to the model's
                    # limit, longest first (a query over half the room is cut too), at the
                    # sequences' ends or, `left`, their starts.
                    with _cut_named(cut_param), tracing.span("tokenize", inputs=len(docs)):
                        ids, lengths, first = await asyncio.to_thread(
                            model.tokenizer.encode_pairs_packed,
                            query,
                            docs,
                            room if cut else None,
                            per_doc,
                            left,
                        )
                if not cut:
                    _check_lengths(lengths, spec.max_input_tokens, param)
                timings.tokenize_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                raw, timings.chunks, timings.replica_s = await self.router.score(
                    name,
                    ids,
                    lengths,
                    first,
                    deadline=deadline,
                    claim=claim,
                    activation=False if req.raw_scores or activation_asked(req) is False else None,
                )
                timings.inference_s = time.perf_counter() - t1
                scores = raw[:, 0] if raw.ndim == 2 else raw
                tokens = int(ids.size)
            else:
                docs_in = [spec.document_prompt + d for d in docs]
                max_length = room
                if per_doc is not None:
                    # max_tokens_per_doc counts the document's own tokens, not prompt and
                    # specials.
                    _, overhead = model.tokenizer.encode_batch_packed(
                        [spec.document_prompt], True, None
                    )
                    max_length = min(per_doc + int(overhead[0]), room)
                with _cut_named(cut_param), tracing.span("tokenize", inputs=len(docs)):
                    d_ids, d_len = await self._tokenize(
                        model,
                        docs_in,
                        truncate=cut,
                        max_length=max_length,
                        left=left,
                        param=param,
                    )
                ids = np.concatenate((q_ids, d_ids))
                lengths = np.concatenate((q_len, d_len))
                timings.tokenize_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                if "multi_vector" in spec.outputs:
                    # ColBERT late interaction: query and documents' token vectors from
                    # this one model, score = sum over query tokens of the best dot product.
                    out, timings.chunks, timings.replica_s = await self.router.embed_outputs(
                        name,
                        ids,
                        lengths,
                        [OUTPUT_KINDS["multi_vector"]],
                        deadline=deadline,
                        claim=claim,
                    )
                    assert out.multi_vectors is not None
                    scores = _maxsim_to_first([v for _, v in out.multi_vectors.split()])
                else:
                    vectors, timings.chunks, timings.replica_s = await self.router.embed(
                        name, ids, lengths, dimensions=0, deadline=deadline, claim=claim
                    )
                    scores = _cosines_to_first(vectors)
                timings.inference_s = time.perf_counter() - t1
                tokens = int(ids.size)
        self.metrics.input_tokens.labels(model=name).inc(tokens)
        order = np.argsort(-scores, kind="stable")
        if req.top_n is not None:
            order = order[: req.top_n]
        if tei:
            if req.return_text:
                return [TeiRankWithText(i, float(scores[i]), docs[i]) for i in order.tolist()]
            return [TeiRank(i, float(scores[i])) for i in order.tolist()]
        results: list[RerankResultWithDocument | RerankResult]
        if req.return_documents is not False:
            results = [
                RerankResultWithDocument(i, float(scores[i]), RerankText(docs[i]))
                for i in order.tolist()
            ]
        else:
            results = [RerankResult(i, float(scores[i])) for i in order.tolist()]
        usage = Usage(tokens, tokens)
        return RerankResponse(str(uuid.uuid4()), name, results, usage, RERANK_META)

    async def tokenize(
        self, req: TokenizeRequest
    ) -> TokenizeResponse | list[list[TeiToken]] | VllmTokenizeResponse:
        tei, vllm = req.inputs is not None, req.prompt is not None
        # `messages` (vLLM's chat shape) is tokenized by the generation service
        if tei + vllm + (req.input is not None) + (req.messages is not None) != 1:
            raise ValidationError(
                "Send `input` (with `model`), `inputs` (TEI's shape), `prompt` or "
                "`messages` (vLLM's), one of them.",
                param="input",
            )
        specials = req.add_special_tokens is not False
        if req.input is not None and req.model is None:
            raise ValidationError("Invalid 'model': Field required.", param="model")
        model = self.model(req.model) if req.model is not None else next(iter(self.models.values()))
        if vllm:
            assert req.prompt is not None
            self._check_chars([req.prompt], "prompt")
            enc = model.reference_tokenizer.encode(req.prompt, add_special_tokens=specials)
            strs = list(enc.tokens) if req.return_token_strs else None
            return VllmTokenizeResponse(
                len(enc.ids), model.spec.max_input_tokens, list(enc.ids), strs
            )
        raw = req.inputs if tei else req.input
        param = "inputs" if tei else "input"
        texts = [raw] if isinstance(raw, str) else list(raw)  # type: ignore[arg-type]
        self.check_count(len(texts), param)
        prompt = model.prompt_named(req.prompt_name)
        texts = [prompt + t for t in texts] if prompt else texts
        self._check_chars(texts, param)

        def run() -> list[tuple[list[int], list[tuple[int, int]]]]:
            return [model.tokenizer.encode_with_offsets(t, specials) for t in texts]

        def run_tei() -> list[list[TeiToken]]:
            return [model.tei_tokens(t, specials) for t in texts]

        inline = sum(len(t) for t in texts) <= _INLINE_CHARS
        if tei:
            return run_tei() if inline else await asyncio.to_thread(run_tei)
        encoded = run() if inline else await asyncio.to_thread(run)
        total = sum(len(ids) for ids, _ in encoded)
        data = [TokenizedInput(i, ids, offsets) for i, (ids, offsets) in enumerate(encoded)]
        return TokenizeResponse(model.name, data, Usage(total, total))

    def list_models(self) -> ModelList:
        return ModelList([self.model_card(name) for name in self.models])

    def model_card(self, name: str) -> ModelCard:
        return ModelCard(self.model(name).name, self.created, "trellis")


def quantize_int8(vectors: np.ndarray) -> np.ndarray:
    """[N, D] float → [N, D] int8: each vector scaled by 127 / its largest magnitude and
    rounded half to even (a zero vector stays zero). Cosine similarity is unaffected by the
    per-vector scale, so int8 vectors compare as the floats do, up to rounding."""
    x = vectors.astype(np.float64)
    peak = np.abs(x).max(axis=1, keepdims=True)
    peak[peak == 0] = 1.0
    return np.clip(np.rint(127.0 * x / peak), -128, 127).astype(np.int8)


def pack_binary(vectors: np.ndarray) -> np.ndarray:
    """[N, D] float → [N, ceil(D / 8)] uint8: bit d is 1 where x_d > 0, packed least
    significant bit first (dimension 0 is bit 0 of byte 0); Hamming distance compares them."""
    return np.packbits(vectors > 0, axis=1, bitorder="little")


# encoding_format → rows of bytes to base64 each (absent: float lists).
_ENCODINGS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "base64": lambda v: v.astype("<f4", copy=False),
    "base64_int8": quantize_int8,
    "base64_binary": pack_binary,
}


_DOCUMENT_TYPES = ("search_document", "document", "passage")


def _prompted(
    model: ServedModel,
    inputs: Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
    prompt: str,
    field: str,
) -> tuple[Sequence[str] | Sequence[int] | Sequence[Sequence[int]], str]:
    """`inputs` and the prompt to put before each. Token ids are embedded as sent, without
    one; with a prompt they are read as TEI reads them: decoded (special tokens skipped),
    the prompt put before the text, and encoded again. `field`: the request's field for
    the inputs."""
    if isinstance(inputs[0], str):
        return inputs, prompt
    if not prompt:
        return inputs, ""
    rows = [inputs] if isinstance(inputs[0], int) else inputs
    return model.decode(rows, True, param=field), prompt  # type: ignore[arg-type]


@contextlib.contextmanager
def _cut_named(param: str | None) -> Iterator[None]:
    """The tokenizer's refusal of a cut (one below the special tokens) as a 400 naming
    `param`, the request field that asked for it (None: left to the exception map)."""
    try:
        yield
    except TokenizationError as exc:
        if param is None:
            raise
        raise ValidationError(f"{param} is too small: {exc}.", param=param) from None


def _class_probabilities(logits: np.ndarray) -> np.ndarray:
    """A classifier's probabilities from its logits [N, labels]: the sigmoid for one
    label, else the softmax over the labels (as TEI, vLLM and sentence-transformers)."""
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _label_names(model: ServedModel, count: int) -> tuple[str, ...]:
    """The model's label names (config.json's id2label), or LABEL_i as transformers names them."""
    return model.spec.labels or tuple(f"LABEL_{i}" for i in range(count))


def _truncation(limit: int, tokens: int | None) -> int | None:
    """The cut vLLM's `truncate_prompt_tokens` asks for: None (no cut), -1 (the model's
    `limit`) or that many tokens, at most the limit."""
    if tokens is not None and (tokens > limit or tokens == 0):
        raise ValidationError(
            f"truncate_prompt_tokens must be -1 or 1 to the model's limit of {limit} "
            f"tokens, got {tokens}.",
            param="truncate_prompt_tokens",
        )
    return None if tokens is None else limit if tokens == -1 else tokens


def _pair_template(
    model: ServedModel, left: bool, param: str = "truncation_direction"
) -> PairTemplate | None:
    """The chat template a cross-encoder reads its pairs through (None: pairs as the
    tokenizer builds them), refusing left cuts (`param`, the request's field for them) for
    one: sentence-transformers cuts such a prompt at its end."""
    template = model.pair_template
    if left and template is not None:
        raise ValidationError(
            f"{param} `left` is not supported for `{model.name}`, whose chat "
            "template's prompt is cut at its end (as sentence-transformers cuts it).",
            param=param,
        )
    return template


def _render_pair(
    model: ServedModel, template: PairTemplate, query: str, doc: str, instruction: str | None
) -> np.ndarray:
    """Ids of the (query, `doc`) prompt rendered by the model's chat template, tokenized as
    one prompt (special-token text in the query, document or instruction stays text)."""
    tok = model.tokenizer
    messages = template.messages(query, doc, instruction)
    rendered = template.template.render_prompt(
        messages, tok.special_tokens, add_generation_prompt=template.add_generation_prompt
    )
    return tok.encode_prompt(rendered.text, rendered.literals)


def _template_suffix(
    model: ServedModel, template: PairTemplate, query: str, instruction: str | None
) -> np.ndarray:
    """The ids the model's prompt ends with after the document (the template's tail, e.g.
    the assistant turn the score is read at): the longest run of ids two renders with
    different documents end alike, short of the whole of either."""
    a = _render_pair(model, template, query, "0", instruction)
    b = _render_pair(model, template, query, "1 2 3 4", instruction)
    n = 0
    while n < min(a.size, b.size) and a[a.size - 1 - n] == b[b.size - 1 - n]:
        n += 1
    return a[a.size - n :] if n < min(a.size, b.size) else a[:0]


def _template_pairs(
    model: ServedModel,
    template: PairTemplate,
    query: str,
    instruction: str | None,
    docs: Sequence[str],
    per_doc: int | None,
    limit: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Packed ids and lengths of (query, document) pairs rendered by the model's chat
    template (`PairTemplate`, `_render_pair`), each document first cut to `per_doc` of its
    own tokens. A prompt over `limit` tokens (None: no cut) is cut as
    sentence-transformers' CrossEncoder cuts it: to the limit, with the template's tail
    (`_template_suffix`, found for the first such prompt) written back over its last ids,
    so the model still reads its score where it expects to."""
    tok = model.tokenizer
    suffix: np.ndarray | None = None
    rows: list[np.ndarray] = []
    for doc in docs:
        # a text has at most one token per UTF-8 byte, and one more a prefix may add
        if per_doc is not None and len(doc.encode()) + 1 > per_doc:
            _, offsets = tok.encode_with_offsets(doc, add_special_tokens=False)
            if len(offsets) > per_doc:
                doc = doc[: offsets[per_doc - 1][1]]
        ids = _render_pair(model, template, query, doc, instruction)
        if limit is not None and ids.size > limit:
            if suffix is None:
                suffix = _template_suffix(model, template, query, instruction)
            ids = np.concatenate((ids[: max(limit - suffix.size, 0)], suffix[-limit:]))
        rows.append(ids)
    lengths = np.fromiter((r.size for r in rows), dtype=np.uint32, count=len(rows))
    return np.concatenate(rows).astype(np.uint32, copy=False), lengths


def _embedding_data(vectors: np.ndarray, encoding_format: str) -> list[EmbeddingData]:
    """OpenAI's data entries of `vectors` [N, D] in `encoding_format`."""
    encode = _ENCODINGS.get(encoding_format)
    if encode is None:
        return [EmbeddingData(i, row) for i, row in enumerate(vectors)]  # type: ignore[arg-type]
    return [
        EmbeddingData(i, base64.b64encode(row).decode()) for i, row in enumerate(encode(vectors))
    ]


def _late_chunks(
    ids: np.ndarray, lengths: np.ndarray, counts: np.ndarray, head: np.ndarray, tail: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks' packed ids [T] and lengths [C] → documents' packed ids (`head`, a document's
    chunks in order, `tail`), their lengths [D], and each chunk's [start, end) token span
    within its document [C, 2] (`counts` [D]: chunks per document)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    first = np.concatenate(([0], np.cumsum(counts)))
    parts: list[np.ndarray] = []
    bounds = np.empty((int(lengths.size), 2), dtype=np.int64)
    doc_lengths = np.empty(int(counts.size), dtype=np.int64)
    for d in range(int(counts.size)):
        a, b = int(first[d]), int(first[d + 1])
        body = ids[starts[a] : ends[b - 1]] if b > a else ids[:0]
        parts += [head, body, tail]
        offset = len(head) - int(starts[a])
        bounds[a:b, 0] = starts[a:b] + offset
        bounds[a:b, 1] = ends[a:b] + offset
        doc_lengths[d] = len(head) + len(body) + len(tail)
    packed = np.concatenate(parts).astype(np.uint32, copy=False)
    return packed, doc_lengths, bounds


def _maxsim_to_first(rows: Sequence[np.ndarray]) -> np.ndarray:
    """ColBERT MaxSim of the first input's token vectors [Lq, D] with each other input's
    [Ld, D]: Σ over query tokens of max over document tokens of the dot product (a sum, as
    ColBERT scores; FlagEmbedding's `colbert_score` divides it by Lq). [N - 1] float32."""
    query = rows[0]
    scores = [
        float((query @ doc.T).max(axis=1).sum()) if doc.size and query.size else 0.0
        for doc in rows[1:]
    ]
    return np.asarray(scores, dtype=np.float32)


def _unit(vectors: np.ndarray) -> np.ndarray:
    """[N, D] -> [N, D]: each row scaled to length 1 (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=1)
    norms[norms == 0] = 1.0
    return vectors / norms[:, None]  # type: ignore[no-any-return]


def _cosines_to_first(vectors: np.ndarray) -> np.ndarray:
    """[N, D] -> [N - 1]: the cosine of each vector after the first with the first."""
    unit = _unit(vectors)
    return unit[1:] @ unit[0]  # type: ignore[no-any-return]


def _base64_rows(rows: np.ndarray) -> list[str]:
    return [base64.b64encode(row).decode() for row in rows]


# Cohere's embedding types -> one vector per text, as JSON writes it. The binary types are
# sentence-transformers' `quantize_embeddings` scheme (numpy's default bit order).
_COHERE_TYPES: dict[str, Callable[[np.ndarray], Any]] = {
    "float": lambda v: v,
    "int8": quantize_int8,
    "uint8": lambda v: (quantize_int8(v).astype(np.int16) + 128).astype(np.uint8),
    "binary": lambda v: (np.packbits(v > 0, axis=1).astype(np.int16) - 128).astype(np.int8),
    "ubinary": lambda v: np.packbits(v > 0, axis=1),
    "base64": lambda v: _base64_rows(v.astype("<f4", copy=False)),
}


def _cut_left(
    ids: np.ndarray, lengths: np.ndarray, cut: int, leading: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows over `cut` tokens keep their first `leading` (special) tokens and their last
    ``cut - leading``: truncation from the start of the text."""
    starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1]))
    keep = np.ones(ids.size, dtype=bool)
    for row in np.flatnonzero(lengths > cut).tolist():
        start, length = int(starts[row]), int(lengths[row])
        keep[start + leading : start + length - (cut - leading)] = False
    return ids[keep], np.minimum(lengths, cut).astype(lengths.dtype)


def _check_lengths(
    lengths: np.ndarray,
    limit: int,
    param: str,
    fix: str = OPENAI_FIELDS.truncate,
    what: str = "this model's limit",
) -> None:
    """Refuse an input over ``limit`` tokens (``what`` the limit is, "" for the request's
    own; ``fix``: how the route asks to cut it) or an empty one, naming the request field
    ``param``."""
    if lengths.size and int(lengths.max()) > limit:
        index = int(np.argmax(lengths > limit))
        over = f"over {what} of {limit}" if what else f"over the {limit} asked for"
        raise ValidationError(
            f"Input {index} has {int(lengths[index])} tokens, {over}; shorten it or {fix}.",
            param=param,
            code="context_length_exceeded",
        )
    if lengths.size and int(lengths.min()) == 0:
        raise ValidationError("Inputs must not be empty.", param=param)


def _pack_ids(
    rows: list[list[int]],
    vocab_size: int,
    limit: int,
    truncate: bool,
    left: bool = False,
    fields: Fields = OPENAI_FIELDS,
) -> tuple[np.ndarray, np.ndarray]:
    if truncate:  # token ids carry no special tokens of ours: cut them as they are
        rows = [r[-limit:] if left else r[:limit] for r in rows]
    lengths = np.fromiter((len(r) for r in rows), dtype=np.uint32, count=len(rows))
    if not truncate:
        _check_lengths(lengths, limit, fields.input, fields.truncate)
    ids = np.fromiter(
        (i for r in rows for i in r), dtype=np.int64, count=int(lengths.sum(dtype=np.int64))
    )
    if vocab_size and ids.size and int(ids.max()) >= vocab_size:
        raise ValidationError(
            f"Token id {int(ids.max())} is outside the vocabulary (size {vocab_size}).",
            param=fields.input,
        )
    return ids.astype(np.uint32), lengths
