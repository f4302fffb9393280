"""`rose.scheduler` on its own, no model: the token budget (decodes first, drafts dropped
when they do not fit, prefills chunked), preemption and page accounting."""

from __future__ import annotations

from rose.kv.allocator import PageAllocator
from rose.sampling import SamplingParams, StopChecker
from rose.scheduler import Request, Scheduled, Scheduler
from rose.spec.proposer import Proposal


def _add(sched: Scheduler, seq_id: int, prompt_len: int) -> Request:
    params = SamplingParams(max_tokens=8)
    table, draft_table = sched.new_tables()
    r = Request(
        seq_id=seq_id,
        prompt_len=prompt_len,
        tokens=list(range(1, prompt_len + 1)),
        params=params,
        generator=None,
        stopper=StopChecker(params, (), None),
        table=table,
        draft_table=draft_table,
    )
    sched.add(r)
    return r


def _run(batch: list[Scheduled]) -> list[tuple[int, int, int]]:
    """What the engine does after a pass that kept no draft: cache what was fed and append
    one token to every request the pass reached the end of."""
    shape = [(s.request.seq_id, s.cached, s.pending + len(s.drafts)) for s in batch]
    for s in batch:
        r = s.request
        r.table.length = s.cached + s.pending
        if s.emits:
            r.tokens.append(0)
        r.proposal = None
    return shape


def test_budget_counts_decodes_first_then_chunks_prefills() -> None:
    alloc = PageAllocator(32)
    sched = Scheduler(alloc, 4, max_batch=3, max_step_tokens=6, draft_room=3, kv_copies=0)
    a, b, _ = (_add(sched, i, n) for i, n in enumerate([9, 5, 2]))
    sched.admit()
    assert len(sched.running) == 3
    assert _run(sched.schedule()) == [(0, 0, 6)]  # a prefill chunk; the others wait
    assert _run(sched.schedule()) == [(0, 6, 3), (1, 0, 3)]  # a finishes its prompt
    assert a.decoding and not b.decoding
    a.proposal = Proposal([7, 7, 7])  # a's token is counted first, its drafts fit: 6 - 1 - 3
    assert _run(sched.schedule()) == [(0, 9, 4), (1, 3, 2)]
    a.proposal = b.proposal = Proposal([7, 7, 7, 7, 7])  # too many: dropped, both decode
    assert _run(sched.schedule()) == [(0, 10, 1), (1, 5, 1), (2, 0, 2)]
    assert a.proposal is None and b.proposal is None


def test_preemption_frees_every_page_and_requeues_first() -> None:
    alloc = PageAllocator(10)
    sched = Scheduler(alloc, 4, max_batch=4, max_step_tokens=0, draft_room=0, kv_copies=1)
    a, b = _add(sched, 0, 8), _add(sched, 1, 3)
    sched.admit()  # a: 2 pages, b: 1 page (its draft table: none yet)
    assert [r.seq_id for r in sched.running] == [0, 1]
    _run(sched.schedule())
    b.draft_table.reserve(4)  # type: ignore[union-attr]  # the proposer's own page
    a.tokens += [0] * 4  # a needs a third page for its next pass
    alloc.allocate(alloc.num_free)  # someone else holds the rest
    batch = sched.schedule()  # a takes b's pages: b leaves, then a's pass fits
    assert [s.request.seq_id for s in batch] == [0]
    assert list(sched.waiting) == [b] and b.table.length == 0 and not b.table.pages
    assert not b.draft_table.pages  # type: ignore[union-attr]
