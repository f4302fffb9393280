"""MTP / EAGLE draft head: trained on a small random target's own outputs it drafts tokens
the target accepts; any head (trained or not) leaves greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rose.generate import GenerationConfig, GenerationEngine
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead, MTPHeadConfig
from rose.spec.train_mtp import (
    TrainConfig,
    answer_prompts,
    draft_vocabulary,
    target_features,
    train_head,
)

VOCAB = 128
GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return LlamaForCausalLM(cfg).eval()


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (6 + i % 11,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def trained(target: LlamaForCausalLM) -> tuple[MTPHead, list[float]]:
    seqs = answer_prompts(target, _prompts(10, 96), answer_tokens=32)
    feats = target_features(target, seqs)
    assert all(f.shape == (len(s), 64) for f, s in zip(feats, seqs, strict=True))
    return train_head(target, seqs, feats, TrainConfig(epochs=12, lr=3e-3, batch_tokens=512))


def _run(target: LlamaForCausalLM, head: MTPHead, prompts: list[list[int]], k: int = 3):
    cfg = GenerationConfig(max_batch=16, spec=SpecConfig(method="mtp", num_draft_tokens=k))
    eng = GenerationEngine(target, cfg, mtp_head=head)
    return [r.output_ids for r in eng.generate(prompts, GREEDY)], eng


def test_trained_head_is_accepted_and_lossless(
    target: LlamaForCausalLM, trained: tuple[MTPHead, list[float]]
) -> None:
    head, history = trained
    assert history[-1] < 0.5 * history[0], history
    prompts = _prompts(20, 32)  # unseen prompts
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    got, eng = _run(target, head, prompts)
    assert got == base
    untrained, eng0 = _run(target, MTPHead(MTPHeadConfig.for_target(target.config)).eval(), prompts)
    assert untrained == base
    st = eng.stats
    assert st.acceptance_rate > 0.3 and st.accepted < st.drafted, st.as_dict()
    assert st.acceptance_rate > 3 * eng0.stats.acceptance_rate
    assert st.acceptance_per_position[0] >= st.acceptance_per_position[-1]
    assert eng.allocator.num_free == eng.config.kv.num_pages


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
    with the second chained draft unrolled: still lossless, still accepted, and it never
    drafts outside its vocabulary; save/load keeps the vocabulary."""
    prompts = _prompts(30, 96)
    seqs = answer_prompts(target, prompts, answer_tokens=32)
    vocab = draft_vocabulary(seqs, [len(p) for p in prompts], 48)
    assert len(vocab) == 48 and vocab == sorted(vocab)
    feats = target_features(target, seqs)
    cfg = TrainConfig(epochs=10, lr=3e-3, batch_tokens=512, unroll=2)
    head, history = train_head(target, seqs, feats, cfg, draft_vocab=vocab)
    assert history[-1] < 0.6 * history[0], history
    assert head.config.draft_vocab_size == 48 and head.draft_vocab.tolist() == vocab
    head.save(tmp_path / "h")
    head = MTPHead.load(tmp_path / "h")
    assert head.draft_vocab.tolist() == vocab

    test_prompts = _prompts(40, 24)
    base = [r.output_ids for r in GenerationEngine(target).generate(test_prompts, GREEDY)]
    got, eng = _run(target, head, test_prompts)
    assert got == base
    assert eng.stats.acceptance_rate > 0.2, eng.stats.as_dict()
    drafted: list[int] = []
    original = eng.mtp.propose if eng.mtp is not None else None
    assert original is not None

    def spy(reqs):  # record every drafted token
        out = original(reqs)
        drafted.extend(t for d, _ in out for t in d)
        return out

    eng.mtp.propose = spy  # type: ignore[method-assign]
    eng.generate(test_prompts[:4], GREEDY)
    assert drafted and set(drafted) <= set(vocab)
