"""Model directories ROSE cannot load fail with EngineError naming the problem; the
sentence-transformers settings (pooling, Normalize, prompts, max_seq_length) are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rose import Engine, EngineConfig, EngineError


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(7)
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
    )
    where = tmp_path_factory.mktemp("bert") / "tiny-bert"
    transformers.BertModel(cfg).save_pretrained(where)
    return where


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        Engine.load(tmp_path / "nope")


def test_missing_config(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(EngineError, match="config.json: file is missing"):
        Engine.load(d)


def test_missing_weights(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(EngineError, match="no weights"):
        Engine.load(d)


def test_unsupported_architecture(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    _edit_config(d, architectures=["LlamaForCausalLM"])
    with pytest.raises(EngineError, match="unsupported architecture 'LlamaForCausalLM'"):
        Engine.load(d)


def test_unsupported_position_embeddings(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    _edit_config(d, position_embedding_type="relative_key")
    with pytest.raises(EngineError, match="position_embedding_type"):
        Engine.load(d)


def test_missing_and_misshapen_weights(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    dropped = {k: v for k, v in tensors.items() if "layer.0.output.dense.bias" not in k}
    save_file(dropped, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match=r"missing 1 tensors.*layer\.0\.output\.dense\.bias"):
        Engine.load(d)
    bad = dict(tensors)
    bad["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(63, 32)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match="intermediate.dense.weight has shape"):
        Engine.load(d)
    extra = dict(tensors)
    extra["encoder.layer.0.surprise.weight"] = torch.zeros(2)
    save_file(extra, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match="unexpected tensors"):
        Engine.load(d)


def test_corrupt_weights(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineError, match="cannot read weights"):
        Engine.load(d)


def test_bad_engine_config_names_the_key() -> None:
    with pytest.raises(EngineError, match="EngineConfig.device"):
        EngineConfig(device="tpu")
    with pytest.raises(EngineError, match="EngineConfig.dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(EngineError, match="EngineConfig.max_graphs"):
        EngineConfig(max_graphs=0)
    with pytest.raises(EngineError, match="EngineConfig.attention"):
        EngineConfig(attention="xformers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_cuda_device_without_cuda(bert_dir: Path) -> None:
    with pytest.raises(EngineError, match="CUDA is not available"):
        Engine.load(bert_dir, EngineConfig(device="cuda"))


def _write_st(
    d: Path, pooling: dict, normalize: bool, prompts: dict | None, max_seq: int | None
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir(exist_ok=True)
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if prompts is not None:
        (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    if max_seq is not None:
        (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq}))


def test_sentence_transformers_settings_legacy_keys(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
    }
    _write_st(d, pooling, True, {"query": "query: ", "passage": "passage: "}, 30)
    info = Engine.load(d).info
    assert (info.default_pooling, info.default_normalize) == ("cls", True)
    assert (info.query_prompt, info.document_prompt) == ("query: ", "passage: ")
    assert info.max_input_tokens == 30


def test_sentence_transformers_settings_new_keys(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    _write_st(
        d,
        {"embedding_dimension": 32, "pooling_mode": "lasttoken", "include_prompt": True},
        False,
        None,
        None,
    )
    info = Engine.load(d).info
    assert (info.default_pooling, info.default_normalize) == ("last", False)
    assert (info.query_prompt, info.document_prompt, info.max_input_tokens) == ("", "", 40)


def test_unsupported_sentence_transformers_parts(bert_dir: Path, tmp_path: Path) -> None:
    d = _copy(bert_dir, tmp_path)
    _write_st(d, {"pooling_mode": "max"}, False, None, None)
    with pytest.raises(EngineError, match="pooling mode 'max' is not supported"):
        Engine.load(d)
    _write_st(d, {"pooling_mode": "mean"}, False, None, None)
    modules = json.loads((d / "modules.json").read_text())
    modules.append(
        {"idx": 2, "name": "2", "path": "2_CNN", "type": "sentence_transformers.models.CNN"}
    )
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EngineError, match="module 'CNN' is not supported"):
        Engine.load(d)


def test_legacy_layernorm_names_and_prefixed_keys(bert_dir: Path, tmp_path: Path) -> None:
    """TF-era checkpoints: `bert.` prefix, LayerNorm gamma/beta, a pretraining head to ignore."""
    import numpy as np

    from rose import RaggedBatch

    d = _copy(bert_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    legacy = {}
    for name, value in tensors.items():
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        )
        legacy["bert." + name] = value
    legacy["cls.predictions.bias"] = torch.zeros(50)
    save_file(legacy, str(d / "model.safetensors"))
    batch = RaggedBatch.from_lists([[1, 7, 9, 2], [1, 3, 2]])
    want = Engine.load(bert_dir).step(batch).numpy()
    np.testing.assert_array_equal(Engine.load(d).step(batch).numpy(), want)
