"""`LazyTensor`: a result that may still be on its way from the device.

`StepOutputs` is what `Engine.step_outputs` returns: the dense rows as a `LazyTensor` and,
for rows that asked for more (`rose.heads`), `RaggedRows` already on the host (they need
data-dependent shapes, so they are complete when the step returns).

On CUDA the engine enqueues a non-blocking copy into pinned host memory and records an
event after it; `ready()` polls the event, `wait()` blocks on it and `await` waits without
blocking the event loop. On CPU the result is complete when `step` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["LazyTensor", "RaggedRows", "StepOutputs"]


class LazyTensor:
    """A [B, N] float32 CPU tensor that is complete once `event` (if any) has completed."""

    __slots__ = ("_event", "_host")

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self._host = host
        self._event = event

    @classmethod
    def from_device(cls, result: torch.Tensor) -> LazyTensor:
        """Start copying `result` to the host; on CPU, wrap it as it is."""
        if result.device.type != "cuda":
            host = result.to(torch.float32)
            # Results made under inference_mode refuse in-place edits later; hand out a
            # normal tensor ([B, N] is small).
            return cls(host.clone() if host.is_inference() else host)
        host = torch.empty(result.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(result, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._host.shape)

    def ready(self) -> bool:
        """True when `wait()` would not block."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> torch.Tensor:
        """Block until the result is on the host and return it ([B, N] float32, CPU)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def numpy(self) -> np.ndarray:
        return self.wait().numpy()

    async def _wait_async(self) -> torch.Tensor:
        if not self.ready():
            assert self._event is not None
            await asyncio.get_running_loop().run_in_executor(None, self._event.synchronize)
        return self.wait()

    def __await__(self) -> Generator[Any, None, torch.Tensor]:
        return self._wait_async().__await__()

    def __repr__(self) -> str:
        state = "ready" if self.ready() else "pending"
        return f"LazyTensor(shape={self.shape}, {state})"


@dataclass(frozen=True, eq=False)
class RaggedRows:
    """Per-row variable-length results on the host.

    counts: [B] int64 entries of each row (rows that did not ask have 0);
    values: [N, D] float32 vectors, or [N] float32 sparse weights (N = counts.sum());
    indices: [N] int64 token ids of sparse weights (ascending within a row), else None.
    """

    counts: np.ndarray
    values: np.ndarray
    indices: np.ndarray | None = None

    def row(self, i: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(indices or None, values) of row `i`."""
        start = int(self.counts[:i].sum())
        stop = start + int(self.counts[i])
        ids = None if self.indices is None else self.indices[start:stop]
        return ids, self.values[start:stop]


@dataclass(frozen=True, eq=False)
class StepOutputs:
    """One pass's results: ``dense`` [B, D] (or [S, D] with spans, [B, labels] logits for
    cross-encoders) and the extra kinds some rows asked for (None: no row asked)."""

    dense: LazyTensor
    sparse: RaggedRows | None = None
    multi_vector: RaggedRows | None = None
    token_states: RaggedRows | None = None

    def extras(self) -> dict[str, RaggedRows]:
        """The extra kinds present, by name ("sparse", "multi_vector", "token_states")."""
        found = {
            "sparse": self.sparse,
            "multi_vector": self.multi_vector,
            "token_states": self.token_states,
        }
        return {k: v for k, v in found.items() if v is not None}
