"""ROSE's Gemma 3 encoder (EmbeddingGemma's stack) against `transformers` `Gemma3TextModel`
with ``use_bidirectional_attention=True`` on tiny random-weight models (fp32, CPU).

The configs have rows longer than the sliding window (so sliding layers see only part of
their row, on both sides), both layer kinds with their own RoPE theta, grouped-query
attention and norm weights away from zero (Gemma's norms scale by 1 + w). Each model is
saved with ``save_pretrained`` and loaded through `Engine.load` (family dispatch, name map,
settings). Tolerances: hidden states and pooled embeddings within 1e-4 of transformers; a
row of a mixed-length ragged batch within 1e-5 of the same row alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rose import Engine, EngineConfig, EngineError, RaggedBatch
from rose.assets.layout import write_pooling
from rose.models import FAMILIES, gemma3

VOCAB = 500
LENGTHS = (1, 2, 5, 9, 17, 33, 3, 40)  # sliding layers see 4 tokens either side
ATOL = 1e-4


def _config(**extra: object) -> transformers.Gemma3TextConfig:
    kw: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=128,
        use_bidirectional_attention=True,
    )
    kw.update(extra)
    return transformers.Gemma3TextConfig(**kw)


def _save(path: Path, seed: int = 0, **extra: object) -> transformers.Gemma3TextModel:
    torch.manual_seed(seed)
    model = transformers.Gemma3TextModel(_config(**extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)  # Gemma's norms start at w = 0 (a scale of one)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("gemma3")
    ref = _save(path)
    write_pooling(path, 64)
    return ref, path


def _rows(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _reference(model: torch.nn.Module, row: list[int]) -> torch.Tensor:
    """[L, H] last hidden states of one row, as transformers runs it (no padding)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([row])).last_hidden_state[0]


def _hidden(path: Path, rows: list[list[int]]) -> torch.Tensor:
    engine = Engine.load(path, EngineConfig(device="cpu"))
    batch = RaggedBatch.from_lists(rows, kinds=[frozenset({"token_states"})] * len(rows))
    states = engine.step_outputs(batch).token_states
    assert states is not None
    return torch.from_numpy(states.values.reshape(-1, 64))


def test_family_table_dispatches_gemma3_text() -> None:
    assert FAMILIES["gemma3_text"] is gemma3.FAMILY


def test_hidden_states_match_transformers(model) -> None:
    ref, path = model
    rows = _rows(1)
    got = _hidden(path, rows)
    want = torch.cat([_reference(ref, r) for r in rows])
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()


def test_mean_embeddings_match_transformers(model) -> None:
    ref, path = model
    rows = _rows(2)
    engine = Engine.load(path, EngineConfig(device="cpu"))
    got = torch.from_numpy(engine.step(RaggedBatch.from_lists(rows)).numpy())
    want = torch.stack([_reference(ref, r).mean(0) for r in rows])
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()


def test_window_matters(model, tmp_path: Path) -> None:
    """The sliding layers' window is what makes long rows differ from full attention: the
    same weights with a window wider than any row give other states on a long row (so the
    parity above tests the window), and the same ones on a row that fits the window."""
    ref, path = model
    raw = json.loads((path / "config.json").read_text())
    full = tmp_path / "full"
    full.mkdir()
    raw["sliding_window"] = 1000
    (full / "config.json").write_text(json.dumps(raw))
    (full / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    long_row, short_row = _rows(3, (30,))[0], _rows(4, (5,))[0]
    windowed = _hidden(path, [long_row, short_row])
    everywhere = _hidden(full, [long_row, short_row])
    assert (windowed[:30] - everywhere[:30]).abs().max() > 1e-2
    assert torch.allclose(windowed[30:], everywhere[30:], atol=1e-5)


def test_ragged_batch_equals_rows_alone(model) -> None:
    _, path = model
    rows = _rows(5)
    engine = Engine.load(path, EngineConfig(device="cpu"))
    batched = engine.step(RaggedBatch.from_lists(rows)).numpy()
    for i, row in enumerate(rows):
        alone = engine.step(RaggedBatch.from_lists([row])).numpy()[0]
        assert abs(batched[i] - alone).max() <= 1e-5


def test_legacy_rope_keys(model, tmp_path: Path) -> None:
    """config.json as transformers 4.x writes it (EmbeddingGemma's published file):
    ``rope_theta`` / ``rope_local_base_freq`` at the top level, no ``rope_parameters``."""
    ref, path = model
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["full_attention"]["rope_theta"]
    raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    raw["rope_scaling"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    rows = _rows(6, (20, 3))
    want = torch.cat([_reference(ref, r) for r in rows])
    assert torch.allclose(_hidden(tmp_path, rows), want, atol=ATOL)


def test_linear_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaled = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}
    ref = _save(
        tmp_path,
        seed=7,
        rope_parameters={
            "full_attention": scaled,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    rows = _rows(8, (25, 4))
    want = torch.cat([_reference(ref, r) for r in rows])
    assert torch.allclose(_hidden(tmp_path, rows), want, atol=ATOL)


def test_causal_gemma3_is_refused(model, tmp_path: Path) -> None:
    _, path = model
    raw = json.loads((path / "config.json").read_text())
    raw["use_bidirectional_attention"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(EngineError, match="use_bidirectional_attention"):
        Engine.load(tmp_path, EngineConfig(device="cpu"))
    with pytest.raises(EngineError, match="causal"):
        Engine.load(path, EngineConfig(device="cpu", attention_mode="causal"))


def test_bad_checkpoints_name_the_problem(model, tmp_path: Path) -> None:
    _, path = model
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("layers.1.pre_feedforward_layernorm.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineError, match="pre_feedforward_layernorm"):
        Engine.load(tmp_path, EngineConfig(device="cpu"))
    raw = json.loads((path / "config.json").read_text())
    raw["attn_logit_softcapping"] = 50.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError, match="softcapping"):
        Engine.load(tmp_path, EngineConfig(device="cpu"))


# -- sentence-transformers Dense layers after the pooling (EmbeddingGemma's projections) ----


def _write_st_head(path: Path, dense: list[torch.nn.Module]) -> None:
    """modules.json: Transformer, mean Pooling, the given ST ``Dense`` modules, Normalize."""
    write_pooling(path, 64)
    modules = json.loads((path / "modules.json").read_text())
    modules = [m for m in modules if not m["type"].endswith("Normalize")]
    for module in dense:
        folder = f"{len(modules)}_Dense"
        (path / folder).mkdir(exist_ok=True)
        module.save(str(path / folder))
        modules.append(
            {
                "idx": len(modules),
                "name": folder,
                "path": folder,
                "type": "sentence_transformers.models.Dense",
            }
        )
    modules.append(
        {
            "idx": len(modules),
            "name": "norm",
            "path": "norm",
            "type": "sentence_transformers.models.Normalize",
        }
    )
    (path / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("shape", ["embeddinggemma", "tanh-bias"])
def test_dense_layers_follow_the_pooling(model, tmp_path: Path, shape: str) -> None:
    """ROSE's pooled rows through the directory's Dense modules equal sentence-transformers'
    own Dense modules applied to transformers' mean pooling, then normalized."""
    from sentence_transformers.sentence_transformer.modules import Dense

    ref, path = model
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    torch.manual_seed(11)
    if shape == "embeddinggemma":  # 768 -> 3072 -> 768 in the real model, no bias
        dense = [
            Dense(64, 256, bias=False, activation_function=torch.nn.Identity()),
            Dense(256, 48, bias=False, activation_function=torch.nn.Identity()),
        ]
    else:
        dense = [Dense(64, 32, bias=True, activation_function=torch.nn.Tanh())]
    _write_st_head(tmp_path, dense)
    rows = _rows(9)
    engine = Engine.load(tmp_path, EngineConfig(device="cpu"))
    assert engine.info.dimensions == dense[-1].linear.out_features
    got = torch.from_numpy(engine.step(RaggedBatch.from_lists(rows)).numpy())
    with torch.no_grad():
        x = torch.stack([_reference(ref, r).mean(0) for r in rows])
        for module in dense:
            x = module({"sentence_embedding": x})["sentence_embedding"]
        want = torch.nn.functional.normalize(x, dim=-1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()


def test_unsupported_dense_modules_are_refused(model, tmp_path: Path) -> None:
    from sentence_transformers.sentence_transformer.modules import Dense

    _, path = model
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    _write_st_head(tmp_path, [Dense(64, 32, activation_function=torch.nn.ReLU())])
    with pytest.raises(EngineError, match="activation_function"):
        Engine.load(tmp_path, EngineConfig(device="cpu"))
    _write_st_head(tmp_path, [Dense(48, 32)])  # does not fit the 64-wide pooled rows
    with pytest.raises(EngineError, match="expected \\(32, 64\\)"):
        Engine.load(tmp_path, EngineConfig(device="cpu"))
