"""What must hold before ROSE's GPU paths meet a GPU (#26), checked on the CPU through fakes,
then on CUDA by the hazard probes that `bench/gpu_run.sh` runs (they skip without CUDA).

CPU: a check claiming FlashInfer fails when SDPA ran (`flashinfer_coverage`); head dims
FlashInfer rejects fall back before anything is imported; a wrapper is re-planned only after
its previous plan's copy ran (`PlanRing`, through fake wrappers and events that log the
order); tree passes get FA2 wrappers of their own; captures run in "thread_local" mode.
CUDA: a capture while another thread polls events; 32 pipelined steps over alternating
shapes against eager; a wrapper planned twice while the stream is busy."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from rose.attention import flashinfer_coverage, select_backend
from rose.attention.flashinfer import FlashInferBackend, PlanRing, import_flashinfer
from rose.attention.metadata import AttentionMetadata
from rose.attention.paged import (
    FlashInferPagedAttention,
    PagedLayout,
    _packbits_takes_host_indptr,
    paged_kernel_for,
)
from rose.graphs import CudaCaptureBackend
from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.spec.tree import DraftTree, tree_metadata

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


# -- 1. a check claiming FlashInfer cannot pass on SDPA ------------------------------------


def test_coverage_fails_when_flashinfer_imports_but_sdpa_ran(tmp_path: Path) -> None:
    from rose import Engine

    engine = Engine.load(_tiny_xlmr(tmp_path, heads=2))  # CPU: ONNX Runtime's kernel
    assert engine.attention.name == "onnxruntime"
    imports = (SimpleNamespace(__name__="flashinfer"), "")
    with pytest.raises(AssertionError, match="fell back"):
        flashinfer_coverage(engine.attention.name, imports)


def test_coverage_skips_with_the_reason_when_flashinfer_is_absent() -> None:
    why = flashinfer_coverage("sdpa", (None, "ModuleNotFoundError: No module named 'flashinfer'"))
    assert why == "FlashInfer unavailable (ModuleNotFoundError: No module named 'flashinfer')"


def test_coverage_passes_only_for_flashinfer() -> None:
    assert flashinfer_coverage("flashinfer", (None, "never asked")) is None
    assert flashinfer_coverage("flashinfer") is None  # without the import answer too


# -- 2. head dims FlashInfer rejects: SDPA, logged, before any import or probe ----------------


def _no_import() -> tuple[None, str]:
    raise AssertionError("FlashInfer was imported (and would have been probed)")


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96])
def test_unsupported_head_dims_fall_back_without_importing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, head_dim: int
) -> None:
    monkeypatch.setattr("rose.attention.import_flashinfer", _no_import)
    monkeypatch.setattr("rose.attention.paged.import_flashinfer", _no_import)
    with caplog.at_level("INFO", logger="rose.attention"):
        choice = select_backend(None, "auto", CUDA, torch.bfloat16, 12, head_dim)
    why = f"FlashInfer takes head_dim 64/128/256, the model has {head_dim}"
    assert choice.backend.name == "sdpa" and choice.reason == why
    assert [r.getMessage() for r in caplog.records] == [
        f"rose attention backend: {choice.backend.describe()} ({why})"
    ]
    assert paged_kernel_for(CUDA, torch.bfloat16, 8, 2, head_dim) == (None, why)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_supported_head_dims_go_on_to_import(
    monkeypatch: pytest.MonkeyPatch, head_dim: int
) -> None:
    absent = (None, "ModuleNotFoundError: absent")
    monkeypatch.setattr("rose.attention.import_flashinfer", lambda: absent)
    monkeypatch.setattr("rose.attention.paged.import_flashinfer", lambda: absent)
    choice = select_backend(None, "auto", CUDA, torch.bfloat16, 4, head_dim)
    assert choice.reason == "FlashInfer unavailable (ModuleNotFoundError: absent)"
    kernel, why = paged_kernel_for(CUDA, torch.bfloat16, 4, 2, head_dim)
    assert kernel is None and why.startswith("flashinfer does not import")


# -- fakes: FlashInfer wrappers and CUDA events that write one shared log ------------------


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, ...]] = []
        self.wrappers: list[Any] = []


class _FakeEvent:
    def __init__(self, log: _Log) -> None:
        self.log, self.id = log, sum(line[0] == "new event" for line in log.lines)
        log.lines.append(("new event", f"e{self.id}"))

    def record(self) -> None:
        self.log.lines.append(("record", f"e{self.id}"))

    def synchronize(self) -> None:
        self.log.lines.append(("sync", f"e{self.id}"))


class _FakeWrapper:
    """Stands in for FlashInfer's wrappers: records its construction and every plan/run."""

    log: _Log

    def __init__(self, workspace: torch.Tensor, layout: str, **kwargs: Any) -> None:
        self.name = f"w{len(self.log.wrappers)}"
        self.kwargs = kwargs
        self.plans: list[dict[str, Any]] = []
        self.log.wrappers.append(self)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.plans.append({"args": args, **kwargs})
        self.log.lines.append(("plan", self.name))

    def run(self, q: torch.Tensor, *_: Any) -> torch.Tensor:
        self.log.lines.append(("run", self.name))
        return q


def _fake_flashinfer(log: _Log) -> SimpleNamespace:
    wrapper = type("FakeWrapper", (_FakeWrapper,), {"log": log})
    return SimpleNamespace(
        BatchPrefillWithRaggedKVCacheWrapper=wrapper, BatchPrefillWithPagedKVCacheWrapper=wrapper
    )


def _assert_replans_wait(log: _Log) -> None:
    """Every plan of a wrapper after its first comes after a sync on the event recorded right
    after that wrapper's previous plan (its copy to the device has run)."""
    last_event: dict[str, str] = {}  # wrapper → event recorded after its last plan
    synced: set[str] = set()
    lines = log.lines
    for i, (what, *who) in enumerate(lines):
        if what == "sync":
            synced.add(who[0])
        elif what == "plan":
            name = who[0]
            if name in last_event:
                assert last_event[name] in synced, f"{name} re-planned before its copy ran"
            assert lines[i + 1][0] == "record", "an event is recorded right after each plan"
            last_event[name] = lines[i + 1][1]
            synced.discard(lines[i + 1][1])


# -- 5. re-planning waits for the previous plan's copy ---------------------------------------


def test_plan_ring_alternates_and_waits_before_replanning() -> None:
    log = _Log()
    wrapper = type("FakeWrapper", (_FakeWrapper,), {"log": log})
    ring = PlanRing(lambda: wrapper(torch.empty(0), "NHD"), 2, lambda: _FakeEvent(log))
    used = [ring.plan(i).name for i in range(5)]
    assert used == ["w0", "w1", "w0", "w1", "w0"]
    assert log.lines[:2] == [("new event", "e0"), ("new event", "e1")]
    assert log.lines[2:] == [
        ("plan", "w0"), ("record", "e0"),
        ("plan", "w1"), ("record", "e1"),
        ("sync", "e0"), ("plan", "w0"), ("record", "e0"),
        ("sync", "e1"), ("plan", "w1"), ("record", "e1"),
        ("sync", "e0"), ("plan", "w0"), ("record", "e0"),
    ]  # fmt: skip
    _assert_replans_wait(log)


def test_ragged_backend_replans_eager_and_graph_wrappers_only_after_their_copy() -> None:
    log = _Log()
    backend = FlashInferBackend(
        _fake_flashinfer(log),  # type: ignore[arg-type]
        torch.device("cpu"),
        torch.bfloat16,
        4,
        64,
        new_event=lambda: _FakeEvent(log),
    )
    cu = np.array([0, 5, 12])
    q = torch.zeros(12, 4, 64)
    for slot in (None, None, (4, 64), None, (4, 64), (4, 64), None):
        state = backend.plan(cu, slot=slot)
        backend.attend(q, q, q, state)
    eager = [w for w in log.wrappers if "use_cuda_graph" not in w.kwargs]
    graph = [w for w in log.wrappers if w.kwargs.get("use_cuda_graph")]
    assert len(eager) == 2 and len(graph) == 1  # two eager wrappers; one per graph slot
    assert [len(w.plans) for w in eager] == [2, 2] and len(graph[0].plans) == 3
    _assert_replans_wait(log)
    backend.release((4, 64))  # dropping a slot's wrapper waits for its last copy first
    assert log.lines[-1][0] == "sync"


# -- 3. draft trees: a wrapper per mask kind, FA2 for the masked ones -------------------------


def _tree_and_causal_metas() -> list[AttentionMetadata]:
    alloc = PageAllocator(32)
    tables = [BlockTable(alloc, 4) for _ in range(2)]
    for t in tables:
        t.reserve(12)
    prefill = AttentionMetadata.build([(tables[0], 0, 7), (tables[1], 0, 5)])
    verify = AttentionMetadata.build([(tables[0], 7, 1), (tables[1], 5, 4)])
    tree = tree_metadata(verify, [(1, 5, 1, DraftTree([5, 6], [[7], []]))])
    decode = AttentionMetadata.build([(tables[0], 8, 1), (tables[1], 9, 1)])
    return [prefill, tree, decode, tree, tree, prefill]


def test_tree_passes_get_fa2_wrappers_of_their_own() -> None:
    log = _Log()
    kernel = FlashInferPagedAttention(
        _fake_flashinfer(log), torch.device("cpu"), torch.bfloat16, 4, 2, 64,
        new_event=lambda: _FakeEvent(log),
    )  # fmt: skip
    for meta in _tree_and_causal_metas():
        plan = kernel.plan(meta)
        plan.run(torch.zeros(meta.num_tokens, 4, 64), torch.zeros(0), torch.zeros(0))
    backends = {w.name: w.kwargs["backend"] for w in log.wrappers}
    assert sorted(backends.values()) == ["auto", "auto", "fa2", "fa2"]
    for w in log.wrappers:
        assert w.plans, f"{w.name} never planned: the ring alternates"
        masked = [p["custom_mask"] is not None for p in w.plans]
        # a wrapper only ever sees one mask kind: "auto" can fix itself to FA3 on a causal
        # first plan, which has no custom masks
        assert masked == [w.kwargs["backend"] == "fa2"] * len(w.plans)
        assert all(p["causal"] == (p["custom_mask"] is None) for p in w.plans)
    tree_plan = next(p for w in log.wrappers for p in w.plans if p["custom_mask"] is not None)
    tree_meta = _tree_and_causal_metas()[1]
    want = PagedLayout.from_metadata(tree_meta).custom_mask
    assert torch.equal(tree_plan["custom_mask"], want)
    _assert_replans_wait(log)
    # each plan's wrapper is the one its pass runs on
    runs = [line for line in log.lines if line[0] in ("plan", "run")]
    assert all(runs[i][1] == runs[i + 1][1] for i in range(0, len(runs), 2))


def test_mask_indptr_device_rule_read_off_flashinfer() -> None:
    class Fixed:
        def plan(self, custom_mask: torch.Tensor, mask_indptr: torch.Tensor) -> None:
            _ = mask_indptr.to(custom_mask.device)

    class Old:
        def plan(self, custom_mask: torch.Tensor, mask_indptr: torch.Tensor) -> None:
            _ = (custom_mask, mask_indptr)

    assert _packbits_takes_host_indptr(Fixed)
    assert not _packbits_takes_host_indptr(Old)
    assert not _packbits_takes_host_indptr(SimpleNamespace(plan=len))  # no source: safe path


# -- 4. captures in thread_local mode --------------------------------------------------------


class _CudaRecorder:
    """Stands in for the torch.cuda namespace: records what the capture backend calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def graph_pool_handle(self) -> str:
        return "pool"

    def CUDAGraph(self) -> SimpleNamespace:  # noqa: N802 (torch's name)
        return SimpleNamespace(replay=lambda: self.calls.append(("replay", None)))

    def graph(self, graph: Any, **kwargs: Any) -> Any:
        self.calls.append(("graph", kwargs))
        return _Context(self, "capture")

    def Stream(self) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(wait_stream=lambda s: self.calls.append(("side waits", s)))

    def current_stream(self) -> SimpleNamespace:
        return SimpleNamespace(wait_stream=lambda s: self.calls.append(("main waits", "side")))

    def stream(self, s: Any) -> Any:
        return _Context(self, "on side stream")


class _Context:
    def __init__(self, rec: _CudaRecorder, what: str) -> None:
        self.rec, self.what = rec, what

    def __enter__(self) -> None:
        self.rec.calls.append((f"enter {self.what}", None))

    def __exit__(self, *_: object) -> None:
        self.rec.calls.append((f"exit {self.what}", None))


def test_cuda_capture_is_thread_local_into_the_shared_pool() -> None:
    rec = _CudaRecorder()
    backend = CudaCaptureBackend(cuda=rec)
    ran: list[str] = []
    backend.warmup((1, 64), lambda: ran.append("warmup"))
    handle = backend.capture((1, 64), lambda: ran.append("capture"))
    backend.replay((1, 64), handle)
    assert ran == ["warmup", "capture"]
    graph_calls = [kw for name, kw in rec.calls if name == "graph"]
    assert graph_calls == [{"pool": "pool", "capture_error_mode": "thread_local"}]
    names = [name for name, _ in rec.calls]
    assert names == [
        "side waits", "enter on side stream", "exit on side stream", "main waits",
        "graph", "enter capture", "exit capture", "replay",
    ]  # fmt: skip


# -- CUDA probes (bench/gpu_run.sh stage "hazards"; skipped without CUDA) -----------------


def _tiny_xlmr(where: Path, heads: int = 2, hidden: int = 128) -> Path:
    """A random XLM-R encoder; hidden / heads is the head dim (64 by default)."""
    torch.manual_seed(3)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=100,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=300,
        type_vocab_size=1,
        pad_token_id=1,
    )
    transformers.XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(where)
    return where


def _batches(n: int) -> list[Any]:
    from rose import RaggedBatch

    rng = np.random.default_rng(0)
    shapes = ([16], [5, 60, 33], [200, 7, 7, 90, 1], [40, 41])
    return [
        RaggedBatch.from_lists([rng.integers(3, 100, k).tolist() for k in shapes[i % len(shapes)]])
        for i in range(n)
    ]


@needs_cuda
@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_cuda_capture_while_another_thread_polls_events(mode: str) -> None:
    """A thread polls and waits on events (as Tulip does on LazyTensors) while the main one
    captures: "thread_local" must capture and replay right; "global" is reported, not
    asserted (it fails only if a poll lands inside the capture)."""
    x = torch.randn(256, 256, device="cuda")
    stop = threading.Event()
    polls = [0]
    errors: list[str] = []

    def poll() -> None:
        while not stop.is_set():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.Stream())
            try:
                ev.query()
                ev.synchronize()
                polls[0] += 1
            except RuntimeError as exc:
                errors.append(str(exc))

    def run() -> torch.Tensor:
        y = x
        for _ in range(200):
            y = torch.tanh(y @ x) * 0.5
        return y

    want = run()
    torch.cuda.synchronize()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.05)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
        result = f"captured, max diff {(out - want).abs().max().item():.3g}"
    except RuntimeError as exc:
        result = f"capture failed: {exc}"
    finally:
        stop.set()
        poller.join(5)
    print(f"capture_error_mode={mode}: {result}; {polls[0]} polls, {len(errors)} poll errors")
    if mode == "thread_local":
        assert result.startswith("captured") and not errors
        torch.testing.assert_close(out, want)


@needs_cuda
@pytest.mark.parametrize("attention", ["sdpa", "flashinfer"])
def test_cuda_32_pipelined_steps_over_alternating_shapes_match_eager(
    tmp_path: Path, attention: str
) -> None:
    """32 steps enqueued before any is waited for (Tulip's pipelining: plans of later
    batches made while earlier ones are queued), shapes alternating so graph slots and the
    eager wrappers are re-planned under load; every result equals its eager one."""
    from rose import Engine, EngineConfig

    path = _tiny_xlmr(tmp_path)
    eager = Engine.load(
        path, EngineConfig(device="cuda", dtype="bfloat16", attention="sdpa", cuda_graphs=False)
    )
    batches = _batches(32)
    wants = [eager.step(b).wait() for b in batches]
    for graphs in (False, True):
        engine = Engine.load(
            path,
            EngineConfig(device="cuda", dtype="bfloat16", attention=attention, cuda_graphs=graphs),
        )
        if attention == "flashinfer" and (why := flashinfer_coverage(engine.attention.name)):
            pytest.skip(why)
        torch.cuda._sleep(50_000_000)  # keep the stream busy: plans run ahead of the GPU
        pending = [engine.step(b) for b in batches]
        for i, (lazy, want) in enumerate(zip(pending, wants, strict=True)):
            cos = torch.nn.functional.cosine_similarity(lazy.wait(), want, dim=-1).min().item()
            assert cos >= 0.999, f"step {i} (graphs {graphs}): cos {cos}"


@needs_cuda
def test_cuda_wrapper_planned_twice_while_the_stream_is_busy() -> None:
    """Plan, run, plan again, run again with the GPU held back, so both plans' copies are
    still queued when the second plan is made: through `FlashInferBackend` (its ring) both
    outputs are right; a bare single wrapper is reported (the hazard the ring avoids)."""
    flashinfer, why = import_flashinfer()
    if flashinfer is None:
        pytest.skip(f"FlashInfer unavailable ({why})")
    import torch.nn.functional as F

    heads, dim = 4, 64
    cus = [np.array([0, 5, 12], dtype=np.int32), np.array([0, 300, 301, 900], dtype=np.int32)]
    gen = torch.Generator().manual_seed(0)
    qkv = [
        [torch.randn(int(cu[-1]), heads, dim, generator=gen).cuda().bfloat16() for _ in range(3)]
        for cu in cus
    ]
    wants = []
    for cu, (q, k, v) in zip(cus, qkv, strict=True):
        rows = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            t = [x[a:b].transpose(0, 1).float() for x in (q, k, v)]
            rows.append(F.scaled_dot_product_attention(*t).transpose(0, 1))
        wants.append(torch.cat(rows))

    def twice(plan_run: Any) -> list[float]:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the copies below stay queued behind this
        outs = [plan_run(cu, q, k, v) for cu, (q, k, v) in zip(cus, qkv, strict=True)]
        return [(o.float() - w).abs().max().item() for o, w in zip(outs, wants, strict=True)]

    backend = FlashInferBackend(flashinfer, CUDA, torch.bfloat16, heads, dim)
    ring = twice(lambda cu, q, k, v: backend.attend(q, k, v, backend.plan(cu)))
    bare_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD"
    )

    def bare(cu: np.ndarray, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        indptr = torch.from_numpy(cu)
        bare_wrapper.plan(indptr, indptr, heads, heads, dim, q_data_type=torch.bfloat16)
        return bare_wrapper.run(q, k, v)

    print(f"plan twice: ring max errors {ring}; one bare wrapper {twice(bare)}")
    assert max(ring) < 2e-2, ring
