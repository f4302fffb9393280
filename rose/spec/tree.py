"""Draft trees for greedy verification: a chain of drafts with alternatives beside it.

The MTP head drafts a chain ``c_1 .. c_k`` (its top token at each depth). At depth ``d`` its
next best tokens are nearly free to verify too: the target pass over 5-6 tokens costs about
what a pass over 4 costs on the CPU (memory-bound), so a tree spends spare rows on them.
The tree is the chain (the trunk) plus, at each depth, alternatives that are leaves:

    root ── c_1 ── c_2 ── c_3         nodes in feed order: c_1 c_2 c_3 | a_1 a_1' | a_2
       ├── a_1    └── a_2             parent(c_d) = c_(d-1), parent(a_d) = c_(d-1)
       └── a_1'                        (root for d = 1)

Verification feeds the root's pending token(s) and every node in one pass; each node sits at
position ``root + depth`` and sees the cache, the root and its own ancestors only (the mask
`tree_metadata` builds). Greedy acceptance (`accept_greedy_tree`) follows the trunk while the
target's argmax is the chain token; where it is not, an alternative equal to the argmax is
kept and ends the walk (it has no children), and the target's argmax after the last kept
node is the bonus token. Output stays exactly the target's greedy output: a token is kept
only when it is the target's argmax at that position.

Leaves only, so the head still runs k steps per draft (one query each) and drafting costs
what the chain costs. The widths per depth are fixed (`SpecConfig.tree_widths`) or chosen per
step from the head's own probabilities (`DynamicTree`, `SpecConfig.tree_nodes`, after
EAGLE-2's dynamic trees). Sampled requests use the plain chain: a lossless multi-candidate
acceptance rule for sampling (SpecInfer's) is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rose.attention.metadata import AttentionMetadata, to_device

__all__ = ["DraftTree", "DynamicTree", "accept_greedy_tree", "tree_metadata"]


@dataclass(frozen=True)
class DraftTree:
    """chain: the trunk ``[k]``; alternatives[d]: leaf tokens at depth ``d + 1`` (parent:
    chain token ``d``, or the root for ``d = 0``); at most ``len(chain)`` depths."""

    chain: list[int]
    alternatives: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.alternatives) > len(self.chain):
            raise ValueError(
                f"a draft tree has alternatives at {len(self.alternatives)} depths but a "
                f"chain of {len(self.chain)}"
            )

    @property
    def tokens(self) -> list[int]:
        """Every node's token in feed order: the chain, then the alternatives by depth."""
        return self.chain + [t for alts in self.alternatives for t in alts]

    @property
    def depths(self) -> list[int]:
        """Depth (1-based) of every node in feed order."""
        return list(range(1, len(self.chain) + 1)) + [
            d + 1 for d, alts in enumerate(self.alternatives) for _ in alts
        ]

    @property
    def parents(self) -> list[int]:
        """Parent node index (feed order) of every node; -1 for the root."""
        return list(range(-1, len(self.chain) - 1)) + [
            d - 1 for d, alts in enumerate(self.alternatives) for _ in alts
        ]


def accept_greedy_tree(tree: DraftTree, target_argmax: Sequence[int]) -> tuple[list[int], int]:
    """target_argmax: the target's argmax at the root then at every node (feed order),
    ``1 + len(tree.tokens)`` values → (kept node indices, root to leaf; next token)."""
    path: list[int] = []
    row = 0  # argmax row of the last kept node (0: the root)
    offset = len(tree.chain)  # feed index of the first alternative at this depth
    for d, tok in enumerate(tree.chain):
        want = target_argmax[row]
        alts = tree.alternatives[d] if d < len(tree.alternatives) else []
        if tok == want:
            path.append(d)
            row = d + 1
        elif want in alts:
            j = offset + alts.index(want)
            path.append(j)
            return path, target_argmax[1 + j]
        else:
            return path, want
        offset += len(alts)
    return path, target_argmax[row]


def tree_metadata(
    meta: AttentionMetadata, trees: Sequence[tuple[int, int, int, DraftTree]]
) -> AttentionMetadata:
    """`meta` with tree positions and masks for some sequences of its batch.

    trees: ``(batch row b, cached tokens, pending tokens P, tree)``; sequence ``b`` was fed
    its P pending tokens then ``tree.tokens``. Node j gets position ``cached + P - 1 +
    depth(j)`` and sees keys ``0 .. cached + P - 1`` plus its ancestors and itself."""
    if not trees:
        return meta
    # Everything that depends on the trees is built on the host and sent with `to_device`
    # (page-locked, non-blocking), and the offsets come from the host-side page lists: a tree
    # pass reads nothing back from the device, so building it never waits for the work
    # queued before it.
    device = meta.kv_slots.device
    positions = meta.positions.clone()
    lq, lk = meta.q_index.shape[1], meta.kv_slots.shape[1]
    if meta.mask is None:
        mask = torch.ones(meta.q_index.shape[0], 1, lq, lk, dtype=torch.bool, device=device)
    else:
        mask = meta.mask.clone()
    cu = meta.pages.new_token_offsets()
    for b, cached, pending, tree in trees:
        n = len(tree.tokens)
        root = cached + pending  # first node's cache index
        depth = to_device(torch.tensor(tree.depths, dtype=positions.dtype), device)  # [n]
        positions[cu[b] + pending : cu[b] + pending + n] = root - 1 + depth
        rows = mask[b, 0, pending : pending + n]  # [n, Lk]
        rows[:, root:] = False
        rows[:, root : root + n] = to_device(torch.tensor(_ancestry(tree.parents)), device)
    return replace(meta, positions=positions, mask=mask, causal=False, kernel=None)


def _ancestry(parents: list[int]) -> list[list[bool]]:
    """Ancestor-or-self matrix ``[n, n]`` of a tree given each node's parent (-1: root)."""
    n = len(parents)
    anc = [[i == j for j in range(n)] for i in range(n)]
    for j in range(n):
        p = parents[j]
        while p >= 0:
            anc[j][p] = True
            p = parents[p]
    return anc


class DynamicTree:
    """Chooses a draft tree of ``nodes`` nodes from the head's ranked tokens per depth.

    Every candidate gets the head's estimate of reaching it: the product of the head's
    probabilities along its path (chain token after chain token, then its own). The tree is
    the ``nodes`` most likely candidates; a chain token always ranks at or above its
    alternatives and its children, so the chosen set is closed under ancestry. The chain grows
    (another head step) only while its tip's estimate beats the ``nodes``-th best so far:
    otherwise no child of the tip could make the cut."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.tip = 1.0  # estimate of reaching the chain's tip
        self.chain: list[int] = []
        # (estimate, depth, 0 for a chain token / 1 for an alternative, token)
        self.pool: list[tuple[float, int, int, int]] = []
        self.grows = True

    def add(self, ranked: list[int], probs: list[float], can_grow: bool) -> None:
        depth = len(self.chain) + 1
        self.pool += [
            (self.tip * p, depth, int(j > 0), t)
            for j, (t, p) in enumerate(zip(ranked, probs, strict=True))
        ]
        self.chain.append(ranked[0])
        self.tip *= probs[0]
        self.pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        del self.pool[self.nodes :]
        cut = self.pool[-1][0] if len(self.pool) == self.nodes else 0.0
        self.grows = can_grow and self.tip > cut

    def select(self) -> tuple[list[int], list[list[int]]]:
        """(chain, alternatives per depth) of the chosen nodes."""
        chain_len = sum(1 for c in self.pool if c[2] == 0)
        alts: list[list[int]] = [[] for _ in range(chain_len)]
        for _, depth, alt, tok in self.pool:
            if alt:
                alts[depth - 1].append(tok)
        while alts and not alts[-1]:
            alts.pop()
        return self.chain[:chain_len], alts
