"""Prefix caching: time to first token of a RAG request whose prompt starts like the one
before it (issue #24's bar: the second of two requests sharing a 400-token prefix reaches its
first token >= 5x faster than without the cache; greedy output unchanged).

SmolLM2-135M-Instruct in ROSE's generation engine, CPU, fp32, one request at a time. Each
round builds a fresh engine with the prefix cache and one without, and sends both the same
two chat prompts: a system prompt and retrieval passages (the shared prefix, over 400
tokens), then two different questions. The first request warms the cache; the second one's
time to first token (``add`` until the step that emits its first token returns) is the
measurement. Both engines' answers to the second request must be equal, token for token.

    python -m bench prefix [--rounds=N] [--threads=N]

Writes bench/results/prefix_cache.md (+ prefix_cache.png when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import machine, percentile

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16

SYSTEM = (
    "You are a search assistant. Answer the user's question using only the passages below. "
    "Quote the passage you use and give its number. If the passages do not answer the "
    "question, say so."
)
PASSAGES = """[1] The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 \
metres tall and was the tallest man-made structure in the world for 41 years, until the \
Chrysler Building in New York was finished in 1930. It was designed by the engineering \
company of Gustave Eiffel, and about 300 workers assembled its 18,038 wrought-iron parts in \
just over two years.
[2] To reset the router, unplug the power cable and wait ten seconds, plug the cable back in, \
then hold the reset button on the back for ten seconds until the power light blinks orange. \
Wait two minutes for the router to restart and connect to the default network printed on the \
label. The router's warranty lasts two years from the date of purchase.
[3] The library is open Monday to Friday from 9 am to 8 pm, and on Saturday from 10 am to \
4 pm. It is closed on Sundays and public holidays. Members can borrow up to ten books at a \
time for three weeks, and can renew each loan twice online. The library was built in 1902 \
with a gift from a local merchant and was extended in 1968.
[4] Honeybees communicate the direction and distance of flowers with the waggle dance. A \
forager returning to the hive runs in a figure of eight, and the angle of the straight run \
relative to vertical matches the angle between the flowers and the sun. The length of the \
run tells the other bees how far to fly.
[5] Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes \
place in the chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue \
light and reflects green light, which is why leaves look green."""
QUESTIONS = [
    "How tall is the Eiffel Tower?",
    "How long should I hold the reset button?",
    "When is the library open on Saturday?",
    "How do bees tell each other where flowers are?",
    "Why are leaves green?",
    "Who designed the Eiffel Tower?",
    "How many books can a member borrow?",
    "How long is the router's warranty?",
    "What does the waggle dance's angle mean?",
    "Where does photosynthesis take place?",
]


def _prompt(tok: Any, question: str) -> list[int]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Passages:\n{PASSAGES}\n\nQuestion: {question}"},
    ]
    ids: Any = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ttft(engine: Any, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from `add` to the first emitted token, and the whole greedy answer."""
    from rose.sampling import SamplingParams

    t0 = time.perf_counter()
    engine.add(prompt, SamplingParams(max_tokens=MAX_TOKENS))
    first = None
    out: list[int] = []
    while engine.has_unfinished():
        for step in engine.step():
            out.extend(step.new_ids)
            if first is None and step.new_ids:
                first = time.perf_counter() - t0
    assert first is not None
    return first, out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench prefix")
    parser.add_argument("--rounds", type=int, default=len(QUESTIONS) - 1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import transformers

    from rose.assets import ensure_model
    from rose.generate import GenerationConfig, GenerationEngine
    from rose.models.llama import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    path = Path(ensure_model(MODEL))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path)
    eos = model.config.eos_token_ids
    prompts = [_prompt(tok, q) for q in QUESTIONS]
    shared = min(_shared(prompts[0], p) for p in prompts[1:])

    def engine(cache: bool) -> GenerationEngine:
        return GenerationEngine(
            model, GenerationConfig(max_batch=1, prefix_cache=cache), eos_ids=eos
        )

    _ttft(engine(False), prompts[0])  # warm up kernels and allocator
    rows: dict[str, list[float]] = {"cache": [], "off": [], "first": []}
    hits: list[int] = []
    for i in range(args.rounds):
        first, second = prompts[i % len(prompts)], prompts[(i + 1) % len(prompts)]
        outs = {}
        for name in ("off", "cache"):  # interleaved: load changes hit both alike
            eng = engine(name == "cache")
            cold, _ = _ttft(eng, first)
            seconds, outs[name] = _ttft(eng, second)
            rows[name].append(seconds)
            if name == "off":
                rows["first"].append(cold)
            else:
                hits.append(eng.prefix_cache.stats.hit_tokens)  # type: ignore[union-attr]
        assert outs["cache"] == outs["off"], f"round {i}: the cache changed the answer"
        print(
            f"round {i}: ttft off {rows['off'][-1] * 1e3:.1f} ms, "
            f"cache {rows['cache'][-1] * 1e3:.1f} ms",
            flush=True,
        )
    p50 = {k: statistics.median(v) for k, v in rows.items()}
    ratio = p50["off"] / p50["cache"]
    lengths = [len(p) for p in prompts]
    lines = [
        "# Prefix caching — SmolLM2-135M-Instruct, CPU, time to first token",
        "",
        f"Generated by `python -m bench prefix` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Machine: {machine()}, torch threads={args.threads}, fp32, "
        f"page size 16, one request at a time.",
        f"Prompts: chat template, system prompt + 5 retrieval passages + a question; "
        f"{min(lengths)}-{max(lengths)} tokens, the first {shared} shared by every prompt.",
        f"Each of {args.rounds} rounds: a fresh engine with the cache and one without, each sent "
        "the same two prompts (different questions); the second request's time to first token "
        "is measured. Its greedy answer with the cache equals the one without in every round.",
        "",
        "| engine | TTFT p50 ms | TTFT p99 ms | prompt tokens found in the cache (mean) |",
        "|---|---|---|---|",
        f"| first request (cold) | {p50['first'] * 1e3:.1f} | {percentile(rows['first'], 99) * 1e3:.1f} | 0 |",
        f"| second request, no prefix cache | {p50['off'] * 1e3:.1f} | "
        f"{percentile(rows['off'], 99) * 1e3:.1f} | 0 |",
        f"| second request, prefix cache | {p50['cache'] * 1e3:.1f} | "
        f"{percentile(rows['cache'], 99) * 1e3:.1f} | {statistics.mean(hits):.0f} |",
        "",
        f"**Speed-up of the second request's first token: {ratio:.1f}x** (p50 without / with "
        f"the cache; bar: >= 5x, {'met' if ratio >= 5 else 'NOT met'}).",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cache.md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(rows)
    return 0


def _plot(rows: dict[str, list[float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["first (cold)", "second, no cache", "second, prefix cache"]
    data = [[x * 1e3 for x in rows[k]] for k in ("first", "off", "cache")]
    ax.boxplot(data, tick_labels=labels)
    ax.set_ylabel("time to first token, ms")
    ax.set_title("Prefix caching, SmolLM2-135M, CPU")
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_cache.png", dpi=120)
