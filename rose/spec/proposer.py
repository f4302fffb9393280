"""The `Proposer` protocol: what a drafter does for the generation engine, and the registry
that maps `SpecConfig.method` to one.

A proposer drafts tokens for decoding requests (`propose`), hears what the target kept of
them after every pass (`accept`, where it rolls its own state back to the kept tokens), and
states its needs up front: ``kv_copies`` (1 when it keeps a paged cache per request, pages
from the engine's pool: the scheduler then creates, reserves room for and frees
``Request.draft_table``) and ``target_features`` (the target hidden states every pass must
return for it). It never touches the target cache or the scheduler, and the engine never
looks inside it: a new drafter is one new file that defines a proposer and registers it
(`register_proposer`), after which ``SpecConfig(method=<its name>)`` selects it.

Proposals are verified exactly (`rose.spec.acceptance.accept`): greedy requests keep the
drafts equal to the target's argmax (a draft tree's path when the proposal has a tree),
sampled ones go through rejection sampling against ``q`` (one-hot at the drafts when
``q`` is None: a certain proposal).

Invariant: the target cache holds ``request.tokens[: table.length]`` when `propose` is
called, and `accept` is called once for every request a pass fed, before the tokens it
emitted are appended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rose.kv.allocator import PageAllocator
    from rose.models.llama import LlamaForCausalLM
    from rose.runner import PassOutput
    from rose.scheduler import Request, Scheduled
    from rose.spec.config import SpecConfig
    from rose.spec.mtp import MTPHead
    from rose.spec.tree import DraftTree

__all__ = [
    "DeviceChainProposer",
    "Proposal",
    "Proposer",
    "ProposerInputs",
    "Verified",
    "build_proposer",
    "kv_copies_of",
    "proposer_methods",
    "register_proposer",
]


@dataclass(frozen=True)
class Proposal:
    """tokens: drafts in feed order (a tree's nodes: its chain, then its alternatives).
    q: ``[len(tokens), V]`` the distributions they were drawn from; None: drawn with
    certainty (one-hot at the drafts: a lookup, or a greedy request's argmax).
    tree: the drafts form this tree (greedy requests only; `rose.spec.tree`)."""

    tokens: list[int]
    q: torch.Tensor | None = None
    tree: DraftTree | None = None


@dataclass(frozen=True)
class Verified:
    """What one pass did for a request: it fed ``pending`` of the request's tokens from
    position ``cached``, then ``drafts`` drafts, and kept the drafts at ``path`` (feed
    order, root to leaf; a chain keeps ``0 .. n - 1``). hidden: the target features of
    every fed row ``[pending + drafts, W]`` when the proposer asked for them."""

    cached: int
    pending: int
    drafts: int
    path: list[int]
    hidden: torch.Tensor | None


@runtime_checkable
class Proposer(Protocol):
    """kv_copies: 1 when the proposer keeps a paged cache per request
    (``Request.draft_table``, pages from the engine's pool), else 0. target_features: the
    target hidden states each pass must return for `accept` (the model's
    ``return_all_hidden``; False: none)."""

    kv_copies: int
    target_features: bool | tuple[int, ...]

    def propose(self, todo: Sequence[tuple[Request, int]]) -> list[Proposal | None]:
        """Up to ``k`` drafts for each ``(request, k)`` (None: no drafts this step)."""
        ...

    def accept(self, request: Request, verified: Verified) -> None:
        """Keep what the pass verified, roll back the rest (cache entries of rejected
        drafts, features past the kept tokens). Called for every request a pass fed, a
        prefill chunk included (no drafts, an empty path)."""
        ...


@runtime_checkable
class DeviceChainProposer(Proposer, Protocol):
    """A proposer that can accept greedy chains on the device and draft the next ones in
    the same step, reading the outcome back once (`SpecConfig.device_chain`)."""

    def chains_on_device(self, batch: Sequence[Scheduled]) -> bool:
        """Before the pass: whether this step goes on the device (and get ready for it)."""
        ...

    def outcome_on_device(self, batch: Sequence[Scheduled], out: PassOutput) -> torch.Tensor:
        """Accepted counts ``[B]``, next tokens ``[B]`` and the next drafts, on the device."""
        ...

    def settle(self, batch: Sequence[Scheduled], back: list[int]) -> list[tuple[int, int]]:
        """After the read back: (accepted drafts, next token) per request; the proposer's
        own state updated (the `accept` of this path)."""
        ...


@dataclass(frozen=True)
class ProposerInputs:
    """What a proposer may be built from: the settings, the target, the engine's page pool
    and the models handed to the engine."""

    spec: SpecConfig
    target: LlamaForCausalLM
    allocator: PageAllocator
    page_size: int
    drafter: LlamaForCausalLM | None = None
    mtp_head: MTPHead | None = None


ProposerFactory = Callable[[ProposerInputs], Proposer]


def _ngram(inputs: ProposerInputs) -> Proposer:
    from rose.spec.ngram import NgramProposer

    return NgramProposer(inputs.spec)


def _draft(inputs: ProposerInputs) -> Proposer:
    from rose.spec.draft_model import DraftModelProposer

    return DraftModelProposer.build(inputs)


def _mtp(inputs: ProposerInputs) -> Proposer:
    from rose.spec.mtp import MTPProposer

    return MTPProposer.build(inputs)


# method -> (factory, kv_copies of the proposers it builds)
_BUILT_IN: dict[str, tuple[ProposerFactory, int]] = {
    "ngram": (_ngram, 0),
    "draft": (_draft, 1),
    "mtp": (_mtp, 1),
}
_REGISTRY = dict(_BUILT_IN)


def register_proposer(method: str, factory: ProposerFactory, *, kv_copies: int = 0) -> None:
    """Make ``SpecConfig(method=method)`` build proposers with ``factory``, whose
    proposers keep ``kv_copies`` paged caches per request (`Proposer.kv_copies`; known
    before any is built, so a server sizes its page pool for them). Registering a name
    again replaces its factory; the built-in names are taken."""
    if method == "none" or method in _BUILT_IN:
        raise ValueError(f"spec.method {method!r} is built in")
    if kv_copies not in (0, 1):
        raise ValueError(f"kv_copies must be 0 or 1, got {kv_copies}")
    _REGISTRY[method] = (factory, kv_copies)


def proposer_methods() -> tuple[str, ...]:
    """Every valid `SpecConfig.method`: "none" and the registered proposers."""
    return ("none", *_REGISTRY)


def kv_copies_of(method: str) -> int:
    """Paged caches per request that ``method``'s proposer keeps besides the target's."""
    return 0 if method == "none" else _REGISTRY[method][1]


def build_proposer(inputs: ProposerInputs) -> Proposer | None:
    """The proposer ``inputs.spec.method`` names (None for "none")."""
    method = inputs.spec.method
    if method == "none":
        return None
    factory, kv_copies = _REGISTRY[method]
    proposer = factory(inputs)
    if proposer.kv_copies != kv_copies:
        raise ValueError(
            f"spec.method {method!r} was registered with kv_copies={kv_copies} but its "
            f"proposer keeps {proposer.kv_copies}"
        )
    return proposer
