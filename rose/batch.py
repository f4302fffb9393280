"""`RaggedBatch`: the engine's input, token ids of all rows concatenated (no padding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rose.errors import EngineError

__all__ = ["OUTPUT_KINDS", "POOLING_MODES", "RaggedBatch"]

POOLING_MODES = ("mean", "cls", "last")
# What a row can ask for (`rose.heads`); every embedding row gets "dense".
OUTPUT_KINDS = ("dense", "sparse", "multi_vector", "token_states")


@dataclass(frozen=True, eq=False)
class RaggedBatch:
    """B rows of token ids packed into one array.

    input_ids: [T] int64, the rows one after another (T = sum of row lengths).
    cu_seqlens: [B+1] int32, row i is input_ids[cu_seqlens[i]:cu_seqlens[i+1]]; cu_seqlens[0] = 0.
    token_type_ids: [T] int64 or None (all zeros).
    pooling: per row "mean" | "cls" | "last" or None for the model's default; None for all defaults.
    normalize: per row L2 normalization on/off or None for the model's default; None for all defaults.
    span_counts: [B] int64, spans per row (each >= 1), or None: one output per row.
    spans: [S, 2] int64 (S = sum(span_counts)), each span's [start, end) token offsets within
        its row, rows in order. With spans an embedder pools each span (late chunking: the
        tokens of a span attend to their whole row) and returns one vector per span.
    kinds: per row the output kinds it asks for (`OUTPUT_KINDS`; "dense" is always given),
        or None: dense only for every row. Extra kinds are per row even when rows have spans
        (only the dense vectors are pooled per span).
    """

    input_ids: np.ndarray
    cu_seqlens: np.ndarray
    token_type_ids: np.ndarray | None = None
    pooling: tuple[str | None, ...] | None = None
    normalize: tuple[bool | None, ...] | None = None
    span_counts: np.ndarray | None = None
    spans: np.ndarray | None = None
    kinds: tuple[frozenset[str], ...] | None = None

    def __post_init__(self) -> None:
        if self.input_ids.ndim != 1 or self.cu_seqlens.ndim != 1 or self.cu_seqlens.size < 2:
            raise EngineError(
                "RaggedBatch needs 1-D input_ids and cu_seqlens with at least one row"
            )
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != self.input_ids.size:
            raise EngineError(
                f"RaggedBatch.cu_seqlens must run from 0 to {self.input_ids.size}, "
                f"got {int(self.cu_seqlens[0])}..{int(self.cu_seqlens[-1])}"
            )
        if np.any(np.diff(self.cu_seqlens) <= 0):
            raise EngineError("RaggedBatch rows must each hold at least one token")
        if self.token_type_ids is not None and self.token_type_ids.shape != self.input_ids.shape:
            raise EngineError(
                f"RaggedBatch.token_type_ids has {self.token_type_ids.size} entries for {self.tokens} tokens"
            )
        for key, values in (("pooling", self.pooling), ("normalize", self.normalize)):
            if values is not None and len(values) != self.rows:
                raise EngineError(
                    f"RaggedBatch.{key} has {len(values)} entries for {self.rows} rows"
                )
        if (self.span_counts is None) != (self.spans is None):
            raise EngineError("RaggedBatch.span_counts and spans come together")
        if self.span_counts is not None and self.spans is not None:
            self._check_spans(self.span_counts, self.spans)
        if self.kinds is not None:
            self._check_kinds(self.kinds)
        if self.pooling is not None:
            for mode in self.pooling:
                if mode is not None and mode not in POOLING_MODES:
                    raise EngineError(
                        f"RaggedBatch.pooling: unknown mode {mode!r}; use one of {POOLING_MODES}"
                    )

    def _check_kinds(self, kinds: tuple[frozenset[str], ...]) -> None:
        if len(kinds) != self.rows:
            raise EngineError(f"RaggedBatch.kinds has {len(kinds)} entries for {self.rows} rows")
        for i, row in enumerate(kinds):
            unknown = sorted(k for k in row if k not in OUTPUT_KINDS)
            if unknown:
                raise EngineError(
                    f"RaggedBatch.kinds[{i}]: unknown output kind(s) {unknown}; use {OUTPUT_KINDS}"
                )

    @property
    def extra_kinds(self) -> frozenset[str]:
        """The kinds beyond "dense" that some row asks for."""
        if self.kinds is None:
            return frozenset()
        return frozenset().union(*self.kinds) - {"dense"}

    def _check_spans(self, counts: np.ndarray, spans: np.ndarray) -> None:
        if counts.shape != (self.rows,) or np.any(counts < 1):
            raise EngineError(
                f"RaggedBatch.span_counts needs one count >= 1 for each of {self.rows} rows"
            )
        if spans.shape != (int(counts.sum()), 2):
            raise EngineError(
                f"RaggedBatch.spans must be [{int(counts.sum())}, 2] (start, end) pairs, got {list(spans.shape)}"
            )
        lengths = np.repeat(self.lengths.astype(np.int64), counts)
        bad = (spans[:, 0] < 0) | (spans[:, 1] <= spans[:, 0]) | (spans[:, 1] > lengths)
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise EngineError(
                f"RaggedBatch.spans[{i}] = [{int(spans[i, 0])}, {int(spans[i, 1])}) is not a "
                f"non-empty span of its row ({int(lengths[i])} tokens)"
            )

    @property
    def outputs(self) -> int:
        """Vectors the batch yields: one per span, or one per row."""
        return self.rows if self.span_counts is None else int(self.span_counts.sum())

    @property
    def rows(self) -> int:
        return int(self.cu_seqlens.size - 1)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def lengths(self) -> np.ndarray:
        """[B] int32 row lengths."""
        return np.diff(self.cu_seqlens)

    @classmethod
    def from_lists(
        cls,
        ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None = None,
        pooling: Sequence[str | None] | None = None,
        normalize: Sequence[bool | None] | None = None,
        kinds: Sequence[frozenset[str]] | None = None,
    ) -> RaggedBatch:
        """Build from one id list per row (and optionally one token-type list per row)."""
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        cu = np.zeros(len(ids) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        flat = np.fromiter((t for row in ids for t in row), dtype=np.int64, count=int(cu[-1]))
        types = None
        if token_type_ids is not None:
            if [len(r) for r in token_type_ids] != lengths.tolist():
                raise EngineError(
                    "RaggedBatch.from_lists: token_type_ids rows differ in length from ids"
                )
            types = np.fromiter(
                (t for row in token_type_ids for t in row), dtype=np.int64, count=int(cu[-1])
            )
        return cls(
            input_ids=flat,
            cu_seqlens=cu,
            token_type_ids=types,
            pooling=None if pooling is None else tuple(pooling),
            normalize=None if normalize is None else tuple(normalize),
            kinds=None if kinds is None else tuple(kinds),
        )

    @classmethod
    def from_packed(
        cls,
        ids: np.ndarray,
        lengths: np.ndarray,
        first_segment_lengths: np.ndarray | None = None,
        pooling: Sequence[str | None] | None = None,
        normalize: Sequence[bool | None] | None = None,
        span_counts: np.ndarray | None = None,
        spans: np.ndarray | None = None,
        kinds: Sequence[frozenset[str]] | None = None,
    ) -> RaggedBatch:
        """Build from the wire layout: flat uint32 ids [T] and uint32 row lengths [B]
        (spans as in the class docstring, any integer dtype).

        first_segment_lengths [B] (pairs for cross-encoders): token type 0 for the first
        first_segment_lengths[i] tokens of row i, 1 for the rest.
        """
        lengths64 = np.asarray(lengths, dtype=np.int64)
        cu = np.zeros(lengths64.size + 1, dtype=np.int32)
        np.cumsum(lengths64, out=cu[1:])
        flat = np.asarray(ids).astype(np.int64, copy=True)
        if lengths64.size and int(cu[-1]) != flat.size:
            raise EngineError(
                f"RaggedBatch.from_packed: lengths sum to {int(cu[-1])}, ids hold {flat.size}"
            )
        types = None
        if first_segment_lengths is not None:
            first = np.asarray(first_segment_lengths, dtype=np.int64)
            if first.shape != lengths64.shape or np.any(first > lengths64) or np.any(first < 0):
                raise EngineError(
                    "RaggedBatch.from_packed: first_segment_lengths must give one length <= the row's per row"
                )
            offset = np.arange(flat.size, dtype=np.int64) - np.repeat(
                cu[:-1].astype(np.int64), lengths64
            )
            types = (offset >= np.repeat(first, lengths64)).astype(np.int64)
        return cls(
            input_ids=flat,
            cu_seqlens=cu,
            token_type_ids=types,
            pooling=None if pooling is None else tuple(pooling),
            normalize=None if normalize is None else tuple(normalize),
            span_counts=None if span_counts is None else np.asarray(span_counts, dtype=np.int64),
            spans=None if spans is None else np.asarray(spans, dtype=np.int64).reshape(-1, 2),
            kinds=None if kinds is None else tuple(kinds),
        )
