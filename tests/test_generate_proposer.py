"""The engine's seams: a drafter added in one file through the `Proposer` protocol (here, in
this file) without touching the scheduler or the runner, and chunked prefill under a
per-step token budget. Greedy output stays exactly plain greedy's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from rose.generate import GenerationConfig, GenerationEngine
from rose.kv import KVCacheConfig
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.scheduler import Request
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead, MTPHeadConfig
from rose.spec.proposer import (
    Proposal,
    Proposer,
    ProposerInputs,
    Verified,
    kv_copies_of,
    proposer_methods,
    register_proposer,
)

VOCAB = 128
GREEDY = SamplingParams(max_tokens=20)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (3 + (i * 5) % 29,), generator=g).tolist() for i in range(12)]


@pytest.fixture(scope="module")
def baseline(target: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]


class TableProposer:
    """Drafts from a fixed table: for a known prompt, the continuation the table holds for
    it, with every ``wrong_every``-th table position replaced by a wrong token (so the
    target rejects some drafts). No cache, no state to roll back."""

    kv_copies = 0
    target_features = False

    def __init__(self, table: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.table = table
        self.wrong_every = wrong_every
        self.accepted: list[Verified] = []

    def propose(self, todo: Sequence[tuple[Request, int]]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for r, k in todo:
            cont = self.table.get(tuple(r.tokens[: r.prompt_len]), [])
            at = len(r.output_ids)
            drafts = [
                (t + 1) % VOCAB if (at + j) % self.wrong_every == 0 else t
                for j, t in enumerate(cont[at : at + k])
            ]
            out.append(Proposal(drafts) if drafts else None)
        return out

    def accept(self, request: Request, verified: Verified) -> None:
        self.accepted.append(verified)


def test_a_drafter_defined_in_one_file_plugs_in(
    target: LlamaForCausalLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    table = {tuple(p): b for p, b in zip(prompts, baseline, strict=True)}
    built: list[TableProposer] = []

    def build(inputs: ProposerInputs) -> TableProposer:
        assert inputs.spec.method == "fixed-table"
        built.append(TableProposer(table, wrong_every=7))
        return built[-1]

    register_proposer("fixed-table", build)
    assert "fixed-table" in proposer_methods()
    spec = SpecConfig(method="fixed-table", num_draft_tokens=4)
    cfg = GenerationConfig(kv=KVCacheConfig(num_pages=64, page_size=8), max_batch=5, spec=spec)
    eng = GenerationEngine(target, cfg)
    [proposer] = built
    assert isinstance(proposer, Proposer)
    got = [r.output_ids for r in eng.generate(prompts, GREEDY)]
    assert got == baseline
    st = eng.stats
    assert 0 < st.accepted < st.drafted, st.as_dict()  # kept and rejected drafts both seen
    assert any(v.drafts and len(v.path) == v.drafts for v in proposer.accepted)
    assert eng.allocator.num_free == cfg.kv.num_pages
    with pytest.raises(ValueError, match="built in"):
        register_proposer("ngram", build)
    # A server sizes its page pool by the registered kv_copies before building anything;
    # a proposer that keeps another number is refused when built.
    copies = {"none": 0, "ngram": 0, "draft": 1, "mtp": 1, "fixed-table": 0}
    assert {m: kv_copies_of(m) for m in copies} == copies
    register_proposer("miscounted", lambda _: TableProposer(table, wrong_every=7), kv_copies=1)
    with pytest.raises(ValueError, match="registered with kv_copies=1"):
        GenerationEngine(target, replace(cfg, spec=SpecConfig(method="miscounted")))


@pytest.mark.parametrize(
    ("budget", "method"),
    [(4, "none"), (7, "ngram"), (5, "table"), (6, "draft"), (5, "mtp"), (9, "mtp-device")],
)
def test_chunked_prefill_under_a_token_budget_keeps_greedy_output(
    target: LlamaForCausalLM,
    prompts: list[list[int]],
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    budget: int,
    method: str,
) -> None:
    """Every pass feeds at most ``budget`` tokens (prompts up to 31 tokens go in chunks,
    drafts that do not fit are dropped), with every kind of proposer; output and page
    accounting are unchanged."""
    torch.manual_seed(4)
    drafter = LlamaForCausalLM(replace(target.config, num_hidden_layers=1)).eval()
    head = MTPHead(MTPHeadConfig.for_target(target.config)).eval()
    table = {tuple(p): b for p, b in zip(prompts, baseline, strict=True)}
    register_proposer("table", lambda _: TableProposer(table, wrong_every=3))
    sizes: list[int] = []
    real = target.forward

    def spy(ids: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(ids.shape[0])
        return real(ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(target, "forward", spy)
    chain = "on" if method == "mtp-device" else "off"
    spec = SpecConfig(method=method.removesuffix("-device"), num_draft_tokens=3, device_chain=chain)
    cfg = GenerationConfig(max_batch=4, max_step_tokens=budget, spec=spec)
    eng = GenerationEngine(target, cfg, drafter=drafter, mtp_head=head)
    got = [r.output_ids for r in eng.generate(prompts, GREEDY)]
    assert got == baseline
    assert max(sizes) <= budget, sorted(set(sizes))
    assert eng.allocator.num_free == cfg.kv.num_pages


def test_max_step_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="generation.max_step_tokens"):
        GenerationConfig(max_batch=8, max_step_tokens=7)
