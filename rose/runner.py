"""Model runner: one target forward pass over whatever the scheduler hands it.

A pass is a list of `Chunk`s, one per request: the tokens fed from the request's cached
length on (a prefill chunk, a decode's pending token, or a pending token and drafts to
verify, chained or as a tree) and how many of the last of them need logits, and which
prompt tokens need theirs (prompt logprobs). The runner builds the attention metadata
(tree masks included), runs the model on the paged cache and returns the logits rows and,
when asked, the target's hidden states of every fed token.

Invariants: each chunk's table already has room for its tokens (the scheduler reserved
it); the pass writes their K/V at positions ``cached ..`` and changes no table's length
(the engine sets lengths from what acceptance kept). CPU-only shape padding (filler tokens,
duplicated logits rows) never shows in what `forward` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rose.attention.metadata import AttentionMetadata
from rose.kv.allocator import OutOfPages
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaForCausalLM
from rose.spec.tree import DraftTree, tree_metadata

__all__ = ["Chunk", "ModelRunner", "PassOutput"]


@dataclass(frozen=True)
class Chunk:
    """One request's rows of a pass: ``ids`` fed from position ``cached`` of ``table``;
    logits for the last ``logits`` of them (0: a prefill chunk short of the prompt's end);
    ``tree``: the last ``len(tree.tokens)`` ids are this draft tree's nodes. ``scored``:
    fed tokens (indices into ``ids``) whose logits are wanted too, the prompt positions a
    request scores (`PassOutput.scored`)."""

    table: BlockTable
    cached: int
    ids: list[int]
    logits: int
    tree: DraftTree | None = None
    scored: range = range(0)


@dataclass(frozen=True)
class PassOutput:
    """logits ``[R, V]``: every chunk's logits rows, in chunk order (chunk ``i``'s start at
    ``rows[i]``). hidden ``[T, W]``: the target features of every fed token (chunk ``i``'s
    start at ``starts[i]``), None unless asked for. scored ``[S, V]``: the logits of every
    chunk's ``scored`` tokens, in chunk order, None when no chunk has any."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    rows: list[int]
    starts: list[int]
    scored: torch.Tensor | None = None


class ModelRunner:
    """Runs ``model`` on its paged ``cache``."""

    def __init__(self, model: LlamaForCausalLM, cache_pages: int, page_size: int) -> None:
        self.model = model
        self.cache = model.new_cache(cache_pages, page_size)
        self.device = self.cache.k.device

    def forward(
        self, chunks: Sequence[Chunk], features: bool | tuple[int, ...] = False
    ) -> PassOutput:
        """One pass over ``chunks``; ``features``: the model's ``return_all_hidden``."""
        entries, ids, idx, rows, starts = [], [], [], [], []
        scored_idx: list[int] = []
        trees: list[tuple[int, int, int, DraftTree]] = []
        total = 0
        for b, c in enumerate(chunks):
            if c.tree is not None:
                trees.append((b, c.cached, len(c.ids) - len(c.tree.tokens), c.tree))
            entries.append((c.table, c.cached, len(c.ids)))
            starts.append(total)
            rows.append(len(idx))
            scored_idx.extend(total + j for j in c.scored)
            ids.extend(c.ids)
            total += len(c.ids)
            idx.extend(range(total - c.logits, total))  # the last c.logits fed tokens
        n_rows = len(idx)
        idx += scored_idx  # after the emitting rows, so those keep their places
        passed = list(entries)  # what the pass feeds: entries plus any fillers
        fill = self._fillers(entries[-1], total)
        if fill:  # after the last chunk's tokens: attended by nothing real, never kept
            table, cached, fed = entries[-1]
            passed[-1] = (table, cached, fed + fill)
            ids.extend([ids[-1]] * fill)
        meta = tree_metadata(AttentionMetadata.build(passed, device=self.device), trees)
        if not idx:  # only prefill chunks short of their prompts' ends: one row anyway
            idx = [total - 1]
        elif 1 < len(idx) < self.model.pass_min_rows:
            # where 2-3 rows times the big LM head cost more than 4 (AMD Zen 4, oneDNN's
            # packed kernel: 9.8 vs 6.9 ms at 2 for SmolLM2's 49152 x 576 head on one
            # thread); duplicate rows, drop them after
            idx += [idx[-1]] * (self.model.pass_min_rows - len(idx))
        fwd = self.model(
            torch.tensor(ids, device=self.device),
            meta,
            self.cache,
            torch.tensor(idx, device=self.device),
            return_all_hidden=features,
        )
        hidden = None if fwd.all_hidden is None else fwd.all_hidden[:total]  # [T, W]
        scored = fwd.logits[n_rows : n_rows + len(scored_idx)] if scored_idx else None
        return PassOutput(fwd.logits[:n_rows], hidden, rows, starts, scored)

    def move_kv(self, table: BlockTable, src: int, dst: int) -> None:
        """Copy the cached K/V of token ``src`` of ``table`` to token ``dst`` (a draft tree's
        kept alternative moves next to the kept chain)."""
        s, d = table.slots(src, src + 1), table.slots(dst, dst + 1)
        self.cache.k[:, d] = self.cache.k[:, s]
        self.cache.v[:, d] = self.cache.v[:, s]

    def _fillers(self, last: tuple[BlockTable, int, int], total: int) -> int:
        """Filler tokens to append to a pass of ``total`` new tokens, up to the model's
        ``pass_min_rows``, fed after the last chunk's tokens (``last``: its table, cached
        and fed counts): causal attention keeps them out of every real token's view, their
        K/V land in its cache past the tokens the step keeps (the table's length never
        covers them; later tokens overwrite them), and no logits or features are read from
        them. They pay where a pass of 2-3 tokens costs more than one of 4 (AMD Zen 4,
        SmolLM2-135M, one thread: 48.4 and 47.5 ms against 45.4; oneDNN streams a weight
        slower at so few rows, and padding every product instead costs ~600 small ops a
        pass; `LlamaForCausalLM.pack_weights` measures it at load). 0 where it does not
        (``pass_min_rows`` 1: GPUs, Zen 5), for passes big enough, or when the table has
        no room for them."""
        rows = self.model.pass_min_rows
        if not 1 < total < rows:
            return 0
        table, cached, fed = last
        fill = rows - total
        try:
            table.reserve(cached + fed + fill)
        except OutOfPages:
            return 0
        return fill
