"""Grammar engines for structured output, by the cost of one token's mask (issue #24).

What a constrained generation pays per token is one mask computation (the set of tokens the
grammar allows next, as a bitmask over the vocabulary) plus advancing the matcher by the
chosen token. Measured here for each engine on PyPI that ships CPU wheels, on SmolLM2's
49,152-token vocabulary, along real JSON documents teacher-forced token by token (so every
engine walks the same path), for `json_object` and two JSON Schemas:

  xgrammar      GrammarCompiler.compile_json_schema -> GrammarMatcher.fill_next_token_bitmask
  llguidance    LLMatcher.grammar_from_json_schema -> llguidance.torch.fill_next_token_bitmask

(outlines-core builds its index from a regex over the whole vocabulary ahead of time; its
`Vocabulary.from_pretrained` needs the Hub, which this machine cannot reach, so it is left
out.) Reported: compile time (first compile of each schema, cold) and the p50 / p99 / max of
mask + advance per token over 5 rounds. One thread, fp32 masks applied to nothing: the
engines' own cost only.

Then what a constrained request costs end to end: SmolLM2-135M-Instruct in ROSE's generation
engine, greedy, one request at a time, the same chat prompts asking for JSON, generated
tokens per second with ``response_format`` json_schema vs without (#24's bar: at most 15%
fewer tokens/s).

    python -m bench grammar [--rounds=N]

llguidance is a bench peer (`pip install -e .[bench]`); xgrammar is Trellis's dependency.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.report import machine

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results" / "grammar.md"
MODEL = "smollm2-135m-instruct"

SCHEMAS: dict[str, tuple[dict | None, object]] = {
    "json_object": (
        None,
        {"query": "dense retrieval", "filters": {"lang": "en", "year": [2023, 2024]}, "k": 10},
    ),
    "record": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "year": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "score": {"type": "number"},
            },
            "required": ["title", "year", "tags", "score"],
            "additionalProperties": False,
        },
        {
            "title": "A survey of dense retrieval for question answering",
            "year": 2024,
            "tags": ["search", "embeddings", "rag", "reranking"],
            "score": 0.93,
        },
    ),
    "answer-with-sources": (
        {
            "type": "object",
            "properties": {
                "answer": {"type": "string"},
                "confidence": {"enum": ["low", "medium", "high"]},
                "sources": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "quote": {"type": "string"},
                        },
                        "required": ["id", "quote"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["answer", "confidence", "sources"],
            "additionalProperties": False,
        },
        {
            "answer": "Late chunking embeds the whole document once, then pools each chunk.",
            "confidence": "high",
            "sources": [
                {"id": 3, "quote": "token embeddings of the full document are mean pooled"},
                {"id": 7, "quote": "chunks keep the context of the text around them"},
            ],
        },
    ),
}


def _xgrammar(tokenizer, vocab: int, eos: int) -> Callable:  # type: ignore[no-untyped-def]
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])

    def run(schema: dict | None, ids: list[int], rounds: int) -> tuple[float, list[float]]:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        text = json.dumps(schema) if schema else '{"type": "object"}'
        compiled = compiler.compile_json_schema(text, any_whitespace=False)
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(rounds):
            matcher = xgr.GrammarMatcher(compiled)
            for token in ids:
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                ok = matcher.accept_token(token)
                times.append(time.perf_counter() - t)
                assert ok, f"xgrammar refused token {token}"
            assert matcher.is_terminated()
        return compile_s, times

    return run


def _llguidance(tokenizer, vocab: int, eos: int) -> Callable:  # type: ignore[no-untyped-def]
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def run(schema: dict | None, ids: list[int], rounds: int) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema or {"type": "object"}),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        assert not matcher.get_error(), matcher.get_error()
        bitmask = llt.allocate_token_bitmask(1, vocab)
        times = []
        for r in range(rounds):
            if r:
                matcher = llguidance.LLMatcher(lltok, grammar)
            for token in ids:
                t = time.perf_counter()
                llt.fill_next_token_bitmask(matcher, bitmask, 0)
                ok = matcher.consume_token(token)
                times.append(time.perf_counter() - t)
                assert ok, f"llguidance refused token {token}: {matcher.get_error()}"
            assert matcher.is_stopped()
        return compile_s, times

    return run


ENGINE_PROMPTS = [
    "Describe a famous novel as JSON.",
    "Give me a JSON record for the city of Lyon.",
    "Return a JSON object describing a search result about solar panels.",
    "Summarize the plot of a detective story as JSON.",
]
ENGINE_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 0, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "tags", "summary"],
    "additionalProperties": False,
}


def _engine_cost(rounds: int, max_tokens: int = 96) -> list[tuple[str, float, int, float]]:
    """(mode, tokens/s of the median round, tokens in it, seconds) with and without the
    schema; rounds alternate which mode runs first."""
    import torch
    from transformers import AutoTokenizer

    from rose.assets import ensure_model
    from rose.generate import GenerationEngine
    from rose.grammar import Grammars, JsonFormat
    from rose.models.llama import LlamaForCausalLM
    from rose.sampling import SamplingParams

    directory = ensure_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, device="cpu")
    eos = [int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]
    engine = GenerationEngine(
        model, eos_ids=eos, grammars=Grammars(directory, model.config.vocab_size, eos)
    )
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for p in ENGINE_PROMPTS
    ]
    modes = {
        "free text": SamplingParams(max_tokens=max_tokens),
        "json_schema": SamplingParams(
            max_tokens=max_tokens, response_format=JsonFormat(json.dumps(ENGINE_SCHEMA))
        ),
    }
    engine.generate(prompts[:1], modes["json_schema"])  # compile + warm up
    runs: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            t0, tokens = time.perf_counter(), 0
            for ids in prompts:  # one request at a time: batch-1 decoding
                tokens += len(engine.generate([ids], modes[mode])[0].output_ids)
            runs[mode].append((time.perf_counter() - t0, tokens))
    out = []
    for mode, done in runs.items():
        rates = sorted((n / s, n, s) for s, n in done)
        rate, n, seconds = rates[len(rates) // 2]
        out.append((mode, rate, n, seconds))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench grammar")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from rose.assets import ensure_model

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(MODEL)))
    vocab, eos = len(tokenizer), int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engines: dict[str, Callable] = {"xgrammar": _xgrammar(tokenizer, vocab, eos)}
    try:
        engines["llguidance"] = _llguidance(tokenizer, vocab, eos)
    except ImportError:
        print("llguidance is not installed (pip install -e .[bench]); measuring xgrammar only")

    rows = []
    for name, (schema, doc) in SCHEMAS.items():
        ids = tokenizer(json.dumps(doc), add_special_tokens=False)["input_ids"] + [eos]
        for engine, run in engines.items():
            compile_s, times = run(schema, ids, args.rounds)
            us = np.asarray(times) * 1e6
            rows.append(
                (
                    name,
                    len(ids),
                    engine,
                    compile_s * 1e3,
                    statistics.median(us),
                    float(np.percentile(us, 99)),
                    float(us.max()),
                )
            )
            print(
                f"{name:20s} {engine:10s} compile {compile_s * 1e3:8.1f} ms  per token p50 "
                f"{statistics.median(us):7.1f} us  p99 {np.percentile(us, 99):8.1f} us",
                flush=True,
            )

    lines = [
        "# Grammar engines: cost of one token's mask (structured output, #24)",
        "",
        f"`python -m bench grammar --rounds={args.rounds}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"SmolLM2-135M-Instruct's vocabulary ({vocab} tokens), compact JSON (no free "
        "whitespace), each document teacher-forced token by token through the matcher; per "
        "token = fill the next-token bitmask + advance by the token. Compile = first compile "
        "of the schema, cache off.",
        "",
        "| format | tokens | engine | compile ms | per token p50 us | p99 us | max us |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, n, engine, c, p50, p99, mx in rows:
        lines.append(f"| {name} | {n} | {engine} | {c:.1f} | {p50:.1f} | {p99:.1f} | {mx:.0f} |")
    by_engine = {e: [r[4] for r in rows if r[2] == e] for e in engines}
    medians = {e: statistics.median(v) for e, v in by_engine.items()}
    best = min(medians, key=medians.__getitem__)
    lines += [
        "",
        "Median over the formats of the per-token p50: "
        + ", ".join(f"{e} {m:.1f} us" for e, m in medians.items())
        + f". Lowest: **{best}**. A decode step of SmolLM2-135M on this CPU takes"
        " milliseconds, so either engine's mask is a small share of it; the per-token cost"
        " (paid every token) outweighs the compile cost (paid once per schema, and cached).",
    ]
    cost = _engine_cost(args.rounds)
    for mode, rate, n, seconds in cost:
        print(f"engine {mode:12s} {rate:7.1f} tokens/s ({n} tokens in {seconds:.1f} s)", flush=True)
    free, held = cost[0][1], cost[1][1]
    lines += [
        "",
        "## What a constrained request costs in the engine",
        "",
        "SmolLM2-135M-Instruct in ROSE's generation engine (fp32, CPU), greedy, one request at a"
        f" time, the {len(ENGINE_PROMPTS)} chat prompts of `ENGINE_PROMPTS` asking for JSON, up"
        f" to 96 new tokens each, {args.rounds} rounds alternating the order; the median round.",
        "",
        "| mode | tokens/s | tokens | seconds |",
        "|---|---:|---:|---:|",
        *(f"| {m} | {r:.1f} | {n} | {sec:.1f} |" for m, r, n, sec in cost),
        "",
        f"json_schema ÷ free text: **{held / free:.2f}x** tokens/s (#24's bar: at least 0.85x,"
        f" {'met' if held / free >= 0.85 else 'NOT met'}).",
    ]
    import importlib.metadata as md

    versions = ", ".join(
        f"{p} {md.version(p)}" for p in ("xgrammar", "llguidance") if _installed(p, md)
    )
    lines += [
        "",
        f"{versions}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"{machine()}, 1 torch thread.",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")
    return 0


def _installed(package: str, md) -> bool:  # type: ignore[no-untyped-def]
    try:
        md.version(package)
    except md.PackageNotFoundError:
        return False
    return True
