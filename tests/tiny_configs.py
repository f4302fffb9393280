"""Small random configs shared by the tests that hold ROSE to `transformers` (fp32 parity,
CPU precision modes, generation). Wide enough weights that outputs differ per token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 120


def bert(**extra: object) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=96,
        type_vocab_size=2,
        **extra,
    )


def xlmr(**extra: object) -> transformers.XLMRobertaConfig:
    return transformers.XLMRobertaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        intermediate_size=80,
        max_position_embeddings=98,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        hidden_act="gelu_new",
        **extra,
    )


def roberta(**extra: object) -> transformers.RobertaConfig:
    """RoBERTa's layout with RoBERTa's defaults (pad 1, exact GELU, one token type)."""
    return transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=98,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        **extra,
    )


def distilbert(**extra: object) -> transformers.DistilBertConfig:
    """DistilBERT's own config keys (dim, n_layers, n_heads, hidden_dim, activation)."""
    return transformers.DistilBertConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=3,
        n_heads=4,
        hidden_dim=112,
        max_position_embeddings=96,
        activation="gelu",
        **extra,
    )


def llama(**over: object) -> transformers.LlamaConfig:
    kw: dict[str, object] = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,  # logits spread out: no near ties in argmax or top-k
    )
    kw.update(over)
    return transformers.LlamaConfig(**kw)


def llama_pair(path: Path, seed: int = 0, **over: object) -> tuple[torch.nn.Module, Any]:
    """A random `transformers` Llama (seeded) and the same weights loaded by ROSE, saved
    through ``path``: (reference, `rose.models.llama.LlamaForCausalLM`)."""
    from rose.models.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    ref = transformers.LlamaForCausalLM(llama(**over)).eval()
    ref.save_pretrained(path, safe_serialization=True)
    return ref, LlamaForCausalLM.from_pretrained(path).eval()


DOOMED_SEED = 13  # `fail_draws_of_seed`: requests with this seed fail their draw


def fail_draws_of_seed(monkeypatch: Any, seed: int = DOOMED_SEED) -> None:  # noqa: ANN401
    """Make `rose.generate`'s acceptance raise, as NaN probabilities once made
    torch.multinomial do, for requests sampled with ``seed`` only."""
    import rose.generate as generate

    real = generate.accept

    def draw(proposal, logits, argmax, params, generator):  # noqa: ANN001, ANN202
        if params.seed == seed:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(proposal, logits, argmax, params, generator)

    monkeypatch.setattr(generate, "accept", draw)
