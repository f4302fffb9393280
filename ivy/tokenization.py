"""The tokenizer adapter Ivy calls: Trellis' Rust tokenizer when it can load the file,
Hugging Face `tokenizers` otherwise (e.g. WordPiece models such as MiniLM).

Both backends release the GIL while encoding batches, so callers run large batches on a
worker thread without stalling the event loop. Output is packed: one uint32 array of all
ids plus per-input lengths, the same layout the gRPC wire carries.

Special-token strings in a text (``<s>``, ``<|im_end|>``) become their ids in every call
but one: `TextTokenizer.encode_prompt` encodes a rendered chat prompt in which the
template's special tokens are tokens and the messages' content is plain text (see
`ivy.chat_template.RenderedPrompt`). Legacy completion prompts are raw model input, with
special tokens parsed as OpenAI and vLLM do: whoever writes one controls the whole prompt
(and may send token ids instead), so there is no turn to forge there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import tokenizers

__all__ = ["PackedIds", "TextTokenizer", "TokenizationError", "load_tokenizer", "longest_first"]

PackedIds = tuple[np.ndarray, np.ndarray]


class TokenizationError(ValueError):
    """The tokenizer rejected an input or a setting (e.g. a length below its specials)."""


class TextTokenizer(Protocol):
    """What Ivy needs from a tokenizer. ``max_length`` counts special tokens;
    ``special_tokens`` holds the text of the special added tokens."""

    backend: str
    vocab_size: int
    special_tokens: frozenset[str]

    def encode_batch_packed(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> PackedIds: ...

    def encode_pairs_packed(
        self,
        query: str,
        documents: Sequence[str],
        max_length: int | None = None,
        max_second: int | None = None,
        left: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`tokenizer(query, document)` for each document: packed ids, lengths, and the
        ids before each document's tokens. ``max_second`` cuts each document to that many
        of its own tokens; ``max_length`` then cuts each pair as HF's default
        ``longest_first`` strategy does (`longest_first`); ``left`` cuts sequences at their
        start (keeping their end), as HF's ``direction="left"``."""
        ...

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]: ...

    def encode_prompt(self, text: str, literals: Mapping[str, str]) -> np.ndarray:
        """uint32 ids of a rendered prompt, no template tokens added: special-token strings
        in ``text`` are their tokens, and each placeholder character of ``literals``
        stands for its string, tokenized as plain text (special tokens not matched)."""
        ...


def _splice_literals(
    text: str,
    literals: Mapping[str, str],
    encoded: tuple[Sequence[int], Sequence[tuple[int, int]]],
    specials: Mapping[int, str],
    encode_plain: Callable[[str], Sequence[int]],
) -> np.ndarray:
    """`encode_prompt` from ``encoded`` (ids and character offsets of ``text``, special
    tokens parsed; ``specials``: id -> text of the special tokens): every stretch between
    two special tokens that holds a placeholder is encoded again, placeholders restored,
    by ``encode_plain``. A stretch stands alone either way (tokenizers split at added
    tokens before normalizing), so the ids of the other stretches are kept as they are.

    A special token is one the matcher found: its id, over text that holds its string
    (with lstrip/rstrip the span also covers the stripped spaces). A model may produce a
    special id from other text, e.g. the unknown token for a placeholder."""
    ids, offsets = encoded
    table = {ord(char): token for char, token in literals.items()}
    out: list[int] = []
    first = 0  # first token of the current stretch
    begin = 0  # where the current stretch starts in text

    def stretch(stop: int, end: int) -> None:
        piece = text[begin:end]
        if any(char in piece for char in literals):
            plain = encode_plain(piece.translate(table))
            if not specials.keys().isdisjoint(plain):
                raise TokenizationError(
                    "the message content tokenizes into a special token even as plain text"
                )
            out.extend(plain)
        else:
            out.extend(ids[first:stop])

    for index, (token, (start, end)) in enumerate(zip(ids, offsets, strict=True)):
        special = specials.get(token)
        if special is not None and special in text[start:end]:
            stretch(index, start)
            out.append(token)
            first, begin = index + 1, end
    stretch(len(ids), len(text))
    return np.asarray(out, dtype=np.uint32)


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """The lengths HF's ``longest_first`` truncation keeps of a pair of ``n1`` and ``n2``
    tokens in ``room`` (the maximum length less the pair's special tokens): nothing is cut
    when both fit; else the longer is cut to what the shorter leaves, unless the shorter
    takes over half the room, and then it keeps ``room // 2`` (a tie counts the first
    sequence as the shorter). The Rust tokenizer's `longest_first` is the same rule."""
    if n1 + n2 <= room:
        return n1, n2
    short = min(n1, n2, room // 2)
    return (room - short, short) if n1 > n2 else (short, room - short)


class RustTokenizer:
    """Trellis' Unigram tokenizer (packed output, parallel, GIL released)."""

    backend = "rust"

    def __init__(self, native: object, error: type[Exception]) -> None:
        self._tok = native
        self._error = error
        self.vocab_size = int(native.vocab_size)  # type: ignore[attr-defined]
        specials: dict[str, int] = native.special_tokens  # type: ignore[attr-defined]
        self.special_tokens = frozenset(specials)
        self._specials = {i: t for t, i in specials.items()}

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
        self,
        query: str,
        documents: Sequence[str],
        max_length: int | None = None,
        max_second: int | None = None,
        left: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            ids, lengths, first = self._tok.encode_pairs_packed(  # type: ignore[attr-defined]
                query, list(documents), max_length=max_length, max_second=max_second, left=left
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

    def encode_prompt(self, text: str, literals: Mapping[str, str]) -> np.ndarray:
        if not literals:
            return self.encode_batch_packed([text], False, None)[0]
        try:
            return _splice_literals(
                text,
                literals,
                self._tok.encode_with_offsets(text, add_special_tokens=False),  # type: ignore[attr-defined]
                self._specials,
                lambda piece: self._tok.encode(  # type: ignore[attr-defined]
                    piece, add_special_tokens=False, split_special_tokens=True
                ),
            )
        except self._error as exc:
            raise TokenizationError(str(exc)) from None


class HFTokenizer:
    """Hugging Face `tokenizers`, with padding and truncation from the file switched off
    (truncation is applied per call on the encodings, which keeps the object thread-safe)."""

    backend = "huggingface"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        tok.no_padding()
        tok.no_truncation()
        self._path = path
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.special_tokens = frozenset(specials.values())
        self._specials = specials
        # A second instance with special tokens read as text (`encode_special_tokens` is
        # state of the instance, so flipping it per call would race), loaded on first use.
        self._plain: tokenizers.Tokenizer | None = None
        self._plain_lock = threading.Lock()

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        with self._plain_lock:
            if self._plain is None:
                from tokenizers import Tokenizer

                plain = Tokenizer.from_file(str(self._path))
                plain.no_padding()
                plain.no_truncation()
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

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
        self,
        query: str,
        documents: Sequence[str],
        max_length: int | None = None,
        max_second: int | None = None,
        left: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tok = self._tok
        room = None
        if max_length is not None:
            room = max_length - tok.num_special_tokens_to_add(True)
            if room < 0:
                raise TokenizationError(f"max_length {max_length} is below the special tokens")
        q = tok.encode(query, add_special_tokens=False)
        cut_queries = {len(q.ids): q}  # the query kept to n tokens, by n
        rows, first = [], []
        side = "left" if left else "right"
        for d in tok.encode_batch(list(documents), add_special_tokens=False):
            if max_second is not None and len(d.ids) > max_second:
                d.truncate(max_second, direction=side)
            kept = q
            if room is not None:
                n1, n2 = longest_first(len(q.ids), len(d.ids), room)
                if n2 < len(d.ids):
                    d.truncate(n2, direction=side)
                kept = cut_queries.get(n1)
                if kept is None:
                    kept = tok.encode(query, add_special_tokens=False)
                    kept.truncate(n1, direction=side)
                    cut_queries[n1] = kept
            pair = tok.post_process(kept, d, add_special_tokens=True)
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

    def encode_prompt(self, text: str, literals: Mapping[str, str]) -> np.ndarray:
        if not literals:
            return self.encode_batch_packed([text], False, None)[0]
        # encode_batch, not encode: only the batch calls release the GIL.
        (enc,) = self._tok.encode_batch([text], add_special_tokens=False)
        plain = self._plain_tokenizer()
        return _splice_literals(
            text,
            literals,
            (enc.ids, enc.offsets),
            self._specials,
            lambda piece: plain.encode_batch([piece], add_special_tokens=False)[0].ids,
        )


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
