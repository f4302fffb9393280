"""DeBERTa-v2/v3 encoders (and `DebertaV2ForSequenceClassification` cross-encoders) on ragged
batches, as transformers' DebertaV2 computes them.

Post-norm BERT-shaped layers whose attention is disentangled: beside content-to-content
q_i·k_j, each score gets content-to-position q_i·Pk[δ(i,j)] (c2p) and position-to-content
k_j·Pq[δ'(i,j)] (p2c), where Pk, Pq project one shared table of relative-position embeddings
and δ = clamp(bucket(i - j) + span, 0, 2·span - 1) indexes it, with log buckets beyond half of
`position_buckets` (v3). All three terms are divided by sqrt(head_dim · (1 + #terms)). The
position terms are an additive bias the engine's attention backends cannot take, so attention
runs through SDPA with the bias as its mask (`rose.models.rows`).

v2 checkpoints may add absolute positions and token types to the embeddings; v3 ones use
neither. The convolution some v2 checkpoints put after the first layer is not supported.

  DebertaV2ForSequenceClassification   CLS → pooler.dense → pooler act → classifier
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
from rose.models.rows import Block, RowLayout, attend, log_sdpa_fallback, require_bidirectional
from rose.models.weights import Spec, find_prefix, take

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "DebertaConfig",
    "DebertaEncoder",
    "DebertaFamilyModel",
    "engine_config",
    "load_weights",
    "log_bucket",
    "position_ids",
]

# architecture in config.json → has a classification head
ARCHITECTURES: dict[str, bool] = {
    "DebertaV2Model": False,
    "DebertaV2ForMaskedLM": False,
    "DebertaV2ForSequenceClassification": True,
}
_POSITION_TERMS = ("c2p", "p2c")
# One layer's relative-position table through its Pk and Pq: [heads, rows, D] each, or None.
Projected = tuple[torch.Tensor | None, torch.Tensor | None]

_ENCODER_PREFIXES = ("", "deberta.")
# Pretraining heads: the legacy (cls.) and current (lm_predictions.) masked-LM heads, and
# ELECTRA-style discriminator heads of v3 checkpoints.
_IGNORED_PREFIXES = ("cls.", "lm_predictions.", "mask_predictions.", "lm_head.")


@dataclass(frozen=True)
class DebertaConfig(EncoderDefaults):
    family: str  # "deberta-v2"
    classifier: bool
    vocab_size: int
    embedding_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    position_biased_input: bool  # absolute position embeddings added to the input
    token_types: int  # token type embeddings in the checkpoint (0: none, ids ignored)
    relative_attention: bool
    position_terms: tuple[str, ...]  # subset of ("c2p", "p2c")
    position_buckets: int  # > 0: log-bucketed relative positions (v3)
    max_relative_positions: int
    share_att_key: bool  # Pk, Pq through the content key / query projections
    norm_rel_embeddings: bool  # LayerNorm on the relative-position table
    pooler_act: str
    pad_token_id: int
    num_labels: int

    @property
    def span(self) -> int:
        """Relative positions δ fall in [-span, span); the table has 2·span rows."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def type_vocab_size(self) -> int:
        """Token type ids the engine accepts (ignored when the checkpoint has none)."""
        return self.token_types if self.token_types > 0 else 2

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DebertaConfig:
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs and archs[0] not in ARCHITECTURES:
            raise EngineError(
                f"config.json: unsupported DeBERTa architecture {archs[0]!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        if not archs and raw.get("model_type") != "deberta-v2":
            raise EngineError(
                f"config.json: model_type {raw.get('model_type')!r} is not 'deberta-v2'"
            )
        classifier = ARCHITECTURES[archs[0]] if archs else False
        for key in ("hidden_act", "pooler_hidden_act"):
            if raw.get(key, "gelu") not in ACTIVATIONS:
                raise EngineError(f"config.json: {key} {raw[key]!r} is not supported")
        if int(raw.get("conv_kernel_size", 0) or 0) > 0:
            raise EngineError(
                "config.json: conv_kernel_size > 0 (DeBERTa-v2's ConvLayer) is not supported"
            )
        terms = raw.get("pos_att_type") or []
        if isinstance(terms, str):
            terms = [t.strip() for t in terms.lower().split("|")]
        unknown = sorted(set(terms) - set(_POSITION_TERMS))
        if unknown:
            raise EngineError(f"config.json: pos_att_type {unknown} is not supported (c2p, p2c)")
        norm_rel = [t.strip() for t in str(raw.get("norm_rel_ebd", "none")).lower().split("|")]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            max_pos = int(raw.get("max_position_embeddings", 512))
            max_rel = int(raw.get("max_relative_positions", -1))
            cfg = cls(
                family="deberta-v2",
                classifier=classifier,
                vocab_size=int(raw["vocab_size"]),
                embedding_size=int(raw.get("embedding_size") or hidden),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                intermediate_size=int(raw["intermediate_size"]),
                hidden_act=str(raw.get("hidden_act", "gelu")),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-7)),
                max_position_embeddings=max_pos,
                position_biased_input=bool(raw.get("position_biased_input", True)),
                token_types=int(raw.get("type_vocab_size", 0)),
                relative_attention=bool(raw.get("relative_attention", False)),
                position_terms=tuple(t for t in _POSITION_TERMS if t in terms),
                position_buckets=int(raw.get("position_buckets", -1)),
                max_relative_positions=max_rel if max_rel >= 1 else max_pos,
                share_att_key=bool(raw.get("share_att_key", False)),
                norm_rel_embeddings="layer_norm" in norm_rel,
                pooler_act=str(raw.get("pooler_hidden_act", "gelu")),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                num_labels=_num_labels(raw) if classifier else 0,
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if hidden % heads:
            raise EngineError(
                f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        if raw.get("attention_head_size", cfg.head_dim) != cfg.head_dim:
            raise EngineError(
                "config.json: attention_head_size other than hidden/heads is not supported"
            )
        if classifier and int(raw.get("pooler_hidden_size", hidden)) != hidden:
            raise EngineError(
                "config.json: pooler_hidden_size other than hidden_size is not supported"
            )
        return cfg


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> DebertaConfig:
    """`DebertaConfig` for the engine (the `rose.models` family contract)."""
    require_bidirectional(options, "DeBERTa-v2")
    return DebertaConfig.from_dict(raw)


def _num_labels(raw: Mapping[str, Any]) -> int:
    if "id2label" in raw:
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


def log_bucket(rel: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """transformers' make_log_bucket_position: relative positions within ±bucket_size/2 kept,
    farther ones mapped logarithmically onto the rest. The same float32 ops, so the same
    ceilings; constants stay Python scalars (no host tensor copied in a captured graph)."""
    sign = torch.sign(rel)
    mid = bucket_size // 2
    near = (rel < mid) & (rel > -mid)
    abs_pos = torch.where(near, mid - 1, torch.abs(rel))  # [L, L] int64
    # log((max_position - 1) / mid) rounded to float32, as transformers computes it
    scale = float(torch.log(torch.tensor((max_position - 1) / mid, device="cpu")))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / scale * (mid - 1)) + mid  # [L, L] float32
    return torch.where(abs_pos <= mid, rel.to(log_pos.dtype), log_pos * sign).long()


class Embeddings(nn.Module):
    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        e = cfg.embedding_size
        self.word = nn.Embedding(cfg.vocab_size, e)
        self.position = (
            nn.Embedding(cfg.max_position_embeddings, e) if cfg.position_biased_input else None
        )
        self.token_type = nn.Embedding(cfg.token_types, e) if cfg.token_types > 0 else None
        self.proj = nn.Linear(e, cfg.hidden_size, bias=False) if e != cfg.hidden_size else None
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word(ids)  # [T, E]
        if self.position is not None:
            x = x + self.position(positions)
        if self.token_type is not None:
            x = x + (self.token_type.weight[0] if types is None else self.token_type(types))
        if self.proj is not None:
            x = self.proj(x)  # [T, H]
        return self.norm(x)


class RelativePositions(nn.Module):
    """The shared table of relative-position embeddings [2·span, H], optionally normalized,
    and the index δ of every (query, key) pair of a block into it."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.table = nn.Parameter(torch.empty(2 * cfg.span, cfg.hidden_size))
        self.norm = (
            nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
            if cfg.norm_rel_embeddings
            else None
        )

    def embeddings(self) -> torch.Tensor:
        return self.table if self.norm is None else self.norm(self.table)  # [2·span, H]

    def delta_range(self, longest: int) -> tuple[int, int]:
        """[lo, hi): the rows of the table that pairs at most `longest` - 1 apart can index
        (bucketing is monotonic in |i - j|, so the farthest pair bounds them)."""
        cfg = self.cfg
        far = max(longest - 1, 0)
        if cfg.position_buckets > 0:
            far = int(
                log_bucket(torch.tensor(far), cfg.position_buckets, cfg.max_relative_positions)
            )
        far = min(far, cfg.span)
        return max(0, cfg.span - far), min(2 * cfg.span, cfg.span + far + 1)

    def indices(self, block: Block, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(c2p index [L, L] for (query i, key j), p2c index [L, L] for (key j, query i)),
        counted from table row `lo`."""
        cfg = self.cfg
        rel = block.rel  # [L, L], position_i - position_j
        if cfg.position_buckets > 0:
            rel = log_bucket(rel, cfg.position_buckets, cfg.max_relative_positions)
        top = 2 * cfg.span - 1
        c2p = torch.clamp(rel + cfg.span, 0, top) - lo  # [L(q), L(k)]
        p2c = torch.clamp(-rel + cfg.span, 0, top) - lo  # [L(k), L(q)] read as (row j, column i)
        return c2p, p2c


class DisentangledAttention(nn.Module):
    """Content attention plus the c2p / p2c relative-position terms as an additive bias."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.terms = cfg.position_terms if cfg.relative_attention else ()
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.share_att_key = cfg.share_att_key
        separate = cfg.relative_attention and not cfg.share_att_key
        h = cfg.hidden_size
        self.pos_key = nn.Linear(h, h) if separate and "c2p" in self.terms else None
        self.pos_query = nn.Linear(h, h) if separate and "p2c" in self.terms else None
        self.scale = (self.head_dim * (1 + len(self.terms))) ** -0.5

    def project_positions(
        self, rel_embeddings: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[2·span, H] → (Pk, Pq), each [heads, 2·span, D] (None when its term is off)."""
        span2 = rel_embeddings.shape[0]
        shared = None
        if self.share_att_key:  # through the content query / key projections
            shared = self.qkv(rel_embeddings).view(span2, 3, self.num_heads * self.head_dim)

        def heads(term: str, part: int, own: nn.Module | None) -> torch.Tensor | None:
            if term not in self.terms:
                return None
            if shared is not None:
                p = shared[:, part]  # [2·span, H]; part 0: query, 1: key
            else:
                assert own is not None
                p = own(rel_embeddings)
            return p.view(span2, self.num_heads, self.head_dim).transpose(0, 1).contiguous()

        return heads("c2p", 1, self.pos_key), heads("p2c", 0, self.pos_query)

    def forward(
        self,
        x: torch.Tensor,
        layout: RowLayout,
        projected: tuple[torch.Tensor | None, torch.Tensor | None],
        indices: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    ) -> torch.Tensor:
        """x [T, H]; projected: this layer's (Pk, Pq) rows for the δ range `indices` address
        (each [heads, R, D]), see `DebertaEncoder.position_projections`."""
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, heads, D]
        q, k, v = qkv.unbind(1)  # each [T, heads, D]
        bias = None
        pk, pq = projected
        if pk is not None or pq is not None:
            # per token, its score against every relative position in range: [heads, T, R]
            c2p_all = torch.einsum("thd,hrd->htr", q, pk) if pk is not None else None
            p2c_all = torch.einsum("thd,hrd->htr", k, pq) if pq is not None else None

            def bias(i: int, block: Block) -> torch.Tensor:
                s = block.span
                c2p_idx, p2c_idx = indices[i]  # each [L, L]
                heads, n = self.num_heads, c2p_idx.shape[0]
                total: torch.Tensor | None = None
                if c2p_all is not None:  # [heads, L(q), L(k)]: q_i · Pk[δ(i, j)]
                    total = c2p_all[:, s].gather(-1, c2p_idx.expand(heads, n, n))
                if p2c_all is not None:  # [heads, L(k), L(q)] → transposed: k_j · Pq[δ'(j, i)]
                    p2c = p2c_all[:, s].gather(-1, p2c_idx.expand(heads, n, n)).transpose(1, 2)
                    total = p2c if total is None else total.add_(p2c)
                assert total is not None
                return total.mul_(self.scale)  # [heads, L, L]

        o = attend(q, k, v, layout, self.scale, bias)  # [T, heads, D]
        return self.out(o.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))  # [T, H]


class Layer(nn.Module):
    """Post-norm layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.attention = DisentangledAttention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        layout: RowLayout,
        projected: Projected,
        indices: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    ) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, layout, projected, indices))
        return self.mlp_norm(x + self.mlp(x))


class DebertaEncoder(nn.Module):
    """Embeddings and layers: ragged ids [T] → hidden states [T, H].

    The relative-position table projected through each layer's Pk / Pq depends on the weights
    alone, so passes without gradients compute it once and keep it (`position_projections`);
    moving or converting the module, loading a state dict or packing weights drops it.
    """

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.relative = RelativePositions(cfg) if cfg.relative_attention else None
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self._projections: tuple[Projected, ...] | None = None

    def drop_cached_projections(self) -> None:
        self._projections = None

    def _apply(self, fn: Any, recurse: bool = True) -> DebertaEncoder:
        self.drop_cached_projections()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.drop_cached_projections()
        super()._load_from_state_dict(*args, **kwargs)

    def position_projections(self) -> tuple[Projected, ...]:
        """Each layer's (Pk, Pq), [heads, 2·span, D] each (None where a term is off); kept
        across passes without gradients, never while a CUDA graph is being captured (the
        capture does not run the kernels that would fill it)."""
        if self._projections is not None and not torch.is_grad_enabled():
            return self._projections
        assert self.relative is not None
        rel = self.relative.embeddings()  # [2·span, H]
        out = tuple(layer.attention.project_positions(rel) for layer in self.layers)
        capturing = rel.is_cuda and torch.cuda.is_current_stream_capturing()
        if not torch.is_grad_enabled() and not capturing:
            self._projections = out
        return out

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend | None = None,
        state: Any = None,
    ) -> torch.Tensor:
        """ids, positions (row-local, from `position_ids`), types: [T]; backend only chooses
        the SDPA strategy, state is unused."""
        layout = RowLayout.build(positions, backend)
        projected: list[Projected] = [(None, None)] * len(self.layers)
        indices: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        if self.relative is not None:
            # Only the table rows this batch's pairs can index (a block's length is host-known).
            longest = max(b.span.stop - b.span.start for b in layout.blocks)
            lo, hi = self.relative.delta_range(longest)
            indices = tuple(self.relative.indices(b, lo) for b in layout.blocks)
            projected = [
                (None if pk is None else pk[:, lo:hi], None if pq is None else pq[:, lo:hi])
                for pk, pq in self.position_projections()
            ]
        x = self.embeddings(ids, positions, types)  # [T, H]
        for layer, proj in zip(self.layers, projected, strict=True):
            x = layer(x, layout, proj, indices)
        return x


class ContextPooler(nn.Module):
    """CLS hidden state [B, H] → logits [B, num_labels]: dense, the pooler activation, classifier."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.pooler_act]
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.dense(cls_hidden)))  # [B, num_labels]


class DebertaFamilyModel(FamilyModule):
    """The encoder plus, for cross-encoders, the ContextPooler head."""

    def __init__(self, cfg: DebertaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = DebertaEncoder(cfg)
        self.head = ContextPooler(cfg) if cfg.classifier else None
        log_sdpa_fallback("deberta-v2", "disentangled c2p/p2c attention bias")

    def pack_weights(self, batch_hint: int = 512) -> int:
        self.encoder.drop_cached_projections()
        return super().pack_weights(batch_hint)


def expected_weights(cfg: DebertaConfig, prefix: str = "") -> Spec:
    """Our parameter name → (checkpoint names, concatenated along dim 0; shape)."""
    h, i, e, p = cfg.hidden_size, cfg.intermediate_size, cfg.embedding_size, prefix
    m: Spec = {
        "encoder.embeddings.word.weight": (
            (p + "embeddings.word_embeddings.weight",),
            (cfg.vocab_size, e),
        ),
        "encoder.embeddings.norm.weight": ((p + "embeddings.LayerNorm.weight",), (h,)),
        "encoder.embeddings.norm.bias": ((p + "embeddings.LayerNorm.bias",), (h,)),
    }
    if cfg.position_biased_input:
        m["encoder.embeddings.position.weight"] = (
            (p + "embeddings.position_embeddings.weight",),
            (cfg.max_position_embeddings, e),
        )
    if cfg.token_types > 0:
        m["encoder.embeddings.token_type.weight"] = (
            (p + "embeddings.token_type_embeddings.weight",),
            (cfg.token_types, e),
        )
    if e != h:
        m["encoder.embeddings.proj.weight"] = ((p + "embeddings.embed_proj.weight",), (h, e))
    if cfg.relative_attention:
        m["encoder.relative.table"] = ((p + "encoder.rel_embeddings.weight",), (2 * cfg.span, h))
        if cfg.norm_rel_embeddings:
            m["encoder.relative.norm.weight"] = ((p + "encoder.LayerNorm.weight",), (h,))
            m["encoder.relative.norm.bias"] = ((p + "encoder.LayerNorm.bias",), (h,))
    terms = cfg.position_terms if cfg.relative_attention else ()
    separate = cfg.relative_attention and not cfg.share_att_key
    for n in range(cfg.num_layers):
        src, dst = f"{p}encoder.layer.{n}.", f"encoder.layers.{n}."
        qkv = tuple(f"{src}attention.self.{x}_proj" for x in ("query", "key", "value"))
        m[dst + "attention.qkv.weight"] = (tuple(f"{q}.weight" for q in qkv), (3 * h, h))
        m[dst + "attention.qkv.bias"] = (tuple(f"{q}.bias" for q in qkv), (3 * h,))
        for ours, theirs, term in (
            ("pos_key", "pos_key_proj", "c2p"),
            ("pos_query", "pos_query_proj", "p2c"),
        ):
            if separate and term in terms:
                m[f"{dst}attention.{ours}.weight"] = (
                    (f"{src}attention.self.{theirs}.weight",),
                    (h, h),
                )
                m[f"{dst}attention.{ours}.bias"] = ((f"{src}attention.self.{theirs}.bias",), (h,))
        m[dst + "attention.out.weight"] = ((src + "attention.output.dense.weight",), (h, h))
        m[dst + "attention.out.bias"] = ((src + "attention.output.dense.bias",), (h,))
        m[dst + "attention_norm.weight"] = ((src + "attention.output.LayerNorm.weight",), (h,))
        m[dst + "attention_norm.bias"] = ((src + "attention.output.LayerNorm.bias",), (h,))
        m[dst + "mlp.up.weight"] = ((src + "intermediate.dense.weight",), (i, h))
        m[dst + "mlp.up.bias"] = ((src + "intermediate.dense.bias",), (i,))
        m[dst + "mlp.down.weight"] = ((src + "output.dense.weight",), (h, i))
        m[dst + "mlp.down.bias"] = ((src + "output.dense.bias",), (h,))
        m[dst + "mlp_norm.weight"] = ((src + "output.LayerNorm.weight",), (h,))
        m[dst + "mlp_norm.bias"] = ((src + "output.LayerNorm.bias",), (h,))
    if cfg.classifier:
        labels = cfg.num_labels
        m["head.dense.weight"] = (("pooler.dense.weight",), (h, h))
        m["head.dense.bias"] = (("pooler.dense.bias",), (h,))
        m["head.proj.weight"] = (("classifier.weight",), (labels, h))
        m["head.proj.bias"] = (("classifier.bias",), (labels,))
    return m


def load_weights(
    cfg: DebertaConfig, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to `DebertaFamilyModel`'s state dict; EngineError on any missing,
    unexpected or misshapen weight."""
    prefix = find_prefix(tensors, "embeddings.word_embeddings.weight", _ENCODER_PREFIXES)
    ignorable = {prefix + "embeddings.position_ids"}
    if not cfg.position_biased_input:
        # transformers ignores a stored absolute position table when the config does not use it
        ignorable.add(prefix + "embeddings.position_embeddings.weight")
    return take(expected_weights(cfg, prefix), tensors, ignorable, _IGNORED_PREFIXES)


FAMILY = Family(engine_config, DebertaFamilyModel, load_weights, position_ids)
