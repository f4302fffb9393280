"""Incremental detokenization of one generated sequence into text deltas.

`TextStream` turns the token ids a sequence emits, step by step, into pieces of text such
that the pieces concatenate to exactly ``decode(output_ids)`` (cut before a stop string when
one ended the sequence). Two things are held back until they are decided:

* an incomplete UTF-8 character (byte-level BPE splits characters across tokens; the
  decoder shows the missing bytes as U+FFFD until the rest arrives);
* a tail of the text that is the beginning of a stop string (it may still become one, and
  the final text is cut before the stop string, as OpenAI and vLLM do).

Only a short window of tokens is decoded per step: the text of the tokens since the last
decided boundary, with the tokens before that boundary as left context (so decoders that
treat the first token specially, like SentencePiece's leading space, decode it in context).

Example::

    stream = TextStream(lambda ids: tok.decode(ids, skip_special_tokens=True), stop=("\\n\\n",))
    piece = stream.push([9906, 11])            # "Hello,"
    last = stream.push([2], finish_reason="stop")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """Text deltas of one sequence; not thread-safe (one owner pushes)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (left context)
        self._read = 0  # tokens whose text is decided (moved into _held or emitted)
        self._held = ""  # decided text not emitted yet: it may begin a stop string
        self.text = ""
        """Everything emitted so far."""

    def push(self, new_ids: Sequence[int], finish_reason: str | None = None) -> str:
        """Add the ids of one step; returns the text that is now decided (maybe empty).

        With ``finish_reason`` set this is the last call: all remaining text is returned,
        cut before the earliest stop string when ``finish_reason`` is ``"stop"``.
        """
        self._ids.extend(new_ids)
        window = self._decode(self._ids[self._prefix :])
        context = self._decode(self._ids[self._prefix : self._read])
        finished = finish_reason is not None
        if not finished and (window.endswith(_REPLACEMENT) or not window.startswith(context)):
            return ""  # an incomplete character: wait for its remaining bytes
        pending = self._held + window[len(context) :]
        self._prefix, self._read = self._read, len(self._ids)
        if finished:
            # the last piece comes from one full decode, so the pieces add up to it exactly
            full = self._decode(self._ids)
            if full.startswith(self.text):
                pending = full[len(self.text) :]
            self._held = ""
            if finish_reason == "stop":
                pending = pending[: self._stop_at(pending)]
            return self._emit(pending)
        cut = self._stop_at(pending)
        if cut < len(pending):  # a whole stop string: the engine finishes on this step
            self._held = pending[cut:]
            return self._emit(pending[:cut])
        keep = self._stop_prefix_len(pending)
        self._held = pending[len(pending) - keep :]
        return self._emit(pending[: len(pending) - keep])

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece

    def _stop_at(self, text: str) -> int:
        """Index of the earliest stop string in ``text`` (``len(text)`` when none)."""
        hits = [i for s in self._stop if (i := text.find(s)) >= 0]
        return min(hits, default=len(text))

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
