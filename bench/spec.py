"""Speculative decoding benchmark: SmolLM2-135M-Instruct, CPU, batch 1.

Methods: no speculation, n-gram prompt lookup, draft-target (the target's first layers as
drafter). Prompt sets: chat questions and retrieval-augmented prompts whose answers quote
the context. Every speculative run must reproduce the no-speculation greedy output token
for token (and the chat set must answer "Paris" to its first question), so a fast but
wrong run fails. Writes bench/results/spec.md (+ spec.png when matplotlib is installed).

    python -m bench spec [--max-tokens=64] [--threads=2] [--mtp-head=DIR]
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rose.models.llama import LlamaForCausalLM
    from rose.spec.mtp import MTPHead

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results"

CHAT = [
    "What is the capital of France?",
    "Explain how a rainbow forms.",
    "Give three tips for writing clean code.",
    "Describe a typical day of a honeybee.",
]
CONTEXTS = [
    (
        "Python was created by Guido van Rossum and first released in 1991. Its design "
        "philosophy emphasizes code readability with the use of significant indentation. "
        "Python is dynamically typed and garbage-collected.",
        "According to the context, who created Python and when was it first released? "
        "Quote the sentence.",
    ),
    (
        "Honey never spoils because its low moisture and high acidity stop bacteria from "
        "growing. Archaeologists have found pots of edible honey in ancient Egyptian tombs "
        "that are over three thousand years old.",
        "Why does honey never spoil? Answer by copying the relevant sentences from the context.",
    ),
    (
        "The Moon is about 384,400 kilometres from Earth. It always shows the same face to "
        "Earth because its rotation period equals its orbital period, a state called tidal "
        "locking.",
        "Repeat the context word for word.",
    ),
    (
        "The Amazon rainforest covers about 5.5 million square kilometres. It spans nine "
        "countries, with the majority of the forest contained within Brazil, followed by "
        "Peru and Colombia.",
        "Quote the context's description of where the Amazon rainforest is.",
    ),
]
METHODS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "ngram k=4": {"method": "ngram", "num_draft_tokens": 4},
    "ngram k=4 n>=3": {"method": "ngram", "num_draft_tokens": 4, "ngram_min": 3, "ngram_max": 4},
    "ngram k=8 n>=3": {"method": "ngram", "num_draft_tokens": 8, "ngram_min": 3, "ngram_max": 4},
    "draft 6L k=3": {"method": "draft", "num_draft_tokens": 3},
}
DRAFT_LAYERS = 6


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


def _run(
    model: LlamaForCausalLM,
    drafter: LlamaForCausalLM,
    head: MTPHead | None,
    prompts: list[list[int]],
    spec: dict[str, Any],
    max_tokens: int,
) -> tuple[float, int, list[float], list[list[int]], dict[str, Any]]:
    from rose.generate import GenerationConfig, GenerationEngine
    from rose.sampling import SamplingParams
    from rose.spec import SpecConfig

    cfg = GenerationConfig(max_batch=1, spec=SpecConfig(**spec))
    eng = GenerationEngine(
        model,
        cfg,
        drafter=drafter if spec["method"] == "draft" else None,
        mtp_head=head if spec["method"] == "mtp" else None,
        eos_ids=model.config.eos_token_ids,
    )
    params = SamplingParams(max_tokens=max_tokens)
    total_s, total_tok, itl, outs = 0.0, 0, [], []
    for p in prompts:
        eng.add(p, params)
        out: list[int] = []
        first = True
        while eng.has_unfinished():
            t0 = time.perf_counter()
            [step] = eng.step()
            dt = time.perf_counter() - t0
            out.extend(step.new_ids)
            if first:  # prefill + first token: time to first token, not inter-token
                first = False
                continue
            total_s += dt
            total_tok += len(step.new_ids)
            if step.new_ids:  # a step that only met EOS emits nothing
                itl.extend([dt * 1e3 / len(step.new_ids)] * len(step.new_ids))
        outs.append(out)
    return total_s, total_tok, itl, outs, eng.stats.as_dict()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str]) -> int:
    import transformers

    from rose.assets import ensure_model
    from rose.models.llama import LlamaForCausalLM
    from rose.spec import truncated_drafter
    from rose.spec.mtp import MTPHead

    max_tokens = _flag(argv, "max-tokens", 64)
    head_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--mtp-head=")), None)
    threads = _flag(argv, "threads", 2)
    torch.set_num_threads(threads)
    path = ensure_model("smollm2-135m-instruct")
    model = LlamaForCausalLM.from_pretrained(path)
    drafter = truncated_drafter(model, DRAFT_LAYERS)
    head = MTPHead.load(head_dir) if head_dir else None
    methods = dict(METHODS)
    if head is not None:
        methods["mtp k=3"] = {"method": "mtp", "num_draft_tokens": 3}
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def chat(text: str) -> list[int]:
        ids: Any = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    sets = {
        "chat": [chat(q) for q in CHAT],
        "rag-quote": [chat(f"Context: {c}\n\nQuestion: {q}") for c, q in CONTEXTS],
    }
    # warm-up (allocator, first-call kernels)
    _run(model, drafter, head, [sets["chat"][0]], {"method": "none"}, 4)

    runs: list[Run] = []
    failures: list[str] = []
    for set_name, prompts in sets.items():
        base: list[list[int]] | None = None
        for name, spec in methods.items():
            s, n, itl, outs, stats = _run(model, drafter, head, prompts, spec, max_tokens)
            runs.append(Run(name, set_name, n, s, itl, outs, stats))
            print(f"  {set_name:10s} {name:14s} {n / s:7.1f} tok/s", flush=True)
            if base is None:
                base = outs
            elif outs != base:
                failures.append(f"{set_name}/{name}: output differs from no-speculation greedy")
        if set_name == "chat" and base is not None and "Paris" not in tok.decode(base[0]):
            failures.append("chat: the model did not answer 'Paris'")

    _write(runs, failures, max_tokens, threads, head_dir)
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


def _write(
    runs: list[Run], failures: list[str], max_tokens: int, threads: int, head_dir: str | None
) -> None:
    import transformers

    RESULTS.mkdir(parents=True, exist_ok=True)
    base = {r.prompt_set: r.tokens_per_s for r in runs if r.method == "none"}
    lines = [
        "# Speculative decoding — SmolLM2-135M-Instruct, CPU, batch 1, greedy",
        "",
        f"Generated by `python -m bench spec` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Each prompt set: {len({r.prompt_set for r in runs})} sets x 4 prompts, max_tokens={max_tokens}, "
        f"fp32, torch threads={threads}. Timing excludes prefill (time to first token).",
        "Every speculative run reproduced the no-speculation output token for token"
        if not failures
        else "FAILURES: " + "; ".join(failures),
        "",
        "| prompts | method | tok/s | speedup | ITL p50 ms | ITL p99 ms | acceptance | mean accepted / step | per-position acceptance | draft s | verify s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        st = r.stats
        per_pos = ", ".join(f"{x:.2f}" for x in st["acceptance_per_position"])
        lines.append(
            f"| {r.prompt_set} | {r.method} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / base[r.prompt_set]:.2f}x | {statistics.median(r.itl_ms):.1f} | "
            f"{_pct(r.itl_ms, 0.99):.1f} | {st['acceptance_rate']:.2f} | "
            f"{st['mean_accepted_length']:.2f} | {per_pos} | {st['draft_s']:.2f} | {st['verify_s']:.2f} |"
        )
    load = os.getloadavg()
    lines += [
        "",
        "## Machine",
        "",
        f"- {platform.machine()}, {os.cpu_count()} CPUs visible, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        "(a shared machine: absolute numbers are noisy, ratios less so)",
        f"- python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}",
        "- drafter for draft-target: the target's first "
        f"{DRAFT_LAYERS} of 30 layers + its norm and head (weights shared, no training)",
        f"- MTP/EAGLE head: {_head_note(head_dir)}",
    ]
    png = _plot(runs, base)
    if png:
        lines += ["", f"![tokens/s per method]({png.name})"]
    (RESULTS / "spec.md").write_text("\n".join(lines) + "\n")


def _head_note(head_dir: str | None) -> str:
    if not head_dir:
        return "no trained head given (--mtp-head=DIR), so no MTP row"
    import json

    meta = json.loads((Path(head_dir) / "config.json").read_text())
    return (
        f"trained by `python -m rose.spec.train_mtp` ({meta.get('train_note', 'see config.json')}); "
        f"loss per epoch {[round(x, 3) for x in meta.get('loss_history', [])]}"
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
