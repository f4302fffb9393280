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
from rose.attention.sdpa import SdpaBackend, choose_sdpa_strategy

__all__ = [
    "FLASHINFER_HEAD_DIMS",
    "AttentionBackend",
    "AttentionChoice",
    "AttentionInputs",
    "FlashInferBackend",
    "SdpaBackend",
    "choose_sdpa_strategy",
    "flashinfer_coverage",
    "head_dim_unsupported",
    "select_backend",
]

log = logging.getLogger("rose.attention")


@dataclass(frozen=True)
class AttentionChoice:
    backend: AttentionBackend
    reason: str


def select_backend(
    requested: str | None,
    sdpa_strategy: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
) -> AttentionChoice:
    """Pick the attention backend for one engine and log the choice (once per engine).

    FlashInfer is tried on CUDA in fp16/bf16 for the head dims its kernels take
    (`FLASHINFER_HEAD_DIMS`, checked before anything is imported or compiled) when
    `requested` is None or "flashinfer"; it must import and pass a small probe against SDPA,
    else SDPA is used and the reason logged. Nothing here raises for a fallback: a check
    that claims FlashInfer asserts it with `flashinfer_coverage`.
    num_kv_heads: key/value heads (grouped-query attention; None: num_heads). causal: each
    token attends to its row's tokens up to itself only.
    """
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    choice = _select(requested, sdpa_strategy, device, dtype, num_heads, head_dim, kv_heads, causal)
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
) -> AttentionChoice:
    sdpa = SdpaBackend(sdpa_strategy, device.type, causal=causal)
    if requested == "sdpa":
        return AttentionChoice(sdpa, "requested")
    if device.type != "cuda":
        return AttentionChoice(sdpa, "FlashInfer needs CUDA" if requested else "CPU")
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


def _probe(
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    kv_heads: int | None = None,
) -> None:
    """Run two ragged rows through `backend` and through SDPA; raise if they disagree."""
    cu = np.array([0, 5, 12], dtype=np.int32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(12, n, head_dim, generator=gen).to(device=device, dtype=dtype)
        for n in (heads, kv_heads or heads, kv_heads or heads)
    )
    seg = torch.tensor([0] * 5 + [1] * 7, device=device)
    inputs = AttentionInputs(torch.from_numpy(cu).to(device), seg)
    got = backend.attend(q, k, v, backend.prepare(backend.plan(cu), inputs)).float()
    for start, end in ((0, 5), (5, 12)):
        want = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).float() for t in (q, k, v)),
            is_causal=backend.causal,
            enable_gqa=q.shape[1] != k.shape[1],
        ).transpose(0, 1)
        err = (got[start:end] - want).abs().max().item()
        if not err < 2e-2:
            raise RuntimeError(f"max abs diff {err:.3g} vs SDPA")
