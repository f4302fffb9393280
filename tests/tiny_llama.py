"""A tiny random Llama target and random prompts for it, shared by the MTP tests
(`test_generate_mtp.py`, `test_mtp_features.py`): fast enough to train a head on in a test."""

from __future__ import annotations

import torch

from rose.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["HIDDEN", "VOCAB", "random_prompts", "tiny_target"]

VOCAB = 128
HIDDEN = 64


def tiny_target() -> LlamaForCausalLM:
    """4 layers, width 64, grouped-query attention; seeded, so every call is the same model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return LlamaForCausalLM(cfg).eval()


def random_prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts of 6-16 random token ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (6 + i % 11,), generator=g).tolist() for i in range(n)]
