"""Generation engine: continuous batching of decoder requests on a paged KV cache, with
optional speculative decoding (any `rose.spec.proposer.Proposer`: n-gram prompt lookup, a
drafter model, an MTP head's chains or trees, or one registered by the caller).

One `GenerationEngine.step()`:

1. the scheduler (`rose.scheduler`, no tensor work) admits waiting requests and sizes each
   decoding request's drafts;
2. the proposer drafts them;
3. the scheduler reserves every request's pages for the pass (preempting when the pool runs
   dry) and cuts prefills to the step's token budget;
4. the runner (`rose.runner`) runs one target pass over the chunks: prefills, decodes and
   verifications (chains or trees);
5. acceptance (`rose.spec.acceptance.accept`, exact) keeps drafts, the target tables are cut
   to the kept tokens, the proposer rolls its own state back (`Proposer.accept`) and the new
   tokens are emitted; finished requests leave and return their pages.

Example::

    engine = GenerationEngine(model, GenerationConfig(), eos_ids=model.config.eos_token_ids)
    [result] = engine.generate([prompt_ids], SamplingParams(max_tokens=32))
    result.output_ids, result.finish_reason, engine.stats.mean_accepted_length
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rose.grammar import GrammarError, Grammars, GrammarState
from rose.kv.allocator import KVCacheConfig, PageAllocator
from rose.kv.prefix import PrefixCache
from rose.models.llama import LlamaForCausalLM
from rose.runner import Chunk, ModelRunner, PassOutput
from rose.sampling import (
    FinishReason,
    SamplingParams,
    StopChecker,
    TokenLogprob,
    adjust_logits,
    token_logprobs,
)
from rose.scheduler import CapacityError, Request, Scheduled, Scheduler
from rose.spec.acceptance import accept
from rose.spec.config import SpecConfig
from rose.spec.mtp import MTPHead
from rose.spec.proposer import (
    DeviceChainProposer,
    Proposal,
    ProposerInputs,
    Verified,
    build_proposer,
)
from rose.spec.stats import SpecStats

__all__ = [
    "CapacityError",
    "GenerationConfig",
    "GenerationEngine",
    "GenerationFailed",
    "GenerationResult",
    "StepOutput",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """kv: page pool shared by target and proposer. max_batch: most running sequences.
    max_step_tokens: most tokens one pass feeds (prefills are chunked to fit, drafts dropped;
    0: no limit, else at least max_batch so that every decode fits).
    spec: speculation method and draft length. prefix_cache: reuse the KV pages of prompt
    prefixes seen before (`rose.kv.prefix`); on only when the proposer keeps no state of its
    own per prompt token (no cache, no target features: none or n-gram), see
    `GenerationEngine.prefix_cache_off_reason`."""

    kv: KVCacheConfig = KVCacheConfig()
    max_batch: int = 32
    max_step_tokens: int = 0
    spec: SpecConfig = SpecConfig()
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"generation.max_batch must be >= 1, got {self.max_batch}")
        if self.max_step_tokens and not self.max_step_tokens >= self.max_batch:
            raise ValueError(
                f"generation.max_step_tokens must be 0 (no limit) or >= max_batch "
                f"({self.max_batch}), got {self.max_step_tokens}"
            )


@dataclass(frozen=True)
class StepOutput:
    """Tokens a sequence emitted in one step; finish_reason set on its last step.
    logprobs: one per new id when the request asked (`SamplingParams.logprobs`), else None.
    prompt_logprobs: on a sequence's first output when it asked
    (`SamplingParams.prompt_logprobs`): one per prompt token after the first, else None.
    error: why the sequence failed in this step on its own (its draw raised); it is dropped
    from the engine, and the other sequences of the step go on (None: no failure)."""

    seq_id: int
    new_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class GenerationFailed(RuntimeError):
    """`GenerationEngine.generate`: a request failed on its own (`StepOutput.error`)."""


@dataclass(frozen=True)
class GenerationResult:
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    text: str | None  # decoded output (cut before a stop string) when a detokenizer is set
    logprobs: list[TokenLogprob] | None = None  # one per output id when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt id after the first


class GenerationEngine:
    """Owns the page pool, the scheduler, the runner (target cache) and the proposer.

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
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.eos_ids = tuple(eos_ids)
        self.detokenize = detokenize
        self.grammars = grammars
        self.page_size = config.kv.page_size
        self.allocator = PageAllocator(config.kv.num_pages)
        self.proposer = build_proposer(
            ProposerInputs(config.spec, model, self.allocator, self.page_size, drafter, mtp_head)
        )
        self.prefix_cache_off_reason = self._prefix_cache_off_reason()
        if self.prefix_cache_off_reason is None:  # before any page is handed out
            self.allocator.prefix = PrefixCache(self.page_size)
        self.runner = ModelRunner(model, config.kv.num_pages, self.page_size)
        self.device = self.runner.device
        self.scheduler = Scheduler(
            self.allocator,
            self.page_size,
            max_batch=config.max_batch,
            max_step_tokens=config.max_step_tokens,
            draft_room=config.spec.max_fed_drafts,
            kv_copies=self.proposer.kv_copies if self.proposer is not None else 0,
        )
        self.stats = SpecStats()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def add(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id. Raises `CapacityError` when it could never fit."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        grammar = None
        if params.response_format is not None:
            if self.grammars is None:
                raise ValueError("sampling.response_format: this engine was built without grammars")
            try:
                grammar = self.grammars.state(params.response_format)
            except GrammarError as error:
                raise GrammarError(f"sampling.response_format.{error}") from None
        table, draft_table = self.scheduler.new_tables()
        r = Request(
            seq_id=next(self._ids),
            prompt_len=len(prompt_ids),
            tokens=list(prompt_ids),
            params=params,
            generator=None if params.greedy else params.generator(self.device),
            stopper=StopChecker(params, self.eos_ids, self.detokenize),
            table=table,
            draft_table=draft_table,
            grammar=grammar,
        )
        self.scheduler.add(r)
        return r.seq_id

    def abort(self, seq_id: int) -> bool:
        """Drop a request (client went away); its pages return to the pool."""
        return self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def max_sequence_tokens(self) -> int:
        """Most tokens (prompt + generated) one sequence can ever hold in the page pool, by
        the worst-case admission rule (room for a pass of drafts, the proposer's cache)."""
        return self.scheduler.max_sequence_tokens

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.allocator.prefix

    def _prefix_cache_off_reason(self) -> str | None:
        """Why this engine runs without a prefix cache (None: it has one)."""
        if not self.config.prefix_cache:
            return "turned off"
        p = self.proposer
        if p is not None and (p.kv_copies or p.target_features):
            # its cache / features of an adopted prefix were never computed
            return f"--spec {self.config.spec.method} keeps per-token state of its own"
        return None

    # ---------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one target pass (with speculation), emit tokens."""
        sched = self.scheduler
        sched.admit()
        if not sched.running:
            if sched.waiting:
                raise CapacityError(1, self.allocator.num_free, self.allocator.num_pages)
            return []
        self._propose()
        batch = sched.schedule()
        if not batch:
            return []
        p = self.proposer
        # greedy chains accepted on the device and the next ones drafted right after the pass
        # (not with a grammar: its masks are made on the host, before acceptance; nor when a
        # request wants logprobs: they read the verified rows, which stay on the device)
        constrained = any(s.request.grammar is not None for s in batch)
        # (nor with penalties or a logit bias: they follow each verified row's tokens, on
        # the host too)
        adjusted = any(s.request.params.adjusts_logits for s in batch)
        scored = [
            i for i, s in enumerate(batch) if s.emits and s.request.params.logprobs is not None
        ]
        chain = (
            p
            if isinstance(p, DeviceChainProposer)
            and not constrained
            and not adjusted
            and not scored
            and p.chains_on_device(batch)
            else None
        )
        chunks = [
            Chunk(
                s.request.table,
                s.cached,
                s.ids,
                len(s.drafts) + 1 if s.emits else 0,
                None if s.request.proposal is None else s.request.proposal.tree,
                _scored(s),
            )
            for s in batch
        ]
        t0 = time.perf_counter()
        out = self.runner.forward(chunks, p.target_features if p is not None else False)
        failed: dict[int, str] = {}  # seq_id -> why its draw failed (it alone)
        raw = out.logits  # what logprobs read: the model's own, after a grammar's mask
        if chain is not None:
            verify_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            back = self._outcome_on_device(chain, batch, out).tolist()  # the step's one read
            self.stats.draft_s += time.perf_counter() - t1
            outcomes = [(list(range(n)), tok) for n, tok in chain.settle(batch, back)]
        else:
            if constrained:
                self._mask(batch, out)
            if adjusted and scored:  # not what penalties and bias make of them
                raw = out.logits.clone()
            if adjusted:
                self._adjust(batch, out)
            # temperature 0: the target's argmax at every verified row, one sync for all
            greedy = any(s.request.params.greedy for s in batch)
            argmax = out.logits.argmax(-1).tolist() if greedy else []
            verify_s = time.perf_counter() - t0
            outcomes, failed = self._accept_each(batch, out, argmax)
        logprobs = self._logprobs(batch, out, outcomes, scored, raw) if scored else {}
        if out.scored is not None:
            self._score_prompts(batch, out)
        outputs: list[StepOutput] = []
        for i, (s, outcome) in enumerate(zip(batch, outcomes, strict=True)):
            if s.request.seq_id in failed:
                continue  # dropped below, whatever its state
            path = [] if outcome is None else self._until_stop(s.request, outcome[0])
            self._keep(s, path, emits=outcome is not None)
            if p is not None and chain is None:  # on the device, `settle` did this
                p.accept(s.request, self._verified(s, path, out, i))
            if outcome is not None:
                outputs.append(self._emit(s.request, outcome, logprobs.get(i)))
        if any(s.drafts for s in batch):
            self.stats.verify_s += verify_s
        sched.retire(batch)
        for seq_id, error in failed.items():
            sched.abort(seq_id)
            outputs.append(StepOutput(seq_id, [], None, error=error))
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts to completion (continuous batching) and return results in order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        reqs = {r.seq_id: r for r in self.scheduler.waiting if r.seq_id in ids}
        logprobs: dict[int, list[TokenLogprob]] = {
            i: [] for i in ids if reqs[i].params.logprobs is not None
        }
        prompt_logprobs: dict[int, list[TokenLogprob]] = {
            i: [] for i in ids if reqs[i].params.prompt_logprobs is not None
        }
        while any(reqs[i].finish_reason is None for i in ids):
            for o in self.step():
                if o.error is not None and o.seq_id in reqs:
                    raise GenerationFailed(f"sequence {o.seq_id}: {o.error}")
                if o.logprobs is not None and o.seq_id in logprobs:
                    logprobs[o.seq_id].extend(o.logprobs)
                if o.prompt_logprobs is not None and o.seq_id in prompt_logprobs:
                    prompt_logprobs[o.seq_id].extend(o.prompt_logprobs)
        out = []
        for i in ids:
            r = reqs[i]
            text = r.stopper.text
            if text is None and self.detokenize is not None:
                text = self.detokenize(r.output_ids)
            assert r.finish_reason is not None
            out.append(
                GenerationResult(
                    i,
                    r.tokens[: r.prompt_len],
                    r.output_ids,
                    r.finish_reason,
                    text,
                    logprobs.get(i),
                    prompt_logprobs.get(i),
                )
            )
        return out

    # ------------------------------------------------------------------ internals
    def _propose(self) -> None:
        """This step's drafts for every decoding request (`Scheduler.draft_room_for`)."""
        for r in self.scheduler.running:
            r.proposal = None
        if self.proposer is None:
            return
        spec = self.config.spec
        todo = []
        for r in self.scheduler.running:
            k = self.scheduler.draft_room_for(r, spec.max_drafts, spec.adaptive_k)
            if k > 0:
                todo.append((r, k))
        if not todo:
            return
        t0 = time.perf_counter()
        for (r, _), proposal in zip(todo, self.proposer.propose(todo), strict=True):
            if r.grammar is not None and proposal is not None:
                proposal = self._constrained(r.grammar, proposal)
            if r.params.adjusts_logits and proposal is not None and proposal.tree is not None:
                proposal = None  # a tree's rows follow different paths: chains only
            r.proposal = proposal
        self.stats.draft_s += time.perf_counter() - t0

    @staticmethod
    def _constrained(grammar: GrammarState, proposal: Proposal) -> Proposal | None:
        """A constrained request's proposal, masked too: cut before its first draft the
        grammar forbids (the target could never accept it), None when nothing is left. A
        draft tree's rows would each need their own path's mask: constrained requests
        verify chains only (a dropped proposal is one every proposer already handles)."""
        if proposal.tree is not None:
            return None
        n = grammar.allowed_drafts(proposal.tokens)
        if n == len(proposal.tokens):
            return proposal
        if n == 0:
            return None
        q = None if proposal.q is None else proposal.q[:n]
        return Proposal(proposal.tokens[:n], q)

    @staticmethod
    def _adjust(batch: list[Scheduled], out: PassOutput) -> None:
        """Apply, in place, every emitting request's logit bias, min_tokens and penalties
        (`rose.sampling.adjust_logits`) to its logits rows, each row after the tokens
        generated so far and the drafts before it."""
        for i, s in enumerate(batch):
            r = s.request
            if r.params.adjusts_logits and s.emits:
                row = out.rows[i]
                rows = out.logits[row : row + len(s.drafts) + 1]
                adjust_logits(
                    rows,
                    r.output_ids,
                    s.drafts,
                    r.params,
                    prompt=r.tokens[: r.prompt_len],
                    stop_ids=r.stopper.stop_ids,
                )

    @staticmethod
    def _mask(batch: list[Scheduled], out: PassOutput) -> None:
        """Mask, in place, the logits rows of every constrained request that emits: each row
        to what its grammar allows after the drafts before it (`GrammarState.mask_rows`), so
        acceptance and sampling see the constrained distribution."""
        for i, s in enumerate(batch):
            grammar = s.request.grammar
            if grammar is not None and s.emits:
                row = out.rows[i]
                grammar.mask_rows(out.logits[row : row + len(s.drafts) + 1], s.drafts)

    def _accept_each(
        self, batch: list[Scheduled], out: PassOutput, argmax: list[int]
    ) -> tuple[list[tuple[list[int], int] | None], dict[int, str]]:
        """`_accept` for each request of the batch on its own: one whose draw raises (its
        sampling parameters, say) is reported by seq_id, and its neighbours' outcomes
        stand."""
        outcomes: list[tuple[list[int], int] | None] = []
        failed: dict[int, str] = {}
        for i, s in enumerate(batch):
            try:
                outcomes.append(self._accept(s, out, argmax, i))
            except Exception as error:  # noqa: BLE001 - this request fails, not the step
                log.exception("rose: sequence %d failed its draw", s.request.seq_id)
                failed[s.request.seq_id] = f"{type(error).__name__}: {error}"
                outcomes.append(None)
        return outcomes, failed

    def _accept(
        self, s: Scheduled, out: PassOutput, argmax: list[int], i: int
    ) -> tuple[list[int], int] | None:
        """Kept draft indices and the next token of ``s`` (None: a prefill chunk that
        stops short of the prompt's end yields nothing)."""
        if not s.emits:
            return None
        r = s.request
        n = len(s.drafts) + 1
        row = out.rows[i]
        return accept(
            r.proposal, out.logits[row : row + n], argmax[row : row + n], r.params, r.generator
        )

    @staticmethod
    def _logprobs(
        batch: list[Scheduled],
        out: PassOutput,
        outcomes: list[tuple[list[int], int] | None],
        scored: list[int],
        logits: torch.Tensor,
    ) -> dict[int, list[TokenLogprob]]:
        """Log probabilities (`rose.sampling.token_logprobs`, over ``logits``: the pass's
        rows before penalties and bias) of every token the requests
        at ``scored`` (batch indices) may emit this step: the kept drafts then the next
        token, each from the target's row that produced it (a draft the target accepted
        gets the target's logprob, not the drafter's). Root row 0 (the last pending
        token) produced the first; draft node ``j`` sits at row ``1 + j`` and produced the
        token after it on the path. One gather and one top-k for the whole step."""
        rows: list[int] = []
        chosen: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (batch index, first, count) in rows
        for i in scored:
            outcome = outcomes[i]
            if outcome is None:
                continue
            path, nxt = outcome
            drafts = batch[i].drafts
            base = out.rows[i]
            spans.append((i, len(rows), len(path) + 1))
            rows += [base] + [base + 1 + j for j in path]
            chosen += [drafts[j] for j in path] + [nxt]
        if not rows:
            return {}
        top = max(batch[i].request.params.logprobs or 0 for i, _, _ in spans)
        index = torch.tensor(rows, dtype=torch.int64, device=out.logits.device)
        scores = token_logprobs(logits.index_select(0, index), chosen, top)
        result = {}
        for i, first, count in spans:
            k = batch[i].request.params.logprobs or 0
            result[i] = [
                TokenLogprob(t.logprob, t.top_ids[:k], t.top_logprobs[:k])
                for t in scores[first : first + count]
            ]
        return result

    @staticmethod
    def _score_prompts(batch: list[Scheduled], out: PassOutput) -> None:
        """Log probabilities of the prompt tokens this pass scored (`_scored`), kept on each
        request until its first output carries them; one top-k for the whole step."""
        assert out.scored is not None
        chosen: list[int] = []
        spans: list[tuple[Scheduled, range]] = []
        for s in batch:
            positions = _scored(s)
            if positions:
                first = s.cached + positions.start
                spans.append((s, range(first, first + len(positions))))
                chosen += s.request.tokens[first + 1 : first + 1 + len(positions)]
        top = max(s.request.params.prompt_logprobs or 0 for s, _ in spans)
        scores = token_logprobs(out.scored, chosen, top)
        at = 0
        for s, positions in spans:
            r, k = s.request, s.request.params.prompt_logprobs or 0
            r.prompt_logprobs += [
                TokenLogprob(t.logprob, t.top_ids[:k], t.top_logprobs[:k])
                for t in scores[at : at + len(positions)]
            ]
            r.prompt_scored = positions.stop
            at += len(positions)

    @staticmethod
    def _until_stop(r: Request, path: list[int]) -> list[int]:
        """``path`` up to and with its first draft that is a stop token (EOS): the target
        also verifies drafts past it, but the request ends there, so those are not kept."""
        drafts = [] if r.proposal is None else r.proposal.tokens
        for j, node in enumerate(path):
            if r.stopper.is_stop_token(drafts[node]):
                return path[: j + 1]
        return path

    def _keep(self, s: Scheduled, path: list[int], emits: bool) -> None:
        """Record the step and cut ``s``'s target table to the tokens the pass kept (its
        pending tokens and the drafts at ``path``), moving a tree's kept alternative next
        to the kept chain."""
        r = s.request
        proposal = r.proposal
        if proposal is not None and proposal.tree is not None:
            tree = proposal.tree
            alternative = bool(path) and path[-1] != len(path) - 1
            self.stats.record(len(tree.chain), len(path), alternative=alternative)
            if alternative:  # its K/V go where the kept path's last token sits
                root = s.cached + s.pending
                self.runner.move_kv(r.table, root + path[-1], root + len(path) - 1)
        elif proposal is not None:
            d = proposal.tokens
            self.stats.record(len(d), len(path))
            if self.config.spec.adaptive_k:  # longer after a fully kept chain
                r.draft_len = self.config.spec.next_draft_len(len(d), len(path))
        # the cache now validly holds everything fed except rejected drafts
        r.table.length = s.cached + s.pending + len(path)
        if emits:  # a prefill chunk short of the prompt's end keeps the prompt's pages
            r.table.truncate(r.table.length)

    @staticmethod
    def _verified(s: Scheduled, path: list[int], out: PassOutput, i: int) -> Verified:
        """What the pass did for ``s``, the ``i``-th request of its batch."""
        start, fed = out.starts[i], s.pending + len(s.drafts)
        hidden = None if out.hidden is None else out.hidden[start : start + fed]
        return Verified(s.cached, s.pending, len(s.drafts), path, hidden)

    @staticmethod
    def _outcome_on_device(
        chain: DeviceChainProposer, batch: list[Scheduled], out: PassOutput
    ) -> torch.Tensor:
        """The device chain's outcome (`DeviceChainProposer.outcome_on_device`), still on
        the device: nothing between the pass and the step's one read back reads it."""
        return chain.outcome_on_device(batch, out)

    def _emit(
        self,
        r: Request,
        outcome: tuple[list[int], int],
        logprobs: list[TokenLogprob] | None = None,
    ) -> StepOutput:
        """Append the kept drafts and the next token (`_append`); what ``r`` emitted, with
        the logprobs of those it emitted (``logprobs``: one per candidate token)."""
        path, nxt = outcome
        drafts = [] if r.proposal is None else r.proposal.tokens
        self._append(r, [drafts[j] for j in path] + [nxt])
        # the emitted ids are a prefix of the candidates (`_append` stops at the finish)
        kept = None if logprobs is None else logprobs[: len(r.new_ids)]
        prompt = None
        if r.prompt_logprobs:  # all scored: the pass that emits first scores the last
            prompt, r.prompt_logprobs = r.prompt_logprobs, []
        emitted = StepOutput(r.seq_id, r.new_ids, r.finish_reason, kept, prompt_logprobs=prompt)
        r.new_ids = []
        return emitted

    def _append(self, r: Request, new: list[int]) -> None:
        """Append tokens one at a time, stopping at EOS / stop string / max_tokens: nothing
        after the finishing token of an accepted chain is emitted."""
        for tok in new:
            if r.stopper.is_stop_token(tok):
                r.finish_reason = "stop"
                return
            if r.grammar is not None:
                r.grammar.accept([tok])
            r.tokens.append(tok)
            r.new_ids.append(tok)
            reason = r.stopper.check(r.output_ids)
            if reason is not None:
                r.finish_reason = reason
                return


def _scored(s: Scheduled) -> range:
    """The fed tokens (indices into ``s.ids``) whose logits score the prompt token after
    each: the request's prompt positions still to score (`Request.unscored`) this pass feeds."""
    todo = s.request.unscored
    start, stop = max(todo.start, s.cached), min(todo.stop, s.cached + s.pending)
    return range(start - s.cached, max(start, stop) - s.cached)
