"""Generation engine: continuous batching of decoder requests on a paged KV cache, with
optional speculative decoding (n-gram prompt lookup or a drafter model).

One `GenerationEngine.step()` runs one target forward pass over every running sequence:
new sequences contribute their whole prompt (prefill), others their pending token plus any
drafts (decode / verification). Sequences join between steps when pages allow and leave
when finished, returning their pages.

Example::

    engine = GenerationEngine(model, GenerationConfig(), eos_ids=model.config.eos_token_ids)
    [result] = engine.generate([prompt_ids], SamplingParams(max_tokens=32))
    result.output_ids, result.finish_reason, engine.stats.mean_accepted_length
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rose.kv.allocator import KVCacheConfig, OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.metadata import AttentionMetadata, to_device
from rose.models.llama import DecoderOutput, LlamaForCausalLM
from rose.sampling import FinishReason, SamplingParams, StopChecker, token_probs
from rose.spec.acceptance import accept_deterministic, accept_drafts, accept_greedy
from rose.spec.config import SpecConfig
from rose.spec.draft_model import DraftRequest, ModelDrafter
from rose.spec.mtp import MTPDrafter, MTPDraftRequest, MTPHead, draft_dtype, draft_int4
from rose.spec.ngram import NgramDrafter
from rose.spec.stats import SpecStats
from rose.spec.tree import DraftTree, accept_greedy_tree, tree_metadata

_NO_DRAFT: tuple[list[int], torch.Tensor | None] = ([], None)
_MIN_LOGIT_ROWS = 4
# On the CPU a pass over 2-3 new tokens costs more than one over 4 (SmolLM2-135M, one
# thread: 48.4 and 47.5 ms against 45.4; oneDNN streams a weight slower at so few rows, and
# padding every product instead costs ~600 small ops a pass), so such passes are topped up
# to this many tokens with fillers (`_fillers`).
_MIN_PASS_TOKENS = 4

__all__ = [
    "CapacityError",
    "GenerationConfig",
    "GenerationEngine",
    "GenerationResult",
    "StepOutput",
]


class CapacityError(OutOfPages):
    """A request can never fit the page pool (answer it as RESOURCE_EXHAUSTED / 429)."""


@dataclass(frozen=True)
class GenerationConfig:
    """kv: page pool shared by target and drafter. max_batch: most running sequences.
    spec: speculation method and draft length."""

    kv: KVCacheConfig = KVCacheConfig()
    max_batch: int = 32
    spec: SpecConfig = SpecConfig()

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"generation.max_batch must be >= 1, got {self.max_batch}")


@dataclass(frozen=True)
class StepOutput:
    """Tokens a sequence emitted in one step; finish_reason set on its last step."""

    seq_id: int
    new_ids: list[int]
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class GenerationResult:
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    text: str | None  # decoded output (cut before a stop string) when a detokenizer is set


@dataclass
class _Seq:
    seq_id: int
    prompt_len: int
    tokens: list[int]  # prompt + generated; the target cache holds tokens[: table.length]
    params: SamplingParams
    generator: torch.Generator | None
    stopper: StopChecker
    table: BlockTable
    draft_table: BlockTable | None
    finish_reason: FinishReason | None = None
    new_ids: list[int] = field(default_factory=list)
    # MTP: target features not yet fed to the head (pairs draft_table.length ..)
    features: torch.Tensor | None = None
    # MTP chains drafted on the device right after the last verification (`spec.device_chain`)
    next_drafts: list[int] | None = None
    draft_len: int = 0  # adaptive k: drafts wanted next step (0: not yet set)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def release(self) -> None:
        self.table.release()
        self.features = None
        self.next_drafts = None
        if self.draft_table is not None:
            self.draft_table.release()


class GenerationEngine:
    """Owns the page pool, the target (and drafter) caches and the request queue.

    Not thread-safe: one owner calls `add`, `step` and `abort`.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: GenerationConfig = GenerationConfig(),
        *,
        drafter: LlamaForCausalLM | None = None,
        mtp_head: MTPHead | None = None,
        eos_ids: Sequence[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        if config.spec.method == "draft" and drafter is None:
            raise ValueError("spec.method='draft' needs a drafter model")
        if config.spec.method == "mtp" and mtp_head is None:
            raise ValueError("spec.method='mtp' needs an mtp_head")
        self.model = model
        self.config = config
        self.eos_ids = tuple(eos_ids)
        self.detokenize = detokenize
        self.page_size = config.kv.page_size
        self.allocator = PageAllocator(config.kv.num_pages)
        self.cache = model.new_cache(config.kv.num_pages, config.kv.page_size)
        self.device = self.cache.k.device
        self.vocab_size = model.config.vocab_size
        self.drafter: ModelDrafter | None = None
        self.ngram: NgramDrafter | None = None
        self.mtp: MTPDrafter | None = None
        if config.spec.method == "mtp" and mtp_head is not None:
            setting = config.spec.draft_dtype
            dtype = draft_dtype(setting, mtp_head)
            int4 = draft_int4(setting, mtp_head)
            self.mtp = MTPDrafter(mtp_head, model, self.allocator, self.page_size, dtype, int4)
        elif config.spec.method == "draft" and drafter is not None:
            self.drafter = ModelDrafter(drafter, self.allocator, self.page_size, self.vocab_size)
        elif config.spec.method == "ngram":
            self.ngram = NgramDrafter(config.spec.ngram_max, config.spec.ngram_min)
        self.stats = SpecStats()
        self._ids = itertools.count()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. Raises `CapacityError` when it could never fit."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        worst = len(prompt_ids) + params.max_tokens + self.config.spec.max_fed_drafts
        copies = 2 if self.drafter is not None or self.mtp is not None else 1
        need = copies * -(-worst // self.page_size)
        if need > self.allocator.num_pages:
            raise CapacityError(need, self.allocator.num_free, self.allocator.num_pages)
        seq = _Seq(
            seq_id=next(self._ids),
            prompt_len=len(prompt_ids),
            tokens=list(prompt_ids),
            params=params,
            generator=None if params.greedy else params.generator(self.device),
            stopper=StopChecker(params, self.eos_ids, self.detokenize),
            table=BlockTable(self.allocator, self.page_size),
            draft_table=(
                self.drafter.new_table()
                if self.drafter is not None
                else self.mtp.new_table()
                if self.mtp is not None
                else None
            ),
        )
        self._waiting.append(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> bool:
        """Drop a request (client went away); its pages return to the pool."""
        for q in (self._waiting, self._running):
            for s in q:
                if s.seq_id == seq_id:
                    q.remove(s)
                    s.release()
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one target pass (with speculation), emit tokens."""
        self._admit()
        if not self._running:
            if self._waiting:
                raise CapacityError(1, self.allocator.num_free, self.allocator.num_pages)
            return []
        k_max = self.config.spec.num_draft_tokens
        drafts, trees = self._draft(k_max)
        for s in list(self._running):
            if s not in self._running:
                continue
            need = len(s.tokens) + len(drafts.get(s.seq_id, _NO_DRAFT)[0])
            while True:
                try:
                    s.table.reserve(need)
                    break
                except OutOfPages:
                    victim = self._running[-1]
                    self._preempt(victim)
                    if victim is s:
                        break
        batch = [s for s in self._running]
        if not batch:
            return []
        on_device = self._chain_on_device(batch, drafts)

        t0 = time.perf_counter()
        entries, ids, n_logits, idx, starts, feeds = [], [], [], [], [], []
        tree_rows: list[tuple[int, int, int, DraftTree]] = []
        total = 0
        for b, s in enumerate(batch):
            d = drafts.get(s.seq_id, _NO_DRAFT)[0]
            pending = s.tokens[s.table.length :]
            feed = pending + d
            if s.seq_id in trees:
                tree_rows.append((b, s.table.length, len(pending), trees[s.seq_id]))
            entries.append((s.table, s.table.length, len(feed)))
            feeds.append(feed)
            starts.append(total)
            ids.extend(feed)
            total += len(feed)
            n_logits.append(len(d) + 1)
            idx.extend(range(total - len(d) - 1, total))  # the last len(d) + 1 fed tokens
        passed = list(entries)  # what the pass feeds: entries plus any fillers
        fill = self._fillers(entries[-1], total)
        if fill:  # after the last sequence's feed: attended by nothing real, never kept
            table, cached, fed = entries[-1]
            passed[-1] = (table, cached, fed + fill)
            ids.extend([ids[-1]] * fill)
        meta = tree_metadata(AttentionMetadata.build(passed, device=self.device), tree_rows)
        n_rows = len(idx)
        if self.device.type == "cpu" and 1 < n_rows < _MIN_LOGIT_ROWS:
            # On the CPU 2-3 rows times the big LM head cost more than 4 (MKL runs them
            # row by row; oneDNN's packed kernel is also slowest at 2: 9.8 vs 6.9 ms for
            # SmolLM2's 49152 x 576 head on one thread); duplicate rows, drop them after
            idx += [idx[-1]] * (_MIN_LOGIT_ROWS - n_rows)
        fwd = self.model(
            torch.tensor(ids, device=self.device),
            meta,
            self.cache,
            torch.tensor(idx, device=self.device),
            return_all_hidden=self.mtp.head.config.target_request if self.mtp else False,
        )
        logits = fwd.logits[:n_rows]
        if on_device:
            verify_s = time.perf_counter() - t0
            return self._accept_and_chain(batch, entries, feeds, drafts, n_logits, fwd, verify_s)
        # temperature 0: the target's argmax at every verified position, one sync for all
        argmax = logits.argmax(-1).tolist() if any(s.params.greedy for s in batch) else []
        verify_s = time.perf_counter() - t0

        outputs: list[StepOutput] = []
        off = 0
        any_drafts = False
        for i, (s, (_, cached, fed), n) in enumerate(zip(batch, entries, n_logits, strict=True)):
            d, q = drafts.get(s.seq_id, _NO_DRAFT)
            any_drafts = any_drafts or bool(d)
            tree = trees.get(s.seq_id)
            path: list[int] = []
            if tree is not None:
                path, nxt = accept_greedy_tree(tree, argmax[off : off + n])
                n_acc = len(path)
            elif s.params.greedy:
                n_acc, nxt = accept_greedy(d, argmax[off : off + n])
            else:
                p = token_probs(logits[off : off + n], s.params)  # [n, V]
                dt = torch.tensor([d], dtype=torch.int64, device=self.device)
                if q is None:  # deterministic proposal (n-gram): q is one-hot at the draft
                    res = accept_deterministic(dt, p[None], s.generator)
                else:
                    res = accept_drafts(dt, q[None], p[None], s.generator)
                n_acc, nxt = int(res.num_accepted[0]), int(res.next_token[0])
            off += n
            pending = fed - len(d)
            alternative = False  # the kept path ends in a tree's alternative, off the chain
            if tree is not None:
                alternative = bool(path) and path[-1] != n_acc - 1
                self.stats.record(len(tree.chain), n_acc, alternative=alternative)
                new = [d[j] for j in path] + [nxt]
                if alternative:  # move the alternative's K/V next to the kept chain
                    at, to = cached + pending + path[-1], cached + pending + n_acc - 1
                    src, dst = s.table.slots(at, at + 1), s.table.slots(to, to + 1)
                    self.cache.k[:, dst] = self.cache.k[:, src]
                    self.cache.v[:, dst] = self.cache.v[:, src]
            else:
                if d:
                    self.stats.record(len(d), n_acc)
                    if self.config.spec.adaptive_k:  # longer after a fully kept chain
                        grow = n_acc == len(d)
                        s.draft_len = min(k_max, len(d) + 2) if grow else max(1, len(d) - 1)
                new = d[:n_acc] + [nxt]
            # cache now validly holds everything fed except rejected drafts
            valid = pending + n_acc
            s.table.length = cached + valid
            s.table.truncate(s.table.length)
            if self.drafter is not None and s.draft_table is not None:
                # drafter cache: tokens so far + the drafts it fed (all but the last)
                keep = len(s.tokens) + min(n_acc, max(len(d) - 1, 0))
                ModelDrafter.rollback(s.draft_table, keep)
            if self.mtp is not None and s.draft_table is not None and fwd.all_hidden is not None:
                # head cache: only pairs built from target features stay (refilled below)
                ModelDrafter.rollback(s.draft_table, len(s.tokens) - 1)
                if alternative:  # pending rows, then the kept path's rows
                    kept = [*range(pending), *(pending + j for j in path)]
                    new_feats = fwd.all_hidden[[starts[i] + r for r in kept]]
                else:  # positions cached .. in feed order
                    new_feats = fwd.all_hidden[starts[i] : starts[i] + valid]
                s.features = new_feats if s.features is None else torch.cat([s.features, new_feats])
            outputs.append(self._emit(s, new))
        if any_drafts:
            self.stats.verify_s += verify_s
        self._retire_finished(batch)
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion (continuous batching) and return results in order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        seqs: dict[int, _Seq] = {}
        for s in list(self._waiting):
            if s.seq_id in ids:
                seqs[s.seq_id] = s
        while any(seqs[i].finish_reason is None for i in ids):
            self.step()
        out = []
        for i in ids:
            s = seqs[i]
            text = s.stopper.text
            if text is None and self.detokenize is not None:
                text = self.detokenize(s.output_ids)
            assert s.finish_reason is not None
            out.append(
                GenerationResult(i, s.tokens[: s.prompt_len], s.output_ids, s.finish_reason, text)
            )
        return out

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_batch:
            s = self._waiting[0]
            need = s.table.pages_needed(len(s.tokens) + self.config.spec.max_fed_drafts)
            if self._running and not self.allocator.can_allocate(need):
                return  # backpressure: wait until running sequences free pages
            try:
                s.table.reserve(len(s.tokens))
            except OutOfPages:
                return
            self._running.append(self._waiting.popleft())

    def _preempt(self, s: _Seq) -> None:
        """Out of pages mid-run: free ``s`` and requeue it at the front; it recomputes its
        cache (prompt + tokens so far) when readmitted."""
        self._running.remove(s)
        s.release()
        self._waiting.appendleft(s)

    def _draft(
        self, k_max: int
    ) -> tuple[dict[int, tuple[list[int], torch.Tensor | None]], dict[int, DraftTree]]:
        """Drafts for sequences past prefill, at most ``max_tokens - generated - 1`` each
        (every node of a sequence's draft tree, in feed order, when it has one)."""
        trees: dict[int, DraftTree] = {}
        if self.ngram is None and self.drafter is None and self.mtp is None:
            return {}, trees
        t0 = time.perf_counter()
        todo: list[tuple[_Seq, int]] = []
        for s in self._running:
            if s.table.length != len(s.tokens) - 1:
                continue  # prefill step: the next token is not known yet
            want = (s.draft_len or k_max) if self.config.spec.adaptive_k else k_max
            k = min(want, s.params.max_tokens - len(s.output_ids) - 1)
            if k > 0:
                todo.append((s, k))
        out: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        if self.mtp is not None:  # chains drafted at the end of the last step
            rest = []
            for s, k in todo:
                if s.next_drafts is None:
                    rest.append((s, k))
                elif s.next_drafts[:k]:
                    out[s.seq_id] = (s.next_drafts[:k], None)
            todo = rest
        for s in self._running:
            s.next_drafts = None
        if self.ngram is not None:
            for s, k in todo:
                d = self.ngram.propose(s.tokens, k)
                if d:
                    out[s.seq_id] = (d, None)  # deterministic proposal: q is one-hot
        elif self.drafter is not None and todo:
            reqs = []
            for s, k in todo:
                assert s.draft_table is not None
                reqs.append(DraftRequest(s.draft_table, s.tokens, k, s.params, s.generator))
            for (s, _), (d, q) in zip(todo, self.drafter.propose(reqs), strict=True):
                if d:
                    out[s.seq_id] = (d, q)
        elif self.mtp is not None and todo:
            mreqs, owners = [], []
            for s, k in todo:
                if s.draft_table is None or s.features is None:
                    continue
                mreqs.append(
                    MTPDraftRequest(s.draft_table, s.features, s.tokens, k, s.params, s.generator)
                )
                owners.append((s, s.draft_table.length))
            spec = self.config.spec
            proposals = self.mtp.propose(
                mreqs, spec.tree_widths, spec.tree_nodes, spec.chain_min_prob
            )
            for (s, before), r, (d, q, alts) in zip(owners, mreqs, proposals, strict=True):
                if r.table.length > before:
                    s.features = None  # consumed into the head's cache
                if d and any(alts):
                    tree = DraftTree(d, alts)
                    trees[s.seq_id] = tree
                    out[s.seq_id] = (tree.tokens, q)
                elif d:
                    out[s.seq_id] = (d, q)
        self.stats.draft_s += time.perf_counter() - t0
        return out, trees

    def _fillers(self, last: tuple[BlockTable, int, int], total: int) -> int:
        """Filler tokens to append to a pass of ``total`` new tokens (`_MIN_PASS_TOKENS`),
        fed after the last sequence's tokens (``last``: its table, cached and fed counts):
        causal attention keeps them out of every real token's view, their K/V land in its
        cache past the tokens the step keeps (the table's length never covers them; later
        tokens overwrite them), and no logits or features are read from them. 0 off the
        CPU, for passes big enough, or when the table has no room for them."""
        if self.device.type != "cpu" or not 1 < total < _MIN_PASS_TOKENS:
            return 0
        table, cached, fed = last
        fill = _MIN_PASS_TOKENS - total
        try:
            table.reserve(cached + fed + fill)
        except OutOfPages:
            return 0
        return fill

    def _chain_on_device(
        self, batch: list[_Seq], drafts: dict[int, tuple[list[int], torch.Tensor | None]]
    ) -> bool:
        """Whether this step accepts on the device and drafts the next MTP chains before
        anything is read back (`spec.device_chain`): every sequence greedy, plain chains,
        the head's cache holding exactly the pairs before the pass, and room reserved in
        every head table for the chain (`MTPDrafter.chain_room`)."""
        spec = self.config.spec
        wanted = spec.device_chain == "on" or (
            spec.device_chain == "auto" and self.device.type != "cpu"
        )
        if (
            self.mtp is None
            or not wanted
            or spec.tree_widths
            or spec.tree_nodes
            or spec.adaptive_k
            or not all(s.params.greedy for s in batch)
        ):
            return False
        for s in batch:
            head = s.draft_table
            if head is None or s.features is not None or head.length < s.table.length:
                return False  # features still to feed: the general path feeds them
        for s in batch:
            head = s.draft_table
            assert head is not None
            ModelDrafter.rollback(head, s.table.length)  # the chain drafted for this pass
            fed = len(s.tokens) - s.table.length + len(drafts.get(s.seq_id, _NO_DRAFT)[0])
            try:
                head.reserve(self.mtp.chain_room(s.table.length, fed, spec.num_draft_tokens))
            except OutOfPages:
                return False
        return True

    def _accept_and_chain(
        self,
        batch: list[_Seq],
        entries: list[tuple[BlockTable, int, int]],
        feeds: list[list[int]],
        drafts: dict[int, tuple[list[int], torch.Tensor | None]],
        n_logits: list[int],
        fwd: DecoderOutput,
        verify_s: float,
    ) -> list[StepOutput]:
        """Greedy acceptance and the next MTP chains on the device (`_outcome_on_device`),
        one read back, then the host's bookkeeping."""
        assert self.mtp is not None
        k = self.config.spec.num_draft_tokens
        b = len(batch)
        chains = [drafts.get(s.seq_id, _NO_DRAFT)[0] for s in batch]
        t1 = time.perf_counter()
        back = self._outcome_on_device(batch, entries, feeds, chains, n_logits, fwd).tolist()
        self.stats.draft_s += time.perf_counter() - t1

        outputs: list[StepOutput] = []
        for i, (s, (_, cached, fed), d) in enumerate(zip(batch, entries, chains, strict=True)):
            acc, tok = back[i], back[b + i]
            if d:
                self.stats.record(len(d), acc)
            valid = fed - len(d) + acc
            s.table.length = cached + valid
            s.table.truncate(s.table.length)
            head = s.draft_table
            assert head is not None
            head.length = self.mtp.chain_room(cached, fed, k)
            head.truncate(cached + valid)  # pairs built from target features only
            s.next_drafts = [t for t in back[2 * b + i * k : 2 * b + (i + 1) * k] if t >= 0]
            outputs.append(self._emit(s, d[:acc] + [tok]))
        if any(chains):
            self.stats.verify_s += verify_s
        self._retire_finished(batch)
        return outputs

    def _outcome_on_device(
        self,
        batch: list[_Seq],
        entries: list[tuple[BlockTable, int, int]],
        feeds: list[list[int]],
        chains: list[list[int]],
        n_logits: list[int],
        fwd: DecoderOutput,
    ) -> torch.Tensor:
        """Accepted counts ``[B]``, bonus tokens ``[B]`` and the next drafts ``[B * k]`` (-1
        past where a chain stopped, `SpecConfig.chain_min_prob`), side by side on the
        device, from a verification pass: nothing is read back and no copy
        waits for the device, so on a GPU the head's steps queue right behind the pass
        (`MTPDrafter.chain_after_verify`)."""
        assert self.mtp is not None and fwd.all_hidden is not None
        dev = self.device
        width = max(1, max(len(d) for d in chains))
        # per sequence: the logits rows checking its drafts, then its bonus row (the last
        # row repeated past a short chain), and its drafts (-1, no token, past them)
        at, want, off = [], [], 0
        for d, n in zip(chains, n_logits, strict=True):
            at.append([off + j for j in range(n)] + [off + n - 1] * (width + 1 - n))
            want.append(list(d) + [-1] * (width - len(d)))
            off += n
        pred = fwd.logits[:off].argmax(-1)[to_device(torch.tensor(at), dev)]  # [B, width + 1]
        hit = pred[:, :width] == to_device(torch.tensor(want), dev)  # [B, width]
        n_acc = hit.to(torch.int64).cumprod(1).sum(1)  # [B] leading drafts the target kept
        bonus = pred.gather(1, n_acc[:, None]).squeeze(1)  # [B] the target's next token
        pending = torch.tensor([len(f) - len(d) for f, d in zip(feeds, chains, strict=True)])
        last = to_device(pending, dev) - 1 + n_acc  # [B] row of the last verified token
        tables = [s.draft_table for s in batch]
        assert all(t is not None for t in tables)
        nxt = self.mtp.chain_after_verify(
            tables,  # type: ignore[arg-type]
            [c for _, c, _ in entries],
            feeds,
            fwd.all_hidden[: sum(len(f) for f in feeds)],  # without any fillers
            last,
            bonus,
            self.config.spec.num_draft_tokens,
            self.config.spec.chain_min_prob,
        )
        return torch.cat([n_acc, bonus, nxt.flatten()])

    def _emit(self, s: _Seq, new: list[int]) -> StepOutput:
        """Append ``new`` (`_append`) and hand out what ``s`` emitted this step."""
        self._append(s, new)
        out = StepOutput(s.seq_id, s.new_ids, s.finish_reason)
        s.new_ids = []
        return out

    def _retire_finished(self, batch: list[_Seq]) -> None:
        """Finished sequences leave the running set and return their pages."""
        for s in batch:
            if s.finish_reason is not None:
                self._running.remove(s)
                s.release()

    def _append(self, s: _Seq, new: list[int]) -> None:
        """Append tokens one at a time, stopping at EOS / stop string / max_tokens: nothing
        after the finishing token of an accepted chain is emitted."""
        for tok in new:
            if s.stopper.is_stop_token(tok):
                s.finish_reason = "stop"
                return
            s.tokens.append(tok)
            s.new_ids.append(tok)
            reason = s.stopper.check(s.output_ids)
            if reason is not None:
                s.finish_reason = reason
                return
