"""rose.packed: linear layers on oneDNN-packed weights against F.linear, and the loaders'
use of them (encoder engine, decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rose import Engine, EngineConfig, RaggedBatch
from rose import packed as packed_mod
from rose.assets import ensure_model
from rose.errors import EngineError
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.packed import (
    ACTIVATIONS,
    PackedLinear,
    can_pack,
    few_row_costs,
    pack_linears,
    tune_few_rows,
)

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(2, 2)), reason="this PyTorch build has no oneDNN linear ops"
)

REFERENCE = {
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "relu": F.relu,
}


def _linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 17, 300])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_packed_linear_equals_f_linear(rows: int, bias: bool, activation: str) -> None:
    lin = _linear(96, 160, bias)
    packed = PackedLinear(lin, batch_hint=4, activation=activation)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    want = REFERENCE[activation](F.linear(x, lin.weight, lin.bias))
    got = packed(x)
    assert got.shape == (rows, 160) and got.dtype == torch.float32 and not got.is_mkldnn
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_single_row_copy_serves_one_row_and_packed_serves_the_rest(bias: bool) -> None:
    lin = _linear(96, 1000, bias)
    packed = PackedLinear(lin, batch_hint=4, single_row=True)
    assert torch.equal(packed.weight, lin.weight)
    for rows in (1, 2, 4):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        want = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(packed(x), want, atol=2e-5, rtol=1e-5)
    one = torch.randn(1, 96)
    # The one-row path is MKL's x @ W.T on the kept copy, not the packed kernel.
    torch.testing.assert_close(
        packed(one), one @ lin.weight.t().contiguous() + (lin.bias if bias else 0), atol=0, rtol=0
    )


def test_two_rows_run_padded_to_min_rows_and_come_back_alone(monkeypatch) -> None:
    lin = _linear(96, 160, True)
    packed = PackedLinear(lin, batch_hint=4, activation="gelu", min_rows=4)
    seen: list[tuple[int, ...]] = []
    real = packed._packed_product
    monkeypatch.setattr(packed, "_packed_product", lambda x: seen.append(x.shape) or real(x))
    for rows in (2, 3, 5):
        seen.clear()
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        got = packed(x)
        # only two rows are padded (to 4); the padding's rows (gelu(bias)) are dropped
        assert seen == [(4 if rows == 2 else rows, 96)] and got.shape == (rows, 160)
        want = F.gelu(F.linear(x, lin.weight, lin.bias))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_weights_under_fp32_activations(rows: int) -> None:
    lin = _linear(96, 200, True).to(torch.bfloat16)
    packed = PackedLinear(lin, batch_hint=4, single_row=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    got = packed(x)
    assert got.dtype == torch.float32  # the caller's dtype comes back
    # the product is bf16 x bf16 (fp32 accumulation), as F.linear on bf16 inputs computes it
    want = F.linear(x.to(torch.bfloat16), lin.weight, lin.bias).float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    exact = F.linear(x, lin.weight.float(), lin.bias.float())
    assert (got - exact).abs().max() > 0  # it did run in bf16, not silently in fp32


def test_packed_linear_takes_any_leading_shape_and_strides() -> None:
    lin = _linear(64, 48, True)
    packed = PackedLinear(lin, batch_hint=512)
    x3 = torch.randn(3, 5, 64)
    torch.testing.assert_close(packed(x3), F.linear(x3, lin.weight, lin.bias), atol=2e-5, rtol=0)
    xt = torch.randn(64, 7).t()  # not contiguous
    torch.testing.assert_close(packed(xt), F.linear(xt, lin.weight, lin.bias), atol=2e-5, rtol=0)


def test_weight_unpacks_exactly_and_shared_weights_are_kept() -> None:
    lin = _linear(32, 24, False)
    packed = PackedLinear(lin, batch_hint=4)
    assert torch.equal(packed.weight, lin.weight)
    shared = PackedLinear(lin, batch_hint=4, keep_dense=True)
    assert shared.weight is lin.weight


def test_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="activation"):
        PackedLinear(_linear(4, 4, True), 4, activation="tanh")
    trainable = nn.Linear(4, 4)  # requires grad: the packed op has no backward
    assert not can_pack(trainable.weight)
    with pytest.raises(ValueError, match="without gradients"):
        PackedLinear(trainable, 4)
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float64))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert pack_linears(model, 4) == 0 and isinstance(model[0], nn.Linear)


def _tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.output.weight = model.tok_embeddings.weight
    return model


def _costs(mkl_1: float, packed_1: float, packed_2: float, packed_4: float):
    """A stand-in for `few_row_costs`: these sweep times, whatever the layers."""
    costs = {"mkl 1": mkl_1, "packed 1": packed_1, "packed 2": packed_2, "packed 4": packed_4}
    return lambda layers, pad_to: dict(costs)


def test_pack_linears_replaces_every_linear_and_keeps_tied_head_dense(monkeypatch) -> None:
    # a CPU like AMD Zen 4: MKL's one-row GEMM and four rows beat the packed kernel's 1 and 2
    monkeypatch.setattr(packed_mod, "few_row_costs", _costs(4.5, 8.5, 9.8, 6.9))
    model = _tiny_llama()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert model.pack_weights() == n_linear == 2 * 7 + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output, PackedLinear)
    assert model.output.weight is model.tok_embeddings.weight  # tied: no second dense copy
    assert model.layers[0].mlp.w_up._dense is None  # untied: no dense [out, in] copy
    assert model.layers[0].mlp.w_up._single_row is not None  # decoding's one-row copy
    assert model.layers[0].mlp.w_up.min_rows == 4  # two-row passes run as four
    assert model.pass_min_rows == 4  # and the runner tops 2-3 token passes up to 4


def test_few_row_paths_follow_what_this_cpu_runs_faster(monkeypatch) -> None:
    """A CPU like AMD Zen 5: the packed kernel beats MKL at one row and two rows beat four,
    so the one-row copies are dropped, nothing is padded, and results stay the products."""
    seen: list[tuple[int, int]] = []
    fake = _costs(4.2, 3.2, 3.5, 3.9)
    monkeypatch.setattr(
        packed_mod,
        "few_row_costs",
        lambda layers, pad_to: seen.append((len(layers), pad_to)) or fake(layers, pad_to),
    )
    model, ref = _tiny_llama(), _tiny_llama()
    dense = {n: m.weight.clone() for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
    model.pack_weights()
    assert seen == [(2 * 7 + 1, 4)]  # measured once, over every packed layer
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert all(m._single_row is None and m.min_rows == 1 for m in layers.values())
    assert model.pass_min_rows == 1
    for name, layer in layers.items():  # the weight still unpacks exactly
        assert torch.equal(layer.weight, dense[name])
    for rows in (1, 2):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        want = x @ dense["layers.0.mlp.w_up"].t()
        torch.testing.assert_close(layers["layers.0.mlp.w_up"](x), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("costs", "copies", "pad"),
    [
        ((4.5, 8.5, 9.8, 6.9), True, 4),
        ((4.2, 3.2, 3.5, 3.9), False, 1),
        ((3.0, 3.2, 3.5, 3.5), True, 1),
    ],
)
def test_tune_few_rows_keeps_each_path_only_where_it_is_faster(
    monkeypatch, costs, copies, pad
) -> None:
    monkeypatch.setattr(packed_mod, "few_row_costs", _costs(*costs))
    layers = [PackedLinear(_linear(32, 48, False, seed), 4, single_row=True) for seed in (0, 1)]
    assert tune_few_rows(layers, 4) == pad
    assert all((m._single_row is not None) == copies and m.min_rows == pad for m in layers)


def test_few_row_costs_times_each_path_on_real_layers() -> None:
    layers = [PackedLinear(_linear(256, 512, False, seed), 4, single_row=True) for seed in (0, 1)]
    layers.append(PackedLinear(_linear(512, 256, False), 4))  # no copy: not in the MKL sweep
    layers.append(PackedLinear(_linear(256, 64, False).to(torch.bfloat16), 4))  # bf16 rows
    costs = few_row_costs(layers, 4)
    assert sorted(costs) == ["mkl 1", "packed 1", "packed 2", "packed 4"]
    assert all(0 < t < 1.0 for t in costs.values())  # measured seconds, not defaults
    assert "mkl 1" not in few_row_costs(layers[2:], 4)
    bf16_head = [PackedLinear(_linear(32, 48, False).to(torch.bfloat16), 4, single_row=True)]
    assert bf16_head[0]._single_row is None and tune_few_rows(bf16_head, 1) == 1
    assert tune_few_rows([], 4) == 1


@pytest.fixture(scope="module")
def e5_path():
    return ensure_model("multilingual-e5-small")


def test_engine_packed_embeddings_equal_unpacked(e5_path) -> None:
    plain = Engine.load(e5_path, EngineConfig(device="cpu", packed_weights=False))
    packed = Engine.load(e5_path, EngineConfig(device="cpu"))
    assert isinstance(packed._model.encoder.layers[0].mlp.up, PackedLinear)
    assert packed._model.encoder.layers[0].mlp.up.activation == "gelu"
    assert packed._model.encoder.layers[0].mlp.act_fused
    assert isinstance(plain._model.encoder.layers[0].mlp.up, nn.Linear)
    rng = np.random.default_rng(0)
    rows = [rng.integers(5, 250_000, size=n).tolist() for n in (1, 7, 128, 300)]
    batch = RaggedBatch.from_lists(rows)
    a = plain.step(batch).numpy()
    b = packed.step(batch).numpy()
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() >= 0.99999, cos


def test_engine_config_packed_weights_must_be_bool() -> None:
    with pytest.raises(EngineError, match="packed_weights"):
        EngineConfig(packed_weights="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("slow", [torch.float32, torch.bfloat16])
def test_bf16_speedup_is_fp32_time_over_bf16_time(monkeypatch, slow: torch.dtype) -> None:
    """The probe's ratio has the right orientation: a CPU whose bf16 products are slow
    reports < 1, one whose fp32 products are slow > 1 (the products are slowed here by a
    sleep, so the outcome does not depend on this machine's CPU)."""
    import time

    import rose.packed

    real = PackedLinear._packed_product

    def product(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if self._packed.dtype == slow:
            time.sleep(0.2)
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "_packed_product", product)
    rose.packed.bf16_speedup.cache_clear()
    try:
        found = rose.packed.bf16_speedup()
        assert rose.packed.bf16_speedup() == found  # measured once per process
    finally:
        rose.packed.bf16_speedup.cache_clear()
    if slow == torch.bfloat16:
        assert 0 < found < 0.5
    else:
        assert found > 2


def test_bf16_speedup_is_zero_where_nothing_packs(monkeypatch) -> None:
    import rose.packed

    monkeypatch.setattr(rose.packed, "_ops_available", lambda: False)
    rose.packed.bf16_speedup.cache_clear()
    try:
        assert rose.packed.bf16_speedup() == 0.0
    finally:
        rose.packed.bf16_speedup.cache_clear()
