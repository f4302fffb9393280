"""Speculative decoding benchmark: SmolLM2-135M-Instruct, CPU, batch 1, greedy.

Methods: no speculation, n-gram prompt lookup, draft-target (the target's first layers as
drafter) and the trained MTP/EAGLE head (`rose.spec.train_mtp`). Prompt sets: chat
questions (held out from the head's training corpus) and retrieval-augmented prompts whose
answers quote the context (passages + a question asking for the passage's words). Each
prompt is declared with a phrase its no-speculation answer contains, and every speculative
run must reproduce the no-speculation greedy output token for token, so a fast but wrong run
fails. The MTP bar is judged on the median speed-up over three rounds of the MTP rows,
chains and draft trees alike (the table's and two more of no speculation and the MTP rows
alone), since one run's ratio moves by several percent on this shared machine; the best
chain and the best tree are named beside it. Writes bench/results/spec.md (+
spec.png when matplotlib is installed).

    python -m bench spec [--max-tokens=96] [--threads=1] [--mtp-head=DIR] [--train-head]

The head is read from ``--mtp-head`` or `rose.spec.train_mtp.default_head_dir`; with
``--train-head`` a missing head is trained first (``python -m rose.spec.train_mtp`` with its
defaults and the chat prompts below excluded from its corpus). ``python -m bench mtp_accept``
scores a head's held-out acceptance alone, without timing.
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.report import machine, percentile

if TYPE_CHECKING:
    from rose.generate import GenerationEngine
    from rose.models.llama import LlamaForCausalLM
    from rose.spec.mtp import MTPHead

__all__ = ["CHAT", "RAG_QUOTE", "main"]

RESULTS = Path(__file__).parent / "results"

# (prompt, a phrase the model's own greedy answer contains)
CHAT = [
    ("What is the capital of France?", "Paris"),
    ("Explain how a rainbow forms.", "light"),
    ("Give three tips for writing clean code.", "code"),
    ("Describe a typical day of a honeybee.", "bee"),
    ("Why do leaves change color in autumn?", "deciduous"),
    ("How does a refrigerator keep food cold?", "refrigerat"),
    ("Write a short poem about the ocean.", "ocean"),
    ("What are the benefits of regular exercise?", "exercise"),
]
# (context passages, question, a phrase the answer quotes from the context)
RAG_QUOTE = [
    (
        "[1] The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 "
        "metres tall and was the tallest man-made structure in the world for 41 years.\n"
        "[2] Gustave Eiffel's company designed and built the tower. About 300 workers "
        "assembled its 18,038 wrought-iron parts in just over two years.",
        "How tall is the Eiffel Tower and when was it completed? Answer by quoting passage "
        "[1] exactly.",
        "completed in 1889 for the World's Fair",
    ),
    (
        "[1] To reset the router: 1. Unplug the power cable and wait ten seconds. 2. Plug the "
        "cable back in. 3. Hold the reset button on the back for ten seconds until the power "
        "light blinks orange. 4. Wait two minutes for the router to restart. 5. Connect to "
        "the default network printed on the label.\n"
        "[2] The router's warranty lasts two years from the date of purchase.",
        "How do I reset the router? Copy the numbered steps from passage [1] exactly.",
        "Wait two minutes for the router to restart",
    ),
    (
        "[1] The library is open Monday to Friday from 9 am to 8 pm, and on Saturday from "
        "10 am to 4 pm. It is closed on Sundays and public holidays. Members can borrow up to "
        "ten books at a time for three weeks, and can renew each loan twice online.\n"
        "[2] The library was built in 1902 with a gift from a local merchant.",
        "What are the library's opening hours and lending rules? Quote passage [1] word for word.",
        "borrow up to ten books at a time",
    ),
    (
        "[1] Symptoms of dehydration include: thirst; dark yellow urine; dizziness or "
        "light-headedness; tiredness; a dry mouth, lips and eyes; and passing urine fewer than "
        "four times a day.\n"
        "[2] Older adults and young children are at higher risk of dehydration.",
        "What are the symptoms of dehydration? Copy the list from passage [1] exactly.",
        "dark yellow urine",
    ),
    (
        "[1] To make a cup of tea, boil fresh water, pour it over a tea bag in a cup, and let "
        "it steep for three to five minutes. Remove the tea bag and add milk or sugar if you "
        "like.\n"
        "[2] Green tea should be made with water that is not quite boiling.",
        "How do I make a cup of tea? Copy the steps from the context word for word.",
        "steep for three to five minutes",
    ),
    (
        "[1] The human heart has four chambers: the left atrium, the right atrium, the left "
        "ventricle and the right ventricle. The right side pumps blood to the lungs, and the "
        "left side pumps blood to the rest of the body.\n"
        "[2] An adult heart beats about 60 to 100 times per minute at rest.",
        "What are the chambers of the heart? Quote passage [1] exactly.",
        "the left atrium, the right atrium",
    ),
    (
        "[1] Pancakes: whisk 200 g of flour, 2 eggs and 300 ml of milk into a smooth batter. "
        "Heat a little oil in a frying pan over a medium heat. Pour in a ladle of batter and "
        "tilt the pan to spread it. Cook for one minute on each side until golden, then serve "
        "with lemon and sugar.\n"
        "[2] Pancake Day falls on the Tuesday before Lent.",
        "What is the pancake recipe? Copy passage [1] word for word.",
        "Pour in a ladle of batter",
    ),
    (
        "[1] Before a fire drill, staff must: close all windows and doors; switch off "
        "electrical equipment; leave personal belongings behind; walk, do not run, to the "
        "nearest exit; and gather at the assembly point in the north car park.\n"
        "[2] Fire drills take place every six months.",
        "What must staff do in a fire drill? Quote the instructions from passage [1] exactly.",
        "assembly point in the north car park",
    ),
    (
        "[1] The Great Barrier Reef is the world's largest coral reef system. It is composed "
        "of over 2,900 individual reefs and 900 islands stretching for over 2,300 kilometres "
        "off the coast of Queensland, Australia.\n"
        "[2] The reef is threatened by rising sea temperatures, which cause coral bleaching.",
        "What is the Great Barrier Reef? Quote passage [1] word for word.",
        "world's largest coral reef system",
    ),
    (
        "[1] To plant a tree, dig a hole twice as wide as the root ball and just as deep. "
        "Loosen the roots, set the tree in the hole so that the top of the root ball is level "
        "with the ground, fill the hole with soil, and water it well. Spread mulch around the "
        "base, keeping it away from the trunk.\n"
        "[2] Autumn and early spring are the best seasons for planting.",
        "How do I plant a tree? Copy the instructions from passage [1] exactly.",
        "top of the root ball is level with the ground",
    ),
]


def _tulip_default(method: str) -> tuple[str, dict[str, Any]]:
    """The row for what Tulip's ``--spec METHOD`` runs by default, read from its `spec_config`
    (so the bench follows Tulip's defaults): a label and the settings that differ from
    `SpecConfig`'s own defaults."""
    from tulip.config import TulipConfig
    from tulip.generation import spec_config

    spec = spec_config(TulipConfig(model="smollm2-135m-instruct", spec=method))
    settings = {
        f.name: getattr(spec, f.name)
        for f in fields(spec)
        if f.name == "method" or getattr(spec, f.name) != f.default
    }
    label = method + (" tree" if spec.tree_nodes else "") + f" k={spec.num_draft_tokens}"
    label += " adaptive" if spec.adaptive_k else ""
    label += f" {spec.ngram_draft_per_match} per match" if spec.ngram_draft_per_match else ""
    label += f" dynamic {spec.tree_nodes}" if spec.tree_nodes else ""
    label += f" stop {spec.chain_min_prob}" if spec.chain_min_prob else ""
    label += f" lookup {spec.lookup_min_match}" if spec.lookup_min_match else ""
    return label, settings


# n-gram lookup with SpecConfig's suffix lengths (1..4): the fixed-k row, and Tulip's default
TULIP_NGRAM_LABEL, TULIP_NGRAM = _tulip_default("ngram")
TULIP_MTP_LABEL, TULIP_MTP = _tulip_default("mtp")
METHODS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "ngram k=4": {"method": "ngram", "num_draft_tokens": 4},
    # Tulip's default until 2026-12-04: drafts grown by 2 after a fully kept step, shrunk by
    # 1 after a rejection, instead of sized by the matched suffix
    "ngram k=16 adaptive": {"method": "ngram", "num_draft_tokens": 16, "adaptive_k": True},
    TULIP_NGRAM_LABEL: TULIP_NGRAM,
    "draft 6L k=3": {"method": "draft", "num_draft_tokens": 3},
}
MTP_METHODS: dict[str, dict[str, Any]] = {
    # drafts with int4 weights and bf16 activations into them where PyTorch has the CPU int4
    # kernel, else bf16 where the CPU has fast bf16 products (SpecConfig.draft_dtype="auto")
    "mtp k=3": {"method": "mtp", "num_draft_tokens": 3},
    "mtp k=2": {"method": "mtp", "num_draft_tokens": 2},
    # a chain of up to 5 that stops once the head's probability for all of it is below 0.15
    # (SpecConfig.chain_min_prob; the value chosen by `python -m bench chain_stop` on tuning
    # prompts that are neither these nor the head's training prompts)
    "mtp k=5 stop 0.15": {"method": "mtp", "num_draft_tokens": 5, "chain_min_prob": 0.15},
    # the same with the head's weights in bf16 (what "auto" chose before int4 drafts)
    "mtp k=5 stop 0.15 bf16 drafts": {
        "method": "mtp",
        "num_draft_tokens": 5,
        "chain_min_prob": 0.15,
        "draft_dtype": "bfloat16",
    },
    # draft trees (rose.spec.tree): the chain plus the head's next best tokens as leaves,
    # 5 nodes in all, so a verification pass feeds 6 tokens (oneDNN's cheapest row count)
    "mtp tree k=2 widths 3,2": {"method": "mtp", "num_draft_tokens": 2, "tree_widths": (3, 2)},
    # a dynamic tree: the 5 nodes the head rates likeliest, up to 4 deep (SpecConfig.tree_nodes)
    "mtp tree k=4 dynamic 5": {"method": "mtp", "num_draft_tokens": 4, "tree_nodes": 5},
    # the trees again, where the context ends in a repeat of 2+ tokens copying up to 5
    # tokens from it instead of asking the head (SpecConfig.lookup_min_match): chat answers
    # repeat the question's names and phrases, where the head keeps about one draft a step
    "mtp tree k=2 widths 3,2 lookup 2": {
        "method": "mtp",
        "num_draft_tokens": 2,
        "tree_widths": (3, 2),
        "lookup_min_match": 2,
    },
    "mtp tree k=4 dynamic 5 lookup 2": {
        "method": "mtp",
        "num_draft_tokens": 4,
        "tree_nodes": 5,
        "lookup_min_match": 2,
    },
    # Tulip's `--spec mtp` default: a dynamic tree of 3 nodes, so a verification pass feeds 4
    # tokens, no more than a chain of 3 does, and the head spends its third node where it is
    # likelier kept (a second guess at depth 1 when unsure, the chain's third token when sure)
    TULIP_MTP_LABEL: TULIP_MTP,
}
DRAFT_LAYERS = 6
# (prompt set, method-name prefix) -> bar; "mtp" rows draft with the MTP head, as chains
# ("mtp k=") or trees ("mtp tree"): the MTP bar is for the head, however it drafts
MTP_PREFIX = "mtp"
CHAIN_PREFIX = "mtp k="
TREE_PREFIX = "mtp tree"
LOOKUP = " lookup "  # in the label of rows that copy long repeats (lookup_min_match)
BARS = {("chat", MTP_PREFIX): 1.8, ("rag-quote", "ngram"): 3.0}  # issue #24 (#8: 1.5, 1.8)
REPEAT_ROUNDS = 2  # extra rounds of the MTP rows on chat, for the MTP bar's median


@dataclass
class Run:
    method: str
    prompt_set: str
    tokens: int
    seconds: float
    itl_ms: list[float]
    outputs: list[list[int]]
    stats: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _flag(argv: list[str], name: str, default: int) -> int:
    for a in argv:
        if a.startswith(f"--{name}="):
            return int(a.split("=", 1)[1])
    return default


def chat_ids(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user message through the tokenizer's chat template,
    ready for the assistant's answer (transformers returns a list or a BatchEncoding)."""
    ids: Any = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _engine(
    model: LlamaForCausalLM,
    drafter: LlamaForCausalLM | None,
    head: MTPHead | None,
    spec: dict[str, Any],
) -> GenerationEngine:
    from rose.generate import GenerationConfig, GenerationEngine
    from rose.spec import SpecConfig

    return GenerationEngine(
        model,
        GenerationConfig(max_batch=1, spec=SpecConfig(**spec)),
        drafter=drafter if spec["method"] == "draft" else None,
        mtp_head=head if spec["method"] == "mtp" else None,
        eos_ids=model.config.eos_token_ids,
    )


def _one(
    eng: GenerationEngine, prompt: list[int], max_tokens: int
) -> tuple[float, list[float], list[int]]:
    """Generate one prompt: (seconds after the first token, per-token ITL ms, output)."""
    from rose.sampling import SamplingParams

    eng.add(prompt, SamplingParams(max_tokens=max_tokens))
    out: list[int] = []
    itl: list[float] = []
    total = 0.0
    first = True
    while eng.has_unfinished():
        t0 = time.perf_counter()
        [step] = eng.step()
        dt = time.perf_counter() - t0
        out.extend(step.new_ids)
        if first:  # prefill + first token: time to first token, not inter-token
            first = False
            continue
        total += dt
        if step.new_ids:  # a step that only met EOS emits nothing
            itl.extend([dt * 1e3 / len(step.new_ids)] * len(step.new_ids))
    return total, itl, out


def _run_set(
    engines: dict[str, GenerationEngine], prompts: list[list[int]], max_tokens: int, set_name: str
) -> list[Run]:
    """Every method on every prompt, methods interleaved per prompt, so that load changes
    on this shared machine hit all methods alike."""
    secs = dict.fromkeys(engines, 0.0)
    itls: dict[str, list[float]] = {m: [] for m in engines}
    outs: dict[str, list[list[int]]] = {m: [] for m in engines}
    for i, p in enumerate(prompts):
        for m, eng in engines.items():
            dt, itl, out = _one(eng, p, max_tokens)
            secs[m] += dt
            itls[m] += itl
            outs[m].append(out)
        print(f"  {set_name} prompt {i + 1}/{len(prompts)} done", flush=True)
    runs = []
    for m, eng in engines.items():
        n = sum(max(0, len(o) - 1) for o in outs[m])  # tokens after the first
        runs.append(Run(m, set_name, n, secs[m], itls[m], outs[m], eng.stats.as_dict()))
    return runs


def _verify_costs(
    model: LlamaForCausalLM, sizes: tuple[int, ...], rounds: int = 5
) -> dict[int, float]:
    """Median ms over ``rounds`` of one target pass over n new tokens (logits for all n)
    after 200 cached tokens, as a verification of n - 1 drafts costs in the engine: where
    the model pads few-row passes (``pass_min_rows``), shorter ones are fed with fillers up
    to it and their logit rows duplicated up to it, as `rose.runner` does. Each round
    passes every size once, so a load change on this shared machine hits all sizes alike."""
    from rose.attention.metadata import AttentionMetadata
    from rose.kv.allocator import PageAllocator
    from rose.kv.block_table import BlockTable

    pad = model.pass_min_rows
    cache = model.new_cache(32, 16)
    table = BlockTable(PageAllocator(32), 16)
    table.reserve(200 + max(sizes))
    ids = torch.randint(
        0, model.config.vocab_size, (200 + max(sizes),), generator=torch.Generator().manual_seed(0)
    )
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.no_grad():
        model(ids[:200], AttentionMetadata.build([(table, 0, 200)]), cache, torch.tensor([199]))
        for _ in range(rounds):
            for n in sizes:
                padded = 1 < n < pad
                rows = list(range(n)) + [n - 1] * (pad - n if padded else 0)
                fed = pad if padded else n
                t0 = time.perf_counter()
                meta = AttentionMetadata.build([(table, 200, fed)])
                model(ids[200 : 200 + fed], meta, cache, torch.tensor(rows)).logits.argmax(-1)
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def _few_rows_note(model: LlamaForCausalLM) -> str:
    """How this machine runs few-row passes, as `rose.packed.tune_few_rows` chose at load."""
    from rose.packed import PackedLinear

    copies = isinstance(model.output, PackedLinear) and model.output._single_row is not None
    pad = model.pass_min_rows
    one = (
        "One-row passes run MKL on a W.T copy of each weight, faster at one row than "
        "oneDNN's kernel on weights packed once (rose/packed.py), which passes over "
        "several rows run"
        if copies
        else "Every pass runs oneDNN's kernels on weights packed once (rose/packed.py): at "
        "one row they beat MKL here, so no W.T copies are kept"
    )
    rows = (
        f"oneDNN streams weights slower at 2 rows than at {pad} here, so the engine feeds a "
        f"pass of 2-{pad - 1} tokens filler tokens up to {pad} and pads its logit rows to "
        f"{pad} (included here)"
        if pad > 1
        else "2 rows run no slower than 4 here, so no pass is padded"
    )
    return f"{one} (as `rose.packed.tune_few_rows` measured at load); {rows}."


def _ensure_head(head_dir: Path, train: bool, default: bool) -> Path | None:
    """The MTP head to bench: `head_dir` when it holds one; else, for the default directory,
    the head Trellis ships (verified, as Tulip's ``--spec mtp`` takes it) unless
    ``--train-head`` asks for a fresh one; else None (no MTP rows)."""
    if (head_dir / "model.safetensors").is_file():
        return head_dir
    if not train:
        from rose.assets.heads import bundled_head_for

        bundled = bundled_head_for("smollm2-135m-instruct") if default else None
        return bundled.verified() if bundled is not None else None
    from rose.spec import train_mtp

    argv = ["--out", str(head_dir), "--threads", "1"]
    for q, _ in CHAT:
        argv += ["--exclude", q]
    if train_mtp.main(argv) != 0:
        raise SystemExit("bench spec: training the MTP head failed")
    return head_dir


def main(argv: list[str]) -> int:
    import transformers

    from rose.assets import ensure_model
    from rose.models.llama import LlamaForCausalLM
    from rose.spec import truncated_drafter
    from rose.spec.mtp import MTPHead
    from rose.spec.train_mtp import default_head_dir

    max_tokens = _flag(argv, "max-tokens", 96)
    threads = _flag(argv, "threads", 1)
    torch.set_num_threads(threads)
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--mtp-head=")), None)
    head_path = _ensure_head(
        Path(given) if given else default_head_dir("smollm2-135m-instruct"),
        "--train-head" in argv,
        default=given is None,
    )
    path = ensure_model("smollm2-135m-instruct")
    model = LlamaForCausalLM.from_pretrained(path)
    drafter = truncated_drafter(model, DRAFT_LAYERS)
    head = MTPHead.load(head_path) if head_path else None
    methods = dict(METHODS)
    if head is not None:
        methods.update(MTP_METHODS)
    tok = transformers.AutoTokenizer.from_pretrained(path)

    sets = {
        "chat": [(chat_ids(tok, q), want) for q, want in CHAT],
        "rag-quote": [
            (chat_ids(tok, f"Context:\n{c}\n\nQuestion: {q}"), want) for c, q, want in RAG_QUOTE
        ],
    }
    # warm-up (allocator, first-call kernels)
    _one(_engine(model, None, None, {"method": "none"}), sets["chat"][0][0], 4)
    costs = _verify_costs(model, (1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
    print("verify ms by tokens: " + ", ".join(f"{n}: {c:.1f}" for n, c in costs.items()))

    runs: list[Run] = []
    failures: list[str] = []
    for set_name, cases in sets.items():
        engines = {name: _engine(model, drafter, head, spec) for name, spec in methods.items()}
        set_runs = _run_set(engines, [p for p, _ in cases], max_tokens, set_name)
        runs += set_runs
        base = set_runs[0].outputs
        for r in set_runs:
            print(f"  {set_name:10s} {r.method:20s} {r.tokens_per_s:7.1f} tok/s", flush=True)
            if r.outputs != base:
                failures.append(f"{set_name}/{r.method}: output differs from no-speculation greedy")
        for (_, want), out in zip(cases, base, strict=True):
            if want not in tok.decode(out):
                failures.append(f"{set_name}: an answer lacks the expected {want!r}")

    # The MTP bar sits within this machine's run-to-run spread (plain decoding alone moves
    # by ~5% between runs), so it is judged on the median over rounds: the table's run plus
    # REPEAT_ROUNDS more of the rows it compares, no speculation and every MTP row (chains
    # and trees), on the chat prompts (interleaved per prompt as before).
    rounds: dict[str, list[float]] = {}
    if head is not None:
        chat_prompts = [p for p, _ in sets["chat"]]
        chat_runs = [r for r in runs if r.prompt_set == "chat"]
        mtp_methods = [r.method for r in chat_runs if r.method.startswith(MTP_PREFIX)]
        for r in chat_runs:
            if r.method in mtp_methods:
                rounds[r.method] = [r.tokens_per_s / chat_runs[0].tokens_per_s]
        for i in range(REPEAT_ROUNDS):
            engines = {m: _engine(model, None, head, methods[m]) for m in ["none", *mtp_methods]}
            again = _run_set(engines, chat_prompts, max_tokens, f"chat round {i + 2}")
            for r in again[1:]:
                rounds[r.method].append(r.tokens_per_s / again[0].tokens_per_s)
                if r.outputs != again[0].outputs:
                    failures.append(f"chat round {i + 2}/{r.method}: output differs")

    _write(runs, failures, max_tokens, threads, head_path, costs, _few_rows_note(model), rounds)
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


def _write(
    runs: list[Run],
    failures: list[str],
    max_tokens: int,
    threads: int,
    head_dir: Path | None,
    costs: dict[int, float],
    few_rows: str,
    rounds: dict[str, list[float]],
) -> None:
    import transformers

    RESULTS.mkdir(parents=True, exist_ok=True)
    base = {r.prompt_set: r.tokens_per_s for r in runs if r.method == "none"}
    sizes = {r.prompt_set: len(r.outputs) for r in runs if r.method == "none"}
    lines = [
        "# Speculative decoding — SmolLM2-135M-Instruct, CPU, batch 1, greedy",
        "",
        f"Generated by `python -m bench spec` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Prompt sets: chat ({sizes.get('chat', 0)} questions, held out from the MTP head's "
        f"training corpus) and rag-quote ({sizes.get('rag-quote', 0)} prompts: two context "
        "passages + a question asking to quote one); "
        f"max_tokens={max_tokens}, fp32, torch threads={threads}. Timing excludes prefill "
        "(time to first token); ITL = a step's time split over the tokens it emitted.",
        "Every speculative run reproduced the no-speculation output token for token, and "
        "every no-speculation answer contains its declared phrase."
        if not failures
        else "FAILURES: " + "; ".join(failures),
        "",
        "For draft trees, acceptance is over the chain's positions (depth reached), and "
        "'alt' is the share of steps whose kept drafts end in an alternative beside the chain.",
        "",
        "| prompts | method | tok/s | speedup | ITL p50 ms | ITL p99 ms | acceptance | mean accepted / step | per-position acceptance | alt | draft s | verify s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        st = r.stats
        per_pos = ", ".join(f"{x:.2f}" for x in st["acceptance_per_position"])
        lines.append(
            f"| {r.prompt_set} | {r.method} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / base[r.prompt_set]:.2f}x | {statistics.median(r.itl_ms):.1f} | "
            f"{percentile(r.itl_ms, 99):.1f} | {st['acceptance_rate']:.2f} | "
            f"{st['mean_accepted_length']:.2f} | {per_pos} | "
            f"{st['alternatives'] / max(1, st['steps']):.2f} | "
            f"{st['draft_s']:.2f} | {st['verify_s']:.2f} |"
        )
    lines += ["", "## Bars (issue #24)", ""]
    for (pset, kind), bar in BARS.items():
        cands = [r for r in runs if r.prompt_set == pset and r.method.startswith(kind)]
        if not cands:
            lines.append(f"- {kind.strip('= ')} on {pset}: not run (no trained head found)")
            continue
        if kind == MTP_PREFIX and rounds:
            med = {m: statistics.median(xs) for m, xs in rounds.items()}
            top = max(med, key=lambda m: med[m])
            verdict = "met" if med[top] >= bar else "NOT met"
            spread = "; ".join(
                f"{m}: {', '.join(f'{x:.2f}' for x in xs)}" for m, xs in rounds.items()
            )
            lines.append(
                f"- MTP head on {pset} (chains and trees): best {top}, median over "
                f"{len(rounds[top])} rounds {med[top]:.2f}x vs bar {bar}x: {verdict} "
                f"(speed-up per round, the table's first: {spread})"
            )
            shapes = (
                ("the chains", lambda m: m.startswith(CHAIN_PREFIX)),
                ("the trees", lambda m: m.startswith(TREE_PREFIX)),
                ("the head's drafts only (no lookup)", lambda m: LOOKUP not in m),
                ("the rows with lookup", lambda m: LOOKUP in m),
            )
            for shape, keep in shapes:
                own = {m: x for m, x in med.items() if keep(m)}
                if own:
                    best_own = max(own, key=lambda m: own[m])
                    lines.append(
                        f"  - best of {shape} alone: {best_own}, median {own[best_own]:.2f}x"
                    )
            continue
        best = max(cands, key=lambda r: r.tokens_per_s)
        x = best.tokens_per_s / base[pset]
        verdict = "met" if x >= bar else "NOT met"
        lines.append(f"- {kind} on {pset}: best {best.method} {x:.2f}x vs bar {bar}x: {verdict}")
    lines += [
        "",
        "## Break-even",
        "",
        "A speculative step costs its drafting plus one verification pass; it pays off only "
        "when it emits more tokens than plain decoding would in the same time. Break-even "
        "mean accepted drafts per step = (draft + verify time per step) / (time per token "
        "without speculation) - 1 (measured in this run):",
        "",
    ]
    for r in runs:
        st = r.stats
        if r.method == "none" or not st["steps"]:
            continue
        step_ms = (st["draft_s"] + st["verify_s"]) / st["steps"] * 1e3
        plain_ms = 1e3 / base[r.prompt_set]
        lines.append(
            f"- {r.prompt_set} / {r.method}: {step_ms:.0f} ms per step vs {plain_ms:.0f} ms per "
            f"plain token: break-even {step_ms / plain_ms - 1:.2f}, achieved "
            f"{st['mean_accepted_length']:.2f}"
        )
    lines += [
        "",
        "## Verification cost by tokens per pass",
        "",
        "One target pass over n new tokens after 200 cached ones (the verification of n - 1 "
        "drafts), median of 5 rounds over every size, ms. " + few_rows,
        "",
        "| tokens | " + " | ".join(str(n) for n in costs) + " |",
        "|---|" + "---|" * len(costs),
        "| ms | " + " | ".join(f"{c:.1f}" for c in costs.values()) + " |",
        "| vs 1 token | " + " | ".join(f"{c / costs[1]:.2f}" for c in costs.values()) + " |",
    ]
    load = os.getloadavg()
    lines += [
        "",
        "## Machine",
        "",
        f"- {machine()}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(a shared machine: absolute numbers are noisy, ratios less so)",
        f"- python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}",
        "- drafter for draft-target: the target's first "
        f"{DRAFT_LAYERS} of 30 layers + its norm and head (weights shared, no training)",
        f"- MTP/EAGLE head: {_head_note(head_dir)}",
        "- MTP draft precision (`SpecConfig.draft_dtype='auto'`): the head's linear layers and "
        "LM-head rows hold int4 weights (groups of 32, `rose.quant`) with bf16 activations going "
        "into them, under fp32 norms, cache and attention; the 'bf16 drafts' row keeps bf16 "
        "weights; verification is always the fp32 target",
    ]
    png = _plot(runs, base)
    if png:
        lines += ["", f"![tokens/s per method]({png.name})"]
    (RESULTS / "spec.md").write_text("\n".join(lines) + "\n")


def _head_note(head_dir: Path | None) -> str:
    if not head_dir:
        return "no trained head found (--mtp-head=DIR or --train-head), so no MTP rows"
    import json

    meta = json.loads((Path(head_dir) / "config.json").read_text())
    command = meta.get("command", "python -m rose.spec.train_mtp")
    held_out = [f"--exclude {shlex.quote(q)}" for q, _ in CHAT]
    if all(h in command for h in held_out):  # the held-out chat prompts, named once
        for h in held_out[1:]:
            command = command.replace(" " + h, "")
        command = command.replace(held_out[0], "--exclude <each bench chat prompt>")
    return (
        f"trained by `{command}` "
        f"({meta.get('train_note', 'see config.json')}); next-token loss per epoch "
        f"{[round(x, 3) for x in meta.get('loss_history', [])]}; draft vocabulary "
        f"{meta.get('draft_vocab_size') or 'full'}"
    )


def _plot(runs: list[Run], base: dict[str, float]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sets = list(base)
    methods = list(dict.fromkeys(r.method for r in runs))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [
            next(r.tokens_per_s for r in runs if r.method == m and r.prompt_set == s) for s in sets
        ]
        ax.bar([j + i * width for j in range(len(sets))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title("SmolLM2-135M, CPU fp32, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / "spec.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
