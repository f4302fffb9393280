"""SmolLM2-135M-Instruct (the real asset): engine logits == transformers, and greedy output
with every speculation method identical to plain greedy on 50 chat prompts (fp32 CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from rose.assets import ensure_model
from rose.attention.metadata import AttentionMetadata
from rose.generate import GenerationConfig, GenerationEngine
from rose.kv import BlockTable, PageAllocator
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig, truncated_drafter
from rose.spec.mtp import MTPHead, MTPHeadConfig

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "Name a famous painting by Leonardo da Vinci.",
    "Suggest a name for a pet turtle.",
    "What is the boiling point of water in Fahrenheit?",
    "Summarize the plot of Cinderella.",
    "What is machine learning?",
    "How many legs does a spider have?",
    "Write a short greeting for a birthday card.",
    "What causes earthquakes?",
    "Recommend a book for a long flight.",
    "What is the difference between weather and climate?",
    "How do vaccines work?",
    "Describe the color orange to someone.",
    "What is the largest planet in our solar system?",
    "Give two tips for better sleep.",
    "What is a prime number?",
]

PASSAGES = [
    "The Amazon rainforest covers about 5.5 million square kilometres and produces a large "
    "share of the world's oxygen. It spans nine countries, with most of it in Brazil.",
    "Python was created by Guido van Rossum and first released in 1991. Its design "
    "philosophy emphasizes code readability with the use of significant indentation.",
    "The Great Wall of China is a series of fortifications built across the northern "
    "borders of ancient Chinese states to protect against nomadic groups.",
    "Honey never spoils because its low moisture and high acidity stop bacteria from "
    "growing. Archaeologists have found edible honey in ancient Egyptian tombs.",
    "The Moon is about 384,400 kilometres from Earth. It always shows the same face to "
    "Earth because its rotation period equals its orbital period.",
]
RAG_QUESTIONS = [
    "Answer using the context.",
    "What does the context say? Quote it.",
    "Repeat the first sentence of the context.",
    "Summarize the context in its own words.",
    "What is the key fact in the context?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smol() -> Path:
    return ensure_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def model(smol: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(smol)


@pytest.fixture(scope="module")
def tokenizer(smol: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(smol)


def _chat(tok: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    texts = list(QUESTIONS)
    texts += [f"Context: {p}\n\nQuestion: {q}" for p in PASSAGES for q in RAG_QUESTIONS]
    assert len(texts) == 50
    return [_chat(tokenizer, t) for t in texts]


@pytest.mark.parametrize("packed", [False, True], ids=["F.linear", "packed"])
def test_logits_match_transformers(smol: Path, prompts: list[list[int]], packed: bool) -> None:
    model = LlamaForCausalLM.from_pretrained(smol, packed=packed)
    ref = transformers.LlamaForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    ids = prompts[30]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        table = BlockTable(PageAllocator(32), 16)
        table.reserve(len(ids))
        meta = AttentionMetadata.build([(table, 0, len(ids))])
        got = model(torch.tensor(ids), meta, model.new_cache(32, 16)).logits
    # With F.linear both sides run the same MKL kernels: the model code must agree to 1e-4.
    # Packed oneDNN weights (rose.packed, the serving default on CPU) add up the same fp32
    # products in another order; over 30 layers that moves logits (magnitude ~20) by a few
    # 1e-4, i.e. ~2e-5 relative, fp32 rounding and nothing more. The argmax must not move.
    torch.testing.assert_close(got, want, atol=1e-3 if packed else 1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def baseline(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    eng = GenerationEngine(
        model, GenerationConfig(max_batch=50), eos_ids=model.config.eos_token_ids
    )
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp", "mtp-tree"])
def test_speculative_greedy_identical_on_50_prompts(
    model: LlamaForCausalLM,
    tokenizer: transformers.PreTrainedTokenizerBase,
    prompts: list[list[int]],
    baseline: list[list[int]],
    method: str,
) -> None:
    assert "Paris" in tokenizer.decode(baseline[0])  # the model really answers
    drafter = truncated_drafter(model, 8) if method == "draft" else None
    head = None
    if method == "mtp-tree":  # draft trees (rose.spec.tree) in a padded batch of 50
        spec = SpecConfig(method="mtp", num_draft_tokens=2, tree_widths=(3, 2))
    else:
        spec = SpecConfig(method=method, num_draft_tokens=4)
    if method.startswith("mtp"):  # an untrained head: proves the path is lossless, not fast
        torch.manual_seed(0)
        head = MTPHead(MTPHeadConfig.for_target(model.config)).eval()
    cfg = GenerationConfig(max_batch=50, spec=spec)
    eng = GenerationEngine(
        model, cfg, drafter=drafter, mtp_head=head, eos_ids=model.config.eos_token_ids
    )
    got = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    mismatches = [i for i, (a, b) in enumerate(zip(got, baseline, strict=True)) if a != b]
    assert mismatches == [], f"prompts whose speculative output differs: {mismatches}"
    assert eng.stats.drafted > 0
    if not method.startswith("mtp"):
        assert eng.stats.accepted > 0
