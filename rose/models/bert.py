"""BERT-layout encoders (and their sequence-classification and masked-LM heads) on ragged
batches: BERT, the RoBERTa layout (RoBERTa, XLM-RoBERTa, CamemBERT) and DistilBERT.

Hidden states are [T, H]: the tokens of all rows concatenated, no padding. Attention is the
only place rows meet and goes through an `AttentionBackend`. The three layouts compute the
same post-norm layer; what differs is data in `BertConfig` (``family``) and the checkpoints'
names (`_LAYER_NAMES`):

  bert        positions 0, 1, 2, ...; token types embedded (type_vocab_size, usually 2)
  roberta     positions from padding_idx + 1, padding tokens at padding_idx (fairseq's
              make_positions, computed by the engine on the host); one token type
  distilbert  positions 0, 1, 2, ...; no token type embedding (ids of type 1 in a pair are
              accepted and ignored, as DistilBERT's tokenizer does not pass them on);
              config.json spells dim / n_layers / n_heads / hidden_dim / activation

Heads differ as the checkpoints do (CLS is each row's first token):

  BertForSequenceClassification        CLS → pooler.dense → tanh → classifier
  RobertaForSequenceClassification     CLS → classifier.dense → tanh → classifier.out_proj
  DistilBertForSequenceClassification  CLS → pre_classifier → ReLU → classifier
  masked LM (SPLADE)                   dense → activation → LayerNorm → tied decoder + bias
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rose.attention.base import AttentionBackend
from rose.errors import EngineError
from rose.models.family import EncoderDefaults, Family, FamilyModule, FamilyOptions
from rose.packed import pack_linears

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "BertConfig",
    "BertEncoder",
    "BertFamilyModel",
    "ClassificationHead",
    "MaskedLMHead",
    "engine_config",
    "expected_weights",
    "load_weights",
    "position_ids",
]

# architecture in config.json → (family, has a classification head)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("bert", False),
    "BertForMaskedLM": ("bert", False),
    "BertForPreTraining": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "XLMRobertaModel": ("roberta", False),
    "XLMRobertaForMaskedLM": ("roberta", False),
    "XLMRobertaForSequenceClassification": ("roberta", True),
    "RobertaModel": ("roberta", False),
    "RobertaForMaskedLM": ("roberta", False),
    "RobertaForSequenceClassification": ("roberta", True),
    "CamembertModel": ("roberta", False),
    "CamembertForMaskedLM": ("roberta", False),
    "CamembertForSequenceClassification": ("roberta", True),
    "DistilBertModel": ("distilbert", False),
    "DistilBertForMaskedLM": ("distilbert", False),
    "DistilBertForSequenceClassification": ("distilbert", True),
}
# config.json model_type → layout; an architecture, when named, must be of that model_type.
_MODEL_TYPES = {
    "bert": "bert",
    "xlm-roberta": "roberta",
    "roberta": "roberta",
    "camembert": "roberta",
    "distilbert": "distilbert",
}
_ARCHITECTURE_PREFIXES = {
    "bert": "Bert",
    "xlm-roberta": "XLMRoberta",
    "roberta": "Roberta",
    "camembert": "Camembert",
    "distilbert": "DistilBert",
}

_DEFAULT_PAD = {"bert": 0, "roberta": 1, "distilbert": 0}  # transformers' defaults per layout

# DistilBERT's config.json names → BERT's (transformers' DistilBertConfig.attribute_map).
_DISTILBERT_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
}

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# hidden_act → the activation `rose.packed` can fuse into the MLP's up projection.
_PACKED_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}

# Weight-name prefixes a checkpoint may put before the encoder's own names.
_ENCODER_PREFIXES = ("", "bert.", "roberta.", "distilbert.")
# Checkpoint entries that are not weights of this model (pretraining heads, saved buffers).
_IGNORED_PREFIXES = (
    "cls.",
    "lm_head.",
    "vocab_transform.",
    "vocab_layer_norm.",
    "vocab_projector.",
)
_IGNORED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(frozen=True)
class BertConfig(EncoderDefaults):
    """What the encoder needs from config.json."""

    family: str  # layout: "bert" | "roberta" (RoBERTa, XLM-R, CamemBERT) | "distilbert"
    classifier: bool
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    num_labels: int
    mlm_head: bool = False  # load the masked-LM head (SPLADE's sparse output)

    @property
    def position_offset(self) -> int:
        """The RoBERTa layout's first position id is padding_idx + 1; the others' is 0."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def embeds_token_types(self) -> bool:
        """DistilBERT has no token type embedding (``type_vocab_size`` then only bounds the
        type ids the engine accepts and ignores)."""
        return self.family != "distilbert"

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], mlm_head: bool = False) -> BertConfig:
        archs = raw.get("architectures") or []
        if len(archs) > 1:
            raise EngineError(f"config.json lists several architectures {archs}; expected one")
        if archs:
            if archs[0] not in ARCHITECTURES:
                raise EngineError(
                    f"config.json: unsupported architecture {archs[0]!r}; "
                    f"supported: {', '.join(sorted(ARCHITECTURES))}"
                )
            family, classifier = ARCHITECTURES[archs[0]]
        else:
            model_type = raw.get("model_type")
            if model_type not in _MODEL_TYPES:
                raise EngineError(f"config.json: unsupported model_type {model_type!r}")
            family, classifier = _MODEL_TYPES[model_type], False
        model_type = raw.get("model_type")
        if (
            archs
            and model_type in _ARCHITECTURE_PREFIXES
            and not archs[0].startswith(
                tuple(_ARCHITECTURE_PREFIXES[model_type] + kind for kind in ("Model", "For"))
            )
        ):
            raise EngineError(
                f"config.json: architecture {archs[0]!r} is not a {model_type!r} architecture"
            )
        if family == "distilbert":
            raw = {**raw, **{ours: raw[k] for k, ours in _DISTILBERT_KEYS.items() if k in raw}}
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise EngineError(
                f"config.json: position_embedding_type {raw['position_embedding_type']!r} is not "
                "supported (only 'absolute')"
            )
        act = raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise EngineError(f"config.json: hidden_act {act!r} is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                family=family,
                classifier=classifier,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                intermediate_size=int(raw["intermediate_size"]),
                hidden_act=act,
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),  # DistilBERT: fixed
                max_position_embeddings=int(raw["max_position_embeddings"]),
                # DistilBERT embeds none but takes BERT-style pair ids (types 0 and 1)
                type_vocab_size=2 if family == "distilbert" else int(raw.get("type_vocab_size", 2)),
                pad_token_id=int(
                    raw.get("pad_token_id")
                    if raw.get("pad_token_id") is not None
                    else _DEFAULT_PAD[family]
                ),
                num_labels=_num_labels(raw) if classifier else 0,
                mlm_head=mlm_head,
            )
        except KeyError as exc:
            raise EngineError(f"config.json: missing key {exc.args[0]!r}") from None
        if hidden % heads:
            raise EngineError(
                f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        return cfg


def engine_config(raw: Mapping[str, Any], options: FamilyOptions) -> BertConfig:
    """`BertConfig` for the engine (the `rose.models` family contract): these encoders
    attend bidirectionally only and have no LM head to score with."""
    if options.attention_mode == "causal":
        raise EngineError(
            "EngineConfig.attention_mode='causal': BERT-layout encoders attend bidirectionally only"
        )
    if options.score_tokens is not None:
        raise EngineError(
            "modules.json: a LogitScore module needs a causal LM; BERT-layout encoders have no LM head here"
        )
    if options.lm_head and _is_classifier(raw):
        raise EngineError(
            "modules.json: SpladePooling needs a masked-LM checkpoint, not a classifier"
        )
    return BertConfig.from_dict(raw, mlm_head=options.lm_head)


def _is_classifier(raw: Mapping[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return bool(archs) and ARCHITECTURES.get(archs[0], ("", False))[1]


def _num_labels(raw: Mapping[str, Any]) -> int:
    if "id2label" in raw:
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.embeds_token_types else None
        )
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word(ids) + self.position(positions)  # [T, H]
        if self.token_type is not None:  # DistilBERT has none
            x = x + (self.token_type.weight[0] if types is None else self.token_type(types))
        return self.norm(x)


class Attention(nn.Module):
    """Self-attention with one fused QKV projection, then output projection (no norm)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, backend: AttentionBackend, state: Any) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, heads, D]
        q, k, v = qkv.unbind(1)  # each [T, heads, D]
        o = backend.attend(q, k, v, state)  # [T, heads, D]
        return self.out(o.reshape(tokens, self.num_heads * self.head_dim))  # [T, H]


class MLP(nn.Module):
    float_under_int8 = True  # --quantize int8 keeps both projections float (rose/int8.py)

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    @property
    def act_fused(self) -> bool:
        """True when `up` applies the activation itself (a packed layer with it fused)."""
        return getattr(self.up, "activation", "none") != "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # [T, I]
        return self.down(h if self.act_fused else self.act(h))  # [T, H]


class Layer(nn.Module):
    """Post-norm transformer layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, backend: AttentionBackend, state: Any) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, backend, state))
        return self.mlp_norm(x + self.mlp(x))


class BertEncoder(nn.Module):
    """Embeddings and layers: ragged ids [T] → hidden states [T, H]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        backend: AttentionBackend,
        state: Any,
    ) -> torch.Tensor:
        x = self.embeddings(ids, positions, types)  # [T, H]
        for layer in self.layers:
            x = layer(x, backend, state)
        return x


class ClassificationHead(nn.Module):
    """CLS hidden state [B, H] → logits [B, num_labels]: dense, activation, projection.

    For BERT the dense layer is the checkpoint's pooler and the projection its classifier;
    for the RoBERTa layout both live in the checkpoint's classifier head (tanh between
    them); DistilBERT's are pre_classifier and classifier with a ReLU between them.
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.act = torch.relu if cfg.family == "distilbert" else torch.tanh

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.dense(cls_hidden)))  # [B, num_labels]


class MaskedLMHead(nn.Module):
    """The masked-LM head, hidden [N, H] → logits [N, V]: dense, activation, LayerNorm, then
    the decoder, whose weight is the word embeddings (tied) plus a bias of its own.

    BertForMaskedLM (``cls.predictions``) and DistilBertForMaskedLM (``vocab_transform``,
    ``vocab_layer_norm``, ``vocab_projector``) use config.json's activation; the RoBERTa
    layout's ``lm_head`` uses exact GELU. SPLADE's sparse output reads these logits."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act if cfg.family != "roberta" else "gelu"]
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.act(self.dense(hidden)))  # [N, H]
        return F.linear(x, word_embeddings, self.bias)  # [N, V]


# -- weights ---------------------------------------------------------------------------------


# Layer n's checkpoint names per layout: (layer prefix, then our sublayer → theirs; the fused
# QKV projection reads three).
_LAYER_NAMES: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "bert": (
        "encoder.layer.{n}.",
        {
            "attention.qkv": tuple(f"attention.self.{p}" for p in ("query", "key", "value")),
            "attention.out": ("attention.output.dense",),
            "attention_norm": ("attention.output.LayerNorm",),
            "mlp.up": ("intermediate.dense",),
            "mlp.down": ("output.dense",),
            "mlp_norm": ("output.LayerNorm",),
        },
    ),
    "distilbert": (
        "transformer.layer.{n}.",
        {
            "attention.qkv": tuple(f"attention.{p}_lin" for p in "qkv"),
            "attention.out": ("attention.out_lin",),
            "attention_norm": ("sa_layer_norm",),
            "mlp.up": ("ffn.lin1",),
            "mlp.down": ("ffn.lin2",),
            "mlp_norm": ("output_layer_norm",),
        },
    ),
}
_LAYER_NAMES["roberta"] = _LAYER_NAMES["bert"]


def expected_weights(cfg: BertConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Our parameter name → (checkpoint names, without the encoder prefix, concatenated along
    dim 0; the parameter's shape). The checkpoint must hold exactly these (plus ignorables)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    m: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
        "encoder.embeddings.word.weight": (
            ("embeddings.word_embeddings.weight",),
            (cfg.vocab_size, h),
        ),
        "encoder.embeddings.position.weight": (
            ("embeddings.position_embeddings.weight",),
            (cfg.max_position_embeddings, h),
        ),
        "encoder.embeddings.norm.weight": (("embeddings.LayerNorm.weight",), (h,)),
        "encoder.embeddings.norm.bias": (("embeddings.LayerNorm.bias",), (h,)),
    }
    if cfg.embeds_token_types:
        m["encoder.embeddings.token_type.weight"] = (
            ("embeddings.token_type_embeddings.weight",),
            (cfg.type_vocab_size, h),
        )
    shapes = {
        "attention.qkv": (3 * h, h),
        "attention.out": (h, h),
        "attention_norm": (h,),
        "mlp.up": (i, h),
        "mlp.down": (h, i),
        "mlp_norm": (h,),
    }
    layer, names = _LAYER_NAMES[cfg.family]
    for n in range(cfg.num_layers):
        src, dst = layer.format(n=n), f"encoder.layers.{n}."
        for ours, theirs in names.items():
            weight = shapes[ours]
            m[f"{dst}{ours}.weight"] = (tuple(f"{src}{t}.weight" for t in theirs), weight)
            m[f"{dst}{ours}.bias"] = (tuple(f"{src}{t}.bias" for t in theirs), weight[:1])
    return m


def _head_weights(
    cfg: BertConfig, prefix: str
) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Head parameters by their full checkpoint names (heads sit outside the encoder prefix)."""
    h, n = cfg.hidden_size, cfg.num_labels
    dense, proj = {
        "bert": (f"{prefix}pooler.dense", "classifier"),
        "roberta": ("classifier.dense", "classifier.out_proj"),
        "distilbert": ("pre_classifier", "classifier"),
    }[cfg.family]
    return {
        "head.dense.weight": ((f"{dense}.weight",), (h, h)),
        "head.dense.bias": ((f"{dense}.bias",), (h,)),
        "head.proj.weight": ((f"{proj}.weight",), (n, h)),
        "head.proj.bias": ((f"{proj}.bias",), (n,)),
    }


def _mlm_weights(cfg: BertConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Masked-LM head parameters by their full checkpoint names (the decoder weight is the
    word embeddings; a saved copy of it is checked to be that, see `load_weights`)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    dense, norm, bias = {
        "bert": (
            "cls.predictions.transform.dense",
            "cls.predictions.transform.LayerNorm",
            "cls.predictions.bias",
        ),
        "roberta": ("lm_head.dense", "lm_head.layer_norm", "lm_head.bias"),
        "distilbert": ("vocab_transform", "vocab_layer_norm", "vocab_projector.bias"),
    }[cfg.family]
    return {
        "mlm.dense.weight": ((f"{dense}.weight",), (h, h)),
        "mlm.dense.bias": ((f"{dense}.bias",), (h,)),
        "mlm.norm.weight": ((f"{norm}.weight",), (h,)),
        "mlm.norm.bias": ((f"{norm}.bias",), (h,)),
        "mlm.bias": ((bias,), (v,)),
    }


_MLM_DECODERS = {
    "bert": "cls.predictions.decoder",
    "roberta": "lm_head.decoder",
    "distilbert": "vocab_projector",
}


def _with_legacy_norm_names(
    tensors: Mapping[str, torch.Tensor], wanted: set[str]
) -> dict[str, torch.Tensor]:
    """Old TF-converted checkpoints call LayerNorm parameters gamma/beta: accept those
    spellings for the LayerNorm names we expect (and only those)."""
    out = dict(tensors)
    for name in wanted:
        for new, old in (
            ("LayerNorm.weight", "LayerNorm.gamma"),
            ("LayerNorm.bias", "LayerNorm.beta"),
        ):
            if name.endswith(new) and name not in out:
                legacy = name[: -len(new)] + old
                if legacy in out:
                    out[name] = out.pop(legacy)
    return out


def load_weights(cfg: BertConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors to this module tree's state dict; raise EngineError on any
    missing, unexpected or misshapen weight."""
    anchor = "embeddings.word_embeddings.weight"
    prefixes = [p for p in _ENCODER_PREFIXES if p + anchor in tensors]
    if len(prefixes) != 1:
        raise EngineError(
            f"weights: expected exactly one of {[p + anchor for p in _ENCODER_PREFIXES]}, found {len(prefixes)}"
        )
    prefix = prefixes[0]
    spec = {
        dst: (tuple(prefix + s for s in srcs), shape)
        for dst, (srcs, shape) in expected_weights(cfg).items()
    }
    if cfg.classifier:
        spec.update(_head_weights(cfg, prefix))
    if cfg.mlm_head:
        spec.update(_mlm_weights(cfg))
    used = {s for srcs, _ in spec.values() for s in srcs}
    tensors = _with_legacy_norm_names(tensors, used)
    missing = sorted(s for s in used if s not in tensors)
    if missing:
        raise EngineError(f"weights: missing {len(missing)} tensors, e.g. {missing[:5]}")
    optional = {prefix + "pooler.dense.weight", prefix + "pooler.dense.bias"}
    unexpected = sorted(
        k
        for k in tensors
        if k not in used
        and k not in optional
        and not k.startswith(_IGNORED_PREFIXES)
        and k.removeprefix(prefix) not in _IGNORED_NAMES
    )
    if unexpected:
        raise EngineError(f"weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    state: dict[str, torch.Tensor] = {}
    for dst, (srcs, shape) in spec.items():
        parts = [tensors[s] for s in srcs]
        if len(parts) > 1 and any(
            tuple(p.shape) != (shape[0] // len(parts), *shape[1:]) for p in parts
        ):
            raise EngineError(
                f"weights: {', '.join(srcs)} do not each have shape {(shape[0] // len(parts), *shape[1:])}"
            )
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(value.shape) != shape:
            raise EngineError(
                f"weights: {'+'.join(srcs)} has shape {tuple(value.shape)}, expected {shape}"
            )
        state[dst] = value
    if cfg.mlm_head:
        _check_tied_decoder(cfg, tensors, state["encoder.embeddings.word.weight"])
    return state


def _check_tied_decoder(
    cfg: BertConfig, tensors: Mapping[str, torch.Tensor], words: torch.Tensor
) -> None:
    """A saved decoder weight must be the word embeddings (the head ties them)."""
    decoder = _MLM_DECODERS[cfg.family]
    weight = tensors.get(f"{decoder}.weight")
    if weight is not None and not torch.equal(weight, words):
        raise EngineError(
            f"weights: {decoder}.weight differs from the word embeddings; only a tied "
            "masked-LM decoder is supported"
        )


class BertFamilyModel(FamilyModule):
    """The encoder plus, for cross-encoders, the classification head."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = BertEncoder(cfg)
        self.head = ClassificationHead(cfg) if cfg.classifier else None
        self.mlm = MaskedLMHead(cfg) if cfg.mlm_head else None

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → masked-LM logits [N, V] (models loaded with the head only)."""
        assert self.mlm is not None
        return self.mlm(hidden, self.encoder.embeddings.word.weight)

    def pack_weights(self, batch_hint: int = 512) -> int:
        """Run every linear layer on oneDNN-packed weights with the MLP activation fused
        (`rose.packed`); returns how many layers were packed (0 off CPU). Inference only."""
        fused = _PACKED_ACTIVATIONS.get(self.cfg.hidden_act)
        names = {}
        if fused is not None:
            names = {f"encoder.layers.{i}.mlp.up": fused for i in range(self.cfg.num_layers)}
        return pack_linears(self, batch_hint, names)


def position_ids(cfg: BertConfig, ids: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
    """[T] int64 absolute positions per row, as the reference models number them.

    BERT, DistilBERT: 0, 1, 2, ... The RoBERTa layout: padding_idx + 1, + 2, ... counting
    only non-padding tokens; padding tokens themselves sit at padding_idx (fairseq's
    make_positions).
    """
    lengths = np.diff(cu_seqlens).astype(np.int64)
    starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)  # [T]
    if cfg.family != "roberta":
        return np.arange(ids.size, dtype=np.int64) - starts
    real = (ids != cfg.pad_token_id).astype(np.int64)  # [T]
    running = np.cumsum(real)  # [T]
    before_row = np.concatenate(([0], running))[starts]  # [T] count before the row's first token
    return (running - before_row) * real + cfg.pad_token_id


FAMILY = Family(engine_config, BertFamilyModel, load_weights, position_ids)
