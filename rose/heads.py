"""Outputs beside the pooled dense vector, computed from one pass's hidden states [T, H].

Output kinds (`OUTPUT_KINDS`), chosen per row of a `RaggedBatch`:

  dense         the pooled vector (`rose.pooling`); every embedding row gets it
  sparse        token id -> weight, max over the row's tokens:
                  BGE-M3   relu(sparse_linear(h_t)), special tokens (cls/eos/pad/unk) dropped
                  SPLADE   log(1 + relu(MLM logits)) over the vocabulary (sentence-transformers'
                           ``MLMTransformer`` + ``SpladePooling``)
  multi_vector  BGE-M3's ColBERT vectors: normalize(colbert_linear(h_t)) for every token but
                the first ([CLS] is dropped, the final </s> kept, as FlagEmbedding does)
  token_states  the raw last hidden states, one per token

BGE-M3 ships its heads as ``sparse_linear.pt`` and ``colbert_linear.pt`` (PyTorch state
dicts of `nn.Linear`) beside the XLM-R weights; `read_bge_m3_heads` loads them with asserted
key sets and shapes. SPLADE's head is the family's masked-LM head (``mlm_logits``).

Ragged results are `rose.lazy.RaggedRows` on the host.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rose.batch import OUTPUT_KINDS
from rose.errors import EngineError
from rose.lazy import RaggedRows

__all__ = [
    "EXTRA_KINDS",
    "OUTPUT_KINDS",
    "BgeM3Heads",
    "read_bge_m3_heads",
    "read_special_ids",
    "sparse_max",
]

EXTRA_KINDS = frozenset(OUTPUT_KINDS[1:])  # what a row asks for beyond its dense vector

_SPARSE_FILE = "sparse_linear.pt"
_COLBERT_FILE = "colbert_linear.pt"
_LINEAR_KEYS = frozenset({"weight", "bias"})
# FlagEmbedding drops these tokens from BGE-M3's sparse weights (its `unused_tokens`).
_SPARSE_DROPPED = ("cls_token", "eos_token", "pad_token", "unk_token")
_SPLADE_CHUNK_TOKENS = 256  # MLM logits [chunk, V] at a time: bounded memory


def _linear_state(path: Path, hidden: int, out: int | None) -> dict[str, torch.Tensor]:
    """An `nn.Linear(hidden, out)` state dict from `path` (out None: any width)."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise EngineError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or set(state) != _LINEAR_KEYS:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise EngineError(f"{path}: expected exactly the keys ['bias', 'weight'], got {keys}")
    weight, bias = state["weight"], state["bias"]
    width = out if out is not None else int(weight.shape[0]) if weight.dim() == 2 else -1
    if tuple(weight.shape) != (width, hidden) or tuple(bias.shape) != (width,):
        raise EngineError(
            f"{path}: weight {tuple(weight.shape)} / bias {tuple(bias.shape)}, expected "
            f"({'out' if out is None else out}, {hidden}) / ({'out' if out is None else out},)"
        )
    return {"weight": weight, "bias": bias}


class BgeM3Heads(nn.Module):
    """BGE-M3's extra heads on the encoder's hidden states (either may be absent)."""

    def __init__(self, hidden: int, sparse: bool, colbert_dim: int | None) -> None:
        super().__init__()
        self.sparse_linear = nn.Linear(hidden, 1) if sparse else None
        self.colbert_linear = nn.Linear(hidden, colbert_dim) if colbert_dim else None


def read_bge_m3_heads(model_dir: Path, hidden: int) -> BgeM3Heads | None:
    """The heads whose files sit in `model_dir`, weights assigned; None when neither does."""
    sparse_path, colbert_path = model_dir / _SPARSE_FILE, model_dir / _COLBERT_FILE
    if not sparse_path.exists() and not colbert_path.exists():
        return None
    sparse = _linear_state(sparse_path, hidden, 1) if sparse_path.exists() else None
    colbert = _linear_state(colbert_path, hidden, None) if colbert_path.exists() else None
    heads = BgeM3Heads(
        hidden, sparse is not None, None if colbert is None else int(colbert["weight"].shape[0])
    )
    state = {f"sparse_linear.{k}": v for k, v in (sparse or {}).items()}
    state.update({f"colbert_linear.{k}": v for k, v in (colbert or {}).items()})
    heads.load_state_dict(state, strict=True)
    return heads


def read_special_ids(model_dir: Path) -> frozenset[int]:
    """Ids of the tokenizer's cls/eos/pad/unk tokens (those BGE-M3's sparse output drops):
    names from tokenizer_config.json / special_tokens_map.json, ids from tokenizer.json."""
    names: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        raw = _json(model_dir / file)
        for key in _SPARSE_DROPPED:
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                names.setdefault(key, value)
    tokenizer = _json(model_dir / "tokenizer.json")
    if not tokenizer:
        raise EngineError(f"{model_dir}: BGE-M3's sparse head needs tokenizer.json (special ids)")
    vocab: dict[str, int] = {}
    model = tokenizer.get("model") or {}
    raw_vocab = model.get("vocab")
    if isinstance(raw_vocab, dict):
        vocab.update({str(k): int(v) for k, v in raw_vocab.items()})
    elif isinstance(raw_vocab, list):  # Unigram: [[piece, score], ...] by id
        vocab.update({str(entry[0]): i for i, entry in enumerate(raw_vocab)})
    for token in tokenizer.get("added_tokens") or ():
        vocab[str(token["content"])] = int(token["id"])
    if not names:  # no tokenizer config: the added tokens marked special
        return frozenset(
            int(t["id"]) for t in tokenizer.get("added_tokens") or () if t.get("special")
        )
    missing = sorted(n for n in names.values() if n not in vocab)
    if missing:
        raise EngineError(f"{model_dir}: special tokens {missing} are not in tokenizer.json")
    return frozenset(vocab[n] for n in names.values())


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: cannot read JSON ({exc})") from None
    return raw if isinstance(raw, dict) else {}


def sparse_max(
    rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, vocab: int, num_rows: int
) -> RaggedRows:
    """Per row, each token id's largest positive weight (BGE-M3's sparse output).

    rows, ids, weights: [P] (a token's row, its id, its weight). Returns `RaggedRows` with
    indices ascending within each row."""
    keep = weights > 0
    key = rows[keep] * vocab + ids[keep]  # [K] one key per (row, token id)
    unique, inverse = torch.unique(key, return_inverse=True)  # sorted: by row, then id
    values = torch.zeros(unique.numel(), dtype=torch.float32, device=weights.device)
    values.scatter_reduce_(0, inverse, weights[keep].float(), "amax", include_self=False)
    counts = torch.bincount(unique // vocab, minlength=num_rows)
    return RaggedRows(
        counts=counts.cpu().numpy().astype(np.int64),
        values=values.cpu().numpy(),
        indices=(unique % vocab).cpu().numpy().astype(np.int64),
    )


def splade_max(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    num_rows: int,
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> RaggedRows:
    """SPLADE: per row, max over its tokens of log(1 + relu(MLM logits)) [V], nonzeros only.

    hidden: [P, H] the asking rows' tokens; rows: [P] their row numbers; `logits` maps
    [n, H] hidden states to [n, V] MLM logits (computed a chunk of tokens at a time)."""
    pooled: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], _SPLADE_CHUNK_TOKENS):
        part = logits(hidden[start : start + _SPLADE_CHUNK_TOKENS]).float()  # [n, V]
        weights = torch.log1p(torch.relu(part))
        if pooled is None:
            pooled = weights.new_zeros(num_rows, weights.shape[1])  # [B, V]
        where = rows[start : start + _SPLADE_CHUNK_TOKENS, None].expand_as(weights)  # [n, V]
        pooled.scatter_reduce_(0, where, weights, "amax", include_self=True)
    assert pooled is not None
    row, index = pooled.nonzero(as_tuple=True)  # row-major: by row, then id
    counts = torch.bincount(row, minlength=num_rows)
    return RaggedRows(
        counts=counts.cpu().numpy().astype(np.int64),
        values=pooled[row, index].cpu().numpy(),
        indices=index.cpu().numpy().astype(np.int64),
    )


def token_rows(vectors: torch.Tensor, rows: torch.Tensor, num_rows: int) -> RaggedRows:
    """Per-token vectors [P, D] of rows `rows` [P] (ascending) as `RaggedRows` (float32)."""
    counts = torch.bincount(rows, minlength=num_rows)
    return RaggedRows(
        counts=counts.cpu().numpy().astype(np.int64), values=vectors.float().cpu().numpy()
    )


def colbert_vectors(heads: BgeM3Heads, hidden: torch.Tensor) -> torch.Tensor:
    """BGE-M3's multi-vectors of tokens [P, H] → [P, D], L2-normalized."""
    assert heads.colbert_linear is not None
    return F.normalize(heads.colbert_linear(hidden).float(), p=2.0, dim=-1)
