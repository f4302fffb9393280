"""The speculative acceptance rule (Leviathan et al. / Chen et al. rejection sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AcceptResult", "accept_deterministic", "accept_drafts", "accept_greedy"]


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
