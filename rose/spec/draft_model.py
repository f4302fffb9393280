"""Draft-target speculation: a small model sharing the target's tokenizer drafts a chain.

`DraftModelProposer` is the engine's `rose.spec.proposer.Proposer` for it: one drafter
cache per request (``Request.draft_table``, pages from the engine's pool) that holds the
request's tokens plus the drafts it fed, rolled back to the kept ones after each pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from rose.attention.metadata import AttentionMetadata
from rose.kv.allocator import OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams, sample, token_probs
from rose.spec.proposer import Proposal, ProposerInputs, Verified

if TYPE_CHECKING:
    from rose.scheduler import Request

__all__ = ["DraftModelProposer", "DraftRequest", "ModelDrafter", "truncated_drafter"]


@dataclass
class DraftRequest:
    """One sequence to draft for: its drafter block table, all tokens so far (the table
    holds a prefix of them), how many tokens to draft, and how to sample them."""

    table: BlockTable
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None


class ModelDrafter:
    """Runs the drafter on its own paged cache whose pages come from the shared allocator.

    Per step, each sequence first catches up on the tokens its drafter cache lacks (the
    tokens accepted last step plus the target's own token: the "refill"), then drafts k
    tokens one forward pass at a time, all sequences batched.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        allocator: PageAllocator,
        page_size: int,
        target_vocab_size: int,
    ) -> None:
        if model.config.vocab_size > target_vocab_size:
            raise ValueError(
                f"spec.draft: drafter vocab_size {model.config.vocab_size} exceeds the "
                f"target's {target_vocab_size}; drafter and target must share a tokenizer"
            )
        self.model = model
        self.allocator = allocator
        self.page_size = page_size
        self.vocab_size = target_vocab_size
        self.cache = model.new_cache(allocator.num_pages, page_size)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Drafts and their distributions ``q [k, V_target]`` per request (k may come back
        smaller, down to 0, when the page pool cannot hold the drafter's tokens). Greedy
        requests draft the drafter's argmax and get None: q is one-hot at the drafts."""
        live: list[int] = []
        for i, r in enumerate(requests):
            try:
                r.table.reserve(len(r.tokens) + r.k - 1)
                live.append(i)
            except OutOfPages:
                pass
        drafts: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        feeds = {i: requests[i].tokens[requests[i].table.length :] for i in live}
        for step in range(max((requests[i].k for i in live), default=0)):
            live = [i for i in live if requests[i].k > step]
            entries = [(requests[i].table, requests[i].table.length, len(feeds[i])) for i in live]
            meta = AttentionMetadata.build(entries, device=self.cache.k.device)
            ids = torch.tensor([t for i in live for t in feeds[i]], device=self.cache.k.device)
            logits = self.model(ids, meta, self.cache, logits_index=meta.last_index).logits
            argmax = logits.argmax(-1).tolist()  # [B] one sync for every greedy row
            for row, i in enumerate(live):
                r = requests[i]
                r.table.length += len(feeds[i])
                if r.params.greedy:  # a certain proposal: no distribution needed
                    tok = argmax[row]
                else:
                    q = token_probs(logits[row : row + 1], r.params)  # [1, V_draft]
                    if q.shape[-1] < self.vocab_size:
                        q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))
                    tok = int(sample(q, r.params, r.generator)[0])
                    dists[i].append(q[0])
                drafts[i].append(tok)
                feeds[i] = [tok]
        out: list[tuple[list[int], torch.Tensor | None]] = []
        for i in range(len(requests)):
            out.append((drafts[i], torch.stack(dists[i]) if dists[i] else None))
        return out

    @staticmethod
    def rollback(table: BlockTable, valid_tokens: int) -> None:
        """Drop cached drafts the target rejected: keep at most ``valid_tokens`` tokens."""
        if table.length > valid_tokens:
            table.truncate(valid_tokens)


class DraftModelProposer:
    """A drafter model (`ModelDrafter`) on each request's ``draft_table``."""

    kv_copies = 1
    target_features = False

    def __init__(self, drafter: ModelDrafter) -> None:
        self.drafter = drafter

    @staticmethod
    def build(inputs: ProposerInputs) -> DraftModelProposer:
        if inputs.drafter is None:
            raise ValueError("spec.method='draft' needs a drafter model")
        return DraftModelProposer(
            ModelDrafter(
                inputs.drafter, inputs.allocator, inputs.page_size, inputs.target.config.vocab_size
            )
        )

    def propose(self, todo: Sequence[tuple[Request, int]]) -> list[Proposal | None]:
        reqs = []
        for r, k in todo:
            assert r.draft_table is not None
            reqs.append(DraftRequest(r.draft_table, r.tokens, k, r.params, r.generator))
        return [Proposal(d, q) if d else None for d, q in self.drafter.propose(reqs)]

    def accept(self, request: Request, verified: Verified) -> None:
        """The drafter cache keeps the tokens so far and the drafts it fed that the target
        kept (it fed all but the last draft)."""
        assert request.draft_table is not None
        kept = min(len(verified.path), max(verified.drafts - 1, 0))
        ModelDrafter.rollback(request.draft_table, len(request.tokens) + kept)


def truncated_drafter(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A drafter made of the target's first ``num_layers`` blocks, final norm and head
    (early exit). Tensors are shared with the target, not copied."""
    cfg = target.config
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(
            f"spec.draft_layers must be in [1, {cfg.num_hidden_layers}], got {num_layers}"
        )
    with torch.device("meta"):
        drafter = LlamaForCausalLM(replace(cfg, num_hidden_layers=num_layers))
    # Share the modules themselves (packed linear layers have no dense state to copy).
    drafter.tok_embeddings = target.tok_embeddings
    drafter.layers = nn.ModuleList(target.layers[:num_layers])
    drafter.norm = target.norm
    drafter.output = target.output
    return drafter.eval()
