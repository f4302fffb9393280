"""Scheduler for the generation engine: which requests run a pass, with how many tokens.

No tensor work here: a request is its tokens (prompt + generated), how many of them the
target cache holds (``table.length``, the computed tokens), how many more it may produce
(``params.max_tokens``) and the drafts proposed for its next pass. Each step the scheduler

1. admits waiting requests while the batch has room and their prompt's pages are free
   (`admit`; the first request always gets in when its prompt fits, so the pool never idles),
   starting each on the cached pages of its prompt's longest cached prefix when the
   allocator has a prefix cache (`rose.kv.prefix`);
2. sizes every decoding request's drafts (`draft_room_for`; the engine asks its proposer
   for them, `rose.spec.proposer`);
3. fits the pass to the per-step token budget (decodes' own tokens first, then drafts and
   prefill chunks in running order) and reserves the pages each request's share writes,
   preempting from the back of the running list when the pool runs dry (a preempted
   request frees every page, its proposer state included, and is recomputed from its
   tokens when readmitted) (`schedule`);
4. after the pass, registers the pages the pass filled in the prefix cache and retires
   finished requests (`retire`).

Invariants: a page is written by at most one table, the only one holding it unless it is a
registered page, which nobody writes (`rose.kv.allocator`, `rose.kv.prefix`); a running request
holds ``tokens[: table.length]`` in the target cache and ``table.length < len(tokens)``
between steps; drafts only ride on a request whose cache lacks just its last token (a
decode), so a chunk that stops short of the end of its request's tokens has none.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rose.kv.allocator import OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable

if TYPE_CHECKING:
    import torch

    from rose.grammar import GrammarState
    from rose.sampling import FinishReason, SamplingParams, StopChecker
    from rose.spec.proposer import Proposal

__all__ = ["CapacityError", "Request", "Scheduled", "Scheduler", "draft_room"]

PROMPT_LOGPROBS_CHUNK = 512
"""Most prompt tokens one pass feeds of a request that scores its prompt: each fed token
gets a logits row (``[tokens, vocabulary]`` fp32, 100 MB at 512 x 49,152), so a long prompt
is prefilled in chunks of this many."""


class CapacityError(OutOfPages):
    """A request can never fit the page pool (answer it as RESOURCE_EXHAUSTED / 429)."""


@dataclass(eq=False)
class Request:
    """One generation request.

    tokens: prompt + generated; the target cache holds ``tokens[: table.length]``.
    draft_table: the proposer's own cache for this request (pages from the same pool), when
        the proposer keeps one (`Proposer.kv_copies`).
    proposal: drafts for this step's pass (None: a pass without drafts).
    draft_len: adaptive k, drafts wanted next step (0: not yet set).
    spec_state: whatever the proposer keeps per request (None again after preemption).
    prompt_scored: prompt positions whose next token's logprob is computed, when the request
        asked for prompt logprobs (``params.prompt_logprobs``): the pass that feeds position
        ``t`` scores ``tokens[t + 1]``, for ``t`` in ``0 .. prompt_len - 2``.
        prompt_logprobs: those not yet emitted (they go out with the first emitted tokens).
    params / generator / stopper / grammar / new_ids / finish_reason: carried for the engine.
    """

    seq_id: int
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stopper: StopChecker
    table: BlockTable
    draft_table: BlockTable | None
    proposal: Proposal | None = None
    draft_len: int = 0
    spec_state: Any = None
    grammar: GrammarState | None = None  # response_format's state (`rose.grammar`)
    finish_reason: FinishReason | None = None
    new_ids: list[int] = field(default_factory=list)
    prompt_scored: int = 0
    prompt_logprobs: list[Any] = field(default_factory=list)  # rose.sampling.TokenLogprob

    @property
    def unscored(self) -> range:
        """Prompt positions still to score (empty unless prompt logprobs were asked for)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(self.prompt_scored, self.prompt_len - 1)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def decoding(self) -> bool:
        """The cache lacks only the last token: the next pass may verify drafts after it."""
        return self.table.length == len(self.tokens) - 1

    def release(self) -> None:
        """Give every page back and forget this step's drafts and the proposer's state."""
        self.table.release()
        if self.draft_table is not None:
            self.draft_table.release()
        self.proposal = None
        self.spec_state = None


@dataclass(frozen=True, eq=False)
class Scheduled:
    """A request's share of one pass: ``pending`` of its tokens from position ``cached``
    (``tokens[cached : cached + pending]``), then its proposal's drafts when it has one."""

    request: Request
    cached: int
    pending: int

    @property
    def drafts(self) -> list[int]:
        p = self.request.proposal
        return [] if p is None else p.tokens

    @property
    def ids(self) -> list[int]:
        """Every token fed: the pending ones, then the drafts."""
        return self.request.tokens[self.cached : self.cached + self.pending] + self.drafts

    @property
    def emits(self) -> bool:
        """The pass reaches the request's last token, so it yields its next one."""
        return self.cached + self.pending == len(self.request.tokens)


def draft_room(draft_len: int, k_max: int, adaptive: bool, max_tokens: int, generated: int) -> int:
    """Drafts a decoding sequence may verify in one pass: ``k_max``, or its adaptive
    ``draft_len`` once set, and never past ``max_tokens - generated - 1`` (the pass emits
    one token beyond them)."""
    want = (draft_len or k_max) if adaptive else k_max
    return max(0, min(want, max_tokens - generated - 1))


class Scheduler:
    """Waiting and running requests on one page pool.

    max_batch: most running requests. max_step_tokens: tokens one pass may feed in all
    (pending tokens and drafts; 0: no limit, else at least max_batch): each decoding
    request's pending token is counted first, then requests take the rest in running order,
    drafts that do not fit are dropped (the request still decodes), and a prefill gets a
    chunk of what is left (none: it sits the step out; only prefills ever do, so no request
    with drafts goes unverified). draft_room: most drafts one pass feeds per request (kept free
    at admission). kv_copies: caches per request besides the target's (a proposer's).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        *,
        max_batch: int,
        max_step_tokens: int,
        draft_room: int,
        kv_copies: int,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.draft_room = draft_room
        self.kv_copies = kv_copies
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ requests
    def new_tables(self) -> tuple[BlockTable, BlockTable | None]:
        """Empty target and proposer tables for a new request."""
        draft = BlockTable(self.allocator, self.page_size) if self.kv_copies else None
        return BlockTable(self.allocator, self.page_size), draft

    @property
    def max_sequence_tokens(self) -> int:
        """Most tokens (prompt + generated) one request can ever hold (`add`'s rule)."""
        pages = self.allocator.num_pages // (1 + self.kv_copies)
        return pages * self.page_size - self.draft_room

    def add(self, request: Request) -> None:
        """Queue ``request``; raises `CapacityError` when it could never fit the pool, even
        alone (its prompt, every token it may generate and a pass of drafts, in each cache)."""
        worst = request.prompt_len + request.params.max_tokens + self.draft_room
        need = (1 + self.kv_copies) * -(-worst // self.page_size)
        if need > self.allocator.num_pages:
            raise CapacityError(need, self.allocator.num_free, self.allocator.num_pages)
        self.waiting.append(request)

    def abort(self, seq_id: int) -> bool:
        for q in (self.waiting, self.running):
            for r in q:
                if r.seq_id == seq_id:
                    q.remove(r)
                    r.release()
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------------- step
    def admit(self) -> None:
        """Move waiting requests to running while the batch has room and pages allow (a
        running set keeps room for one pass of drafts free: backpressure)."""
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            prefix = self.allocator.prefix
            if prefix is not None:  # at least the last token is computed: it gives the logits
                # (and every prompt position still to score: their logits are wanted)
                todo = r.unscored
                limit = min(len(r.tokens) - 1, todo.start) if todo else len(r.tokens) - 1
                r.table.adopt(*prefix.lookup(r.tokens, limit))
            need = r.table.pages_needed(len(r.tokens) + self.draft_room)
            if self.running and not self.allocator.can_allocate(need):
                r.table.release()
                return
            try:
                r.table.reserve(len(r.tokens))
            except OutOfPages:
                r.table.release()
                return
            if prefix is not None:
                prefix.stats.queried_tokens += len(r.tokens)
                prefix.stats.hit_tokens += r.table.length
            self.running.append(self.waiting.popleft())

    def draft_room_for(self, r: Request, k_max: int, adaptive: bool) -> int:
        """Drafts ``r`` may verify in this step's pass: 0 unless it is decoding, and never
        past ``max_tokens - generated - 1`` (the pass emits one token beyond them)."""
        if not r.decoding:
            return 0
        return draft_room(r.draft_len, k_max, adaptive, r.params.max_tokens, len(r.output_ids))

    def schedule(self) -> list[Scheduled]:
        """Reserve the pages of every running request's pass (preempting from the back when
        the pool runs dry) and fit the pass to the step's token budget: every decoding
        request's pending token first, then drafts and prefill chunks in running order."""
        left = None
        if self.max_step_tokens:  # >= max_batch: the decodes' own tokens always fit
            left = self.max_step_tokens - sum(r.decoding for r in self.running)
        out: list[Scheduled] = []
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted for an earlier request
            cached, pending = r.table.length, len(r.tokens) - r.table.length
            if r.unscored and not r.decoding:  # its chunk's rows all get logits: bound them
                pending = min(pending, PROMPT_LOGPROBS_CHUNK)
            drafts = len(r.proposal.tokens) if r.proposal is not None else 0
            if left is not None:
                if r.decoding:  # its pending token is counted already
                    if drafts > left:
                        r.proposal, drafts = None, 0
                    left -= drafts
                else:  # a prefill: a chunk of what is left, or nothing this step
                    pending = min(pending, left)
                    left -= pending
                    if pending == 0:
                        continue
            if self._reserve(r, cached + pending + drafts):
                out.append(Scheduled(r, cached, pending))
        return out  # a victim is always at or after the request it made room for

    def retire(self, batch: Sequence[Scheduled]) -> None:
        """Register the pages the pass filled (`BlockTable.commit`); finished requests
        leave the running set and return their pages (registered ones stay cached)."""
        for s in batch:
            r = s.request
            r.table.commit(r.tokens)
            if r.finish_reason is not None:
                self.running.remove(r)
                r.release()

    # ------------------------------------------------------------------ internals
    def _reserve(self, r: Request, tokens: int) -> bool:
        """Room for ``tokens`` in ``r``'s table, preempting the last running requests for
        it; False when ``r`` itself had to go."""
        while True:
            try:
                r.table.reserve(tokens)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    return False

    def _preempt(self, r: Request) -> None:
        """Free ``r`` and requeue it at the front; it recomputes its cache (prompt + tokens
        so far) when readmitted."""
        self.running.remove(r)
        r.release()
        self.waiting.appendleft(r)
