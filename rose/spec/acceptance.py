"""The speculative acceptance rules (Leviathan et al. / Chen et al. rejection sampling).

`accept` picks the rule for one request's verified rows: the greedy tree walk
(`rose.spec.tree.accept_greedy_tree`) for a draft tree, `accept_greedy` for a greedy chain,
and for sampled requests rejection sampling, `accept_drafts` against the proposal's ``q``
or `accept_deterministic` when the drafts were proposed with certainty. Every rule emits
exactly what sampling from the target token by token would (its argmax at temperature 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rose.sampling import SamplingParams, token_probs
from rose.spec.tree import accept_greedy_tree

if TYPE_CHECKING:
    from rose.spec.proposer import Proposal

__all__ = ["AcceptResult", "accept", "accept_deterministic", "accept_drafts", "accept_greedy"]


def accept(
    proposal: Proposal | None,
    logits: torch.Tensor,
    argmax: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """One request's verdict on ``proposal`` (None: no drafts): logits ``[n, V]`` are the
    target's at the ``n = len(drafts) + 1`` verified rows (the last pending token, then
    every draft), ``argmax`` their argmax (read only for greedy requests). Returns the kept
    drafts' indices (feed order, root to leaf) and the token emitted after them."""
    drafts = [] if proposal is None else proposal.tokens
    if proposal is not None and proposal.tree is not None:
        return accept_greedy_tree(proposal.tree, argmax)
    if params.greedy:
        n, nxt = accept_greedy(drafts, list(argmax))
        return list(range(n)), nxt
    p = token_probs(logits, params)  # [n, V]
    dt = torch.tensor([drafts], dtype=torch.int64, device=logits.device)  # [1, k]
    if proposal is None or proposal.q is None:  # q is one-hot at the drafts
        res = accept_deterministic(dt, p[None], generator)
    else:
        res = accept_drafts(dt, proposal.q[None], p[None], generator)
    return list(range(int(res.num_accepted[0]))), int(res.next_token[0])


@dataclass(frozen=True)
class AcceptResult:
    """num_accepted ``[B]``: drafts kept per row; next_token ``[B]``: the token emitted
    after them (a resample on rejection, or the bonus token when all were kept)."""

    num_accepted: torch.Tensor
    next_token: torch.Tensor


def accept_drafts(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Keep the longest prefix of ``draft`` that the target accepts, then emit one token.

    draft ``[B, k]`` tokens drawn from the drafter's distributions ``q [B, k, V]``;
    ``p [B, k + 1, V]`` are the target's distributions at the same positions plus one.
    The emitted sequence is distributed exactly as sampling from ``p`` token by token.
    Greedy decoding passes one-hot ``p``/``q``: then a draft is kept iff it is the target's
    argmax and the emitted token is the target's argmax, so output equals plain greedy.
    """
    b, k = draft.shape
    if k == 0:
        return AcceptResult(torch.zeros(b, dtype=torch.int64), _draw(p[:, 0], generator))
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k] target prob of draft
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)  # [B, k] drafter prob (> 0: it was drawn)
    # Accept draft i with probability min(1, p/q): u < p/q  <=>  u * q < p (u in [0, 1)).
    u = torch.rand(b, k, generator=generator, device=p.device)
    ok = u * q_d < p_d  # [B, k]
    n = ok.to(torch.int64).cumprod(-1).sum(-1)  # [B] length of the accepted prefix

    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n]  # [B, V] target distribution at the first unaccepted position
    # On rejection at position n < k, draw from the residual norm(max(0, p - q)): the mass
    # the target wants that the drafter under-proposed. When every draft was kept (n == k)
    # draw the bonus token from p at position k. (A zero residual means p == q, where
    # rejection has probability 0; fall back to p to stay well-defined.)
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n]  # [B, V]; 0 at n == k
    residual = (p_n - q_n).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)
    return AcceptResult(n, _draw(dist, generator))


def accept_deterministic(
    draft: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> AcceptResult:
    """`accept_drafts` for drafts proposed with certainty (q one-hot at the draft: n-gram
    lookup, or a drafter's argmax), without building ``q``.

    With q = one-hot(d) the rule reads: keep d with probability p(d); on rejection draw
    from p with d removed (norm(max(0, p - q)) = p without d, renormalized).
    draft ``[B, k]``, p ``[B, k + 1, V]``.
    """
    b, k = draft.shape
    if k == 0:
        return AcceptResult(torch.zeros(b, dtype=torch.int64), _draw(p[:, 0], generator))
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(b, k, generator=generator, device=p.device)
    ok = u < p_d  # [B, k]
    n = ok.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n].clone()  # [B, V]
    rejected = n < k
    d_n = draft[rows, n.clamp_max(k - 1)]  # [B] the rejected draft (unused when n == k)
    p_n[rows[rejected], d_n[rejected]] = 0.0
    mass = p_n.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, p_n / mass.clamp_min(1e-30), p[rows, n])
    return AcceptResult(n, _draw(dist, generator))


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Temperature 0: ``target_argmax`` holds the target's argmax at the ``len(draft) + 1``
    verified positions. Keeps drafts while they equal the target's argmax and then emits the
    target's argmax — what `accept_drafts` does with one-hot ``p`` and ``q``, without
    building distributions. Returns (number kept, next token)."""
    n = 0
    for d, t in zip(draft, target_argmax, strict=False):
        if d != t:
            break
        n += 1
    return n, target_argmax[n]


def _draw(dist: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``dist [B, V]``; a one-hot row always yields its hot index."""
    return torch.multinomial(dist, 1, generator=generator).squeeze(-1)
