"""Small random BERT / XLM-R configs shared by the tests that hold ROSE to `transformers`
(fp32 parity, CPU precision modes). Wide enough weights that outputs differ per token."""

from __future__ import annotations

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
