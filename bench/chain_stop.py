"""Choose `SpecConfig.chain_min_prob` for the MTP head on prompts nobody else uses.

A chain that stops once the head's probability for all of it falls below ``min_prob``
(`rose.spec.mtp.MTPDrafter.propose`) trades drafts that would likely be rejected for head
steps it does not run. Where the trade pays depends on the head and on this machine's costs,
so it is measured, on tuning prompts that are neither in the head's training corpus nor among
`bench.spec`'s chat prompts (which measure the result):

- the 16 local prompts (`rose.spec.corpus.local_prompts`) that follow the training
  corpus's 2560 in the same seeded sequence (`train_mtp`'s defaults: seed 1, the chat
  prompts of `bench.spec` excluded), so the head never saw them answered;
- SmolLM2-135M-Instruct, CPU, batch 1, greedy, one thread, methods interleaved per prompt:
  no speculation, the fixed chain of `bench.spec` (k = 3), and chains of up to ``--k``
  drafts stopping below each ``min_prob`` of the grid.

Every run must reproduce plain greedy output. Writes bench/results/chain_stop.md, naming the
best ``min_prob``; `bench.spec`'s "stop" chain row uses the value chosen here.

    python -m bench chain_stop [--max-tokens=96] [--k=5] [--grid=0.1,0.15,0.2,0.25,0.3,0.35,0.4]
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench import spec as bench_spec

__all__ = ["main", "tuning_prompts"]

RESULTS = Path(__file__).parent / "results"
TRAINING_PROMPTS = 2560  # rose.spec.train_mtp --prompts default
TRAINING_SEED = 1  # rose.spec.train_mtp --seed default
TUNING_PROMPTS = 16


def tuning_prompts(tokenizer_json: Path, n: int = TUNING_PROMPTS) -> list[str]:
    """The ``n`` prompts right after the default training corpus's in its seeded sequence:
    `local_prompts` draws them one by one from one generator, so a longer list starts with
    the shorter one and its tail is new."""
    from rose.spec.corpus import local_prompts

    held_out = [q for q, _ in bench_spec.CHAT]
    every = local_prompts(tokenizer_json, TRAINING_PROMPTS + n, TRAINING_SEED, held_out)
    return every[TRAINING_PROMPTS:]


def _grid(argv: list[str]) -> list[float]:
    for a in argv:
        if a.startswith("--grid="):
            return [float(x) for x in a.split("=", 1)[1].split(",")]
    return [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4]


def main(argv: list[str]) -> int:
    import transformers

    from rose.assets import ensure_model
    from rose.models.llama import LlamaForCausalLM
    from rose.spec.mtp import MTPHead
    from rose.spec.train_mtp import default_head_dir

    max_tokens = bench_spec._flag(argv, "max-tokens", 96)
    k = bench_spec._flag(argv, "k", 5)
    torch.set_num_threads(1)
    head_dir = default_head_dir("smollm2-135m-instruct")
    if not (head_dir / "model.safetensors").is_file():
        print(
            f"bench chain_stop: skipped, no trained head in {head_dir} "
            "(python -m rose.spec.train_mtp, or python -m bench spec --train-head)"
        )
        return 0
    path = ensure_model("smollm2-135m-instruct")
    model = LlamaForCausalLM.from_pretrained(path)
    head = MTPHead.load(head_dir)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = tuning_prompts(path / "tokenizer.json")
    prompts = []
    for t in texts:
        ids: Any = tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))

    methods: dict[str, dict[str, Any]] = {
        "none": {"method": "none"},
        "mtp k=3": {"method": "mtp", "num_draft_tokens": 3},
    }
    for p in _grid(argv):
        methods[f"mtp k={k} stop {p:g}"] = {
            "method": "mtp",
            "num_draft_tokens": k,
            "chain_min_prob": p,
        }
    bench_spec._one(bench_spec._engine(model, None, None, {"method": "none"}), prompts[0], 4)
    engines = {m: bench_spec._engine(model, None, head, s) for m, s in methods.items()}
    runs = bench_spec._run_set(engines, prompts, max_tokens, "tuning")
    failures = [
        f"{r.method}: output differs from no-speculation greedy"
        for r in runs
        if r.outputs != runs[0].outputs
    ]
    base = runs[0].tokens_per_s
    stops = [r for r in runs if " stop " in r.method]
    best = max(stops, key=lambda r: r.tokens_per_s)
    _write(runs, failures, texts, max_tokens, best.method)
    for r in runs:
        print(f"  {r.method:22s} {r.tokens_per_s:6.1f} tok/s {r.tokens_per_s / base:.3f}x")
    print(f"best: {best.method}")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


def _write(
    runs: list[bench_spec.Run], failures: list[str], texts: list[str], max_tokens: int, best: str
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = runs[0].tokens_per_s
    load = os.getloadavg()
    lines = [
        "# Chain stop probability for the MTP head (SpecConfig.chain_min_prob)",
        "",
        f"Generated by `python -m bench chain_stop` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: SmolLM2-135M-Instruct, CPU, "
        f"batch 1, greedy, fp32 target, one thread, max_tokens={max_tokens}, "
        f"{len(texts)} tuning prompts (after the head's training corpus in its seeded "
        "sequence: never trained on, and not the chat prompts of bench/results/spec.md).",
        "Every run reproduced plain greedy output token for token."
        if not failures
        else "FAILURES: " + "; ".join(failures),
        "",
        "| method | tok/s | speedup | mean accepted / step | steps | draft ms / step | "
        "verify ms / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        st = r.stats
        steps = max(1, st["steps"])
        lines.append(
            f"| {r.method} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.3f}x | "
            f"{st['mean_accepted_length']:.3f} | {st['steps']} | "
            f"{1e3 * st['draft_s'] / steps:.1f} | {1e3 * st['verify_s'] / steps:.1f} |"
        )
    lines += [
        "",
        f"Best: **{best}**.",
        "",
        "## Tuning prompts",
        "",
        *[f"- {t}" for t in texts],
        "",
        "## Machine",
        "",
        f"- {platform.machine()}, {os.cpu_count()} CPUs visible, load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; torch {torch.__version__}",
        f"- ITL p50 of the best: "
        f"{statistics.median(next(r for r in runs if r.method == best).itl_ms):.1f} ms",
    ]
    (RESULTS / "chain_stop.md").write_text("\n".join(lines) + "\n")
