"""Train an MTP / EAGLE draft head for a target model (the target stays frozen).

Pipeline: chat-style prompts built from local text (`rose.spec.corpus`, plus optional
``--text`` files) → answered by the target itself (greedy, batched on the paged engine;
kept in ``corpus.jsonl`` next to the head so a rerun with the same settings skips this) →
target final hidden states for every position → the draft vocabulary (the answers' most
frequent tokens) → head trained with teacher forcing: pair (feature t, token t + 1)
predicts token t + 2 (cross-entropy through the target's LM head rows of the draft
vocabulary) and regresses feature t + 1 (smooth L1, which keeps chained drafting, where the
head feeds on its own features, close to the target); with ``--unroll 2`` the second
chained draft is trained too. Saved with `MTPHead.save` after every epoch.

    python -m rose.spec.train_mtp [--model smollm2-135m-instruct] [--out DIR]
        [--prompts 576] [--answer-tokens 80] [--draft-vocab 4096] [--epochs 4] [--unroll 2]

Default output: ``~/.cache/trellis/heads/<model>-mtp`` (`default_head_dir`), where
``python -m bench spec`` looks. Device-agnostic PyTorch, but the command runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rose.kv.allocator import KVCacheConfig, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.metadata import AttentionMetadata
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec.mtp import MTPHead, MTPHeadConfig

__all__ = [
    "TrainConfig",
    "answer_prompts",
    "default_head_dir",
    "draft_vocabulary",
    "main",
    "target_features",
    "train_head",
]


@dataclass(frozen=True)
class TrainConfig:
    """lr / weight_decay: AdamW. epochs: passes over the corpus (stops early at
    max_seconds). batch_tokens: tokens per optimizer step. feature_weight: weight of the
    feature-regression loss. unroll: 1 trains the first draft only, 2 also the second
    chained draft (weighted by unroll_weight). seed: initial weights and shuffling."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    epochs: int = 4
    max_seconds: float = 1800.0
    batch_tokens: int = 2048
    feature_weight: float = 1.0
    unroll: int = 1
    unroll_weight: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1, got {self.epochs}")
        if self.batch_tokens < 2:
            raise ValueError(f"train.batch_tokens must be >= 2, got {self.batch_tokens}")
        if self.unroll not in (1, 2):
            raise ValueError(f"train.unroll must be 1 or 2, got {self.unroll}")


def answer_prompts(
    model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], answer_tokens: int, batch: int = 32
) -> list[list[int]]:
    """Each prompt followed by the target's own greedy answer (what the head must predict)."""
    from rose.generate import GenerationConfig, GenerationEngine  # avoid an import cycle

    longest = max(len(p) for p in prompts) + answer_tokens
    pages = batch * -(-longest // 16) + 1  # room for a whole batch: no preemption
    eng = GenerationEngine(
        model,
        GenerationConfig(kv=KVCacheConfig(num_pages=pages, page_size=16), max_batch=batch),
        eos_ids=model.config.eos_token_ids,
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


def draft_vocabulary(seqs: Sequence[Sequence[int]], skip: Sequence[int], size: int) -> list[int]:
    """The ``size`` most frequent tokens of the target's answers (``seq[skip[i]:]``), ties
    broken by id; with ``size`` >= the distinct count every seen token is kept."""
    counts: Counter[int] = Counter()
    for s, k in zip(seqs, skip, strict=True):
        counts.update(s[k:])
    return sorted(sorted(counts, key=lambda t: (-counts[t], t))[:size])


def train_head(
    model: LlamaForCausalLM,
    seqs: Sequence[Sequence[int]],
    features: Sequence[torch.Tensor],
    cfg: TrainConfig,
    log: Callable[[str], None] = lambda _: None,
    draft_vocab: Sequence[int] | None = None,
    checkpoint: Callable[[MTPHead, list[float]], None] | None = None,
) -> tuple[MTPHead, list[float]]:
    """Train a fresh head on (sequence, target features) pairs; returns it and the mean
    loss of each epoch. ``draft_vocab``: target ids the head drafts among (None: all);
    labels outside it are not trained on. ``checkpoint`` is called after every epoch.

    With ``cfg.unroll`` = 2 each batch also trains the second chained draft: the head's
    own output feature for pair t stands in for the target's feature t + 1, paired with
    token t + 2, and must predict token t + 3 (what chained drafting feeds it)."""
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.config.vocab_size
    head_cfg = MTPHeadConfig.for_target(
        model.config, 0 if draft_vocab is None else len(draft_vocab)
    )
    head = MTPHead(head_cfg).to(model.tok_embeddings.weight.device)
    # label id -> row of the draft vocabulary (-100: not draftable, not trained on)
    to_row = torch.arange(vocab)
    if draft_vocab is not None:
        head.draft_vocab.copy_(torch.tensor(list(draft_vocab), dtype=torch.int64))
        to_row = torch.full((vocab + 1,), -100, dtype=torch.int64)
        to_row[head.draft_vocab] = torch.arange(len(draft_vocab))
    to_row = torch.cat([to_row[:vocab], torch.tensor([-100])])  # index vocab = "no label"
    lm_w = head.lm_weight(model.output.weight).detach()  # [N, H]
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    usable = [i for i, s in enumerate(seqs) if len(s) >= 4]
    lengths = [len(s) for s in seqs]
    total_steps = cfg.epochs * max(1, sum(lengths[i] for i in usable) // cfg.batch_tokens + 1)
    warmup = max(1, total_steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10 %
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()
    history: list[float] = []
    step = 0
    for epoch in range(cfg.epochs):
        order = [usable[i] for i in torch.randperm(len(usable), generator=gen).tolist()]
        total, count = 0.0, 0
        for group in _batches(order, lengths, cfg.batch_tokens):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            step += 1
            # pair t = (feature t, token t + 1) for t in [0, T - 2]; label token t + 2
            pairs = [len(seqs[i]) - 1 for i in group]
            meta = _ragged([[0] * n for n in pairs])
            cache = head.new_cache(int(meta.kv_slots.max()) // 64 + 1, 64)
            hid = torch.cat([features[i][:-1] for i in group])  # [P, H]
            toks = torch.tensor([t for i in group for t in seqs[i][1:]])  # [P]
            out = head(hid, model.tok_embeddings(toks), meta, cache)  # [P, H]
            last = torch.zeros(len(toks), dtype=torch.bool)
            last[meta.last_index] = True  # the final pair of a sequence has no label
            labels = torch.tensor([t for i in group for t in [*seqs[i][2:], vocab]])
            labels = to_row[labels].masked_fill(last, -100)
            feat_target = torch.cat([features[i][1:] for i in group])  # [P, H]
            ce = F.cross_entropy(out @ lm_w.T, labels, ignore_index=-100)
            reg = F.smooth_l1_loss(out[~last], feat_target[~last])
            loss = ce + cfg.feature_weight * reg
            if cfg.unroll >= 2:
                # pair t' = (head feature for t + 1, token t + 2) → token t + 3
                pairs2 = [n - 1 for n in pairs]
                keep = torch.cat([torch.arange(n) < n - 1 for n in pairs])  # drop each last
                meta2 = _ragged([[0] * n for n in pairs2])
                cache2 = head.new_cache(int(meta2.kv_slots.max()) // 64 + 1, 64)
                toks2 = torch.tensor([t for i in group for t in seqs[i][2:]])
                out2 = head(out[keep], model.tok_embeddings(toks2), meta2, cache2)
                last2 = torch.zeros(len(toks2), dtype=torch.bool)
                last2[meta2.last_index] = True
                labels2 = torch.tensor([t for i in group for t in [*seqs[i][3:], vocab]])
                labels2 = to_row[labels2].masked_fill(last2, -100)
                ce2 = F.cross_entropy(out2 @ lm_w.T, labels2, ignore_index=-100)
                loss = loss + cfg.unroll_weight * ce2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(ce.detach()) * len(group)
            count += len(group)
            if time.perf_counter() - t0 > cfg.max_seconds:
                break
        history.append(total / max(count, 1))
        log(f"epoch {epoch}: next-token loss {history[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
        if checkpoint is not None:
            checkpoint(head.eval(), history)
            head.train()
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


def default_head_dir(model: str) -> Path:
    """Where the head for asset ``model`` is kept: ``~/.cache/trellis/heads/<model>-mtp``."""
    return Path.home() / ".cache" / "trellis" / "heads" / f"{Path(model).name}-mtp"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rose.spec.train_mtp", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="asset name or HF dir")
    ap.add_argument(
        "--text", type=Path, action="append", default=[], help="extra prompt lines (files)"
    )
    ap.add_argument("--out", type=Path, help="default: ~/.cache/trellis/heads/<model>-mtp")
    ap.add_argument("--prompts", type=int, default=576)
    ap.add_argument("--answer-tokens", type=int, default=80)
    ap.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=4096, help="0: the whole vocabulary")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (on a shared, oversubscribed CPU 1 beats 2 by far)",
    )
    ap.add_argument("--gen-batch", type=int, default=192, help="answering batch size")
    ap.add_argument("--exclude", action="append", default=[], help="held-out prompt (repeat)")
    ap.add_argument("--seed", type=int, default=1)
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(args_list)
    torch.set_num_threads(args.threads)

    import transformers  # only the command needs the chat template

    from rose.spec.corpus import local_prompts

    path = Path(args.model)
    if not path.is_dir():
        from rose.assets import ensure_model

        path = ensure_model(args.model)
    out_dir = args.out or default_head_dir(args.model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM.from_pretrained(path)
    t0 = time.perf_counter()
    corpus_file = out_dir / "corpus.jsonl"
    corpus_key = {
        "prompts": args.prompts,
        "answer_tokens": args.answer_tokens,
        "seed": args.seed,
        "text": [str(t) for t in args.text],
        "exclude": sorted(args.exclude),
    }
    seqs, skip = _load_corpus(corpus_file, corpus_key)
    if seqs:
        print(f"corpus: reusing {len(seqs)} answered prompts from {corpus_file}", flush=True)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        texts = _read_prompts(args.text, args.prompts)
        texts += local_prompts(
            path / "tokenizer.json", args.prompts - len(texts), args.seed, args.exclude
        )
        prompts = []
        for t in texts:
            ids: Any = tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True
            )
            prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        seqs = answer_prompts(model, prompts, args.answer_tokens, batch=args.gen_batch)
        skip = [len(p) for p in prompts]
        _save_corpus(corpus_file, corpus_key, seqs, skip)
        print(
            f"corpus: {len(seqs)} prompts answered in {time.perf_counter() - t0:.0f} s", flush=True
        )
    feats = _cached_features(model, seqs, out_dir / "features.safetensors", corpus_key)
    print(f"features: {time.perf_counter() - t0:.0f} s", flush=True)
    vocab = draft_vocabulary(seqs, skip, args.draft_vocab) if args.draft_vocab else None
    if vocab is not None:
        answer_toks = [t for s, k in zip(seqs, skip, strict=True) for t in s[k:]]
        vset = set(vocab)
        cover = sum(t in vset for t in answer_toks) / max(1, len(answer_toks))
        print(f"draft vocabulary: {len(vocab)} tokens cover {cover:.3f} of answers", flush=True)
    cfg = TrainConfig(
        lr=args.lr,
        epochs=args.epochs,
        max_seconds=args.minutes * 60,
        batch_tokens=args.batch_tokens,
        unroll=args.unroll,
        seed=args.seed,
    )
    n_tok = sum(len(s) for s in seqs)

    def note(history: list[float]) -> dict[str, Any]:
        return {
            "target": str(args.model),
            "loss_history": history,
            "train_note": (
                f"{len(seqs)} local prompts answered by the target (up to {args.answer_tokens} "
                f"tokens, {n_tok} tokens in all), draft vocabulary {args.draft_vocab or 'full'}, "
                f"unroll {args.unroll}, {len(history)} epochs, "
                f"{time.perf_counter() - t0:.0f} s in all on {args.threads} threads"
            ),
            "command": "python -m rose.spec.train_mtp " + shlex.join(args_list),
        }

    def checkpoint(head: MTPHead, history: list[float]) -> None:
        head.save(out_dir, extra=note(history))

    head, history = train_head(
        model,
        seqs,
        feats,
        cfg,
        log=lambda m: print(m, flush=True),
        draft_vocab=vocab,
        checkpoint=checkpoint,
    )
    head.save(out_dir, extra=note(history))
    print(f"saved {out_dir} after {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def _cached_features(
    model: LlamaForCausalLM, seqs: Sequence[Sequence[int]], file: Path, key: dict[str, Any]
) -> list[torch.Tensor]:
    """Target features of the corpus, kept next to it (recomputed when the corpus changes)."""
    from safetensors.torch import load_file, save_file

    tag = json.dumps({**key, "tokens": sum(len(s) for s in seqs)}, sort_keys=True)
    if file.is_file():
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            same = (f.metadata() or {}).get("corpus") == tag
        if same:
            flat = load_file(str(file))["features"]
            return list(flat.split([len(s) for s in seqs]))
    feats = target_features(model, seqs)
    save_file({"features": torch.cat(feats).contiguous()}, str(file), metadata={"corpus": tag})
    return feats


def _load_corpus(file: Path, key: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    """A previous run's answered prompts when made with the same settings."""
    if not file.is_file():
        return [], []
    lines = file.read_text().splitlines()
    if not lines or json.loads(lines[0]) != key:
        return [], []
    rows = [json.loads(line) for line in lines[1:]]
    return [r["ids"] for r in rows], [r["prompt_len"] for r in rows]


def _save_corpus(
    file: Path, key: dict[str, Any], seqs: Sequence[Sequence[int]], skip: Sequence[int]
) -> None:
    rows = [json.dumps(key)]
    rows += [json.dumps({"prompt_len": k, "ids": list(s)}) for s, k in zip(seqs, skip, strict=True)]
    file.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
