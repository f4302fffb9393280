"""OpenAI's presence and frequency penalties and logit_bias on SmolLM2-135M-Instruct (the
real asset): greedy output equals a token-by-token loop over transformers' logits with
OpenAI's formulas applied by hand (logit + bias - frequency * count - presence *
[count > 0], counts over the output so far), and every speculation method gives the same
output as plain decoding."""

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


def test_tulip_carries_the_penalties_and_refuses_them_out_of_range() -> None:
    from protos.trellis.v1 import inference_pb2 as pb
    from tulip.errors import InvalidInput
    from tulip.inputs import ModelLimits, generate_work

    limits = ModelLimits(
        kind="generator", vocab_size=100, max_input_tokens=64, dimensions=0, default_normalize=False
    )

    def work(**sampling: object) -> dict[str, object]:
        request = pb.GenerateRequest(
            prompt_ids=(1).to_bytes(4, "little"), sampling=pb.SamplingOptions(**sampling)
        )
        return generate_work(request, limits).sampling_kwargs(4)

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
