"""Weight-only int4 linear layers for the CPU (the MTP drafter's products).

Why: a draft head's one-row products stream their weights from memory after every target
pass has evicted them, so their cost is the bytes read. On the 2-core AMD EPYC this project
is developed on, one SmolLM2-135M head step (six products, 13 MB of bf16 weights) takes
~1.05 ms through oneDNN's packed bf16 kernel and ~0.40 ms as int4 (groups of 64; cold
weights, one thread). Drafts only need to be good guesses (the target verifies them in its
own precision): on the 8 held-out chat prompts of ``python -m bench spec`` group-32 int4
drafts were accepted as often as bf16 ones (0.72 vs 0.71 per step; groups of 64 lost 4%),
drafting took 1.42 instead of 2.28 s, and the k <= 5 chain's speed-up went from 1.48x to
1.56x (bench/results/spec.md of that day; see its git history).

Layout: each output row's weights are split into groups of `GROUP` inputs, and each group
is stored as 4-bit codes ``q`` in 0..15 with a bf16 scale and zero point:
``w = (q - 8) * scale + zero``, where ``scale = (max - min) / 15`` and ``zero = min + 8 *
scale`` of the group (asymmetric, so a group's extremes are exact up to bf16 rounding of
scale and zero). PyTorch's CPU kernels hold the codes packed
(``aten._convert_weight_to_int4pack_for_cpu``) and compute ``x @ w.T`` with bf16
activations (``aten._weight_int4pack_mm_for_cpu``), the ops gpt-fast and torchao use.

`int4_available` says whether this PyTorch has them; callers keep their dense layers when it
does not.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GROUP", "Int4Linear", "int4_available", "int4_fits", "quantize_linears"]

# inputs per (scale, zero) pair: 32 kept the head's acceptance (64 lost 4% of it)
GROUP = 32


def int4_available() -> bool:
    """True when this PyTorch has the CPU int4 weight-only product."""
    ops = torch.ops.aten
    return hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(
        ops, "_weight_int4pack_mm_for_cpu"
    )


def int4_fits(weight: torch.Tensor, group: int = GROUP) -> bool:
    """True when the kernel takes this ``[out, in]`` weight: on the CPU, inputs in whole
    groups, outputs a multiple of 16 (the packing's block)."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and in_features % group == 0
        and out_features % 16 == 0
        and int4_available()
    )


class Int4Linear(nn.Module):
    """``y = x @ W.T`` for x ``[rows, in_features]`` (any float dtype; computed in bf16,
    returned in x's dtype) from a dense ``W`` ``[out, in]`` quantized to int4 once."""

    def __init__(self, weight: torch.Tensor, group: int = GROUP) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if not int4_fits(weight, group):
            raise ValueError(
                f"Int4Linear needs PyTorch's CPU int4 kernel and a CPU weight whose inputs "
                f"split into groups of {group} and whose outputs are a multiple of 16; got "
                f"[{out_features}, {in_features}] on {weight.device}"
            )
        w = weight.detach().float().view(out_features, in_features // group, group)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # [out, groups, 1]
        scale = (hi - lo).clamp(min=1e-12) / 15
        codes = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32)
        zero = lo + 8 * scale
        # [groups, out, 2] bf16: the kernel's (scale, zero) layout
        self.scales_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous()
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.view(out_features, in_features), 1
        )
        self.group = group
        self.in_features = in_features
        self.out_features = out_features

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` the products use (fp32)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self._product(eye).float().t().contiguous()

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_zeros
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._product(x.reshape(-1, self.in_features).to(torch.bfloat16))  # [rows, out]
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"
        )


def quantize_linears(model: nn.Module, group: int = GROUP) -> int:
    """Replaces every linear layer of ``model`` without a bias (an ``nn.Linear`` or a
    `rose.packed.PackedLinear`) whose weight the kernel takes (`int4_fits`) by an
    `Int4Linear` of it; returns how many."""
    from rose.packed import PackedLinear

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear | PackedLinear)
                and child.bias is None
                and int4_fits(child.weight, group)
            ):
                setattr(parent, name, Int4Linear(child.weight, group))
                swapped += 1
    return swapped
