"""GPU check for ROSE: FlashInfer and CUDA-graph replay against eager SDPA, with latencies.

On a CUDA machine (installs nothing): an encoder of multilingual-e5-small's size (XLM-R, 12
layers, 384-d) but with 6 heads of 64 and 4,098 positions, random weights, built with
transformers (e5-small itself has heads of 32, which FlashInfer's kernels do not take, and
512 positions); or `--model-dir`. It runs the same ragged batches through

    sdpa            eager, SDPA attention (the reference)
    sdpa+cg         SDPA (block-diagonal) with CUDA graphs
    flashinfer      eager, FlashInfer ragged prefill
    flashinfer+cg   FlashInfer with CUDA graphs (each batch: warm-up, capture, replays)

in bf16, checks every row against the reference (cosine >= 0.999), then prints the latency
table: step().wait() p50/p99 for one row of 128, 512 and 4,096 tokens, graphs on vs off.
The FlashInfer configurations must run FlashInfer (`flashinfer_coverage`): where FlashInfer
imports and an engine fell back to SDPA that is a failure; where it does not import they
are reported skipped, never compared SDPA with SDPA. Then the decoder (SmolLM2-135M-Instruct
from the model cache, bf16, heads of 64): greedy chat answers with attention through SDPA
over gathered K/V against FlashInfer's paged kernel (`rose.attention.paged`), plain and with
MTP speculation when a trained head is in the cache (chains accepted on the device,
`spec.device_chain`, and on the host; draft trees through the masked FA2 wrappers), reporting
tokens/s and how many answers the two attention paths agree on token for token (bf16 sums in
another order may flip a near-tie, so agreement is reported, and a prefix of at least 16
tokens is required). Without CUDA it says so and exits 0 after checking that the GPU code
paths import cleanly.

    python -m bench gpu_check [--model-dir=DIR] [--iters=N] [--skip-decoder]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]

MIN_COSINE = 0.999
SHAPES = {  # name → row lengths (checked against SDPA)
    "1x16": [16],
    "8x64": [64] * 8,
    "mixed-32": [16, 23, 40, 64, 100, 128, 200, 300, 512, 18, 33, 47] + [24] * 20,
    "1x128": [128],
    "1x512": [512],
    "1x4096": [4096],
}
LATENCY_SHAPES = ("1x128", "1x512", "1x4096")  # the latency table's rows: batch 1


def _model_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=8000,
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,  # heads of 64: FlashInfer takes 64/128/256
        intermediate_size=1536,
        max_position_embeddings=4096 + 2,  # XLM-R's positions start after the padding id
        type_vocab_size=2,
        pad_token_id=1,
    )
    where = Path(tempfile.mkdtemp()) / "e5-small-sized-h64"
    transformers.XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(where)
    return where


def _covered(name: str, backend_name: str) -> str | None:
    """None when `name` may be checked; else why not ("FAIL: ..." for a silent fallback)."""
    if not name.startswith("flashinfer"):
        return None
    from rose.attention import flashinfer_coverage

    try:
        return flashinfer_coverage(backend_name)
    except AssertionError as exc:
        return f"FAIL: {exc}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu_check")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--skip-decoder", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from rose.attention.flashinfer import import_flashinfer

    flashinfer, why = import_flashinfer()
    version = getattr(flashinfer, "__version__", "?")
    print(
        f"torch {torch.__version__}; FlashInfer: "
        + (f"{version} importable" if flashinfer else f"absent ({why})")
    )
    if not torch.cuda.is_available():
        print("no CUDA: GPU paths import cleanly; nothing to check on this machine")
        return 0

    import logging

    from rose import Engine, EngineConfig, RaggedBatch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(f"device: {torch.cuda.get_device_name()}")
    path = _model_dir(args.model_dir)

    def config(attention: str, graphs: bool) -> EngineConfig:
        return EngineConfig(
            device="cuda", dtype="bfloat16", attention=attention, cuda_graphs=graphs
        )

    configs = {
        "sdpa": config("sdpa", False),
        "sdpa+cg": config("sdpa", True),
        "flashinfer": config("flashinfer", False),
        "flashinfer+cg": config("flashinfer", True),
    }
    engines = {name: Engine.load(path, cfg) for name, cfg in configs.items()}
    failures = 0
    for name, engine in list(engines.items()):
        graphs = "graphs on" if engine.graphs is not None else "graphs off"
        print(f"{name:14s} attention={engine.attention.describe()}, {graphs}")
        if (why := _covered(name, engine.attention.name)) is not None:
            failures += why.startswith("FAIL")
            print(f"{name:14s} {'' if why.startswith('FAIL') else 'skipped: '}{why}")
            del engines[name]

    rng = np.random.default_rng(0)
    vocab = engines["sdpa"].info.vocab_size
    batches = {
        shape: RaggedBatch.from_lists(
            [[0, *rng.integers(5, vocab, n - 2).tolist(), 2] for n in lengths]
        )
        for shape, lengths in SHAPES.items()
    }
    for shape, batch in batches.items():
        want = engines["sdpa"].step(batch).wait()
        for name, engine in engines.items():
            if name == "sdpa":
                continue
            worst = 1.0
            for _ in range(4):  # graphs: warm-up, capture + replay, replay, replay
                got = engine.step(batch).wait()
                worst = min(
                    worst, torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
                )
            ok = worst >= MIN_COSINE
            failures += not ok
            print(
                f"check {shape:9s} {name:14s} min cosine vs sdpa {worst:.6f} {'ok' if ok else 'FAIL'}"
            )

    print(f"\nstep().wait() latency, batch 1, bf16, over {args.iters} calls (ms, p50 / p99)")
    print(f"{'tokens':10s}" + "".join(f"{n:>22s}" for n in engines))
    for shape in LATENCY_SHAPES:
        batch = batches[shape]
        row = f"{shape.split('x')[1]:10s}"
        for engine in engines.values():
            for _ in range(5):
                engine.step(batch).wait()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                engine.step(batch).wait()
                times.append((time.perf_counter() - start) * 1e3)
            row += f"{statistics.median(times):>13.3f} / {np.percentile(times, 99):6.3f}"
        print(row)
    if not args.skip_decoder:
        failures += _decoder_check()
    print("\nresult:", "all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


DECODER_TOKENS = 64
MIN_AGREED_PREFIX = 16


def _decoder_check(device: str = "cuda", dtype_name: str = "bfloat16", limit: int = 0) -> int:
    """Greedy answers with SDPA vs FlashInfer paged attention (plain and MTP); failures.
    (``device``, ``dtype_name``, ``limit``: for a dry run of this check on other hardware.)"""
    import torch
    import transformers

    from bench.spec import CHAT, _engine, _one, chat_ids
    from rose.assets import model_dir
    from rose.models.llama import LlamaForCausalLM
    from rose.spec.mtp import MTPHead
    from rose.spec.train_mtp import default_head_dir

    path = model_dir("smollm2-135m-instruct")
    if not (path / "config.json").exists():
        print("\ndecoder: smollm2-135m-instruct not in the model cache; skipped")
        return 0
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [chat_ids(tok, question) for question, _ in CHAT[: limit or None]]
    dtype = getattr(torch, dtype_name)
    paged = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    gathered = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    gathered.paged_kernel = None
    print(f"\ndecoder: paged kernel {type(paged.paged_kernel).__name__}")
    kernel_name = getattr(paged.paged_kernel, "name", "sdpa")
    if device == "cuda" and (why := _covered("flashinfer", kernel_name)) is not None:
        print(f"decoder: {'' if why.startswith('FAIL') else 'skipped: '}{why}")
        return int(why.startswith("FAIL"))
    head_dir = default_head_dir("smollm2-135m-instruct")
    head = None
    if (head_dir / "model.safetensors").is_file():
        head = MTPHead.load(head_dir).to(device)
    methods = {"none": {"method": "none"}}
    if head is not None:
        methods["mtp k=3"] = {"method": "mtp", "num_draft_tokens": 3}
        # the same chain accepted on the host, then drafted at the next step's start: the
        # tokens/s gap is what keeping acceptance on the device (spec.device_chain) saves
        methods["mtp k=3 host"] = {"method": "mtp", "num_draft_tokens": 3, "device_chain": "off"}
        # chains cut where the head's confidence falls (on the device: all 5 head steps run,
        # only the kept drafts are verified)
        methods["mtp k=5 stop 0.15"] = {
            "method": "mtp",
            "num_draft_tokens": 5,
            "chain_min_prob": 0.15,
        }
        methods["mtp tree 3,2"] = {"method": "mtp", "num_draft_tokens": 2, "tree_widths": (3, 2)}
    failures = 0
    for name, spec in methods.items():
        outs, rates = {}, {}
        for label, model in (("sdpa", gathered), ("paged", paged)):
            eng = _engine(model, None, head, spec)
            _one(eng, prompts[0], 8)  # warm-up
            secs, tokens, answers = 0.0, 0, []
            for p in prompts:
                dt, _, out = _one(eng, p, DECODER_TOKENS)
                secs += dt
                tokens += max(0, len(out) - 1)
                answers.append(out)
            outs[label], rates[label] = answers, tokens / secs
        same = sum(a == b for a, b in zip(outs["sdpa"], outs["paged"], strict=True))
        pairs = list(zip(outs["sdpa"], outs["paged"], strict=True))
        prefix = min(_common_prefix(a, b) for a, b in pairs)
        # every pair agrees for MIN_AGREED_PREFIX tokens, or up to the shorter one's end
        ok = all(_common_prefix(a, b) >= min(MIN_AGREED_PREFIX, len(a), len(b)) for a, b in pairs)
        failures += not ok
        print(
            f"decoder {name:13s} sdpa {rates['sdpa']:7.1f} tok/s  paged {rates['paged']:7.1f} tok/s"
            f"  identical answers {same}/{len(prompts)}, shortest common prefix {prefix}"
            f" {'ok' if ok else 'FAIL'}"
        )
    return failures


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
