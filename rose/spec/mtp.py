"""MTP / EAGLE-style draft head: one transformer layer on the target's features.

Input pair ``t`` is the target's final hidden state at position ``t`` and the embedding of
token ``t + 1`` (inputs shifted by one); each is RMS-normalized, concatenated and projected
back to the model width, then one decoder block (its own paged KV cache, pages from the
shared allocator) and an RMSNorm produce a feature whose logits come from the target's
LM head: the prediction for token ``t + 2``. The head shares the target's embeddings and LM
head. Chained drafting feeds the head's own output feature as the next pair's hidden state.

Saved as ``model.safetensors`` + ``config.json`` (`MTPHeadConfig`) in a directory.
"""

from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rose.kv.allocator import OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.cache import PagedKVCache
from rose.kv.metadata import AttentionMetadata
from rose.models.llama import (
    Block,
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
)
from rose.packed import can_pack, pack_linears
from rose.sampling import SamplingParams, sample, token_probs

__all__ = ["MTPDraftRequest", "MTPDrafter", "MTPHead", "MTPHeadConfig"]

_FORMAT = "trellis-mtp-head/1"


@dataclass(frozen=True)
class MTPHeadConfig:
    """Shape of the head; must match its target's width, heads and vocabulary.

    draft_vocab_size: the head drafts only among this many target tokens (the ids are the
    head's ``draft_vocab`` buffer, the target's most frequent output tokens), so a draft
    step multiplies by a ``[draft_vocab_size, H]`` slice of the LM head instead of all of
    it; 0 drafts over the whole vocabulary. Verification by the target stays exact either way.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"mtp head config.draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )

    @staticmethod
    def for_target(cfg: LlamaConfig, draft_vocab_size: int = 0) -> MTPHeadConfig:
        return MTPHeadConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            draft_vocab_size=draft_vocab_size,
        )

    def check_target(self, cfg: LlamaConfig) -> None:
        for key in ("hidden_size", "vocab_size"):
            if getattr(self, key) != getattr(cfg, key):
                raise ValueError(
                    f"mtp head config.{key}={getattr(self, key)} does not match the "
                    f"target's {getattr(cfg, key)}"
                )

    def block_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> MTPHeadConfig:
        if d.get("format") != _FORMAT:
            raise ValueError(f"mtp head config.format must be {_FORMAT!r}, got {d.get('format')!r}")
        fields = {k: d[k] for k in MTPHeadConfig.__dataclass_fields__ if k in d}
        return MTPHeadConfig(**fields)


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPHeadConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fuse = nn.Linear(2 * h, h, bias=False)
        self.block = Block(cfg.block_config(), layer=0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # target token id of each draft-vocabulary row (identity when drafting over all)
        n = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("draft_vocab", torch.arange(n, dtype=torch.int64))
        self._inv_freq: torch.Tensor | None = None

    def lm_weight(self, target_output: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head weight ``[V, H]`` the head drafts among."""
        if self.config.draft_vocab_size == 0:
            return target_output
        return target_output[self.draft_vocab].contiguous()  # [N, H]

    def new_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        w = self.norm.weight  # dtype and device (the linear layers may be packed)
        c = self.config
        return PagedKVCache(
            1, c.num_key_value_heads, c.head_dim, num_pages, page_size, w.dtype, w.device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        token_emb: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """hidden ``[T, H]`` (target feature at t), token_emb ``[T, H]`` (embedding of
        token t + 1) → feature ``[T, H]`` (normed; logits = target LM head of it)."""
        if self._inv_freq is None or self._inv_freq.device != hidden.device:
            self._inv_freq = rope_inv_freq(self.config.block_config()).to(hidden.device)
        cos, sin = rope_cos_sin(self._inv_freq, meta.positions, hidden.dtype)
        x = torch.cat([self.embed_norm(token_emb), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        x = self.block(self.fuse(x), cos, sin, meta, cache)  # [T, H]
        return self.norm(x)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        meta = {"format": _FORMAT, **asdict(self.config), **(extra or {})}
        (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")

    @staticmethod
    def load(path: str | Path, dtype: torch.dtype = torch.float32) -> MTPHead:
        path = Path(path)
        cfg = MTPHeadConfig.from_dict(json.loads((path / "config.json").read_text()))
        head = MTPHead(cfg)
        state = load_file(str(path / "model.safetensors"))
        want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        if cfg.draft_vocab_size == 0 and "draft_vocab" not in state:
            state["draft_vocab"] = head.draft_vocab  # heads saved before draft vocabularies
        got = {k: tuple(v.shape) for k, v in state.items()}
        if want != got:
            raise ValueError(f"mtp head weights in {path}: expected {want}, got {got}")
        head.load_state_dict(state, strict=True)
        return head.to(dtype).eval()


@dataclass
class MTPDraftRequest:
    """table: the head's cache for this sequence (holds pairs ``0 .. table.length - 1``).
    features: target hidden states ``[n, H]`` for pairs ``table.length ..`` up to the
    sequence's last cached position; tokens: all tokens so far; k: drafts wanted."""

    table: BlockTable
    features: torch.Tensor
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None


def _for_inference(head: MTPHead) -> MTPHead:
    """The head the drafter runs: on CPU a copy with oneDNN-packed linear layers
    (`rose.packed`; the caller's head stays trainable), else the head itself."""
    if not can_pack(head.fuse.weight.detach()):
        return head
    copy = deepcopy(head).requires_grad_(False)
    pack_linears(copy, batch_hint=4, single_row=True)
    return copy


class MTPDrafter:
    """Drafts a chain of k tokens per sequence with an `MTPHead`, all sequences batched."""

    def __init__(
        self, head: MTPHead, target: LlamaForCausalLM, allocator: PageAllocator, page_size: int
    ) -> None:
        head.config.check_target(target.config)
        self.head = _for_inference(head)
        self.target = target
        self.allocator = allocator
        self.page_size = page_size
        self.cache = self.head.new_cache(allocator.num_pages, page_size)
        # the LM head rows the head drafts among, sliced once ([N, H])
        self.lm_weight = head.lm_weight(target.output.weight.detach())

    def new_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.page_size)

    @torch.no_grad()
    def propose(
        self, requests: list[MTPDraftRequest]
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Chains of drafts per request and their distributions ``q [k, V]`` (None for
        greedy requests, whose drafts are the head's argmax: q is one-hot at them)."""
        vocab = self.target.config.vocab_size
        emb = self.target.tok_embeddings
        draft_vocab = self.head.draft_vocab
        live: list[int] = []
        for i, r in enumerate(requests):
            n = r.features.shape[0]
            if n < 1:
                continue
            try:
                r.table.reserve(r.table.length + n + r.k - 1)
                live.append(i)
            except OutOfPages:
                pass
        drafts: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        # step 0 feeds the pending target features with the tokens that follow them
        feats = {i: requests[i].features for i in live}
        toks: dict[int, list[int]] = {}
        for i in live:
            r = requests[i]
            start = r.table.length + 1  # pair t pairs feature t with token t + 1
            toks[i] = r.tokens[start : start + r.features.shape[0]]
        for step in range(max((requests[i].k for i in live), default=0)):
            live = [i for i in live if requests[i].k > step]
            entries = [(requests[i].table, requests[i].table.length, len(toks[i])) for i in live]
            meta = AttentionMetadata.build(entries, device=self.cache.k.device)
            ids = torch.tensor([t for i in live for t in toks[i]], device=self.cache.k.device)
            hid = feats[live[0]] if len(live) == 1 else torch.cat([feats[i] for i in live])
            out = self.head(hid, emb(ids), meta, self.cache)
            if out.shape[0] != len(live):
                out = out[meta.last_index]  # [B, H]
            logits = out @ self.lm_weight.T  # [B, N] over the draft vocabulary
            best = draft_vocab[logits.argmax(-1)].tolist()  # [B] target ids, one sync
            for row, i in enumerate(live):
                r = requests[i]
                r.table.length += len(toks[i])
                if r.params.greedy:
                    tok = best[row]
                else:  # sample within the draft vocabulary; q is zero outside it
                    q_sub = token_probs(logits[row : row + 1], r.params)  # [1, N]
                    j = int(sample(q_sub, r.params, r.generator)[0])
                    tok = int(draft_vocab[j])
                    q = torch.zeros(vocab, device=q_sub.device).index_copy_(
                        0, draft_vocab, q_sub[0]
                    )
                    dists[i].append(q)
                drafts[i].append(tok)
                feats[i] = out[row : row + 1]
                toks[i] = [tok]
        return [
            (drafts[i], torch.stack(dists[i]) if dists[i] else None) for i in range(len(requests))
        ]
