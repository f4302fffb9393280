"""Gemma 3 as a bidirectional encoder on ragged batches: EmbeddingGemma
(``google/embeddinggemma-300m``: config.json ``model_type: gemma3_text``,
``use_bidirectional_attention: true``, mean pooling, then two sentence-transformers
``Dense`` projections and a ``Normalize``, which `rose.loading` reads).

The stack, as transformers' ``Gemma3TextModel`` computes it, over the engine's ragged layout
(hidden states [T, H], the tokens of all rows concatenated):

  embeddings   token embedding times sqrt(H) (rounded to the weights' dtype)
  layer        x += post_attn_norm(Attn(input_norm(x))); x += post_ffn_norm(MLP(pre_ffn_norm(x)))
  norms        RMSNorm with weight (1 + w), normalized and scaled in fp32
  attention    q / k / v projections, per-head RMSNorm of q and k, RoPE, grouped-query
               attention scaled by ``query_pre_attn_scalar ** -0.5``; each layer is a
               ``sliding_attention`` layer (a token sees the keys of its row at most
               ``sliding_window // 2`` positions away, on either side: transformers'
               Gemma3TextConfig turns config.json's window W into the exclusive bound
               W // 2 + 1 when the attention is bidirectional) or a ``full_attention``
               one (its whole row), each kind with its own RoPE theta
  MLP          down(gelu_tanh(gate(x)) * up(x))
  final        RMSNorm

Attention runs through SDPA with windows (`rose.models.rows`), since the engine's backends
take no window; key / value heads are repeated to the query heads first. Causal Gemma 3
(the chat model's stack, no bidirectional flag) is refused: it is a decoder, not one of the
embedders this family serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rose.attention.base import AttentionBackend
from rose.errors import EngineError
from rose.models.family import Family, FamilyModule, FamilyOptions
from rose.models.family import row_positions as position_ids
from rose.models.qwen3 import apply_rope
from rose.models.rows import RowLayout, attend, log_sdpa_fallback, require_bidirectional
from rose.models.weights import Spec, find_prefix, take

__all__ = [
    "FAMILY",
    "Gemma3Config",
    "Gemma3Encoder",
    "Gemma3FamilyModel",
    "engine_config",
    "expected_weights",
    "load_weights",
    "position_ids",
]

ARCHITECTURES = ("Gemma3TextModel", "Gemma3ForCausalLM")
SLIDING, FULL = "sliding_attention", "full_attention"
# Weight-name prefixes a checkpoint may put before the stack's own names.
_PREFIXES = ("", "model.")


@dataclass(frozen=True)
class Gemma3Config:
    """What the encoder needs from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # SLIDING or FULL per layer
    sliding_window: int  # config.json's: a sliding layer's token sees keys up to half of it away
    rope: tuple[tuple[str, float, float], ...]  # (layer type, theta, linear scaling factor)
    query_pre_attn_scalar: float
    max_position_embeddings: int
    attention_bias: bool
    pad_token_id: int = 0
    classifier: bool = False
    num_labels: int = 0
    type_vocab_size: int = 1  # no token types: absent or all 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def causal(self) -> bool:
        return False

    @property
    def position_offset(self) -> int:
        return 0

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings

    @property
    def default_pooling(self) -> str:
        return "mean"

    def rope_for(self, layer_type: str) -> tuple[float, float]:
        """(theta, linear scaling factor) of a layer kind's RoPE."""
        return next((theta, f) for kind, theta, f in self.rope if kind == layer_type)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], options: FamilyOptions | None = None
    ) -> Gemma3Config:
        options = options or FamilyOptions()
        require_bidirectional(options, "gemma3")
        archs = raw.get("architectures") or []
        if len(archs) > 1 or (archs and archs[0] not in ARCHITECTURES):
            raise EngineError(
                f"config.json: architectures {archs} are not supported for gemma3_text "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        if not raw.get("use_bidirectional_attention") and options.attention_mode != "bidirectional":
            raise EngineError(
                "config.json: gemma3_text without use_bidirectional_attention=true is Gemma 3's "
                "causal decoder; this family serves its bidirectional embedders (EmbeddingGemma)"
            )
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise EngineError(
                f"config.json: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')"
            )
        if raw.get("attn_logit_softcapping") is not None:
            raise EngineError("config.json: attn_logit_softcapping is not supported")
        try:
            layers = int(raw["num_hidden_layers"])
            heads = int(raw["num_attention_heads"])
            types = tuple(raw.get("layer_types") or _default_layer_types(raw, layers))
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or 256),  # transformers' Gemma3 default
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                layer_types=types,
                sliding_window=int(raw.get("sliding_window") or 4096),
                rope=_rope(raw),
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
                attention_bias=bool(raw.get("attention_bias", False)),
                pad_token_id=int(raw.get("pad_token_id") or 0),
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise EngineError(f"config.json: {exc}") from None
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise EngineError(
                f"config.json: layer_types must give one of {SLIDING!r} / {FULL!r} for each of "
                f"the {layers} layers, got {list(types)}"
            )
        if cfg.num_heads % cfg.num_kv_heads:
            raise EngineError(
                f"config.json: num_attention_heads {cfg.num_heads} is not a multiple of "
                f"num_key_value_heads {cfg.num_kv_heads}"
            )
        if cfg.head_dim % 2 or cfg.sliding_window < 1:
            raise EngineError(
                f"config.json: head_dim {cfg.head_dim} must be even, sliding_window "
                f"{cfg.sliding_window} positive"
            )
        return cfg


def _default_layer_types(raw: Mapping[str, Any], layers: int) -> list[str]:
    """transformers' default when config.json lists none: every sliding_window_pattern-th
    layer full, the others sliding."""
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


def _rope(raw: Mapping[str, Any]) -> tuple[tuple[str, float, float], ...]:
    """(layer type, theta, linear factor) for both kinds. transformers >= 5 writes
    ``rope_parameters`` per layer type; older files keep ``rope_theta`` (full layers),
    ``rope_local_base_freq`` (sliding layers) and ``rope_scaling`` (full layers only)."""
    nested = raw.get("rope_parameters") or {}
    if SLIDING in nested or FULL in nested:
        per_kind = {kind: dict(nested.get(kind) or {}) for kind in (SLIDING, FULL)}
    else:
        full = {
            "rope_theta": raw.get("rope_theta", 1_000_000.0),
            **dict(raw.get("rope_scaling") or {}),
        }
        per_kind = {
            SLIDING: {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)},
            FULL: full,
        }
    out = []
    for kind, params in per_kind.items():
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise EngineError(
                f"config.json: {kind} rope_type {rope_type!r} is not supported ('default', 'linear')"
            )
        factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
        theta = params.get("rope_theta", 10_000.0 if kind == SLIDING else 1_000_000.0)
        out.append((kind, float(theta), factor))
    return tuple(out)


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> Gemma3Config:
    """`Gemma3Config` for the engine (the `rose.models` family contract)."""
    return Gemma3Config.from_dict(raw, options)


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · (1 + weight) over the last dim, all in fp32 and cast back
    (transformers' Gemma3RMSNorm: the weight is stored as an offset from one)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        scale = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)  # [.., 1]
        return (x32 * scale * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections, per-head (1 + w) RMSNorm of q and k, RoPE, grouped-query
    attention within the row (a window on sliding layers)."""

    def __init__(self, cfg: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.layer_type = layer_type
        self.window = cfg.sliding_window // 2 if layer_type == SLIDING else None
        self.scale = cfg.query_pre_attn_scalar**-0.5
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.wq = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.wk = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.wv = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_norm(self.wq(x).view(t, self.num_heads, d))  # [T, Hq, D]
        k = self.k_norm(self.wk(x).view(t, self.num_kv_heads, d))  # [T, Hkv, D]
        v = self.wv(x).view(t, self.num_kv_heads, d)  # [T, Hkv, D]
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # each key / value head serves `groups` consecutive query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = attend(q, k, v, layout, self.scale, window=self.window)  # [T, Hq, D]
        return self.wo(o.reshape(t, self.num_heads * d))  # [T, H]


class MLP(nn.Module):
    """GeGLU with tanh-approximated GELU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = nn.Linear(h, i, bias=False)
        self.w_up = nn.Linear(h, i, bias=False)
        self.w_down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.gelu(self.w_gate(x), approximate="tanh").mul_(self.w_up(x))  # [T, I]
        return self.w_down(gated)  # [T, H]


class Block(nn.Module):
    """Sandwich-norm layer: each sublayer's input and output normalized, then added."""

    def __init__(self, cfg: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = RMSNorm(h, eps)
        self.attention = Attention(cfg, layer_type)
        self.post_attention_norm = RMSNorm(h, eps)
        self.pre_mlp_norm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = RMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, layout: RowLayout, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = self.post_attention_norm(self.attention(self.input_norm(x), layout, rope)).add_(x)
        return self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x))).add_(x)


class Gemma3Encoder(nn.Module):
    """Embeddings, layers and the final norm: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _rope(
        self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of a layer kind (fp32 frequencies, cast to the pass's dtype)."""
        theta, factor = self.cfg.rope_for(layer_type)
        d = self.cfg.head_dim
        steps = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float()
        inv_freq = 1.0 / (theta ** (steps / d)) / factor  # [D/2]
        freqs = positions.float()[:, None] * inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)  # [T, D]
        sin = torch.cat((-sin, sin), dim=-1)  # [T, D], rotate_half's sign folded in
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend,
        state: Any,
    ) -> torch.Tensor:
        """Ragged ids [T] (types all 0 or None: Gemma has none) → hidden states [T, H]."""
        del types, state
        layout = RowLayout.build(positions, backend)
        x = self.embed(ids)  # [T, H]
        x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)
        ropes = {kind: self._rope(positions, kind, x.dtype) for kind in set(self.cfg.layer_types)}
        for layer in self.layers:
            x = layer(x, layout, ropes[layer.attention.layer_type])
        return self.norm(x)


class Gemma3FamilyModel(FamilyModule):
    """The encoder (EmbeddingGemma has no classification head)."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Gemma3Encoder(cfg)
        self.head = None
        log_sdpa_fallback("gemma3", "sliding-window layers")


# -- weights ---------------------------------------------------------------------------------


def expected_weights(cfg: Gemma3Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our parameter name → (checkpoint name without the stack's prefix, shape)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    m: dict[str, tuple[str, tuple[int, ...]]] = {
        "encoder.embed.weight": ("embed_tokens.weight", (cfg.vocab_size, h)),
        "encoder.norm.weight": ("norm.weight", (h,)),
    }
    for n in range(cfg.num_layers):
        src, dst = f"layers.{n}.", f"encoder.layers.{n}."
        for ours, hf in (
            ("input_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("pre_mlp_norm", "pre_feedforward_layernorm"),
            ("post_mlp_norm", "post_feedforward_layernorm"),
        ):
            m[f"{dst}{ours}.weight"] = (f"{src}{hf}.weight", (h,))
        for hf, ours, shape in (
            ("q_proj", "wq", (q, h)),
            ("k_proj", "wk", (kv, h)),
            ("v_proj", "wv", (kv, h)),
            ("o_proj", "wo", (h, q)),
        ):
            m[f"{dst}attention.{ours}.weight"] = (f"{src}self_attn.{hf}.weight", shape)
            if cfg.attention_bias:
                m[f"{dst}attention.{ours}.bias"] = (f"{src}self_attn.{hf}.bias", (shape[0],))
        m[dst + "attention.q_norm.weight"] = (src + "self_attn.q_norm.weight", (d,))
        m[dst + "attention.k_norm.weight"] = (src + "self_attn.k_norm.weight", (d,))
        for hf, ours, shape in (
            ("gate_proj", "w_gate", (i, h)),
            ("up_proj", "w_up", (i, h)),
            ("down_proj", "w_down", (h, i)),
        ):
            m[f"{dst}mlp.{ours}.weight"] = (f"{src}mlp.{hf}.weight", shape)
    return m


def load_weights(cfg: Gemma3Config, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `Gemma3FamilyModel`'s state dict; raise EngineError on any
    missing, unexpected or misshapen weight (an LM head, tied or not, is ignored)."""
    prefix = find_prefix(tensors, "embed_tokens.weight", _PREFIXES)
    spec: Spec = {
        dst: ((prefix + src,), shape) for dst, (src, shape) in expected_weights(cfg).items()
    }
    return take(spec, tensors, ignorable={"lm_head.weight"})


FAMILY = Family(engine_config, Gemma3FamilyModel, load_weights, position_ids)
