"""Int4 weight-only linear layers (`rose.quant`) against dense products."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rose.packed import PackedLinear, can_pack
from rose.quant import GROUP, Int4Linear, int4_available, int4_fits, quantize_linears

pytestmark = pytest.mark.skipif(
    not int4_available(), reason="this PyTorch build has no CPU int4 kernel"
)


def test_weights_on_the_int4_grid_come_back_exactly() -> None:
    """Each group is 16 levels apart by a power of two from -0.5: the codes and bf16 scale
    and zero represent it exactly, so only bf16 rounding of x and the sums remain."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 4 * GROUP), generator=gen)
    codes[:, ::GROUP] = 0  # every group spans 0..15, so its scale is exactly 1/16
    codes[:, 1::GROUP] = 15
    w = codes.float() / 16 - 0.5
    lin = Int4Linear(w)
    assert torch.equal(lin.dequantized(), w)
    x = torch.randn(3, 4 * GROUP, generator=gen)
    want = x.to(torch.bfloat16).float() @ w.T
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (3, 48)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_random_weights_are_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen)
    deq = Int4Linear(w).dequantized()
    groups = w.view(64, 96 // GROUP, GROUP)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    err = (deq.view_as(groups) - groups).abs()
    # half a step, plus bf16 rounding of the scale, zero and result (8 bits of mantissa)
    assert (err <= step / 2 + groups.abs().amax(-1, keepdim=True) / 64).all()
    x = torch.randn(5, 96, generator=gen)
    cos = nn.functional.cosine_similarity(Int4Linear(w)(x), x @ w.T, dim=-1)
    assert (cos > 0.99).all(), cos


def test_shapes_the_kernel_refuses_are_named() -> None:
    assert not int4_fits(torch.zeros(64, GROUP + 1))
    assert not int4_fits(torch.zeros(40, GROUP))  # outputs not a multiple of 16
    with pytest.raises(ValueError, match="groups of 32"):
        Int4Linear(torch.zeros(64, 48))


def test_quantize_linears_swaps_bias_free_layers_that_fit() -> None:
    model = nn.Sequential(
        nn.Linear(64, 32, bias=False),  # swapped
        nn.Linear(32, 48, bias=True),  # has a bias: kept
        nn.Linear(48, 24, bias=False),  # 24 outputs: kept
    ).requires_grad_(False)
    if can_pack(model[0].weight):
        model[0] = PackedLinear(model[0], batch_hint=4)  # a packed layer is swapped too
    x = torch.randn(2, 64)
    want = model(x)
    assert quantize_linears(model) == 1
    assert isinstance(model[0], Int4Linear)
    assert isinstance(model[1], nn.Linear) and isinstance(model[2], nn.Linear)
    assert nn.functional.cosine_similarity(model(x), want, dim=-1).min() > 0.98
