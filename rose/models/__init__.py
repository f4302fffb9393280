"""Model families, one module each (plain PyTorch, weights through explicit name maps).

The encoder `rose.Engine` serves every family in `FAMILIES` (config.json ``model_type`` →
`Family`), chosen once when a model directory loads; the decoders of `rose.generate` load
`rose.models.llama` themselves. Adding an encoder family is one module that defines
``FAMILY = Family(config, model, load_weights, position_ids)`` and one line in `FAMILIES`.

The family contract, i.e. all that `Engine` asks of a family::

    Family.config(raw, options) -> cfg
        raw: config.json as a dict; options: `FamilyOptions` (the attention mode asked for
        by `EngineConfig.attention_mode`, a sentence-transformers LogitScore's token ids); a
        family that cannot honour them raises. Raises EngineError naming the offending key. `cfg` is a frozen dataclass with at least the
        fields of `EncoderConfig` below.
    Family.model(cfg) -> nn.Module (built on the meta device; weights are assigned) with
        cfg                     the config it was built from
        encoder(ids [T], positions [T], types [T] | None, backend, state) -> hidden [T, H]
            a submodule; the ragged batch as `Engine` lays it out: rows concatenated, no
            padding; attention through `backend.attend(q, k, v, state)` (`rose.attention`),
            whose causality the engine set from ``cfg.causal`` (a family whose attention
            the backend cannot express may run its own SDPA, see `rose.models.rows`).
        classify(hidden [T, H], cu_seqlens [B+1], seg_ids [T]) -> logits [B, num_labels]
            cross-encoders only (``cfg.classifier``); raw logits, no activation.
        pack_weights() -> int   CPU oneDNN packing (`rose.packed`); may return 0.
    Family.load_weights(cfg, tensors) -> state dict for ``load_state_dict(strict=True)``
        through an explicit name map; raises EngineError on any missing, unexpected or
        misshapen tensor.
    Family.position_ids(cfg, ids [T], cu_seqlens [B+1]) -> [T] int64 (numpy, host side)

Graph padding tokens (CUDA graph buckets) get ``cfg.pad_token_id`` at position
``cfg.position_offset`` in a row of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rose.errors import EngineError
from rose.models import bert, deberta, gemma3, modernbert, mpnet, qwen3, t5
from rose.models.family import EncoderConfig, Family, FamilyOptions

__all__ = ["FAMILIES", "EncoderConfig", "Family", "FamilyOptions", "family_for"]

# config.json model_type → family; one line per family.
FAMILIES: dict[str, Family] = {
    "bert": bert.FAMILY,
    "xlm-roberta": bert.FAMILY,
    "roberta": bert.FAMILY,
    "camembert": bert.FAMILY,
    "distilbert": bert.FAMILY,
    "qwen3": qwen3.FAMILY,
    "bidirectional_pplx_qwen3": qwen3.FAMILY,  # pplx-embed
    "qwen2": qwen3.FAMILY,  # gte-Qwen2 (Qwen2 generators load in rose.models.llama)
    "llama": qwen3.FAMILY,
    "mistral": qwen3.FAMILY,  # e5-mistral
    "mpnet": mpnet.FAMILY,
    "deberta-v2": deberta.FAMILY,
    "modernbert": modernbert.FAMILY,
    "gemma3_text": gemma3.FAMILY,  # EmbeddingGemma
    "t5": t5.FAMILY,  # sentence-t5, GTR (the encoder of a T5 checkpoint)
    "mt5": t5.FAMILY,
}


def family_for(raw: Mapping[str, Any]) -> Family:
    """The family of a config.json. One without ``model_type`` (old BERT exports) goes to the
    BERT family, which decides from ``architectures``."""
    model_type = raw.get("model_type", "bert")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise EngineError(
            f"config.json: unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return family
