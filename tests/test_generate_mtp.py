"""MTP / EAGLE draft head: trained on a small random target's own outputs it drafts tokens
the target accepts; any head (trained or not) leaves greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_llama import VOCAB, random_prompts, tiny_target

from rose.attention.metadata import AttentionMetadata
from rose.generate import GenerationConfig, GenerationEngine
from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaForCausalLM
from rose.quant import Int4Linear, int4_available
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.mtp import (
    MTPDrafter,
    MTPDraftRequest,
    MTPHead,
    MTPHeadConfig,
    MTPProposer,
    draft_int4,
)
from rose.spec.mtp import draft_dtype as resolve_draft_dtype
from rose.spec.train_mtp import (
    TrainConfig,
    UnrolledHead,
    answer_prompts,
    answer_with_features,
    draft_vocabulary,
    init_from_target,
    target_features,
    train_head,
)

GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def trained(target: LlamaForCausalLM) -> tuple[MTPHead, list[float]]:
    seqs = answer_prompts(target, random_prompts(10, 96), answer_tokens=32)
    feats = target_features(target, seqs)
    assert all(f.shape == (len(s), 64) for f, s in zip(feats, seqs, strict=True))
    return train_head(target, seqs, feats, TrainConfig(epochs=12, lr=3e-3, batch_tokens=512))


def _run(
    target: LlamaForCausalLM,
    head: MTPHead,
    prompts: list[list[int]],
    k: int = 3,
    draft_dtype: str = "auto",
):
    spec = SpecConfig(method="mtp", num_draft_tokens=k, draft_dtype=draft_dtype)
    cfg = GenerationConfig(max_batch=16, spec=spec)
    eng = GenerationEngine(target, cfg, mtp_head=head)
    return [r.output_ids for r in eng.generate(prompts, GREEDY)], eng


INT4 = pytest.param(
    "int4",
    marks=pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
)


@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16", INT4])
def test_trained_head_is_accepted_and_lossless(
    target: LlamaForCausalLM, trained: tuple[MTPHead, list[float]], draft_dtype: str
) -> None:
    head, history = trained
    assert history[-1] < 0.5 * history[0], history
    prompts = random_prompts(20, 50)  # unseen prompts, 50 as the bar asks
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    got, eng = _run(target, head, prompts, draft_dtype=draft_dtype)
    assert isinstance(eng.proposer, MTPProposer)
    drafter = eng.proposer.drafter
    if draft_dtype == "int4":  # the products that fit the kernel hold int4 weights
        assert isinstance(drafter.head.fuse, Int4Linear)
        assert isinstance(drafter.lm_head, Int4Linear)
    else:
        assert drafter.head.fuse.weight.dtype == getattr(torch, draft_dtype)
    assert got == base
    untrained, eng0 = _run(target, MTPHead(MTPHeadConfig.for_target(target.config)).eval(), prompts)
    assert untrained == base
    st = eng.stats
    assert st.acceptance_rate > 0.3 and st.accepted < st.drafted, st.as_dict()
    assert st.acceptance_rate > 3 * eng0.stats.acceptance_rate
    assert st.acceptance_per_position[0] >= st.acceptance_per_position[-1]
    assert eng.allocator.num_free == eng.config.kv.num_pages


@pytest.mark.parametrize(
    ("draft_dtype", "min_prob"),
    [
        ("float32", 0.0),
        ("bfloat16", 0.0),
        ("float32", 0.3),
        pytest.param("int4", 0.3, marks=INT4.marks),
    ],
)
def test_chains_accepted_on_the_device_equal_the_host_path(
    target: LlamaForCausalLM,
    trained: tuple[MTPHead, list[float]],
    draft_dtype: str,
    min_prob: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`spec.device_chain` (accept on the device, draft the next chain in the same step,
    one read back) against the host path: the same outputs, drafts and acceptance, with
    requests joining mid-run (batch of 4 over 12 prompts), different max_tokens, an EOS
    that ends chains early, and every page back in the pool at the end; with
    ``chain_min_prob`` the device's full chains cut where the host's stop."""
    head, _ = trained
    prompts = random_prompts(44, 12)
    params = [SamplingParams(max_tokens=6 + 5 * (i % 4)) for i in range(len(prompts))]
    plain = GenerationEngine(target).generate(prompts, params)
    counts: dict[int, int] = {}
    for r in plain:
        for t in r.output_ids:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: counts[t])  # common enough to end some answers early
    calls = {"n": 0}
    real = MTPDrafter.chain_after_verify

    def spy(self: MTPDrafter, *args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MTPDrafter, "chain_after_verify", spy)
    runs = {}
    for device_chain in ("on", "off"):
        spec = SpecConfig(
            method="mtp",
            num_draft_tokens=3,
            draft_dtype=draft_dtype,
            device_chain=device_chain,
            chain_min_prob=min_prob,
        )
        eng = GenerationEngine(
            target, GenerationConfig(max_batch=4, spec=spec), mtp_head=head, eos_ids=[eos]
        )
        before = calls["n"]
        out = eng.generate(prompts, params)
        runs[device_chain] = ([(r.output_ids, r.finish_reason) for r in out], eng.stats)
        assert (calls["n"] > before) == (device_chain == "on")
        assert eng.allocator.num_free == eng.config.kv.num_pages
    (got, st), (want, st_host) = runs["on"], runs["off"]
    before = calls["n"]
    auto = GenerationEngine(
        target, GenerationConfig(spec=SpecConfig(method="mtp")), mtp_head=head, eos_ids=[eos]
    )
    assert [r.output_ids for r in auto.generate(prompts[:2], params[:2])] == [
        o for o, _ in want[:2]
    ]
    assert calls["n"] == before  # "auto" takes the host path on the CPU
    with pytest.raises(ValueError, match="spec.device_chain"):
        SpecConfig(method="mtp", device_chain="yes")
    assert got == want
    assert any(reason == "stop" for _, reason in got) and all(eos not in o for o, _ in got)
    assert st.drafted > 0 and st.accepted > 0
    if min_prob:  # some chains stopped early: fewer drafts than fixed chains
        spec = SpecConfig(method="mtp", num_draft_tokens=3, draft_dtype=draft_dtype)
        fixed = GenerationEngine(
            target, GenerationConfig(max_batch=4, spec=spec), mtp_head=head, eos_ids=[eos]
        )
        fixed.generate(prompts, params)
        assert st.drafted < fixed.stats.drafted
    assert (st.steps, st.drafted, st.accepted, st.accepted_at) == (
        st_host.steps,
        st_host.drafted,
        st_host.accepted,
        st_host.accepted_at,
    )


def test_chains_stop_where_the_heads_probability_falls(
    target: LlamaForCausalLM, trained: tuple[MTPHead, list[float]]
) -> None:
    """`spec.chain_min_prob`: the output stays plain greedy's; a stopped chain is a prefix
    of the full one; the higher the bar, the shorter the chains (at 0.9999 nearly every
    chain stops after its first draft)."""
    head, _ = trained
    prompts = random_prompts(20, 32)
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    per_step: dict[float, float] = {}
    for min_prob in (0.0, 0.3, 0.9999):
        spec = SpecConfig(method="mtp", num_draft_tokens=4, chain_min_prob=min_prob)
        eng = GenerationEngine(target, GenerationConfig(max_batch=16, spec=spec), mtp_head=head)
        got = [r.output_ids for r in eng.generate(prompts, GREEDY)]
        assert got == base, min_prob
        assert eng.allocator.num_free == eng.config.kv.num_pages
        per_step[min_prob] = eng.stats.drafted / eng.stats.steps
    assert per_step[0.0] > per_step[0.3] > per_step[0.9999], per_step
    assert per_step[0.0] > 3.5 and per_step[0.9999] < 1.5, per_step

    drafter = MTPDrafter(head, target, PageAllocator(64), 16)
    feats = target_features(target, prompts[:8])
    stopped_early = 0
    for prompt, feat, nxt in zip(prompts[:8], feats, base[:8], strict=True):
        chains = {}
        for min_prob in (0.0, 0.3):
            table = drafter.new_table()
            req = MTPDraftRequest(table, feat, [*prompt, nxt[0]], 6, GREEDY, None)
            [(chains[min_prob], _, _)] = drafter.propose([req], min_prob=min_prob)
            table.release()
        assert len(chains[0.0]) == 6 and chains[0.3] == chains[0.0][: len(chains[0.3])]
        stopped_early += len(chains[0.3]) < 6
    assert stopped_early > 0


def test_draft_dtype_setting(target: LlamaForCausalLM) -> None:
    head = MTPHead(MTPHeadConfig.for_target(target.config)).eval()
    assert resolve_draft_dtype("float32", head) == torch.float32
    assert resolve_draft_dtype("bfloat16", head) == torch.bfloat16
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    fast = probe is not None and bool(probe())
    assert resolve_draft_dtype("auto", head) == (torch.bfloat16 if fast else torch.float32)
    # int4 weights on top of bf16 where the kernel is there; "int4" asks for them outright
    assert draft_int4("auto", head) == (fast and int4_available())
    assert not draft_int4("bfloat16", head) and not draft_int4("float32", head)
    if int4_available():
        assert draft_int4("int4", head) and resolve_draft_dtype("int4", head) == torch.bfloat16
    else:
        with pytest.raises(ValueError, match="int4"):
            draft_int4("int4", head)
    with pytest.raises(ValueError, match="spec.draft_dtype"):
        SpecConfig(method="mtp", draft_dtype="fp8")


def test_head_save_load_roundtrip(trained: tuple[MTPHead, list[float]], tmp_path: Path) -> None:
    head, _ = trained
    head.save(tmp_path / "head", extra={"target": "tiny"})
    again = MTPHead.load(tmp_path / "head")
    for (k, a), (k2, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    (tmp_path / "head" / "config.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="config.format"):
        MTPHead.load(tmp_path / "head")


def test_head_must_match_target(target: LlamaForCausalLM) -> None:
    other = MTPHeadConfig.for_target(target.config)
    bad = MTPHead(MTPHeadConfig(**{**other.__dict__, "vocab_size": VOCAB + 1}))
    with pytest.raises(ValueError, match="vocab_size"):
        GenerationEngine(target, GenerationConfig(spec=SpecConfig(method="mtp")), mtp_head=bad)
    with pytest.raises(ValueError, match="needs an mtp_head"):
        GenerationEngine(target, GenerationConfig(spec=SpecConfig(method="mtp")))


def test_head_with_a_draft_vocabulary_and_unrolled_training(
    target: LlamaForCausalLM, tmp_path: Path
) -> None:
    """A head that drafts only among the answers' 48 most frequent tokens (of 128), trained
    with the second and third chained drafts unrolled: still lossless, still accepted, and it never
    drafts outside its vocabulary; save/load keeps the vocabulary."""
    prompts = random_prompts(30, 96)
    seqs = answer_prompts(target, prompts, answer_tokens=32)
    vocab = draft_vocabulary(seqs, [len(p) for p in prompts], 48)
    assert len(vocab) == 48 and vocab == sorted(vocab)
    feats = target_features(target, seqs)
    cfg = TrainConfig(epochs=10, lr=3e-3, batch_tokens=512, unroll=3)
    head, history = train_head(target, seqs, feats, cfg, draft_vocab=vocab)
    assert history[-1] < 0.6 * history[0], history
    assert head.config.draft_vocab_size == 48 and head.draft_vocab.tolist() == vocab
    head.save(tmp_path / "h")
    head = MTPHead.load(tmp_path / "h")
    assert head.draft_vocab.tolist() == vocab

    test_prompts = random_prompts(40, 24)
    base = [r.output_ids for r in GenerationEngine(target).generate(test_prompts, GREEDY)]
    got, eng = _run(target, head, test_prompts)
    assert got == base
    assert eng.stats.acceptance_rate > 0.2, eng.stats.as_dict()
    drafted: list[int] = []
    assert isinstance(eng.proposer, MTPProposer)
    drafter = eng.proposer.drafter
    original = drafter.propose

    def spy(reqs, *args):  # record every drafted token
        out = original(reqs, *args)
        drafted.extend(t for d, _, _ in out for t in d)
        return out

    chained = drafter.chain_after_verify

    def spy_chain(*args, **kwargs):  # the same for chains drafted right after verification
        out = chained(*args, **kwargs)
        drafted.extend(out.flatten().tolist())
        return out

    drafter.propose = spy  # type: ignore[method-assign]
    drafter.chain_after_verify = spy_chain  # type: ignore[method-assign]
    eng.generate(test_prompts[:4], GREEDY)
    assert drafted and set(drafted) <= set(vocab)


def test_answers_with_features_equal_answering_then_a_feature_pass(
    target: LlamaForCausalLM,
) -> None:
    """Features captured while answering (batches of 7, a ragged last batch) are the
    target's own answers and final hidden states, as a separate full pass computes them."""
    prompts = random_prompts(50, 20)
    seqs, feats = answer_with_features(target, prompts, answer_tokens=24, batch=7)
    assert seqs == answer_prompts(target, prompts, answer_tokens=24)
    ref = target_features(target, seqs)
    for f, r in zip(feats, ref, strict=True):
        assert f.shape == r.shape
        torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feature_layers", [(), (0, 2)])
def test_unrolled_training_forward_matches_chained_drafting(
    target: LlamaForCausalLM, feature_layers: tuple[int, ...]
) -> None:
    """The dense training forward of steps 1-3 computes what the paged head computes when it
    drafts a chain: step 1 over teacher-forced pairs (the target's final-norm feature, or
    several of its layers side by side), then its own features fed back (the head's cache
    holding the committed pairs and the chain's earlier drafts)."""
    torch.manual_seed(5)
    cfg = MTPHeadConfig.for_target(target.config, feature_layers=feature_layers)
    head = MTPHead(cfg).eval()
    lens = [9, 6, 12]
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in lens]
    feats = [torch.randn(n, cfg.feature_width) for n in lens]
    emb = target.tok_embeddings
    with torch.no_grad():
        fwd = UnrolledHead(head, lens)
        out1 = fwd.step(
            torch.cat([f[:-1] for f in feats]),
            emb(torch.tensor([t for s in seqs for t in s[1:]])),
            torch.arange(sum(lens) - len(lens)),
        )
        rows2 = fwd.rows(2)
        out2 = fwd.step(
            out1[rows2],
            emb(torch.tensor([seqs[fwd.seq1[r]][fwd.t1[r] + 2] for r in rows2.tolist()])),
            rows2,
        )
        rows3 = fwd.rows(3)
        out3 = fwd.step(
            out2[torch.searchsorted(rows2, rows3)],
            emb(torch.tensor([seqs[fwd.seq1[r]][fwd.t1[r] + 3] for r in rows3.tolist()])),
            rows3,
        )
        for seq, t in [(0, 0), (0, 4), (1, 2), (2, 8)]:
            s, f = seqs[seq], feats[seq]
            table = BlockTable(PageAllocator(4), 16)
            table.reserve(t + 3)
            cache = head.new_cache(4, 16)
            meta = AttentionMetadata.build([(table, 0, t + 1)])
            chain = [head(f[: t + 1], emb(torch.tensor(s[1 : t + 2])), meta, cache)[-1:]]
            for step in (1, 2):
                meta = AttentionMetadata.build([(table, t + step, 1)])
                tok = emb(torch.tensor([s[t + step + 1]]))
                chain.append(head(chain[-1], tok, meta, cache))
            for rows, out, got in [
                (torch.arange(len(fwd.t1)), out1, chain[0]),
                (rows2, out2, chain[1]),
                (rows3, out3, chain[2]),
            ]:
                [i] = [
                    j for j, r in enumerate(rows.tolist()) if fwd.seq1[r] == seq and fwd.t1[r] == t
                ]
                torch.testing.assert_close(out[i : i + 1], got, atol=1e-5, rtol=1e-5)


def test_greedy_chains_drafted_on_the_device_equal_the_per_step_path(
    target: LlamaForCausalLM, trained: tuple[MTPHead, list[float]]
) -> None:
    """Greedy chains keep their drafts on the device between head steps; a one-wide tree
    takes the per-step host path. Both must draft the same chains, in a batch whose
    requests want different lengths (so the live set shrinks between steps)."""
    head, _ = trained
    prompts = random_prompts(31, 3)
    feats = target_features(target, prompts)
    ks = (3, 1, 2)
    nexts = (5, 40, 90)  # the token after each prompt: distinct, so the chains differ

    def propose(widths: tuple[int, ...]) -> tuple[list[list[int]], list[int]]:
        drafter = MTPDrafter(head, target, PageAllocator(64), 16)
        reqs = [
            MTPDraftRequest(drafter.new_table(), f, [*p, t], k, GREEDY, None)
            for p, f, k, t in zip(prompts, feats, ks, nexts, strict=True)
        ]
        chains = [d for d, _, _ in drafter.propose(reqs, widths)]
        return chains, [r.table.length for r in reqs]

    on_device, lengths = propose(())
    per_step, lengths_host = propose((1,))
    assert [len(c) for c in on_device] == list(ks)
    assert len({c[0] for c in on_device}) == len(ks)  # distinct chains, or the test is blind
    assert on_device == per_step and lengths == lengths_host


def test_head_starts_from_the_targets_last_layer(target: LlamaForCausalLM) -> None:
    head = MTPHead(MTPHeadConfig.for_target(target.config))
    init_from_target(head, target)
    last = target.layers[-1].state_dict()
    for k, v in head.block.state_dict().items():
        assert torch.equal(v, last[k]), k
    with pytest.raises(ValueError, match="train.init"):
        TrainConfig(init="zeros")
    with pytest.raises(ValueError, match="train.unroll"):
        TrainConfig(unroll=0)
    with pytest.raises(ValueError, match="train.distill"):
        TrainConfig(distill=1.5)


def test_draft_vocabulary_fills_with_the_lowest_ids() -> None:
    """Frequent answer tokens first; rare ones give way to the lowest ids (BPE merge order)."""
    seqs, skip = [[3, 9, 5, 5, 7, 7, 7]], [1]
    assert draft_vocabulary(seqs, skip, 2) == [5, 7]
    assert draft_vocabulary(seqs, skip, 4) == [5, 7, 9]  # no vocab_size: nothing to fill
    assert draft_vocabulary(seqs, skip, 4, vocab_size=12) == [0, 5, 7, 9]
    assert draft_vocabulary(seqs, skip, 4, vocab_size=12, min_count=2) == [0, 1, 5, 7]


def test_head_trained_on_the_targets_distribution_is_accepted(
    target: LlamaForCausalLM,
) -> None:
    """All of the token loss on the target's own distribution (soft labels): the head still
    learns what the target says on unseen prompts, and output stays the target's."""
    prompts = random_prompts(60, 96)
    seqs = answer_prompts(target, prompts, answer_tokens=32)
    feats = target_features(target, seqs)
    cfg = TrainConfig(epochs=12, lr=3e-3, batch_tokens=512, distill=1.0)
    head, _ = train_head(target, seqs, feats, cfg)
    test_prompts = random_prompts(70, 24)
    base = [r.output_ids for r in GenerationEngine(target).generate(test_prompts, GREEDY)]
    got, eng = _run(target, head, test_prompts)
    assert got == base
    untrained = MTPHead(MTPHeadConfig.for_target(target.config)).eval()
    _, eng0 = _run(target, untrained, test_prompts)
    assert eng.stats.acceptance_rate > 0.3, eng.stats.as_dict()
    assert eng.stats.acceptance_rate > 3 * eng0.stats.acceptance_rate


def test_a_time_budget_that_cuts_training_short_says_so(target: LlamaForCausalLM) -> None:
    """``max_seconds`` stops training, and the run reports it: its loss history holds only
    the epochs it completed, it logs a warning, and the head's note says STOPPED EARLY."""
    from rose.spec.train_mtp import _epochs_note

    seqs = answer_prompts(target, random_prompts(4, 96), answer_tokens=16)
    feats = target_features(target, seqs)
    tokens = sum(len(s) for s in seqs)

    def run(**kw: object) -> tuple[list[float], list[str]]:
        logs: list[str] = []
        cfg = TrainConfig(epochs=3, lr=3e-3, **kw)  # type: ignore[arg-type]
        _, history = train_head(target, seqs, feats, cfg, log=logs.append)
        return history, [m for m in logs if m.startswith("warning:")]

    full, warned = run(batch_tokens=64)  # no budget: every epoch, no warning
    assert len(full) == 3 and warned == []
    # spent within the first epoch's batches: nothing complete
    history, warned = run(batch_tokens=64, max_seconds=0.0)
    assert history == []
    assert len(warned) == 1 and "0 of 3 epochs complete" in warned[0]
    # one batch per epoch: the budget is seen between epochs
    history, warned = run(batch_tokens=tokens + 1, max_seconds=0.0)
    assert len(history) == 1
    assert len(warned) == 1 and "1 of 3 epochs complete" in warned[0]
    assert _epochs_note(3, 3, None) == "3 epochs"
    assert _epochs_note(1, 3, 75.0).startswith("1 of 3 epochs (STOPPED EARLY by --minutes 75.0")


@pytest.mark.parametrize(
    "tree", [{}, {"tree_nodes": 4}, {"tree_widths": (3, 2)}], ids=["chain", "dynamic", "widths"]
)
def test_lookup_drafts_long_repeats_in_place_of_the_head(
    target: LlamaForCausalLM, trained: tuple[MTPHead, list[float]], tree: dict[str, object]
) -> None:
    """`spec.lookup_min_match`: where the context ends in a repeat of 2+ tokens, a step
    copies what followed it (up to lookup_drafts = 6, past the head's k = 2), and the head's
    cache catches up afterwards: at every step its pairs plus the features it still has to
    feed cover the sequence (pair t: feature t with token t + 1), and the output stays
    plain greedy's."""
    head, _ = trained
    # a prompt, the target's own answer to it, and the prompt again: the answer is in the
    # context when the target answers a second time
    firsts = random_prompts(30, 12)
    answers = [r.output_ids for r in GenerationEngine(target).generate(firsts, GREEDY)]
    prompts = [p + a + p for p, a in zip(firsts, answers, strict=True)]
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    spec = SpecConfig(method="mtp", num_draft_tokens=2, lookup_min_match=2, lookup_drafts=6, **tree)
    eng = GenerationEngine(target, GenerationConfig(max_batch=16, spec=spec), mtp_head=head)
    for p in prompts:
        eng.add(p, GREEDY)
    outputs: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for res in eng.step():
            outputs.setdefault(res.seq_id, []).extend(res.new_ids)
        for r in eng.scheduler.running:
            state, table = r.spec_state, r.draft_table
            if state is not None and table is not None:
                queued = 0 if state.features is None else state.features.shape[0]
                assert table.length + queued == len(r.tokens) - 1
    assert [outputs[i] for i in sorted(outputs)] == base
    st = eng.stats
    assert len(st.proposed_at) == 6, st.as_dict()  # lookups drafted past the head's k
    assert sum(st.accepted_at[2:]) > 0, st.as_dict()  # and the target kept some of it
    assert eng.allocator.num_free == eng.config.kv.num_pages

    plain = SpecConfig(method="mtp", num_draft_tokens=2, **tree)
    eng0 = GenerationEngine(target, GenerationConfig(max_batch=16, spec=plain), mtp_head=head)
    assert [r.output_ids for r in eng0.generate(prompts, GREEDY)] == base
    assert st.emitted / st.steps > eng0.stats.emitted / eng0.stats.steps, (
        st.as_dict(),
        eng0.stats.as_dict(),
    )
