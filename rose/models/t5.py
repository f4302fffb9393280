"""T5 and mT5 encoders on ragged batches: the encoder stack of a T5 checkpoint as an embedder
(sentence-t5, GTR: mean pooling, a Dense projection and Normalize in their sentence-transformers
modules).

Pre-norm layers with T5's RMS norm (no mean, no bias), attention without biases and without
the 1/sqrt(d) scale, and one relative position bias for the whole stack: bidirectional log
buckets of (query position - key position), one learned scalar per bucket and head, stored in
the first block and added to every layer's scores. The MLP is ReLU (``feed_forward_proj:
relu``, T5 1.0) or gated (``gated-gelu``: act(wi_0 x) * wi_1 x, T5 1.1, mT5). The bias is not
expressible by the engine's attention backends, so attention runs through SDPA with the bias
as its mask (`rose.models.rows`). T5 has no position limit of its own; rows are capped at
``n_positions`` (512 when config.json has none), the length sentence-t5 and GTR were trained
to, which also bounds the [heads, L, L] bias.

A full encoder-decoder checkpoint (``T5ForConditionalGeneration``, ``T5Model``) serves its
encoder only, as sentence-transformers loads it; the decoder's weights are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rose.attention.base import AttentionBackend
from rose.errors import EngineError
from rose.models.activations import ACTIVATIONS
from rose.models.family import EncoderDefaults, Family, FamilyModule, FamilyOptions
from rose.models.family import row_positions as position_ids
from rose.models.mpnet import RelativeBias
from rose.models.qwen3 import RMSNorm
from rose.models.rows import RowLayout, attend, log_sdpa_fallback, require_bidirectional
from rose.models.weights import Spec, take

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "T5Config",
    "T5Encoder",
    "T5FamilyModel",
    "engine_config",
    "load_weights",
    "position_ids",
]

# model_type → the architectures whose encoder this family serves.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "t5": ("T5EncoderModel", "T5Model", "T5ForConditionalGeneration"),
    "mt5": ("MT5EncoderModel", "MT5Model", "MT5ForConditionalGeneration"),
}

DEFAULT_MAX_TOKENS = 512

# Checkpoint entries that are not the encoder's (a full T5's decoder and LM head).
_IGNORED_PREFIXES = ("decoder.", "lm_head.")


@dataclass(frozen=True)
class T5Config(EncoderDefaults):
    family: str  # "t5" | "mt5"
    vocab_size: int
    hidden_size: int  # d_model
    num_layers: int
    num_heads: int
    kv_dim: int  # d_kv, the width of one head (not always d_model / heads)
    intermediate_size: int  # d_ff
    act: str  # the MLP's activation
    gated: bool  # act(wi_0 x) * wi_1 x instead of act(wi x)
    layer_norm_eps: float
    relative_buckets: int
    relative_max_distance: int
    max_tokens: int
    pad_token_id: int
    classifier: bool = False
    num_labels: int = 0

    @property
    def head_dim(self) -> int:
        return self.kv_dim

    @property
    def type_vocab_size(self) -> int:
        """Token type ids the engine accepts: T5 has none and ignores them."""
        return 2

    @property
    def max_input_tokens(self) -> int:
        return self.max_tokens

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> T5Config:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise EngineError(f"config.json: model_type {model_type!r} is not 't5' or 'mt5'")
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs and archs[0] not in ARCHITECTURES[model_type]:
            raise EngineError(
                f"config.json: unsupported {model_type} architecture {archs[0]!r}; supported: "
                f"{', '.join(ARCHITECTURES[model_type])} (their encoder, as an embedder)"
            )
        # "relu" | "gated-gelu" | "gated-silu" | ...: [gated-]activation (T5Config's parsing)
        proj = str(raw.get("feed_forward_proj", "gated-gelu" if model_type == "mt5" else "relu"))
        gated = proj.startswith("gated-")
        act = proj.removeprefix("gated-")
        if act == "gelu" and gated:
            act = "gelu_new"  # transformers maps gated-gelu to the tanh approximation
        if act not in ACTIVATIONS:
            raise EngineError(f"config.json: feed_forward_proj {proj!r} is not supported")
        try:
            cfg = cls(
                family=str(model_type),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["d_model"]),
                num_layers=int(raw["num_layers"]),
                num_heads=int(raw["num_heads"]),
                kv_dim=int(raw["d_kv"]),
                intermediate_size=int(raw["d_ff"]),
                act=act,
                gated=gated,
                layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-6)),
                relative_buckets=int(raw.get("relative_attention_num_buckets", 32)),
                relative_max_distance=int(raw.get("relative_attention_max_distance", 128)),
                max_tokens=int(raw.get("n_positions") or DEFAULT_MAX_TOKENS),
                pad_token_id=int(raw.get("pad_token_id") or 0),
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if cfg.relative_buckets < 4 or cfg.relative_buckets % 4:
            raise EngineError(
                f"config.json: relative_attention_num_buckets {cfg.relative_buckets} must be a "
                "positive multiple of 4"
            )
        return cfg


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> T5Config:
    """`T5Config` for the engine (the `rose.models` family contract)."""
    require_bidirectional(options, "T5")
    if options.lm_head:
        raise EngineError("modules.json: SpladePooling needs a masked-LM head; T5 has none here")
    return T5Config.from_dict(raw)


class Attention(nn.Module):
    """q, k, v, o without biases; scores unscaled, plus the stack's relative bias."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.kv_dim
        inner = cfg.num_heads * cfg.kv_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.out = nn.Linear(inner, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, biases: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, heads, D]
        q, k, v = qkv.unbind(1)  # each [T, heads, D]
        o = attend(q, k, v, layout, 1.0, lambda i, _: biases[i])  # [T, heads, D]
        return self.out(o.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    """wo(act(wi x)), or wo(act(wi_0 x) * wi_1 x) when gated; no biases."""

    float_under_int8 = True  # --quantize int8 keeps the projections float (rose/int8.py)

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.up = nn.Linear(h, i, bias=False)  # wi, or wi_0 when gated
        self.gate = nn.Linear(h, i, bias=False) if cfg.gated else None  # wi_1
        self.down = nn.Linear(i, h, bias=False)  # wo
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(x))  # [T, I]
        if self.gate is not None:
            h = h * self.gate(x)
        return self.down(h)  # [T, H]


class Layer(nn.Module):
    """Pre-norm layer: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, biases: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), layout, biases)
        return x + self.mlp(self.mlp_norm(x))


class T5Encoder(nn.Module):
    """Embeddings, layers and the final norm: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        buckets = cfg.relative_buckets
        self.relative_bias = RelativeBias(
            buckets, cfg.num_heads, buckets, cfg.relative_max_distance
        )
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend | None = None,
        state: Any = None,
    ) -> torch.Tensor:
        """ids, positions (row-local, from `position_ids`): [T]; types are ignored (T5 has
        none); backend only chooses the SDPA strategy, state is unused."""
        del types, state
        layout = RowLayout.build(positions, backend)
        biases = tuple(self.relative_bias(b) for b in layout.blocks)  # each [heads, L, L]
        x = self.embed(ids)  # [T, H]
        for layer in self.layers:
            x = layer(x, layout, biases)
        return self.norm(x)


class T5FamilyModel(FamilyModule):
    """The encoder (T5 embedders have no classification head here)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = T5Encoder(cfg)
        self.head = None
        log_sdpa_fallback(cfg.family, "relative position bias")


def expected_weights(cfg: T5Config, embedding: str) -> Spec:
    """Our parameter name → (checkpoint names, concatenated along dim 0; shape)."""
    h, i, inner = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.kv_dim
    first = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    m: Spec = {
        "encoder.embed.weight": ((embedding,), (cfg.vocab_size, h)),
        "encoder.relative_bias.table.weight": ((first,), (cfg.relative_buckets, cfg.num_heads)),
        "encoder.norm.weight": (("encoder.final_layer_norm.weight",), (h,)),
    }
    for n in range(cfg.num_layers):
        src, dst = f"encoder.block.{n}.layer.", f"encoder.layers.{n}."
        qkv = tuple(f"{src}0.SelfAttention.{x}.weight" for x in "qkv")
        m[dst + "attention.qkv.weight"] = (qkv, (3 * inner, h))
        m[dst + "attention.out.weight"] = ((f"{src}0.SelfAttention.o.weight",), (h, inner))
        m[dst + "attention_norm.weight"] = ((f"{src}0.layer_norm.weight",), (h,))
        ff = f"{src}1.DenseReluDense."
        m[dst + "mlp.up.weight"] = ((ff + ("wi_0" if cfg.gated else "wi") + ".weight",), (i, h))
        if cfg.gated:
            m[dst + "mlp.gate.weight"] = ((ff + "wi_1.weight",), (i, h))
        m[dst + "mlp.down.weight"] = ((ff + "wo.weight",), (h, i))
        m[dst + "mlp_norm.weight"] = ((f"{src}1.layer_norm.weight",), (h,))
    return m


def load_weights(cfg: T5Config, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `T5FamilyModel`'s state dict; EngineError on any missing,
    unexpected or misshapen weight. The token embedding is ``shared.weight`` and/or its tied
    copy ``encoder.embed_tokens.weight`` (which must then be equal)."""
    names = [n for n in ("shared.weight", "encoder.embed_tokens.weight") if n in tensors]
    if not names:
        raise EngineError("weights: missing the token embedding (shared.weight)")
    if len(names) == 2 and not torch.equal(tensors[names[0]], tensors[names[1]]):
        raise EngineError("weights: encoder.embed_tokens.weight differs from shared.weight")
    return take(expected_weights(cfg, names[0]), tensors, set(names), _IGNORED_PREFIXES)


FAMILY = Family(engine_config, T5FamilyModel, load_weights, position_ids)
