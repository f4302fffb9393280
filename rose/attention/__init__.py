"""Attention backends behind one interface (`AttentionBackend`) and the choice between them.

These serve the encoders' ragged non-causal passes. The decoders' causal passes over a
paged KV cache have their own kernel contract in `rose.attention.paged`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rose.attention.base import AttentionBackend, AttentionInputs
from rose.attention.flashinfer import FlashInferBackend, import_flashinfer
from rose.attention.sdpa import SdpaBackend, choose_sdpa_strategy

__all__ = [
    "AttentionBackend",
    "AttentionChoice",
    "AttentionInputs",
    "FlashInferBackend",
    "SdpaBackend",
    "choose_sdpa_strategy",
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
) -> AttentionChoice:
    """Pick the attention backend for one engine and log the choice (once per engine).

    FlashInfer is tried on CUDA in fp16/bf16 when `requested` is None or "flashinfer"; it must
    import and pass a small probe against SDPA, else SDPA is used and the reason logged.
    """
    choice = _select(requested, sdpa_strategy, device, dtype, num_heads, head_dim)
    log.info("rose attention backend: %s (%s)", choice.backend.describe(), choice.reason)
    return choice


def _select(
    requested: str | None,
    sdpa_strategy: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    head_dim: int,
) -> AttentionChoice:
    sdpa = SdpaBackend(sdpa_strategy, device.type)
    if requested == "sdpa":
        return AttentionChoice(sdpa, "requested")
    if device.type != "cuda":
        return AttentionChoice(sdpa, "FlashInfer needs CUDA" if requested else "CPU")
    if dtype not in (torch.float16, torch.bfloat16):
        return AttentionChoice(sdpa, f"FlashInfer needs fp16/bf16, model runs in {dtype}")
    module, why = import_flashinfer()
    if module is None:
        return AttentionChoice(sdpa, f"FlashInfer unavailable ({why})")
    try:
        backend = FlashInferBackend(module, device, dtype, num_heads, head_dim)
        _probe(backend, device, dtype, num_heads, head_dim)
    except Exception as exc:
        return AttentionChoice(sdpa, f"FlashInfer failed its probe ({type(exc).__name__}: {exc})")
    return AttentionChoice(backend, "FlashInfer ragged prefill")


def _probe(
    backend: AttentionBackend, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    """Run two ragged rows through `backend` and through SDPA; raise if they disagree."""
    cu = np.array([0, 5, 12], dtype=np.int32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(12, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        for _ in range(3)
    )
    seg = torch.tensor([0] * 5 + [1] * 7, device=device)
    inputs = AttentionInputs(torch.from_numpy(cu).to(device), seg)
    got = backend.attend(q, k, v, backend.prepare(backend.plan(cu), inputs)).float()
    for start, end in ((0, 5), (5, 12)):
        want = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).float() for t in (q, k, v))
        ).transpose(0, 1)
        err = (got[start:end] - want).abs().max().item()
        if not err < 2e-2:
            raise RuntimeError(f"max abs diff {err:.3g} vs SDPA")
