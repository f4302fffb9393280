"""ROSE on the newer encoder families (issues #22, #23) vs their usual CPU peers.

Four random-weight models at real checkpoint shapes, each against the library people run it
with today, on the same texts, the same thread count, fp32, in one process:

  qwen3-bidir   pplx-embed-v1-0.6B's shapes (Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128,
                MLP 3072, vocab 151,669), ``model_type: bidirectional_pplx_qwen3`` with
                ``use_bidirectional_attention: true``, mean pooling. Peer: transformers'
                ``Qwen3Model`` on padded batches with a 4-D non-causal padding mask, then the
                masked mean (sentence-transformers would run it causally: its Transformer module
                passes a 2-D mask, which Qwen3Model turns causal).
  modernbert    ModernBERT-base's shapes as ``ModernBertForSequenceClassification`` with one
                label (mean pooling, as gte-reranker-modernbert-base). Peer:
                ``sentence_transformers.CrossEncoder.predict``.
  deberta-v3    DeBERTa-v3-base's shapes (mxbai-rerank-base-v1) as
                ``DebertaV2ForSequenceClassification`` with one label. Peer: ``CrossEncoder``.
  embeddinggemma  EmbeddingGemma-300m's shapes (Gemma 3: hidden 768, 3 q / 1 kv heads of 256,
                MLP 1152, vocab 262,144; five sliding-window layers (512) to one full), run
                bidirectionally, mean pooling, its two Dense projections 768 -> 3072 -> 768
                and Normalize. Peer: ``SentenceTransformer.encode``.

Fewer layers than the checkpoints keep the run short (the layer count is in the results);
each layer does the real checkpoint's work, so the ratio is the full model's. Each model
directory gets a word-level ``tokenizer.json`` whose words ``w<id>`` are its ids, so the
peers tokenize text as usual and ROSE runs the ids the same tokenizer gives.

Batches as a server sees them: one request at a time (batch 1) and 32 rows (batch 32) in
arrival order, each batch one call to each system. Rounds alternate which system runs first
(ABAB, then BABA); tokens/s come from the median round, the ratio from the median of the
per-round ratios (paired rounds, so machine load hits both alike).

The run fails (exit 1) if ROSE's outputs disagree with the peer's (embeddings: cosine
< 0.9999; cross-encoders: a logit more than 1e-3 away), so a fast but wrong run cannot pass.

    python -m bench families [--quick] [--threads=N] [--rounds=N] [--models=a,b] [--results=PATH]

``--quick`` runs few rows, half the layers and two rounds, and prints the table without
writing results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import machine, percentile

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results" / "families.md"
BAR = 1.3  # ROSE tokens/s over the peer's
MIN_COSINE = 0.9999
MAX_LOGIT_DIFF = 1e-3
SPECIALS = {"[CLS]": 0, "[PAD]": 1, "[SEP]": 2, "[UNK]": 3}
BATCHES = (1, 32)


@dataclass(frozen=True)
class Model:
    """One benchmarked model: its transformers config and how it is judged."""

    name: str
    kind: str  # "embedding" | "cross-encoder"
    peer: str  # what ROSE is compared with
    shapes: str  # the checkpoint whose shapes these are
    full_layers: int  # the checkpoint's layer count
    layers: int  # layers run here
    config: Callable[[int], Any]  # layers → transformers config
    model_class: str  # transformers class saved


def _qwen3(layers: int) -> Any:
    import transformers

    return transformers.Qwen3Config(
        vocab_size=151_669,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32_768,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        use_bidirectional_attention=True,
    )


def _modernbert(layers: int) -> Any:
    import transformers

    return transformers.ModernBertConfig(
        vocab_size=50_368,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=layers,
        num_attention_heads=12,
        max_position_embeddings=8192,
        local_attention=128,
        global_attn_every_n_layers=3,
        classifier_pooling="mean",
        num_labels=1,
        pad_token_id=SPECIALS["[PAD]"],
        cls_token_id=SPECIALS["[CLS]"],
        sep_token_id=SPECIALS["[SEP]"],
        bos_token_id=SPECIALS["[CLS]"],
        eos_token_id=SPECIALS["[SEP]"],
    )


def _deberta_v3(layers: int) -> Any:
    import transformers

    return transformers.DebertaV2Config(
        vocab_size=128_100,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=12,
        max_position_embeddings=512,
        type_vocab_size=0,
        relative_attention=True,
        pos_att_type="p2c|c2p",
        position_buckets=256,
        max_relative_positions=-1,
        position_biased_input=False,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        layer_norm_eps=1e-7,
        num_labels=1,
        pad_token_id=SPECIALS["[PAD]"],
    )


def _gemma3(layers: int) -> Any:
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=262_144,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=layers,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        max_position_embeddings=2048,
        use_bidirectional_attention=True,
        pad_token_id=SPECIALS["[PAD]"],
    )


MODELS = (
    Model(
        "qwen3-bidir",
        "embedding",
        "transformers Qwen3Model, non-causal 4-D mask + mean",
        "pplx-embed-v1-0.6B (Qwen3-0.6B)",
        28,
        4,
        _qwen3,
        "Qwen3Model",
    ),
    Model(
        "modernbert",
        "cross-encoder",
        "sentence-transformers CrossEncoder",
        "ModernBERT-base",
        22,
        6,
        _modernbert,
        "ModernBertForSequenceClassification",
    ),
    Model(
        "deberta-v3",
        "cross-encoder",
        "sentence-transformers CrossEncoder",
        "DeBERTa-v3-base (mxbai-rerank-base-v1)",
        12,
        4,
        _deberta_v3,
        "DebertaV2ForSequenceClassification",
    ),
    Model(
        "embeddinggemma",
        "embedding",
        "sentence-transformers SentenceTransformer.encode",
        "EmbeddingGemma-300m (Gemma 3)",
        24,
        6,
        _gemma3,
        "Gemma3TextModel",
    ),
)
# Dense projections after the pooling (sentence-transformers modules), per model
DENSE = {"embeddinggemma": ((768, 3072), (3072, 768))}


# -- model directories -------------------------------------------------------------------------


def _write_dir(model: Model, path: Path) -> None:
    """Random weights at the model's shapes, a word-level tokenizer over its whole vocabulary
    and, for the embedder, a sentence-transformers mean Pooling module."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from rose.assets.layout import write_pooling

    torch.manual_seed(0)
    cfg = model.config(model.layers)
    net = getattr(transformers, model.model_class)(cfg).eval()
    if model.name == "qwen3-bidir":
        cfg_extra = {"model_type": "bidirectional_pplx_qwen3", "architectures": ["PPLXQwen3Model"]}
    else:
        cfg_extra = {}
    net.save_pretrained(path, safe_serialization=True)
    if cfg_extra:
        raw = json.loads((path / "config.json").read_text())
        raw.update(cfg_extra)
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    vocab = {**SPECIALS, **{f"w{i}": i for i in range(len(SPECIALS), cfg.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if model.kind == "cross-encoder":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", SPECIALS["[CLS]"]), ("[SEP]", SPECIALS["[SEP]"])],
        )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "[PAD]",
                "unk_token": "[UNK]",
                "cls_token": "[CLS]",
                "sep_token": "[SEP]",
                "model_max_length": 512,
            }
        )
    )
    if model.kind == "embedding":
        write_pooling(path, cfg.hidden_size, normalize=model.name in DENSE)
    if model.name in DENSE:
        _write_dense(path, DENSE[model.name])


def _write_dense(path: Path, shapes: tuple[tuple[int, int], ...]) -> None:
    """Random sentence-transformers Dense modules (no bias, identity) between the Pooling and
    the Normalize module `write_pooling` wrote, as EmbeddingGemma's modules.json lists them."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense

    modules = json.loads((path / "modules.json").read_text())
    normalize = modules.pop()
    for n_in, n_out in shapes:
        folder = f"{len(modules)}_Dense"
        (path / folder).mkdir()
        Dense(n_in, n_out, bias=False, activation_function=torch.nn.Identity()).save(
            str(path / folder)
        )
        modules.append(
            {
                "idx": len(modules),
                "name": folder,
                "path": folder,
                "type": "sentence_transformers.models.Dense",
            }
        )
    modules.append({**normalize, "idx": len(modules)})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Texts (embedder) or (query, document) pairs (cross-encoders), in arrival order."""

    texts: list[str] | list[tuple[str, str]]
    lengths: np.ndarray  # tokens per row as the model sees it (specials included)


def _workload(model: Model, vocab: int, count: int, seed: int) -> Workload:
    """Rows of 32..512 tokens, log-normal around 96 (a long tail of long documents)."""
    rng = np.random.default_rng(seed)
    totals = np.clip(np.exp(rng.normal(np.log(96), 0.8, count)), 32, 512).astype(int)

    def words(n: int) -> str:
        return " ".join(f"w{i}" for i in rng.integers(len(SPECIALS), vocab, size=n))

    if model.kind == "embedding":
        return Workload([words(int(n)) for n in totals], totals)
    pairs = []
    for n in totals:
        q = int(rng.integers(6, 25))
        pairs.append((words(q), words(int(n) - q - 3)))  # [CLS] q [SEP] d [SEP]
    return Workload(pairs, totals)


# -- systems -----------------------------------------------------------------------------------


class Rose:
    """rose.Engine from the same tokenizer's ids."""

    def __init__(self, model: Model, path: Path) -> None:
        import transformers

        from rose import Engine, EngineConfig

        self.kind = model.kind
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.engine = Engine.load(path, EngineConfig(device="cpu"))

    def __call__(self, rows: list[Any]) -> np.ndarray:
        from rose import RaggedBatch

        if self.kind == "embedding":
            ids = self.tokenizer(rows, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer([q for q, _ in rows], [d for _, d in rows])["input_ids"]
        return self.engine.step(RaggedBatch.from_lists(ids)).numpy()


class QwenPeer:
    """transformers' Qwen3Model on a padded batch, bidirectional through a 4-D mask that only
    hides padding keys, then the mean over real tokens (what pplx-embed's remote code does)."""

    def __init__(self, model: Model, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.net = transformers.Qwen3Model.from_pretrained(path, torch_dtype="float32").eval()

    def __call__(self, rows: list[Any]) -> np.ndarray:
        import torch

        enc = self.tokenizer(rows, add_special_tokens=False, padding=True, return_tensors="pt")
        keep = enc["attention_mask"]  # [B, L]
        mask = torch.zeros(keep.shape[0], 1, 1, keep.shape[1])
        mask.masked_fill_(keep[:, None, None, :] == 0, torch.finfo(torch.float32).min)
        with torch.inference_mode():
            hidden = self.net(input_ids=enc["input_ids"], attention_mask=mask).last_hidden_state
            weights = keep.unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
            pooled = (hidden * weights).sum(1) / weights.sum(1)
        return pooled.numpy()


class SentenceTransformerPeer:
    """sentence-transformers SentenceTransformer.encode on the texts (its own modules: pooling,
    Dense, Normalize), one call per batch."""

    def __init__(self, model: Model, path: Path) -> None:
        from sentence_transformers import SentenceTransformer

        self.st = SentenceTransformer(str(path), device="cpu")

    def __call__(self, rows: list[Any]) -> np.ndarray:
        return self.st.encode(rows, batch_size=len(rows), show_progress_bar=False)


class CrossEncoderPeer:
    """sentence-transformers CrossEncoder.predict on the pairs, raw logits."""

    def __init__(self, model: Model, path: Path) -> None:
        import torch
        from sentence_transformers import CrossEncoder

        self.ce = CrossEncoder(str(path), device="cpu", max_length=512)
        self.identity = torch.nn.Identity()

    def __call__(self, rows: list[Any]) -> np.ndarray:
        scores = self.ce.predict(
            rows, batch_size=len(rows), activation_fn=self.identity, show_progress_bar=False
        )
        return np.asarray(scores, dtype=np.float32).reshape(len(rows), -1)


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Timings:
    """One system at one batch size: seconds per round and per batch call."""

    rounds: list[float] = field(default_factory=list)
    batches: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    tokens: int  # per round
    rose: Timings
    peer: Timings

    @property
    def rose_tps(self) -> float:
        return self.tokens / statistics.median(self.rose.rounds)

    @property
    def peer_tps(self) -> float:
        return self.tokens / statistics.median(self.peer.rounds)

    @property
    def ratio(self) -> float:
        """Median over rounds of peer time ÷ ROSE time (paired: same round)."""
        pairs = zip(self.peer.rounds, self.rose.rounds, strict=True)
        return statistics.median(p / r for p, r in pairs)


def _run_round(
    system: Callable[[list[Any]], np.ndarray], chunks: list[list[Any]], t: Timings
) -> list[np.ndarray]:
    outs = []
    start = time.perf_counter()
    for chunk in chunks:
        s = time.perf_counter()
        outs.append(system(chunk))
        t.batches.append(time.perf_counter() - s)
    t.rounds.append(time.perf_counter() - start)
    return outs


def _agreement(model: Model, got: np.ndarray, want: np.ndarray) -> tuple[str, bool]:
    diff = float(np.abs(got - want).max())
    if model.kind == "embedding":
        cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
        ok = bool(cos.min() >= MIN_COSINE)
        return f"min cosine {cos.min():.7f}, max abs diff {diff:.2e}", ok
    ok = diff <= MAX_LOGIT_DIFF
    return f"max abs logit diff {diff:.2e} (logits' std {want.std():.3f})", ok


def _bench_model(model: Model, args: argparse.Namespace, root: Path) -> tuple[list[Row], str, bool]:
    import gc

    path = root / model.name
    print(f"-- {model.name}: writing {model.layers}-layer random model", flush=True)
    _write_dir(model, path)
    vocab = model.config(1).vocab_size
    rose = Rose(model, path)
    peers = {"qwen3-bidir": QwenPeer, "embeddinggemma": SentenceTransformerPeer}
    peer = peers.get(model.name, CrossEncoderPeer)(model, path)
    counts = {1: args.single, 32: args.texts}
    rows: list[Row] = []
    note, ok = "", True
    for b in BATCHES:
        work = _workload(model, vocab, counts[b], seed=b)
        chunks = [work.texts[i : i + b] for i in range(0, len(work.texts), b)]
        rose_t, peer_t = Timings(), Timings()
        rose(chunks[0])  # warm-up, untimed
        peer(chunks[0])
        for r in range(args.rounds):
            order = [("rose", rose, rose_t), ("peer", peer, peer_t)]
            if r % 2:
                order.reverse()
            outs = {}
            for name, system, t in order:
                outs[name] = _run_round(system, chunks, t)
            if r == 0 and b == 32:
                note, ok = _agreement(
                    model, np.concatenate(outs["rose"]), np.concatenate(outs["peer"])
                )
            print(
                f"   batch {b} round {r}: rose {rose_t.rounds[-1]:.2f}s, peer {peer_t.rounds[-1]:.2f}s",
                flush=True,
            )
        rows.append(Row(model.name, b, int(work.lengths.sum()), rose_t, peer_t))
    del rose, peer
    gc.collect()
    return rows, note, ok


# -- report ------------------------------------------------------------------------------------


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| model | batch | tokens/s ROSE | tokens/s peer | ROSE ÷ peer | ROSE batch p50 / p99 | peer batch p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = "" if r.ratio >= BAR else " (under bar)"
        lines.append(
            f"| {r.model} | {r.batch} | {r.rose_tps:.0f} | {r.peer_tps:.0f} | **{r.ratio:.2f}**{mark} | "
            f"{percentile(r.rose.batches, 50) * 1e3:.0f} / {percentile(r.rose.batches, 99) * 1e3:.0f} ms | "
            f"{percentile(r.peer.batches, 50) * 1e3:.0f} / {percentile(r.peer.batches, 99) * 1e3:.0f} ms |"
        )
    return lines


def _plot(rows: list[Row], where: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the dev extra has it): no plot")
        return False
    labels = [f"{r.model}\nbatch {r.batch}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, [r.rose_tps for r in rows], 0.4, label="ROSE")
    ax.bar(x + 0.2, [r.peer_tps for r in rows], 0.4, label="peer")
    for i, r in enumerate(rows):
        ax.annotate(f"{r.ratio:.2f}x", (i, max(r.rose_tps, r.peer_tps)), ha="center", va="bottom")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("tokens/s (fp32, CPU)")
    ax.set_title("ROSE vs peers on the new families (label: ROSE ÷ peer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(where, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench families")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for every system"
    )
    parser.add_argument("--texts", type=int, default=32, help="rows per round at batch 32")
    parser.add_argument("--single", type=int, default=12, help="rows per round at batch 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(m.name for m in MODELS))
    parser.add_argument(
        "--quick", action="store_true", help="few rows and layers, 2 rounds, no results written"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="where the table goes (the plot beside it); another CPU's run gets its own file",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.single, args.rounds = 32, 4, 2

    import sentence_transformers
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    chosen = [m for m in MODELS if m.name in args.models.split(",")]
    if args.quick:  # half the layers (ModernBERT keeps one global and two local layers)
        chosen = [dataclasses.replace(m, layers=max(m.layers // 2, 2)) for m in chosen]
    load_start = os.getloadavg()[0]
    rows: list[Row] = []
    checks: list[str] = []
    correct = True
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        for model in chosen:
            got, note, ok = _bench_model(model, args, Path(tmp))
            rows += got
            checks.append(f"- {model.name}: {note}: {'ok' if ok else 'FAILED'}")
            correct &= ok
    load_end = os.getloadavg()[0]

    met = all(r.ratio >= BAR for r in rows)
    lines = [
        "# ROSE on the new families (CPU): Qwen3 and Gemma 3 bidirectional embedders, ModernBERT and DeBERTa-v3 cross-encoders",
        "",
        f"fp32, torch.set_num_threads({args.threads}) for every system, random weights at the checkpoints' shapes, "
        f"{args.rounds} rounds alternating which system runs first; tokens/s from the median round, the ratio is "
        "the median of the per-round ratios. Rows: 32..512 tokens (log-normal around 96, specials included), "
        f"{args.texts} rows per round at batch 32, {args.single} at batch 1; each batch is one call to each system.",
        "",
        "| model | shapes | layers run | peer |",
        "|---|---|---:|---|",
        *(f"| {m.name} | {m.shapes} | {m.layers} of {m.full_layers} | {m.peer} |" for m in chosen),
        "",
        "## Throughput",
        "",
        *_table(rows),
        "",
        f"Bar: ROSE >= {BAR}x the peer everywhere: **{'met' if met else 'NOT met'}**.",
        "",
        "Agreement (first round at batch 32, same rows):",
        *checks,
        "",
        "## Versions and machine",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, sentence-transformers "
        f"{sentence_transformers.__version__}, numpy {np.__version__}, Python {platform.python_version()}.",
        f"{machine()}; load average at start {load_start:.1f}, at end {load_end:.1f}. The machine is shared "
        "with other engineers' jobs, so absolute numbers are noisy; the paired, alternating rounds keep the "
        "ratios comparable.",
        "",
    ]
    print("\n".join(lines))
    if not args.quick:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text("\n".join(lines), encoding="utf-8")
        _plot(rows, args.results.with_suffix(".png"))
    return 0 if correct else 1
