"""Small random configs shared by the tests that hold ROSE to `transformers` (fp32 parity,
CPU precision modes, generation). Wide enough weights that outputs differ per token. Also
what the end-to-end chat tests build their tiny decoders from: a byte-level BPE tokenizer
trained here (`byte_bpe`), spread weights (`spread_decoder`), and conversations as a chat
template takes them (`template_messages`)."""

from __future__ import annotations

import json
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


def byte_bpe(
    path: Path, corpus: list[str], specials: list[str], vocab_size: int, **config: object
) -> int:
    """A byte-level BPE ``tokenizer.json`` trained on ``corpus`` (the ``specials`` first:
    each one's id is its index) and a ``tokenizer_config.json`` of ``config`` (a
    ``PreTrainedTokenizerFast``) in ``path``; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok.get_vocab_size()


def chat_decoder(config: type[transformers.PretrainedConfig], vocab: int, **over: object) -> Any:  # noqa: ANN401
    """A `transformers` causal LM of ``config``'s family at the end-to-end chat tests'
    size (2 layers, 64 wide, 4 heads over 2 K/V heads), ``over`` on top, its weights
    spread (`spread_decoder`)."""
    kw: dict[str, object] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = transformers.AutoModelForCausalLM.from_config(config(**{**kw, **over}))
    spread_decoder(model)
    return model


def spread_decoder(model: torch.nn.Module) -> None:
    """Larger random weights than HF's init (attention far from uniform) and norms away
    from 1, so a tiny decoder's greedy answers differ per prompt."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.2)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as vLLM hands it to a chat template (and so does Ivy): each tool
    call's ``arguments`` parsed to an object."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def greedy(model: Any, tokenizer: Any, ids: list[int], max_new: int) -> tuple[list[int], str, str]:  # noqa: ANN401
    """`transformers`' greedy ``generate`` from ``ids``: (new ids without the EOS, their
    text, finish reason "stop" at the model's EOS else "length")."""
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=eos,
        )
    new = out[0, len(ids) :].tolist()
    finish = "length"
    if eos in new:
        new, finish = new[: new.index(eos)], "stop"
    return new, tokenizer.decode(new, skip_special_tokens=True), finish
