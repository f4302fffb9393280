"""OpenAI's ``logprobs`` from a replica's per-token numbers (`pb.TokenLogprob`, one per
generated token id): ids become the token's text and UTF-8 bytes through the model's
tokenizer (`TokenPieces`), shaped as chat completions want them (`chat_logprobs`) or as
the legacy completions do (`CompletionLogprobsBuilder`, which keeps a stream's text
offsets across its chunks).

A token's ``bytes`` are its own raw bytes, read from the vocabulary: a byte-level BPE
piece (``Ġthe``) maps back through GPT-2's byte-to-unicode table (`` the``), a
SentencePiece piece turns ``▁`` into a space and a byte-fallback piece (``<0xE2>``) into
its byte, an added token is its content. A token's ``token`` is those bytes as text; a
token that is part of a character (byte-level vocabularies split rare characters over
several tokens) is not valid UTF-8 on its own and is written as OpenAI does,
``bytes:\\xe2\\x80`` (its ``bytes`` stay exact: join them to rebuild the text).

Example::

    pieces = TokenPieces.from_file(model_dir / "tokenizer.json")
    pieces.text_of(id), pieces.bytes_of(id)
    chat_logprobs(pieces, message.token_ids, message.logprobs)
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ivy.generation_schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from protos.trellis.v1 import inference_pb2 as pb

__all__ = ["CompletionLogprobsBuilder", "TokenPieces", "chat_logprobs"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: the character each byte is written as in a
    byte-level BPE vocabulary → that byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def _decoders(spec: Any) -> list[dict[str, Any]]:
    """The decoder steps of a tokenizer.json ``decoder`` (a Sequence flattened)."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoders(inner)]
    return [spec]


class TokenPieces:
    """Each token id's raw bytes and text, computed on first use and kept.

    vocab: id → piece as the vocabulary spells it. added: id → an added token's content.
    byte_level: pieces are GPT-2 byte-level (else SentencePiece-like: ``space`` stands
    for a space, and ``<0xNN>`` pieces are one byte when ``byte_fallback``)."""

    def __init__(
        self,
        vocab: dict[int, str],
        added: dict[int, str],
        *,
        byte_level: bool,
        space: str | None,
        byte_fallback: bool,
    ) -> None:
        self._vocab = vocab
        self._added = added
        self._table = _byte_level_table() if byte_level else None
        self._space = space
        self._byte_fallback = byte_fallback
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    @classmethod
    def from_file(cls, path: Path | str) -> TokenPieces:
        """From a Hugging Face tokenizer.json."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model = data.get("model") or {}
        raw = model.get("vocab") or {}
        if isinstance(raw, dict):  # BPE, WordPiece: piece → id
            vocab = {int(i): piece for piece, i in raw.items()}
        else:  # Unigram: [piece, score] in id order
            vocab = {i: entry[0] for i, entry in enumerate(raw)}
        added = {int(t["id"]): t["content"] for t in data.get("added_tokens") or []}
        steps = _decoders(data.get("decoder"))
        kinds = {d.get("type") for d in steps}
        space = None
        for d in steps:
            if d.get("type") == "Metaspace":
                space = d.get("replacement", "▁")
            elif d.get("type") == "Replace" and d.get("content") == " ":
                pattern = d.get("pattern") or {}
                space = pattern.get("String", space)
        return cls(
            vocab,
            added,
            byte_level="ByteLevel" in kinds,
            space=space,
            byte_fallback="ByteFallback" in kinds or bool(model.get("byte_fallback")),
        )

    def bytes_of(self, token: int) -> bytes:
        """The token's raw bytes (empty for an id outside the vocabulary)."""
        out = self._bytes.get(token)
        if out is None:
            out = self._bytes[token] = self._raw(token)
        return out

    def text_of(self, token: int) -> str:
        """The token's bytes as text; ``bytes:\\xNN...`` when they are not UTF-8 alone."""
        out = self._text.get(token)
        if out is None:
            raw = self.bytes_of(token)
            try:
                out = raw.decode("utf-8")
            except UnicodeDecodeError:
                out = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._text[token] = out
        return out

    def _raw(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self._vocab.get(token)
        if piece is None:
            return b""
        if self._table is not None:
            if all(c in self._table for c in piece):
                return bytes(self._table[c] for c in piece)
            return piece.encode("utf-8")
        if self._byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self._space:
            piece = piece.replace(self._space, " ")
        return piece.encode("utf-8")


def _check(ids: Sequence[int], entries: Sequence[pb.TokenLogprob]) -> None:
    if len(ids) != len(entries):
        raise ValueError(f"{len(entries)} logprobs for {len(ids)} tokens")


def chat_logprobs(
    pieces: TokenPieces, ids: Sequence[int], entries: Sequence[pb.TokenLogprob]
) -> ChatLogprobs:
    """Chat's ``choices[i].logprobs``: one entry per token, with its alternatives."""
    _check(ids, entries)
    content = []
    for token, e in zip(ids, entries, strict=True):
        top = [
            TopLogprob(pieces.text_of(t), v, list(pieces.bytes_of(t)))
            for t, v in zip(e.top_ids, e.top_logprobs, strict=True)
        ]
        content.append(
            ChatTokenLogprob(pieces.text_of(token), e.logprob, list(pieces.bytes_of(token)), top)
        )
    return ChatLogprobs(content)


class CompletionLogprobsBuilder:
    """Legacy completions' ``choices[i].logprobs`` for one choice, chunk by chunk.

    ``text_offset`` is each token's offset, in characters, in the concatenated text of the
    generated tokens (0 at the first one; it runs on across a stream's chunks; a token
    that completes a character split over several tokens starts where that character
    does). ``top_logprobs`` maps the alternatives' text to their logprob and, as in
    OpenAI's API, always holds the chosen token too (so up to logprobs + 1 entries)."""

    def __init__(self, pieces: TokenPieces) -> None:
        self._pieces = pieces
        self._chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Sequence[int], entries: Sequence[pb.TokenLogprob]) -> CompletionLogprobs:
        """Generated tokens, one entry each."""
        _check(ids, entries)
        out = CompletionLogprobs([], [], [], [])
        for token, e in zip(ids, entries, strict=True):
            self._append(out, token, e)
        return out

    def add_prompt(
        self, ids: Sequence[int], entries: Sequence[pb.TokenLogprob]
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens, before the generated ones: ``entries`` score every
        token but the first, which nothing precedes (its logprob and alternatives are null,
        as in OpenAI's API)."""
        _check(ids[1:], entries)
        out = CompletionLogprobs([], [], [], [])
        for j, token in enumerate(ids):
            self._append(out, token, entries[j - 1] if j else None)
        return out

    def _append(self, out: CompletionLogprobs, token: int, e: pb.TokenLogprob | None) -> None:
        pieces = self._pieces
        text = pieces.text_of(token)
        top: dict[str, float] | None = None
        if e is not None:
            top = {}
            for t, v in zip(e.top_ids, e.top_logprobs, strict=True):
                top.setdefault(pieces.text_of(t), v)
            top.setdefault(text, e.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(None if e is None else e.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(self._chars)
        self._chars += len(self._decoder.decode(pieces.bytes_of(token)))
