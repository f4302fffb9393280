"""Train an MTP / EAGLE draft head for a target model (the target stays frozen).

Pipeline: prompts from local text files → answered by the target itself (greedy, batched,
on the paged engine) → target final hidden states for every position → head trained with
teacher forcing: pair (feature t, token t + 1) predicts token t + 2 (cross-entropy through
the target's LM head) and regresses feature t + 1 (smooth L1, which keeps chained drafting,
where the head feeds on its own features, close to the target). Saved with `MTPHead.save`.

    python -m rose.spec.train_mtp --model smollm2-135m-instruct --text FILE [--text FILE]
        --out DIR [--prompts 256] [--answer-tokens 96] [--minutes 30]

The same code runs on GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.metadata import AttentionMetadata
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec.mtp import MTPHead, MTPHeadConfig

__all__ = ["TrainConfig", "answer_prompts", "main", "target_features", "train_head"]


@dataclass(frozen=True)
class TrainConfig:
    """lr / weight_decay: AdamW. epochs: passes over the corpus (stops early at
    max_seconds). batch_tokens: tokens per optimizer step. feature_weight: weight of the
    feature-regression loss. seed: initial weights and shuffling."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    epochs: int = 4
    max_seconds: float = 1800.0
    batch_tokens: int = 2048
    feature_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1, got {self.epochs}")
        if self.batch_tokens < 2:
            raise ValueError(f"train.batch_tokens must be >= 2, got {self.batch_tokens}")


def answer_prompts(
    model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], answer_tokens: int, batch: int = 32
) -> list[list[int]]:
    """Each prompt followed by the target's own greedy answer (what the head must predict)."""
    from rose.generate import GenerationConfig, GenerationEngine  # avoid an import cycle

    eng = GenerationEngine(
        model, GenerationConfig(max_batch=batch), eos_ids=model.config.eos_token_ids
    )
    results = eng.generate(prompts, SamplingParams(max_tokens=answer_tokens))
    return [list(r.prompt_ids) + list(r.output_ids) for r in results]


def _ragged(seqs: Sequence[Sequence[int]], page_size: int = 64) -> AttentionMetadata:
    pages = sum(-(-len(s) // page_size) for s in seqs)
    alloc = PageAllocator(pages)
    entries = []
    for s in seqs:
        t = BlockTable(alloc, page_size)
        t.reserve(len(s))
        entries.append((t, 0, len(s)))
    return AttentionMetadata.build(entries)


@torch.no_grad()
def target_features(
    model: LlamaForCausalLM, seqs: Sequence[Sequence[int]], batch_tokens: int = 4096
) -> list[torch.Tensor]:
    """Final-norm hidden states ``[len(s), H]`` of the target for every sequence."""
    out: list[torch.Tensor] = []
    for group in _batches(list(range(len(seqs))), [len(s) for s in seqs], batch_tokens):
        part = [seqs[i] for i in group]
        meta = _ragged(part)
        cache = model.new_cache(int(meta.kv_slots.max()) // 64 + 1, 64)
        ids = torch.tensor([t for s in part for t in s])
        hid = model(ids, meta, cache, logits_index=meta.last_index, return_all_hidden=True)
        assert hid.all_hidden is not None
        cu = meta.cu_seqlens.tolist()
        out.extend(hid.all_hidden[cu[j] : cu[j + 1]].clone() for j in range(len(part)))
    return out


def _batches(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    used = 0
    for i in order:
        if groups[-1] and used + lengths[i] > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += lengths[i]
    return [g for g in groups if g]


def train_head(
    model: LlamaForCausalLM,
    seqs: Sequence[Sequence[int]],
    features: Sequence[torch.Tensor],
    cfg: TrainConfig,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[MTPHead, list[float]]:
    """Train a fresh head on (sequence, target features) pairs; returns it and the mean
    loss of each epoch."""
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    head = MTPHead(MTPHeadConfig.for_target(model.config)).to(model.tok_embeddings.weight.device)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    usable = [i for i, s in enumerate(seqs) if len(s) >= 3]
    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()
    history: list[float] = []
    for epoch in range(cfg.epochs):
        order = [usable[i] for i in torch.randperm(len(usable), generator=gen).tolist()]
        total, count = 0.0, 0
        for group in _batches(order, [len(s) for s in seqs], cfg.batch_tokens):
            # pair t = (feature t, token t + 1) for t in [0, T - 2]; label token t + 2
            pairs = [len(seqs[i]) - 1 for i in group]
            meta = _ragged([[0] * n for n in pairs])
            cache = head.new_cache(int(meta.kv_slots.max()) // 64 + 1, 64)
            hid = torch.cat([features[i][:-1] for i in group])  # [P, H]
            toks = torch.tensor([t for i in group for t in seqs[i][1:]])  # [P]
            out = head(hid, model.tok_embeddings(toks), meta, cache)  # [P, H]
            last = torch.zeros(len(toks), dtype=torch.bool)
            last[meta.last_index] = True  # the final pair of a sequence has no label
            labels = torch.tensor([t for i in group for t in [*seqs[i][2:], -100]])
            labels = labels.masked_fill(last, -100)
            feat_target = torch.cat([features[i][1:] for i in group])  # [P, H]
            ce = F.cross_entropy(model.output(out), labels, ignore_index=-100)
            reg = F.smooth_l1_loss(out[~last], feat_target[~last])
            loss = ce + cfg.feature_weight * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(group)
            count += len(group)
            if time.perf_counter() - t0 > cfg.max_seconds:
                break
        history.append(total / max(count, 1))
        log(f"epoch {epoch}: loss {history[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
        if time.perf_counter() - t0 > cfg.max_seconds:
            break
    return head.eval(), history


def _read_prompts(files: Sequence[Path], n: int) -> list[str]:
    out: list[str] = []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            line = line.strip()
            if len(line) >= 20:
                out.append(line[:400])
            if len(out) >= n:
                return out
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rose.spec.train_mtp", description=__doc__)
    ap.add_argument("--model", required=True, help="asset name or HF model directory")
    ap.add_argument("--text", type=Path, action="append", required=True, help="local text")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)

    import transformers  # only the command needs the chat template

    path = Path(args.model)
    if not path.is_dir():
        from rose.assets import ensure_model

        path = ensure_model(args.model)
    model = LlamaForCausalLM.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = _read_prompts(args.text, args.prompts)
    if not texts:
        raise SystemExit("train_mtp: no usable lines (>= 20 chars) in --text files")
    t0 = time.perf_counter()
    prompts = []
    for t in texts:
        ids: Any = tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    seqs = answer_prompts(model, prompts, args.answer_tokens)
    print(f"corpus: {len(seqs)} sequences answered in {time.perf_counter() - t0:.0f} s", flush=True)
    feats = target_features(model, seqs)
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)
    cfg = TrainConfig(lr=args.lr, epochs=args.epochs, max_seconds=args.minutes * 60)
    head, history = train_head(model, seqs, feats, cfg, log=lambda m: print(m, flush=True))
    note = (
        f"{len(seqs)} prompts answered by the target ({args.answer_tokens} tokens each), "
        f"{len(history)} epochs, {time.perf_counter() - t0:.0f} s in all"
    )
    head.save(
        args.out, extra={"target": str(args.model), "loss_history": history, "train_note": note}
    )
    print(f"saved {args.out} after {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
