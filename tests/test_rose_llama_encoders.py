"""ROSE's encoders for the rest of Qwen3's lineage (Qwen2, Llama, Mistral: gte-Qwen2,
e5-mistral, SFR-Embedding and the like) against `transformers` on tiny random-weight models
(fp32, CPU), loaded through `Engine.load` from ``save_pretrained`` directories.

What each layout changes is what is covered: Qwen2's q/k/v bias without one on the output
projection, Llama's ``attention_bias`` on all four and a ``head_dim`` other than hidden /
heads, Mistral's sliding window (the input cap), none of them with Qwen3's q/k norm.
References: ``{Qwen2,Llama,Mistral}Model`` as it runs (causal) and given an all-zeros
additive 4-D mask (bidirectional, ``is_causal: false`` in config.json), and the
``*ForSequenceClassification`` heads. Tolerance 1e-4, as for Qwen3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_rose_qwen3 import _reference, _reference_last_token_batch, _rows

from rose import Engine, EngineConfig, EngineError, RaggedBatch
from rose.assets.layout import write_pooling
from rose.models import FAMILIES
from tulip.generation import is_generator

VOCAB = 1000
ATOL = 1e-4
WINDOW = 64  # the Mistral config's sliding window: the longest row in `_rows`


def _common() -> dict[str, object]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    }


CONFIGS = {
    "qwen2": lambda **x: transformers.Qwen2Config(**_common(), **x),
    "llama": lambda **x: transformers.LlamaConfig(
        **_common(), attention_bias=True, head_dim=24, **x
    ),
    "mistral": lambda **x: transformers.MistralConfig(**_common(), sliding_window=WINDOW, **x),
}
BASES = {
    "qwen2": transformers.Qwen2Model,
    "llama": transformers.LlamaModel,
    "mistral": transformers.MistralModel,
}
LMS = {
    "qwen2": transformers.Qwen2ForCausalLM,
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}
CLASSIFIERS = {
    "qwen2": transformers.Qwen2ForSequenceClassification,
    "llama": transformers.LlamaForSequenceClassification,
    "mistral": transformers.MistralForSequenceClassification,
}
TYPES = tuple(CONFIGS)


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    torch.manual_seed(31)
    return {t: BASES[t](CONFIGS[t]()).eval() for t in TYPES}


def test_the_lineage_is_one_family() -> None:
    assert FAMILIES["qwen2"] is FAMILIES["llama"] is FAMILIES["mistral"] is FAMILIES["qwen3"]


@pytest.mark.parametrize("model_type", TYPES)
def test_last_token_embeddings_match_transformers(bases, tmp_path: Path, model_type: str) -> None:
    """gte-Qwen2 / e5-mistral's use: causal attention, last-token pooling, normalized."""
    model = bases[model_type]
    model.save_pretrained(tmp_path)
    write_pooling(tmp_path, 64, "lasttoken", normalize=True)
    engine = Engine.load(tmp_path)
    assert (engine.info.kind, engine.info.default_pooling) == ("embedding", "last")
    assert engine.attention.causal
    rows = _rows(1)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()  # [B, H]
    want = torch.nn.functional.normalize(_reference_last_token_batch(model, rows), dim=-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    alone = torch.cat([engine.step(RaggedBatch.from_lists([r])).wait() for r in rows])
    torch.testing.assert_close(alone, got, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", TYPES)
def test_bidirectional_mean_embeddings_match_transformers(
    bases, tmp_path: Path, model_type: str
) -> None:
    """``is_causal: false`` (transformers >= 5.2's switch; LLM2Vec-style exports) makes the
    same weights attend over the whole row, pooled by the mean without Pooling files."""
    model = bases[model_type]
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, is_causal=False)
    engine = Engine.load(tmp_path)
    assert not engine.attention.causal and engine.info.default_pooling == "mean"
    rows = _rows(2)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()
    for i, row in enumerate(rows):
        torch.testing.assert_close(
            got[i], _reference(model, row, causal=False).mean(0), atol=ATOL, rtol=0
        )
    causal_mean = _reference(model, rows[3], causal=True).mean(0)  # the reference differs
    assert (got[3] - causal_mean).abs().max().item() > 1e-2


@pytest.mark.parametrize("model_type", TYPES)
def test_causal_lm_checkpoint_with_pooling_is_an_embedder(tmp_path: Path, model_type: str) -> None:
    """e5-mistral ships ``MistralForCausalLM``-named directories with sentence-transformers
    modules: an embedder (the LM head unused), while the same name without modules.json is
    a chat model for the generator."""
    torch.manual_seed(5)
    lm = LMS[model_type](CONFIGS[model_type](tie_word_embeddings=False)).eval()
    lm.save_pretrained(tmp_path)
    if model_type != "mistral":  # no Mistral generator: always an encoder
        assert is_generator(tmp_path)
    write_pooling(tmp_path, 64, "lasttoken")
    assert not is_generator(tmp_path)
    engine = Engine.load(tmp_path)
    rows = _rows(3)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()
    torch.testing.assert_close(got, _reference_last_token_batch(lm.model, rows), atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", TYPES)
def test_sequence_classifier_logits_match_transformers(tmp_path: Path, model_type: str) -> None:
    torch.manual_seed(8)
    ce = CLASSIFIERS[model_type](CONFIGS[model_type](num_labels=1, pad_token_id=0)).eval()
    ce.save_pretrained(tmp_path)
    engine = Engine.load(tmp_path)
    assert (engine.info.kind, engine.info.num_labels) == ("cross-encoder", 1)
    rows = _rows(8)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()
    with torch.no_grad():
        want = torch.cat([ce(input_ids=torch.tensor([r])).logits for r in rows])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_mistral_inputs_are_capped_at_the_sliding_window(bases, tmp_path: Path) -> None:
    bases["mistral"].save_pretrained(tmp_path)
    engine = Engine.load(tmp_path)
    assert engine.info.max_input_tokens == WINDOW
    with pytest.raises(EngineError, match=f"takes at most {WINDOW}"):
        engine.step(RaggedBatch.from_lists([list(range(1, WINDOW + 2))]))
    _edit_config(tmp_path, sliding_window=None)
    assert Engine.load(tmp_path).info.max_input_tokens == 128


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ("llama", {"mlp_bias": True}, "mlp_bias=true is not supported"),
        ("llama", {"architectures": ["Qwen3Model"]}, "unsupported architecture 'Qwen3Model'"),
        ("llama", {"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3'"),
    ],
)
def test_unsupported_settings_name_the_key(
    bases, tmp_path: Path, model_type: str, changes: dict, message: str
) -> None:
    bases[model_type].save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(EngineError, match=message):
        Engine.load(tmp_path, EngineConfig(device="cpu"))


def test_qwen2_weights_have_no_output_projection_bias(bases, tmp_path: Path) -> None:
    """Qwen2's checkpoints carry q/k/v biases and none on o_proj: a missing q bias or an
    extra o bias is named, not loaded around."""
    from safetensors.torch import load_file, save_file

    bases["qwen2"].save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "layers.0.self_attn.q_proj.bias" in tensors
    assert "layers.0.self_attn.o_proj.bias" not in tensors
    del tensors["layers.0.self_attn.q_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EngineError, match="missing 1 tensors.*q_proj.bias"):
        Engine.load(tmp_path)
