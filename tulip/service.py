"""The `trellis.v1.Inference` gRPC service: validate, queue, await, pack."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import numpy as np

from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from protos.wire import pack_tensor
from tulip.errors import NotReady, TulipError, status_code
from tulip.inputs import ModelLimits, embed_work, score_work
from tulip.metrics import Metrics
from tulip.scheduler import Scheduler

__all__ = ["InferenceService", "Model", "ServedModel"]

_Response = TypeVar("_Response")


@dataclass(frozen=True)
class ServedModel:
    """What the server says about its model, and the limits requests are checked against."""

    name: str
    limits: ModelLimits
    info: pb.InfoResponse


class Model(Protocol):
    """The served model as the service sees it (implemented by `RoseBackend`)."""

    @property
    def served(self) -> ServedModel: ...

    def shape_embeddings(
        self, rows: np.ndarray, dimensions: int, normalize: bool
    ) -> np.ndarray: ...

    def activate(self, logits: np.ndarray, activation: str) -> np.ndarray: ...


class InferenceService(pb_grpc.InferenceServicer):
    """Answers Embed/Score/Info; until `attach` is called every call is UNAVAILABLE."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._model: Model | None = None
        self._scheduler: Scheduler | None = None

    def attach(self, model: Model, scheduler: Scheduler) -> None:
        """Start serving `model` through `scheduler` (after loading and warm-up)."""
        self._model = model
        self._scheduler = scheduler

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await self._answer("Embed", context, lambda: self._embed(request, context))

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        return await self._answer("Score", context, lambda: self._score(request, context))

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        async def info() -> pb.InfoResponse:
            return self._ready()[0].served.info

        return await self._answer("Info", context, info)

    async def _embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        model, scheduler = self._ready()
        work, options = embed_work(request, model.served.limits)
        result = await scheduler.submit(work, _deadline(context))
        rows = model.shape_embeddings(result.rows, options.dimensions, options.normalize)
        return pb.EmbedResponse(
            embeddings=pack_tensor(rows, options.dtype),
            prompt_tokens=work.tokens,
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us),
        )

    async def _score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        model, scheduler = self._ready()
        work, activation = score_work(request, model.served.limits)
        result = await scheduler.submit(work, _deadline(context))
        scores = model.activate(result.rows, activation)
        return pb.ScoreResponse(
            scores=pack_tensor(scores, pb.DTYPE_FLOAT32),
            prompt_tokens=work.tokens,
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us),
        )

    def _ready(self) -> tuple[Model, Scheduler]:
        if self._model is None or self._scheduler is None:
            raise NotReady("model is still loading; retry shortly")
        return self._model, self._scheduler

    async def _answer(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        handler: Callable[[], Awaitable[_Response]],
    ) -> _Response:
        try:
            response = await handler()
        except TulipError as error:
            code = status_code(error)
            self._metrics.requests.labels(method=method, status=code.name).inc()
            await context.abort(code, str(error))
            raise AssertionError("unreachable: abort raises") from error
        except asyncio.CancelledError:
            self._metrics.requests.labels(method=method, status="CANCELLED").inc()
            raise
        except Exception:
            self._metrics.requests.labels(method=method, status="UNKNOWN").inc()
            raise
        self._metrics.requests.labels(method=method, status="OK").inc()
        return response


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
