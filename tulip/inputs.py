"""Validation of request inputs against the served model, before anything is queued.

Every rejection is an `InvalidInput` whose message names the input (``inputs[3]``,
``pairs[0]``) and says why, so a client can fix the one bad item.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import WireError, unpack_token_batch
from rose.grammar import GrammarError, JsonFormat
from rose.sampling import MAX_LOGIT_BIAS, MAX_PENALTY
from tulip.errors import InvalidInput

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "OUTPUT_NAMES",
    "EmbedOptions",
    "GenerateWork",
    "ModelLimits",
    "Work",
    "embed_work",
    "generate_work",
    "score_work",
]

MAX_STOP_STRINGS = 16
"""Most stop strings one Generate request may give."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per generated token's logprobs (`rose.sampling.MAX_TOP_LOGPROBS`)."""

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
OUTPUT_NAMES = {
    pb.OUTPUT_DENSE: "dense",
    pb.OUTPUT_SPARSE: "sparse",
    pb.OUTPUT_MULTI_VECTOR: "multi_vector",
    pb.OUTPUT_TOKEN_STATES: "token_states",
}
"""Wire output kinds → the engine's names (`rose.batch.OUTPUT_KINDS`)."""
_DENSE_ONLY = frozenset({"dense"})


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    kind: str
    """``embedding``, ``cross-encoder`` or ``generator``."""
    vocab_size: int
    max_input_tokens: int
    dimensions: int
    default_normalize: bool
    token_types: int = 2
    """Token types the model embeds (config.json ``type_vocab_size``)."""
    outputs: frozenset[str] = _DENSE_ONLY
    """Output kinds an Embed call may ask for (`OUTPUT_NAMES` values)."""


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
    span_counts: np.ndarray | None = None
    """uint32 [rows], spans pooled per input (late chunking); None: one vector per input."""
    spans: np.ndarray | None = None
    """uint32 [spans, 2], each span's [start, end) within its input; None with span_counts."""
    kinds: frozenset[str] | None = None
    """Output kinds beyond the dense vector every input gets (sparse, multi_vector,
    token_states); None: none."""

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def outputs(self) -> int:
        """Result rows the request gets: one per span, or one per input."""
        return self.rows if self.span_counts is None else int(self.span_counts.sum())

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
    outputs: frozenset[str] = _DENSE_ONLY
    """Output kinds the response carries."""


@dataclass(frozen=True)
class GenerateWork:
    """One Generate request, validated; the sampling fields mirror `rose.sampling.SamplingParams`
    (zero values of the wire already replaced by their defaults, except ``max_tokens``: 0
    means up to the context, or what one sequence can hold in the KV cache if less)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    response_format: JsonFormat | None = None  # None: free text
    logprobs: int | None = None  # alternatives per token's logprobs; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0

    def sampling_kwargs(self, max_tokens: int) -> dict[str, object]:
        """Keyword arguments of `rose.sampling.SamplingParams` (``max_tokens`` resolved)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "response_format": self.response_format,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
        }


def generate_work(request: pb.GenerateRequest, limits: ModelLimits) -> GenerateWork:
    """Validate a `GenerateRequest` against a generator's vocabulary and context length;
    raises `InvalidInput` naming the field (``prompt_ids``, ``sampling.top_p``, ...)."""
    if limits.kind != "generator":
        raise InvalidInput(
            f"Generate needs a generator model; the served model is a {limits.kind} model"
        )
    if len(request.prompt_ids) % 4:
        raise InvalidInput(
            f"prompt_ids: {len(request.prompt_ids)} bytes, not a multiple of 4 (uint32 ids)"
        )
    ids = np.frombuffer(request.prompt_ids, dtype="<u4")
    if ids.size == 0:
        raise InvalidInput("prompt_ids: empty prompt (at least one token is needed)")
    context = limits.max_input_tokens
    if ids.size >= context:
        raise InvalidInput(
            f"prompt_ids: {ids.size} tokens leave no room to generate within the model's "
            f"context of {context} tokens"
        )
    outside = np.flatnonzero(ids >= limits.vocab_size)
    if outside.size:
        i = int(outside[0])
        raise InvalidInput(
            f"prompt_ids[{i}]: token id {int(ids[i])} is outside the vocabulary "
            f"(size {limits.vocab_size})"
        )
    s = request.sampling
    room = context - int(ids.size)
    max_tokens = s.max_tokens  # 0: as many as fit, resolved by the backend (KV cache)
    if max_tokens > room:
        raise InvalidInput(
            f"sampling.max_tokens: {ids.size} prompt tokens + {max_tokens} new tokens exceed "
            f"the model's context of {context} tokens (at most {room} new tokens fit)"
        )
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidInput(
            f"sampling.temperature: must be a finite number >= 0, got {s.temperature}"
        )
    top_p = s.top_p or 1.0
    if not 0.0 < top_p <= 1.0:  # NaN fails too
        raise InvalidInput(f"sampling.top_p: must be in (0, 1] (0 means 1), got {s.top_p}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidInput(f"sampling.stop: {len(s.stop)} strings, at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(s.stop):
        if not text:
            raise InvalidInput(f"sampling.stop[{i}]: empty string")
    for i, token in enumerate(s.stop_token_ids):
        if token >= limits.vocab_size:
            raise InvalidInput(
                f"sampling.stop_token_ids[{i}]: token id {token} is outside the vocabulary "
                f"(size {limits.vocab_size})"
            )
    logprobs = int(s.top_logprobs) if s.HasField("top_logprobs") else None
    prompt_logprobs = int(s.prompt_logprobs) if s.HasField("prompt_logprobs") else None
    for name, value in (("top_logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > MAX_TOP_LOGPROBS:
            raise InvalidInput(f"sampling.{name}: {value} alternatives, at most {MAX_TOP_LOGPROBS}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
            raise InvalidInput(
                f"sampling.{name}: must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}"
            )
    for token, bias in sorted(s.logit_bias.items()):
        if token >= limits.vocab_size:
            raise InvalidInput(
                f"sampling.logit_bias: token id {token} is outside the vocabulary "
                f"(size {limits.vocab_size})"
            )
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
            raise InvalidInput(
                f"sampling.logit_bias[{token}]: must be in [-{MAX_LOGIT_BIAS}, "
                f"{MAX_LOGIT_BIAS}], got {bias}"
            )
    repetition = s.repetition_penalty or 1.0
    if not 0.0 < repetition < math.inf:  # NaN fails too
        raise InvalidInput(
            f"sampling.repetition_penalty: must be a finite number > 0 (0 means 1), got "
            f"{s.repetition_penalty}"
        )
    if not 0.0 <= s.min_p <= 1.0:
        raise InvalidInput(f"sampling.min_p: must be in [0, 1], got {s.min_p}")
    if s.min_tokens > (max_tokens or room):
        raise InvalidInput(
            f"sampling.min_tokens: {s.min_tokens} exceeds max_tokens ({max_tokens or room})"
        )
    return GenerateWork(
        repetition_penalty=float(repetition),
        min_p=float(s.min_p),
        min_tokens=int(s.min_tokens),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        response_format=_response_format(s),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        prompt_ids=ids.tolist(),
        max_tokens=int(max_tokens),
        temperature=float(s.temperature),
        top_p=float(top_p),
        top_k=int(s.top_k),
        seed=int(s.seed) if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
        ignore_eos=bool(s.ignore_eos),
    )


def _response_format(s: pb.SamplingOptions) -> JsonFormat | None:
    if not s.HasField("response_format"):
        return None
    fmt = s.response_format
    if fmt.type == pb.ResponseFormat.TYPE_TEXT:
        return None
    if fmt.type == pb.ResponseFormat.TYPE_JSON_OBJECT:
        return JsonFormat()
    if fmt.type == pb.ResponseFormat.TYPE_JSON_SCHEMA:
        try:
            return JsonFormat(fmt.json_schema)
        except GrammarError as error:
            raise InvalidInput(f"sampling.response_format.{error}") from None
    raise InvalidInput(f"sampling.response_format.type: unknown value {fmt.type}")


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
    counts, spans = _spans(request, lengths)
    outputs = _outputs(request, limits)
    extra = outputs - _DENSE_ONLY
    if extra and counts is not None:
        raise InvalidInput(
            f"outputs: {', '.join(sorted(extra))} do not combine with spans (dense only)"
        )
    work = Work(
        ids=ids,
        lengths=lengths,
        pooling=_POOLING[request.pooling],
        normalize=normalize,
        span_counts=counts,
        spans=spans,
        kinds=extra or None,
    )
    options = EmbedOptions(
        dimensions=request.dimensions or limits.dimensions,
        normalize=limits.default_normalize if normalize is None else normalize,
        dtype=request.dtype,
        outputs=outputs,
    )
    return work, options


def _outputs(request: pb.EmbedRequest, limits: ModelLimits) -> frozenset[str]:
    """The output kinds asked for (empty: dense), each known, once, and offered."""
    if not len(request.outputs):
        return _DENSE_ONLY
    names: list[str] = []
    for i, value in enumerate(request.outputs):
        name = OUTPUT_NAMES.get(value)
        if name is None:
            raise InvalidInput(f"outputs[{i}]: unknown value {value}")
        if name in names:
            raise InvalidInput(f"outputs[{i}]: {name} is asked for twice")
        if name not in limits.outputs:
            raise InvalidInput(
                f"outputs[{i}]: the served model cannot give {name} output "
                f"(it offers {', '.join(sorted(limits.outputs))})"
            )
        names.append(name)
    return frozenset(names)


def _spans(
    request: pb.EmbedRequest, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The request's late-chunking spans, checked against its inputs (None, None: none)."""
    if not len(request.span_counts) and not len(request.spans):
        return None, None
    counts = np.asarray(request.span_counts, dtype=np.uint32)
    if counts.size != lengths.size:
        raise InvalidInput(f"span_counts: {counts.size} counts for {lengths.size} inputs")
    if counts.min() == 0:
        raise InvalidInput(f"span_counts[{int(np.flatnonzero(counts == 0)[0])}]: 0 spans")
    flat = np.asarray(request.spans, dtype=np.int64)
    if flat.size != 2 * int(counts.sum(dtype=np.int64)):
        raise InvalidInput(
            f"spans: {flat.size} values for {int(counts.sum(dtype=np.int64))} spans (two per span)"
        )
    spans = flat.reshape(-1, 2)
    row_lengths = np.repeat(lengths.astype(np.int64), counts)
    bad = np.flatnonzero((spans[:, 1] <= spans[:, 0]) | (spans[:, 1] > row_lengths))
    if bad.size:
        i = int(bad[0])
        raise InvalidInput(
            f"spans[{i}]: [{int(spans[i, 0])}, {int(spans[i, 1])}) is not a non-empty span "
            f"of its input ({int(row_lengths[i])} tokens)"
        )
    return counts, spans.astype(np.uint32)


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
    # Cheap reductions first; the offending index is looked up only for the error.
    if lengths.min() == 0:
        i = int(np.flatnonzero(lengths == 0)[0])
        raise InvalidInput(f"{field}[{i}]: empty sequence (length 0)")
    if lengths.max() > limits.max_input_tokens:
        i = int(np.flatnonzero(lengths > limits.max_input_tokens)[0])
        raise InvalidInput(
            f"{field}[{i}]: {int(lengths[i])} tokens is longer than the model's maximum "
            f"of {limits.max_input_tokens}"
        )
    if ids.max() >= limits.vocab_size:
        position = int(np.flatnonzero(ids >= limits.vocab_size)[0])
        ends = np.cumsum(lengths, dtype=np.int64)
        row = int(np.searchsorted(ends, position, side="right"))
        start = int(ends[row - 1]) if row else 0
        raise InvalidInput(
            f"{field}[{row}]: token id {int(ids[position])} at position {position - start} "
            f"is outside the vocabulary (size {limits.vocab_size})"
        )
    return ids, lengths
