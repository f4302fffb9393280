"""ModernBERT encoders (and `ModernBertForSequenceClassification` cross-encoders) on ragged
batches, as transformers' ModernBert computes them.

Pre-norm layers (LayerNorm without bias unless norm_bias; the first layer has no attention
norm), a final norm, RoPE on queries and keys, and a GeGLU MLP (Wi → input, gate;
act(input) · gate → Wo). Layers alternate between global attention and local attention over
a sliding window (|i - j| <= local_attention / 2), each kind with its own RoPE theta
(`layer_types`, or every `global_attn_every_n_layers`-th layer global in older configs).
Attention runs through SDPA with a windowed block-diagonal (or per-row) mask
(`rose.models.rows`), since the engine's backends take no window.

  ModernBertForSequenceClassification   pool (CLS or the row mean, classifier_pooling) →
                                        head.dense → act → head.norm → classifier
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
from rose.models.rows import RowLayout, attend, log_sdpa_fallback, require_bidirectional
from rose.models.weights import Spec, find_prefix, take

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "ModernBertConfig",
    "ModernBertEncoder",
    "ModernBertFamilyModel",
    "engine_config",
    "load_weights",
    "position_ids",
]

# architecture in config.json → has a classification head
ARCHITECTURES: dict[str, bool] = {
    "ModernBertModel": False,
    "ModernBertForMaskedLM": False,
    "ModernBertForSequenceClassification": True,
}
GLOBAL, LOCAL = "full_attention", "sliding_attention"
_DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}  # transformers' defaults
_LEGACY_THETA_KEYS = {GLOBAL: "global_rope_theta", LOCAL: "local_rope_theta"}

_ENCODER_PREFIXES = ("", "model.")


@dataclass(frozen=True)
class ModernBertConfig(EncoderDefaults):
    family: str  # "modernbert"
    classifier: bool
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # GLOBAL or LOCAL per layer
    rope_theta: tuple[tuple[str, float], ...]  # (layer type, theta)
    local_attention: int  # the whole window; a local layer sees keys within half of it
    classifier_pooling: str  # "cls" | "mean"
    classifier_bias: bool
    classifier_act: str
    pad_token_id: int
    num_labels: int

    @property
    def window(self) -> int:
        return self.local_attention // 2

    @property
    def type_vocab_size(self) -> int:
        """Token type ids the engine accepts: ModernBERT has none and ignores them."""
        return 2

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings

    def theta(self, layer_type: str) -> float:
        return dict(self.rope_theta)[layer_type]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModernBertConfig:
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs and archs[0] not in ARCHITECTURES:
            raise EngineError(
                f"config.json: unsupported ModernBERT architecture {archs[0]!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        if not archs and raw.get("model_type") != "modernbert":
            raise EngineError(
                f"config.json: model_type {raw.get('model_type')!r} is not 'modernbert'"
            )
        classifier = ARCHITECTURES[archs[0]] if archs else False
        for key in ("hidden_activation", "classifier_activation"):
            if raw.get(key, "gelu") not in ACTIVATIONS:
                raise EngineError(f"config.json: {key} {raw[key]!r} is not supported")
        pooling = raw.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise EngineError(f"config.json: classifier_pooling {pooling!r} is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            cfg = cls(
                family="modernbert",
                classifier=classifier,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=layers,
                num_heads=heads,
                intermediate_size=int(raw["intermediate_size"]),
                hidden_act=str(raw.get("hidden_activation", "gelu")),
                norm_eps=float(raw.get("norm_eps", 1e-5)),
                norm_bias=bool(raw.get("norm_bias", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                layer_types=_layer_types(raw, layers),
                rope_theta=_rope_theta(raw),
                local_attention=int(raw.get("local_attention", 128)),
                classifier_pooling=str(pooling),
                classifier_bias=bool(raw.get("classifier_bias", False)),
                classifier_act=str(raw.get("classifier_activation", "gelu")),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                num_labels=_num_labels(raw) if classifier else 0,
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if hidden % heads:
            raise EngineError(
                f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        return cfg


def _layer_types(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:  # older configs: every n-th layer (from the first) is global
        every = int(raw.get("global_attn_every_n_layers", 3))
        types = [LOCAL if i % every else GLOBAL for i in range(layers)]
    if len(types) != layers or set(types) - {GLOBAL, LOCAL}:
        raise EngineError(
            f"config.json: layer_types {types!r} must name {layers} of {GLOBAL}/{LOCAL}"
        )
    return tuple(types)


def _rope_theta(raw: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """Theta per layer type from rope_parameters (current configs) or global_rope_theta /
    local_rope_theta (older ones); only the default RoPE (no scaling) is supported."""
    params = raw.get("rope_parameters") or {}
    if raw.get("rope_scaling"):
        raise EngineError("config.json: rope_scaling is not supported")
    out = []
    for kind in (GLOBAL, LOCAL):
        p = params.get(kind) or {}
        if p.get("rope_type", "default") != "default":
            raise EngineError(f"config.json: rope_type {p['rope_type']!r} is not supported")
        theta = p.get("rope_theta", raw.get(_LEGACY_THETA_KEYS[kind], _DEFAULT_THETA[kind]))
        out.append((kind, float(theta)))
    return tuple(out)


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> ModernBertConfig:
    """`ModernBertConfig` for the engine (the `rose.models` family contract)."""
    require_bidirectional(options, "ModernBERT")
    return ModernBertConfig.from_dict(raw)


def _num_labels(raw: Mapping[str, Any]) -> int:
    if "id2label" in raw:
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


def _norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class Rotary(nn.Module):
    """cos, sin [T, 1, 1, D] in fp32 for row-local positions and one theta (transformers'
    default RoPE), made once per pass and shared by every layer of the theta's kind; sin has
    rotate_half's sign folded into its first half (see `_rotate`)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        steps = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float()
        inv_freq = 1.0 / (self.theta ** (steps / d))  # [D/2]
        freqs = positions.float().unsqueeze(1) * inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)  # [T, D]
        sin = torch.cat((-sin, sin), dim=-1)  # [T, D]
        return cos[:, None, None], sin[:, None, None]  # [T, 1, 1, D] each


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, heads, D] rotated in fp32: x · cos + rotate_half(x) · sin, rotate_half(x) =
    (-x2, x1). With rotate_half's sign in sin's first half (`Rotary`), each half of the result
    is one multiply-add of the other half into x · cos, in place: no negated copy and no
    concatenation."""
    xf = x.float()
    half = x.shape[-1] // 2
    out = xf * cos  # [T, n, heads, D]
    out[..., :half].addcmul_(xf[..., half:], sin[..., :half])  # x1·cos - x2·sin
    out[..., half:].addcmul_(xf[..., :half], sin[..., half:])  # x2·cos + x1·sin
    return out.to(x.dtype)


class Attention(nn.Module):
    """Self-attention with one fused QKV projection and RoPE; local layers use a window."""

    def __init__(self, cfg: ModernBertConfig, layer_type: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.window if layer_type == LOCAL else None
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, heads, D]
        # Queries and keys rotated together: one set of elementwise ops for both.
        q, k = _rotate(qkv[:, :2], *rope).unbind(1)  # each [T, heads, D]
        v = qkv[:, 2]  # [T, heads, D]
        o = attend(q, k, v, layout, self.head_dim**-0.5, window=self.window)  # [T, heads, D]
        return self.out(o.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class GeGLU(nn.Module):
    """up → (input, gate); down(act(input) · gate)."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(x).chunk(2, dim=-1)  # each [T, I], views of [T, 2I]
        # The product in place on act's fresh [T, I] output: no second [T, I] tensor.
        return self.down(self.act(value).mul_(gate))  # [T, H]


class Layer(nn.Module):
    """Pre-norm layer: x = x + Attn(LN(x)); x = x + MLP(LN(x)); layer 0 has no attention norm."""

    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        self.attention_norm = _norm(cfg) if index > 0 else None
        self.attention = Attention(cfg, self.layer_type)
        self.mlp_norm = _norm(cfg)
        self.mlp = GeGLU(cfg)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        h = x if self.attention_norm is None else self.attention_norm(x)
        # Residuals added in place into each sublayer's fresh output (x + y == y + x).
        x = self.attention(h, layout, rope).add_(x)
        return self.mlp(self.mlp_norm(x)).add_(x)


class ModernBertEncoder(nn.Module):
    """Embeddings, layers and the final norm: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embeddings_norm = _norm(cfg)
        self.rotary = nn.ModuleDict(
            {kind: Rotary(cfg.head_dim, theta) for kind, theta in cfg.rope_theta}
        )
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend | None = None,
        state: Any = None,
    ) -> torch.Tensor:
        """ids, positions (row-local, from `position_ids`): [T]; types are ignored (ModernBERT
        has none); backend only chooses the SDPA strategy, state is unused."""
        layout = RowLayout.build(positions, backend)
        rope = {kind: self.rotary[kind](positions) for kind in set(self.cfg.layer_types)}
        x = self.embeddings_norm(self.embeddings(ids))  # [T, H]
        for layer in self.layers:
            x = layer(x, layout, rope[layer.layer_type])
        return self.final_norm(x)


class ClassificationHead(nn.Module):
    """Pool each row as the checkpoint says (classifier_pooling), then logits [B, num_labels]:
    dense, act, norm, classifier.

    Called with all hidden states [T, H] plus cu_seqlens [B+1] and seg_ids [T] it pools
    itself (either pooling). Called with first-token states [B, H] alone, as the engine calls
    BERT's heads, it works for "cls" pooling and refuses "mean" (a row mean needs the row).
    """

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.pooling = cfg.classifier_pooling
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = ACTIVATIONS[cfg.classifier_act]
        self.norm = _norm(cfg)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(
        self,
        states: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        seg_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cu_seqlens is None or seg_ids is None:
            if self.pooling != "cls":
                raise EngineError(
                    "ModernBERT's mean-pooling head needs the whole ragged batch "
                    "(head(hidden, cu_seqlens, seg_ids) or model.classify), not first-token states"
                )
            pooled = states  # [B, H]
        else:
            pooled = _pool(states, cu_seqlens, seg_ids, self.pooling)  # [B, H]
        return self.proj(self.norm(self.act(self.dense(pooled))))  # [B, num_labels]


def _pool(
    hidden: torch.Tensor, cu_seqlens: torch.Tensor, seg_ids: torch.Tensor, pooling: str
) -> torch.Tensor:
    """hidden [T, H] → [B, H]: each row's first token ("cls") or its mean ("mean")."""
    starts = cu_seqlens[:-1]  # [B]
    if pooling == "cls":
        return hidden[starts.clamp(max=hidden.shape[0] - 1)]
    sums = hidden.new_zeros(starts.shape[0], hidden.shape[1]).index_add_(0, seg_ids, hidden)
    lengths = (cu_seqlens[1:] - starts).clamp(min=1)  # [B]
    return sums / lengths.unsqueeze(1).to(hidden.dtype)


class ModernBertFamilyModel(FamilyModule):
    """The encoder plus, for cross-encoders, the classification head (see its pooling)."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = ModernBertEncoder(cfg)
        self.head = ClassificationHead(cfg) if cfg.classifier else None
        log_sdpa_fallback("modernbert", "sliding-window local layers")

    def classify(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, seg_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], cu_seqlens [B+1], seg_ids [T] → logits [B, num_labels]."""
        assert self.head is not None
        return self.head(hidden, cu_seqlens, seg_ids)


def expected_weights(cfg: ModernBertConfig, prefix: str = "") -> Spec:
    """Our parameter name → (checkpoint names, concatenated along dim 0; shape). LayerNorm and
    linear biases appear only where the config gives the layers biases."""
    h, i, p = cfg.hidden_size, cfg.intermediate_size, prefix
    m: Spec = {
        "encoder.embeddings.weight": (
            (p + "embeddings.tok_embeddings.weight",),
            (cfg.vocab_size, h),
        )
    }

    def linear(dst: str, src: str, shape: tuple[int, int], bias: bool) -> None:
        m[dst + ".weight"] = ((src + ".weight",), shape)
        if bias:
            m[dst + ".bias"] = ((src + ".bias",), (shape[0],))

    def norm(dst: str, src: str) -> None:
        m[dst + ".weight"] = ((src + ".weight",), (h,))
        if cfg.norm_bias:
            m[dst + ".bias"] = ((src + ".bias",), (h,))

    norm("encoder.embeddings_norm", p + "embeddings.norm")
    for n in range(cfg.num_layers):
        src, dst = f"{p}layers.{n}.", f"encoder.layers.{n}."
        if n > 0:
            norm(dst + "attention_norm", src + "attn_norm")
        linear(dst + "attention.qkv", src + "attn.Wqkv", (3 * h, h), cfg.attention_bias)
        linear(dst + "attention.out", src + "attn.Wo", (h, h), cfg.attention_bias)
        norm(dst + "mlp_norm", src + "mlp_norm")
        linear(dst + "mlp.up", src + "mlp.Wi", (2 * i, h), cfg.mlp_bias)
        linear(dst + "mlp.down", src + "mlp.Wo", (h, i), cfg.mlp_bias)
    norm("encoder.final_norm", p + "final_norm")
    if cfg.classifier:
        linear("head.dense", "head.dense", (h, h), cfg.classifier_bias)
        norm("head.norm", "head.norm")
        linear("head.proj", "classifier", (cfg.num_labels, h), True)
    return m


def load_weights(
    cfg: ModernBertConfig, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `ModernBertFamilyModel`'s state dict; EngineError on any
    missing, unexpected or misshapen weight."""
    prefix = find_prefix(tensors, "embeddings.tok_embeddings.weight", _ENCODER_PREFIXES)
    # A masked-LM checkpoint's prediction head and decoder are not part of the encoder.
    ignored = ("decoder.",) if cfg.classifier else ("head.", "decoder.")
    return take(expected_weights(cfg, prefix), tensors, (), ignored)


FAMILY = Family(engine_config, ModernBertFamilyModel, load_weights, position_ids)
