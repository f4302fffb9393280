"""Attention backends behind one interface (`AttentionBackend`) and the choice between them.

These serve the encoders' ragged passes (bidirectional, or causal for decoder-based embedders),
which see no KV cache. The decoders' passes over a paged KV cache have their own kernel
contract in `rose.attention.paged`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend, AttentionInputs
from rose.attention.flashinfer import (
    FLASHINFER_HEAD_DIMS,
    FlashInferBackend,
    flashinfer_coverage,
    head_dim_unsupported,
    import_flashinfer,
)
from rose.attention.onnxrt import OnnxRuntimeBackend, import_onnxruntime, kernel_speedup
from rose.attention.sdpa import SdpaBackend, choose_sdpa_strategy

__all__ = [
    "FLASHINFER_HEAD_DIMS",
    "AttentionBackend",
    "AttentionChoice",
    "AttentionInputs",
    "FlashInferBackend",
    "OnnxRuntimeBackend",
    "SdpaBackend",
    "choose_sdpa_strategy",
    "flashinfer_coverage",
    "head_dim_unsupported",
    "reduced_attention_pays",
    "select_backend",
]

log = logging.getLogger("rose.attention")


@dataclass(frozen=True)
class AttentionChoice:
    backend: AttentionBackend
    reason: str


def reduced_attention_pays(dtype: torch.dtype) -> bool:
    """Whether PyTorch's CPU attention kernel in `dtype` (bf16 / fp16) beats ONNX Runtime's
    fp32 one on this CPU: only where the CPU has AMX tiles for it (Sapphire Rapids and later
    for bf16, ~2x: 2.1 against 4.5 ms for a 512-token row, 12 heads x 32; AMX-FP16 for fp16).
    Elsewhere (AMD Zen 4/5, Xeons without AMX) it is no faster on real passes (732 vs 765 ms
    for 8 x 512 tokens on Zen 4, bench/results/engine.md). A CPU feature, not a timing:
    the choice was once timed at each load, and a 256-token probe on Zen 4 measured 0.65-0.81
    of ONNX Runtime's time around a 0.75 bar, so two replicas of one model could attend with
    different kernels and answer the same text with vectors 1e-4 apart."""
    if dtype == torch.bfloat16:
        return bool(torch.cpu._is_amx_tile_supported())
    if dtype == torch.float16:
        return bool(torch.cpu._is_amx_fp16_supported())
    return False


def select_backend(
    requested: str | None,
    sdpa_strategy: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    attend_dtype: torch.dtype | None = None,
) -> AttentionChoice:
    """Pick the attention backend for one engine and log the choice (once per engine).

    On the CPU, bidirectional passes go to ONNX Runtime's attention kernel
    (`OnnxRuntimeBackend`, about twice PyTorch's CPU flash kernel on AMD Zen 5) when
    `requested` is None or "onnxruntime", provided it imports and passes the probe (the
    log line reports its speed against SDPA on this CPU, `kernel_speedup`), except bf16 /
    fp16 engines, and fp32 engines given an `attend_dtype` (int8 ones: their float layers'
    dtype), on CPUs where PyTorch's kernel in that dtype is faster (`reduced_attention_pays`:
    AMX, a CPU feature, so every load and every replica on a CPU chooses alike); causal
    ones go to SDPA.
    FlashInfer is tried on CUDA in fp16/bf16 for the head dims its kernels take
    (`FLASHINFER_HEAD_DIMS`, checked before anything is imported or compiled) when
    `requested` is None or "flashinfer"; it must import and pass a small probe against SDPA,
    else SDPA is used and the reason logged. Nothing here raises for a fallback: a check
    that claims FlashInfer asserts it with `flashinfer_coverage`.
    num_kv_heads: key/value heads (grouped-query attention; None: num_heads). causal: each
    token attends to its row's tokens up to itself only. attend_dtype: a reduced dtype an
    fp32 CPU engine may attend in (None or fp32: it attends in fp32).
    """
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    choice = _select(
        requested, sdpa_strategy, device, dtype, num_heads, head_dim, kv_heads, causal, attend_dtype
    )
    log.info("rose attention backend: %s (%s)", choice.backend.describe(), choice.reason)
    return choice


def _select(
    requested: str | None,
    sdpa_strategy: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    causal: bool,
    attend_dtype: torch.dtype | None,
) -> AttentionChoice:
    sdpa = SdpaBackend(sdpa_strategy, device.type, causal=causal)
    if requested == "sdpa":
        return AttentionChoice(sdpa, "requested")
    if device.type == "cpu" and requested in (None, "onnxruntime"):
        timed = requested is None
        return _cpu(sdpa, dtype, num_heads, head_dim, num_kv_heads, causal, timed, attend_dtype)
    if device.type != "cuda":
        return AttentionChoice(sdpa, "FlashInfer needs CUDA" if requested else "CPU")
    if requested == "onnxruntime":
        return AttentionChoice(sdpa, "ONNX Runtime's attention serves the CPU")
    if dtype not in (torch.float16, torch.bfloat16):
        return AttentionChoice(sdpa, f"FlashInfer needs fp16/bf16, model runs in {dtype}")
    if why := head_dim_unsupported(head_dim):
        return AttentionChoice(sdpa, why)
    module, why = import_flashinfer()
    if module is None:
        return AttentionChoice(sdpa, f"FlashInfer unavailable ({why})")
    try:
        backend = FlashInferBackend(
            module, device, dtype, num_heads, head_dim, num_kv_heads=num_kv_heads, causal=causal
        )
        _probe(backend, device, dtype, num_heads, head_dim, num_kv_heads)
    except Exception as exc:
        return AttentionChoice(sdpa, f"FlashInfer failed its probe ({type(exc).__name__}: {exc})")
    return AttentionChoice(backend, "FlashInfer ragged prefill")


def _cpu(
    sdpa: SdpaBackend,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    causal: bool,
    timed: bool,
    attend_dtype: torch.dtype | None,
) -> AttentionChoice:
    """ONNX Runtime's kernel for a bidirectional CPU engine when it imports and agrees with
    SDPA; when it was not asked for by name (`timed`), PyTorch's kernel in a reduced dtype
    (the engine's, or `attend_dtype`) where that pays (`reduced_attention_pays`), else
    ONNX Runtime's with its speed against SDPA measured for the log line."""
    if causal:
        return AttentionChoice(sdpa, "CPU, causal: PyTorch's causal kernel skips masked blocks")
    module, why = import_onnxruntime()
    if module is None:
        return AttentionChoice(sdpa, f"CPU, ONNX Runtime unavailable ({why})")
    try:
        backend = OnnxRuntimeBackend(module, num_heads, head_dim, torch.get_num_threads(), sdpa)
        # rows long enough that the plan is per-sequence: the probe runs the kernel itself
        _probe(backend, torch.device("cpu"), dtype, num_heads, head_dim, num_kv_heads, (40, 60))
    except Exception as exc:
        return AttentionChoice(
            sdpa, f"CPU, ONNX Runtime failed its probe ({type(exc).__name__}: {exc})"
        )
    if not timed:
        return AttentionChoice(backend, "requested")
    reduced = dtype if dtype != torch.float32 else attend_dtype
    if reduced not in (None, torch.float32) and reduced_attention_pays(reduced):
        name = str(reduced).removeprefix("torch.")
        # an fp32 engine's SDPA casts its operands
        against = sdpa if reduced == dtype else SdpaBackend(sdpa.strategy, compute_dtype=reduced)
        return AttentionChoice(against, f"CPU, {name} with AMX: PyTorch's kernel in {name}")
    # The timing is reported, never decides (a model's backend must not flip between loads
    # or replicas), so a CPU where the kernel loses shows it in the log line.
    speedup = kernel_speedup(backend, num_heads, head_dim)
    return AttentionChoice(backend, f"CPU, ONNX Runtime MultiHeadAttention, {speedup:.2f}x SDPA")


def _probe(
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    kv_heads: int | None = None,
    lengths: tuple[int, int] = (5, 7),
) -> None:
    """Run two ragged rows through `backend` and through SDPA; raise if they disagree."""
    cu = np.array([0, lengths[0], sum(lengths)], dtype=np.int32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    kv = kv_heads or heads
    # q, k, v as the models make them: strided views of one fused projection
    qkv = torch.randn(int(cu[-1]), heads + 2 * kv, head_dim, generator=gen)
    q, k, v = qkv.to(device=device, dtype=dtype).split([heads, kv, kv], dim=1)
    seg = torch.tensor([0] * lengths[0] + [1] * lengths[1], device=device)
    inputs = AttentionInputs(torch.from_numpy(cu).to(device), seg)
    got = backend.attend(q, k, v, backend.prepare(backend.plan(cu), inputs)).float()
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).float() for t in (q, k, v)),
            is_causal=backend.causal,
            enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
        err = (got[start:end] - want).abs().max().item()
        if not err < 2e-2:
            raise RuntimeError(f"max abs diff {err:.3g} vs SDPA")
