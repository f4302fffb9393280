"""The speculative acceptance rule and the sampler's filters, against independent oracles:
chi-square goodness of fit to the target distribution, transformers' logits warpers."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rose.sampling import GREEDY_TEMPERATURE, SamplingParams, StopChecker, sample, token_probs
from rose.spec.acceptance import accept_deterministic, accept_drafts, accept_greedy

N = 100_000
V = 8
K = 3


def _random_dists(g: torch.Generator, rows: int, zero_some: bool) -> torch.Tensor:
    x = torch.rand(rows, V, generator=g) ** 2
    if zero_some:  # like top-k filtering: some tokens impossible
        x[:, : V // 4] = 0.0
    return x / x.sum(-1, keepdim=True)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("case", ["dense", "target-sparse", "draft-sparse"])
def test_rejection_sampler_matches_target_distribution(case: str) -> None:
    g = torch.Generator().manual_seed({"dense": 1, "target-sparse": 2, "draft-sparse": 3}[case])
    p = _random_dists(g, K + 1, zero_some=case == "target-sparse")  # [K+1, V] target
    q = _random_dists(g, K, zero_some=case == "draft-sparse")  # [K, V] drafter
    assert (p - torch.cat([q, p[-1:]])).abs().max() > 0.1  # drafter really differs

    draft = torch.stack(
        [torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1
    )
    res = accept_drafts(draft, q.expand(N, K, V), p.expand(N, K + 1, V), g)
    n = res.num_accepted

    # First emitted token: the first draft when kept, else the resampled token.
    first = torch.where(n >= 1, draft[:, 0], res.next_token)
    assert _chi2(first, p[0]) > 0.01
    # Second emitted token, given the first was a kept draft (independent of position 1).
    kept = n >= 1
    second = torch.where(n[kept] >= 2, draft[kept, 1], res.next_token[kept])
    assert kept.sum() > 10_000
    assert _chi2(second, p[1]) > 0.01
    # Bonus token when every draft was kept comes from p at position K.
    all_kept = n == K
    if all_kept.sum() > 2_000:
        assert _chi2(res.next_token[all_kept], p[K]) > 0.01
    # The rule is not trivially accepting/rejecting everything.
    assert 0.05 < (n > 0).float().mean() < 0.95


def test_chi_square_check_detects_a_wrong_sampler() -> None:
    """Sanity for the test above: drafts accepted unconditionally follow q, not p."""
    g = torch.Generator().manual_seed(4)
    p = _random_dists(g, 1, False)[0]
    q = _random_dists(g, 1, False)[0]
    wrong = torch.multinomial(q, N, replacement=True, generator=g)
    assert _chi2(wrong, p) < 1e-6


def test_greedy_one_hot_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    greedy = SamplingParams()
    p = token_probs(logits, greedy)  # [4, V] one-hot
    target = logits.argmax(-1)
    draft = torch.stack([target[:3], torch.tensor([target[0], target[1], 7])])  # [2, 3]
    draft[1, 2] = (target[2] + 1) % 50
    q = torch.zeros(2, 3, 50).scatter_(-1, draft[..., None], 1.0)
    res = accept_drafts(draft, q, p.expand(2, 4, 50), torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [3, 2]
    assert res.next_token.tolist() == [int(target[3]), int(target[2])]


@pytest.mark.parametrize("case", ["likely-drafts", "impossible-draft"])
def test_deterministic_drafts_match_target_distribution(case: str) -> None:
    """N-gram drafts (q one-hot at the draft, never built): the emitted tokens still follow
    the target's distributions."""
    g = torch.Generator().manual_seed(7 if case == "likely-drafts" else 8)
    p = _random_dists(g, K + 1, zero_some=case == "impossible-draft")  # [K+1, V]
    fixed = p[:K].argmax(-1)  # a plausible copy
    if case == "impossible-draft":
        fixed[1] = 0  # p[1, 0] == 0: this draft can never be kept
        assert p[1, 0] == 0
    draft = fixed.expand(N, K).contiguous()
    res = accept_deterministic(draft, p.expand(N, K + 1, V), g)
    n = res.num_accepted
    first = torch.where(n >= 1, draft[:, 0], res.next_token)
    assert _chi2(first, p[0]) > 0.01
    kept = n >= 1
    second = torch.where(n[kept] >= 2, draft[kept, 1], res.next_token[kept])
    assert _chi2(second, p[1]) > 0.01
    if case == "impossible-draft":
        assert int(n.max()) <= 1
    else:
        all_kept = n == K
        assert all_kept.sum() > 1_000
        assert _chi2(res.next_token[all_kept], p[K]) > 0.01
    # the one-hot formulation of the general rule gives the same acceptance law
    q = torch.zeros(K, V).scatter_(-1, fixed[:, None], 1.0)
    ref = accept_drafts(draft, q.expand(N, K, V), p.expand(N, K + 1, V), g)
    for j in range(K + 1):
        a, b = (n == j).float().mean(), (ref.num_accepted == j).float().mean()
        assert abs(a - b) < 0.01, (j, float(a), float(b))


def test_accept_greedy_equals_one_hot_rejection_sampling() -> None:
    g = torch.Generator().manual_seed(9)
    for trial in range(50):
        k = 1 + trial % 6
        logits = torch.randn(k + 1, 30, generator=g)
        target = logits.argmax(-1)
        draft = target[:k].clone()
        if trial % 3:  # break the chain somewhere
            j = int(torch.randint(0, k, (1,), generator=g))
            draft[j] = (draft[j] + 1 + trial) % 30
        p = token_probs(logits, SamplingParams())
        q = torch.zeros(k, 30).scatter_(-1, draft[:, None], 1.0)
        ref = accept_drafts(draft[None], q[None], p[None], g)
        n, nxt = accept_greedy(draft.tolist(), target.tolist())
        assert (n, nxt) == (int(ref.num_accepted[0]), int(ref.next_token[0]))
    assert accept_greedy([], [4]) == (0, 4)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (10, 0.5), (0, 0.05)])
def test_filters_keep_the_same_tokens_as_transformers(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 300, generator=g) * 3
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    ours = token_probs(logits, params)
    ref = logits / 0.8
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(ours, ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_follows_probs() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    probs = torch.tensor([[0.1, 0.6, 0.3]]).expand(N, 3)
    a = sample(probs, params, params.generator())
    b = sample(probs, params, params.generator())
    assert torch.equal(a, b)
    counts = torch.bincount(a, minlength=3).double()
    expected = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64) * N
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 0.01


def test_temperatures_too_small_to_divide_by_are_greedy() -> None:
    """1e-40 is a float32 subnormal: logits divided by it overflow to inf, and the draw failed
    with NaN probabilities for the whole batch. Below GREEDY_TEMPERATURE it is the argmax."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]])
    for t in (1e-40, 1e-38, 1e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy
        assert torch.equal(token_probs(logits, params), torch.eye(3)[[1, 0]])
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    warm = token_probs(logits, SamplingParams(temperature=GREEDY_TEMPERATURE))
    assert torch.isfinite(warm).all()


def test_sampling_params_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="sampling.max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="sampling.temperature"):
        SamplingParams(temperature=-1.0)


def test_stop_checker_eos_stop_strings_and_length() -> None:
    def detok(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    c = StopChecker(SamplingParams(max_tokens=10, stop=("cd",)), eos_ids=[25], detokenize=detok)
    assert c.is_stop_token(25) and not c.is_stop_token(2)
    assert c.check([0, 1, 2]) is None
    assert c.check([0, 1, 2, 3]) == "stop"
    assert c.text == "ab"
    c = StopChecker(SamplingParams(max_tokens=2, ignore_eos=True), eos_ids=[25], detokenize=None)
    assert not c.is_stop_token(25)
    assert c.check([1]) is None and c.check([1, 2]) == "length"
    with pytest.raises(ValueError, match="detokenizer"):
        StopChecker(SamplingParams(stop=("x",)), eos_ids=[], detokenize=None)
