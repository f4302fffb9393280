"""ONNX Runtime's attention kernel on the CPU (`rose.attention.onnxrt`) against SDPA.

The contract is SDPA's: bidirectional attention of each row over its own tokens. Operands
are what the models pass (strided views of one fused q/k/v projection, fp32 or bf16, grouped
key/value heads), rows are ragged with lengths from 1 to a few hundred, and every row is
compared with PyTorch's SDPA on that row alone in fp32: within 1e-5 for fp32 operands
(both compute in fp32; observed ~5e-7), 2e-2 for bf16 ones (the result is rounded to bf16,
whose step at |x| ~ 1-4 is 8e-3 to 3e-2; observed ~3e-3).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import tiny_configs
import torch
import torch.nn.functional as F
import transformers

from rose import Engine, EngineConfig, RaggedBatch
from rose.attention import AttentionInputs, OnnxRuntimeBackend, SdpaBackend, onnxrt, select_backend

CPU = torch.device("cpu")
LENGTHS = (1, 3, 17, 64, 130, 7, 300)
HEADS, HEAD_DIM = 4, 16


def _operands(
    lengths: tuple[int, ...], kv_heads: int, dtype: torch.dtype, seed: int = 0
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens and q, k, v as strided views of one [T, heads + 2 kv, D] projection."""
    cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(int(cu[-1]), HEADS + 2 * kv_heads, HEAD_DIM, generator=gen)
    q, k, v = fused.to(dtype).split([HEADS, kv_heads, kv_heads], dim=1)
    return cu, q, k, v


def _attend(backend: OnnxRuntimeBackend | SdpaBackend, cu: np.ndarray, q, k, v) -> torch.Tensor:  # type: ignore[no-untyped-def]
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.from_numpy(np.diff(cu)))
    inputs = AttentionInputs(torch.from_numpy(cu), seg)
    return backend.attend(q, k, v, backend.prepare(backend.plan(cu), inputs))


def _per_row_sdpa(cu: np.ndarray, q, k, v) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    out = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qb, kb, vb = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True).transpose(0, 1))
    return out


def _backend(strategy: str = "auto") -> OnnxRuntimeBackend:
    choice = select_backend("onnxruntime", strategy, CPU, torch.float32, HEADS, HEAD_DIM)
    assert isinstance(choice.backend, OnnxRuntimeBackend), choice.reason
    return choice.backend


@pytest.mark.parametrize("kv_heads", [HEADS, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_equals_sdpa_on_that_row_alone(
    dtype: torch.dtype, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 32 tokens and more run the kernel, one call each; shorter ones PyTorch's."""
    backend = _backend("per-sequence")
    cu, q, k, v = _operands(LENGTHS, kv_heads, dtype)
    assert not q.is_contiguous()  # the models' form: views of a fused projection
    calls = []
    run = backend._session.run_with_iobinding
    monkeypatch.setattr(backend._session, "run_with_iobinding", lambda b: calls.append(run(b)))
    got = _attend(backend, cu, q, k, v)
    assert len(calls) == sum(n >= onnxrt.MIN_KERNEL_TOKENS for n in LENGTHS) == 3
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, want in enumerate(_per_row_sdpa(cu, q, k, v)):
        start, end = int(cu[i]), int(cu[i + 1])
        torch.testing.assert_close(got[start:end].float(), want, atol=tol, rtol=0)


def test_tiny_rows_take_sdpas_block_diagonal_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen 4-token rows: one masked SDPA call beats sixteen kernel calls (SDPA's cost
    model), so the kernel is not called at all; the result is still right."""
    backend = _backend("auto")
    cu, q, k, v = _operands((4,) * 16, HEADS, torch.float32)
    assert backend.plan(cu).strategy == "block-diagonal"

    def refuse(*_: object) -> None:
        raise AssertionError("the ONNX Runtime kernel ran for a block-diagonal pass")

    monkeypatch.setattr(backend._session, "run_with_iobinding", refuse)
    got = _attend(backend, cu, q, k, v)
    for i, want in enumerate(_per_row_sdpa(cu, q, k, v)):
        torch.testing.assert_close(got[4 * i : 4 * i + 4], want, atol=1e-5, rtol=0)


def test_the_cpu_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import rose.attention as attention

    args = (CPU, torch.float32, HEADS, HEAD_DIM)
    for speedup in (1.9, 0.8):  # as measured on this CPU: reported, never flips the choice
        monkeypatch.setattr(attention, "kernel_speedup", lambda *_, x=speedup: x)
        default = select_backend(None, "auto", *args)
        assert default.backend.name == "onnxruntime"
        assert default.reason == f"CPU, ONNX Runtime MultiHeadAttention, {speedup:.2f}x SDPA"
    monkeypatch.undo()
    measured = attention.kernel_speedup(_backend(), HEADS, HEAD_DIM)
    assert 0.0 < measured < float("inf")
    causal = select_backend(None, "auto", *args, causal=True)
    assert causal.backend.name == "sdpa" and causal.backend.causal
    assert "causal" in causal.reason
    assert select_backend("sdpa", "auto", *args).backend.name == "sdpa"
    asked = select_backend("onnxruntime", "auto", *args)
    assert (asked.backend.name, asked.reason) == ("onnxruntime", "requested")
    asked = select_backend("onnxruntime", "auto", CPU, torch.bfloat16, HEADS, HEAD_DIM)
    assert (asked.backend.name, asked.reason) == ("onnxruntime", "requested")
    with pytest.raises(ValueError, match="bidirectionally"):
        OnnxRuntimeBackend(None, HEADS, HEAD_DIM, 1, SdpaBackend(causal=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reduced_precision_engine_takes_sdpa_by_the_cpus_features_not_a_timing(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """bf16 / fp16 engines attend through PyTorch's kernel in their dtype on CPUs with AMX
    for it, else through ONNX Runtime's fp32 one, whatever a timing says: the choice was
    once timed at each load and two loads on one CPU could choose differently."""
    import rose.attention as attention

    args = (CPU, dtype, HEADS, HEAD_DIM)
    name = str(dtype).removeprefix("torch.")
    for amx in (True, False):
        monkeypatch.setattr(attention, "reduced_attention_pays", lambda dt, x=amx: x)
        for x in (0.47, 1.9):  # reported in the log line, never decides
            monkeypatch.setattr(attention, "kernel_speedup", lambda *_, x=x: x)
            choice = select_backend(None, "auto", *args)
            assert choice.backend.name == ("sdpa" if amx else "onnxruntime"), choice.reason
            if amx:
                assert not choice.backend.causal and choice.backend.compute_dtype is None
                assert choice.reason == f"CPU, {name} with AMX: PyTorch's kernel in {name}"
            else:
                assert choice.reason == f"CPU, ONNX Runtime MultiHeadAttention, {x:.2f}x SDPA"
    monkeypatch.undo()
    amx = {
        torch.bfloat16: torch.cpu._is_amx_tile_supported,
        torch.float16: torch.cpu._is_amx_fp16_supported,
    }
    assert attention.reduced_attention_pays(dtype) == amx[dtype]()
    assert not attention.reduced_attention_pays(torch.float32)


def test_an_int8_engine_attends_in_its_float_layers_dtype_on_amx_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fp32 engine given `attend_dtype` (int8's float layers in bf16) attends through
    SDPA computing in bf16 on its fp32 operands where the CPU has AMX, else through ONNX
    Runtime's fp32 kernel; the SDPA backend returns fp32 rows as close to fp32 attention as
    bf16 allows."""
    import rose.attention as attention

    asked: list[torch.dtype] = []

    def pays(dt: torch.dtype, *, x: bool) -> bool:
        asked.append(dt)
        return x

    args = (CPU, torch.float32, HEADS, HEAD_DIM)
    for x, want in ((True, "sdpa"), (False, "onnxruntime")):
        monkeypatch.setattr(attention, "reduced_attention_pays", functools.partial(pays, x=x))
        choice = select_backend(None, "auto", *args, attend_dtype=torch.bfloat16)
        assert choice.backend.name == want, (x, choice.reason)
    assert asked == [torch.bfloat16] * 2
    monkeypatch.setattr(attention, "reduced_attention_pays", functools.partial(pays, x=True))
    chosen = select_backend(None, "auto", *args, attend_dtype=torch.bfloat16).backend
    assert chosen.describe() == "sdpa (auto, in bfloat16)"
    for fp32 in (None, torch.float32):  # without a reduced dtype: fp32, not asked
        plain = select_backend(None, "auto", *args, attend_dtype=fp32)
        assert plain.backend.name == "onnxruntime"
    assert asked == [torch.bfloat16] * 3
    lengths = [40, 3, 2, 60]  # per-sequence and block-diagonal plans both cast
    q, k, v = torch.randn(sum(lengths), 3, HEADS, HEAD_DIM).unbind(1)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    inputs = AttentionInputs(torch.from_numpy(cu), seg)
    for strategy in ("per-sequence", "block-diagonal"):
        exact = SdpaBackend(strategy)
        want = exact.attend(q, k, v, exact.prepare(exact.plan(cu), inputs))
        bf16 = SdpaBackend(strategy, compute_dtype=torch.bfloat16)
        got = bf16.attend(q, k, v, bf16.prepare(bf16.plan(cu), inputs))
        assert got.dtype == torch.float32 and got.shape == q.shape
        err = (got - want).abs().max().item()
        assert 0.0 < err < 2e-2, strategy  # bf16's rounding, not fp32's result


def test_a_kernel_that_disagrees_with_sdpa_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time probe feeds strided views, as the models do: handing them to the kernel
    without the contiguous copy (it reads its operands as dense [L, heads * D] rows) gives
    wrong results, and the probe refuses the kernel for SDPA, saying why."""
    monkeypatch.setattr(onnxrt, "_contiguous_fp32", lambda t: t.float())
    choice = select_backend("onnxruntime", "auto", CPU, torch.float32, HEADS, HEAD_DIM)
    assert choice.backend.name == "sdpa"
    assert choice.reason.startswith(
        "CPU, ONNX Runtime failed its probe (RuntimeError: max abs diff"
    )


def test_missing_onnxruntime_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    import rose.attention as attention

    monkeypatch.setattr(attention, "import_onnxruntime", lambda: (None, "ImportError: gone"))
    choice = select_backend("onnxruntime", "auto", CPU, torch.float32, HEADS, HEAD_DIM)
    assert choice.backend.name == "sdpa"
    assert choice.reason == "CPU, ONNX Runtime unavailable (ImportError: gone)"


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(25)
    model = transformers.XLMRobertaModel(tiny_configs.xlmr(), add_pooling_layer=False).eval()
    path = tmp_path_factory.mktemp("ort-xlmr")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_engine_embeddings_equal_the_sdpa_engines(xlmr, dtype: str | None) -> None:  # type: ignore[no-untyped-def]
    """Whole encoder passes, ragged rows: the engine on ONNX Runtime's kernel against the
    same engine on SDPA, fp32 within 1e-5 and bf16 within 1e-2 (unit vectors)."""
    _, path = xlmr
    rng = np.random.default_rng(3)
    rows = [[0, *rng.integers(3, tiny_configs.VOCAB, n - 2).tolist(), 2] for n in (2, 40, 90, 5)]
    batch = RaggedBatch.from_lists(rows)
    config = dict(dtype=dtype, accuracy_gate=False)
    ours = Engine.load(path, EngineConfig(attention="onnxruntime", **config))
    sdpa = Engine.load(path, EngineConfig(attention="sdpa", **config))
    assert (ours.attention.name, sdpa.attention.name) == ("onnxruntime", "sdpa")
    torch.testing.assert_close(
        ours.step(batch).wait(),
        sdpa.step(batch).wait(),
        atol=1e-5 if dtype is None else 1e-2,
        rtol=0,
    )
