"""ROSE's MPNet, DeBERTa-v2/v3 and ModernBERT families against `transformers` on tiny
random-weight models (fp32, CPU), weights read back from `save_pretrained` safetensors through
each family's `load_weights`.

Tolerances: last hidden states and classifier logits within 1e-4 of transformers; a row in a
mixed-length ragged batch within 1e-5 of the same row run alone, under both SDPA strategies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from rose.attention.sdpa import SdpaBackend
from rose.errors import EngineError
from rose.loading import read_tensors
from rose.models import deberta, modernbert, mpnet

VOCAB = 1000
# Longer than ModernBERT's test window (8) and MPNet's exact buckets; one row of one token.
LENGTHS = (1, 5, 17, 33, 40, 3)
STRATEGIES = ("per-sequence", "block-diagonal")


@dataclass(frozen=True)
class Family:
    module: ModuleType
    config: Any  # (**extra) -> transformers config
    encoder: Any  # transformers encoder class
    classifier: Any  # transformers *ForSequenceClassification class
    model_class: str  # our model class in `module`
    config_class: str  # our config class in `module`


def _mpnet_config(**extra: Any) -> transformers.MPNetConfig:
    return transformers.MPNetConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=130,
        **extra,
    )


def _deberta_v3_config(**extra: Any) -> transformers.DebertaV2Config:
    """v3 shape: log-bucketed relative positions, shared key projections, no absolute
    positions, no token types, normalized relative table."""
    return transformers.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        type_vocab_size=0,
        relative_attention=True,
        pos_att_type="p2c|c2p",
        position_buckets=8,
        max_relative_positions=-1,
        position_biased_input=False,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        **extra,
    )


def _deberta_v2_config(**extra: Any) -> transformers.DebertaV2Config:
    """v2 shape: unbucketed relative positions (span 16 < the longest row), separate position
    projections, absolute positions, token types, an embedding projection."""
    return transformers.DebertaV2Config(
        vocab_size=VOCAB,
        embedding_size=48,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        type_vocab_size=2,
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
        max_relative_positions=16,
        position_biased_input=True,
        share_att_key=False,
        pooler_hidden_act="tanh",
        **extra,
    )


def _modernbert_config(**extra: Any) -> transformers.ModernBertConfig:
    """Layers global, local, local (every third global); window 8, so local layers see 4
    positions either side of rows up to 40 long; two distinct thetas."""
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=128,
        local_attention=8,
        global_attn_every_n_layers=3,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        cls_token_id=0,
        sep_token_id=2,
    )
    return transformers.ModernBertConfig(**{**settings, **extra})


def _modernbert_mean_config(**extra: Any) -> transformers.ModernBertConfig:
    """Mean-pooling head; every bias on (norms, attention, MLP, head); global every 2nd layer."""
    return _modernbert_config(
        classifier_pooling="mean",
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
        classifier_activation="silu",
        num_hidden_layers=4,
        global_attn_every_n_layers=2,
        **extra,
    )


FAMILIES = {
    "mpnet": Family(
        mpnet,
        _mpnet_config,
        transformers.MPNetModel,
        transformers.MPNetForSequenceClassification,
        "MPNetFamilyModel",
        "MPNetConfig",
    ),
    "deberta-v3": Family(
        deberta,
        _deberta_v3_config,
        transformers.DebertaV2Model,
        transformers.DebertaV2ForSequenceClassification,
        "DebertaFamilyModel",
        "DebertaConfig",
    ),
    "deberta-v2": Family(
        deberta,
        _deberta_v2_config,
        transformers.DebertaV2Model,
        transformers.DebertaV2ForSequenceClassification,
        "DebertaFamilyModel",
        "DebertaConfig",
    ),
    "modernbert": Family(
        modernbert,
        _modernbert_config,
        transformers.ModernBertModel,
        transformers.ModernBertForSequenceClassification,
        "ModernBertFamilyModel",
        "ModernBertConfig",
    ),
    "modernbert-mean": Family(
        modernbert,
        _modernbert_mean_config,
        transformers.ModernBertModel,
        transformers.ModernBertForSequenceClassification,
        "ModernBertFamilyModel",
        "ModernBertConfig",
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """name → (transformers model, its save_pretrained directory) for every family and kind."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, fam) in enumerate(FAMILIES.items()):
        torch.manual_seed(100 + i)
        for kind, model in (
            ("encoder", fam.encoder(fam.config())),
            ("classifier", fam.classifier(fam.config(num_labels=3))),
        ):
            _spread(model)
            model.eval()
            where = root / f"{name}-{kind}"
            model.save_pretrained(where, safe_serialization=True)
            out[f"{name}-{kind}"] = (model, where)
    return out


def _spread(model: torch.nn.Module) -> None:
    """Larger random weights than transformers' init (std 0.02, zero biases, unit norms), so
    attention is far from uniform and every bias and norm parameter counts."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p), alpha=0.1)


def _load(name: str, path: Path) -> torch.nn.Module:
    fam = FAMILIES[name]
    raw = json.loads((path / "config.json").read_text())
    cfg = getattr(fam.module, fam.config_class).from_dict(raw)
    state = fam.module.load_weights(cfg, read_tensors(path))
    with torch.device("meta"):  # as Engine.load builds models
        model = getattr(fam.module, fam.model_class)(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _rows(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        body = rng.integers(5, VOCAB, size=max(n - 2, 0)).tolist()
        rows.append(([0] + body + [2])[:n] if n >= 2 else [0])
    return rows


def _run(
    model: torch.nn.Module, name: str, rows: list[list[int]], strategy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (hidden states [T, H], cu_seqlens [B+1]) for `rows` as one ragged batch."""
    module = FAMILIES[name].module
    ids = np.array([t for r in rows for t in r], dtype=np.int64)
    cu = np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(np.int64)
    positions = module.position_ids(model.cfg, ids, cu)
    with torch.inference_mode():
        hidden = model.encoder(
            torch.from_numpy(ids), torch.from_numpy(positions), None, SdpaBackend(strategy), None
        )
    return hidden, torch.from_numpy(cu)


def _classify(model: torch.nn.Module, hidden: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    with torch.inference_mode():
        return model.classify(hidden, cu, seg)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_encoder_matches_transformers(saved, name: str, strategy: str) -> None:
    reference, path = saved[f"{name}-encoder"]
    model = _load(name, path)
    rows = _rows(1)
    hidden, cu = _run(model, name, rows, strategy)
    with torch.no_grad():
        for i, row in enumerate(rows):
            want = reference(input_ids=torch.tensor([row])).last_hidden_state[0]  # [L, H]
            got = hidden[cu[i] : cu[i + 1]]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_classifier_matches_transformers(saved, name: str, strategy: str) -> None:
    reference, path = saved[f"{name}-classifier"]
    model = _load(name, path)
    rows = _rows(2)
    logits = _classify(model, *_run(model, name, rows, strategy))
    assert logits.shape == (len(rows), 3)
    with torch.no_grad():
        for i, row in enumerate(rows):
            want = reference(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_batched_equals_single(saved, name: str, strategy: str) -> None:
    model = _load(name, saved[f"{name}-classifier"][1])
    rows = _rows(3)
    hidden, cu = _run(model, name, rows, strategy)
    logits = _classify(model, hidden, cu)
    for i, row in enumerate(rows):
        alone, cu1 = _run(model, name, [row], strategy)
        torch.testing.assert_close(hidden[cu[i] : cu[i + 1]], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[i], _classify(model, alone, cu1)[0], atol=1e-5, rtol=0)


def test_mpnet_positions_skip_padding_tokens(saved) -> None:
    """RoBERTa numbering: a padding id inside a row keeps position padding_idx, does not count."""
    reference, path = saved["mpnet-encoder"]
    model = _load("mpnet", path)
    rows = [[0, 9, 2], [0, 5, 6, 1, 1, 7, 8, 2]]
    hidden, cu = _run(model, "mpnet", rows, "block-diagonal")
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([rows[1]])).last_hidden_state[0]
    torch.testing.assert_close(hidden[cu[1] :], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_load_weights_rejects_bad_checkpoints(saved, name: str) -> None:
    fam = FAMILIES[name]
    path = saved[f"{name}-classifier"][1]
    cfg = getattr(fam.module, fam.config_class).from_dict(
        json.loads((path / "config.json").read_text())
    )
    tensors = read_tensors(path)
    victim = sorted(tensors)[len(tensors) // 2]
    with pytest.raises(EngineError, match="missing"):
        fam.module.load_weights(cfg, {k: v for k, v in tensors.items() if k != victim})
    with pytest.raises(EngineError, match="unexpected"):
        fam.module.load_weights(cfg, {**tensors, "surprise.weight": torch.zeros(1)})
    with pytest.raises(EngineError, match="shape"):
        fam.module.load_weights(cfg, {**tensors, victim: torch.zeros(3, 3, 3)})


def test_deberta_v2_token_types_are_used(saved) -> None:
    reference, path = saved["deberta-v2-encoder"]
    model = _load("deberta-v2", path)
    row = _rows(4, (12,))[0]
    types = [0] * 5 + [1] * 7
    ids = torch.tensor(row)
    positions = torch.from_numpy(deberta.position_ids(model.cfg, ids.numpy(), np.array([0, 12])))
    with torch.inference_mode():
        got = model.encoder(ids, positions, torch.tensor(types), SdpaBackend("auto"), None)
        plain = model.encoder(ids, positions, None, SdpaBackend("auto"), None)
    with torch.no_grad():
        want = reference(input_ids=ids[None], token_type_ids=torch.tensor([types]))
    torch.testing.assert_close(got, want.last_hidden_state[0], atol=1e-4, rtol=0)
    assert (got - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_packed_weights_agree(saved, name: str) -> None:
    """Engine.load packs linear layers on CPU by default; the packed model computes the same."""
    path = saved[f"{name}-classifier"][1]
    plain, packed = _load(name, path), _load(name, path)
    packed.pack_weights()
    rows = _rows(5)
    want = _classify(plain, *_run(plain, name, rows, "auto"))
    got = _classify(packed, *_run(packed, name, rows, "auto"))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["modernbert", "modernbert-mean"])
def test_modernbert_head_on_first_token_states(saved, name: str) -> None:
    """The engine hands BERT-style heads first-token states: fine for CLS pooling, refused
    (not silently wrong) for mean pooling."""
    model = _load(name, saved[f"{name}-classifier"][1])
    hidden, cu = _run(model, name, _rows(6), "auto")
    first = hidden[cu[:-1]]
    if model.cfg.classifier_pooling == "cls":
        with torch.inference_mode():
            got = model.head(first)
        torch.testing.assert_close(got, _classify(model, hidden, cu), atol=0, rtol=0)
    else:
        with pytest.raises(EngineError, match="mean-pooling"):
            model.head(first)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_engine_serves_the_family(saved, name: str) -> None:
    """Engine.load picks the family from config.json's model_type; pooled embeddings and
    cross-encoder logits equal transformers' (pairs' token types accepted and ignored where
    the model has none)."""
    from rose import Engine, EngineConfig, RaggedBatch

    rows = _rows(7)
    encoder, path = saved[f"{name}-encoder"]
    engine = Engine.load(path, EngineConfig())
    got = engine.step(RaggedBatch.from_lists(rows, pooling=["mean"] * len(rows))).wait()
    classifier, ce_path = saved[f"{name}-classifier"]
    ce = Engine.load(ce_path, EngineConfig())
    assert ce.info.kind == "cross-encoder" and ce.info.num_labels == 3
    types = [[0] * (len(r) // 2) + [1] * (len(r) - len(r) // 2) for r in rows]
    logits = ce.step(RaggedBatch.from_lists(rows, token_type_ids=types)).wait()
    with torch.no_grad():
        for i, row in enumerate(rows):
            ids = torch.tensor([row])
            want = encoder(input_ids=ids).last_hidden_state[0].mean(0)
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)
            extra = {}
            if FAMILIES[name].module is deberta and classifier.config.type_vocab_size > 0:
                extra["token_type_ids"] = torch.tensor([types[i]])
            want = classifier(input_ids=ids, **extra).logits[0]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=0)


def test_relative_buckets_equal_transformers() -> None:
    """Every relative distance a 700-token row can have, bucketed as transformers buckets it."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    rel = torch.arange(-700, 701)
    for size, max_position in ((8, 64), (256, 512), (6, 31)):
        want = make_log_bucket_position(rel, size, max_position).long()
        assert torch.equal(deberta.log_bucket(rel, size, max_position), want)
    # MPNet buckets key - query; ours take query - key
    want = MPNetEncoder.relative_position_bucket(-rel)
    assert torch.equal(mpnet.relative_buckets(rel), want)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_grouped_cpu_passes_equal_one_pass(saved, name: str) -> None:
    """Engine's CPU passes in groups of rows (`EngineConfig.cpu_pass_tokens`) give every
    family's embeddings and logits of the batch in one pass."""
    from rose import Engine, EngineConfig, RaggedBatch

    rows = _rows(8)
    for kind in ("encoder", "classifier"):
        path = saved[f"{name}-{kind}"][1]
        pooling = ["mean"] * len(rows) if kind == "encoder" else None
        batch = RaggedBatch.from_lists(rows, pooling=pooling)
        whole = Engine.load(path, EngineConfig(cpu_pass_tokens=10**6))
        grouped = Engine.load(path, EngineConfig(cpu_pass_tokens=max(LENGTHS)))
        calls: list[int] = []
        grouped._model.encoder.register_forward_hook(
            lambda m, a, out, calls=calls: calls.append(len(out))
        )
        want, got = whole.step(batch).wait(), grouped.step(batch).wait()
        assert len(calls) >= 3 and sum(calls) == sum(LENGTHS)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
