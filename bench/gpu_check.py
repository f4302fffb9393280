"""GPU check for ROSE: FlashInfer and CUDA-graph replay against eager SDPA, with latencies.

On a CUDA machine (installs nothing): loads multilingual-e5-small from the model cache if it
is there (else a random-weight model of the same shape, built with transformers), runs the
same ragged batches through

    sdpa            eager, SDPA attention (the reference)
    flashinfer      eager, FlashInfer ragged prefill (if importable; the engine logs fallback)
    flashinfer+cg   FlashInfer with CUDA graphs (each batch: warm-up, capture, replays)
    sdpa+cg         SDPA (block-diagonal) with CUDA graphs

in bf16, checks every row against the reference (cosine >= 0.999) and prints step() latency
p50/p99 per configuration. Without CUDA it says so and exits 0 after checking that the GPU
code paths import cleanly.

    python -m bench gpu_check [--model-dir=DIR] [--iters=N]
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
SHAPES = {  # name → row lengths
    "1x16": [16],
    "8x64": [64] * 8,
    "mixed-32": [16, 23, 40, 64, 100, 128, 200, 300, 512, 18, 33, 47] + [24] * 20,
}


def _model_dir(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    from rose.assets import model_dir

    cached = model_dir("multilingual-e5-small")
    if (cached / "config.json").exists():
        return cached
    import torch
    import transformers

    print("e5-small not in the model cache: using random weights of the same shape")
    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=8000,
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=514,
        type_vocab_size=2,
        pad_token_id=1,
    )
    where = Path(tempfile.mkdtemp()) / "e5-small-shaped"
    transformers.XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(where)
    return where


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench gpu_check")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)

    import torch

    from rose.attention.flashinfer import import_flashinfer

    flashinfer, why = import_flashinfer()
    print(
        f"torch {torch.__version__}; FlashInfer: {'importable' if flashinfer else 'absent (' + why + ')'}"
    )
    if not torch.cuda.is_available():
        print("no CUDA: GPU paths import cleanly; nothing to check on this machine")
        return 0

    import logging

    from rose import Engine, EngineConfig, RaggedBatch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(f"device: {torch.cuda.get_device_name()}")
    path = _model_dir(args.model_dir)
    configs = {
        "sdpa": EngineConfig(device="cuda", dtype="bfloat16", attention="sdpa", cuda_graphs=False),
        "flashinfer": EngineConfig(
            device="cuda", dtype="bfloat16", attention="flashinfer", cuda_graphs=False
        ),
        "flashinfer+cg": EngineConfig(
            device="cuda", dtype="bfloat16", attention="flashinfer", cuda_graphs=True
        ),
        "sdpa+cg": EngineConfig(
            device="cuda", dtype="bfloat16", attention="sdpa", cuda_graphs=True
        ),
    }
    engines = {name: Engine.load(path, cfg) for name, cfg in configs.items()}
    for name, engine in engines.items():
        graphs = "graphs on" if engine.graphs is not None else "graphs off"
        print(f"{name:14s} attention={engine.attention.describe()}, {graphs}")

    rng = np.random.default_rng(0)
    vocab = engines["sdpa"].info.vocab_size
    batches = {
        shape: RaggedBatch.from_lists(
            [[0, *rng.integers(5, vocab, n - 2).tolist(), 2] for n in lengths]
        )
        for shape, lengths in SHAPES.items()
    }
    failures = 0
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

    print(f"\nstep().wait() latency over {args.iters} calls (ms, p50 / p99)")
    print(f"{'shape':10s}" + "".join(f"{n:>22s}" for n in engines))
    for shape, batch in batches.items():
        row = f"{shape:10s}"
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
    print("\nresult:", "all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0
