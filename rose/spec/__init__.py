"""Speculative decoding: a drafter proposes tokens, the target verifies them in one pass.

- `accept_drafts`: the lossless acceptance rule (rejection sampling + bonus token).
- `NgramDrafter`: prompt lookup — copy what followed the last n tokens' earlier occurrence.
- `ModelDrafter`: a small model sharing the target's tokenizer, on the shared page pool.
- `SpecConfig`: which method, how many tokens; `SpecStats`: acceptance and timing.
"""

from __future__ import annotations

from rose.spec.acceptance import AcceptResult, accept_drafts
from rose.spec.config import SpecConfig
from rose.spec.draft_model import ModelDrafter, truncated_drafter
from rose.spec.ngram import NgramDrafter
from rose.spec.stats import SpecStats

__all__ = [
    "AcceptResult",
    "ModelDrafter",
    "NgramDrafter",
    "SpecConfig",
    "SpecStats",
    "accept_drafts",
    "truncated_drafter",
]
