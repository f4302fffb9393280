"""Bidirectional attention on the CPU through ONNX Runtime's ``MultiHeadAttention`` kernel.

PyTorch's CPU flash kernel runs its block products through MKL's sgemm (its AVX2 path on AMD
CPUs), and with the encoders' small heads (head_dim 32 for e5-small) it reaches ~60 GFLOP/s
on this project's AMD Zen 5. ONNX Runtime's contrib ``com.microsoft.MultiHeadAttention`` runs
MLAS's own kernels and computes the same attention in fp32 1.3x as fast at 64 tokens and
about 2x from 256 up there (one thread; bench/results/engine-zen5.md, "Attention kernels"),
in blocks: memory stays linear in the row (an 8,192-token row adds ~50 MB, not the 3 GB a
score matrix would take).

Contract: what `SdpaBackend` computes for bidirectional rows (same default scale
``1 / sqrt(head_dim)``, fp32 arithmetic, results equal to ~1e-6), one kernel call per row on
its own tokens, so rows never mix and no padding is computed; rows under `MIN_KERNEL_TOKENS`
go to PyTorch's kernel, whose call costs less. Passes where SDPA would take its
block-diagonal form (many very short rows, where one call beats one call per row) go to the
`SdpaBackend` given as ``fallback``. Causal passes are not its job (`rose.attention` keeps
them on SDPA): the kernel has no causal block skipping, so PyTorch's causal flash kernel is
faster from ~1,000 tokens on.

Operands are bound in place (``io_binding``): q, k, v are made contiguous ``[T, heads, D]``
fp32 once per layer (a copy of the fused QKV projection's views; bf16 activations are
widened, so the kernel computes in fp32 whatever the model's dtype), each row's slices are
``[1, L, heads * D]`` views of them, and the kernel writes each row's output straight into
the ``[T, heads, D]`` result. Grouped-query heads are repeated to the query heads first.
Threads: the session has as many intra-op threads as torch has when it is built, and they
sleep instead of spinning between calls, so they do not take cores from torch's OpenMP team.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from rose.attention.base import AttentionBackend, AttentionInputs
from rose.attention.sdpa import SdpaBackend, SdpaPlan

__all__ = ["MIN_KERNEL_TOKENS", "OnnxRuntimeBackend", "import_onnxruntime", "kernel_speedup"]

# Rows shorter than this go to PyTorch's kernel: a call here costs ~10 us more, which a row
# of 16 tokens does not win back (0.034 vs 0.027 ms; 32 tokens: 0.043 vs 0.051 ms; one
# thread, 12 heads x 32, bench/results/engine-zen5.md "Attention kernels").
MIN_KERNEL_TOKENS = 32

_PROBE_TOKENS = 256  # the row `kernel_speedup` times
_PROBE_REPEATS = 5


def import_onnxruntime() -> tuple[Any, str]:
    """(onnxruntime, "") when it imports with its CPU provider, else (None, why not)."""
    try:
        ort = importlib.import_module("onnxruntime")
        importlib.import_module("onnx")
    except Exception as exc:  # ImportError, or a broken wheel raising anything at import
        return None, f"{type(exc).__name__}: {exc}"
    if "CPUExecutionProvider" not in ort.get_available_providers():
        return None, "onnxruntime has no CPUExecutionProvider"
    return ort, ""


def _session(ort: Any, heads: int, head_dim: int, threads: int) -> Any:
    """A session whose graph is one ``MultiHeadAttention`` node over ``[B, S, heads * D]``
    fp32 q, k, v (any B and S)."""
    from onnx import TensorProto, helper

    width = heads * head_dim

    def value(name: str) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", "S", width])

    node = helper.make_node(
        "MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=heads
    )
    graph = helper.make_graph([node], "attention", [value(n) for n in "qkv"], [value("o")])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _contiguous_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous fp32 tensor, one copy at most (``Tensor.to`` returns a strided
    fp32 view unchanged, whatever ``memory_format`` says)."""
    if t.dtype == torch.float32:
        return t.contiguous()
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


class OnnxRuntimeBackend(AttentionBackend):
    """Bidirectional ragged attention, one ONNX Runtime kernel call per row (CPU);
    `fallback` takes the passes this kernel does not (see the module)."""

    name = "onnxruntime"

    def __init__(
        self, ort: Any, num_heads: int, head_dim: int, threads: int, fallback: SdpaBackend
    ) -> None:
        if fallback.causal:
            raise ValueError("OnnxRuntimeBackend attends bidirectionally only")
        self.graph_safe = False
        self.strategy = fallback.strategy  # the SDPA strategy its plans follow
        self._fallback = fallback
        self._width = num_heads * head_dim
        self._session = _session(ort, num_heads, head_dim, threads)

    def plan(self, host_cu_seqlens: np.ndarray, slot: Hashable | None = None) -> SdpaPlan:
        return self._fallback.plan(host_cu_seqlens, slot)

    def prepare(self, plan: SdpaPlan, inputs: AttentionInputs) -> Any:
        # a per-sequence plan is its own state; block-diagonal gets the fallback's mask
        return self._fallback.prepare(plan, inputs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Any) -> torch.Tensor:
        if not isinstance(state, SdpaPlan):  # block-diagonal: the fallback's masked call
            return self._fallback.attend(q, k, v, state)
        if k.shape[1] != q.shape[1]:  # grouped-query heads: the kernel wants one per query head
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)  # [T, heads, D]
            v = v.repeat_interleave(group, dim=1)
        short = tuple((s, e) for s, e in state.bounds if e - s < MIN_KERNEL_TOKENS)
        long = (b for b in state.bounds if b[1] - b[0] >= MIN_KERNEL_TOKENS)
        q32, k32, v32 = (_contiguous_fp32(t) for t in (q, k, v))  # [T, heads, D]
        out = torch.empty(q.shape, dtype=torch.float32)  # [T, heads, D]
        width, row_bytes = self._width, self._width * 4
        for start, end in long:
            shape = [1, end - start, width]
            binding = self._session.io_binding()
            for name, t in (("q", q32), ("k", k32), ("v", v32)):
                binding.bind_input(
                    name, "cpu", 0, np.float32, shape, t.data_ptr() + start * row_bytes
                )
            binding.bind_output(
                "o", "cpu", 0, np.float32, shape, out.data_ptr() + start * row_bytes
            )
            self._session.run_with_iobinding(binding)
        if short:  # PyTorch's kernel on the rows too short for this one to pay off
            alone = self._fallback.attend(q32, k32, v32, SdpaPlan("per-sequence", short))
            for start, end in short:
                out[start:end] = alone[start:end]
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def describe(self) -> str:
        return f"onnxruntime MultiHeadAttention, {self._fallback.describe()} for tiny rows"


def kernel_speedup(backend: OnnxRuntimeBackend, num_heads: int, head_dim: int) -> float:
    """How many times faster `backend` attends one fp32 row of `_PROBE_TOKENS` tokens than
    its SDPA fallback on this CPU, at the current thread count: the fastest of
    `_PROBE_REPEATS` interleaved calls of each (~10 ms in all for e5-small's heads).
    Reported in the backend's log line, never deciding (the kernels were measured on AMD
    CPUs only, module docstring, so a CPU where this one loses shows it there)."""
    cu = np.array([0, _PROBE_TOKENS], dtype=np.int64)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(_PROBE_TOKENS, 3, num_heads, head_dim, generator=gen)
    q, k, v = qkv.unbind(1)
    inputs = AttentionInputs(torch.from_numpy(cu), torch.zeros(_PROBE_TOKENS, dtype=torch.long))
    contenders = (backend, backend._fallback)
    states = [b.prepare(b.plan(cu), inputs) for b in contenders]
    best = [float("inf")] * 2
    with torch.inference_mode():
        for b, state in zip(contenders, states, strict=True):
            b.attend(q, k, v, state)  # first calls: allocations, kernel set-up
        for _ in range(_PROBE_REPEATS):
            for i, (b, state) in enumerate(zip(contenders, states, strict=True)):
                start = time.perf_counter()
                b.attend(q, k, v, state)
                best[i] = min(best[i], time.perf_counter() - start)
    return best[1] / best[0]
