"""MPNet encoders (and `MPNetForSequenceClassification` cross-encoders) on ragged batches.

BERT-shaped post-norm layers with absolute position embeddings numbered as RoBERTa numbers
them (from padding_idx + 1, skipping padding tokens), plus one relative position bias shared
by all layers: T5-style log buckets of (query position - key position), one learned scalar
per bucket and head, added to the scaled scores. That bias is not expressible by the engine's
attention backends, so attention runs through SDPA with the bias as its mask (`rose.models.rows`).

  MPNetForSequenceClassification   CLS → classifier.dense → tanh → classifier.out_proj
"""

from __future__ import annotations

import math
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
from rose.models.rows import Block, RowLayout, attend, log_sdpa_fallback, require_bidirectional
from rose.models.weights import Spec, find_prefix, take

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "MPNetConfig",
    "MPNetEncoder",
    "MPNetFamilyModel",
    "engine_config",
    "load_weights",
    "position_ids",
    "relative_buckets",
]

# architecture in config.json → has a classification head
ARCHITECTURES: dict[str, bool] = {
    "MPNetModel": False,
    "MPNetForMaskedLM": False,
    "MPNetForSequenceClassification": True,
}

# transformers numbers absolute positions from this padding index whatever pad_token_id says.
PADDING_IDX = 1
# transformers computes the relative buckets with these constants (the bias table has
# relative_attention_num_buckets rows, of which the first 32 are used).
NUM_BUCKETS, MAX_DISTANCE = 32, 128

_ENCODER_PREFIXES = ("", "mpnet.")
_IGNORED_PREFIXES = ("lm_head.",)
_IGNORED_NAMES = ("embeddings.position_ids",)


@dataclass(frozen=True)
class MPNetConfig(EncoderDefaults):
    family: str  # "mpnet"
    classifier: bool
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    relative_buckets: int
    pad_token_id: int
    num_labels: int

    @property
    def type_vocab_size(self) -> int:
        """Token type ids the engine accepts: MPNet has none and ignores them, as transformers."""
        return 2

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings - PADDING_IDX - 1

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MPNetConfig:
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs and archs[0] not in ARCHITECTURES:
            raise EngineError(
                f"config.json: unsupported MPNet architecture {archs[0]!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        if not archs and raw.get("model_type") != "mpnet":
            raise EngineError(f"config.json: model_type {raw.get('model_type')!r} is not 'mpnet'")
        classifier = ARCHITECTURES[archs[0]] if archs else False
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise EngineError(f"config.json: hidden_act {act!r} is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                family="mpnet",
                classifier=classifier,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                intermediate_size=int(raw["intermediate_size"]),
                hidden_act=act,
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                relative_buckets=int(raw.get("relative_attention_num_buckets", 32)),
                pad_token_id=int(raw.get("pad_token_id", PADDING_IDX)),
                num_labels=_num_labels(raw) if classifier else 0,
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if hidden % heads:
            raise EngineError(
                f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        if cfg.relative_buckets < NUM_BUCKETS:
            raise EngineError(
                f"config.json: relative_attention_num_buckets {cfg.relative_buckets} < {NUM_BUCKETS}"
            )
        return cfg


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> MPNetConfig:
    """`MPNetConfig` for the engine (the `rose.models` family contract)."""
    require_bidirectional(options, "MPNet")
    return MPNetConfig.from_dict(raw)


def _num_labels(raw: Mapping[str, Any]) -> int:
    if "id2label" in raw:
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


def relative_buckets(
    rel: torch.Tensor, num_buckets: int = NUM_BUCKETS, max_distance: int = MAX_DISTANCE
) -> torch.Tensor:
    """rel = query position - key position (any shape, int64) → bucket in 0..num_buckets-1,
    as transformers' MPNetEncoder.relative_position_bucket and T5's bidirectional buckets:
    num_buckets / 2 per sign (keys after the query in the upper half), exact up to
    num_buckets / 4, logarithmic up to max_distance (defaults: MPNet's 32 and 128)."""
    half = num_buckets // 2
    exact = half // 2
    sign = (rel < 0).long() * half
    n = rel.abs()
    # log of n / exact scaled onto the remaining buckets (n >= exact here; clamp avoids log 0)
    scaled = torch.log(n.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (half - exact)).long()).clamp(max=half - 1)
    return sign + torch.where(n < exact, n, large)


class Embeddings(nn.Module):
    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(ids) + self.position(embedding_positions(ids, positions)))


def embedding_positions(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Row-local positions [T] → RoBERTa's position embedding index [T]: padding_idx + 1, + 2,
    ... counting only non-padding tokens of the row; padding tokens sit at padding_idx."""
    real = (ids != PADDING_IDX).long()  # [T]
    running = torch.cumsum(real, dim=0)  # [T]
    first = torch.arange(ids.shape[0], device=ids.device) - positions  # [T] row start
    before = running[first] - real[first]  # [T] real tokens before the row
    return (running - before) * real + PADDING_IDX


class Attention(nn.Module):
    """Self-attention with a fused QKV projection and an additive relative bias."""

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, biases: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, heads, D]
        q, k, v = qkv.unbind(1)  # each [T, heads, D]
        o = attend(q, k, v, layout, self.head_dim**-0.5, lambda i, _: biases[i])  # [T, heads, D]
        return self.out(o.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))  # [T, H]


class Layer(nn.Module):
    """Post-norm layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, biases: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, layout, biases))
        return self.mlp_norm(x + self.mlp(x))


class RelativeBias(nn.Module):
    """One learned scalar per (relative bucket, head), shared by all layers: a table of
    `rows` buckets of which `relative_buckets(rel, num_buckets, max_distance)` reads the
    first num_buckets (MPNet's table may be longer than its 32 buckets; T5's is exact)."""

    def __init__(
        self,
        rows: int,
        heads: int,
        num_buckets: int = NUM_BUCKETS,
        max_distance: int = MAX_DISTANCE,
    ) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, heads)
        self.num_buckets, self.max_distance = num_buckets, max_distance

    def forward(self, block: Block) -> torch.Tensor:
        buckets = relative_buckets(block.rel, self.num_buckets, self.max_distance)  # [L, L]
        return self.table(buckets).permute(2, 0, 1)  # [heads, L, L]


class MPNetEncoder(nn.Module):
    """Embeddings and layers: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.relative_bias = RelativeBias(cfg.relative_buckets, cfg.num_heads)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend | None = None,
        state: Any = None,
    ) -> torch.Tensor:
        """ids, positions (row-local, from `position_ids`): [T]; types are ignored (MPNet has
        none); backend only chooses the SDPA strategy, state is unused."""
        layout = RowLayout.build(positions, backend)
        biases = tuple(self.relative_bias(b) for b in layout.blocks)  # each [heads, L, L]
        x = self.embeddings(ids, positions)  # [T, H]
        for layer in self.layers:
            x = layer(x, layout, biases)
        return x


class ClassificationHead(nn.Module):
    """CLS hidden state [B, H] → logits [B, num_labels]: dense, tanh, out_proj."""

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.dense(cls_hidden)))  # [B, num_labels]


class MPNetFamilyModel(FamilyModule):
    """The encoder plus, for cross-encoders, the classification head."""

    def __init__(self, cfg: MPNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = MPNetEncoder(cfg)
        self.head = ClassificationHead(cfg) if cfg.classifier else None
        log_sdpa_fallback("mpnet", "relative position bias")


def expected_weights(cfg: MPNetConfig, prefix: str = "") -> Spec:
    """Our parameter name → (checkpoint names, concatenated along dim 0; shape)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    p = prefix
    m: Spec = {
        "encoder.embeddings.word.weight": (
            (p + "embeddings.word_embeddings.weight",),
            (cfg.vocab_size, h),
        ),
        "encoder.embeddings.position.weight": (
            (p + "embeddings.position_embeddings.weight",),
            (cfg.max_position_embeddings, h),
        ),
        "encoder.embeddings.norm.weight": ((p + "embeddings.LayerNorm.weight",), (h,)),
        "encoder.embeddings.norm.bias": ((p + "embeddings.LayerNorm.bias",), (h,)),
        "encoder.relative_bias.table.weight": (
            (p + "encoder.relative_attention_bias.weight",),
            (cfg.relative_buckets, cfg.num_heads),
        ),
    }
    for n in range(cfg.num_layers):
        src, dst = f"{p}encoder.layer.{n}.", f"encoder.layers.{n}."
        qkv = tuple(f"{src}attention.attn.{x}" for x in ("q", "k", "v"))
        m[dst + "attention.qkv.weight"] = (tuple(f"{q}.weight" for q in qkv), (3 * h, h))
        m[dst + "attention.qkv.bias"] = (tuple(f"{q}.bias" for q in qkv), (3 * h,))
        m[dst + "attention.out.weight"] = ((src + "attention.attn.o.weight",), (h, h))
        m[dst + "attention.out.bias"] = ((src + "attention.attn.o.bias",), (h,))
        m[dst + "attention_norm.weight"] = ((src + "attention.LayerNorm.weight",), (h,))
        m[dst + "attention_norm.bias"] = ((src + "attention.LayerNorm.bias",), (h,))
        m[dst + "mlp.up.weight"] = ((src + "intermediate.dense.weight",), (i, h))
        m[dst + "mlp.up.bias"] = ((src + "intermediate.dense.bias",), (i,))
        m[dst + "mlp.down.weight"] = ((src + "output.dense.weight",), (h, i))
        m[dst + "mlp.down.bias"] = ((src + "output.dense.bias",), (h,))
        m[dst + "mlp_norm.weight"] = ((src + "output.LayerNorm.weight",), (h,))
        m[dst + "mlp_norm.bias"] = ((src + "output.LayerNorm.bias",), (h,))
    if cfg.classifier:
        n_labels = cfg.num_labels
        m["head.dense.weight"] = (("classifier.dense.weight",), (h, h))
        m["head.dense.bias"] = (("classifier.dense.bias",), (h,))
        m["head.proj.weight"] = (("classifier.out_proj.weight",), (n_labels, h))
        m["head.proj.bias"] = (("classifier.out_proj.bias",), (n_labels,))
    return m


def load_weights(cfg: MPNetConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `MPNetFamilyModel`'s state dict; EngineError on any missing,
    unexpected or misshapen weight."""
    prefix = find_prefix(tensors, "embeddings.word_embeddings.weight", _ENCODER_PREFIXES)
    ignorable = {prefix + n for n in _IGNORED_NAMES}
    ignorable |= {prefix + "pooler.dense.weight", prefix + "pooler.dense.bias"}
    return take(expected_weights(cfg, prefix), tensors, ignorable, _IGNORED_PREFIXES)


FAMILY = Family(engine_config, MPNetFamilyModel, load_weights, position_ids)
