"""Speculative decoding: a drafter proposes tokens, the target verifies them in one pass.

- `Proposer` (`rose.spec.proposer`): what a drafter is to the generation engine (propose,
  accept / roll back, its KV needs); `register_proposer` adds one under a `SpecConfig.method`
  name. `NgramProposer`, `DraftModelProposer` and `MTPProposer` are the built-in ones.
- `accept`: the exact acceptance rule for one request's verified rows (greedy chain, greedy
  tree, or rejection sampling), built on the rules below.
- `accept_drafts`: the lossless acceptance rule (rejection sampling + bonus token);
  `accept_deterministic` for drafts proposed with certainty (n-gram), `accept_greedy` for
  temperature 0 (longest prefix equal to the target's argmax), neither building ``q``.
- `NgramDrafter`: prompt lookup — copy what followed the last n tokens' earlier occurrence.
- `ModelDrafter`: a small model sharing the target's tokenizer, on the shared page pool.
- `rose.spec.mtp` / `rose.spec.train_mtp`: the MTP / EAGLE head and its training command.
  Greedy chains are accepted on the device and the next chain drafted in the same step
  (`MTPDrafter.chain_after_verify`, `SpecConfig.device_chain`): one read back per step.
  Where the context ends in a long repeat, a step copies from it instead of asking the
  head (`SpecConfig.lookup_min_match`).
- `rose.spec.tree`: draft trees for greedy MTP requests — the chain plus the head's
  runner-up tokens as leaves, verified in the same pass under a tree mask.
- `SpecConfig`: which method, how many tokens, validated once here (Tulip maps its flags to
  it); `SpecStats`: acceptance and timing.
"""

from __future__ import annotations

from rose.spec.acceptance import (
    AcceptResult,
    accept,
    accept_deterministic,
    accept_drafts,
    accept_greedy,
)
from rose.spec.config import SpecConfig
from rose.spec.draft_model import DraftModelProposer, ModelDrafter, truncated_drafter
from rose.spec.ngram import NgramDrafter, NgramProposer
from rose.spec.proposer import Proposal, Proposer, Verified, register_proposer
from rose.spec.stats import SpecStats

__all__ = [
    "AcceptResult",
    "DraftModelProposer",
    "ModelDrafter",
    "NgramDrafter",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpecConfig",
    "SpecStats",
    "Verified",
    "accept",
    "accept_deterministic",
    "accept_drafts",
    "accept_greedy",
    "register_proposer",
    "truncated_drafter",
]
