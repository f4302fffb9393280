"""Llama-family decoder (Llama, SmolLM2, Mistral, Phi-3's fused projections and LongRoPE,
Qwen2's q/k/v bias, Qwen3's q/k norm, Qwen3-MoE's and Mixtral's routed experts, Granite's
multipliers) on a paged KV cache.

Plain PyTorch in the gpt-fast manner: a frozen config built from config.json, small
modules, shape comments, and weights loaded through an explicit name map whose key set
and shapes are asserted. Every forward pass is ragged: new tokens of all sequences are
concatenated into ``[T]`` and attend to their own paged cache (`rose.kv`), so prefill,
decode, speculative verification and mixed batches are one code path.

Example::

    model = LlamaForCausalLM.from_pretrained(path)
    cache = model.new_cache(num_pages=64, page_size=16)
    table = BlockTable(PageAllocator(64), 16); table.reserve(len(ids))
    meta = AttentionMetadata.build([(table, 0, len(ids))])
    out = model(torch.tensor(ids), meta, cache, logits_index=meta.last_index)
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from rose.attention.metadata import AttentionMetadata
from rose.attention.paged import PagedKernel, paged_kernel_for
from rose.kv.cache import PagedKVCache
from rose.packed import PackedLinear, pack_linears

__all__ = [
    "DecoderOutput",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "load_state_dict",
    "RopeTable",
    "rope_cos_sin",
    "rope_inv_freq",
    "weight_name_map",
]

_SUPPORTED_MODEL_TYPES = (
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)

log = logging.getLogger("rose.models.llama")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``kind`` is "default", "linear", "llama3" or "longrope"
    (Phi-3: each pair's frequency divided by its ``short_factor``, the cos/sin tables times
    ``attention_factor``; served within ``original_max_position_embeddings``, where those
    are the factors in use)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class LlamaConfig:
    """Decoder hyper-parameters read from a Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True; Llama: config.attention_bias
    o_bias: bool = False  # Llama: config.attention_bias; Qwen2: False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Qwen3-MoE: the layers whose MLP is `SparseMoE` (num_experts experts of
    # moe_intermediate_size, experts_per_token routed per token, their weights renormalized
    # over the chosen ones when norm_topk_prob); the other layers keep the dense MLP
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Granite: embeddings times embedding_multiplier, each residual branch times
    # residual_multiplier, attention scores times attention_multiplier (None: the usual
    # 1 / sqrt(head_dim)), logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"config.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "config.num_attention_heads must be a multiple of config.num_key_value_heads "
                f"({self.num_attention_heads} vs {self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling.kind not in ("default", "linear", "llama3", "longrope"):
            raise ValueError(
                f"config.rope_scaling.rope_type {self.rope_scaling.kind!r} unsupported"
            )

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LlamaConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.model_type {model_type!r} not in {_SUPPORTED_MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.hidden_act {act!r} unsupported (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("config.use_sliding_window=true is unsupported")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"config.layer_types {sorted(set(layer_types))} unsupported (only 'full_attention')"
            )
        heads = int(d["num_attention_heads"])
        positions = context = int(d.get("max_position_embeddings", 2048))
        window = d.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3") else None
        if window is not None and int(window) < context:
            # Mistral 7B v0.1, Phi-3-mini-4k: each token sees the last `window` tokens.
            # Within that many tokens sliding attention is full causal attention, so the
            # model is served with that context, exactly (later ones set no window).
            log.info("config.sliding_window %d: the context is cut to it", int(window))
            context = int(window)
        # transformers >= 5 nests rope settings in rope_parameters; older files keep
        # rope_theta at top level and scaling in rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        # transformers >= 5 writes it in rope_parameters, older files at the top level
        partial = min(
            float(rope.get("partial_rotary_factor", 1.0)),
            float(d.get("partial_rotary_factor", 1.0)),
        )
        if partial != 1.0:
            raise ValueError(
                f"config.partial_rotary_factor {partial} unsupported (RoPE over whole heads only)"
            )
        if kind == "su":  # Phi-3's first name for LongRoPE
            kind = "longrope"
        short, attention = (), 1.0
        if kind == "longrope":
            # Phi-3's config.json keeps it at the top level
            top = d.get("original_max_position_embeddings", positions)
            original = int(rope.get("original_max_position_embeddings", top))
            short = tuple(float(f) for f in rope["short_factor"])
            attention = rope.get("attention_factor")
            if attention is None:  # the paper's, from the context's growth (as transformers)
                grown = float(rope.get("factor") or positions / original)
                attention = (
                    1.0 if grown <= 1.0 else math.sqrt(1 + math.log(grown) / math.log(original))
                )
            if original < context:
                # past it the long factors take over, for the whole sequence: every cached
                # key would change, so the model is served within it, exactly
                log.info("config.rope_scaling longrope: the context is cut to %d", original)
                context = original
        scaling = RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
            short_factor=short,
            attention_factor=float(attention),
        )
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        attention_bias = bool(d.get("attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        is_qwen3 = model_type in ("qwen3", "qwen3_moe")
        # transformers' Qwen3 default head_dim is 128, not hidden_size // heads
        head_dim = d.get("head_dim") or (128 if is_qwen3 else int(d["hidden_size"]) // heads)
        return LlamaConfig(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            max_position_embeddings=context,
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            **_moe_fields(d) if model_type in ("mixtral", "qwen3_moe") else {},
            **_granite_fields(d) if model_type == "granite" else {},
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @staticmethod
    def from_file(path: str | Path) -> LlamaConfig:
        return LlamaConfig.from_dict(json.loads(Path(path).read_text()))


def _granite_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(d.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(d.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(d.get("attention_multiplier", 1.0)),
        "logits_scaling": float(d.get("logits_scaling", 1.0)),
    }


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The expert settings of Qwen3-MoE (a layer is sparse, as transformers builds it,
    unless it is in ``mlp_only_layers``, when ``(layer + 1) % decoder_sparse_step == 0``)
    and Mixtral (every layer, experts of ``intermediate_size``, weights renormalized)."""
    mixtral = d.get("model_type") == "mixtral"
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)  # transformers 5
    step = int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or [])
    layers = range(int(d["num_hidden_layers"]))
    sparse = tuple(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0)
    size = d["intermediate_size"] if mixtral else d.get("moe_intermediate_size", 0)
    return {
        "moe_layers": sparse,
        "num_experts": experts,
        "experts_per_token": int(d.get("num_experts_per_tok", 0)),
        "moe_intermediate_size": int(size),
        "norm_topk_prob": mixtral or bool(d.get("norm_topk_prob", False)),
    }


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (fp32), with scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "longrope":
        if len(s.short_factor) != d // 2:
            raise ValueError(
                f"config.rope_scaling.short_factor: {len(s.short_factor)} factors for "
                f"{d // 2} frequency pairs"
            )
        inv = 1.0 / (
            torch.tensor(s.short_factor)
            * cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        )
    elif s.kind == "llama3":
        # Long wavelengths (beyond the original context / low_freq_factor) are slowed by
        # `factor`; short ones (below context / high_freq_factor) kept; in between, a
        # linear blend in 1/wavelength.
        wavelen = 2 * math.pi / inv
        ctx = s.original_max_position_embeddings
        slow = inv / s.factor
        blend = (ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        mixed = (1 - blend) * slow + blend * inv
        inv = torch.where(wavelen > ctx / s.low_freq_factor, slow, inv)
        medium = (wavelen >= ctx / s.high_freq_factor) & (wavelen <= ctx / s.low_freq_factor)
        inv = torch.where(medium, mixed, inv)
    return inv


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, 1, D]`` for positions ``[T]``, times ``scale`` (LongRoPE's
    attention factor; 1: none)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RopeTable:
    """`rope_cos_sin` of every position below ``size``, computed once: a pass then looks its
    positions up with one index op instead of ~10 small ones, which a draft head's one-token
    steps notice (the values are the same: each entry is computed as `rope_cos_sin` would).

    table ``[size, 2, D]``: cos then sin of each position. A position past it raises
    (IndexError on the CPU), so size it to the cache a model writes to: a sequence's
    positions never exceed the cache's slots, one slot per token."""

    def __init__(self, inv_freq: torch.Tensor, size: int, dtype: torch.dtype) -> None:
        cos, sin = rope_cos_sin(inv_freq, torch.arange(size, device=inv_freq.device), dtype)
        self.table = torch.cat([cos, sin], dim=1)  # [size, 2, D]

    def __len__(self) -> int:
        return int(self.table.shape[0])

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, D]`` for positions ``[T]`` (views of one lookup)."""
        both = self.table.index_select(0, positions)  # [T, 2, D]
        return both[:, :1], both[:, 1:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: x ``[T, heads, D]``, cos/sin ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the same ops without the two no-op casts
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _stacked_linear(*parts: nn.Module) -> nn.Linear:
    """One frozen linear layer whose output is the given layers' outputs side by side (their
    weights, and biases when they have them, stacked along the output dimension). The parts
    may be `PackedLinear`s: their ``weight`` is the dense one."""
    w = torch.cat([p.weight.detach() for p in parts])  # [sum out, in]
    has_bias = getattr(parts[0], "bias", None) is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias)
    fused = fused.to(device=w.device, dtype=w.dtype).requires_grad_(False)
    fused.weight.copy_(w)
    if fused.bias is not None:
        fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.wq = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.wk = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.wv = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * d, h, bias=cfg.o_bias)
        # Qwen3: RMSNorm over each head's D features of q and of k (weights [D]), before RoPE
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Granite's attention_multiplier in place of 1 / sqrt(D): every kernel scales the
        # scores by 1 / sqrt(D), so queries are scaled by the ratio first (1.0: no op)
        m = cfg.attention_multiplier
        self.q_scale = 1.0 if m is None else m * math.sqrt(d)
        self.wqkv: nn.Module | None = None  # set by `fuse_qkv`

    def fuse_qkv(self) -> None:
        """Replace wq, wk and wv by one linear layer ``[(Hq + 2 Hkv) * D, H]`` whose output
        is ``[q | k | v]``: one product instead of three, for inference copies whose
        products are small enough that a call's fixed cost shows (a draft head's one-token
        steps). Loaded weights stay where they are until this is called."""
        self.wqkv = _stacked_linear(self.wq, self.wk, self.wv)
        del self.wq, self.wk, self.wv

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.wqkv is not None:  # q and k side by side: one rotation for both
            d_qk = (self.n_heads + self.n_kv) * self.head_dim
            qk, v = self.wqkv(x).split([d_qk, self.n_kv * self.head_dim], dim=-1)
            qk = qk.view(t, self.n_heads + self.n_kv, self.head_dim)  # [T, Hq + Hkv, D]
            if self.q_norm is not None and self.k_norm is not None:
                q, k = qk.split([self.n_heads, self.n_kv], dim=1)
                qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)  # [T, Hq + Hkv, D]
            qk = apply_rope(qk, cos, sin)
            q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # [T, Hq, D], [T, Hkv, D]
        else:
            q = self.wq(x).view(t, self.n_heads, self.head_dim)  # [T, Hq, D]
            k = self.wk(x).view(t, self.n_kv, self.head_dim)  # [T, Hkv, D]
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = self.wv(x)
        v = v.view(t, self.n_kv, self.head_dim)  # [T, Hkv, D]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        cache.write(self.layer, meta.slot_mapping, k, v)
        if meta.kernel is not None:  # a paged kernel reads the pages in place
            out = meta.kernel.run(q, *cache.pages(self.layer))  # [T, Hq, D]
            return self.wo(out.reshape(t, self.n_heads * self.head_dim))  # [T, H]

        keys, values = cache.gather(self.layer, meta.kv_slots)  # [B, Lk, Hkv, D]
        b, lq = meta.q_index.shape
        # one sequence: the padded view is the ragged one (q_index [[0 .. T-1]], out_index
        # [0 .. T-1]), so skip the two identity gathers
        queries = q[None] if b == 1 else q[meta.q_index]  # [B, Lq, Hq, D]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [B, Hq, Lq, D]
            keys.transpose(1, 2),  # [B, Hkv, Lk, D]
            values.transpose(1, 2),  # [B, Hkv, Lk, D]
            attn_mask=meta.mask,  # [B, 1, Lq, Lk] or None
            enable_gqa=self.n_heads != self.n_kv,
        )  # [B, Hq, Lq, D]
        out = out.transpose(1, 2).reshape(b * lq, self.n_heads * self.head_dim)  # [B*Lq, Hq*D]
        return self.wo(out if b == 1 else out[meta.out_index])  # [T, H]


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.w_gate = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.w_up = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.w_gate_up: nn.Module | None = None  # set by `fuse_gate_up`

    def fuse_gate_up(self) -> None:
        """Replace w_gate and w_up by one linear layer ``[2 I, H]`` whose output is
        ``[gate | up]`` (see `Attention.fuse_qkv`)."""
        self.w_gate_up = _stacked_linear(self.w_gate, self.w_up)
        del self.w_gate, self.w_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [T, I] each
            return self.w_down(F.silu(gate) * up)
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class SparseMoE(nn.Module):
    """Qwen3-MoE's and Mixtral's routed MLP: a router picks ``k`` of ``E`` expert MLPs per token, whose
    outputs are summed weighted by the router's softmax (fp32) over the chosen ones
    (renormalized when ``norm_topk_prob``). Each expert runs once per pass, on the tokens
    routed to it, in ascending expert order (so a token's sum runs in transformers' order)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.k = cfg.experts_per_token
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = probs.topk(self.k, dim=-1)  # [T, k] each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)  # [T, H]
        # one sync for the whole layer: which (slot, token) pairs each expert serves
        flat = chosen.t().reshape(-1)  # [k * T], slot-major, as transformers walks them
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        slots, tokens = order // x.shape[0], order % x.shape[0]
        at = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                t, j = tokens[at : at + n], slots[at : at + n]
                y = expert(x.index_select(0, t)) * weights[t, j, None]  # [n, H]
                out.index_add_(0, t, y)
                at += n
        return out


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if layer in cfg.moe_layers else MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        r = self.residual_multiplier
        if r != 1.0:  # Granite
            x = x + self.attention(self.attention_norm(x), cos, sin, meta, cache) * r
            return x + self.mlp(self.mlp_norm(x)) * r
        x = x + self.attention(self.attention_norm(x), cos, sin, meta, cache)
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class DecoderOutput:
    """logits ``[N, V]`` and final-norm hidden states ``[N, H]`` at the selected tokens;
    all_hidden, when requested: every new token's final-norm hidden state ``[T, H]``, or the
    outputs of the requested decoder layers side by side ``[T, len(layers) * H]``."""

    logits: torch.Tensor
    hidden: torch.Tensor
    all_hidden: torch.Tensor | None = None


def _feature_layers(request: bool | Sequence[int], num_layers: int) -> frozenset[int]:
    """The layer indices a ``return_all_hidden`` request names (empty for a bool)."""
    if isinstance(request, bool):
        return frozenset()
    layers = [int(i) for i in request]
    if not layers:
        raise ValueError("return_all_hidden: an empty layer list; pass True or False")
    if any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        raise ValueError(f"return_all_hidden layers must be ascending, got {layers}")
    if layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"return_all_hidden layers must be in [0, {num_layers}), got {layers}")
    return frozenset(layers)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._inv_freq: torch.Tensor | None = None
        # Plans each pass of a paged-attention kernel (`rose.attention.paged`; FlashInfer on
        # CUDA, set by `from_pretrained`); None: SDPA over gathered K/V.
        self.paged_kernel: PagedKernel | None = None
        # Rows a pass of 2-3 rows is padded to (`pack_weights`: where this CPU runs that
        # many faster); 1: no padding.
        self.pass_min_rows = 1

    def new_cache(
        self, num_pages: int, page_size: int, device: torch.device | str | None = None
    ) -> PagedKVCache:
        w = self.tok_embeddings.weight
        c = self.config
        return PagedKVCache(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            num_pages,
            page_size,
            dtype=w.dtype,
            device=w.device if device is None else device,
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config).to(positions.device)
        scale = self.config.rope_scaling.attention_factor
        return rope_cos_sin(self._inv_freq, positions, self.tok_embeddings.weight.dtype, scale)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_index: torch.Tensor | None = None,
        return_all_hidden: bool | Sequence[int] = False,
    ) -> DecoderOutput:
        """input_ids ``[T]`` (all sequences' new tokens, concatenated) → logits at
        ``logits_index`` (``[N]`` indices into ``[T]``; all tokens when None).

        return_all_hidden: True keeps every new token's final-norm hidden state as
        ``all_hidden``; a non-empty sequence of layer indices (0-based, ascending, each
        below ``num_hidden_layers``) keeps those decoder layers' outputs instead, in that
        order, side by side (``[T, len * H]``; the residual stream, before any norm)."""
        layers = _feature_layers(return_all_hidden, len(self.layers))
        if self.paged_kernel is not None and meta.kernel is None:
            meta = replace(meta, kernel=self.paged_kernel.plan(meta))
        cos, sin = self._rope(meta.positions)
        x = self.tok_embeddings(input_ids)  # [T, H]
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        kept: list[torch.Tensor] = []
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, meta, cache)
            if i in layers:
                kept.append(x)
        if kept:
            sel = x if logits_index is None else x[logits_index]  # [N, H]
            hidden = self.norm(sel)
            all_hidden = kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)  # [T, L*H]
            return DecoderOutput(self._logits(hidden), hidden, all_hidden)
        if return_all_hidden is True:
            all_hidden = self.norm(x)  # [T, H]
            hidden = all_hidden if logits_index is None else all_hidden[logits_index]
            return DecoderOutput(self._logits(hidden), hidden, all_hidden)
        if logits_index is not None:
            x = x[logits_index]  # [N, H]
        hidden = self.norm(x)
        return DecoderOutput(logits=self._logits(hidden), hidden=hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.output(hidden)  # [N, V]
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling  # Granite

    def pack_weights(self, batch_hint: int = 4) -> int:
        """Run every linear layer on oneDNN-packed weights (`rose.packed`); returns how many
        were packed (0 off CPU). The hint is small because decoding and verification pass a
        few tokens per sequence; prefill's long passes gain as well. Where this CPU runs
        them faster (measured at load, `rose.packed.tune_few_rows`), every layer also keeps
        ``W.T`` for the single row of plain decoding (the weights then take twice the
        memory), and passes of 2-3 rows are padded to ``batch_hint`` (`pass_min_rows`:
        the runner tops such passes up with filler tokens, the layers pad two-row
        inputs). Inference only."""
        n = pack_linears(self, batch_hint, single_row=True, min_rows=batch_hint)
        if isinstance(self.output, PackedLinear):
            self.pass_min_rows = self.output.min_rows
        return n

    @staticmethod
    def from_pretrained(
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        packed: bool = True,
    ) -> LlamaForCausalLM:
        """Load a Hugging Face Llama/Qwen2/Qwen3 directory (config.json + *.safetensors) for
        inference (no gradients); packed: on CPU, `pack_weights` right away."""
        path = Path(path)
        cfg = LlamaConfig.from_file(path / "config.json")
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        state = load_state_dict(path, cfg, model, dtype=dtype, device=device)
        model.load_state_dict(state, assign=True, strict=True)
        if cfg.tie_word_embeddings:
            model.output.weight = model.tok_embeddings.weight
        model = model.eval().requires_grad_(False)
        if packed:
            model.pack_weights()
        model.paged_kernel, why = paged_kernel_for(
            model.tok_embeddings.weight.device,
            dtype,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        if why:
            log.info("decoder attention: SDPA over gathered K/V (%s)", why)
        return model


# a sparse layer's checkpoint names: its block, then each expert's gate, up and down
_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def weight_name_map(cfg: LlamaConfig) -> dict[str, str]:
    """Checkpoint key (Hugging Face layout) → this module's parameter name."""
    m = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
    }
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        m[src + "input_layernorm.weight"] = dst + "attention_norm.weight"
        m[src + "post_attention_layernorm.weight"] = dst + "mlp_norm.weight"
        for hf, ours in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
            m[f"{src}self_attn.{hf}.weight"] = f"{dst}attention.{ours}.weight"
        if cfg.qkv_bias:
            for hf, ours in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
                m[f"{src}self_attn.{hf}.bias"] = f"{dst}attention.{ours}.bias"
        if cfg.o_bias:
            m[f"{src}self_attn.o_proj.bias"] = f"{dst}attention.wo.bias"
        if cfg.qk_norm:
            m[src + "self_attn.q_norm.weight"] = dst + "attention.q_norm.weight"
            m[src + "self_attn.k_norm.weight"] = dst + "attention.k_norm.weight"
        if i in cfg.moe_layers:
            moe, names = _MOE_NAMES.get(cfg.model_type, _MOE_NAMES["qwen3_moe"])
            m[f"{src}{moe}.gate.weight"] = dst + "mlp.gate.weight"
            for e in range(cfg.num_experts):
                for hf, ours in zip(names, ("w_gate", "w_up", "w_down"), strict=True):
                    m[f"{src}{moe}.experts.{e}.{hf}.weight"] = f"{dst}mlp.experts.{e}.{ours}.weight"
            continue
        for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            m[f"{src}mlp.{hf}.weight"] = f"{dst}mlp.{ours}.weight"
            if cfg.mlp_bias:
                m[f"{src}mlp.{hf}.bias"] = f"{dst}mlp.{ours}.bias"
    return m


def _unfused_phi3(raw: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused ``qkv_proj`` ``[(Hq + 2 Hkv) D, H]`` and ``gate_up_proj`` ``[2 I, H]``
    (gate first), split into the Llama layout's projections (views of the same storage)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = dict(raw)
    for i in range(cfg.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = out.pop(attn + "qkv_proj.weight", None)
        if qkv is not None and qkv.shape[0] == q + 2 * kv:
            for name, part in zip(
                ("q_proj", "k_proj", "v_proj"), qkv.split([q, kv, kv]), strict=True
            ):
                out[f"{attn}{name}.weight"] = part
        elif qkv is not None:  # not Phi-3's shape: left for the key-set check to name
            out[attn + "qkv_proj.weight"] = qkv
        gate_up = out.pop(mlp + "gate_up_proj.weight", None)
        if gate_up is not None and gate_up.shape[0] == 2 * cfg.intermediate_size:
            out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate_up.chunk(2)
        elif gate_up is not None:
            out[mlp + "gate_up_proj.weight"] = gate_up
    return out


def load_state_dict(
    path: Path,
    cfg: LlamaConfig,
    model: nn.Module,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` under ``path`` and rename through `weight_name_map`,
    asserting the exact key set and every shape against ``model``'s parameters."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    if cfg.model_type == "phi3":
        raw = _unfused_phi3(raw, cfg)
    names = weight_name_map(cfg)
    if cfg.tie_word_embeddings:
        raw.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    missing = sorted(set(names) - set(raw))
    unexpected = sorted(set(raw) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"llama weights in {path}: missing {missing[:8]} ({len(missing)}), "
            f"unexpected {unexpected[:8]} ({len(unexpected)})"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for src, dst in names.items():
        t = raw[src]
        want = tuple(params[dst].shape)
        if tuple(t.shape) != want:
            raise ValueError(f"llama weight {src}: shape {tuple(t.shape)}, expected {want}")
        out[dst] = t.to(dtype=dtype, device=device)
    if cfg.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
