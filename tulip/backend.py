"""The ROSE engine behind Tulip's scheduler: loading, warm-up, batches and post-processing.

`Engine.step` returns at once on CUDA but computes the whole batch before returning on
the CPU, so every step runs on one dedicated engine thread: the event loop never blocks
(admission, cancellation and health keep answering while a batch computes), and steps
still reach the engine in order, one after the other.

`rose` (and torch) are imported only when a model is loaded, so the rest of the package
stays importable and testable without them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protos.trellis.v1 import inference_pb2 as pb
from tulip.config import TulipConfig
from tulip.inputs import OUTPUT_NAMES, ModelLimits
from tulip.scheduler import BatchInputs, BatchOutputs, Ragged
from tulip.service import ServedModel

if TYPE_CHECKING:
    from rose.hub import ResolvedModel

__all__ = ["RoseBackend", "resolve_model_dir"]

_KINDS = {
    "embedding": pb.MODEL_KIND_EMBEDDING,
    "cross-encoder": pb.MODEL_KIND_CROSS_ENCODER,
    "generator": pb.MODEL_KIND_GENERATOR,
}
_POOLINGS = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS, "last": pb.POOLING_LAST_TOKEN}
_OUTPUTS = {name: value for value, name in OUTPUT_NAMES.items()}
_WARMUP_TOKENS = 16
_CPU_BATCH_TOKENS = 2048
_GPU_BATCH_TOKENS = 16384


def resolve_model_dir(model: str) -> Path:
    """The model directory of a spec (directory, asset name or Hub id): `rose.hub`'s."""
    from rose.hub import resolve_model

    return resolve_model(model).path


class RoseBackend:
    """One loaded ROSE engine, as the scheduler and the service use it."""

    def __init__(self, engine: Any, model_name: str, token_types: int = 2) -> None:
        self._engine = engine
        info = engine.info
        outputs = tuple(getattr(info, "outputs", ("dense",)) or ())
        self.served = ServedModel(
            name=model_name,
            limits=ModelLimits(
                kind=str(info.kind),
                vocab_size=int(info.vocab_size),
                max_input_tokens=int(info.max_input_tokens),
                dimensions=int(info.dimensions or 0),
                default_normalize=bool(info.default_normalize),
                token_types=token_types,
                outputs=frozenset(outputs) if info.kind == "embedding" else frozenset(),
            ),
            info=pb.InfoResponse(
                model_name=model_name,
                kind=_KINDS.get(str(info.kind), pb.MODEL_KIND_UNSPECIFIED),
                dimensions=int(info.dimensions or 0),
                max_input_tokens=int(info.max_input_tokens),
                vocab_size=int(info.vocab_size),
                num_labels=int(info.num_labels or 0),
                default_pooling=_POOLINGS.get(str(info.default_pooling), pb.POOLING_DEFAULT),
                default_normalize=bool(info.default_normalize),
                query_prompt=info.query_prompt or "",
                document_prompt=info.document_prompt or "",
                device=str(info.device),
                dtype=str(info.dtype).removeprefix("torch."),
                outputs=[_OUTPUTS[o] for o in outputs if o in _OUTPUTS]
                if info.kind == "embedding"
                else [],
            ),
        )
        self._num_labels = int(info.num_labels or 0)
        self._on_cpu = str(info.device) == "cpu"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tulip-engine")

    @classmethod
    def load(cls, config: TulipConfig, model: ResolvedModel | None = None) -> RoseBackend:
        """Load and return the engine for `config` (blocking; run it in a thread); resolves
        `config.model` unless `model` is that resolution already."""
        import torch

        from rose import Engine, EngineConfig
        from rose.hub import resolve_model

        if config.threads is not None:
            torch.set_num_threads(config.threads)
        model = model or resolve_model(config.model)
        model_dir = model.path
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = Engine.load(
            model_dir,
            EngineConfig(
                device=device,
                dtype=None if config.dtype == "auto" else config.dtype,
                quantize=None if config.quantize == "none" else config.quantize,
                cuda_graphs=config.cuda_graphs,
                max_graphs=64,
                attention_mode=config.attention_mode,
            ),
        )
        return cls(engine, config.model_name or model.name, engine.info.token_types)

    @property
    def default_batch_tokens(self) -> int:
        """The batch token budget when none is configured: a GPU gains throughput up to
        large batches; a CPU is saturated by a few hundred tokens, so larger batches only
        make small requests wait for big neighbours."""
        return _CPU_BATCH_TOKENS if self._on_cpu else _GPU_BATCH_TOKENS

    # -- the scheduler's Backend protocol ------------------------------------------------

    def step(self, batch: BatchInputs) -> Awaitable[np.ndarray | BatchOutputs]:
        """Queue `batch` on the engine thread now; the awaitable yields its result rows."""
        submitted = self._thread.submit(self._step, batch)
        if self._on_cpu:
            return asyncio.wrap_future(submitted)  # already numpy rows: nothing to await
        return _rows(submitted)

    def _step(self, batch: BatchInputs) -> Any:
        from rose import RaggedBatch

        ragged = RaggedBatch.from_packed(
            batch.ids,
            batch.lengths,
            first_segment_lengths=batch.first_segment_lengths,
            pooling=batch.pooling,
            normalize=batch.normalize,
            span_counts=batch.span_counts,
            spans=batch.spans,
            kinds=batch.kinds,
        )
        if batch.kinds is not None:
            # Extra kinds are on the host when step_outputs returns (eager, data-dependent
            # shapes); only the dense rows may still be on their way.
            found = self._engine.step_outputs(ragged)
            extras = {
                kind: Ragged(rows.counts, rows.values, rows.indices)
                for kind, rows in found.extras().items()
            }
            return BatchOutputs(found.dense.numpy(), extras)
        result = self._engine.step(ragged)
        # On the CPU the rows are final when `step` returns: hand the event loop plain
        # numpy rows (one wake-up, no await of the LazyTensor there). On CUDA the result
        # stays lazy so this thread can queue the next batch while the copy completes.
        return result.numpy() if result.ready() else result

    def close(self) -> None:
        """Stop the engine thread once the steps already queued have run."""
        self._thread.shutdown(wait=False)

    async def warm_up(self) -> None:
        """Run one small batch through the engine so the first request pays no set-up."""
        await self.timed_batch(2, _WARMUP_TOKENS)

    async def timed_batch(self, rows: int, length: int) -> tuple[int, float]:
        """Run `rows` synthetic inputs of `length` tokens (at most the model's limit) and
        return (tokens, seconds): the warm-up, and the speed the scheduler admits by."""
        limits = self.served.limits
        length = max(1, min(length, limits.max_input_tokens))
        ids = (np.arange(rows * length, dtype=np.int64) % limits.vocab_size).astype(np.uint32)
        lengths = np.full(rows, length, dtype=np.uint32)
        # Pairs as `score_work` admits them: a model with one token type (XLM-R
        # cross-encoders such as bge-reranker) gets no segments, i.e. type 0 throughout.
        pairs = limits.kind == "cross-encoder" and limits.token_types > 1
        first = lengths // 2 if pairs else None
        batch = BatchInputs(
            ids=ids, lengths=lengths, first_segment_lengths=first, pooling=None, normalize=None
        )
        start = time.monotonic()
        await self.step(batch)
        return int(ids.size), time.monotonic() - start

    # -- post-processing -----------------------------------------------------------------

    def shape_embeddings(self, rows: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
        """Matryoshka truncation (then renormalization when normalizing) of pooled rows."""
        if dimensions >= rows.shape[1]:
            return rows
        from rose.pooling import truncate_dimensions

        return truncate_dimensions(rows, dimensions, normalize)

    def activate(self, logits: np.ndarray, activation: str) -> np.ndarray:
        """Scores from raw logits ("default": sigmoid for one label, none otherwise)."""
        from rose.pooling import apply_activation

        return apply_activation(logits, activation, self._num_labels)


async def _rows(step: Future[Any]) -> np.ndarray | BatchOutputs:
    result = await asyncio.wrap_future(step)
    if isinstance(result, (np.ndarray, BatchOutputs)):
        return result
    tensor = await result
    return tensor.numpy()
