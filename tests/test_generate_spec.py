"""Generation engine on small random models: speculative greedy == plain greedy (exactly),
EOS / stop strings inside accepted chains, continuous batching, preemption, backpressure."""

from __future__ import annotations

import pytest
import torch

from rose.generate import CapacityError, GenerationConfig, GenerationEngine
from rose.kv import KVCacheConfig
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig

VOCAB = 128
N_PROMPTS = 50


def _config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config(4)).eval()


@pytest.fixture(scope="module")
def truncated(target: LlamaForCausalLM) -> LlamaForCausalLM:
    """The target's embeddings, first layer, norm and head: agrees often, not always."""
    d = LlamaForCausalLM(_config(1)).eval()
    d.load_state_dict(
        {
            k: v
            for k, v in target.state_dict().items()
            if not k.startswith("layers.") or k.startswith("layers.0.")
        }
    )
    return d


@pytest.fixture(scope="module")
def random_drafter() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(_config(1)).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(N_PROMPTS):
        n = 3 + (i * 7) % 40
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        if i % 2:  # quote-like prompts: a span repeated, as in retrieval-augmented answers
            ids = ids + ids[: n // 2]
        out.append(ids)
    return out


def detok(ids: list[int]) -> str:
    return "".join(chr(0x4E00 + i) for i in ids)


GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def baseline(target: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    eng = GenerationEngine(target, GenerationConfig(max_batch=16))
    return [r.output_ids for r in eng.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    "method,drafter,k",
    [
        ("ngram", None, 4),
        ("draft", "truncated", 4),
        ("draft", "random", 3),
        ("draft", "truncated", 1),
        ("ngram-adaptive", None, 6),
        ("draft-adaptive", "truncated", 5),
        ("ngram-per-match", None, 8),
    ],
)
def test_speculative_greedy_identical_to_plain_greedy(
    request: pytest.FixtureRequest,
    target: LlamaForCausalLM,
    prompts: list[list[int]],
    baseline: list[list[int]],
    method: str,
    drafter: str | None,
    k: int,
) -> None:
    d = (
        None
        if drafter is None
        else request.getfixturevalue(
            {"truncated": "truncated", "random": "random_drafter"}[drafter]
        )
    )
    adaptive = method.endswith("-adaptive")
    per_match = 2 if method.endswith("-per-match") else 0
    spec = SpecConfig(
        method=method.split("-")[0],
        num_draft_tokens=k,
        adaptive_k=adaptive,
        ngram_draft_per_match=per_match,
    )
    cfg = GenerationConfig(max_batch=16, spec=spec)
    eng = GenerationEngine(target, cfg, drafter=d)
    got = [r.output_ids for r in eng.generate(prompts, GREEDY)]
    mismatches = [i for i, (a, b) in enumerate(zip(got, baseline, strict=True)) if a != b]
    assert mismatches == [], f"prompts whose speculative output differs: {mismatches}"
    st = eng.stats
    assert 0 < st.accepted < st.drafted  # both acceptance and rejection were exercised
    assert st.emitted == st.accepted + st.steps
    assert len(st.acceptance_per_position) == k
    if adaptive or per_match:  # after rejections / on short matches, fewer than k drafts
        assert st.drafted < k * st.steps
    assert st.draft_s > 0 and st.verify_s > 0
    assert eng.allocator.num_free == cfg.kv.num_pages  # every page came back


@pytest.mark.parametrize("pad", [4, 1])
def test_short_passes_are_topped_up_with_fillers(
    target: LlamaForCausalLM,
    truncated: LlamaForCausalLM,
    prompts: list[list[int]],
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    pad: int,
) -> None:
    """Where the model pads few-row passes (``pass_min_rows`` 4, as `pack_weights` picks on
    AMD Zen 4) a pass over 2-3 new tokens (here: one draft each, verified alone at the end
    of the run) is fed 4, the fillers after the last sequence's tokens; where it does not
    (1: Zen 5, GPUs) it is fed as is. The output is plain greedy's either way and every
    page comes back."""
    sizes: list[int] = []
    real = target.forward

    def spy(ids: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(ids.shape[0])
        return real(ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(target, "forward", spy)
    monkeypatch.setattr(target, "pass_min_rows", pad)
    # different lengths, so that sequences leave the batch one by one and the last ones
    # decode alone: one pending token and one draft, a pass of 2
    params = [SamplingParams(max_tokens=4 + 4 * i) for i in range(6)]
    spec = SpecConfig(method="draft", num_draft_tokens=1)
    cfg = GenerationConfig(max_batch=4, spec=spec)
    eng = GenerationEngine(target, cfg, drafter=truncated)
    got = [r.output_ids for r in eng.generate(prompts[:6], params)]
    assert got == [b[: p.max_tokens] for b, p in zip(baseline, params, strict=False)]
    if pad == 4:
        assert 4 in sizes and 2 not in sizes and 3 not in sizes, sorted(set(sizes))
    else:
        assert 2 in sizes, sorted(set(sizes))
    assert eng.allocator.num_free == cfg.kv.num_pages


def _chain_step(eng: GenerationEngine, prompt: list[int]) -> list[int]:
    """Run one prompt and return the first step that emitted >= 3 tokens."""
    eng.add(prompt, GREEDY)
    while eng.has_unfinished():
        for out in eng.step():
            if len(out.new_ids) >= 3:
                return out.new_ids
    raise AssertionError("no accepted chain of length >= 3")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_nothing_emitted_after_eos_or_stop_inside_an_accepted_chain(
    target: LlamaForCausalLM,
    truncated: LlamaForCausalLM,
    prompts: list[list[int]],
    baseline: list[list[int]],
    method: str,
) -> None:
    cfg = GenerationConfig(spec=SpecConfig(method=method, num_draft_tokens=4))
    # find a prompt and a token that sits in the middle of an accepted chain
    for pi in range(1, N_PROMPTS, 2):
        chain = _chain_step(GenerationEngine(target, cfg, drafter=truncated), prompts[pi])
        tok = chain[1]
        if baseline[pi].index(tok) == baseline[pi].index(chain[0]) + 1:
            break  # first occurrence of tok is inside the chain
    else:
        pytest.fail("no prompt with a usable chain")
    cut = baseline[pi].index(tok)

    eng = GenerationEngine(target, cfg, drafter=truncated, eos_ids=[tok])
    [r] = eng.generate([prompts[pi]], GREEDY)
    assert r.output_ids == baseline[pi][:cut] and r.finish_reason == "stop"

    eng = GenerationEngine(target, cfg, drafter=truncated, detokenize=detok)
    stop = SamplingParams(max_tokens=24, stop=(detok([tok]),))
    [r] = eng.generate([prompts[pi]], stop)
    assert r.output_ids == baseline[pi][: cut + 1] and r.finish_reason == "stop"
    assert r.text == detok(baseline[pi][:cut])
    assert eng.allocator.num_free == cfg.kv.num_pages


def test_continuous_batching_with_few_pages_preempts_and_still_matches(
    target: LlamaForCausalLM,
    truncated: LlamaForCausalLM,
    prompts: list[list[int]],
    baseline: list[list[int]],
) -> None:
    """12 pages of 8 tokens for 20 prompts: sequences join as others leave, and some are
    preempted mid-generation and recomputed; output is unchanged."""
    cfg = GenerationConfig(
        kv=KVCacheConfig(num_pages=24, page_size=8),
        max_batch=6,
        spec=SpecConfig(method="draft", num_draft_tokens=3),
    )
    eng = GenerationEngine(target, cfg, drafter=truncated)
    ids = [eng.add(p, GREEDY) for p in prompts[:20]]
    seen_running = set()
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    finished: dict[int, str] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outputs[o.seq_id].extend(o.new_ids)
            if o.finish_reason:
                finished[o.seq_id] = o.finish_reason
        seen_running.add(eng.num_running)
    assert max(seen_running) > 1
    assert set(finished) == set(ids)
    # a preempted sequence re-emits nothing: its stream is exactly its output
    assert [outputs[i] for i in ids] == baseline[:20]
    assert eng.allocator.num_free == 24


def test_batched_equals_one_at_a_time(
    target: LlamaForCausalLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    eng = GenerationEngine(target, GenerationConfig(max_batch=1))
    got = [r.output_ids for r in eng.generate(prompts[:8], GREEDY)]
    assert got == baseline[:8]


def test_backpressure_and_abort(target: LlamaForCausalLM) -> None:
    cfg = GenerationConfig(kv=KVCacheConfig(num_pages=4, page_size=4))
    eng = GenerationEngine(target, cfg)
    with pytest.raises(CapacityError, match="out of pages"):
        eng.add(list(range(10)), SamplingParams(max_tokens=10))
    sid = eng.add([1, 2, 3], SamplingParams(max_tokens=4))
    eng.step()
    assert eng.allocator.num_free < 4
    assert eng.abort(sid) and not eng.has_unfinished()
    assert eng.allocator.num_free == 4


def test_sampled_speculation_is_seeded(
    target: LlamaForCausalLM, truncated: LlamaForCausalLM, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    cfg = GenerationConfig(spec=SpecConfig(method="draft", num_draft_tokens=3))
    a = GenerationEngine(target, cfg, drafter=truncated).generate(prompts[:4], params)
    b = GenerationEngine(target, cfg, drafter=truncated).generate(prompts[:4], params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert all(len(r.output_ids) == 16 for r in a)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_speculation_follows_the_target(
    target: LlamaForCausalLM, truncated: LlamaForCausalLM, method: str
) -> None:
    """Temperature 1: the first token after a fixed prompt, over many seeds, has the same
    distribution with speculation (deterministic n-gram drafts / sampled model drafts) as
    without (chi-square homogeneity)."""
    from scipy.stats import chi2_contingency

    prompt = [5, 9, 5, 9, 5, 9, 5]  # the n-gram drafter always proposes here
    cfg = GenerationConfig(max_batch=64, spec=SpecConfig(method=method, num_draft_tokens=3))
    plain, spec = GenerationEngine(target), GenerationEngine(target, cfg, drafter=truncated)
    counts = []
    for eng in (plain, spec):
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(600)]
        outs = eng.generate([prompt] * 600, params)
        counts.append(
            torch.bincount(torch.tensor([r.output_ids[1] for r in outs]), minlength=VOCAB)
        )
    if method == "ngram":
        assert spec.stats.steps > 0
    table = torch.stack(counts)
    table = table[:, table.sum(0) > 0].numpy()
    assert chi2_contingency(table).pvalue > 0.01


def test_config_errors_name_the_key(target: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="spec.method"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="spec.num_draft_tokens"):
        SpecConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="spec.chain_min_prob"):
        SpecConfig(method="mtp", chain_min_prob=1.0)
    with pytest.raises(ValueError, match="spec.chain_min_prob"):
        SpecConfig(method="ngram", chain_min_prob=0.2)
    with pytest.raises(ValueError, match="spec.chain_min_prob"):
        SpecConfig(method="mtp", chain_min_prob=0.2, tree_nodes=4)
    with pytest.raises(ValueError, match="lookup_min_match is for method 'mtp'"):
        SpecConfig(method="ngram", lookup_min_match=2)
    with pytest.raises(ValueError, match="within ngram_min..ngram_max"):
        SpecConfig(method="mtp", lookup_min_match=5)
    with pytest.raises(ValueError, match="lookup_drafts must be >= 1"):
        SpecConfig(method="mtp", lookup_min_match=2, lookup_drafts=0)
    with pytest.raises(ValueError, match="lookup_drafts must be an int >= 0"):
        SpecConfig(method="mtp", lookup_drafts=True)
    lookup = SpecConfig(method="mtp", num_draft_tokens=2, tree_nodes=4, lookup_min_match=3)
    assert lookup.max_drafts == 5 and lookup.max_fed_drafts == 5
    with pytest.raises(ValueError, match="generation.max_batch"):
        GenerationConfig(max_batch=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        GenerationEngine(target, GenerationConfig(spec=SpecConfig(method="draft")))


def test_a_request_whose_draw_fails_fails_alone(
    target: LlamaForCausalLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence whose draw raises (as NaN probabilities once made torch.multinomial do)
    is dropped with its error; the greedy neighbour in the same steps finishes exactly as
    alone, and every page comes back."""
    from tiny_configs import fail_draws_of_seed

    import rose.generate as generate

    cfg = GenerationConfig(max_batch=4)
    alone = GenerationEngine(target, cfg).generate([prompts[0]], GREEDY)[0].output_ids
    fail_draws_of_seed(monkeypatch)  # seed 13
    doomed = SamplingParams(max_tokens=8, temperature=1.0, seed=13)
    eng = GenerationEngine(target, cfg)
    good, bad = eng.add(prompts[0], GREEDY), eng.add(prompts[1], doomed)
    emitted: dict[int, list[int]] = {good: [], bad: []}
    errors: dict[int, str] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.error is not None:
                errors[o.seq_id] = o.error
            else:
                emitted[o.seq_id] += o.new_ids
    assert list(errors) == [bad] and "inf, nan" in errors[bad]
    assert emitted == {good: alone, bad: []}
    assert eng.allocator.num_free == cfg.kv.num_pages
    with pytest.raises(generate.GenerationFailed, match="inf, nan"):
        eng.generate([prompts[1]], doomed)
