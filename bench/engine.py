"""ROSE encoder throughput on CPU vs sentence-transformers and padded transformers.

Same process, same thread count, same texts: a long-tailed mix of 16–512 tokens (log-normal,
median ~48) built from multilingual sentences, for multilingual-e5-small. Each round runs
every system once (interleaved, so machine load hits all alike); tokens/s come from the
median round. Also: per-call overhead of `Engine.step()` at 1 row x 16 tokens, and the SDPA
strategy sweep behind `rose.attention.sdpa`'s "auto" cost model.

Reduced precision (issue #25): tokens/s at 128 / 512 tokens x 1 / 32 rows for ROSE fp32,
bf16 and int8 (`rose.int8`) next to sentence-transformers fp32 and ONNX Runtime fp32 / int8
(the same model exported with torch.onnx, int8 by `quantize_dynamic`; `make bench-peers`
installs them), and each system's per-row cosine to sentence-transformers fp32 and top-10
overlap on a query -> passage search over 1,000 real corpus lines (tests/tokenizer_corpus).
Results: bench/results/engine.md and engine.png; `--quick` (4 rows instead of 32, 100
passages, one round) checks that the bench works and writes to a temporary directory.

The run fails (exit 1) if ROSE's fp32 embeddings differ from sentence-transformers' (cosine
< 0.9999 on any text) or a reduced mode misses its bound (0.999 bf16, 0.99 int8), so a fast
but wrong engine cannot pass.

    python -m bench engine [--threads=N] [--texts=N] [--rounds=N] [--batch=N] [--quick]
                           [--results=PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.report import machine, percentile

__all__ = ["main"]

MODEL = "multilingual-e5-small"
RESULTS = Path(__file__).parent / "results" / "engine.md"
BAR = 1.3  # ROSE tokens/s over sentence-transformers encode()
MIN_COSINE = 0.9999

SENTENCES = [
    "The committee postponed its decision until the auditors had reviewed every invoice.",
    "Heavy rain is expected across the northern valleys tonight, with flooding possible near rivers.",
    "She replaced the worn bearings, tightened the chain and took the bicycle out for a test ride.",
    "Le musée ouvrira une nouvelle aile consacrée aux instruments scientifiques du dix-huitième siècle.",
    "Les habitants du quartier ont demandé davantage de pistes cyclables et un marché le samedi.",
    "Die Bibliothek verlängert ihre Öffnungszeiten während der Prüfungswochen bis Mitternacht.",
    "Nach dem Umbau verbraucht das Gebäude nur noch die Hälfte der früheren Heizenergie.",
    "El tren de alta velocidad conecta ahora las dos ciudades en menos de tres horas.",
    "La receta tradicional usa azafrán, pimentón ahumado y arroz de grano corto.",
    "Il consiglio comunale ha approvato il bilancio dopo una lunga discussione notturna.",
    "Новая линия метро соединит аэропорт с центром города уже в следующем году.",
    "Учёные обнаружили, что эти птицы запоминают расположение тысяч тайников с семенами.",
    "新しい図書館は駅から歩いて五分の場所にあり、週末も夜九時まで開いています。",
    "研究チームは、この酵素が低温でも安定して働くことを確認した。",
    "这家工厂去年把太阳能板的产量提高了一倍，并减少了用水量。",
    "周末的市场上有很多新鲜的蔬菜和手工做的点心。",
    "Zespół naukowców opublikował dane z trzyletnich pomiarów jakości powietrza.",
    "Yeni köprü, iki yaka arasındaki yolculuk süresini yarım saate indirdi.",
    "Hoteli ilijengwa upya baada ya mafuriko na sasa inatumia nishati ya jua.",
    "A biblioteca municipal recebeu uma doação de mil livros infantis ilustrados.",
]


@dataclass(frozen=True)
class Workload:
    texts: list[str]
    ids: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.ids)


def _workload(tokenizer, count: int, seed: int) -> Workload:  # type: ignore[no-untyped-def]
    """Texts whose token counts follow a long-tailed mix in 16..512."""
    rng = np.random.default_rng(seed)
    targets = np.clip(np.exp(rng.normal(np.log(48), 0.9, count)), 16, 512).astype(int)
    sentence_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in SENTENCES]
    texts = []
    for target in targets:
        pieces: list[int] = []
        while len(pieces) < target - 2:
            pieces.extend(sentence_ids[int(rng.integers(len(SENTENCES)))])
        texts.append(tokenizer.decode(pieces[: target - 2]))
    ids = tokenizer(texts, truncation=True, max_length=512)["input_ids"]
    return Workload(texts, ids)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sdpa_sweep() -> list[tuple[int, int, float, float, str, str]]:
    """Time both SDPA strategies on uniform batches (e5-small heads: 12 x 32)."""
    import torch

    from rose.attention.base import AttentionInputs
    from rose.attention.sdpa import SdpaBackend, choose_sdpa_strategy

    shapes = ((2, 16), (8, 16), (32, 16), (64, 16), (8, 64), (32, 64), (8, 256), (4, 512))
    sweep = []
    for rows, length in shapes:
        lens = np.full(rows, length)
        cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        q = torch.randn(int(cu[-1]), 12, 32)
        seg = torch.repeat_interleave(torch.arange(rows), torch.from_numpy(lens))
        inputs = AttentionInputs(torch.from_numpy(cu), seg)
        times = {}
        for strategy in ("per-sequence", "block-diagonal"):
            sdpa = SdpaBackend(strategy)
            state = sdpa.prepare(sdpa.plan(cu), inputs)

            def once(sdpa: SdpaBackend = sdpa, state: object = state, q: torch.Tensor = q) -> None:
                with torch.inference_mode():
                    sdpa.attend(q, q, q, state)

            for _ in range(3):
                once()
            times[strategy] = statistics.median(_timed(once) for _ in range(15))
        faster = min(times, key=times.__getitem__)
        sweep.append(
            (
                rows,
                length,
                times["per-sequence"],
                times["block-diagonal"],
                faster,
                choose_sdpa_strategy(lens),
            )
        )
    return sweep


def _kernel_sweep() -> list[tuple[int, float, float]]:
    """One row of each length through SDPA (PyTorch's CPU flash kernel) and through the CPU
    default, ONNX Runtime's kernel (`rose.attention.onnxrt`): (tokens, sdpa s, ort s). The
    operands are what the encoders pass, views of one fused q/k/v projection."""
    import torch

    from rose.attention import OnnxRuntimeBackend, select_backend
    from rose.attention.base import AttentionInputs
    from rose.attention.sdpa import SdpaBackend

    ort = select_backend(None, "per-sequence", torch.device("cpu"), torch.float32, 12, 32).backend
    if not isinstance(ort, OnnxRuntimeBackend):
        return []
    sdpa = SdpaBackend("per-sequence")
    sweep = []
    for length in (16, 32, 64, 128, 256, 512, 1024, 2048):
        cu = np.array([0, length], dtype=np.int64)
        q, k, v = torch.randn(length, 3, 12, 32).unbind(1)  # [L, 12, 32] views
        inputs = AttentionInputs(torch.from_numpy(cu), torch.zeros(length, dtype=torch.long))
        times = []
        for backend in (sdpa, ort):
            state = backend.prepare(backend.plan(cu), inputs)

            def once(b: object = backend, state: object = state, qkv: tuple = (q, k, v)) -> None:
                with torch.inference_mode():
                    b.attend(*qkv, state)  # type: ignore[attr-defined]

            for _ in range(3):
                once()
            times.append(statistics.median(_timed(once) for _ in range(15)))
        sweep.append((length, times[0], times[1]))
    return sweep


# -- reduced precision (issue #25) -----------------------------------------------------------

SHAPES = ((128, 1), (128, 32), (512, 1), (512, 32))  # (tokens per row, rows per call)
QUICK_SHAPES = ((128, 1), (128, 4), (512, 1), (512, 4))
ROSE_MODES = (
    ("ROSE fp32", {}),
    ("ROSE fp32, SDPA attention", {"attention": "sdpa"}),  # before the CPU attention kernel
    ("ROSE bf16", {"dtype": "bfloat16"}),
    ("ROSE int8", {"quantize": "int8"}),
)
PEERS = ("sentence-transformers fp32", "ONNX Runtime fp32", "ONNX Runtime int8")
# Per-row cosine to fp32 (sentence-transformers) each ROSE mode must reach, else exit 1.
MODE_COSINE = {
    "ROSE fp32": MIN_COSINE,
    "ROSE fp32, SDPA attention": MIN_COSINE,
    "ROSE bf16": 0.999,
    "ROSE int8": 0.99,
}
MIN_OVERLAP = 0.95  # retrieval top-10 overlap goal
GOALS = (  # (numerator, denominator, factor) at 32 x 512
    ("ROSE int8", "ROSE fp32", 2.0),
    ("ROSE int8", "ONNX Runtime int8", 1.2),
    ("ROSE bf16", "ROSE fp32", 1.5),
)
ONNX_CACHE = Path.home() / ".cache" / "trellis" / "bench" / "onnx"
PLOT = RESULTS.with_suffix(".png")
# hand-measured sections of engine.md the bench keeps
KEPT = (
    "## Long rows on CPU",
    "## int8 activation scales",
    "## CPU passes in groups of rows",
    "## Intel Xeon without AMX",
    "## Intel Xeon with AMX",
    "## Zen 5 against Zen 4",
)


def _real_texts(count: int, seed: int) -> list[str]:
    """`count` distinct sentence-like lines of the tests' multilingual corpus
    (tests/tokenizer_corpus: fortunes, man pages, CLDR, MIRACL passages; cached after the
    tests' first build): 80-600 characters, mostly letters, with punctuation."""
    import random
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tokenizer_corpus import corpus_lines

    seen: set[str] = set()
    picked = []
    for line in corpus_lines():
        text = " ".join(line.split())
        if (
            80 <= len(text) <= 600
            and sum(c.isalpha() for c in text) >= 0.6 * len(text)
            and any(p in text for p in ".,;!?。，、")
            and text not in seen
        ):
            seen.add(text)
            picked.append(text)
    random.Random(seed).shuffle(picked)
    if len(picked) < count:
        raise SystemExit(f"the corpus has {len(picked)} usable lines, {count} wanted")
    return picked[:count]


def _rows_of(tokenizer, texts: list[str], length: int, count: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """[count, length] ids: <s> + a running stream of the texts' tokens + </s> per row."""
    stream = [t for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in ids]
    body = length - 2
    if len(stream) < body * count:
        stream = stream * (body * count // max(1, len(stream)) + 1)
    rows = np.asarray(stream[: body * count], dtype=np.int64).reshape(count, body)
    bos = np.full((count, 1), tokenizer.cls_token_id, dtype=np.int64)
    eos = np.full((count, 1), tokenizer.sep_token_id, dtype=np.int64)
    return np.concatenate([bos, rows, eos], axis=1)


def _onnx_models(model_dir: Path) -> tuple[Path, Path, str]:
    """The model exported with torch.onnx (mean pooling and L2 normalization inside the
    graph, as sentence-transformers computes them) and its ONNX Runtime dynamic int8
    quantization (MatMul weights int8 per channel, activations per call); cached by the
    model's manifest and the library versions. Returns (fp32, int8, versions)."""
    import hashlib

    import onnx
    import onnxruntime
    import torch
    import transformers
    from onnxruntime.quantization import QuantType, quantize_dynamic

    manifest = (model_dir / "trellis-asset.json").read_bytes()
    versions = (
        f"torch {torch.__version__}, onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}"
    )
    key = hashlib.sha256(manifest + versions.encode()).hexdigest()[:12]
    root = ONNX_CACHE / f"{model_dir.name}-{key}"
    fp32, int8 = root / "model.onnx", root / "model-int8.onnx"
    if fp32.exists() and int8.exists():
        return fp32, int8, versions
    root.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, H]
            return torch.nn.functional.normalize(pooled, dim=-1)

    print("exporting the model to ONNX (cached for later runs)", flush=True)
    ids = torch.ones(2, 16, dtype=torch.long)
    axes = {0: "rows", 1: "tokens"}
    tmp = root / "export.onnx"
    torch.onnx.export(
        Pooled(),
        (ids, torch.ones_like(ids)),
        str(tmp),
        dynamo=False,
        input_names=["input_ids", "attention_mask"],
        output_names=["embedding"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "embedding": {0: "rows"}},
        opset_version=17,
    )
    quantize_dynamic(
        str(tmp),
        str(root / "int8.tmp.onnx"),
        weight_type=QuantType.QInt8,
        per_channel=True,
        op_types_to_quantize=["MatMul"],
    )
    (root / "int8.tmp.onnx").replace(int8)
    tmp.replace(fp32)
    return fp32, int8, versions


def _padded(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def _systems(
    path: Path, threads: int, tokenizer
) -> tuple[dict[str, Callable[[list[list[int]]], np.ndarray]], str, dict[str, str]]:  # type: ignore[no-untyped-def]
    """name → encode(rows of ids) → [B, D] embeddings, for ROSE's modes and the peers; the
    library versions; each ROSE mode's attention backend as its engine chose it."""
    import onnxruntime
    import torch
    from sentence_transformers import SentenceTransformer

    from rose import Engine, EngineConfig, RaggedBatch

    systems: dict[str, Callable[[list[list[int]]], np.ndarray]] = {}
    attention: dict[str, str] = {}
    for name, overrides in ROSE_MODES:
        engine = Engine.load(path, EngineConfig(device="cpu", **overrides))
        attention[name] = engine.attention.describe()

        def rose(rows: list[list[int]], engine: Engine = engine) -> np.ndarray:
            return engine.step(RaggedBatch.from_lists(rows)).numpy()

        systems[name] = rose
    st = SentenceTransformer(str(path), device="cpu")
    pad = tokenizer.pad_token_id

    def sentence_transformers(rows: list[list[int]]) -> np.ndarray:
        ids, mask = _padded(rows, pad)
        with torch.inference_mode():
            out = st.forward(
                {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
            )
        return out["sentence_embedding"].numpy()

    systems[PEERS[0]] = sentence_transformers
    fp32, int8, versions = _onnx_models(path)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    for name, model in ((PEERS[1], fp32), (PEERS[2], int8)):
        session = onnxruntime.InferenceSession(
            str(model), options, providers=["CPUExecutionProvider"]
        )

        def ort(rows: list[list[int]], session=session) -> np.ndarray:  # type: ignore[no-untyped-def]
            ids, mask = _padded(rows, pad)
            return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

        systems[name] = ort
    return systems, versions, attention


@dataclass(frozen=True)
class Precision:
    """What the reduced-precision section measured."""

    shapes: tuple[tuple[int, int], ...]
    tps: dict[str, dict[tuple[int, int], float]]  # system → shape → tokens/s
    cosines: dict[str, np.ndarray]  # system → per-row cosine to sentence-transformers fp32
    overlap: dict[str, float]  # system → mean top-10 overlap with sentence-transformers fp32
    passages: int
    queries: int
    rounds: int
    versions: str
    attention: dict[str, str]  # ROSE mode → its attention backend (`describe()`)


def _precision(path: Path, tokenizer, threads: int, quick: bool, rounds: int) -> Precision:  # type: ignore[no-untyped-def]
    """Tokens/s per (row length, rows) for every system, then accuracy against
    sentence-transformers fp32 on a query → passage search over real corpus lines."""
    shapes = QUICK_SHAPES if quick else SHAPES
    passages_n, queries_n = (100, 20) if quick else (1000, 100)
    texts = _real_texts(passages_n, seed=25)
    systems, versions, attention = _systems(path, threads, tokenizer)

    tps: dict[str, dict[tuple[int, int], float]] = {name: {} for name in systems}
    for length, batch in shapes:
        rows = _rows_of(tokenizer, texts, length, batch).tolist()
        calls = max(1, (512 if quick else 4096) // (length * batch))
        times: dict[str, list[float]] = {name: [] for name in systems}
        for encode in systems.values():
            encode(rows)  # warm-up
        for _ in range(rounds):
            for name, encode in systems.items():  # interleaved: load hits all alike
                times[name].append(
                    _timed(lambda e=encode, r=rows, n=calls: [e(r) for _ in range(n)]) / calls
                )
        for name in systems:
            tps[name][(length, batch)] = length * batch / statistics.median(times[name])
        print(
            f"{length} x {batch}: "
            + ", ".join(f"{k} {v[(length, batch)]:.0f}" for k, v in tps.items()),
            flush=True,
        )

    # accuracy: every corpus line a passage; queries are the opening words of an evenly
    # spread sample of them, so each query has its passage among many unrelated ones
    passages = [f"passage: {t}" for t in texts]
    asked = np.linspace(0, passages_n - 1, queries_n).astype(int)
    queries = [f"query: {' '.join(texts[i].split()[:8])}" for i in asked]
    encoded = tokenizer(passages + queries, truncation=True, max_length=512)["input_ids"]
    out: dict[str, np.ndarray] = {}
    for name, encode in systems.items():
        parts = [encode(encoded[i : i + 32]) for i in range(0, len(encoded), 32)]
        vectors = np.concatenate(parts).astype(np.float64)
        out[name] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    reference = out[PEERS[0]]
    cosines = {name: (v * reference).sum(1) for name, v in out.items()}

    def top10(v: np.ndarray) -> np.ndarray:
        scores = v[passages_n:] @ v[:passages_n].T  # [Q, P]
        return np.argsort(-scores, axis=1)[:, :10]

    want = top10(reference)
    overlap = {
        name: float(
            np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top10(v), want, strict=True)])
        )
        for name, v in out.items()
    }
    return Precision(
        shapes, tps, cosines, overlap, passages_n, queries_n, rounds, versions, attention
    )


def _float_layers() -> str:
    """The int8 mode's float-layer format on this CPU and why (`rose.packed.bf16_speedup`)."""
    import torch

    from rose.int8 import float_layer_dtype
    from rose.packed import bf16_speedup

    name = "bf16" if float_layer_dtype() == torch.bfloat16 else "fp32"
    return f"{name}, bf16 products at {bf16_speedup():.2f}x fp32's rate"


def _precision_lines(p: Precision) -> tuple[list[str], bool]:
    """The section's markdown, and whether every ROSE mode met its cosine bound."""
    big = p.shapes[-1]
    head = " | ".join(f"{n} tok x {b}" for n, b in p.shapes)
    lines = [
        "## Reduced precision on CPU (issue #25): ROSE fp32 / bf16 / int8 vs peers",
        "",
        "Token ids given to every system (no tokenization in the timings); rows of exactly "
        "that many tokens cut from a stream of real corpus lines, so no padding anywhere; "
        f"{p.rounds} interleaved rounds, median; tokens/s.",
        "ROSE modes attend through the CPU default (`rose.attention.select_backend`): ONNX "
        "Runtime's kernel in fp32 (`rose.attention.onnxrt`), or PyTorch's in bf16 for bf16 "
        "and for int8 with bf16 float layers on CPUs with AMX, where it is faster; 'ROSE fp32, SDPA attention' asks for "
        "PyTorch's CPU flash kernel (the engine's attention before it). Here: "
        + "; ".join(f"{name}: {how}" for name, how in p.attention.items())
        + ". "
        "ROSE bf16: weights and activations in bf16 (oneDNN packed linears). "
        "ROSE int8: `rose.int8` (QKV and attention output projections int8 per output "
        "channel with dynamic activations, one scale per sequence, SmoothQuant-smoothed with a "
        "calibration at load; the MLP's two projections in bf16 where this CPU's packed bf16 "
        f"products are faster than fp32 ones, else fp32: here {_float_layers()}). "
        "sentence-transformers: its modules' forward on the ids (fp32). ONNX Runtime: the "
        "model exported with `torch.onnx` (mean pooling + normalization in the graph), "
        "default session optimizations; int8 = `onnxruntime.quantization.quantize_dynamic` "
        "(MatMul weights int8 per channel).",
        "",
        f"| system | {head} |",
        "|---|" + "---:|" * len(p.shapes),
    ]
    for name, by_shape in p.tps.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_shape[s]:.0f}" for s in p.shapes) + " |")
    lines += ["", f"Goals at {big[1]} x {big[0]} tokens:", ""]
    for num, den, factor in GOALS:
        ratio = p.tps[num][big] / p.tps[den][big]
        verdict = "met" if ratio >= factor else "NOT met"
        lines.append(f"- {num} ÷ {den}: {ratio:.2f}x (goal >= {factor}x): **{verdict}**")
    lines += [
        "",
        f"### Accuracy against sentence-transformers fp32 ({p.passages} corpus lines as "
        f"passages, {p.queries} queries made of the first 8 words of {p.queries} of them; "
        "per-row cosine over passages and queries; top-10 overlap of query → passage search)",
        "",
        "| system | min cosine | p1 cosine | mean cosine | bound | top-10 overlap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ok = True
    for name, cos in p.cosines.items():
        bound = MODE_COSINE.get(name)
        if bound is not None and cos.min() < bound:
            ok = False
        mark = "" if bound is None else f"{bound} ({'ok' if cos.min() >= bound else 'MISSED'})"
        lines.append(
            f"| {name} | {cos.min():.5f} | {np.percentile(cos, 1):.5f} | {cos.mean():.5f} | "
            f"{mark} | {p.overlap[name]:.3f} |"
        )
    missed = [n for n in MODE_COSINE if p.overlap[n] < MIN_OVERLAP]
    lines += [
        "",
        f"Top-10 overlap goal >= {MIN_OVERLAP}: "
        + ("**met** by every ROSE mode." if not missed else f"**NOT met** by {', '.join(missed)}."),
        f"Versions: {p.versions}.",
        "",
    ]
    return lines, ok


def _plot(p: Precision, where: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the dev extra has it): no plot")
        return
    names = list(p.tps)
    x = np.arange(len(p.shapes))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, name in enumerate(names):
        ax.bar(
            x + (i - (len(names) - 1) / 2) * width,
            [p.tps[name][s] for s in p.shapes],
            width,
            label=name,
        )
    ax.set_xticks(x, [f"{b} x {n} tokens" for n, b in p.shapes], fontsize=8)
    ax.set_ylabel("tokens/s (CPU)")
    ax.set_title(
        "multilingual-e5-small: ROSE fp32 / bf16 / int8 vs sentence-transformers and ONNX Runtime"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(where, dpi=110)
    plt.close(fig)


def _kept_sections(path: Path) -> list[str]:
    """Hand-measured sections of an existing results file (headings in `KEPT`), kept as is."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith(KEPT)]
    return text[starts[0] :] if starts else []


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench engine")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for every system"
    )
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="rows per batch for every system")
    parser.add_argument(
        "--precision-rounds", type=int, default=3, help="rounds of the reduced-precision table"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run (< 2 min once the ONNX export is cached) that checks the bench works; "
        "results go to a temporary directory, not bench/results/",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="where the table goes (the plot beside it); another CPU's run gets its own file",
    )
    args = parser.parse_args(argv)
    if args.results.is_dir():  # fail now, not after the whole run
        parser.error(
            f"--results names the table's file (e.g. engine-zen5.md), not a folder: {args.results}"
        )
    if args.quick:
        args.texts, args.rounds, args.precision_rounds = 16, 1, 1
    results = args.results
    if args.quick:
        import tempfile

        results = Path(tempfile.gettempdir()) / "trellis-bench-engine-quick" / RESULTS.name

    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    from rose import Engine, EngineConfig, RaggedBatch
    from rose.assets import ensure_model
    from rose.attention.sdpa import CALL_COST_IN_PAIRS

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    path = ensure_model(MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    work = _workload(tokenizer, args.texts, seed=0)
    lengths = np.array([len(r) for r in work.ids])
    engine = Engine.load(path, EngineConfig(device="cpu"))
    st = SentenceTransformer(str(path), device="cpu")
    hf = transformers.AutoModel.from_pretrained(path).eval()
    chunks = [slice(i, i + args.batch) for i in range(0, len(work.texts), args.batch)]

    rose_batch_s: list[float] = []
    rose_fwd_batch_s: list[float] = []
    hf_batch_s: list[float] = []
    rounds: dict[str, list[float]] = {"rose": [], "rose-ids": [], "st": [], "hf": []}
    rose_out: list[np.ndarray] = []

    def run_rose(record: list[np.ndarray] | None) -> None:
        for part in chunks:
            start = time.perf_counter()
            ids = tokenizer(work.texts[part], truncation=True, max_length=512)["input_ids"]
            out = engine.step(RaggedBatch.from_lists(ids)).numpy()
            rose_batch_s.append(time.perf_counter() - start)
            if record is not None:
                record.append(out)

    def run_rose_ids() -> None:
        for part in chunks:
            rose_fwd_batch_s.append(
                _timed(lambda p=part: engine.step(RaggedBatch.from_lists(work.ids[p])).wait())
            )

    def run_st() -> np.ndarray:
        return st.encode(work.texts, batch_size=args.batch, convert_to_numpy=True)

    def run_hf() -> None:
        for part in chunks:
            start = time.perf_counter()
            enc = tokenizer(
                work.texts[part], truncation=True, max_length=512, padding=True, return_tensors="pt"
            )
            with torch.inference_mode():
                hidden = hf(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            torch.nn.functional.normalize(pooled, dim=-1).numpy()
            hf_batch_s.append(time.perf_counter() - start)

    run_rose(None)  # warm-up, untimed
    st_out = run_st()
    for r in range(args.rounds):
        rounds["rose"].append(_timed(lambda r=r: run_rose(rose_out if r == 0 else None)))
        rounds["rose-ids"].append(_timed(run_rose_ids))
        rounds["st"].append(_timed(run_st))
        rounds["hf"].append(_timed(run_hf))
        print(
            f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rounds.items()), flush=True
        )

    got = np.concatenate(rose_out)
    cos = (got * st_out).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(st_out, axis=-1))
    correct = bool(cos.min() >= MIN_COSINE)
    tps = {k: work.tokens / statistics.median(v) for k, v in rounds.items()}
    ratio_st = tps["rose"] / tps["st"]
    ratio_hf = tps["rose"] / tps["hf"]

    # Per-call overhead at 1 row x 16 tokens: step() end to end vs the bare device pass,
    # alternated call by call so machine load hits both alike; plus step()'s host-side work
    # (validation, layout, attention plan, tensor wrapping) timed on its own.
    small = RaggedBatch.from_lists([work.ids[0][:15] + [2]])
    host = engine._layout(small)
    plan = engine.attention.plan(host.cu_seqlens)

    def bare() -> None:
        with torch.inference_mode():
            ids, pos, seg, cu, modes = (
                torch.from_numpy(a)
                for a in (host.ids, host.positions, host.seg_ids, host.cu_seqlens, host.modes)
            )
            engine._forward(
                ids, pos, None, seg, cu, modes, torch.from_numpy(host.normalize), plan, host.present
            )

    def host_side() -> None:
        layout = engine._layout(small)
        engine.attention.plan(layout.cu_seqlens)

    for _ in range(20):
        engine.step(small).wait()
        bare()
    step_s, bare_s = [], []
    for _ in range(50 if args.quick else 300):
        step_s.append(_timed(lambda: engine.step(small).wait()))
        bare_s.append(_timed(bare))
    paired_us = statistics.median(a - b for a, b in zip(step_s, bare_s, strict=True)) * 1e6
    host_s = [_timed(host_side) for _ in range(1000)]

    sweep = _sdpa_sweep()
    kernels = _kernel_sweep()
    precision = _precision(path, tokenizer, args.threads, args.quick, args.precision_rounds)
    precision_lines, precise = _precision_lines(precision)

    load_end = os.getloadavg()[0]
    lines = [
        "# ROSE engine benchmark (CPU)",
        "",
        f"Model {MODEL} (XLM-R, 12 layers, 384-d), fp32, {args.threads} torch thread(s) for every system, "
        f"{len(work.texts)} texts / {work.tokens} tokens per round, batches of {args.batch} rows in arrival order "
        f"(sentence-transformers sorts all texts by length itself), {args.rounds} rounds, median round reported.",
        f"Token lengths: min {lengths.min()}, p50 {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, "
        f"p99 {int(np.percentile(lengths, 99))}, max {lengths.max()} (log-normal, median 48, clipped to 16..512).",
        "",
        "## Throughput",
        "",
        "| system | tokens/s | ROSE (from text) ÷ system | batch p50 | batch p99 |",
        "|---|---:|---:|---:|---:|",
        f"| ROSE (HF tokenizer + step, from text) | {tps['rose']:.0f} | 1.00 | {percentile(rose_batch_s, 50) * 1e3:.0f} ms | {percentile(rose_batch_s, 99) * 1e3:.0f} ms |",
        f"| ROSE step only (ids given; not in the ratios) | {tps['rose-ids']:.0f} | n/a | {percentile(rose_fwd_batch_s, 50) * 1e3:.0f} ms | {percentile(rose_fwd_batch_s, 99) * 1e3:.0f} ms |",
        f"| sentence-transformers encode() (from text) | {tps['st']:.0f} | **{ratio_st:.2f}** | n/a (one call) | n/a |",
        f"| transformers, padded batches (from text) | {tps['hf']:.0f} | {ratio_hf:.2f} | {percentile(hf_batch_s, 50) * 1e3:.0f} ms | {percentile(hf_batch_s, 99) * 1e3:.0f} ms |",
        "",
        "Round times (s): "
        + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in vals) for k, vals in rounds.items()),
        "",
        f"Bar: ROSE >= {BAR}x sentence-transformers: **{'met' if ratio_st >= BAR else 'NOT met'}** ({ratio_st:.2f}x).",
        f"Correctness: min cosine ROSE vs sentence-transformers over all texts {cos.min():.7f} "
        f"(required >= {MIN_COSINE}): {'ok' if correct else 'FAILED'}.",
        "",
        "## Per-call overhead of step() (1 row x 16 tokens)",
        "",
        f"step().wait(): p50 {statistics.median(step_s) * 1e3:.3f} ms, p99 {percentile(step_s, 99) * 1e3:.3f} ms; "
        f"bare device pass on the same tensors: p50 {statistics.median(bare_s) * 1e3:.3f} ms, "
        f"p99 {percentile(bare_s, 99) * 1e3:.3f} ms; median paired difference (step - bare, calls alternated): "
        f"{paired_us:.0f} us.",
        f"step()'s host-side work alone (validation, positions/row ids/pooling layout, attention plan): "
        f"p50 {statistics.median(host_s) * 1e6:.0f} us, p99 {percentile(host_s, 99) * 1e6:.0f} us.",
        "",
        "## SDPA strategy sweep (attention op only, 12 heads x 32, fp32)",
        "",
        f"`auto` picks block-diagonal when (rows - 1) x {CALL_COST_IN_PAIRS} > wasted query-key pairs.",
        "",
        "| rows x tokens | per-sequence | block-diagonal | faster | auto picks |",
        "|---|---:|---:|---|---|",
        *(
            f"| {r} x {n} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {f} | {c} |"
            for r, n, a, b, f, c in sweep
        ),
        "",
        "## Attention kernels (attention op only, one row, 12 heads x 32, fp32)",
        "",
        "PyTorch's CPU flash kernel (SDPA) against ONNX Runtime's `MultiHeadAttention` "
        "(`rose.attention.onnxrt`, the CPU default for bidirectional encoders), operands as "
        "the encoders pass them (views of one fused q/k/v projection), median of 15 calls.",
        "",
        "| tokens | SDPA (flash) | ONNX Runtime | SDPA ÷ ONNX Runtime |",
        "|---:|---:|---:|---:|",
        *(f"| {n} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {a / b:.2f}x |" for n, a, b in kernels),
        "",
        "## Versions and machine",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, sentence-transformers "
        f"{sentence_transformers.__version__}, numpy {np.__version__}, Python {platform.python_version()}.",
        f"{machine()}; load average at start {load_start:.1f}, at end {load_end:.1f} (the machine is shared "
        "with other jobs, so absolute numbers are noisy; the interleaved rounds keep the ratios comparable).",
        "",
    ]
    at = lines.index("## Versions and machine")
    lines[at:at] = precision_lines
    if args.quick:
        lines.insert(1, "\n**--quick run: small, one round, noisy; not a result.**")
    lines += _kept_sections(results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(precision, results.with_suffix(".png"))
    print("\n".join(lines))
    print(f"written: {results} and {results.with_suffix('.png').name}")
    return 0 if correct and precise else 1
