"""The tokenizer adapter Ivy calls: Trellis' Rust tokenizer when it can load the file,
Hugging Face `tokenizers` otherwise (e.g. WordPiece models such as MiniLM).

Both backends release the GIL while encoding batches, so callers run large batches on a
worker thread without stalling the event loop. Output is packed: one uint32 array of all
ids plus per-input lengths, the same layout the gRPC wire carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["PackedIds", "TextTokenizer", "TokenizationError", "load_tokenizer"]

PackedIds = tuple[np.ndarray, np.ndarray]


class TokenizationError(ValueError):
    """The tokenizer rejected an input or a setting (e.g. a length below its specials)."""


class TextTokenizer(Protocol):
    """What Ivy needs from a tokenizer. ``max_length`` counts special tokens."""

    backend: str
    vocab_size: int

    def encode_batch_packed(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> PackedIds: ...

    def encode_pairs_packed(
        self, query: str, documents: Sequence[str], max_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]: ...


class RustTokenizer:
    """Trellis' Unigram tokenizer (packed output, parallel, GIL released)."""

    backend = "rust"

    def __init__(self, native: object, error: type[Exception]) -> None:
        self._tok = native
        self._error = error
        self.vocab_size = int(native.vocab_size)  # type: ignore[attr-defined]

    def encode_batch_packed(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> PackedIds:
        try:
            ids, lengths = self._tok.encode_batch_packed(  # type: ignore[attr-defined]
                list(texts), add_special_tokens=add_special_tokens, max_length=max_length
            )
        except self._error as exc:
            raise TokenizationError(str(exc)) from None
        return np.asarray(ids, dtype=np.uint32), np.asarray(lengths, dtype=np.uint32)

    def encode_pairs_packed(
        self, query: str, documents: Sequence[str], max_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            ids, lengths, first = self._tok.encode_pairs_packed(  # type: ignore[attr-defined]
                query, list(documents), max_length=max_length
            )
        except self._error as exc:
            raise TokenizationError(str(exc)) from None
        return (
            np.asarray(ids, dtype=np.uint32),
            np.asarray(lengths, dtype=np.uint32),
            np.asarray(first, dtype=np.uint32),
        )

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets = self._tok.encode_with_offsets(  # type: ignore[attr-defined]
            text, add_special_tokens=add_special_tokens
        )
        return [int(i) for i in ids], [(int(s), int(e)) for s, e in offsets]


class HFTokenizer:
    """Hugging Face `tokenizers`, with padding and truncation from the file switched off
    (truncation is applied per call on the encodings, which keeps the object thread-safe)."""

    backend = "huggingface"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def _pack(self, rows: Sequence[Sequence[int]]) -> PackedIds:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.uint32, count=len(rows))
        ids = np.fromiter(
            (i for r in rows for i in r), dtype=np.uint32, count=int(lengths.sum(dtype=np.int64))
        )
        return ids, lengths

    def encode_batch_packed(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> PackedIds:
        tok = self._tok
        if max_length is None:
            encodings = tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
            return self._pack([e.ids for e in encodings])
        encodings = tok.encode_batch(list(texts), add_special_tokens=False)
        budget = max_length - (tok.num_special_tokens_to_add(False) if add_special_tokens else 0)
        if budget < 0:
            raise TokenizationError(f"max_length {max_length} is below the special tokens")
        rows = []
        for enc in encodings:
            if len(enc.ids) > budget:
                enc.truncate(max(budget, 0))
            if add_special_tokens:
                enc = tok.post_process(enc, add_special_tokens=True)
            rows.append(enc.ids[:max_length])
        return self._pack(rows)

    def encode_pairs_packed(
        self, query: str, documents: Sequence[str], max_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tok = self._tok
        q = tok.encode(query, add_special_tokens=False)
        docs = tok.encode_batch(list(documents), add_special_tokens=False)
        rows, first = [], []
        for d in docs:
            if max_length is not None:
                budget = max_length - len(q.ids) - tok.num_special_tokens_to_add(True)
                if budget < 0:
                    raise TokenizationError(f"max_length {max_length} leaves no document tokens")
                if len(d.ids) > budget:
                    d.truncate(max(budget, 0))
            pair = tok.post_process(q, d, add_special_tokens=True)
            types = pair.type_ids
            n0 = next((i for i, t in enumerate(types) if t != 0), len(types))
            rows.append(pair.ids)
            first.append(n0)
        ids, lengths = self._pack(rows)
        return ids, lengths, np.asarray(first, dtype=np.uint32)

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), [(int(s), int(e)) for s, e in enc.offsets]


def load_tokenizer(path: Path | str, word_cache: int | None = None) -> TextTokenizer:
    """Load ``tokenizer.json``: the Rust tokenizer when importable and the file is one it
    supports (Unigram), Hugging Face `tokenizers` otherwise. ``word_cache``: entries of the
    Rust tokenizer's per-thread word cache (None: its default; 0: off)."""
    path = Path(path)
    try:
        from tokenizer import Tokenizer, TokenizerError  # type: ignore[attr-defined]
    except ImportError:
        return HFTokenizer(path)
    try:
        if word_cache is None:
            native = Tokenizer.from_file(str(path))
        else:
            native = Tokenizer.from_file(str(path), word_cache=word_cache)
    except TokenizerError:
        return HFTokenizer(path)
    return RustTokenizer(native, TokenizerError)
