"""The `trellis.v1.Inference` gRPC service: validate, queue, await, pack.

Embed and Score go through the batching `Scheduler` to an encoder backend; Generate
streams from a `Generator` (`tulip.generation.GenerationBackend`). A process serves one
model, so exactly one of the two is attached; the other RPCs answer INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import numpy as np

from protos import tracing
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from protos.wire import pack_tensor
from tulip.calls import serve_calls
from tulip.errors import InvalidInput, NotReady, TulipError, status_code
from tulip.inputs import GenerateWork, ModelLimits, embed_work, generate_work, score_work
from tulip.metrics import Metrics
from tulip.scheduler import Ragged, Scheduler

__all__ = ["GenerationStreamLike", "Generator", "InferenceService", "Model", "ServedModel"]

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


class GenerationStreamLike(Protocol):
    """One request's responses; `close` aborts it when it has not finished."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]: ...

    def close(self) -> None: ...


class Generator(Protocol):
    """A served decoder as the service sees it (implemented by `GenerationBackend`)."""

    @property
    def served(self) -> ServedModel: ...

    def submit(self, work: GenerateWork) -> GenerationStreamLike: ...


class InferenceService(pb_grpc.InferenceServicer):
    """Answers Embed/Score/Info/Generate; until a model is attached every call is
    UNAVAILABLE."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._model: Model | None = None
        self._scheduler: Scheduler | None = None
        self._generator: Generator | None = None

    def attach(self, model: Model, scheduler: Scheduler) -> None:
        """Start serving `model` through `scheduler` (after loading and warm-up)."""
        self._model = model
        self._scheduler = scheduler

    def attach_generator(self, generator: Generator) -> None:
        """Start serving a decoder: Generate streams, Embed/Score are INVALID_ARGUMENT."""
        self._generator = generator

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await self._answer(
            "Embed",
            context,
            lambda: self.embed(request, _deadline(context), traceparent=_traceparent(context)),
        )

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        return await self._answer(
            "Score",
            context,
            lambda: self.score(request, _deadline(context), traceparent=_traceparent(context)),
        )

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        async def info() -> pb.InfoResponse:
            if self._generator is not None:
                return self._generator.served.info
            return self._ready()[0].served.info

        return await self._answer("Info", context, info)

    async def Calls(
        self, requests: AsyncIterator[pb.CallRequest], context: grpc.aio.ServicerContext
    ) -> None:
        await serve_calls(self, requests, context, self._metrics)

    async def embed(
        self,
        request: pb.EmbedRequest,
        deadline: float | None,
        admitted: bool = False,
        traceparent: str = "",
    ) -> pb.EmbedResponse:
        """One Embed call's answer (`deadline`: a `time.monotonic()` instant or None;
        `admitted`: part of work already admitted, see `Scheduler.submit`; `traceparent`:
        the caller's span, see `protos.tracing`); failures raise `TulipError`."""
        model, scheduler = self._ready()
        work, options = embed_work(request, model.served.limits)
        result = await scheduler.submit(work, deadline, admitted=admitted)
        _record_spans(traceparent, result.queue_us, result.inference_us, work.tokens)
        response = pb.EmbedResponse(
            prompt_tokens=work.tokens,
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us),
        )
        if "dense" in options.outputs:
            rows = model.shape_embeddings(result.rows, options.dimensions, options.normalize)
            response.embeddings.CopyFrom(pack_tensor(rows, options.dtype))
        extras = result.extras
        if "sparse" in extras:
            _pack_sparse(response.sparse, extras["sparse"])
        if "multi_vector" in extras:
            _pack_vectors(response.multi_vectors, extras["multi_vector"], options.dtype)
        if "token_states" in extras:
            _pack_vectors(response.token_states, extras["token_states"], options.dtype)
        return response

    async def score(
        self,
        request: pb.ScoreRequest,
        deadline: float | None,
        admitted: bool = False,
        traceparent: str = "",
    ) -> pb.ScoreResponse:
        """One Score call's answer; failures raise `TulipError`."""
        model, scheduler = self._ready()
        work, activation = score_work(request, model.served.limits)
        result = await scheduler.submit(work, deadline, admitted=admitted)
        _record_spans(traceparent, result.queue_us, result.inference_us, work.tokens)
        scores = model.activate(result.rows, activation)
        return pb.ScoreResponse(
            scores=pack_tensor(scores, pb.DTYPE_FLOAT32),
            prompt_tokens=work.tokens,
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us),
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        method = "Generate"
        stream: GenerationStreamLike | None = None
        try:
            generator = self._generator_ready()
            with tracing.server_span("generate", _traceparent(context)):
                stream = generator.submit(generate_work(request, generator.served.limits))
                async for response in stream:
                    yield response
        except TulipError as error:
            code = status_code(error)
            self._metrics.requests.labels(method=method, status=code.name).inc()
            await context.abort(code, str(error))
            raise AssertionError("unreachable: abort raises") from error
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.requests.labels(method=method, status="CANCELLED").inc()
            raise
        except Exception:
            self._metrics.requests.labels(method=method, status="UNKNOWN").inc()
            raise
        finally:
            if stream is not None:
                stream.close()  # aborts the sequence unless it finished
        self._metrics.requests.labels(method=method, status="OK").inc()

    def _ready(self) -> tuple[Model, Scheduler]:
        if self._model is None or self._scheduler is None:
            if self._generator is not None:
                raise InvalidInput(
                    f"{self._generator.served.name} is a generator model: it answers "
                    "Generate and Info, not Embed or Score"
                )
            raise NotReady("model is still loading; retry shortly")
        return self._model, self._scheduler

    def _generator_ready(self) -> Generator:
        if self._generator is None:
            if self._model is not None:
                raise InvalidInput(
                    f"Generate needs a generator model; {self._model.served.name} is a "
                    f"{self._model.served.limits.kind} model"
                )
            raise NotReady("model is still loading; retry shortly")
        return self._generator

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


def _pack_sparse(out: pb.SparseVectors, sparse: Ragged) -> None:
    assert sparse.indices is not None
    out.indices = np.ascontiguousarray(sparse.indices, dtype="<u4").tobytes()
    out.values = np.ascontiguousarray(sparse.values, dtype="<f4").tobytes()
    out.counts.extend(int(c) for c in sparse.counts)


def _pack_vectors(out: pb.TokenVectors, vectors: Ragged, dtype: int) -> None:
    out.vectors.CopyFrom(pack_tensor(vectors.values, dtype))
    out.counts.extend(int(c) for c in vectors.counts)


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    if not tracing.enabled():
        return ""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return str(value)
    return ""


def _record_spans(traceparent: str, queue_us: int, inference_us: int, tokens: int) -> None:
    """The request's ``queue`` and ``inference`` spans, ending now, under the caller's."""
    if not traceparent or not tracing.enabled():
        return
    end = time.time_ns()
    start = end - inference_us * 1000
    tracing.record("queue", traceparent, start - queue_us * 1000, start)
    tracing.record("inference", traceparent, start, end, tokens=tokens)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
