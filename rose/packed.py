"""Linear layers on weights pre-packed for oneDNN (CPU only).

Why: ``F.linear`` on a CPU tensor goes to MKL's sgemm, which re-lays-out (packs) the weight
matrix inside every call. For the many-token passes of an encoder that costs a few percent;
for the few-token passes of decoding and speculative verification it dominates: on the 2-core
AMD EPYC this project is developed on, a 4-row product with SmolLM2's 49152 x 576 LM head
takes 17 ms through MKL against 6 ms from a weight packed once, and a whole 4-token
verification pass costs 1.5x a 1-token decode step through MKL but 0.9x packed
(bench/results/spec.md of that day). oneDNN also picks its AVX-512 kernels on AMD, where
MKL's dispatch does not: encoder passes over 128-512 tokens run 7-21 % faster.

`PackedLinear` replaces an ``nn.Linear`` after loading: it holds the weight in oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the op TorchInductor's CPU
backend uses for frozen weights) and computes ``x @ W.T + b`` with
``torch.ops.mkldnn._linear_pointwise``, optionally with GELU fused as a post-op. Results are
the same fp32 products summed in another order (differences of a few ulps, e.g. 5e-5 on
SmolLM2's logits, cosine 1.0 on e5 embeddings). The dense weight is not kept unless another
module shares it (tied LM head and embeddings); `weight` unpacks on demand.

`pack_linears` is what loaders call. It changes nothing, and says so, where the op does not
exist (a PyTorch built without oneDNN), on GPUs, for dtypes other than float32/bfloat16, and
for modules that need gradients (training keeps ``nn.Linear``).

Whether bf16 products are faster than fp32 ones depends on the CPU, not on its flags alone:
AMD Zen 4's AVX-512 bf16 dot products ran oneDNN's packed bf16 products ~1.5-2x its fp32
ones, while an Intel Xeon (family 6 model 207) whose VM exposes AVX-512 bf16 but not AMX ran
them at 0.58x (2048 x 384 -> 1536: 84 vs 146 GFLOP/s, one thread; its bf16 dot product has
the fp32 FMAs' peak and adds conversions). `bf16_speedup` measures the ratio once per
process, so callers choosing a format by speed (`rose.int8`'s contracting layers) choose
by this CPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "PackedLinear",
    "PROBE_SHAPE",
    "bf16_speedup",
    "can_pack",
    "fastest",
    "few_row_costs",
    "pack_linears",
    "tune_few_rows",
]

log = logging.getLogger("rose.packed")

K = TypeVar("K")

# Post-ops the fused kernel applies (name → oneDNN post-op name and algorithm).
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "none": ("none", ""),
    "gelu": ("gelu", "none"),  # exact (erf) GELU, as F.gelu's default
    "gelu_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def _ops_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def can_pack(weight: torch.Tensor) -> bool:
    """True when a linear layer with this weight can run on a packed copy."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and not weight.requires_grad
        and _ops_available()
    )


class PackedLinear(nn.Module):
    """``y = act(x @ W.T + b)`` for x ``[..., in_features]`` on a packed ``W`` ``[out, in]``.

    batch_hint: the number of rows oneDNN tunes the layout for; any row count works.
    keep_dense: keep a reference to the dense weight (when another module shares it).
    Inputs of another dtype than the weight (fp32 activations on bf16 weights, as the MTP
    drafter runs) are cast to it and the result back.
    single_row: also keep ``W.T`` contiguous ``[in, out]`` for one-row inputs, which MKL's
        plain GEMM streams faster than oneDNN's packed kernel on some CPUs (AMD Zen 4:
        SmolLM2's 49152 x 576 LM head ~4.5 vs ~8.5 ms on one thread; a whole 1-token decode
        step ~6% faster with every layer so) and slower on others (Zen 5: the head 4.2 vs
        3.2 ms, the decode step 29.5 vs 24.2 ms). That is the row each sequence's plain
        decode step computes; it costs a second copy of the weight, so `pack_linears` keeps
        it only where it measures faster (`tune_few_rows`). Only for fp32
        weights: MKL has no bf16 GEMM, and oneDNN's packed bf16 kernel beats PyTorch's bf16
        ``mm`` on one row (136 vs 155 µs for a cold 1536 x 576 weight).
    min_rows: two-row inputs are zero-padded to this many rows (when it is more than 2)
        and the padding's rows dropped from the result. On AMD Zen 4 oneDNN's fp32 kernel
        streams a weight that is not in cache slower at 2 rows than at 4: a whole
        SmolLM2-135M pass over 2 new tokens took 57.5 ms against 45 ms over 4 and 47.1 ms
        padded to 4 (one thread); on Zen 5 2 rows are the cheaper (24.4 vs 27.7 ms), so
        `pack_linears` pads only where it measures so. For models whose weights stream
        from memory on every pass; a weight that stays in cache is faster at 2 rows (72 vs
        91 µs for a warm 1536 x 576 one).
    """

    def __init__(
        self,
        linear: nn.Linear,
        batch_hint: int,
        activation: str = "none",
        keep_dense: bool = False,
        single_row: bool = False,
        min_rows: int = 1,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"PackedLinear activation must be one of {tuple(ACTIVATIONS)}")
        if not can_pack(linear.weight):
            raise ValueError(
                f"PackedLinear needs a CPU {[str(d) for d in _PACKABLE_DTYPES]} weight without "
                "gradients and PyTorch with oneDNN; got "
                f"{linear.weight.dtype} on {linear.weight.device}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation = activation
        self._post_op, self._algorithm = ACTIVATIONS[activation]
        w = linear.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, max(1, batch_hint))
        self._dense = linear.weight if keep_dense else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        keep_row = single_row and activation == "none" and w.dtype == torch.float32
        self._single_row = w.t().contiguous() if keep_row else None
        self.min_rows = min_rows

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight (unpacked anew unless a dense copy is kept)."""
        if self._dense is not None:
            return self._dense
        if self._single_row is not None:
            return self._single_row.t()
        return self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self._packed.dtype:  # bf16 weights under fp32 activations
            return self._forward(x.to(self._packed.dtype)).to(x.dtype)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._single_row is not None and x.dim() == 2 and x.shape[0] == 1:
            y = x @ self._single_row  # [1, out]
            return y if self.bias is None else y + self.bias
        if x.dim() == 2 and x.shape[0] == 2 < self.min_rows:
            pad = x.new_zeros(self.min_rows - 2, x.shape[1])
            return self._packed_product(torch.cat([x, pad]))[:2]  # [2, out]
        return self._packed_product(x)

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, self._packed, self.bias, self._post_op, [], self._algorithm
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation}"
        )


def pack_linears(
    model: nn.Module,
    batch_hint: int,
    activations: dict[str, str] | None = None,
    single_row: bool | frozenset[str] = False,
    min_rows: int = 1,
) -> int:
    """Replace every ``nn.Linear`` in `model` whose weight `can_pack` with a `PackedLinear`,
    in place; returns how many were replaced (0 where packing is unavailable).

    activations: module name (as in ``named_modules``) → activation to fuse into that layer;
    the caller must then skip applying it itself. single_row: the layers (all when True,
    else these names) that also keep a copy for one-row inputs (see `PackedLinear`).
    min_rows: two-row inputs padded to it (see `PackedLinear`). With either, the copies and
    the padding stay only where they are faster on this CPU (`tune_few_rows`, measured
    once here over the packed layers).
    """
    activations = activations or {}
    linears = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    if not linears or not can_pack(linears[0][1].weight):
        return 0
    linear_ids = {id(m) for _, m in linears}
    shared = {
        id(p)
        for m in model.modules()
        if id(m) not in linear_ids
        for p in m.parameters(recurse=False)
    }
    packed = 0
    layers: list[PackedLinear] = []
    for name, module in linears:
        if not can_pack(module.weight):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(
            parent,
            attr,
            PackedLinear(
                module,
                batch_hint,
                activation=activations.get(name, "none"),
                keep_dense=id(module.weight) in shared,
                single_row=name in single_row if isinstance(single_row, frozenset) else single_row,
                min_rows=min_rows,
            ),
        )
        layers.append(getattr(parent, attr))
        packed += 1
    tune_few_rows(layers, min_rows)  # measures only when there is a choice to make
    return packed


_ROW_PROBE_REPEATS = 3


def few_row_costs(layers: list[PackedLinear], pad_to: int) -> dict[str, float]:
    """Seconds of one sweep over `layers` in order (as a decode step streams them) at the
    few rows decoding and verification pass: ``"mkl 1"`` one row through the kept ``W.T``
    copies (absent when no layer keeps one), ``"packed n"`` n rows through the packed
    kernel for n = 1, 2 and `pad_to`. The fastest of `_ROW_PROBE_REPEATS` interleaved
    sweeps of each; a model whose weights outgrow the cache streams them from memory, as
    decoding does. ~12 decode steps' products (~0.3 s for SmolLM2-135M on one thread)."""
    rowed = [layer for layer in layers if layer._single_row is not None]
    sizes = sorted({1, 2, pad_to})
    shapes = {(layer.in_features, layer._packed.dtype) for layer in layers}
    inputs = {(n, f, d): torch.ones(n, f, dtype=d) for n in sizes for f, d in shapes}

    def row(n: int, layer: PackedLinear) -> torch.Tensor:
        return inputs[n, layer.in_features, layer._packed.dtype]

    sweeps: dict[str, tuple[list[PackedLinear], Callable[[PackedLinear], object]]] = {}
    if rowed:
        sweeps["mkl 1"] = (rowed, lambda layer: row(1, layer) @ layer._single_row)
    for n in sizes:
        sweeps[f"packed {n}"] = (layers, lambda layer, n=n: layer._packed_product(row(n, layer)))
    with torch.inference_mode():
        for todo, run in sweeps.values():  # first calls: oneDNN builds its kernels
            run(todo[0])
        return fastest(
            {key: functools.partial(_sweep, todo, run) for key, (todo, run) in sweeps.items()},
            _ROW_PROBE_REPEATS,
        )


def _sweep(layers: list[PackedLinear], run: Callable[[PackedLinear], object]) -> None:
    for layer in layers:
        run(layer)


def tune_few_rows(layers: list[PackedLinear], pad_to: int) -> int:
    """Choose, by `few_row_costs` on this CPU, how `layers` run the few rows of decoding:
    keep the one-row ``W.T`` copies only where MKL runs one row faster than the packed
    kernel (else drop them: half the weight memory), and pad two-row inputs to `pad_to`
    rows only where `pad_to` rows cost less than two. Returns the rows few-row passes
    should be padded to (`pad_to`, or 1: no padding), which callers that can pad a whole
    pass (`rose.runner`) follow too. The paths compute the same products (a few ulps
    apart), so only speed and memory depend on the choice."""
    if not layers or (pad_to <= 2 and all(layer._single_row is None for layer in layers)):
        return 1  # nothing to choose
    costs = few_row_costs(layers, pad_to)
    keep_copies = costs.get("mkl 1", float("inf")) < costs["packed 1"]
    pad = pad_to if pad_to > 2 and costs[f"packed {pad_to}"] < costs["packed 2"] else 1
    log.info(
        "few-row products on this CPU (ms per sweep of %d layers): %s; one-row W.T copies "
        "%s, two-row inputs %s",
        len(layers),
        ", ".join(f"{k} {v * 1e3:.2f}" for k, v in costs.items()),
        "kept" if keep_copies else "dropped",
        f"padded to {pad}" if pad > 1 else "not padded",
    )
    for layer in layers:
        if not keep_copies:
            layer._single_row = None
        layer.min_rows = pad
    return pad


# The product `bf16_speedup` times: an encoder MLP's shape at a pass's row count.
PROBE_SHAPE = (512, 1024, 1024)  # rows, in, out
_PROBE_REPEATS = 5


@functools.cache
def bf16_speedup() -> float:
    """How many times faster oneDNN's packed bf16 product runs than its packed fp32 product
    on this CPU, at the current thread count (0.0 where bf16 weights cannot be packed).

    Measured once per process (30-90 ms, packing included): the fastest of `_PROBE_REPEATS`
    interleaved runs of each on a [512, 1024] x [1024, 1024] product. A loaded machine slows both alike; the CPUs
    this decides between sit far from 1 on either side (module docstring)."""
    rows, n_in, n_out = PROBE_SHAPE
    probe = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=probe)
    x = torch.randn(rows, n_in, generator=probe)
    if not (can_pack(weight) and can_pack(weight.bfloat16())):
        return 0.0
    layers = {}
    for dtype in (torch.float32, torch.bfloat16):
        linear = nn.Linear(n_in, n_out, bias=False, dtype=dtype).requires_grad_(False)
        linear.weight.copy_(weight)
        layers[dtype] = (PackedLinear(linear, batch_hint=rows), x.to(dtype))
    with torch.inference_mode():
        for layer, inputs in layers.values():
            layer(inputs)  # first call: oneDNN builds its kernel
        best = fastest(
            {dtype: functools.partial(layer, inputs) for dtype, (layer, inputs) in layers.items()},
            _PROBE_REPEATS,
        )
    return best[torch.float32] / best[torch.bfloat16]


def fastest(runs: dict[K, Callable[[], object]], repeats: int) -> dict[K, float]:
    """The fastest of `repeats` timed calls of each of `runs`, interleaved (each round
    calls every run once), so that a change in machine load hits all of them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - start)
    return best
