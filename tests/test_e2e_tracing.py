"""End to end: OpenTelemetry traces from `trellis up`'s real processes (Ivy and two Tulips)
to a loopback OTLP collector, configured only by the standard ``OTEL_*`` variables.

One client request with a W3C ``traceparent`` must come back as one trace: Ivy's server
span under the client's span, its ``tokenize`` and ``inference`` children, and the Tulip
replica's ``queue`` and ``inference`` spans under Ivy's inference span.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from up_cluster import UpCluster, start_up, stop_up

MODEL = "multilingual-e5-small"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC trace receiver: keeps (service, span) of every export."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(  # noqa: N802 - the gRPC method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(collector: tuple[Collector, int]) -> Iterator[UpCluster]:
    from rose.assets import ensure_model

    _, port = collector
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    c = start_up(Path(ensure_model(MODEL)), env=env)
    yield c
    assert stop_up(c) == 0, "".join(c.output[-40:])


def test_one_request_is_one_trace_across_ivy_and_tulip(
    cluster: UpCluster, collector: tuple[Collector, int]
) -> None:
    received, _ = collector
    r = httpx.post(
        f"{cluster.base_url}/v1/embeddings",
        json={"model": cluster.name, "input": ["a traced request", "and its neighbour"]},
        headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = received.of_trace(TRACE_ID)
        if sum(svc == "tulip" for svc, _ in spans) >= 2 and len(spans) >= 5:
            break
        time.sleep(0.2)
    spans = received.of_trace(TRACE_ID)
    named = {(svc, s.name): s for svc, s in spans}
    assert set(named) == {
        ("ivy", "POST /v1/embeddings"),
        ("ivy", "tokenize"),
        ("ivy", "inference"),
        ("tulip", "queue"),
        ("tulip", "inference"),
    }, sorted(named)
    server = named[("ivy", "POST /v1/embeddings")]
    assert server.parent_span_id.hex() == CLIENT_SPAN
    for child in ("tokenize", "inference"):
        assert named[("ivy", child)].parent_span_id == server.span_id
    ivy_inference = named[("ivy", "inference")]
    for child in ("queue", "inference"):
        span = named[("tulip", child)]
        assert span.parent_span_id == ivy_inference.span_id
        # The replica's time lies within Ivy's inference span.
        assert ivy_inference.start_time_unix_nano <= span.start_time_unix_nano
        assert span.end_time_unix_nano <= ivy_inference.end_time_unix_nano + 5_000_000
    queue, work = named[("tulip", "queue")], named[("tulip", "inference")]
    assert queue.end_time_unix_nano == work.start_time_unix_nano
