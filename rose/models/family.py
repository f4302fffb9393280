"""`Family`: the entry points of one encoder family, and `EncoderConfig`, what `rose.Engine`
reads from a family's config. The contract is described in `rose.models`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

__all__ = [
    "EncoderConfig",
    "EncoderDefaults",
    "Family",
    "FamilyModule",
    "FamilyOptions",
    "row_positions",
]


@dataclass(frozen=True)
class FamilyOptions:
    """What a family's config builder gets besides config.json.

    attention_mode: `EngineConfig.attention_mode` ("auto" | "causal" | "bidirectional").
    score_tokens: (true token id, false token id or None) when the directory's
        sentence-transformers modules end in a ``LogitScore`` (a causal LM used as a
        reranker: one logit, the true token's LM logit minus the false token's); else None.
    lm_head: the directory's sentence-transformers modules end in ``SpladePooling``: load
        the masked-LM head too, as ``mlm_logits(hidden [N, H]) -> [N, V]`` on the model
        (families without one leave it out; the engine then refuses the directory).
    A family raises EngineError for an option it cannot honour.
    """

    attention_mode: str = "auto"
    score_tokens: tuple[int, int | None] | None = None
    lm_head: bool = False


class EncoderConfig(Protocol):
    """What `Engine` reads from a family's config."""

    vocab_size: int
    hidden_size: int  # the embedding dimensions
    num_heads: int
    type_vocab_size: int  # 1: token types must be absent or all 0
    classifier: bool  # a cross-encoder: `classify` gives [B, num_labels] logits
    num_labels: int  # 0 unless classifier
    pad_token_id: int  # graph padding token

    @property
    def num_kv_heads(self) -> int: ...  # < num_heads: grouped-query attention

    @property
    def head_dim(self) -> int: ...

    @property
    def max_input_tokens(self) -> int: ...

    @property
    def position_offset(self) -> int: ...  # position of graph padding tokens

    @property
    def causal(self) -> bool: ...  # the attention mode, resolved

    @property
    def default_pooling(self) -> str: ...  # "mean" | "cls" | "last" without a Pooling module


@dataclass(frozen=True)
class Family:
    """One encoder family's entry points; each family module defines its ``FAMILY``."""

    config: Callable[[Mapping[str, Any], FamilyOptions], Any]  # (config.json, options) → cfg
    model: Callable[[Any], nn.Module]  # cfg → module with encode / classify / pack_weights
    load_weights: Callable[[Any, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    position_ids: Callable[[Any, np.ndarray, np.ndarray], np.ndarray]  # (cfg, ids, cu) → [T]


class EncoderDefaults:
    """What most bidirectional encoder configs say alike, mixed into their dataclasses
    (which override what differs): every head has its own keys and values, no causal
    mask, mean pooling without a Pooling module (as sentence-transformers wraps a plain
    transformers model), and graph padding at position 0."""

    hidden_size: int
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def causal(self) -> bool:
        return False

    @property
    def default_pooling(self) -> str:
        return "mean"

    @property
    def position_offset(self) -> int:
        return 0


class FamilyModule(nn.Module):
    """Base of the families' models: `head` (None for embedders) reads each row's first
    token, as BERT-style cross-encoders do (families that pool otherwise override
    `classify`), and every linear layer can run on oneDNN-packed weights."""

    head: nn.Module | None

    def classify(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, seg_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H] → logits [B, num_labels] from each row's first token."""
        assert self.head is not None
        return self.head(hidden[cu_seqlens[:-1].clamp(max=hidden.shape[0] - 1)])

    def pack_weights(self, batch_hint: int = 512) -> int:
        """Run the linear layers on oneDNN-packed weights (`rose.packed`); returns how many."""
        from rose.packed import pack_linears

        return pack_linears(self, batch_hint)


def row_positions(cfg: object, ids: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
    """`Family.position_ids` of the families that number tokens 0, 1, 2, ... within each
    row (RoPE and relative positions; `rose.models.rows` reads the rows back from them):
    [T] int64 for ragged ids [T] with row offsets cu_seqlens [B+1]."""
    del cfg
    lengths = np.diff(cu_seqlens).astype(np.int64)
    starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)  # [T]
    return np.arange(ids.size, dtype=np.int64) - starts
