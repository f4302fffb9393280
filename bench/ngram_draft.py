"""Choose how long prompt lookup drafts (`SpecConfig.ngram_draft_per_match`) on prompts
nobody else uses, by replaying greedy answers.

Greedy speculative decoding emits exactly the plain greedy answer, and prompt lookup
(`rose.spec.ngram.NgramDrafter`) drafts from the tokens so far alone, so which drafts a
policy proposes and how many of them the target keeps follow from the plain answer: a
policy's steps can be replayed without the model. What a step costs is this machine's
verification pass over its fed tokens (measured here, as `bench.spec` does), so each
policy's speed-up is predicted without run-to-run noise, and every policy is judged on the
same answers.

- Tuning prompts: 20 RAG prompts (two passages from the Python documentation topics the
  interpreter ships, `pydoc_data`, and a question on one of them: copy it, quote from it,
  summarize it, explain it) and the 16 chat prompts of `bench.chain_stop` (after the MTP
  head's training corpus in its seeded sequence); neither set is `bench.spec`'s, which
  measures the result end to end.
- Policies: fixed drafts of 4 / 8 / 16 tokens, the adaptive rule (`SpecConfig.adaptive_k`,
  up to 16), and drafts of up to ``a`` tokens per token of the matched suffix (up to 16)
  for each ``a`` of the grid.
- Check: the chosen policy also runs through the real engine on every tuning prompt; its
  output must equal plain greedy and its steps, drafted and kept tokens must equal the
  replay's.

Writes bench/results/ngram_draft.md, naming the best ``a`` on the RAG prompts; Tulip's
``--spec ngram`` default (``--spec-ngram-per-match``) is the value chosen here.

    python -m bench ngram_draft [--max-tokens=96] [--grid=2,3,4,5,6,8]
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench import chain_stop
from bench import spec as bench_spec
from bench.report import machine

if TYPE_CHECKING:
    from rose.models.llama import LlamaForCausalLM

__all__ = ["Policy", "main", "rag_tuning_prompts", "replay"]

RESULTS = Path(__file__).parent / "results"
K_MAX = 16
COST_ROUNDS = 21  # passes per size, interleaved over sizes (the prices' medians)
RAG_PROMPTS = 20
RAG_QUESTIONS = (
    "Copy passage [{i}] exactly.",
    "What does passage [{i}] say? Quote it.",
    "Quote the first sentence of passage [{i}].",
    "Summarize passage [{i}] in one sentence.",
    "Using the context, explain the topic of passage [{i}].",
)


def rag_tuning_prompts(n: int = RAG_PROMPTS, seed: int = 7) -> list[str]:
    """``n`` prompts of two documentation paragraphs (prose of 150-450 characters from the
    interpreter's `pydoc_data` topics, seeded order) and a question on one of them."""
    from rose.spec.corpus import _pydoc_topics

    topics = _pydoc_topics()
    paras = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            if block.startswith(" ") or "***" in block or ">>>" in block:
                continue  # code, headings, examples
            text = re.sub(r"\s+", " ", block).strip()
            if 150 < len(text) < 450:
                paras.append(text)
    random.Random(seed).shuffle(paras)
    if len(paras) < 2 * n:
        raise SystemExit(f"bench ngram_draft: {len(paras)} pydoc paragraphs, need {2 * n}")
    out = []
    for j in range(n):
        q = RAG_QUESTIONS[j % len(RAG_QUESTIONS)].format(i=1 + j % 2)
        out.append(f"Context:\n[1] {paras[2 * j]}\n[2] {paras[2 * j + 1]}\n\nQuestion: {q}")
    return out


@dataclass(frozen=True)
class Policy:
    """Draft-length rule: up to ``k`` tokens, ``per_match`` per matched suffix token (0:
    off), and the engine's adaptive rule on top when ``adaptive``."""

    name: str
    k: int
    per_match: int = 0
    adaptive: bool = False

    def spec(self) -> dict[str, Any]:
        return {
            "method": "ngram",
            "num_draft_tokens": self.k,
            "ngram_draft_per_match": self.per_match,
            "adaptive_k": self.adaptive,
        }


@dataclass
class Replayed:
    fed: list[int] = field(default_factory=list)  # tokens fed per step after the first
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # steps that carried drafts (as SpecStats counts them)
    by_match: dict[int, list[int]] = field(default_factory=dict)  # suffix length -> kept

    def add(self, other: Replayed) -> None:
        self.fed += other.fed
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.steps += other.steps
        for m, kept in other.by_match.items():
            self.by_match.setdefault(m, []).extend(kept)


def replay(prompt: list[int], answer: list[int], policy: Policy, max_tokens: int) -> Replayed:
    """The steps greedy decoding with ``policy`` takes to produce ``answer`` (whose first
    token comes from the prefill), as `rose.generate` runs them. ``answer`` ends with the
    EOS token that stopped it, if one did: the engine does not emit it, but a step made it."""
    from rose.scheduler import draft_room
    from rose.spec import SpecConfig
    from rose.spec.ngram import NgramDrafter

    cfg = SpecConfig(**policy.spec())
    drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min)
    out = Replayed()
    pos, draft_len = 1, 0
    while pos < len(answer):
        tokens = prompt + answer[:pos]
        room = draft_room(draft_len, cfg.num_draft_tokens, cfg.adaptive_k, max_tokens, pos)
        d = drafter.propose(tokens, room, cfg.ngram_draft_per_match)
        kept = 0
        while kept < len(d) and pos + kept < len(answer) and d[kept] == answer[pos + kept]:
            kept += 1
        # past the kept drafts the step emits one token of its own, unless the last kept one
        # was the answer's EOS (drafts stop before max_tokens: `draft_room`)
        if d:
            out.steps += 1
            out.drafted += len(d)
            out.accepted += kept
            found = drafter.match(tokens)
            assert found is not None  # it drafted
            out.by_match.setdefault(found[1], []).append(kept)
            if cfg.adaptive_k:
                draft_len = cfg.next_draft_len(len(d), kept)
        out.fed.append(1 + len(d))
        pos += kept + 1
    return out


def _answers(model: LlamaForCausalLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy tokens for each prompt up to and with the first EOS token, if any (an
    engine that knows no EOS runs on past it; what comes after is cut)."""
    from rose.generate import GenerationConfig, GenerationEngine
    from rose.sampling import SamplingParams

    eng = GenerationEngine(model, GenerationConfig(max_batch=1))
    eos = set(model.config.eos_token_ids)
    out = []
    for done in eng.generate(prompts, SamplingParams(max_tokens=max_tokens)):
        ids = done.output_ids
        out.append(ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))])
    return out


def _policies(grid: list[int]) -> list[Policy]:
    return [
        Policy("ngram k=4", 4),
        Policy("ngram k=8", 8),
        Policy("ngram k=16", K_MAX),
        Policy("ngram k=16 adaptive", K_MAX, adaptive=True),
        *[Policy(f"ngram k=16 {a} per match", K_MAX, per_match=a) for a in grid],
    ]


def main(argv: list[str]) -> int:
    import transformers

    from rose.assets import ensure_model
    from rose.models.llama import LlamaForCausalLM

    max_tokens = bench_spec._flag(argv, "max-tokens", 96)
    grid_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--grid=")), "2,3,4,5,6,8")
    grid = [int(x) for x in grid_arg.split(",")]
    torch.set_num_threads(1)
    path = ensure_model("smollm2-135m-instruct")
    model = LlamaForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = {
        "rag": rag_tuning_prompts(),
        "chat": chain_stop.tuning_prompts(path / "tokenizer.json"),
    }
    prompts = {s: [bench_spec.chat_ids(tok, t) for t in ts] for s, ts in texts.items()}
    plain = bench_spec._engine(model, None, None, {"method": "none"})
    bench_spec._one(plain, prompts["chat"][0], 4)  # warm-up
    costs = bench_spec._verify_costs(model, tuple(range(1, K_MAX + 2)), rounds=COST_ROUNDS)
    answers = {s: _answers(model, ps, max_tokens) for s, ps in prompts.items()}
    policies = _policies(grid)
    table: dict[tuple[str, str], tuple[float, Replayed]] = {}
    for s in prompts:
        base = sum(costs[1] * (len(a) - 1) for a in answers[s])  # a plain step per token
        for pol in policies:
            merged = Replayed()
            for p, a in zip(prompts[s], answers[s], strict=True):
                merged.add(replay(p, a, pol, max_tokens))
            table[(s, pol.name)] = (base / sum(costs[f] for f in merged.fed), merged)
    per_match = [p for p in policies if p.per_match]
    best = max(per_match, key=lambda p: table[("rag", p.name)][0])

    # the chosen policy through the real engine: same output, same steps as replayed
    failures = []
    eos = set(model.config.eos_token_ids)
    for s in prompts:
        eng = bench_spec._engine(model, None, None, best.spec())
        got = [bench_spec._one(eng, p, max_tokens)[2] for p in prompts[s]]
        if got != [a[:-1] if a[-1] in eos else a for a in answers[s]]:
            failures.append(f"{s}/{best.name}: output differs from no-speculation greedy")
        st, rep = eng.stats, table[(s, best.name)][1]
        if (st.steps, st.drafted, st.accepted) != (rep.steps, rep.drafted, rep.accepted):
            failures.append(
                f"{s}/{best.name}: engine steps/drafted/kept {st.steps}/{st.drafted}/"
                f"{st.accepted}, replay {rep.steps}/{rep.drafted}/{rep.accepted}"
            )
    _write(table, policies, best, costs, texts, max_tokens, failures)
    for (s, name), (speedup, _) in table.items():
        print(f"  {s:5s} {name:26s} {speedup:.3f}x")
    print(f"best: {best.name}")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


def _write(
    table: dict[tuple[str, str], tuple[float, Replayed]],
    policies: list[Policy],
    best: Policy,
    costs: dict[int, float],
    texts: dict[str, list[str]],
    max_tokens: int,
    failures: list[str],
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    sets = list(texts)
    lines = [
        "# Prompt-lookup draft length (SpecConfig.ngram_draft_per_match)",
        "",
        f"Generated by `python -m bench ngram_draft` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: SmolLM2-135M-Instruct, CPU, "
        f"batch 1, greedy, fp32 target, one thread, max_tokens={max_tokens}; "
        f"{len(texts['rag'])} RAG and {len(texts['chat'])} chat tuning prompts (not those of "
        "bench/results/spec.md). Each policy's steps are replayed from the plain greedy "
        "answers and priced at this machine's measured verification passes (below).",
        "The chosen policy, run through the engine, reproduced plain greedy output and the "
        "replay's steps, drafted and kept tokens exactly on every prompt."
        if not failures
        else "FAILURES: " + "; ".join(failures),
        "",
        "| policy | " + " | ".join(f"{s} speedup | {s} kept / step" for s in sets) + " |",
        "|---|" + "---|---|" * len(sets),
    ]
    for pol in policies:
        cells = []
        for s in sets:
            speedup, rep = table[(s, pol.name)]
            cells += [f"{speedup:.3f}x", f"{rep.accepted / max(1, rep.steps):.2f}"]
        lines.append(f"| {pol.name} | " + " | ".join(cells) + " |")
    lines += ["", f"Best on the RAG prompts: **{best.name}**.", ""]
    lines += [
        "## Kept drafts by matched suffix length",
        "",
        "Every drafting step of the fixed 16-token policy, by how long a suffix the lookup "
        "matched (`ngram_max` = 4): share of steps that kept at least 1 / 4 / 8 drafts.",
        "",
        "| prompts | matched | steps | kept >= 1 | kept >= 4 | kept >= 8 | mean kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sets:
        by_match = table[(s, "ngram k=16")][1].by_match
        for m in sorted(by_match):
            v = by_match[m]
            share = [sum(x >= t for x in v) / len(v) for t in (1, 4, 8)]
            lines.append(
                f"| {s} | {m} | {len(v)} | "
                + " | ".join(f"{x:.2f}" for x in share)
                + f" | {sum(v) / len(v):.2f} |"
            )
    lines += [
        "",
        f"## Verification pass cost (ms, after 200 cached tokens, median of {COST_ROUNDS} "
        "interleaved rounds)",
        "",
        "| tokens | " + " | ".join(str(n) for n in costs) + " |",
        "|---|" + "---|" * len(costs),
        "| ms | " + " | ".join(f"{c:.1f}" for c in costs.values()) + " |",
        "",
        "## Machine",
        "",
        f"- {machine()}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
        f"torch {torch.__version__}",
        "",
        "## RAG tuning prompts",
        "",
        *[f"- {t.splitlines()[-1]}" for t in texts["rag"]],
    ]
    (RESULTS / "ngram_draft.md").write_text("\n".join(lines) + "\n")
