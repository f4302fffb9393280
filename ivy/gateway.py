"""The work behind each endpoint, independent of HTTP: validate against the model,
template, tokenize (off the event loop for big batches), route, shape the answer."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ivy.errors import ModelNotFoundError, UnavailableError, ValidationError
from ivy.metrics import Metrics
from ivy.models import CROSS_ENCODER, EMBEDDING, ServedModel
from ivy.replicas import Replica, ReplicaPool
from ivy.router import Claim, Router
from ivy.schemas import EmbeddingRequest, RerankRequest, TokenizeRequest

__all__ = ["Gateway", "Timings"]

# Batches with more characters than this are tokenized on a worker thread.
_INLINE_CHARS = 4096
_DEFAULT_MAX_TOKENS_PER_DOC = 4096
# Characters per token are at most this in the served tokenizers' real-world text (a
# token hint from characters under-counts, never over-counts, the tokens to come).
_CHARS_PER_TOKEN_BOUND = 8


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
    ) -> None:
        self.models = models
        self.pools = pools
        self.metrics = metrics
        self.router = Router(pools, metrics, chunk_tokens, hedge_after_s)
        self.max_inputs = max_inputs
        self.max_input_chars = max_input_chars
        self.request_timeout_s = request_timeout_s
        self.draining = False
        self.created = int(time.time())

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
        param: str = "input",
    ) -> tuple[np.ndarray, np.ndarray]:
        limit = model.spec.max_input_tokens
        cut = min(limit, max_length) if max_length is not None else limit
        trunc = cut if truncate else None
        chars = sum(len(t) for t in texts)
        if chars > _INLINE_CHARS:
            ids, lengths = await asyncio.to_thread(
                model.tokenizer.encode_batch_packed, texts, True, trunc
            )
        else:
            ids, lengths = model.tokenizer.encode_batch_packed(texts, True, trunc)
        if not truncate:
            _check_lengths(lengths, limit, param)
        return ids, lengths

    # ---- endpoints ---------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, timings: Timings) -> dict[str, Any]:
        model = self.model(req.model)
        t0 = time.perf_counter()
        spec = model.spec
        if spec.kind != EMBEDDING:
            raise ValidationError(
                f"The model `{req.model}` does not produce embeddings.", param="model"
            )
        if req.dimensions is not None and spec.dimensions and req.dimensions > spec.dimensions:
            raise ValidationError(
                f"dimensions must be at most {spec.dimensions} for `{req.model}`, "
                f"got {req.dimensions}.",
                param="dimensions",
            )
        inputs = req.input
        if isinstance(inputs, str):
            inputs = [inputs]
        if len(inputs) > self.max_inputs:
            raise ValidationError(
                f"At most {self.max_inputs} inputs per request, got {len(inputs)}.", param="input"
            )
        texts_in = isinstance(inputs[0], str)
        deadline, claim = self._admit(req.model, inputs if texts_in else ())  # type: ignore[arg-type]
        with claim:
            if texts_in:
                prompt = model.prompt_for(req.input_type)
                texts = [prompt + t for t in inputs] if prompt else list(inputs)  # type: ignore[operator]
                ids, lengths = await self._tokenize(model, texts, truncate=req.truncate)
            else:
                rows: list[list[int]] = [inputs] if isinstance(inputs[0], int) else inputs  # type: ignore[assignment,list-item]
                ids, lengths = _pack_ids(rows, spec.vocab_size, spec.max_input_tokens, req.truncate)
            timings.tokenize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            vectors, timings.chunks, timings.replica_s = await self.router.embed(
                req.model,
                ids,
                lengths,
                dimensions=req.dimensions or 0,
                deadline=deadline,
                claim=claim,
            )
            timings.inference_s = time.perf_counter() - t1
        self.metrics.input_tokens.labels(model=req.model).inc(int(ids.size))
        encode = _ENCODINGS.get(req.encoding_format)
        if encode is not None:
            data = [
                {"object": "embedding", "index": i, "embedding": base64.b64encode(row).decode()}
                for i, row in enumerate(encode(vectors))
            ]
        else:
            data = [
                {"object": "embedding", "index": i, "embedding": row}
                for i, row in enumerate(vectors)
            ]
        tokens = int(ids.size)
        return {
            "object": "list",
            "data": data,
            "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def rerank(self, req: RerankRequest, timings: Timings) -> dict[str, Any]:
        model = self.model(req.model)
        t0 = time.perf_counter()
        self._check_chars([req.query], "query")
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        if len(docs) > self.max_inputs:
            raise ValidationError(
                f"At most {self.max_inputs} documents per request, got {len(docs)}.",
                param="documents",
            )
        deadline, claim = self._admit(req.model, docs)
        with claim:
            per_doc = req.max_tokens_per_doc or _DEFAULT_MAX_TOKENS_PER_DOC
            spec = model.spec
            if spec.kind == CROSS_ENCODER:
                # Pairs as `tokenizer(query, document)` builds them. Only documents are cut: to
                # max_tokens_per_doc of their own tokens, and so that the pair fits the model
                # (HF's "only_second"; the "longest_first" of sentence-transformers' CrossEncoder
                # cuts the same tokens whenever the query takes at most half of the room).
                q_ids, _ = model.tokenizer.encode_batch_packed([req.query], False, None)
                _, specials, _ = model.tokenizer.encode_pairs_packed("", [""], None)
                fixed = int(q_ids.size) + int(specials[0])
                if fixed >= spec.max_input_tokens:
                    raise ValidationError(
                        f"The query has {q_ids.size} tokens, which with the pair's special tokens "
                        f"leaves no room for a document within this model's limit of "
                        f"{spec.max_input_tokens} tokens.",
                        param="query",
                        code="context_length_exceeded",
                    )
                max_len = min(spec.max_input_tokens, fixed + per_doc)
                ids, lengths, first = await asyncio.to_thread(
                    model.tokenizer.encode_pairs_packed, req.query, docs, max_len
                )
                timings.tokenize_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                raw, timings.chunks, timings.replica_s = await self.router.score(
                    req.model, ids, lengths, first, deadline=deadline, claim=claim
                )
                timings.inference_s = time.perf_counter() - t1
                scores = raw[:, 0] if raw.ndim == 2 else raw
                tokens = int(ids.size)
            elif spec.kind == EMBEDDING:
                texts = [spec.query_prompt + req.query] + [spec.document_prompt + d for d in docs]
                q_ids, q_len = await self._tokenize(model, texts[:1], truncate=False, param="query")
                # max_tokens_per_doc counts the document's own tokens, not prompt and specials.
                _, overhead = model.tokenizer.encode_batch_packed(
                    [spec.document_prompt], True, None
                )
                d_ids, d_len = await self._tokenize(
                    model, texts[1:], truncate=True, max_length=per_doc + int(overhead[0])
                )
                ids = np.concatenate((q_ids, d_ids))
                lengths = np.concatenate((q_len, d_len))
                timings.tokenize_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                vectors, timings.chunks, timings.replica_s = await self.router.embed(
                    req.model, ids, lengths, dimensions=0, deadline=deadline, claim=claim
                )
                timings.inference_s = time.perf_counter() - t1
                norms = np.linalg.norm(vectors, axis=1)
                norms[norms == 0] = 1.0
                unit = vectors / norms[:, None]
                scores = unit[1:] @ unit[0]
                tokens = int(ids.size)
            else:
                raise ValidationError(f"The model `{req.model}` cannot rerank.", param="model")
        self.metrics.input_tokens.labels(model=req.model).inc(tokens)
        order = np.argsort(-scores, kind="stable")
        if req.top_n is not None:
            order = order[: req.top_n]
        with_docs = req.return_documents is not False
        results = []
        for i in order.tolist():
            item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if with_docs:
                item["document"] = {"text": docs[i]}
            results.append(item)
        return {
            "id": str(uuid.uuid4()),
            "model": req.model,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
        }

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        model = self.model(req.model)
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if len(texts) > self.max_inputs:
            raise ValidationError(
                f"At most {self.max_inputs} inputs per request, got {len(texts)}.", param="input"
            )

        self._check_chars(texts, "input")

        def run() -> list[tuple[list[int], list[tuple[int, int]]]]:
            return [model.tokenizer.encode_with_offsets(t, req.add_special_tokens) for t in texts]

        chars = sum(len(t) for t in texts)
        encoded = await asyncio.to_thread(run) if chars > _INLINE_CHARS else run()
        total = sum(len(ids) for ids, _ in encoded)
        return {
            "model": req.model,
            "data": [
                {"index": i, "ids": ids, "offsets": offsets}
                for i, (ids, offsets) in enumerate(encoded)
            ],
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }

    def list_models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "trellis"}
                for name in self.models
            ],
        }


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


def _check_lengths(lengths: np.ndarray, limit: int, param: str) -> None:
    if lengths.size and int(lengths.max()) > limit:
        index = int(np.argmax(lengths > limit))
        raise ValidationError(
            f"Input {index} has {int(lengths[index])} tokens, over this model's limit of "
            f"{limit}; shorten it or pass `truncate: true`.",
            param=param,
            code="context_length_exceeded",
        )
    if lengths.size and int(lengths.min()) == 0:
        raise ValidationError("Inputs must not be empty.", param=param)


def _pack_ids(
    rows: list[list[int]], vocab_size: int, limit: int, truncate: bool
) -> tuple[np.ndarray, np.ndarray]:
    if truncate:
        rows = [r[:limit] for r in rows]
    lengths = np.fromiter((len(r) for r in rows), dtype=np.uint32, count=len(rows))
    if not truncate:
        _check_lengths(lengths, limit, "input")
    ids = np.fromiter(
        (i for r in rows for i in r), dtype=np.int64, count=int(lengths.sum(dtype=np.int64))
    )
    if vocab_size and ids.size and int(ids.max()) >= vocab_size:
        raise ValidationError(
            f"Token id {int(ids.max())} is outside the vocabulary (size {vocab_size}).",
            param="input",
        )
    return ids.astype(np.uint32), lengths
