"""A small typed client for Tulip (numpy + grpc + the generated stubs, nothing else).

Two layers, so a gateway can keep its own channel management:

* pure helpers that build requests and read responses (`embed_request`,
  `score_request`, `generate_request`, `read_embed`, `read_score`), built on `protos.wire`;
* `TulipClient`, an asyncio client over one `grpc.aio` channel.

Example::

    async with TulipClient("localhost:50051") as client:
        result = await client.embed([[0, 35378, 4, 2], [0, 9, 2]])
        result.embeddings  # float32 [2, 384]
        async for piece in client.generate([1, 9906], pb.SamplingOptions(max_tokens=8)):
            piece.token_ids, piece.text, piece.finish_reason  # last: finish_reason, usage
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.grpc_options import CLIENT_OPTIONS
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from protos.wire import pack_token_batch, unpack_tensor

__all__ = [
    "EmbedResult",
    "ScoreResult",
    "Tokens",
    "TulipClient",
    "embed_request",
    "generate_request",
    "read_embed",
    "read_score",
    "score_request",
]

Tokens = Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray]
"""Either a list of id lists, or (flat uint32 ids, lengths)."""

_POOLING = {
    None: pb.POOLING_DEFAULT,
    "mean": pb.POOLING_MEAN,
    "cls": pb.POOLING_CLS,
    "last": pb.POOLING_LAST_TOKEN,
}
_NORMALIZE = {None: pb.NORMALIZE_DEFAULT, True: pb.NORMALIZE_ON, False: pb.NORMALIZE_OFF}
_ACTIVATION = {
    "default": pb.ACTIVATION_DEFAULT,
    "none": pb.ACTIVATION_NONE,
    "sigmoid": pb.ACTIVATION_SIGMOID,
}
_DTYPE = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16}


@dataclass(frozen=True, eq=False)
class EmbedResult:
    embeddings: np.ndarray
    """float32 [inputs, dimensions] (float16 on the wire is widened)."""
    prompt_tokens: int
    queue_us: int
    inference_us: int


@dataclass(frozen=True, eq=False)
class ScoreResult:
    scores: np.ndarray
    """float32 [pairs, num_labels]."""
    prompt_tokens: int
    queue_us: int
    inference_us: int


def _token_batch(tokens: Tokens) -> pb.TokenBatch:
    if isinstance(tokens, tuple) and len(tokens) == 2 and isinstance(tokens[0], np.ndarray):
        return pack_token_batch(tokens[0], tokens[1])
    return pack_token_batch(tokens)  # type: ignore[arg-type]


def embed_request(
    tokens: Tokens,
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    dimensions: int = 0,
    dtype: str = "float32",
) -> pb.EmbedRequest:
    """An `EmbedRequest`; ``pooling`` is mean/cls/last or None for the model's default."""
    return pb.EmbedRequest(
        inputs=_token_batch(tokens),
        pooling=_POOLING[pooling],
        normalize=_NORMALIZE[normalize],
        dimensions=dimensions,
        dtype=_DTYPE[dtype],
    )


def score_request(
    pairs: Tokens,
    first_segment_lengths: Sequence[int] | np.ndarray | None = None,
    *,
    activation: str = "default",
) -> pb.ScoreRequest:
    """A `ScoreRequest` over whole pair sequences; ``activation`` is default/none/sigmoid."""
    first = [] if first_segment_lengths is None else [int(n) for n in first_segment_lengths]
    return pb.ScoreRequest(
        pairs=_token_batch(pairs),
        first_segment_lengths=first,
        activation=_ACTIVATION[activation],
    )


def generate_request(
    prompt_ids: Sequence[int] | np.ndarray, sampling: pb.SamplingOptions | None = None
) -> pb.GenerateRequest:
    """A `GenerateRequest`: the prompt's ids packed as little-endian uint32."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError("prompt_ids must be one sequence of token ids")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.uint32).max):
        raise ValueError("prompt_ids must fit in uint32")
    request = pb.GenerateRequest(prompt_ids=ids.astype("<u4").tobytes())
    if sampling is not None:
        request.sampling.CopyFrom(sampling)
    return request


def read_embed(response: pb.EmbedResponse) -> EmbedResult:
    return EmbedResult(
        embeddings=unpack_tensor(response.embeddings),
        prompt_tokens=response.prompt_tokens,
        queue_us=response.timing.queue_us,
        inference_us=response.timing.inference_us,
    )


def read_score(response: pb.ScoreResponse) -> ScoreResult:
    return ScoreResult(
        scores=unpack_tensor(response.scores),
        prompt_tokens=response.prompt_tokens,
        queue_us=response.timing.queue_us,
        inference_us=response.timing.inference_us,
    )


class TulipClient:
    """An asyncio client of one Tulip server; use it as ``async with``."""

    def __init__(self, target: str, *, channel: grpc.aio.Channel | None = None) -> None:
        self.target = target
        self._channel = channel or grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> TulipClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    @property
    def stub(self) -> pb_grpc.InferenceStub:
        """The raw stub, for calls that need per-call options this class does not cover."""
        return self._stub

    async def embed(
        self,
        tokens: Tokens,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int = 0,
        dtype: str = "float32",
        timeout: float | None = None,
    ) -> EmbedResult:
        request = embed_request(
            tokens, pooling=pooling, normalize=normalize, dimensions=dimensions, dtype=dtype
        )
        return read_embed(await self._stub.Embed(request, timeout=timeout))

    async def score(
        self,
        pairs: Tokens,
        first_segment_lengths: Sequence[int] | np.ndarray | None = None,
        *,
        activation: str = "default",
        timeout: float | None = None,
    ) -> ScoreResult:
        request = score_request(pairs, first_segment_lengths, activation=activation)
        return read_score(await self._stub.Score(request, timeout=timeout))

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: pb.SamplingOptions | None = None,
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the generation of one prompt: each message carries the new `token_ids`
        and `text`; the last one `finish_reason`, `usage` and `timing`. Leaving the loop
        early (or ``aclose()``) cancels the call, and the server frees the sequence.
        Failures raise `grpc.aio.AioRpcError` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).
        """
        call = self._stub.Generate(generate_request(prompt_ids, sampling), timeout=timeout)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def info(self, *, timeout: float | None = None) -> pb.InfoResponse:
        return await self._stub.Info(pb.InfoRequest(), timeout=timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health status name (SERVING, NOT_SERVING, ...) of `service` ("" = server)."""
        response = await self._health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
