"""Prompt lookup (`rose.spec.ngram`): which continuation it copies and how much of it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from bench.ngram_draft import Policy, replay
from rose.generate import GenerationConfig, GenerationEngine
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.ngram import NgramDrafter


def test_copies_what_followed_the_most_recent_occurrence_of_the_longest_suffix() -> None:
    d = NgramDrafter(max_n=3, min_n=1)
    # suffix [1, 2, 3] occurs once (at 0), the 1-gram [3] more recently (at 7)
    tokens = [1, 2, 3, 40, 41, 42, 9, 3, 50, 1, 2, 3]
    assert d.propose(tokens, 3) == [40, 41, 42]
    assert d.match(tokens) == (3, 3)  # 3 tokens matched, copying from index 3
    # only the 1-gram [7] matches; its most recent earlier occurrence is followed by 8
    assert d.propose([7, 5, 7, 8, 6, 7], 2) == [8, 6]
    assert d.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert d.match([1, 2, 3, 4]) is None
    assert d.propose([5, 6, 5, 6], 0) == []


def test_a_match_close_to_the_end_continues_periodic_text() -> None:
    # [5, 6] recurs right before the suffix: copying runs on through its own drafts
    assert NgramDrafter(max_n=2).propose([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]


@pytest.mark.parametrize(
    "tokens,n",
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 1], 1),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 1, 2], 2),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 1, 2, 3, 4], 4),
    ],
)
def test_per_match_sizes_the_draft_by_the_matched_suffix(tokens: list[int], n: int) -> None:
    """A suffix of n matched tokens drafts at most n * per_match, within k."""
    d = NgramDrafter(max_n=4)
    follow = tokens[n : n + 16]
    assert d.propose(tokens, 16) == follow
    assert d.propose(tokens, 16, per_match=3) == follow[: 3 * n]
    assert d.propose(tokens, 2, per_match=3) == follow[:2]


def test_per_match_is_validated_for_ngram_only() -> None:
    assert SpecConfig(method="ngram", ngram_draft_per_match=4).ngram_draft_per_match == 4
    with pytest.raises(ValueError, match="ngram_draft_per_match is for method 'ngram'"):
        SpecConfig(method="draft", ngram_draft_per_match=4)
    with pytest.raises(ValueError, match="ngram_draft_per_match must be an int >= 0"):
        SpecConfig(method="ngram", ngram_draft_per_match=-1)
    with pytest.raises(ValueError, match="ngram_draft_per_match must be an int >= 0"):
        SpecConfig(method="ngram", ngram_draft_per_match=True)


PARAMS = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def quoting() -> tuple[LlamaForCausalLM, list[list[int]], list[list[int]], int]:
    """A small random Llama, quote-like prompts (a span repeated, as RAG answers copy), an
    EOS token some answers meet early, and the plain greedy answers up to and with it."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).eval()
    g = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(8):
        ids = torch.randint(0, 96, (6 + 4 * i,), generator=g).tolist()
        prompts.append(ids + ids[: len(ids) // 2])
    plain = GenerationEngine(model, GenerationConfig(max_batch=1))
    # each prompt carries the start of its own greedy answer, which runs on the same, so a
    # lookup can copy answer text (and an EOS in it) from the prompt
    starts = [r.output_ids[:16] for r in plain.generate(prompts, PARAMS)]
    prompts = [p + a for p, a in zip(prompts, starts, strict=True)]
    full = [r.output_ids for r in plain.generate(prompts, PARAMS)]  # no EOS: runs to the end
    # EOS: of the tokens the answers make most often after their first few, the first that
    # a draft of prompt lookup runs into (so the engine keeps an EOS among its drafts)
    for eos, _ in Counter(t for a in full for t in a[4:]).most_common():
        answers = [a[: a.index(eos) + 1] if eos in a else a for a in full]
        if any(_eos_drafted(p, a) for p, a in zip(prompts, answers, strict=True) if a[-1] == eos):
            break
    else:
        raise AssertionError("no frequent token of the answers is ever drafted at their end")
    assert 1 < sum(len(a) < PARAMS.max_tokens for a in answers) < len(answers)
    return model, prompts, answers, eos


def _eos_drafted(prompt: list[int], answer: list[int]) -> bool:
    """Whether a 16-token lookup draft from some point of ``answer`` runs through its end."""
    d = NgramDrafter(4)
    return any(
        d.propose(prompt + answer[:j], 16)[: len(answer) - j] == answer[j:]
        for j in range(1, len(answer))
    )


@pytest.mark.parametrize(
    "policy",
    [
        Policy("fixed 4", 4),
        Policy("fixed 16", 16),
        Policy("adaptive", 16, adaptive=True),
        Policy("2 per match", 16, per_match=2),
        Policy("4 per match, adaptive", 12, per_match=4, adaptive=True),
    ],
    ids=lambda p: p.name,
)
def test_bench_replay_takes_the_engines_steps(
    quoting: tuple[LlamaForCausalLM, list[list[int]], list[list[int]], int], policy: Policy
) -> None:
    """`bench.ngram_draft` prices draft policies by replaying plain greedy answers; the
    replay drafts, keeps and steps exactly as the engine does, EOS inside drafts too."""
    model, prompts, answers, eos = quoting
    spec = SpecConfig(**policy.spec())
    eng = GenerationEngine(model, GenerationConfig(max_batch=1, spec=spec), eos_ids=(eos,))
    got = [r.output_ids for r in eng.generate(prompts, PARAMS)]
    assert got == [a[:-1] if a[-1] == eos else a for a in answers]  # EOS is not emitted
    reps = [replay(p, a, policy, PARAMS.max_tokens) for p, a in zip(prompts, answers, strict=True)]
    st = eng.stats
    assert st.steps > 0 and 0 < st.accepted < st.drafted
    assert (st.steps, st.drafted, st.accepted) == (
        sum(r.steps for r in reps),
        sum(r.drafted for r in reps),
        sum(r.accepted for r in reps),
    )
    # every step after the first token fed 1 + its drafts
    assert sum(r.steps for r in reps) == sum(f > 1 for r in reps for f in r.fed)
