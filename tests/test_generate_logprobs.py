"""Generation logprobs (`SamplingParams.logprobs`) on a small random Llama, against
`transformers` on the same weights: each emitted token's logprob and its top alternatives
are ``log_softmax`` of the reference's logits at the position that produced it, with and
without speculation (accepted drafts carry the target's numbers, not the drafter's), for
greedy and sampled requests, and requests that did not ask get none; the numbers are the
model's own under penalties and a logit bias; prompt logprobs (`SamplingParams.prompt_logprobs`)
score every prompt token after the first, however the prompt is fed (chunked, preempted,
after a cached prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tiny_configs
import torch
import transformers

import rose.scheduler
from rose.generate import GenerationConfig, GenerationEngine, GenerationResult
from rose.kv.allocator import KVCacheConfig
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams, TokenLogprob, token_logprobs
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead, MTPHeadConfig

VOCAB = 97
TOL = 1e-4  # fp32 CPU, max abs logprob difference
TOP = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """(transformers reference, the same weights loaded by rose)."""
    return tiny_configs.llama_pair(Path(tmp_path_factory.mktemp("logprobs")) / "llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(8):
        ids = torch.randint(0, VOCAB, (4 + (i * 5) % 17,), generator=g).tolist()
        out.append(ids + ids[: len(ids) // 2] if i % 2 else ids)  # repeats: n-gram drafts
    return out


def reference(ref: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the reference's logits at every position that produced an output
    token: ``[len(output), V]``."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = ref(ids).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def check(ref: torch.nn.Module, prompt: list[int], r: GenerationResult, top: int) -> None:
    assert r.logprobs is not None
    assert len(r.logprobs) == len(r.output_ids)
    want = reference(ref, prompt, r.output_ids)
    for t, (tok, got) in enumerate(zip(r.output_ids, r.logprobs, strict=True)):
        assert got.logprob == pytest.approx(want[t, tok].item(), abs=TOL), t
        values, ids = want[t].topk(top)
        assert list(got.top_logprobs) == pytest.approx(values.tolist(), abs=TOL), t
        assert list(got.top_ids) == ids.tolist(), t


def test_greedy_logprobs_equal_transformers(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]]
) -> None:
    ref, ours = models
    eng = GenerationEngine(ours, GenerationConfig(max_batch=4))
    results = eng.generate(prompts, SamplingParams(max_tokens=12, logprobs=TOP))
    for prompt, r in zip(prompts, results, strict=True):
        check(ref, prompt, r, TOP)
        # greedy: the emitted token is the most likely one
        assert all(
            lp.top_ids[0] == tok for lp, tok in zip(r.logprobs or [], r.output_ids, strict=True)
        )


def _spec_engine(ours: LlamaForCausalLM, method: str) -> GenerationEngine:
    torch.manual_seed(4)
    if method == "draft-self":  # the target drafting for itself: every draft is kept
        spec = SpecConfig(method="draft", num_draft_tokens=3)
        return GenerationEngine(ours, GenerationConfig(max_batch=4, spec=spec), drafter=ours)
    if method.startswith("mtp"):
        head = MTPHead(MTPHeadConfig.for_target(ours.config)).eval()
        chain = "on" if method == "mtp-device" else "off"
        widths = (3, 2) if method == "mtp-tree" else ()
        spec = SpecConfig(method="mtp", num_draft_tokens=3, device_chain=chain, tree_widths=widths)
        return GenerationEngine(ours, GenerationConfig(max_batch=4, spec=spec), mtp_head=head)
    spec = SpecConfig(method=method, num_draft_tokens=4)
    return GenerationEngine(ours, GenerationConfig(max_batch=4, spec=spec))


@pytest.mark.parametrize("method", ["ngram", "draft-self", "mtp-tree", "mtp-device"])
def test_speculative_logprobs_equal_plain_logprobs(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]], method: str
) -> None:
    """Accepted drafts get the target's logprobs at the rows that verified them: the
    numbers (and tokens) equal decoding without speculation, and transformers'."""
    ref, ours = models
    params = SamplingParams(max_tokens=16, logprobs=TOP)
    plain = GenerationEngine(ours, GenerationConfig(max_batch=4)).generate(prompts, params)
    eng = _spec_engine(ours, method)
    results = eng.generate(prompts, params)
    if method in ("ngram", "draft-self"):
        assert eng.stats.accepted > 0  # drafts were kept, so their rows were read
    for prompt, a, b in zip(prompts, plain, results, strict=True):
        assert b.output_ids == a.output_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.logprob == pytest.approx(x.logprob, abs=TOL)
            assert y.top_ids == x.top_ids
            assert list(y.top_logprobs) == pytest.approx(list(x.top_logprobs), abs=TOL)
        check(ref, prompt, b, TOP)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_sampled_tokens_get_their_raw_logprob(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]], method: str
) -> None:
    """Temperature and top-p shape the draw, not the reported numbers (raw logprobs)."""
    ref, ours = models
    spec = SpecConfig(method=method, num_draft_tokens=3)
    eng = GenerationEngine(ours, GenerationConfig(max_batch=4, spec=spec))
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=i, logprobs=2)
        for i in range(len(prompts))
    ]
    for prompt, r in zip(prompts, eng.generate(prompts, params), strict=True):
        check(ref, prompt, r, 2)


def test_only_requests_that_ask_get_logprobs(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]]
) -> None:
    ref, ours = models
    eng = GenerationEngine(ours, GenerationConfig(max_batch=8))
    params = [
        SamplingParams(max_tokens=6, logprobs=None if i % 3 == 0 else i % 3 - 1)
        for i in range(len(prompts))
    ]
    for i, (prompt, r) in enumerate(zip(prompts, eng.generate(prompts, params), strict=True)):
        if i % 3 == 0:
            assert r.logprobs is None
        else:
            check(ref, prompt, r, i % 3 - 1)  # logprobs=0: the token's own, no alternatives


def test_logprobs_stop_with_the_output(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]]
) -> None:
    """An EOS inside an accepted chain (the target drafting for itself keeps every draft)
    ends the output; the logprobs end with it, one per emitted token."""
    ref, ours = models
    params = SamplingParams(max_tokens=16, logprobs=1)
    [plain] = GenerationEngine(ours).generate([prompts[1]], params)
    eos = plain.output_ids[5]
    stop_at = plain.output_ids.index(eos)
    spec = SpecConfig(method="draft", num_draft_tokens=4)
    eng = GenerationEngine(ours, GenerationConfig(spec=spec), drafter=ours, eos_ids=(eos,))
    [r] = eng.generate([prompts[1]], params)
    assert r.output_ids == plain.output_ids[:stop_at]
    assert r.finish_reason == "stop"
    check(ref, prompts[1], r, 1)


@pytest.mark.parametrize("adjust", ["logit_bias", "penalties"])
def test_logprobs_are_the_models_own_under_penalties_and_bias(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]], adjust: str
) -> None:
    """Penalties and a logit bias change which tokens are drawn, not the numbers reported
    for them (vLLM's raw logprobs): each is log_softmax of transformers' plain logits."""
    ref, ours = models
    if adjust == "logit_bias":  # forces token 7 wherever the bias wins
        over: dict[str, Any] = {"logit_bias": ((7, 30.0), (3, -50.0))}
    else:
        over = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    params = SamplingParams(max_tokens=10, logprobs=TOP, **over)
    plain = GenerationEngine(ours).generate(prompts[:4], SamplingParams(max_tokens=10))
    results = GenerationEngine(ours, GenerationConfig(max_batch=4)).generate(prompts[:4], params)
    assert any(
        a.output_ids != b.output_ids for a, b in zip(plain, results, strict=True)
    )  # the adjustment did change the draw
    if adjust == "logit_bias":
        assert all(7 in r.output_ids and 3 not in r.output_ids for r in results)
    for prompt, r in zip(prompts[:4], results, strict=True):
        check(ref, prompt, r, TOP)


def prompt_reference(ref: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the reference's logits at every prompt position but the last:
    ``[len(prompt) - 1, V]``, row ``t`` the distribution of ``prompt[t + 1]``."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize("feed", ["whole", "step-budget", "chunk-cap", "preempted", "cached"])
def test_prompt_logprobs_equal_transformers(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
    prompts: list[list[int]],
    feed: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every prompt token after the first gets its logprob and top alternatives under the
    tokens before it, from transformers' logits over the whole prompt, and the output is
    what a request without them generates: fed in one pass, in chunks of a step budget,
    in chunks of the scoring cap (`rose.scheduler.PROMPT_LOGPROBS_CHUNK`), preempted and
    recomputed partway, or after its prompt's pages were cached by an earlier request
    (which it must not adopt: their logits were never computed for it)."""
    ref, ours = models
    config = GenerationConfig(max_batch=4)
    if feed == "step-budget":
        config = GenerationConfig(max_batch=4, max_step_tokens=6)
    elif feed == "chunk-cap":
        monkeypatch.setattr(rose.scheduler, "PROMPT_LOGPROBS_CHUNK", 5)
    elif feed == "preempted":  # 12 pages of 4 tokens for 8 prompts of up to 31 tokens
        config = GenerationConfig(
            kv=KVCacheConfig(num_pages=12, page_size=4), max_batch=4, max_step_tokens=8
        )
    preempted = []
    original = rose.scheduler.Scheduler._preempt
    monkeypatch.setattr(
        rose.scheduler.Scheduler,
        "_preempt",
        lambda self, r: (preempted.append(r.seq_id), original(self, r)),
    )
    eng = GenerationEngine(ours, config)
    plain = GenerationEngine(ours, config).generate(prompts, SamplingParams(max_tokens=8))
    if feed == "cached":
        eng.generate(prompts, SamplingParams(max_tokens=1))
        assert eng.prefix_cache is not None and eng.prefix_cache.stats.hit_tokens == 0
    params = [SamplingParams(max_tokens=8, prompt_logprobs=i % 3) for i in range(len(prompts))]
    results = eng.generate(prompts, params)
    if feed == "preempted":
        assert preempted
    for i, (prompt, r, p) in enumerate(zip(prompts, results, plain, strict=True)):
        assert r.output_ids == p.output_ids
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(prompt) - 1
        want, top = prompt_reference(ref, prompt), i % 3
        for t, got in enumerate(r.prompt_logprobs):
            assert got.logprob == pytest.approx(want[t, prompt[t + 1]].item(), abs=TOL), t
            values, ids = want[t].topk(top)
            assert list(got.top_ids) == ids.tolist(), t
            assert list(got.top_logprobs) == pytest.approx(values.tolist(), abs=TOL), t
        assert r.logprobs is None  # not asked for
    if feed == "cached":  # the prompts were cached, and the scored ones did not use them
        assert eng.prefix_cache is not None and eng.prefix_cache.stats.hit_tokens == 0
        eng.generate([max(prompts, key=len)], SamplingParams(max_tokens=1))  # one not scoring
        assert eng.prefix_cache.stats.hit_tokens >= eng.page_size


def test_prompt_logprobs_arrive_once_with_the_first_output(
    models: tuple[torch.nn.Module, LlamaForCausalLM], prompts: list[list[int]]
) -> None:
    """On the step stream: the first output of a request that asked carries its prompt's
    logprobs, later ones none; a request that did not ask gets none."""
    _, ours = models
    eng = GenerationEngine(ours, GenerationConfig(max_batch=4, max_step_tokens=6))
    asked = eng.add(prompts[3], SamplingParams(max_tokens=4, prompt_logprobs=1))
    other = eng.add(prompts[5], SamplingParams(max_tokens=4))
    seen: dict[int, list[int | None]] = {asked: [], other: []}
    while eng.has_unfinished():
        for o in eng.step():
            n = None if o.prompt_logprobs is None else len(o.prompt_logprobs)
            seen[o.seq_id].append(n)
    assert seen[asked] == [len(prompts[3]) - 1, None, None, None]
    assert seen[other] == [None] * 4


def test_token_logprobs_leaves_out_forbidden_tokens() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    [t] = token_logprobs(logits, [2], top=3)
    want = torch.log_softmax(logits, -1)
    assert t == TokenLogprob(
        pytest.approx(want[0, 2].item()),  # type: ignore[arg-type]
        (2, 0),
        (pytest.approx(want[0, 2].item()), pytest.approx(want[0, 0].item())),  # type: ignore[arg-type]
    )


def test_logprobs_is_validated() -> None:
    with pytest.raises(ValueError, match="sampling.logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="sampling.logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="sampling.prompt_logprobs must be in 0..20"):
        SamplingParams(prompt_logprobs=21)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any, Any, LlamaForCausalLM]:
    """(transformers model, its tokenizer, grammars, rose model) on the real SmolLM2."""
    from rose.assets import ensure_model
    from rose.grammar import Grammars

    directory = Path(ensure_model("smollm2-135m-instruct"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    grammars = Grammars(directory, ref.config.vocab_size, [SMOL_EOS])
    return ref.eval(), tokenizer, grammars, LlamaForCausalLM.from_pretrained(directory)


SMOL_EOS = 2  # <|im_end|>


@pytest.mark.parametrize("method", ["none", "draft-self"])
def test_constrained_logprobs_are_the_masked_distribution(
    smollm2: tuple[Any, Any, Any, LlamaForCausalLM], method: str
) -> None:
    """Under a response_format the numbers are log_softmax of the target's logits after
    the grammar's mask (the distribution the tokens come from): transformers' logits,
    masked row by row after the output so far, give them; forbidden tokens are never
    among the alternatives."""
    import json

    from rose.grammar import JsonFormat

    ref, tokenizer, grammars, model = smollm2
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    fmt = JsonFormat(json.dumps(schema))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which city is the largest in Japan? Answer in JSON."}],
        add_generation_prompt=True,
    )
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    # the target drafting for itself (unmasked): drafts kept wherever the grammar agrees
    spec = SpecConfig(method="none" if method == "none" else "draft", num_draft_tokens=3)
    engine = GenerationEngine(
        model,
        GenerationConfig(spec=spec),
        drafter=None if method == "none" else model,
        eos_ids=[SMOL_EOS],
        grammars=grammars,
    )
    [r] = engine.generate(
        [prompt], SamplingParams(max_tokens=16, response_format=fmt, logprobs=TOP)
    )
    assert r.logprobs is not None and len(r.logprobs) == len(r.output_ids) > 3
    if method != "none":
        assert engine.stats.accepted > 0
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + r.output_ids])).logits[0].float()
    rows = logits[len(prompt) - 1 : -1].clone()  # [n, V]
    grammars.state(fmt).mask_rows(rows, r.output_ids[:-1])
    want = torch.log_softmax(rows, dim=-1)
    for t, (tok, got) in enumerate(zip(r.output_ids, r.logprobs, strict=True)):
        assert got.logprob == pytest.approx(want[t, tok].item(), abs=TOL), t
        allowed = int(torch.isfinite(want[t]).sum())
        values, ids = want[t].topk(min(TOP, allowed))
        assert list(got.top_logprobs) == pytest.approx(values.tolist(), abs=TOL), t
        assert set(got.top_ids) == set(ids.tolist()), t  # allowed tokens only
    # somewhere the grammar left fewer than TOP tokens: the list is shorter, not padded
    assert any(len(lp.top_ids) < TOP for lp in r.logprobs)
