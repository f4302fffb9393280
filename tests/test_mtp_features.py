"""EAGLE-3-style multi-layer features for the MTP head: the target returns the requested
layers' outputs (equal to `transformers`' ``output_hidden_states`` on SmolLM2), the head's
config validates and round-trips ``feature_layers`` (old heads without it still load),
training feeds the same features chained drafting does, and greedy output with a
multi-layer head stays identical to plain greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_llama import HIDDEN, random_prompts, tiny_target

from rose.assets import ensure_model
from rose.attention.metadata import AttentionMetadata
from rose.generate import GenerationConfig, GenerationEngine
from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead, MTPHeadConfig
from rose.spec.train_mtp import (
    TrainConfig,
    answer_prompts,
    answer_with_features,
    collected_layers,
    init_feature_norms,
    split_features,
    target_features,
    train_head,
)

H = HIDDEN
LAYERS = (0, 2)  # of the tiny target's 4
GREEDY = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


def _forward(
    model: LlamaForCausalLM, ids: list[int], request: bool | tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    table = BlockTable(PageAllocator(64), 16)
    table.reserve(len(ids))
    meta = AttentionMetadata.build([(table, 0, len(ids))])
    with torch.no_grad():
        out = model(torch.tensor(ids), meta, model.new_cache(64, 16), return_all_hidden=request)
    return out.logits, out.all_hidden


def _multi_head(target: LlamaForCausalLM, layers: tuple[int, ...] = LAYERS) -> MTPHead:
    torch.manual_seed(3)
    return MTPHead(MTPHeadConfig.for_target(target.config, feature_layers=layers)).eval()


# --- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers", [(1,), (2, 1), (1, 1), (-1, 2), [0, 2], (0.0, 2), (True, 2)], ids=repr
)
def test_feature_layers_are_validated(target: LlamaForCausalLM, layers: object) -> None:
    base = MTPHeadConfig.for_target(target.config)
    with pytest.raises(ValueError, match="config.feature_layers"):
        MTPHeadConfig(**{**base.__dict__, "feature_layers": layers})


def test_feature_layers_must_exist_in_the_target(target: LlamaForCausalLM) -> None:
    head = MTPHead(MTPHeadConfig.for_target(target.config, feature_layers=(1, 4)))
    with pytest.raises(ValueError, match="feature_layers"):
        GenerationEngine(target, GenerationConfig(spec=SpecConfig(method="mtp")), mtp_head=head)


def test_train_config_validates_feature_layers() -> None:
    with pytest.raises(ValueError, match="train.feature_layers"):
        TrainConfig(feature_layers=(3,))
    with pytest.raises(ValueError, match="train.feature_layers"):
        TrainConfig(feature_layers=(3, 1))
    assert TrainConfig(feature_layers=(0, 3)).feature_layers == (0, 3)


def test_multi_layer_head_save_load_roundtrip(target: LlamaForCausalLM, tmp_path: Path) -> None:
    head = _multi_head(target)
    assert head.config.feature_width == 2 * H
    head.save(tmp_path / "h")
    saved = json.loads((tmp_path / "h" / "config.json").read_text())
    assert saved["feature_layers"] == list(LAYERS)
    again = MTPHead.load(tmp_path / "h")
    assert again.config == head.config and again.config.feature_layers == LAYERS
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and "reduce.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_old_format_head_still_loads(target: LlamaForCausalLM, tmp_path: Path) -> None:
    """A head saved before ``feature_layers`` existed (no key in config.json, no reduce
    weights) loads as a final-norm head and keeps its weights."""
    torch.manual_seed(4)
    head = MTPHead(MTPHeadConfig.for_target(target.config)).eval()
    head.save(tmp_path / "old")
    cfg_file = tmp_path / "old" / "config.json"
    d = json.loads(cfg_file.read_text())
    del d["feature_layers"]
    cfg_file.write_text(json.dumps(d))
    again = MTPHead.load(tmp_path / "old")
    assert again.config.feature_layers == () and again.config.feature_width == H
    assert not hasattr(again, "reduce")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in head.state_dict().items())


def test_head_rejects_features_of_another_width(target: LlamaForCausalLM) -> None:
    head = _multi_head(target)
    with pytest.raises(ValueError, match="128 or 64 wide"):
        head.fuse_inputs(torch.zeros(2, 3 * H), torch.zeros(2, H))


# --- the target's layer outputs ---------------------------------------------------------


def test_requested_layers_and_errors(target: LlamaForCausalLM) -> None:
    ids = random_prompts(1, 1)[0]
    logits, final = _forward(target, ids, True)
    logits2, layers = _forward(target, ids, (0, 1, 3))
    assert final is not None and layers is not None
    assert layers.shape == (len(ids), 3 * H)
    torch.testing.assert_close(logits2, logits, atol=0, rtol=0)
    # the final-norm state is the last layer's output through the final norm
    torch.testing.assert_close(target.norm(layers[:, 2 * H :]), final, atol=1e-6, rtol=0)
    for bad in [(), (3, 1), (0, 4), (-1, 2)]:
        with pytest.raises(ValueError, match="return_all_hidden"):
            _forward(target, ids, bad)


@pytest.fixture(scope="module")
def smol() -> Path:
    return ensure_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_model(smol: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(smol)


def test_smollm2_layers_match_transformers(smol: Path) -> None:
    """Layers 2, 15 and 29 of SmolLM2-135M equal `transformers`' hidden states (entry
    i + 1 is layer i's output; the last one normed) within 1e-4, fp32, the same weights,
    unpacked (the same kernels)."""
    model = LlamaForCausalLM.from_pretrained(smol, packed=False)
    ref = transformers.LlamaForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smol)
    ids = tok("The glacier moved slowly down the valley, carving the rock.")["input_ids"]
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    _, got = _forward(model, ids, (2, 15, 29))
    assert got is not None and got.shape == (len(ids), 3 * 576)
    assert len(hs) == 31  # the embeddings, then one entry per layer
    for j, layer in enumerate((2, 15)):
        want = hs[layer + 1][0]  # [T, H]
        torch.testing.assert_close(got[:, j * 576 : (j + 1) * 576], want, atol=1e-4, rtol=0)
    # transformers' last entry is the last layer's output after the final norm
    torch.testing.assert_close(model.norm(got[:, 2 * 576 :]), hs[30][0], atol=1e-4, rtol=0)


# --- training and drafting ---------------------------------------------------------------


def test_answers_with_layer_features_equal_a_feature_pass(target: LlamaForCausalLM) -> None:
    prompts = random_prompts(50, 12)
    request = collected_layers(LAYERS, 4)
    assert request == (0, 2, 3) and collected_layers((1, 3), 4) == (1, 3)
    assert collected_layers((), 4) is True
    seqs, feats = answer_with_features(target, prompts, answer_tokens=16, batch=5, request=request)
    assert seqs == answer_prompts(target, prompts, answer_tokens=16)
    ref = target_features(target, seqs, request=request)
    final = target_features(target, seqs)
    for f, r, fin in zip(feats, ref, final, strict=True):
        assert f.shape == (r.shape[0], 3 * H)
        torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)
        inputs, got_final = split_features(target, f, LAYERS)
        assert inputs.shape == (f.shape[0], 2 * H)
        torch.testing.assert_close(got_final, fin, atol=1e-5, rtol=1e-5)


def test_feature_norms_start_as_the_targets_readers(target: LlamaForCausalLM) -> None:
    """Layer i's norm starts as layer i + 1's attention norm, the last layer's as the final
    norm (norm weights made distinct so a wrong pick shows)."""
    torch.manual_seed(6)
    other = LlamaForCausalLM(target.config)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 1:
                p.uniform_(0.1, 2.0)
    head = _multi_head(other, (1, 3))
    init_feature_norms(head, other)
    assert torch.equal(head.layer_norms[0].weight, other.layers[2].attention_norm.weight)
    assert torch.equal(head.layer_norms[1].weight, other.norm.weight)


def test_trained_multi_layer_head_is_accepted_and_lossless(target: LlamaForCausalLM) -> None:
    request = collected_layers(LAYERS, 4)
    seqs, feats = answer_with_features(target, random_prompts(10, 96), 32, request=request)
    cfg = TrainConfig(epochs=10, lr=3e-3, batch_tokens=512, unroll=2, feature_layers=LAYERS)
    head, history = train_head(target, seqs, feats, cfg)
    assert head.config.feature_layers == LAYERS
    assert history[-1] < 0.5 * history[0], history
    prompts = random_prompts(20, 24)
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    spec = SpecConfig(method="mtp", num_draft_tokens=3)
    eng = GenerationEngine(target, GenerationConfig(max_batch=16, spec=spec), mtp_head=head)
    assert [r.output_ids for r in eng.generate(prompts, GREEDY)] == base
    assert eng.stats.acceptance_rate > 0.3, eng.stats.as_dict()
    assert eng.allocator.num_free == eng.config.kv.num_pages


def test_smollm2_greedy_identical_with_a_multi_layer_head(smol_model: LlamaForCausalLM) -> None:
    """A random multi-layer head on SmolLM2 (layers 2, 15, 29): batched chained drafting
    leaves greedy output token for token as plain greedy."""
    model = smol_model
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 49152, (5 + 3 * i,), generator=g).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=20)
    plain = GenerationEngine(
        model, GenerationConfig(max_batch=6), eos_ids=model.config.eos_token_ids
    )
    base = [r.output_ids for r in plain.generate(prompts, params)]
    torch.manual_seed(0)
    head = MTPHead(MTPHeadConfig.for_target(model.config, feature_layers=(2, 15, 29))).eval()
    spec = SpecConfig(method="mtp", num_draft_tokens=3)
    eng = GenerationEngine(
        model,
        GenerationConfig(max_batch=6, spec=spec),
        mtp_head=head,
        eos_ids=model.config.eos_token_ids,
    )
    assert [r.output_ids for r in eng.generate(prompts, params)] == base
    assert eng.stats.drafted > 0
