"""Lazy CUDA graphs keyed by (row bucket, token bucket).

A batch of B rows and T tokens runs in the slot of key (row_bucket(B), token_bucket(T)):
static device buffers sized for the bucket, padded on the host side. The first hit of a
key runs the pass eagerly on those buffers (warm-up), the second captures it, later hits
replay. Slots live in an LRU of at most `max_graphs`; evicting one frees its graph and
buffers.

The manager only decides and keeps the LRU; what capture means is a `CaptureBackend`:
`CudaCaptureBackend` uses torch.cuda graphs, `RecordingCaptureBackend` runs everything
eagerly and records the decisions (tests on machines without CUDA).

Captures happen lazily, under live traffic, so other threads make CUDA calls while one
runs: Tulip's event loop polls `LazyTensor.ready()` (``cudaEventQuery``) and its executor
threads block in ``event.synchronize()``. PyTorch captures in ``"global"`` error mode by
default, where such a call from *any* thread during a capture is an error that invalidates
the capture. `CudaCaptureBackend` captures in ``"thread_local"`` mode instead: only the
capturing thread's own unsafe calls are errors, and the capture itself makes none (plans
are made before it, `GraphManager.run`'s ``fill``). That was chosen over a lock around
captures shared with every poller: the pollers are event-loop code that must never block
on a capture (tens of milliseconds), and a lock would have to cover every CUDA call of every
thread, present and future. What ``thread_local`` does not cover, and nothing here does:
another thread queuing work on the capturing stream, which ROSE never does (all device
work runs in the engine's one thread, on its current stream).

Graphs share one memory pool (`CudaCaptureBackend`). That is valid because replays run
one at a time on one stream, and a replay's outputs are consumed on that stream before the
next replay (`Engine.step` queues the copy to the host right away), while each slot keeps
its output tensors referenced, so no later capture is handed their memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rose.errors import EngineError

__all__ = [
    "CaptureBackend",
    "CudaCaptureBackend",
    "GraphKey",
    "GraphManager",
    "RecordingCaptureBackend",
    "graph_key",
    "row_bucket",
    "token_bucket",
]

GraphKey = tuple[int, int]
SlotT = TypeVar("SlotT")

TOKEN_STEP_SMALL = 64
TOKEN_STEP_LARGE = 256
TOKEN_SMALL_LIMIT = 1024


def token_bucket(tokens: int) -> int:
    """Multiples of 64 up to 1024, then multiples of 256."""
    if tokens < 1:
        raise EngineError(f"token_bucket: need at least one token, got {tokens}")
    step = TOKEN_STEP_SMALL if tokens <= TOKEN_SMALL_LIMIT else TOKEN_STEP_LARGE
    return -(-tokens // step) * step


def row_bucket(rows: int) -> int:
    """The next power of two."""
    if rows < 1:
        raise EngineError(f"row_bucket: need at least one row, got {rows}")
    return 1 << (rows - 1).bit_length()


def graph_key(rows: int, tokens: int) -> GraphKey:
    return (row_bucket(rows), token_bucket(tokens))


class CaptureBackend(ABC):
    """How a pass is warmed up, captured and replayed."""

    @abstractmethod
    def warmup(self, key: GraphKey, run: Callable[[], None]) -> None:
        """Run the pass eagerly once."""

    @abstractmethod
    def capture(self, key: GraphKey, run: Callable[[], None]) -> Any:
        """Record the pass; return a handle `replay` accepts. Need not execute it."""

    @abstractmethod
    def replay(self, key: GraphKey, handle: Any) -> None:
        """Execute a captured pass on whatever the static buffers now hold."""

    def release(self, key: GraphKey, handle: Any) -> None:  # noqa: B027 (optional hook)
        """Free a captured pass."""


class RecordingCaptureBackend(CaptureBackend):
    """Runs every pass eagerly and records ("warmup" | "capture" | "replay" | "release", key)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, GraphKey]] = []

    def warmup(self, key: GraphKey, run: Callable[[], None]) -> None:
        self.events.append(("warmup", key))
        run()

    def capture(self, key: GraphKey, run: Callable[[], None]) -> Any:
        self.events.append(("capture", key))
        return run

    def replay(self, key: GraphKey, handle: Any) -> None:
        self.events.append(("replay", key))
        handle()

    def release(self, key: GraphKey, handle: Any) -> None:
        self.events.append(("release", key))


class CudaCaptureBackend(CaptureBackend):
    """torch.cuda graphs sharing one memory pool, captured in ``"thread_local"`` error mode
    (the module doc says why both are sound).

    cuda: the ``torch.cuda`` namespace (a recorder standing in for it in CPU tests)."""

    capture_error_mode = "thread_local"

    def __init__(self, cuda: Any = None) -> None:
        self._cuda = torch.cuda if cuda is None else cuda
        self._pool = self._cuda.graph_pool_handle()

    def warmup(self, key: GraphKey, run: Callable[[], None]) -> None:
        # Warm up on a side stream, as torch's graph capture recommends.
        cuda = self._cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            run()
        cuda.current_stream().wait_stream(side)

    def capture(self, key: GraphKey, run: Callable[[], None]) -> Any:
        graph = self._cuda.CUDAGraph()
        with self._cuda.graph(graph, pool=self._pool, capture_error_mode=self.capture_error_mode):
            run()
        return graph

    def replay(self, key: GraphKey, handle: Any) -> None:
        handle.replay()

    def release(self, key: GraphKey, handle: Any) -> None:
        handle.reset()


class _Entry(Generic[SlotT]):
    __slots__ = ("handle", "slot")

    def __init__(self, slot: SlotT) -> None:
        self.slot = slot
        self.handle: Any = None  # None until captured


class GraphManager(Generic[SlotT]):
    """The warm-up / capture / replay decisions and the LRU of slots.

    `run(key, make_slot, fill, forward)`: find or make the key's slot (evicting the least
    recently used beyond `max_graphs`), `fill(slot)` its static inputs, then warm up, capture
    and replay, or replay `forward(slot)`. Returns the slot, whose outputs `forward` updated.
    """

    def __init__(
        self,
        backend: CaptureBackend,
        max_graphs: int,
        on_evict: Callable[[GraphKey, SlotT], None] | None = None,
    ) -> None:
        if max_graphs < 1:
            raise EngineError(f"max_graphs must be >= 1, got {max_graphs}")
        self._backend = backend
        self._max = max_graphs
        self._on_evict = on_evict
        self._entries: OrderedDict[GraphKey, _Entry[SlotT]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[GraphKey]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def captured(self, key: GraphKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.handle is not None

    def run(
        self,
        key: GraphKey,
        make_slot: Callable[[], SlotT],
        fill: Callable[[SlotT], None],
        forward: Callable[[SlotT], None],
    ) -> SlotT:
        entry = self._entries.get(key)
        if entry is None:
            while len(self._entries) >= self._max:
                self._evict()
            entry = _Entry(make_slot())
            self._entries[key] = entry
            fill(entry.slot)
            self._backend.warmup(key, lambda: forward(entry.slot))
            return entry.slot
        self._entries.move_to_end(key)
        fill(entry.slot)
        if entry.handle is None:
            entry.handle = self._backend.capture(key, lambda: forward(entry.slot))
        self._backend.replay(key, entry.handle)
        return entry.slot

    def clear(self) -> None:
        while self._entries:
            self._evict()

    def _evict(self) -> None:
        key, entry = self._entries.popitem(last=False)
        if entry.handle is not None:
            self._backend.release(key, entry.handle)
        if self._on_evict is not None:
            self._on_evict(key, entry.slot)
