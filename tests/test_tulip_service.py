"""The gRPC service before its model is attached: every RPC is UNAVAILABLE, and counted.

Runs a real `grpc.aio` server on a loopback port in this process (no engine needed: the
point is the state before loading finishes). Served behaviour is in test_tulip_server.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from tulip.client import TulipClient, embed_request
from tulip.metrics import Metrics
from tulip.service import InferenceService


def test_rpcs_are_unavailable_until_the_model_is_attached() -> None:
    metrics = Metrics()

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceService(metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with TulipClient(f"127.0.0.1:{port}") as client:
                for call in (
                    client.stub.Embed(embed_request([[0, 2]]), timeout=30),
                    client.stub.Score(pb.ScoreRequest(), timeout=30),
                    client.stub.Info(pb.InfoRequest(), timeout=30),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "still loading" in (caught.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(main())
    for method in ("Embed", "Score", "Info"):
        labels = {"method": method, "status": "UNAVAILABLE"}
        assert metrics.registry.get_sample_value("tulip_requests_total", labels) == 1
