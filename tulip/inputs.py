"""Validation of request inputs against the served model, before anything is queued.

Every rejection is an `InvalidInput` whose message names the input (``inputs[3]``,
``pairs[0]``) and says why, so a client can fix the one bad item.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import WireError, unpack_token_batch
from tulip.errors import InvalidInput

__all__ = [
    "EmbedOptions",
    "ModelLimits",
    "Work",
    "embed_work",
    "score_work",
]

_POOLING = {
    pb.POOLING_DEFAULT: None,
    pb.POOLING_MEAN: "mean",
    pb.POOLING_CLS: "cls",
    pb.POOLING_LAST_TOKEN: "last",
}
_NORMALIZE = {pb.NORMALIZE_DEFAULT: None, pb.NORMALIZE_ON: True, pb.NORMALIZE_OFF: False}
_ACTIVATION = {
    pb.ACTIVATION_DEFAULT: "default",
    pb.ACTIVATION_NONE: "none",
    pb.ACTIVATION_SIGMOID: "sigmoid",
}
_DTYPES = frozenset({pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16})


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    kind: str
    """``embedding`` or ``cross-encoder``."""
    vocab_size: int
    max_input_tokens: int
    dimensions: int
    default_normalize: bool
    token_types: int = 2
    """Token types the model embeds (config.json ``type_vocab_size``)."""


@dataclass(frozen=True, eq=False)
class Work:
    """One request's inputs, validated: they are batched together and answered together."""

    ids: np.ndarray
    """uint32 [tokens]: every input's ids, concatenated."""
    lengths: np.ndarray
    """uint32 [rows]: tokens of each input, all > 0."""
    first_segment_lengths: np.ndarray | None = None
    """uint32 [rows] for pairs (tokens of type 0), None for single sequences."""
    pooling: str | None = None
    normalize: bool | None = None

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def tokens(self) -> int:
        return int(self.ids.size)


@dataclass(frozen=True)
class EmbedOptions:
    """How an embedding response is shaped after the engine ran."""

    dimensions: int
    """Columns kept (Matryoshka truncation); equals the model's size when not truncating."""
    normalize: bool
    """Whether rows are L2-normalized (after truncation)."""
    dtype: int
    """Wire dtype of the response tensor."""


def embed_work(request: pb.EmbedRequest, limits: ModelLimits) -> tuple[Work, EmbedOptions]:
    """Validate an `EmbedRequest`; raises `InvalidInput` naming the bad input."""
    if limits.kind != "embedding":
        raise InvalidInput(
            f"Embed needs an embedding model; the served model is a {limits.kind} model"
        )
    if request.pooling not in _POOLING:
        raise InvalidInput(f"pooling: unknown value {request.pooling}")
    if request.normalize not in _NORMALIZE:
        raise InvalidInput(f"normalize: unknown value {request.normalize}")
    if request.dtype not in _DTYPES:
        raise InvalidInput(f"dtype: unknown value {request.dtype}")
    if request.dimensions > limits.dimensions:
        raise InvalidInput(
            f"dimensions: {request.dimensions} is more than the model's {limits.dimensions}"
        )
    ids, lengths = _token_batch(request.inputs, "inputs", limits)
    normalize = _NORMALIZE[request.normalize]
    work = Work(ids=ids, lengths=lengths, pooling=_POOLING[request.pooling], normalize=normalize)
    options = EmbedOptions(
        dimensions=request.dimensions or limits.dimensions,
        normalize=limits.default_normalize if normalize is None else normalize,
        dtype=request.dtype,
    )
    return work, options


def score_work(request: pb.ScoreRequest, limits: ModelLimits) -> tuple[Work, str]:
    """Validate a `ScoreRequest`; returns the work and the activation name."""
    if limits.kind != "cross-encoder":
        raise InvalidInput(
            f"Score needs a cross-encoder model; the served model is a {limits.kind} model"
        )
    if request.activation not in _ACTIVATION:
        raise InvalidInput(f"activation: unknown value {request.activation}")
    ids, lengths = _token_batch(request.pairs, "pairs", limits)
    first = None
    if len(request.first_segment_lengths):
        first = np.asarray(request.first_segment_lengths, dtype=np.uint32)
        if first.size != lengths.size:
            raise InvalidInput(
                f"first_segment_lengths: {first.size} values for {lengths.size} pairs"
            )
        over = np.flatnonzero(first > lengths)
        if over.size:
            i = int(over[0])
            raise InvalidInput(
                f"pairs[{i}]: first segment of {int(first[i])} tokens is longer than "
                f"the pair ({int(lengths[i])} tokens)"
            )
        if limits.token_types < 2:
            # Models with one token type (XLM-R) take no segment ids: every token is type 0,
            # exactly as their tokenizer would have it.
            first = None
    return Work(ids=ids, lengths=lengths, first_segment_lengths=first), _ACTIVATION[
        request.activation
    ]


def _token_batch(
    batch: pb.TokenBatch, field: str, limits: ModelLimits
) -> tuple[np.ndarray, np.ndarray]:
    try:
        ids, lengths = unpack_token_batch(batch)
    except WireError as error:
        raise InvalidInput(f"{field}: {error}") from None
    if lengths.size == 0:
        raise InvalidInput(f"{field}: no inputs")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise InvalidInput(f"{field}[{int(empty[0])}]: empty sequence (length 0)")
    long = np.flatnonzero(lengths > limits.max_input_tokens)
    if long.size:
        i = int(long[0])
        raise InvalidInput(
            f"{field}[{i}]: {int(lengths[i])} tokens is longer than the model's maximum "
            f"of {limits.max_input_tokens}"
        )
    outside = np.flatnonzero(ids >= limits.vocab_size)
    if outside.size:
        position = int(outside[0])
        ends = np.cumsum(lengths, dtype=np.int64)
        row = int(np.searchsorted(ends, position, side="right"))
        start = int(ends[row - 1]) if row else 0
        raise InvalidInput(
            f"{field}[{row}]: token id {int(ids[position])} at position {position - start} "
            f"is outside the vocabulary (size {limits.vocab_size})"
        )
    return ids, lengths
