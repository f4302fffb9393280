"""OpenAI's presence and frequency penalties and logit_bias, and vLLM's repetition_penalty,
min_tokens and min_p, on SmolLM2-135M-Instruct (the real asset): greedy output equals a
token-by-token loop over transformers' logits with OpenAI's formulas applied by hand
(logit + bias - frequency * count - presence * [count > 0], counts over the output so far)
or transformers' own logits processors (RepetitionPenalty, MinNewTokensLength, MinP), and
every speculation method gives the same output as plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from rose.assets import ensure_model
from rose.generate import GenerationConfig, GenerationEngine
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams, adjust_logits
from rose.spec import SpecConfig, truncated_drafter
from rose.spec.mtp import MTPHead, MTPHeadConfig

# Prompts whose greedy answers repeat themselves, so the penalties change them.
TEXTS = [
    "List the numbers from one to twenty, separated by commas.",
    "Repeat the word 'echo' ten times.",
    "Write a poem in which every line starts with 'The rain'.",
    "Context: The Moon is about 384,400 kilometres from Earth. It always shows the same "
    "face to Earth.\n\nQuestion: Repeat the first sentence of the context twice.",
]
TOKENS = 24
COMMA, THE = 28, 378  # SmolLM2's "," and " The"
NO_BIAS: tuple[tuple[int, float], ...] = ()
# (presence, frequency, logit_bias)
PENALTIES = [
    (0.0, 1.5, NO_BIAS),
    (1.0, 0.0, NO_BIAS),
    (0.6, 0.8, NO_BIAS),
    (-0.5, 0.0, NO_BIAS),
    (0.0, 0.0, ((COMMA, -100.0), (THE, 4.0))),
    (0.6, 0.8, ((COMMA, -3.0),)),
]


@pytest.fixture(scope="module")
def smol() -> Path:
    return ensure_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(smol: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(smol)
    out = []
    for text in TEXTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


@pytest.fixture(scope="module")
def references(smol: Path, prompts: list[list[int]]) -> dict[tuple, list[list[int]]]:
    """transformers' greedy loop with the bias and penalties applied to its logits by hand."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    out: dict[tuple, list[list[int]]] = {}
    with torch.no_grad():
        for presence, frequency, bias in [(0.0, 0.0, NO_BIAS), *PENALTIES]:
            rows = []
            for prompt in prompts:
                generated: list[int] = []
                past, feed = None, torch.tensor([prompt])
                for _ in range(TOKENS):
                    step = model(input_ids=feed, past_key_values=past, use_cache=True)
                    past = step.past_key_values
                    logits = step.logits[0, -1].clone()
                    for token, value in bias:
                        logits[token] += value
                    counts = torch.bincount(
                        torch.tensor(generated, dtype=torch.int64), minlength=logits.numel()
                    ).float()
                    logits -= frequency * counts + presence * (counts > 0).float()
                    token = int(logits.argmax())
                    generated.append(token)
                    feed = torch.tensor([[token]])
                rows.append(generated)
            out[presence, frequency, bias] = rows
    return out


@pytest.fixture(scope="module")
def model(smol: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(smol)


def _generate(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    presence: float,
    frequency: float,
    bias: tuple[tuple[int, float], ...] = NO_BIAS,
    method: str | None = None,
) -> list[list[int]]:
    drafter, head, spec = None, None, None
    if method == "mtp-tree":
        spec = SpecConfig(method="mtp", num_draft_tokens=2, tree_widths=(3, 2))
    elif method is not None:
        spec = SpecConfig(method=method, num_draft_tokens=4)
    if method == "draft":
        drafter = truncated_drafter(model, 8)
    if method is not None and method.startswith("mtp"):
        torch.manual_seed(0)  # an untrained head: the path is lossless, not fast
        head = MTPHead(MTPHeadConfig.for_target(model.config)).eval()
    cfg = GenerationConfig(max_batch=len(prompts), **({"spec": spec} if spec else {}))
    eng = GenerationEngine(
        model, cfg, drafter=drafter, mtp_head=head, eos_ids=model.config.eos_token_ids
    )
    params = SamplingParams(
        max_tokens=TOKENS,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=bias,
    )
    return [r.output_ids for r in eng.generate(prompts, params)]


@pytest.mark.parametrize(("presence", "frequency", "bias"), PENALTIES)
def test_penalized_greedy_equals_transformers_with_openais_formula(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    references: dict[tuple, list[list[int]]],
    presence: float,
    frequency: float,
    bias: tuple[tuple[int, float], ...],
) -> None:
    got = _generate(model, prompts, presence, frequency, bias)
    assert got == references[presence, frequency, bias]
    plain = references[0.0, 0.0, NO_BIAS]
    assert _generate(model, prompts, 0.0, 0.0) == plain
    changed = [i for i, row in enumerate(got) if row != plain[i]]
    assert changed, "the adjustments changed no answer: the test could not fail"
    if bias and bias[0][1] == -100.0:
        assert all(COMMA not in row for row in got)  # banned
        assert any(COMMA in row for row in plain)


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp", "mtp-tree"])
def test_speculation_keeps_penalized_greedy_output(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    references: dict[tuple, list[list[int]]],
    method: str,
) -> None:
    """Each verified row is penalized after the drafts before it, so drafts the plain
    decoder would not emit are rejected (a draft tree is dropped: its rows follow several
    paths)."""
    for presence, frequency, bias in PENALTIES[4:]:
        got = _generate(model, prompts, presence, frequency, bias, method)
        assert got == references[presence, frequency, bias]


def test_each_verified_row_is_penalized_after_the_drafts_before_it() -> None:
    """Row j of a verified pass (the pending token's, then each draft's) is what plain
    decoding sees at that position: the output so far plus drafts 0..j-1."""
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    generated, drafts = [1, 1, 4], [4, 7]
    got = logits.clone()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((7, 2.0),))
    adjust_logits(got, generated, drafts, params)
    for j in range(3):
        seen = generated + drafts[:j]
        want = logits[j].clone()
        want[7] += 2.0
        for token in set(seen):
            want[token] -= 0.25 * seen.count(token) + 0.5
        torch.testing.assert_close(got[j], want)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.01, -2.5, float("nan")])
def test_penalties_outside_openais_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="sampling.logit_bias"):
        SamplingParams(logit_bias=((5, value * 50),))


def work(**sampling: object) -> dict[str, object]:
    """Tulip's reading of a Generate request with these sampling options (a one-token
    prompt, a 100-token vocabulary, a 64-token context), as SamplingParams' arguments."""
    from protos.trellis.v1 import inference_pb2 as pb
    from tulip.inputs import ModelLimits, generate_work

    limits = ModelLimits(
        kind="generator", vocab_size=100, max_input_tokens=64, dimensions=0, default_normalize=False
    )
    request = pb.GenerateRequest(
        prompt_ids=(1).to_bytes(4, "little"), sampling=pb.SamplingOptions(**sampling)
    )
    return generate_work(request, limits).sampling_kwargs(4)


def test_tulip_carries_the_penalties_and_refuses_them_out_of_range() -> None:
    from tulip.errors import InvalidInput

    got = work(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={7: -100.0, 2: 1.5})
    assert (got["presence_penalty"], got["frequency_penalty"]) == (1.5, -0.5)
    assert got["logit_bias"] == ((2, 1.5), (7, -100.0))
    assert (work()["presence_penalty"], work()["frequency_penalty"]) == (0.0, 0.0)
    for bias in ({100: 1.0}, {3: 100.5}, {3: float("nan")}):
        with pytest.raises(InvalidInput, match="sampling.logit_bias"):
            work(logit_bias=bias)
    for field in ("presence_penalty", "frequency_penalty"):
        for value in (2.5, -3.0, float("nan")):
            with pytest.raises(InvalidInput, match=f"sampling.{field}"):
                work(**{field: value})


# ---- vLLM's repetition_penalty, min_tokens and min_p --------------------------------------

SHORT = "What is 2 + 2?"  # its greedy answer ends (EOS) well before TOKENS
# (repetition_penalty, min_tokens)
VLLM = [(1.3, 0), (0.8, 0), (1.0, 16), (1.2, 16)]


@pytest.fixture(scope="module")
def vllm_prompts(smol: Path, prompts: list[list[int]]) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(smol)
    ids = tok.apply_chat_template([{"role": "user", "content": SHORT}], add_generation_prompt=True)
    return [*prompts[:2], list(ids if isinstance(ids, list) else ids["input_ids"])]


@pytest.fixture(scope="module")
def vllm_references(
    smol: Path, vllm_prompts: list[list[int]], model: LlamaForCausalLM
) -> dict[tuple[float, int], list[list[int]]]:
    """transformers' greedy loop under its own RepetitionPenalty (prompt + output) and
    MinNewTokensLength (the EOS held back) processors, stopping at EOS (not kept)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    eos = list(model.config.eos_token_ids)
    out: dict[tuple[float, int], list[list[int]]] = {}
    with torch.no_grad():
        for repetition, min_tokens in [(1.0, 0), *VLLM]:
            rows = []
            for prompt in vllm_prompts:
                processors = [
                    transformers.MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos),
                    transformers.RepetitionPenaltyLogitsProcessor(repetition),
                ]
                ids, past, feed = list(prompt), None, torch.tensor([prompt])
                while len(ids) - len(prompt) < TOKENS:
                    step = hf(input_ids=feed, past_key_values=past, use_cache=True)
                    past = step.past_key_values
                    scores = step.logits[:, -1].clone()
                    for process in processors:
                        scores = process(torch.tensor([ids]), scores)
                    token = int(scores.argmax())
                    if token in eos:
                        break
                    ids.append(token)
                    feed = torch.tensor([[token]])
                rows.append(ids[len(prompt) :])
            out[repetition, min_tokens] = rows
    return out


def _generate_vllm(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    repetition: float,
    min_tokens: int,
    method: str | None = None,
) -> list[list[int]]:
    spec = None
    if method == "mtp-tree":
        spec = SpecConfig(method="mtp", num_draft_tokens=2, tree_widths=(3, 2))
    elif method is not None:
        spec = SpecConfig(method=method, num_draft_tokens=4)
    drafter = truncated_drafter(model, 8) if method == "draft" else None
    head = None
    if method is not None and method.startswith("mtp"):
        torch.manual_seed(0)
        head = MTPHead(MTPHeadConfig.for_target(model.config)).eval()
    cfg = GenerationConfig(max_batch=len(prompts), **({"spec": spec} if spec else {}))
    eng = GenerationEngine(
        model, cfg, drafter=drafter, mtp_head=head, eos_ids=model.config.eos_token_ids
    )
    params = SamplingParams(max_tokens=TOKENS, repetition_penalty=repetition, min_tokens=min_tokens)
    return [r.output_ids for r in eng.generate(prompts, params)]


@pytest.mark.parametrize(("repetition", "min_tokens"), VLLM)
def test_vllm_repetition_penalty_and_min_tokens_equal_transformers_processors(
    model: LlamaForCausalLM,
    vllm_prompts: list[list[int]],
    vllm_references: dict[tuple[float, int], list[list[int]]],
    repetition: float,
    min_tokens: int,
) -> None:
    got = _generate_vllm(model, vllm_prompts, repetition, min_tokens)
    assert got == vllm_references[repetition, min_tokens]
    plain = vllm_references[1.0, 0]
    assert _generate_vllm(model, vllm_prompts, 1.0, 0) == plain
    assert got != plain, "the settings changed no answer: the test could not fail"
    if min_tokens:
        assert len(plain[2]) < min_tokens <= len(got[2])  # the EOS was held back


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp", "mtp-tree"])
def test_speculation_keeps_vllm_adjusted_greedy_output(
    model: LlamaForCausalLM,
    vllm_prompts: list[list[int]],
    vllm_references: dict[tuple[float, int], list[list[int]]],
    method: str,
) -> None:
    got = _generate_vllm(model, vllm_prompts, 1.2, 16, method)
    assert got == vllm_references[1.2, 16]


def test_each_verified_row_gets_repetition_and_min_tokens_after_the_drafts_before_it() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    prompt, generated, drafts, stop = [9], [1, 4], [3, 6], {6, 8}
    got = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, min_tokens=4)
    adjust_logits(got, generated, drafts, params, prompt=prompt, stop_ids=stop)
    for j in range(3):
        want = logits[j].clone()
        for token in set(prompt + generated + drafts[:j]):
            want[token] = want[token] / 1.5 if want[token] > 0 else want[token] * 1.5
        if len(generated) + j < 4:  # this row's token would be among the first 4
            want[sorted(stop)] = float("-inf")
        torch.testing.assert_close(got[j], want)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_keeps_what_transformers_min_p_keeps(min_p: float) -> None:
    from rose.sampling import token_probs

    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 3
    got = token_probs(logits, SamplingParams(temperature=0.7, min_p=min_p))
    scores = transformers.TemperatureLogitsWarper(0.7)(None, logits.clone())
    want = transformers.MinPLogitsWarper(min_p)(None, scores).softmax(-1)
    torch.testing.assert_close(got, want)
    assert ((got > 0).sum(-1) < 50).all()  # it dropped tokens: the test could fail


def test_min_tokens_ignores_stop_strings_that_end_before_it() -> None:
    from rose.sampling import StopChecker

    def text(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    checker = StopChecker(SamplingParams(max_tokens=8, stop=("bc",), min_tokens=3), (), text)
    assert [checker.check([1, 2][:n]) for n in (1, 2)] == [None, None]  # "bc" at 2 tokens
    assert checker.check([1, 2, 0]) is None
    assert checker.check([1, 2, 0, 1, 2]) == "stop"  # a later "bc" ends it
    assert checker.text == "bca"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("min_p", 1.5),
        ("min_tokens", 300),
    ],
)
def test_vllm_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**{field: value})


def test_tulip_carries_vllm_settings_and_refuses_them_out_of_range() -> None:
    from tulip.errors import InvalidInput

    got = work(repetition_penalty=1.25, min_p=0.25, min_tokens=3, max_tokens=4)
    assert (got["repetition_penalty"], got["min_p"], got["min_tokens"]) == (1.25, 0.25, 3)
    default = work()
    assert (default["repetition_penalty"], default["min_p"], default["min_tokens"]) == (1.0, 0, 0)
    for field, value in (
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("nan")),
        ("min_p", 1.5),
        ("min_tokens", 5),  # over max_tokens
    ):
        with pytest.raises(InvalidInput, match=f"sampling.{field}"):
            work(**{field: value, "max_tokens": 4})
