"""N-gram prompt lookup drafting: no model, copies continuations from the context.

`NgramProposer` is the engine's `rose.spec.proposer.Proposer` for it: no cache, no state,
certain proposals (q one-hot at the drafts).

How long a draft to copy is the lookup's own evidence: the longer the suffix that matched,
the likelier the text is being copied and the longer the copy runs. With
``SpecConfig.ngram_draft_per_match = 4`` (Tulip's default) a 1-token match drafts up to 4
tokens and a 4-token match up to 16. On the RAG tuning prompts of
bench/results/ngram_draft.md a 1-token match kept at least one draft in 27 % of the steps,
a 4-token match in 95 %; 4 per matched token priced best there among 2-8 (2.30x plain,
against 2.11x for growing drafts after fully kept steps, `SpecConfig.adaptive_k`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rose.spec.proposer import Proposal, Verified

if TYPE_CHECKING:
    from rose.scheduler import Request
    from rose.spec.config import SpecConfig

__all__ = ["NgramDrafter", "NgramProposer"]


class NgramDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of the
    context's last n tokens (trying n = max_n down to min_n)."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got {min_n}/{max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """``(start, n)``: the longest suffix of ``tokens`` (``max_n`` down to ``min_n``)
        with an earlier occurrence is ``n`` tokens long, and its most recent earlier
        occurrence is followed by ``tokens[start]``; None when nothing matches."""
        length = len(tokens)
        if length < 2:
            return None
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n :]
            # windows starting at 0 .. length-n-1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                return int(hits[-1]) + n, n
        return None

    def propose(self, tokens: list[int], k: int, per_match: int = 0) -> list[int]:
        """Up to ``k`` draft tokens continuing ``tokens`` (empty when nothing matches); with
        ``per_match``, up to ``per_match`` per token of the suffix that matched."""
        found = self.match(tokens) if k >= 1 else None
        if found is None:
            return []
        start, n = found
        if per_match:
            k = min(k, per_match * n)
        # Copy forward; a match close to the end keeps copying from the draft itself
        # (LZ77-style overlap), which continues periodic text.
        out = list(tokens)
        for i in range(k):
            out.append(out[start + i])
        return out[len(tokens) :]


class NgramProposer:
    """Prompt lookup over each request's tokens (`NgramDrafter`)."""

    kv_copies = 0
    target_features = False

    def __init__(self, spec: SpecConfig) -> None:
        self.drafter = NgramDrafter(spec.ngram_max, spec.ngram_min)
        self.per_match = spec.ngram_draft_per_match

    def propose(self, todo: Sequence[tuple[Request, int]]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for r, k in todo:
            d = self.drafter.propose(r.tokens, k, self.per_match)
            out.append(Proposal(d) if d else None)
        return out

    def accept(self, request: Request, verified: Verified) -> None:
        """Nothing to roll back: the next lookup reads the request's tokens afresh."""
