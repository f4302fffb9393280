"""Qwen3 and its Llama lineage as encoders on ragged batches: embedders (Qwen3-Embedding,
pplx-embed; gte-Qwen2 and stella on Qwen2; e5-mistral and SFR-Embedding on Mistral; Llama
ones) and sequence-classification rerankers.

The lineage shares one layer; `LAYOUTS` names what each model_type changes: Qwen3's q/k
RMSNorm, Qwen2's q/k/v bias, Llama's ``attention_bias`` on all four projections, the head
width's default, and Mistral's sliding window (the encoder attends over whole rows, so
inputs are capped at the window, inside which that is exact).

The decoder stack of Qwen3 (pre-norm; RMSNorm; per-head RMSNorm of queries and keys before
RoPE; grouped-query attention; SwiGLU MLP; a final RMSNorm) run over the engine's ragged
layout: hidden states are [T, H], the tokens of all rows concatenated, and attention goes
through an `AttentionBackend`, the only place rows meet. The same weights serve two ways:

  causal         each token sees its row up to itself; pooled at the last token by default
                 (Qwen3-Embedding: sentence-transformers ``pooling_mode_lasttoken``)
  bidirectional  each token sees its whole row; mean pooling by default (pplx-embed, whose
                 config.json says ``model_type: bidirectional_pplx_qwen3`` and
                 ``use_bidirectional_attention: true``)

`engine_config` resolves the mode from config.json unless `EngineConfig.attention_mode`
insists; the model directory's sentence-transformers Pooling module, when present, decides
the pooling.

Rerankers are cross-encoders with one logit per row, read at the row's last token:
  Qwen3-Reranker as sentence-transformers (>= 5.4) ships it: a causal LM whose modules.json
      ends in a ``LogitScore`` module naming the "yes" and "no" token ids; the logit is
      lm_head("yes") - lm_head("no") (tied or untied head), so its sigmoid is the model
      card's softmax over the two logits, P("yes"). Only the two LM-head rows are kept:
      ``head.weight = W[yes] - W[no]``.
  ``Qwen3ForSequenceClassification`` (e.g. a Qwen3-Reranker converted to that one logit):
      its ``score`` layer.

A ``Qwen3ForCausalLM`` directory without sentence-transformers modules is a chat model,
not an encoder: it generates on `rose.models.llama`'s paged-KV decoder (whose q/k norm is
Qwen3's), and Tulip decides which use a directory gets (`tulip.generation.is_generator`,
``--runner``).
"""

from __future__ import annotations

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

__all__ = [
    "FAMILY",
    "LAYOUTS",
    "Layout",
    "Qwen3Config",
    "Qwen3Encoder",
    "Qwen3FamilyModel",
    "architectures",
    "engine_config",
    "expected_weights",
    "load_weights",
    "position_ids",
]


@dataclass(frozen=True)
class Layout:
    """How a model_type's layers differ from Llama's.

    stem: its architectures' prefix (``{stem}Model``, ``{stem}ForCausalLM``,
        ``{stem}ForSequenceClassification``).
    qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3).
    qkv_bias: q/k/v projections always carry a bias (Qwen2); else config.json's
        ``attention_bias`` gives all four projections one (Llama) or none.
    head_dim: the head width when config.json has no ``head_dim`` (None: hidden / heads).
    """

    stem: str
    qk_norm: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None


# config.json model_type → layout, for the Llama lineage this family serves as encoders.
LAYOUTS: dict[str, Layout] = {
    "qwen3": Layout("Qwen3", qk_norm=True, head_dim=128),  # transformers' Qwen3 default
    "bidirectional_pplx_qwen3": Layout("Qwen3", qk_norm=True, head_dim=128),  # pplx-embed
    "qwen2": Layout("Qwen2", qkv_bias=True),  # gte-Qwen2, stella
    "llama": Layout("Llama"),
    "mistral": Layout("Mistral"),  # e5-mistral, SFR-Embedding-Mistral
}


def architectures(model_type: str) -> dict[str, bool]:
    """The architectures a model_type's config.json may name → has a classification head
    (scored at the last token). ``*ForCausalLM`` is an embedder (Qwen3-Embedding,
    e5-mistral ship that name with base-model weights) or a LogitScore reranker; generators
    under the same name load in rose.models.llama (`tulip.generation.is_generator`)."""
    stem = LAYOUTS[model_type].stem
    found = {f"{stem}Model": False, f"{stem}ForCausalLM": False}
    found[f"{stem}ForSequenceClassification"] = True
    if model_type == "bidirectional_pplx_qwen3":
        found["PPLXQwen3Model"] = False
    return found


# Weight-name prefixes a checkpoint may put before the decoder stack's own names.
_PREFIXES = ("", "model.")


@dataclass(frozen=True)
class Qwen3Config:
    """What the encoder needs from config.json (plus the resolved attention mode)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool  # all four projections (Llama's attention_bias)
    causal: bool
    qk_norm: bool = True  # Qwen3's per-head q/k RMSNorm
    qkv_bias: bool = False  # q/k/v only (Qwen2)
    sliding_window: int | None = None  # Mistral: attention span; inputs are capped at it
    classifier: bool = False
    num_labels: int = 0
    pad_token_id: int = 0
    tie_word_embeddings: bool = False
    score_tokens: tuple[int, int | None] | None = None  # LogitScore (true id, false id)
    type_vocab_size: int = 1  # no token types: absent or all 0

    @property
    def position_offset(self) -> int:
        return 0

    @property
    def max_input_tokens(self) -> int:
        """Up to a sliding window, every token sees every other (within its row), so the
        encoder is exact there; beyond it the model would need the window's mask."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def default_pooling(self) -> str:
        """Without a sentence-transformers Pooling module: the last token when causal (it is
        the only one that saw the whole row), else the mean."""
        return "last" if self.causal else "mean"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], options: FamilyOptions | None = None) -> Qwen3Config:
        options = options or FamilyOptions()
        model_type = str(raw.get("model_type", "qwen3"))
        if model_type not in LAYOUTS:
            raise EngineError(
                f"config.json: model_type {model_type!r} is not one of {', '.join(LAYOUTS)}"
            )
        layout, known = LAYOUTS[model_type], architectures(model_type)
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs and archs[0] not in known:
            raise EngineError(
                f"config.json: unsupported architecture {archs[0]!r} for model_type "
                f"{model_type!r}; supported: {', '.join(sorted(known))}"
            )
        classifier = bool(archs) and known[archs[0]]
        score = options.score_tokens
        if score is not None and classifier:
            raise EngineError(
                f"modules.json: a LogitScore module needs a causal LM, not {archs[0]!r}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise EngineError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("use_sliding_window"):  # Qwen2 / Qwen3: off unless this says so
            raise EngineError("config.json: use_sliding_window=true is not supported")
        if raw.get("mlp_bias"):
            raise EngineError("config.json: mlp_bias=true is not supported")
        # Mistral's window applies whenever set; the Qwens' only with use_sliding_window.
        window = raw.get("sliding_window") if model_type == "mistral" else None
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError(
                f"config.json: layer_types {sorted(set(layer_types))} are not supported "
                "(only 'full_attention')"
            )
        # transformers >= 5 nests RoPE settings in rope_parameters; older files keep
        # rope_theta at the top level and scaling in rope_scaling.
        rope = dict(raw.get("rope_parameters") or {})
        rope.update(raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise EngineError(f"config.json: rope_type {kind!r} is not supported (only 'default')")
        causal = _resolve_causal(raw, options.attention_mode)
        try:
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(
                    raw.get("head_dim") or layout.head_dim or int(raw["hidden_size"]) // heads
                ),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                attention_bias=bool(raw.get("attention_bias", False)),
                causal=causal,
                qk_norm=layout.qk_norm,
                qkv_bias=layout.qkv_bias,
                sliding_window=None if window is None else int(window),
                classifier=classifier or score is not None,
                num_labels=1 if score is not None else _num_labels(raw) if classifier else 0,
                pad_token_id=int(raw.get("pad_token_id") or 0),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                score_tokens=score,
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise EngineError(
                f"config.json: num_attention_heads {cfg.num_heads} is not a multiple of "
                f"num_key_value_heads {cfg.num_kv_heads}"
            )
        if cfg.head_dim % 2:
            raise EngineError(f"config.json: head_dim {cfg.head_dim} must be even for RoPE")
        if score is not None and not all(t is None or 0 <= t < cfg.vocab_size for t in score):
            raise EngineError(
                f"LogitScore token ids {score} are outside the vocabulary (0..{cfg.vocab_size - 1})"
            )
        return cfg


def _resolve_causal(raw: Mapping[str, Any], attention_mode: str) -> bool:
    """The attention mode: `EngineConfig.attention_mode` when not "auto"; else config.json's
    ``use_bidirectional_attention`` (pplx-embed), else its ``is_causal`` (GritLM-style
    exports), else bidirectional exactly for pplx-embed's model_type; causal otherwise."""
    if attention_mode != "auto":
        return attention_mode == "causal"
    if "use_bidirectional_attention" in raw:
        return not bool(raw["use_bidirectional_attention"])
    if "is_causal" in raw:
        return bool(raw["is_causal"])
    return raw.get("model_type") != "bidirectional_pplx_qwen3"


def _num_labels(raw: Mapping[str, Any]) -> int:
    if "id2label" in raw:
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> Qwen3Config:
    """`Qwen3Config` for the engine (the `rose.models` family contract)."""
    return Qwen3Config.from_dict(raw, options)


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · weight over the last dim, normalized in fp32 (as
    transformers' Qwen3RMSNorm) and scaled in x's dtype.

    The weight scales the normalized tensor in place: one [.., dim] tensor fewer per call
    (3-14 us less per call at 96-250 tokens on one CPU thread)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy when x is fp32
        scale = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)  # [.., 1]
        return (x32 * scale).to(x.dtype).mul_(self.weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with its halves rotated: x · cos + rotate_half(x) · sin, where
    rotate_half(x) = (-x2, x1). cos, sin [T, 1, D] from `Qwen3Encoder._rope`, whose sin has
    rotate_half's sign folded into its first half, so each half of the result is one
    multiply-add of the other half into x · cos, in place (no negated copy, no concatenation)."""
    half = x.shape[-1] // 2
    out = x * cos  # [T, heads, D]
    out[..., :half].addcmul_(x[..., half:], sin[..., :half])  # x1·cos - x2·sin
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])  # x2·cos + x1·sin
    return out


class Attention(nn.Module):
    """q/k/v projections, per-head RMSNorm of q and k, RoPE, grouped-query attention."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = d = cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        qkv_bias = bias or cfg.qkv_bias
        self.wq = nn.Linear(h, cfg.num_heads * d, bias=qkv_bias)
        self.wk = nn.Linear(h, cfg.num_kv_heads * d, bias=qkv_bias)
        self.wv = nn.Linear(h, cfg.num_kv_heads * d, bias=qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=bias)
        # Qwen3 only; the other layouts' q and k enter RoPE as projected.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        state: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.wq(x).view(t, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(self.wk(x).view(t, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = self.wv(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = backend.attend(q, k, v, state)  # [T, Hq, D]
        return self.wo(o.reshape(t, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    float_under_int8 = True  # --quantize int8 keeps the three projections float (rose/int8.py)

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = nn.Linear(h, i, bias=False)
        self.w_up = nn.Linear(h, i, bias=False)
        self.w_down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SiLU and the product in place on the fresh [T, I] gate: no new [T, I] tensors.
        gated = F.silu(self.w_gate(x), inplace=True).mul_(self.w_up(x))  # [T, I]
        return self.w_down(gated)  # [T, H]


class Block(nn.Module):
    """Pre-norm layer: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        state: Any,
    ) -> torch.Tensor:
        # Residuals added in place into each sublayer's fresh output (x + y == y + x).
        x = self.attention(self.attention_norm(x), cos, sin, backend, state).add_(x)
        return self.mlp(self.mlp_norm(x)).add_(x)


class Qwen3Encoder(nn.Module):
    """Embeddings, layers and the final norm: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # RoPE frequencies [D/2] in fp32, made on first use on the pass's device (a plain
        # attribute: moving the module to a low-precision dtype must not round them).
        self._inv_freq: torch.Tensor | None = None

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            d = self.cfg.head_dim
            steps = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device)
            self._inv_freq = 1.0 / (self.cfg.rope_theta ** (steps.float() / d))  # [D/2]
        freqs = positions.float()[:, None] * self._inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)  # [T, D]
        sin = torch.cat((-sin, sin), dim=-1)  # [T, D], rotate_half's sign folded in
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [T, 1, D] each

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend,
        state: Any,
    ) -> torch.Tensor:
        """Ragged ids [T] (types are all 0 or None: Qwen3 has none) → hidden states [T, H]."""
        del types
        x = self.embed(ids)  # [T, H]
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, backend, state)
        return self.norm(x)


class Qwen3FamilyModel(FamilyModule):
    """The encoder plus, for rerankers, the one-row head read at each row's last token."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Qwen3Encoder(cfg)
        self.head = (
            nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.classifier else None
        )

    def classify(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, seg_ids: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [T, H] → logits [B, num_labels] from each row's last token."""
        del seg_ids
        assert self.head is not None
        return self.head(hidden[(cu_seqlens[1:] - 1).clamp(min=0)])  # [B, num_labels]


# -- weights ---------------------------------------------------------------------------------


def expected_weights(cfg: Qwen3Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our parameter name → (checkpoint name without the stack's prefix, shape)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    m: dict[str, tuple[str, tuple[int, ...]]] = {
        "encoder.embed.weight": ("embed_tokens.weight", (cfg.vocab_size, h)),
        "encoder.norm.weight": ("norm.weight", (h,)),
    }
    for n in range(cfg.num_layers):
        src, dst = f"layers.{n}.", f"encoder.layers.{n}."
        m[dst + "attention_norm.weight"] = (src + "input_layernorm.weight", (h,))
        m[dst + "mlp_norm.weight"] = (src + "post_attention_layernorm.weight", (h,))
        for hf, ours, shape in (
            ("q_proj", "wq", (q, h)),
            ("k_proj", "wk", (kv, h)),
            ("v_proj", "wv", (kv, h)),
            ("o_proj", "wo", (h, q)),
        ):
            m[f"{dst}attention.{ours}.weight"] = (f"{src}self_attn.{hf}.weight", shape)
            if cfg.attention_bias or (cfg.qkv_bias and hf != "o_proj"):
                m[f"{dst}attention.{ours}.bias"] = (f"{src}self_attn.{hf}.bias", (shape[0],))
        if cfg.qk_norm:
            m[dst + "attention.q_norm.weight"] = (src + "self_attn.q_norm.weight", (d,))
            m[dst + "attention.k_norm.weight"] = (src + "self_attn.k_norm.weight", (d,))
        for hf, ours, shape in (
            ("gate_proj", "w_gate", (i, h)),
            ("up_proj", "w_up", (i, h)),
            ("down_proj", "w_down", (h, i)),
        ):
            m[f"{dst}mlp.{ours}.weight"] = (f"{src}mlp.{hf}.weight", shape)
    return m


def load_weights(cfg: Qwen3Config, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `Qwen3FamilyModel`'s state dict; raise EngineError on any
    missing, unexpected or misshapen weight. The LM head (``lm_head.weight``) only serves a
    LogitScore reranker (two of its rows) and is otherwise ignored; a sequence classifier's
    ``score.weight`` is its head."""
    anchor = "embed_tokens.weight"
    prefixes = [p for p in _PREFIXES if p + anchor in tensors]
    if len(prefixes) != 1:
        raise EngineError(
            f"weights: expected exactly one of {[p + anchor for p in _PREFIXES]}, found {len(prefixes)}"
        )
    prefix = prefixes[0]
    spec = {dst: (prefix + src, shape) for dst, (src, shape) in expected_weights(cfg).items()}
    lm_head = prefix + anchor if cfg.tie_word_embeddings else "lm_head.weight"
    if cfg.score_tokens is None and cfg.classifier:
        spec["head.weight"] = ("score.weight", (cfg.num_labels, cfg.hidden_size))
    elif cfg.score_tokens is not None and lm_head not in tensors:
        raise EngineError(
            f"weights: a LogitScore reranker needs the LM head {lm_head!r} (tie_word_embeddings "
            f"is {str(cfg.tie_word_embeddings).lower()})"
        )
    used = {src for src, _ in spec.values()}
    missing = sorted(used - set(tensors))
    if missing:
        raise EngineError(f"weights: missing {len(missing)} tensors, e.g. {missing[:5]}")
    unexpected = sorted(set(tensors) - used - {"lm_head.weight"})
    if unexpected:
        raise EngineError(f"weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    state: dict[str, torch.Tensor] = {}
    for dst, (src, shape) in spec.items():
        value = tensors[src]
        if tuple(value.shape) != shape:
            raise EngineError(f"weights: {src} has shape {tuple(value.shape)}, expected {shape}")
        state[dst] = value
    if cfg.score_tokens is not None:
        state["head.weight"] = _score_row(tensors[lm_head], cfg)
    return state


def _score_row(lm_head: torch.Tensor, cfg: Qwen3Config) -> torch.Tensor:
    """[1, H] fp32: the LM-head row of the true token minus that of the false token (the
    logit difference is linear in the hidden state, so one row computes it)."""
    assert cfg.score_tokens is not None
    true_id, false_id = cfg.score_tokens
    if tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise EngineError(
            f"weights: LM head has shape {tuple(lm_head.shape)}, expected {(cfg.vocab_size, cfg.hidden_size)}"
        )
    row = lm_head[true_id].float()
    if false_id is not None:
        row = row - lm_head[false_id].float()
    return row[None]


FAMILY = Family(engine_config, Qwen3FamilyModel, load_weights, position_ids)
