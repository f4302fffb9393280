"""ROSE's T5 / mT5 encoders against `transformers` on tiny random-weight models (fp32, CPU).

Every model is saved with ``save_pretrained`` and loaded through `Engine.load` (family
dispatch, name map, settings). The references are `T5EncoderModel` / `MT5EncoderModel` as
they run; a full `T5ForConditionalGeneration` directory serves its encoder only, as
sentence-transformers loads it.

Shapes exercise what T5 does differently: d_kv * heads != d_model, a relative-position
distance limit (12) below the longest row (40), so the log buckets and their clamp are hit;
ReLU (T5 1.0) and gated-GELU (T5 1.1 / mT5) MLPs.

Tolerances: pooled embeddings and hidden states within 1e-4 of transformers; a row of a
mixed-length ragged batch within 1e-5 of the same row run alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rose import Engine, EngineConfig, EngineError, RaggedBatch

VOCAB = 200
LENGTHS = (1, 2, 7, 17, 40, 3)


def _config(cls: type = transformers.T5Config, **extra: object) -> transformers.PretrainedConfig:
    settings: dict[str, object] = dict(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=8,  # 4 heads x 8 = 32 != 64
        d_ff=96,
        num_layers=3,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=12,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    settings.update(extra)
    return cls(**settings)


def _spread(model: torch.nn.Module) -> None:
    """Larger random weights than T5's init, so attention is far from uniform and the
    relative bias and every norm count."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p), alpha=0.1)
            else:
                p.normal_(0.0, 0.3 if "relative_attention_bias" in name else 0.15)


MODELS = {
    "t5-relu": lambda: transformers.T5EncoderModel(_config()),
    "t5-gated": lambda: transformers.T5EncoderModel(_config(feed_forward_proj="gated-gelu")),
    "mt5": lambda: transformers.MT5EncoderModel(_config(transformers.MT5Config)),
    "t5-full": lambda: transformers.T5ForConditionalGeneration(_config()),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("t5")
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(50 + i)
        model = make()
        _spread(model)
        model.eval()
        model.save_pretrained(root / name, safe_serialization=True)
        out[name] = (model, root / name)
    return out


def _rows(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=n - 1).tolist() + [1] for n in lengths]  # ... </s>


def _reference(model: torch.nn.Module, row: list[int]) -> torch.Tensor:
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else model
    with torch.no_grad():
        return encoder(input_ids=torch.tensor([row])).last_hidden_state[0]  # [L, H]


@pytest.mark.parametrize("strategy", ["per-sequence", "block-diagonal"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_pooled_embeddings_match_transformers(saved, name: str, strategy: str) -> None:
    model, path = saved[name]
    engine = Engine.load(path, EngineConfig(sdpa_strategy=strategy))
    assert engine.info.kind == "embedding" and engine.info.dimensions == 64
    rows = _rows(1)
    for pooling in ("mean", "cls"):
        batch = RaggedBatch.from_lists(rows, pooling=[pooling] * len(rows))
        got = engine.step(batch).wait()
        for i, row in enumerate(rows):
            hidden = _reference(model, row)
            want = hidden.mean(0) if pooling == "mean" else hidden[0]
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["t5-relu", "mt5"])
def test_ragged_batch_equals_rows_alone(saved, name: str) -> None:
    _, path = saved[name]
    engine = Engine.load(path)
    rows = _rows(2)
    together = engine.step(RaggedBatch.from_lists(rows)).wait()
    for i, row in enumerate(rows):
        alone = engine.step(RaggedBatch.from_lists([row])).wait()
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=0)


def test_the_relative_bias_is_used(saved, tmp_path: Path) -> None:
    """Zeroing the bias table changes every long row: positions reach T5 only through it."""
    model, path = saved["t5-relu"]
    flat = tmp_path / "flat"
    shutil.copytree(path, flat)
    tensors = load_file(flat / "model.safetensors")
    name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, flat / "model.safetensors")
    row = _rows(3, (30,))[0]
    got = Engine.load(path).step(RaggedBatch.from_lists([row])).wait()[0]
    unbiased = Engine.load(flat).step(RaggedBatch.from_lists([row])).wait()[0]
    assert (got - unbiased).abs().max().item() > 1e-2


def _edited(path: Path, where: Path, **changes: object) -> Path:
    shutil.copytree(path, where)
    raw = json.loads((where / "config.json").read_text())
    raw.update(changes)
    (where / "config.json").write_text(json.dumps(raw))
    return where


def test_rows_are_capped_at_n_positions(saved, tmp_path: Path) -> None:
    _, path = saved["t5-relu"]
    assert Engine.load(path).info.max_input_tokens == 512
    capped = Engine.load(_edited(path, tmp_path / "capped", n_positions=16))
    assert capped.info.max_input_tokens == 16
    with pytest.raises(EngineError, match="at most 16"):
        capped.step(RaggedBatch.from_lists(_rows(4, (17,))))


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"architectures": ["T5ForSequenceClassification"]}, "T5ForSequenceClassification"),
        ({"architectures": ["MT5EncoderModel"]}, "MT5EncoderModel"),
        ({"feed_forward_proj": "gated-mish"}, "feed_forward_proj"),
        ({"relative_attention_num_buckets": 6}, "multiple of 4"),
    ],
)
def test_unsupported_configs_are_refused(saved, tmp_path: Path, changes: dict, says: str) -> None:
    _, path = saved["t5-relu"]
    with pytest.raises(EngineError, match=says):
        Engine.load(_edited(path, tmp_path / "bad", **changes))


def test_causal_attention_is_refused(saved) -> None:
    _, path = saved["t5-relu"]
    with pytest.raises(EngineError, match="bidirectionally only"):
        Engine.load(path, EngineConfig(attention_mode="causal"))


def test_bad_checkpoints_are_refused(saved, tmp_path: Path) -> None:
    _, path = saved["t5-gated"]
    tensors = load_file(path / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if "wi_1" not in k}, "missing"),
        "extra": ({**tensors, "encoder.block.0.extra.weight": torch.zeros(2)}, "unexpected"),
        "untied": (
            {
                **tensors,
                "shared.weight": tensors["encoder.embed_tokens.weight"] + 1
                if "encoder.embed_tokens.weight" in tensors
                else tensors["shared.weight"],
                "encoder.embed_tokens.weight": tensors.get(
                    "encoder.embed_tokens.weight", tensors["shared.weight"] + 1
                ),
            },
            "differs",
        ),
    }
    for name, (broken, says) in cases.items():
        where = tmp_path / name
        shutil.copytree(path, where)
        save_file(broken, where / "model.safetensors")
        with pytest.raises(EngineError, match=says):
            Engine.load(where)
